//! The prefetch pool: worker threads that fill the batches a dataset was told are coming
//! (`Dataset::will_gather`) ahead of the training step, into a bounded set of batch buffers,
//! and hand them over strictly in the announced order.
//!
//! The bound is on buffers, not on a queue's length: at most `capacity` batch buffers exist at
//! any time (being filled, or filled and waiting), so the pool's memory is `capacity` batches
//! plus each worker's scratch, planned before the first one is allocated. A worker takes the
//! first batch not yet started among the next `capacity` announced ones, and only when a
//! buffer is free or may still be allocated.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a pool's workers run: fill one batch of samples into a buffer.
pub(crate) trait Fill: Send + Sync + 'static {
    /// Per-worker state (decode buffers), made once when the worker starts.
    type Scratch;
    fn scratch(&self) -> Self::Scratch;
    /// Fills `out` with samples `idx` (`out.images` holds `idx.len()` samples). An `Err` is
    /// handed to whoever gathers that batch.
    fn fill(
        &self,
        scratch: &mut Self::Scratch,
        idx: &[usize],
        out: &mut Filled,
    ) -> Result<(), String>;
    /// Bytes of one sample in `Filled::images`.
    fn sample_bytes(&self) -> usize;
}

/// One batch buffer: `images` of the batch's samples back to back, and the class of each
/// sample actually written (a bad file's slot holds another sample, with that sample's class).
#[derive(Debug, Default)]
pub(crate) struct Filled {
    pub images: Vec<u8>,
    pub labels: Vec<i32>,
}

/// Counters of a pool's work, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Batches handed over from the pool.
    pub prefetched: u64,
    /// Time the consumer spent blocked waiting for a batch that was not ready yet.
    pub blocked: Duration,
    /// The most batch buffers that existed at once (never above the pool's capacity).
    pub max_buffers: usize,
    /// The most batches filled and waiting at once.
    pub max_ready: usize,
    /// Batches filled for an announcement that was replaced before they were gathered.
    pub discarded: u64,
}

enum Status {
    Pending,
    Filling,
    Ready(Filled),
    Failed(String),
}

struct Slot {
    id: u64,
    idx: Arc<[usize]>,
    status: Status,
}

struct State {
    slots: VecDeque<Slot>,
    next_id: u64,
    free: Vec<Filled>,
    allocated: usize,
    shutdown: bool,
    stats: PrefetchStats,
}

struct Shared<F> {
    fill: Arc<F>,
    capacity: usize,
    state: Mutex<State>,
    /// Workers wait here for a batch to start and a buffer to fill.
    work: Condvar,
    /// The consumer waits here for the batch at the front.
    ready: Condvar,
}

impl<F> Shared<F> {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held cannot leave `State` half-changed (no code that can
        // panic runs under it), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Worker threads and the batch buffers they fill.
pub(crate) struct Pool<F: Fill> {
    shared: Arc<Shared<F>>,
    threads: Vec<JoinHandle<()>>,
}

impl<F: Fill> Pool<F> {
    /// Starts `workers` threads (named `memwise-prefetch-N`) sharing `capacity` batch buffers.
    /// `None` when no thread could be started (the caller then fills batches itself).
    pub fn start(fill: Arc<F>, workers: usize, capacity: usize) -> Option<Pool<F>> {
        let shared = Arc::new(Shared {
            fill,
            capacity: capacity.max(1),
            state: Mutex::new(State {
                slots: VecDeque::new(),
                next_id: 0,
                free: Vec::new(),
                allocated: 0,
                shutdown: false,
                stats: PrefetchStats::default(),
            }),
            work: Condvar::new(),
            ready: Condvar::new(),
        });
        let threads: Vec<JoinHandle<()>> = (0..workers.max(1))
            .filter_map(|k| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("memwise-prefetch-{k}"))
                    .spawn(move || work(&s))
                    .ok()
            })
            .collect();
        (!threads.is_empty()).then_some(Pool { shared, threads })
    }

    /// Replaces what is announced: the batches already prepared or being prepared that
    /// match the start of `batches` are kept, the rest dropped (their buffers freed).
    pub fn announce(&self, batches: Vec<Arc<[usize]>>) {
        let mut st = self.shared.lock();
        let keep = st
            .slots
            .iter()
            .zip(&batches)
            .take_while(|(s, b)| *s.idx == ***b)
            .count();
        let dropped: Vec<Slot> = st.slots.drain(keep..).collect();
        for s in dropped {
            if let Status::Ready(f) = s.status {
                st.free.push(f);
                st.stats.discarded += 1;
            }
        }
        for idx in batches.into_iter().skip(keep) {
            let id = st.next_id;
            st.next_id += 1;
            st.slots.push_back(Slot {
                id,
                idx,
                status: Status::Pending,
            });
        }
        drop(st);
        self.shared.work.notify_all();
    }

    /// The batch of samples `idx` when it is the next one announced, waiting for it if it is
    /// still being filled; `None` when `idx` is not the next announced batch.
    pub fn take(&self, idx: &[usize]) -> Option<Result<Filled, String>> {
        let mut st = self.shared.lock();
        let id = match st.slots.front() {
            Some(s) if *s.idx == *idx => s.id,
            _ => return None,
        };
        let t0 = Instant::now();
        loop {
            match st.slots.front() {
                Some(s) if s.id == id => {
                    if matches!(s.status, Status::Ready(_) | Status::Failed(_)) {
                        break;
                    }
                }
                // Another thread replaced the announcement meanwhile.
                _ => return None,
            }
            if st.shutdown {
                return None;
            }
            st = self
                .shared
                .ready
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        st.stats.blocked += t0.elapsed();
        let slot = st.slots.pop_front()?;
        drop(st);
        // A worker may now start the batch that just came within reach.
        self.shared.work.notify_all();
        match slot.status {
            Status::Ready(f) => {
                self.shared.lock().stats.prefetched += 1;
                Some(Ok(f))
            }
            Status::Failed(e) => Some(Err(e)),
            Status::Pending | Status::Filling => None,
        }
    }

    /// Returns a buffer from [`Pool::take`] for reuse.
    pub fn give_back(&self, f: Filled) {
        self.shared.lock().free.push(f);
        self.shared.work.notify_all();
    }

    pub fn stats(&self) -> PrefetchStats {
        self.shared.lock().stats
    }
}

impl<F: Fill> Drop for Pool<F> {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One worker: claim, fill, hand over, until shutdown.
fn work<F: Fill>(shared: &Shared<F>) {
    let mut scratch = shared.fill.scratch();
    loop {
        let (id, idx, mut buf) = {
            let mut st = shared.lock();
            let pos = loop {
                if st.shutdown {
                    return;
                }
                let buffer_available = !st.free.is_empty() || st.allocated < shared.capacity;
                let pending = st
                    .slots
                    .iter()
                    .take(shared.capacity)
                    .position(|s| matches!(s.status, Status::Pending));
                if let (Some(pos), true) = (pending, buffer_available) {
                    break pos;
                }
                st = shared.work.wait(st).unwrap_or_else(|e| e.into_inner());
            };
            let buf = match st.free.pop() {
                Some(b) => b,
                None => {
                    st.allocated += 1;
                    st.stats.max_buffers = st.stats.max_buffers.max(st.allocated);
                    Filled::default()
                }
            };
            let slot = &mut st.slots[pos];
            slot.status = Status::Filling;
            (slot.id, Arc::clone(&slot.idx), buf)
        };
        let n = idx.len();
        buf.images.resize(n * shared.fill.sample_bytes(), 0);
        buf.labels.resize(n, 0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            shared.fill.fill(&mut scratch, &idx, &mut buf)
        }))
        .unwrap_or_else(|p| {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!(
                "a prefetch worker panicked filling the batch: {what}"
            ))
        });
        let mut st = shared.lock();
        let State {
            slots, free, stats, ..
        } = &mut *st;
        match slots.iter_mut().find(|s| s.id == id) {
            Some(slot) => {
                slot.status = match result {
                    Ok(()) => Status::Ready(buf),
                    Err(e) => {
                        free.push(buf);
                        Status::Failed(e)
                    }
                };
                let ready = slots
                    .iter()
                    .filter(|s| matches!(s.status, Status::Ready(_)))
                    .count();
                stats.max_ready = stats.max_ready.max(ready);
            }
            None => {
                free.push(buf);
                stats.discarded += 1;
            }
        }
        drop(st);
        shared.ready.notify_all();
        shared.work.notify_all();
    }
}
