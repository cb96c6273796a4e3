//! `Collective`: what data-parallel training asks of the other replicas — sums over every
//! rank, a broadcast, a barrier, all-gathers (ZeRO's updated shards, predictions) — behind one trait, so the walk and the trainer never know
//! which engine carries it: [`Threads`] (replicas as threads of one process: tests, the
//! emulated GPU) or, with the `mpi` feature, `Mpi` (ranks launched by `mpirun`).
//!
//! Every rank must end a sum with the same bits, or the replicas' weights drift apart: the
//! implementations sum in an order that does not depend on the rank.

mod threads;
pub use threads::{ThreadGroup, Threads};

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;

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
        let elem = elem_bytes.max(1);
        if !bytes.len().is_multiple_of(elem) {
            return Err(RuntimeError::Input(format!(
                "an all-gather of {} bytes in elements of {elem}",
                bytes.len()
            )));
        }
        let (n, size) = (bytes.len() / elem, self.size());
        let part = |r: usize| {
            let s = shard_range(n, r, size);
            s.start * elem..s.end * elem
        };
        self.all_gather_parts(bytes, &part)
    }
    /// What carries it, for messages ("threads", "MPI").
    fn engine(&self) -> &'static str;
    /// Host memory this engine holds beside the values while it sums `largest` f32 values
    /// at once (its send buffers, the copies it gathers): the trainer adds it to the
    /// estimate the memory monitor checks.
    fn scratch_bytes(&self, largest: usize) -> u64;
}

/// How long a rank waits for the others before it gives up with an error: a rank that
/// died or stopped early makes the others fail within this time, never hang.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
