//! `Collective`: what data-parallel training asks of the other replicas — sums over every
//! rank, a broadcast, a barrier, all-gathers (ZeRO's updated shards, predictions) — behind one trait, so the walk and the trainer never know
//! which engine carries it: [`Threads`] (replicas as threads of one process: tests, the
//! emulated GPU) or, with the `mpi` feature, `Mpi` (ranks launched by `mpirun`); with the
//! `nccl` feature, `Nccl` (ranks launched by `mpirun`, one per GPU) also sums on device
//! memory ([`DeviceCollective`]), so the CUDA executor's gradients never leave the GPU.
//!
//! Every rank must end a sum with the same bits, or the replicas' weights drift apart: the
//! implementations sum in an order that does not depend on the rank.

mod threads;
pub use threads::{ThreadGroup, Threads};

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;

#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
pub use self::nccl::Nccl;

use memwise_plan::data_parallel::shard_range;

use std::ops::Range;

use crate::error::{Result, RuntimeError};

/// The replicas of one data-parallel job, seen from one of them.
pub trait Collective: Send + Sync {
    /// This replica's index, `0..size()`.
    fn rank(&self) -> usize;
    /// How many replicas the job has.
    fn size(&self) -> usize;
    /// Replaces `values` on every rank by their sum over the ranks (the same length on
    /// every rank), identical bits everywhere.
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()>;
    /// The same, in f64 (loss values, counts, flags).
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()>;
    /// Copies `bytes` of rank `root` into `bytes` of every other rank.
    fn broadcast(&self, root: usize, bytes: &mut [u8]) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Sends `bytes` to rank `to`, whose [`Collective::recv`] from this rank receives them;
    /// messages from one rank to another arrive in the order they were sent. Point to point,
    /// as pipeline stages pass activations and gradients (issue 16). It may return before
    /// `to` receives (a buffered send) or only once it does (MPI's rendezvous for long
    /// messages): two ranks must not both send to each other before either receives.
    fn send(&self, to: usize, bytes: &[u8]) -> Result<()>;
    /// Receives the next message from rank `from` into `bytes`, which must be its length.
    fn recv(&self, from: usize, bytes: &mut [u8]) -> Result<()>;
    /// A pipeline stage sends at most `bytes` in `messages` messages a step, each received
    /// within the step: an engine whose sends may wait for their receiver (MPI's rendezvous)
    /// sets that much buffer aside once, so that every later [`Collective::send`] returns at
    /// once and two stages that send to each other cannot wait on each other. Every call
    /// of a process shares one reservation, as large as the largest call's: returns the host
    /// bytes it added to it (0: its sends never wait, or an earlier call set aside enough).
    /// Called between steps only, when no send of this rank is on its way.
    fn reserve_sends(&self, bytes: usize, messages: usize) -> Result<u64> {
        let _ = (bytes, messages);
        Ok(0)
    }
    /// Every rank holds the same `bytes`, of which rank `r`'s part (the byte range `part(r)`,
    /// the same on every rank; parts do not overlap) is up to date there: copies each rank's
    /// part to every other rank, in place. One broadcast per rank from its own part: nothing
    /// is held beside the values but what a broadcast holds.
    fn all_gather_parts(
        &self,
        bytes: &mut [u8],
        part: &dyn Fn(usize) -> Range<usize>,
    ) -> Result<()> {
        for r in 0..self.size() {
            let range = part(r);
            // Every rank computes the same ranges, so all skip an empty part alike.
            if range.is_empty() {
                continue;
            }
            let Some(mine) = bytes.get_mut(range.clone()) else {
                return Err(RuntimeError::Input(format!(
                    "an all-gather of {} bytes with rank {r}'s part at {range:?}",
                    bytes.len()
                )));
            };
            self.broadcast(r, mine)?;
        }
        Ok(())
    }

    /// ZeRO's all-gather: `bytes` (the same length on every rank, `elem_bytes` per element)
    /// is up to date on rank `r` in its shard, the elements
    /// [`shard_range`]`(len, r, size)`; copies every rank's shard to every other rank.
    fn all_gather_shards(&self, bytes: &mut [u8], elem_bytes: usize) -> Result<()> {
        let parts = shard_byte_ranges(bytes.len(), elem_bytes, self.size())?;
        self.all_gather_parts(bytes, &|r| parts[r].clone())
    }
    /// Splits the job into groups, as `MPI_Comm_split` does: the ranks that give the same
    /// `color` form one group, ranked within it by `key` (ties by their rank here), and each
    /// gets its own group's collective, carried by the same engine. A collective call: every
    /// rank makes it. What a replicated pipeline's stages sum their gradients over: the
    /// replicas of one stage (issue 16).
    fn split(&self, color: usize, key: usize) -> Result<std::sync::Arc<dyn Collective>>;
    /// What carries it, for messages ("threads", "MPI", "NCCL").
    fn engine(&self) -> &'static str;
    /// The same replicas' collectives on device memory, where this engine has them (NCCL):
    /// the CUDA executor then sums its gradients and gathers its shards in place on the
    /// device instead of through the host.
    fn device(&self) -> Option<&dyn DeviceCollective> {
        None
    }
    /// Host memory this engine holds beside the values while it sums `largest` f32 values
    /// at once (its send buffers, the copies it gathers): the trainer adds it to the
    /// estimate the memory monitor checks.
    fn scratch_bytes(&self, largest: usize) -> u64;
}

/// Collectives on device memory (NCCL's), enqueued on a stream of the device that holds the
/// memory, so they are ordered with the kernels around them and nothing is copied to the
/// host. Addresses and streams are raw handles (`CUdeviceptr`, `CUstream`), as the executor
/// and its backend know them; a backend whose device memory is host memory and whose
/// launches run at once (the emulated one) passes stream 0.
///
/// Every rank makes the same calls in the same order with the same lengths, as with
/// [`Collective`].
pub trait DeviceCollective: Send + Sync {
    /// Replaces the `n` f32 at `values` by their sum over the ranks, identical bits on every
    /// rank.
    ///
    /// # Safety
    /// `values` must hold `n` f32 on the device `stream` belongs to, untouched by anything
    /// else until the stream has passed this call.
    unsafe fn all_reduce_sum_f32(&self, values: u64, n: usize, stream: u64) -> Result<()>;
    /// Copies the `bytes` bytes at `at` on rank `root` to `at` on every other rank.
    ///
    /// # Safety
    /// As [`DeviceCollective::all_reduce_sum_f32`], for `bytes` bytes.
    unsafe fn broadcast(&self, root: usize, at: u64, bytes: usize, stream: u64) -> Result<()>;
    /// ZeRO's all-gather on the device: the `len` bytes at `at` (`elem_bytes` per element)
    /// are up to date on rank `r` in its shard, the elements
    /// [`shard_range`]`(len / elem_bytes, r, size)`; copies every rank's shard to every other
    /// rank, one broadcast per rank from its own shard (shards may differ in length, which
    /// an all-gather does not allow), nothing held beside the values.
    ///
    /// # Safety
    /// As [`DeviceCollective::broadcast`], for `len` bytes.
    unsafe fn all_gather_shards(
        &self,
        at: u64,
        len: usize,
        elem_bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let parts = shard_byte_ranges(len, elem_bytes, self.ranks())?;
        self.begin_group()?;
        let sent = parts.into_iter().enumerate().try_for_each(|(r, part)| {
            // Every rank computes the same ranges, so all skip an empty shard alike.
            if part.is_empty() {
                return Ok(());
            }
            self.broadcast(r, at + part.start as u64, part.len(), stream)
        });
        // The group is closed whatever happened inside it.
        let ended = self.end_group();
        sent.and(ended)
    }
    /// Sends the `bytes` bytes at `at` to rank `to` (NCCL's `ncclSend`), whose
    /// [`DeviceCollective::recv`] from this rank receives them, in order. The stream waits
    /// until the receiver has posted its receive: a pipeline stage's transfers between two
    /// units (an activation down and a gradient up cross under 1F1B) go in one group
    /// ([`DeviceCollective::begin_group`]), or the two stages' streams would wait on each other.
    ///
    /// # Safety
    /// As [`DeviceCollective::broadcast`], for `bytes` bytes.
    unsafe fn send(&self, to: usize, at: u64, bytes: usize, stream: u64) -> Result<()>;
    /// Receives the next message of rank `from` into the `bytes` bytes at `at` (NCCL's
    /// `ncclRecv`), which must be its length.
    ///
    /// # Safety
    /// As [`DeviceCollective::broadcast`], for `bytes` bytes.
    unsafe fn recv(&self, from: usize, at: u64, bytes: usize, stream: u64) -> Result<()>;
    /// Starts a group of calls that the engine may run together (NCCL's `ncclGroupStart`);
    /// nothing by default.
    fn begin_group(&self) -> Result<()> {
        Ok(())
    }
    /// Ends the group [`DeviceCollective::begin_group`] started and launches its calls.
    fn end_group(&self) -> Result<()> {
        Ok(())
    }
    /// How many ranks take part (the [`Collective`]'s size).
    fn ranks(&self) -> usize;
}

/// The byte ranges of each rank's shard of `len` bytes in elements of `elem_bytes`
/// ([`shard_range`]), checked to be whole elements.
pub fn shard_byte_ranges(len: usize, elem_bytes: usize, size: usize) -> Result<Vec<Range<usize>>> {
    let elem = elem_bytes.max(1);
    if !len.is_multiple_of(elem) {
        return Err(RuntimeError::Input(format!(
            "an all-gather of {len} bytes in elements of {elem}"
        )));
    }
    Ok((0..size)
        .map(|r| {
            let s = shard_range(len / elem, r, size);
            s.start * elem..s.end * elem
        })
        .collect())
}

/// `Err` unless `peer` is a rank of a job of `size` (`what`: "a send to").
pub(crate) fn check_peer(what: &str, peer: usize, size: usize) -> Result<()> {
    if peer < size {
        return Ok(());
    }
    Err(RuntimeError::Input(format!(
        "{what} rank {peer}, in a job of {size} ranks"
    )))
}

/// How long a rank waits for the others before it gives up with an error: a rank that
/// died or stopped early makes the others fail within this time, never hang.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
