//! `Mpi`: the ranks of a data-parallel job as processes launched by `mpirun`, one
//! [`Collective`] per process over `MPI_COMM_WORLD` (the `mpi` crate, rsmpi, over Open MPI;
//! `scripts/install-mpi.sh` installs it, `scripts/ci-mpi.sh` checks it).
//!
//! * **Sums** are `MPI_Allreduce` with `MPI_SUM` on `MPI_FLOAT` / `MPI_DOUBLE`. The mpi crate
//!   has no in-place form (`MPI_IN_PLACE`) in its safe API, so each call copies the buffer into
//!   a send buffer kept in the `Mpi`, at most [`Mpi::CHUNK`] elements at a time: the extra
//!   memory is bounded (4 MiB in f32, 8 MiB in f64), never the size of a gradient bucket.
//!   Every rank ends with the same bits: the sum is element-wise and Open MPI's reductions
//!   either combine the same partial sums on every rank (recursive doubling: IEEE addition is
//!   commutative) or compute each element on one rank and send it to the others (ring,
//!   reduce-scatter + gather). `examples/mpi_check.rs` checks the bits across ranks.
//! * **Broadcast** is `MPI_Bcast` of bytes, in place; **barrier** is `MPI_Barrier`.
//! * **Failures.** `MPI_COMM_WORLD`'s error handler is MPI's default, `MPI_ERRORS_ARE_FATAL`:
//!   an MPI error (such as buffers of different lengths on different ranks, which the trait
//!   forbids) aborts the whole job instead of returning. With Open MPI, a rank that dies
//!   (a crash, a signal, or an exit before `MPI_Finalize`, whatever its status) makes `mpirun`
//!   kill every other rank and exit non-zero, so no rank hangs waiting in a collective for
//!   one that is gone: the job ends within seconds (`scripts/ci-mpi.sh` measures it), well
//!   under [`super::DEFAULT_TIMEOUT`], which `Threads` needs and this engine does not.
//!
//! Threading: MPI is initialised with `MPI_THREAD_SERIALIZED` — any thread may call MPI, but
//! never two at once — and [`Mpi::init`] fails unless the library provides at least that. The
//! trait is `Send + Sync`, so a rank may be driven from any thread (the trainer's, a worker's);
//! every MPI call is made while holding one `Mutex`, which is exactly the serialisation that
//! level asks of the caller. `MPI_THREAD_MULTIPLE` would only add locking inside Open MPI for
//! concurrency the lock forbids anyway. The state kept across calls is the mpi crate's
//! `Universe` (which is `Send`) and the send buffers; `MPI_COMM_WORLD`'s handle, a raw pointer
//! that is neither `Send` nor `Sync`, is made afresh under the lock for each call (it is a
//! constant: that costs nothing). A group split from the job ([`Mpi::split_group`]: the
//! replicas of one pipeline stage) keeps its communicator, marked `Send + Sync` by hand for
//! the same reason: it is only used, and freed, under the one lock every group shares.

use std::sync::{Arc, Mutex, MutexGuard};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Equivalence, Root, Source};
use mpi::Threading;

use super::{check_peer, Collective};
use crate::error::{Result, RuntimeError};

/// What is only touched while holding the lock.
struct Inner {
    /// MPI itself: dropping it calls `MPI_Finalize`.
    universe: Universe,
    /// The send buffers of the sums (the mpi crate has no in-place all-reduce).
    send_f32: Vec<f32>,
    send_f64: Vec<f64>,
    /// Sends go through the buffer attached for them (`MPI_Bsend`), once a pipeline stage
    /// has reserved it ([`Collective::reserve_sends`]): `buffered` bytes (0: not yet).
    buffered: usize,
}

/// This process's rank of a job launched by `mpirun` (`mpirun -n N program`): one per
/// process, made by [`Mpi::init`]. A program run without `mpirun` is a job of one rank.
///
/// Dropping it finalises MPI (`MPI_Finalize`), after which MPI cannot start again in this
/// process; drop it on the thread that called [`Mpi::init`] (normally the main thread), as the
/// MPI standard asks of `MPI_Finalize`, and only after the last collective of every rank's
/// handle. A process that exits without dropping it (`std::process::exit`, a panic that
/// aborts) counts as a dead rank: `mpirun` ends the job with a non-zero status.
pub struct Mpi {
    rank: usize,
    size: usize,
    /// Shared by every group split from the job: MPI is called by one thread at a time.
    inner: Arc<Mutex<Inner>>,
    /// The group's communicator, for a group [`Collective::split`] made; `None`:
    /// `MPI_COMM_WORLD`.
    group: Option<GroupComm>,
}

/// A communicator `MPI_Comm_split` made, freed (`MPI_Comm_free`) when dropped.
struct GroupComm(SimpleCommunicator);

// SAFETY: an MPI communicator handle may be used from any thread under
// `MPI_THREAD_SERIALIZED`, one call at a time; `Mpi` only uses it, and frees it, while holding
// the lock around every MPI call of the process.
unsafe impl Send for GroupComm {}
// SAFETY: as above; a shared reference is only used under the same lock.
unsafe impl Sync for GroupComm {}

impl Drop for Mpi {
    fn drop(&mut self) {
        if let Some(group) = self.group.take() {
            let _serialised = self.lock();
            drop(group);
        }
    }
}

impl Mpi {
    /// The most elements one `MPI_Allreduce` carries: longer sums run in pieces of this
    /// many, so the send buffer never holds more (and every count fits MPI's `int`).
    pub const CHUNK: usize = 1 << 20;

    /// The bytes a buffered send holds beside its message: at least `MPI_BSEND_OVERHEAD`.
    const BSEND_OVERHEAD: usize = 1024;

    /// Initialises MPI (`MPI_Init_thread`, asking for `MPI_THREAD_SERIALIZED`) and returns
    /// this process's rank of `MPI_COMM_WORLD`.
    ///
    /// Fails with [`RuntimeError::Device`] when MPI was already initialised in this process
    /// (by an earlier `Mpi`, or by other code: there is one MPI per process) or when the MPI
    /// library does not provide `MPI_THREAD_SERIALIZED` (MPI is then finalised again).
    pub fn init() -> Result<Mpi> {
        let Some((universe, provided)) = mpi::initialize_with_threading(Threading::Serialized)
        else {
            return Err(RuntimeError::Device(if mpi::is_finalized() {
                "MPI: already initialised and finalised in this process (an earlier Mpi was \
                 dropped), and MPI cannot start twice: keep one Mpi for the whole program"
                    .into()
            } else {
                "MPI: already initialised in this process; Mpi::init must be its only \
                 initialisation: make one Mpi per process and share it"
                    .into()
            }));
        };
        if provided < Threading::Serialized {
            // `universe` is dropped on return: MPI is finalised again.
            return Err(RuntimeError::Device(format!(
                "MPI: the library provides threading level {provided:?}, below the \
                 MPI_THREAD_SERIALIZED that Mpi needs (it may be called from any thread, \
                 one at a time)"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank(), world.size());
        drop(world);
        Ok(Mpi {
            rank: usize::try_from(rank).expect("MPI ranks are non-negative"),
            size: usize::try_from(size).expect("MPI sizes are positive"),
            inner: Arc::new(Mutex::new(Inner {
                universe,
                send_f32: Vec::new(),
                send_f64: Vec::new(),
                buffered: 0,
            })),
            group: None,
        })
    }

    /// How many ranks `mpirun` (Open MPI's) launched, read from the environment it gives each
    /// rank (`OMPI_COMM_WORLD_SIZE`), without initialising MPI; `None` when not launched by
    /// Open MPI's `mpirun`. Lets a program decide whether to call [`Mpi::init`], and lets a
    /// rank check that the MPI library it was linked with is the launcher's (a program linked
    /// with another MPI runs as N separate jobs of one rank).
    pub fn world_size_from_env() -> Option<usize> {
        std::env::var("OMPI_COMM_WORLD_SIZE")
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// This rank's group of a split of its job ([`Collective::split`], `MPI_Comm_split`),
    /// an `Mpi` of its own that shares this one's MPI: the group is freed when it is dropped,
    /// and MPI finalised once the last `Mpi` of the process is.
    pub fn split_group(&self, color: usize, key: usize) -> Result<Mpi> {
        let (Ok(color), Ok(key)) = (i32::try_from(color), i32::try_from(key)) else {
            return Err(RuntimeError::Input(format!(
                "MPI: a split's color {color} and key {key} must fit an int"
            )));
        };
        let group = self.with_comm(|comm, _| {
            let made = comm.split_by_color_with_key(Color::with_value(color), key);
            made.map(|g| (g.rank(), g.size(), GroupComm(g)))
        });
        let Some((rank, size, group)) = group else {
            return Err(RuntimeError::Device(
                "MPI: MPI_Comm_split gave this rank no group".into(),
            ));
        };
        Ok(Mpi {
            rank: usize::try_from(rank).expect("MPI ranks are non-negative"),
            size: usize::try_from(size).expect("MPI sizes are positive"),
            inner: self.inner.clone(),
            group: Some(group),
        })
    }

    /// This rank's index among the ranks on its own node (`MPI_Comm_split_type` with
    /// `MPI_COMM_TYPE_SHARED`): with one process per GPU, the GPU this rank drives.
    pub fn local_rank(&self) -> usize {
        let inner = self.lock();
        let node = inner.universe.world().split_shared(self.rank as mpi::Rank);
        usize::try_from(node.rank()).expect("MPI ranks are non-negative")
    }

    /// Runs `f` on this rank's communicator (its group's, or `MPI_COMM_WORLD`) under the lock.
    fn with_comm<R>(&self, f: impl FnOnce(&SimpleCommunicator, &mut Inner) -> R) -> R {
        let mut inner = self.lock();
        match &self.group {
            Some(group) => f(&group.0, &mut inner),
            None => {
                let world = inner.universe.world();
                f(&world, &mut inner)
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock can only come from the mpi crate's checks before a
        // call is made (MPI errors abort the process): the state is as it was, going on is
        // sound.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// `values` ← their element-wise sum over the ranks of `world`, [`Mpi::CHUNK`] elements per
/// `MPI_Allreduce`, each piece copied into `send` first.
fn all_reduce_sum<T: Equivalence + Copy>(
    world: &SimpleCommunicator,
    send: &mut Vec<T>,
    values: &mut [T],
) {
    for piece in values.chunks_mut(Mpi::CHUNK) {
        send.clear();
        // Exactly the longest piece so far, so `scratch_bytes` is what is held.
        send.reserve_exact(piece.len());
        send.extend_from_slice(piece);
        world.all_reduce_into(&send[..], piece, SystemOperation::sum());
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.with_comm(|comm, inner| all_reduce_sum(comm, &mut inner.send_f32, values));
        Ok(())
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.with_comm(|comm, inner| all_reduce_sum(comm, &mut inner.send_f64, values));
        Ok(())
    }

    fn broadcast(&self, root: usize, bytes: &mut [u8]) -> Result<()> {
        if root >= self.size {
            // Every rank is given the same root, so every rank fails here alike and none is
            // left waiting in MPI_Bcast.
            return Err(RuntimeError::Device(format!(
                "MPI broadcast (rank {}): root {root} is not a rank of this job of {}",
                self.rank, self.size
            )));
        }
        self.with_comm(|comm, _| {
            let root = comm.process_at_rank(root as mpi::Rank);
            // MPI counts in `int`: pieces of at most 1 GiB.
            for piece in bytes.chunks_mut(1 << 30) {
                root.broadcast_into(piece);
            }
        });
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.with_comm(|comm, _| comm.barrier());
        Ok(())
    }

    fn send(&self, to: usize, bytes: &[u8]) -> Result<()> {
        check_peer("an MPI send to", to, self.size)?;
        self.with_comm(|comm, inner| {
            let dest = comm.process_at_rank(to as mpi::Rank);
            // MPI counts in `int`: pieces of at most 1 GiB, received piece by piece alike.
            for piece in bytes.chunks(1 << 30) {
                if inner.buffered > 0 {
                    dest.buffered_send(piece);
                } else {
                    dest.send(piece);
                }
            }
        });
        Ok(())
    }

    fn reserve_sends(&self, bytes: usize, messages: usize) -> Result<u64> {
        // MPI_BSEND_OVERHEAD is below 100 bytes in Open MPI; a piece of 1 GiB is one message.
        let pieces = messages + bytes / (1 << 30);
        let size = bytes + pieces * Self::BSEND_OVERHEAD;
        let mut inner = self.lock();
        if i32::try_from(size).is_err() {
            return Err(RuntimeError::Input(format!(
                "MPI: a stage sends {bytes} bytes a step, more than one MPI buffer holds (2 GiB): \
                 use more micro-batches, or more stages"
            )));
        }
        // One buffer for every plan of the process (a stage's training and inference
        // plans), as large as the largest: it only grows, and only when no buffered send is
        // on its way (a stage's engines are built between its steps, whose sends are all
        // received within the step).
        if size <= inner.buffered {
            return Ok(0);
        }
        let grown = size - inner.buffered;
        inner.universe.set_buffer_size(size);
        inner.buffered = size;
        Ok(grown as u64)
    }

    fn recv(&self, from: usize, bytes: &mut [u8]) -> Result<()> {
        check_peer("an MPI receive from", from, self.size)?;
        self.with_comm(|comm, _| {
            let src = comm.process_at_rank(from as mpi::Rank);
            for piece in bytes.chunks_mut(1 << 30) {
                // A longer message than `piece` is MPI_ERR_TRUNCATE, fatal under
                // MPI_ERRORS_ARE_FATAL; a shorter one is counted here.
                let got = src.receive_into(piece).count(u8::equivalent_datatype()) as usize;
                if got != piece.len() {
                    return Err(RuntimeError::Input(format!(
                        "MPI: rank {from} sent {got} bytes where rank {} expected {}",
                        self.rank,
                        piece.len()
                    )));
                }
            }
            Ok(())
        })
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>> {
        Ok(Arc::new(self.split_group(color, key)?))
    }

    fn engine(&self) -> &'static str {
        "MPI"
    }

    fn scratch_bytes(&self, largest: usize) -> u64 {
        // The f32 send buffer at its longest (the f64 one carries a few scalars).
        largest.min(Mpi::CHUNK) as u64 * 4
    }
}
