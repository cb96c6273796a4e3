//! `Nccl`: the ranks of a data-parallel job on GPUs, one process per GPU launched by `mpirun`,
//! summing and gathering on device memory through NCCL (cudarc's `nccl` feature, loaded at
//! run time as the rest of the CUDA path), with MPI ([`Mpi`]) for everything else.
//!
//! * **Bootstrap.** Rank 0 makes NCCL's unique id and broadcasts it over MPI, then every rank
//!   joins the communicator (`ncclCommInitRank`): the same launch works across nodes, as
//!   PyTorch's `init_process_group("nccl")` over a TCP store. Before that, the ranks agree
//!   (an MPI sum of failure flags) that every one found NCCL and its device, so a rank that
//!   cannot start makes all of them fail with a message instead of leaving the others
//!   waiting in the communicator's set-up.
//! * **Device collectives** ([`DeviceCollective`]): `ncclAllReduce` (`ncclSum` on
//!   `ncclFloat32`, in place) for gradient buckets and `ncclBroadcast` of bytes for ZeRO's
//!   gathered shards (grouped: one `ncclGroupStart`/`ncclGroupEnd` per parameter), enqueued
//!   on the executor's own stream, so they are ordered with its kernels and the gradients
//!   never leave the GPU. Every rank ends a sum with the same bits: NCCL's ring and tree
//!   all-reduces compute each element once and send the result to every rank.
//! * **Host collectives** (loss and metric sums, the non-finite flag, broadcasts of host
//!   bytes, barriers): the [`Mpi`] this engine was built on.
//! * **Failures.** As with [`Mpi`]: a rank that dies makes `mpirun` end every other rank.
//!   NCCL's own errors come back as an `Err` naming the call and NCCL's message.
//!
//! NCCL's communicator takes device memory of its own (its channels' buffers), outside any
//! plan: it is measured when the communicator is made ([`Nccl::device_bytes`]), before any
//! executor compares its plan with the free memory, so that check already leaves it out.

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

use memwise_kernels::cuda::device::cudarc::nccl::{result, sys};
use memwise_kernels::cuda::device::CudaDevice;

use super::{check_peer, Collective, DeviceCollective, Mpi};
use crate::device::{Device, DeviceKind};
use crate::error::{Result, RuntimeError};

/// An NCCL communicator handle, destroyed when dropped.
struct Communicator(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `Nccl` only
// touches it while holding the mutex around it.
unsafe impl Send for Communicator {}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once, here.
        let _ = unsafe { result::comm_destroy(self.0) };
    }
}

/// This process's rank of a job launched by `mpirun`, one process per GPU, made by
/// [`Nccl::init`]: NCCL for device memory, MPI for the rest.
pub struct Nccl {
    // The communicator goes before the MPI it was set up over.
    comm: Mutex<Communicator>,
    device: Arc<CudaDevice>,
    device_bytes: u64,
    mpi: Mpi,
}

impl Nccl {
    /// Joins this rank of `mpi`'s job to an NCCL communicator on `device` (a CUDA device:
    /// with one process per GPU, the one [`Mpi::local_rank`] names). A collective call:
    /// every rank makes it.
    ///
    /// Fails with [`RuntimeError::Device`], on every rank alike, when a rank's device is not
    /// a CUDA one or NCCL's library is not there (cudarc loads `libnccl.so`: install NCCL's
    /// development package, or link `libnccl.so.2` as `libnccl.so` on `LD_LIBRARY_PATH`).
    pub fn init(mpi: Mpi, device: &Device) -> Result<Nccl> {
        let ready = open_for_nccl(device);
        let mut failed = [ready.is_err() as u8 as f64];
        mpi.all_reduce_sum_f64(&mut failed)?;
        let dev = match ready {
            Err(e) => return Err(e),
            Ok(_) if failed[0] > 0.0 => {
                return Err(RuntimeError::Device(format!(
                    "NCCL: {} of {} ranks could not start it (their own errors say why)",
                    failed[0],
                    mpi.size()
                )))
            }
            Ok(d) => d,
        };
        Nccl::join(mpi, dev)
    }

    /// Joins every rank of `mpi`'s job, each on its device `dev`, to one new communicator.
    fn join(mpi: Mpi, dev: Arc<CudaDevice>) -> Result<Nccl> {
        let mut id = [0u8; 128];
        if mpi.rank() == 0 {
            let made = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            for (b, c) in id.iter_mut().zip(made.internal) {
                *b = c as u8;
            }
        }
        mpi.broadcast(0, &mut id)?;
        let unique = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        bind(&dev)?;
        let free_before = dev.mem_get_info().map_err(RuntimeError::Device)?.0;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is written by the call; the id is the one every rank received.
        unsafe {
            result::comm_init_rank(&mut comm, mpi.size() as c_int, unique, mpi.rank() as c_int)
                .map_err(|e| nccl_error("ncclCommInitRank", e))?
        };
        let free_after = dev.mem_get_info().map_err(RuntimeError::Device)?.0;
        Ok(Nccl {
            comm: Mutex::new(Communicator(comm)),
            device: dev,
            device_bytes: free_before.saturating_sub(free_after),
            mpi,
        })
    }

    /// Device memory the communicator took when it was made (free memory before minus
    /// after): NCCL's own buffers, outside every plan.
    pub fn device_bytes(&self) -> u64 {
        self.device_bytes
    }

    /// The communicator, with the device's context current on this thread (NCCL enqueues
    /// on streams of that context).
    fn lock(&self) -> Result<MutexGuard<'_, Communicator>> {
        bind(&self.device)?;
        // A panic while holding the lock leaves no half-made call behind: NCCL returns
        // before the guard drops.
        Ok(self
            .comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

/// The CUDA device `device` names, opened, once NCCL's library is known to be there.
fn open_for_nccl(device: &Device) -> Result<Arc<CudaDevice>> {
    let DeviceKind::Cuda { ordinal, .. } = &device.kind else {
        return Err(RuntimeError::Device(format!(
            "NCCL sums on CUDA devices, and this rank's device is {}: use --device cuda",
            device.name()
        )));
    };
    // SAFETY: only tries to open the library; cudarc panics at the first call without it.
    if !unsafe { sys::is_culib_present() } {
        return Err(RuntimeError::Device(
            "NCCL: libnccl.so was not found (install NCCL's development package, or put a \
             link named libnccl.so to libnccl.so.2 on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    crate::cuda::device::open(*ordinal)
}

fn bind(device: &CudaDevice) -> Result<()> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| RuntimeError::Device(format!("binding the CUDA context for NCCL: {e:?}")))
}

fn nccl_error(call: &str, e: result::NcclError) -> RuntimeError {
    // SAFETY: NCCL returns a static, NUL-terminated string for every result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    RuntimeError::Device(format!("{call}: {} ({:?})", text.to_string_lossy(), e.0))
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn size(&self) -> usize {
        self.mpi.size()
    }

    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.mpi.all_reduce_sum_f32(values)
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.mpi.all_reduce_sum_f64(values)
    }

    fn broadcast(&self, root: usize, bytes: &mut [u8]) -> Result<()> {
        self.mpi.broadcast(root, bytes)
    }

    fn barrier(&self) -> Result<()> {
        self.mpi.barrier()
    }

    fn send(&self, to: usize, bytes: &[u8]) -> Result<()> {
        self.mpi.send(to, bytes)
    }

    fn recv(&self, from: usize, bytes: &mut [u8]) -> Result<()> {
        self.mpi.recv(from, bytes)
    }

    fn reserve_sends(&self, bytes: usize, messages: usize) -> Result<u64> {
        self.mpi.reserve_sends(bytes, messages)
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>> {
        // A group's own communicator, over its own MPI group (as `ncclCommSplit` would make).
        let group = self.mpi.split_group(color, key)?;
        Ok(Arc::new(Nccl::join(group, self.device.clone())?))
    }

    fn engine(&self) -> &'static str {
        "NCCL"
    }

    fn device(&self) -> Option<&dyn DeviceCollective> {
        Some(self)
    }

    fn scratch_bytes(&self, _largest: usize) -> u64 {
        // Gradients are summed in place on the device; the host sums carry a few scalars.
        0
    }
}

impl DeviceCollective for Nccl {
    unsafe fn all_reduce_sum_f32(&self, values: u64, n: usize, stream: u64) -> Result<()> {
        let comm = self.lock()?;
        result::all_reduce(
            values as *const c_void,
            values as *mut c_void,
            n,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            comm.0,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| nccl_error("ncclAllReduce", e))?;
        Ok(())
    }

    unsafe fn broadcast(&self, root: usize, at: u64, bytes: usize, stream: u64) -> Result<()> {
        let comm = self.lock()?;
        result::broadcast(
            at as *const c_void,
            at as *mut c_void,
            bytes,
            sys::ncclDataType_t::ncclUint8,
            root as c_int,
            comm.0,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| nccl_error("ncclBroadcast", e))?;
        Ok(())
    }

    unsafe fn send(&self, to: usize, at: u64, bytes: usize, stream: u64) -> Result<()> {
        check_peer("an NCCL send to", to, self.mpi.size())?;
        let comm = self.lock()?;
        result::send(
            at as *const c_void,
            bytes,
            sys::ncclDataType_t::ncclUint8,
            to as c_int,
            comm.0,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| nccl_error("ncclSend", e))?;
        Ok(())
    }

    unsafe fn recv(&self, from: usize, at: u64, bytes: usize, stream: u64) -> Result<()> {
        check_peer("an NCCL receive from", from, self.mpi.size())?;
        let comm = self.lock()?;
        result::recv(
            at as *mut c_void,
            bytes,
            sys::ncclDataType_t::ncclUint8,
            from as c_int,
            comm.0,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| nccl_error("ncclRecv", e))?;
        Ok(())
    }

    fn begin_group(&self) -> Result<()> {
        // ZeRO's gather: NCCL runs the ranks' broadcasts together, not one after another.
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
        Ok(())
    }

    fn end_group(&self) -> Result<()> {
        bind(&self.device)?;
        result::group_end().map_err(|e| nccl_error("ncclGroupEnd", e))?;
        Ok(())
    }

    fn ranks(&self) -> usize {
        self.mpi.size()
    }
}
