//! A lane of work on one CUDA device (feature `cuda`): a stream of its own, a cuBLAS handle
//! bound to it and the handle's workspace, and the launches, copies and GEMMs queued on them.
//!
//! Why one per trainer and not one per device: two trainers on one shared stream would
//! interleave their launches, and one's synchronisation or capture would catch the other's
//! work. Why not one per engine: a lane costs about 100 MiB of device memory on an H200 (the
//! cuBLAS handle's own allocations and the workspace, measured by the GPU self-check), and a
//! trainer builds inference engines beside its training engine; those share the trainer's
//! lane and take turns a whole step at a time (`memwise_runtime`'s `DeviceTurn`), whatever
//! thread drives them. The compiled kernels stay the device's, shared. Every raw driver call
//! binds the device's context to the calling thread first, since an engine may be driven from
//! any thread.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, CudaEvent, CudaStream, PinnedHostSlice};

use super::device::{alloc_raw, err, CudaDevice, DeviceBuffer, DeviceResult};
use super::launch::{Float, KernelCall};
use crate::cublas_map::{CublasGemm, GemmBuffers, Operand};

/// cuBLAS workspace set on each lane's handle (NVIDIA's recommendation for Hopper), so
/// captured graphs never allocate.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// The storage types `[A, B, C]` of every GEMM the executors issue (the CUDA glue's f32,
/// 16-bit, and 16-bit operands accumulated into an f32 gradient). One small GEMM of each runs
/// when a lane opens: cuBLAS loads its kernels lazily, at the first GEMM of a type, and that
/// device memory then belongs to the lane (measured with it) instead of appearing after an
/// executor checked its plan against free memory.
const WARM_UP_GEMM_TYPES: [[Float; 3]; 5] = [
    [Float::F32, Float::F32, Float::F32],
    [Float::F16, Float::F16, Float::F16],
    [Float::F16, Float::F16, Float::F32],
    [Float::Bf16, Float::Bf16, Float::Bf16],
    [Float::Bf16, Float::Bf16, Float::F32],
];

/// Two page-locked (pinned) host buffers that a backend's input uploads alternate between:
/// a copy from pinned memory is a real asynchronous DMA at the link's full rate, where one
/// from pageable memory is staged through a driver buffer first. Each buffer's event marks
/// when the copies out of it have finished, so the buffer is refilled only after them: with
/// two, the batch of the next step may be written while the copies of this one are in flight.
pub struct PinnedStaging {
    buffers: [PinnedHostSlice<u8>; 2],
    copied: [CudaEvent; 2],
    next: usize,
}

impl PinnedStaging {
    /// Bytes each buffer holds: the most one staged upload may carry.
    pub fn capacity(&self) -> usize {
        self.buffers[0].len()
    }
}

/// A stream, a cuBLAS handle on it and its workspace, on one device.
pub struct Lane {
    // Drop order matters: the handle goes before the workspace it was given.
    blas: CudaBlas,
    _blas_workspace: DeviceBuffer,
    stream: Arc<CudaStream>,
    /// The stream device collectives (NCCL) run on beside `stream`, made at the first
    /// [`Lane::fork_collective`].
    collectives: std::sync::OnceLock<Arc<CudaStream>>,
    /// Device memory the lane took when it opened (the stream, the cuBLAS handle's own
    /// allocations and the workspace): about 100 MiB on an H200.
    device_bytes: u64,
    dev: Arc<CudaDevice>,
}

impl Lane {
    /// A new stream on `dev`, with its own cuBLAS handle and workspace.
    pub fn open(dev: Arc<CudaDevice>) -> DeviceResult<Lane> {
        dev.bind()?;
        let used = || dev.mem_get_info().map(|(free, total)| total - free).ok();
        let before = used();
        let stream = dev
            .context()
            .new_stream()
            .map_err(err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| format!("creating the cuBLAS handle: {e:?}"))?;
        let ws = alloc_raw(dev.context(), CUBLAS_WORKSPACE_BYTES)?;
        // SAFETY: the workspace outlives the handle (both owned by the lane; the handle drops
        // first).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), ws.ptr() as *mut c_void, ws.bytes())
                .result()
                .map_err(|e| format!("setting the cuBLAS workspace: {e:?}"))?
        };
        let mut lane = Lane {
            blas,
            _blas_workspace: ws,
            stream,
            collectives: std::sync::OnceLock::new(),
            device_bytes: CUBLAS_WORKSPACE_BYTES as u64,
            dev: dev.clone(),
        };
        lane.warm_up_gemms()?;
        if let (Some(b), Some(a)) = (before, used()) {
            lane.device_bytes = a.saturating_sub(b);
        }
        Ok(lane)
    }

    /// One 64×64×64 GEMM of each of [`WARM_UP_GEMM_TYPES`] on a scratch buffer freed after.
    fn warm_up_gemms(&self) -> DeviceResult<()> {
        const N: usize = 64;
        let matrix = (N * N * 4) as u64;
        let scratch = alloc_raw(self.dev.context(), 3 * matrix as usize)?;
        // SAFETY: the scratch buffer is 3 matrices of N×N f32 (each type fits), zeroed first.
        unsafe {
            self.memset(scratch.ptr(), scratch.bytes(), 0)?;
            for types in WARM_UP_GEMM_TYPES {
                let g = CublasGemm {
                    transa: false,
                    transb: false,
                    m: N,
                    n: N,
                    k: N,
                    alpha: 1.0,
                    beta: 0.0,
                    a: (Operand::X, 0),
                    lda: N,
                    stride_a: 0,
                    b: (Operand::W, 0),
                    ldb: N,
                    stride_b: 0,
                    c: (Operand::Y, 0),
                    ldc: N,
                    stride_c: 0,
                    batch: 1,
                };
                let (a, b, c) = (
                    scratch.ptr(),
                    scratch.ptr() + matrix,
                    scratch.ptr() + 2 * matrix,
                );
                self.gemm(&g, GemmBuffers { a, b, c, types })?;
            }
        }
        self.synchronize()
    }

    /// Device memory the lane took when it opened, measured (`cuMemGetInfo` before and
    /// after).
    pub fn device_bytes(&self) -> u64 {
        self.device_bytes
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The collective stream (a raw `CUstream`), made to wait for everything enqueued on the
    /// lane's stream so far: a collective enqueued on it sees finished values and runs
    /// while the lane's later launches do.
    pub fn fork_collective(&self) -> DeviceResult<u64> {
        self.dev.bind()?;
        let collectives = match self.collectives.get() {
            Some(s) => s,
            None => {
                let s = self
                    .dev
                    .context()
                    .new_stream()
                    .map_err(err("creating the collective stream"))?;
                self.collectives.get_or_init(|| s)
            }
        };
        collectives
            .join(&self.stream)
            .map_err(err("ordering the collective stream after the lane's"))?;
        Ok(collectives.cu_stream() as u64)
    }

    /// Makes the lane's stream wait for everything enqueued on the collective stream so far.
    pub fn join_collectives(&self) -> DeviceResult<()> {
        let Some(collectives) = self.collectives.get() else {
            return Ok(());
        };
        self.dev.bind()?;
        self.stream
            .join(collectives)
            .map_err(err("ordering the lane's stream after the collectives"))
    }

    /// One plain allocation of `bytes`, zeroed.
    pub fn alloc_zeroed(&self, bytes: usize) -> DeviceResult<DeviceBuffer> {
        let b = alloc_raw(self.dev.context(), bytes)?;
        if bytes > 0 {
            // SAFETY: b is a fresh allocation of `bytes`.
            unsafe { drv::memset_d8_async(b.ptr(), 0, bytes, self.stream.cu_stream()) }
                .map_err(err("cuMemsetD8"))?;
        }
        Ok(b)
    }

    /// Host → device copy of `src` to address `dst` (asynchronous on the stream; `src` must
    /// stay alive until the next [`Lane::synchronize`]).
    ///
    /// # Safety
    /// `dst` must be a device address with room for `src`.
    pub unsafe fn htod<T>(&self, src: &[T], dst: u64) -> DeviceResult<()> {
        self.dev.bind()?;
        drv::memcpy_htod_async(dst, src, self.stream.cu_stream()).map_err(err("cuMemcpyHtoDAsync"))
    }

    /// Two pinned host buffers of `bytes` each, for [`Lane::htod_staged`].
    pub fn pinned_staging(&self, bytes: usize) -> DeviceResult<PinnedStaging> {
        let ctx = self.dev.context();
        let buffer = || {
            // SAFETY: the bytes are written before any copy reads them (htod_staged).
            unsafe { ctx.alloc_pinned::<u8>(bytes.max(1)) }
                .map_err(err("allocating pinned host memory for the inputs"))
        };
        let event = || ctx.new_event(None).map_err(err("creating an event"));
        Ok(PinnedStaging {
            buffers: [buffer()?, buffer()?],
            copied: [event()?, event()?],
            next: 0,
        })
    }

    /// Host → device copies of `parts` (`(bytes, device address)`) through the next of the
    /// two pinned buffers of `staging`: waits until the copies that last read that buffer are
    /// done, packs the parts into it, queues one asynchronous copy per part and marks the
    /// buffer's event after them. The host slices may go as soon as this returns.
    ///
    /// # Safety
    /// Each address must have room for its part.
    pub unsafe fn htod_staged(
        &self,
        staging: &mut PinnedStaging,
        parts: &[(&[u8], u64)],
    ) -> DeviceResult<()> {
        let total: usize = parts.iter().map(|(b, _)| b.len()).sum();
        if total > staging.capacity() {
            return Err(format!(
                "{total} bytes of inputs for pinned buffers of {}",
                staging.capacity()
            ));
        }
        self.dev.bind()?;
        let k = staging.next;
        staging.next = 1 - k;
        staging.copied[k]
            .synchronize()
            .map_err(err("waiting for the previous upload"))?;
        let buffer = staging.buffers[k]
            .as_mut_slice()
            .map_err(err("the pinned input buffer"))?;
        let mut at = 0;
        for &(bytes, dst) in parts {
            let part = &mut buffer[at..at + bytes.len()];
            part.copy_from_slice(bytes);
            drv::memcpy_htod_async(dst, part, self.stream.cu_stream())
                .map_err(err("cuMemcpyHtoDAsync"))?;
            at += bytes.len();
        }
        staging.copied[k]
            .record(&self.stream)
            .map_err(err("recording the upload"))
    }

    /// Device → host copy into `dst` (waits for the stream first).
    ///
    /// # Safety
    /// `src` must be a device address holding `dst.len()` elements.
    pub unsafe fn dtoh<T>(&self, src: u64, dst: &mut [T]) -> DeviceResult<()> {
        self.dev.bind()?;
        drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
            .map_err(err("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Sets `bytes` bytes at `dst` to `value`, on the stream.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory.
    pub unsafe fn memset(&self, dst: u64, bytes: usize, value: u8) -> DeviceResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        drv::memset_d8_async(dst, value, bytes, self.stream.cu_stream())
            .map_err(err("cuMemsetD8Async"))
    }

    /// Waits for everything queued on the lane's stream.
    pub fn synchronize(&self) -> DeviceResult<()> {
        self.dev.bind()?;
        self.stream
            .synchronize()
            .map_err(err("synchronising the stream"))
    }

    /// Launches `call` on the stream.
    ///
    /// # Safety
    /// Every pointer argument must be a device address valid for what the kernel touches.
    pub unsafe fn launch(&self, call: &KernelCall) -> DeviceResult<()> {
        let f = self.dev.function(&call.name)?;
        self.dev.bind()?;
        let mut params = call.params();
        let g = call.cfg.grid;
        let b = call.cfg.block;
        drv::launch_kernel(
            f.cu_function(),
            (g[0], g[1], g[2]),
            (b[0], b[1], b[2]),
            0,
            self.stream.cu_stream(),
            &mut params,
        )
        .map_err(|e| format!("launching {}: {e:?}", call.name))
    }

    /// Runs one mapped GEMM on cuBLAS (`cublasGemmStridedBatchedEx`, or `cublasGemmEx` for a
    /// single item) with f32 accumulation, on the buffers `bufs` (element offsets are added
    /// here).
    ///
    /// # Safety
    /// The addresses must hold what [`CublasGemm::extents`] says the call touches.
    pub unsafe fn gemm(&self, g: &CublasGemm, bufs: GemmBuffers) -> DeviceResult<()> {
        g.validate()?;
        self.dev.bind()?;
        let GemmBuffers { a, b, c, types } = bufs;
        let [ta, tb, tc] = types;
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (g.alpha, g.beta);
        let pa = (a + (g.a.1 * ta.size()) as u64) as *const c_void;
        let pb = (b + (g.b.1 * tb.size()) as u64) as *const c_void;
        let pc = (c + (g.c.1 * tc.size()) as u64) as *mut c_void;
        let h = *self.blas.handle();
        let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let r = if g.batch == 1 {
            blas_result::gemm_ex(
                h,
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                pa,
                data_type(ta),
                g.lda as i32,
                pb,
                data_type(tb),
                g.ldb as i32,
                &beta as *const f32 as *const c_void,
                pc,
                data_type(tc),
                g.ldc as i32,
                compute,
                algo,
            )
        } else {
            blas_result::gemm_strided_batched_ex(
                h,
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                pa,
                data_type(ta),
                g.lda as i32,
                g.stride_a as i64,
                pb,
                data_type(tb),
                g.ldb as i32,
                g.stride_b as i64,
                &beta as *const f32 as *const c_void,
                pc,
                data_type(tc),
                g.ldc as i32,
                g.stride_c as i64,
                g.batch as i32,
                compute,
                algo,
            )
        };
        r.map_err(|e| {
            format!(
                "cuBLAS GEMM {}x{}x{} (batch {}): {e:?}",
                g.m, g.n, g.k, g.batch
            )
        })
    }
}

/// The element type of a GEMM operand.
fn data_type(f: Float) -> blas_sys::cudaDataType {
    match f {
        Float::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        Float::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        Float::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
    }
}
