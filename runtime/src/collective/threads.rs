//! `Threads`: the replicas of a data-parallel job as threads of one process, meeting in
//! shared memory. What the tests and the emulated GPU use, and a correct single-machine
//! engine in its own right. Sums run in rank order, so every rank gets the same bits.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{check_peer, Collective, DEFAULT_TIMEOUT};
use crate::error::{Result, RuntimeError};

/// What one rank brings to a round.
enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bytes(Vec<u8>),
    /// A split's `(color, key)`.
    Split(usize, usize),
    /// A split's result: per rank, its group and its rank in it.
    Groups(Vec<(Arc<Shared>, usize)>),
}

/// One round of a collective: every rank's contribution, then the result they all copy.
#[derive(Default)]
struct Round {
    given: Vec<Option<Payload>>,
    result: Option<Payload>,
    /// Ranks that copied the result; the round is over when all have.
    taken: usize,
}

struct State {
    round: Round,
    /// Why the job cannot go on (a rank left, timed out, or gave mismatched buffers).
    broken: Option<String>,
    /// Point-to-point messages sent and not yet received, by `(from, to)`, oldest first.
    mail: HashMap<(usize, usize), VecDeque<Vec<u8>>>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn new(size: usize, timeout: Duration) -> Arc<Shared> {
        Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                round: Round {
                    given: (0..size).map(|_| None).collect(),
                    ..Round::default()
                },
                broken: None,
                mail: HashMap::new(),
            }),
            changed: Condvar::new(),
        })
    }
}

/// Per rank of a split, its group and its rank in it: one group per color, its members
/// ranked by `(key, rank)`.
fn split_groups(given: &[Option<Payload>], timeout: Duration) -> Vec<(Arc<Shared>, usize)> {
    let asked: Vec<(usize, usize)> = (given.iter())
        .map(|p| match p {
            Some(Payload::Split(color, key)) => (*color, *key),
            _ => (usize::MAX, usize::MAX),
        })
        .collect();
    let mut out: Vec<Option<(Arc<Shared>, usize)>> = vec![None; given.len()];
    for (rank, &(color, _)) in asked.iter().enumerate() {
        if out[rank].is_some() {
            continue;
        }
        let mut members: Vec<usize> = (0..asked.len()).filter(|&r| asked[r].0 == color).collect();
        members.sort_by_key(|&r| (asked[r].1, r));
        let group = Shared::new(members.len(), timeout);
        for (i, &r) in members.iter().enumerate() {
            out[r] = Some((group.clone(), i));
        }
    }
    out.into_iter().flatten().collect()
}

/// Makes the handles of one job: [`ThreadGroup::new`]`(n)` gives `n` of them, one per thread.
pub struct ThreadGroup;

impl ThreadGroup {
    /// `n` ranks that wait at most [`DEFAULT_TIMEOUT`] for each other.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize) -> Vec<Threads> {
        ThreadGroup::with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// `n` ranks that wait at most `timeout` for each other.
    pub fn with_timeout(n: usize, timeout: Duration) -> Vec<Threads> {
        let n = n.max(1);
        let shared = Shared::new(n, timeout);
        (0..n)
            .map(|rank| Threads {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

/// One rank of a [`ThreadGroup`]. Dropping it tells the others this rank has left: their
/// next collective fails at once instead of waiting for it.
pub struct Threads {
    rank: usize,
    shared: Arc<Shared>,
}

impl Threads {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves the state as it was: the
        // rounds are only changed whole, so going on is sound.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits (releasing the lock) until `ready` holds, the job breaks, or the time is up.
    fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        what: &str,
        deadline: Instant,
        ready: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        loop {
            // Ready first: a rank that left after the round's result was made leaves it
            // to be taken.
            if ready(&st) {
                return Ok(st);
            }
            if let Some(why) = &st.broken {
                return Err(RuntimeError::Device(format!(
                    "threads job ({what}, rank {}): {why}",
                    self.rank
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!(
                    "rank {} waited {:.0} s for the other ranks in {what}; a rank stopped or died",
                    self.rank,
                    self.shared.timeout.as_secs_f64()
                );
                st.broken = Some(why.clone());
                self.shared.changed.notify_all();
                return Err(RuntimeError::Device(format!("threads job: {why}")));
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Gives `mine` to the round, and returns what `combine` made of every rank's
    /// contribution once all gave theirs.
    fn round(
        &self,
        what: &str,
        mine: Payload,
        combine: impl FnOnce(&[Option<Payload>]) -> std::result::Result<Payload, String>,
        take: impl FnOnce(&Payload),
    ) -> Result<()> {
        let deadline = Instant::now() + self.shared.timeout;
        let n = self.shared.size;
        // The previous round is over when its result is gone.
        let st = self.lock();
        let mut st = self.wait_until(st, what, deadline, |s| s.round.result.is_none())?;
        st.round.given[self.rank] = Some(mine);
        if st.round.given.iter().all(Option::is_some) {
            match combine(&st.round.given) {
                Ok(r) => st.round.result = Some(r),
                Err(why) => st.broken = Some(why),
            }
            self.shared.changed.notify_all();
        }
        let mut st = self.wait_until(st, what, deadline, |s| s.round.result.is_some())?;
        if let Some(r) = &st.round.result {
            take(r);
        }
        st.round.taken += 1;
        if st.round.taken == n {
            st.round = Round {
                given: (0..n).map(|_| None).collect(),
                ..Round::default()
            };
            self.shared.changed.notify_all();
        }
        Ok(())
    }
}

/// The lengths of every contribution, or why they differ.
fn same_len(
    given: &[Option<Payload>],
    len: impl Fn(&Payload) -> usize,
) -> std::result::Result<usize, String> {
    let lens: Vec<usize> = given.iter().flatten().map(&len).collect();
    match lens.first() {
        Some(&l) if lens.iter().all(|&m| m == l) => Ok(l),
        _ => Err(format!(
            "the ranks gave buffers of different lengths {lens:?}"
        )),
    }
}

fn sum_in_rank_order<T: Copy + std::ops::AddAssign + Default>(
    given: &[Option<Payload>],
    get: impl Fn(&Payload) -> Option<&Vec<T>>,
) -> std::result::Result<Vec<T>, String> {
    let parts: Vec<&Vec<T>> = given.iter().flatten().filter_map(get).collect();
    if parts.len() != given.len() {
        return Err("the ranks called different collectives".into());
    }
    let mut out = vec![T::default(); parts[0].len()];
    for p in parts {
        for (o, &v) in out.iter_mut().zip(p.iter()) {
            *o += v;
        }
    }
    Ok(out)
}

impl Collective for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        let mine = Payload::F32(values.to_vec());
        let combine = |g: &[Option<Payload>]| {
            same_len(g, |p| match p {
                Payload::F32(v) => v.len(),
                _ => usize::MAX,
            })?;
            sum_in_rank_order(g, |p| match p {
                Payload::F32(v) => Some(v),
                _ => None,
            })
            .map(Payload::F32)
        };
        let take = |r: &Payload| {
            if let Payload::F32(s) = r {
                values.copy_from_slice(s);
            }
        };
        self.round("a sum", mine, combine, take)
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        let mine = Payload::F64(values.to_vec());
        let combine = |g: &[Option<Payload>]| {
            same_len(g, |p| match p {
                Payload::F64(v) => v.len(),
                _ => usize::MAX,
            })?;
            sum_in_rank_order(g, |p| match p {
                Payload::F64(v) => Some(v),
                _ => None,
            })
            .map(Payload::F64)
        };
        let take = |r: &Payload| {
            if let Payload::F64(s) = r {
                values.copy_from_slice(s);
            }
        };
        self.round("a sum", mine, combine, take)
    }

    fn broadcast(&self, root: usize, bytes: &mut [u8]) -> Result<()> {
        let mine = Payload::Bytes(bytes.to_vec());
        if root >= self.size() {
            return Err(RuntimeError::Input(format!(
                "broadcast from rank {root} of {}",
                self.size()
            )));
        }
        let combine = |g: &[Option<Payload>]| {
            same_len(g, |p| match p {
                Payload::Bytes(v) => v.len(),
                _ => usize::MAX,
            })?;
            match &g[root] {
                Some(Payload::Bytes(b)) => Ok(Payload::Bytes(b.clone())),
                _ => Err("the ranks called different collectives".to_string()),
            }
        };
        let take = |r: &Payload| {
            if let Payload::Bytes(b) = r {
                bytes.copy_from_slice(b);
            }
        };
        self.round("a broadcast", mine, combine, take)
    }

    fn barrier(&self) -> Result<()> {
        self.round(
            "a barrier",
            Payload::Bytes(Vec::new()),
            |_| Ok(Payload::Bytes(Vec::new())),
            |_| {},
        )
    }

    fn send(&self, to: usize, bytes: &[u8]) -> Result<()> {
        check_peer("a send to", to, self.size())?;
        let mut st = self.lock();
        if let Some(why) = &st.broken {
            return Err(RuntimeError::Device(format!(
                "threads job (a send to rank {to}, rank {}): {why}",
                self.rank
            )));
        }
        // Buffered: the sender goes on at once, as MPI's eager sends of short messages do.
        let queue = st.mail.entry((self.rank, to)).or_default();
        queue.push_back(bytes.to_vec());
        self.shared.changed.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize, bytes: &mut [u8]) -> Result<()> {
        check_peer("a receive from", from, self.size())?;
        let key = (from, self.rank);
        let what = format!("a receive from rank {from}");
        let deadline = Instant::now() + self.shared.timeout;
        let st = self.lock();
        let has_mail = |s: &State| s.mail.get(&key).is_some_and(|q| !q.is_empty());
        let mut st = self.wait_until(st, &what, deadline, has_mail)?;
        let message = st
            .mail
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .unwrap_or_default();
        if message.len() != bytes.len() {
            return Err(RuntimeError::Input(format!(
                "rank {from} sent {} bytes, rank {} expected {}",
                message.len(),
                self.rank,
                bytes.len()
            )));
        }
        bytes.copy_from_slice(&message);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>> {
        let timeout = self.shared.timeout;
        let combine = |g: &[Option<Payload>]| {
            if !g.iter().all(|p| matches!(p, Some(Payload::Split(..)))) {
                return Err("the ranks called different collectives".to_string());
            }
            Ok(Payload::Groups(split_groups(g, timeout)))
        };
        let mut mine: Option<(Arc<Shared>, usize)> = None;
        let take = |r: &Payload| {
            if let Payload::Groups(groups) = r {
                mine = groups.get(self.rank).cloned();
            }
        };
        self.round("a split", Payload::Split(color, key), combine, take)?;
        let (shared, rank) = mine.ok_or_else(|| {
            RuntimeError::Device(format!(
                "threads job: rank {} was left out of a split",
                self.rank
            ))
        })?;
        Ok(Arc::new(Threads { rank, shared }))
    }

    fn engine(&self) -> &'static str {
        "threads"
    }

    fn scratch_bytes(&self, largest: usize) -> u64 {
        // This rank's copy handed in, and its share of the sum every rank reads back.
        2 * largest as u64 * 4
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        let mut st = self.lock();
        if st.broken.is_none() {
            st.broken = Some(format!("rank {} has left the job", self.rank));
        }
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_same_sum_and_broadcast() {
        let ranks = ThreadGroup::new(3);
        let out: Vec<(Vec<f32>, Vec<u8>)> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let mut v = vec![r + 0.1, 2.0 * r, 1e-8];
                        let mut b = vec![c.rank() as u8; 4];
                        for _ in 0..5 {
                            c.barrier().unwrap();
                        }
                        c.all_reduce_sum_f32(&mut v).unwrap();
                        c.broadcast(2, &mut b).unwrap();
                        (v, b)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<f32> = vec![(0.1f32 + 1.1) + 2.1, 0.0 + 2.0 + 4.0, 1e-8 + 1e-8 + 1e-8];
        for (v, b) in &out {
            assert_eq!(v, &want);
            assert_eq!(b, &vec![2u8; 4]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
        let mut ranks = ThreadGroup::with_timeout(2, Duration::from_secs(30));
        let second = ranks.pop().unwrap();
        let first = ranks.pop().unwrap();
        let t = Instant::now();
        let waiter = std::thread::spawn(move || {
            let mut v = [1.0f32];
            first.all_reduce_sum_f32(&mut v)
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(second);
        let e = waiter.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 has left the job"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn messages_go_round_a_ring_in_order() {
        let ranks = ThreadGroup::new(4);
        let got: Vec<Vec<[u8; 2]>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let (r, n) = (c.rank(), c.size());
                        for k in 0..3u8 {
                            c.send((r + 1) % n, &[r as u8, k]).unwrap();
                        }
                        (0..3)
                            .map(|_| {
                                let mut b = [0u8; 2];
                                c.recv((r + n - 1) % n, &mut b).unwrap();
                                b
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, msgs) in got.iter().enumerate() {
            let from = ((r + 3) % 4) as u8;
            assert_eq!(msgs, &[[from, 0], [from, 1], [from, 2]]);
        }
    }

    #[test]
    fn a_receive_names_a_wrong_length_a_wrong_peer_and_a_sender_that_left() {
        let mut ranks = ThreadGroup::with_timeout(2, Duration::from_secs(30));
        let second = ranks.pop().unwrap();
        let first = ranks.pop().unwrap();
        second.send(0, &[1, 2, 3]).unwrap();
        let e = first.recv(1, &mut [0u8; 2]).unwrap_err().to_string();
        assert!(e.contains("rank 1 sent 3 bytes, rank 0 expected 2"), "{e}");
        let e = first.send(2, &[0]).unwrap_err().to_string();
        assert!(e.contains("a send to rank 2, in a job of 2 ranks"), "{e}");
        // Sent before it left: still received.
        second.send(0, &[7]).unwrap();
        drop(second);
        let mut b = [0u8];
        first.recv(1, &mut b).unwrap();
        assert_eq!(b, [7]);
        let t = Instant::now();
        let e = first.recv(1, &mut b).unwrap_err().to_string();
        assert!(e.contains("rank 1 has left the job"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn a_missing_rank_times_out_with_a_message() {
        let ranks = ThreadGroup::with_timeout(2, Duration::from_millis(200));
        let e = ranks[0].barrier().unwrap_err().to_string();
        assert!(e.contains("waited 0 s") || e.contains("waited"), "{e}");
        assert!(e.contains("a rank stopped or died"), "{e}");
    }

    #[test]
    fn mismatched_buffers_are_an_error_on_every_rank() {
        let ranks = ThreadGroup::new(2);
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut v = vec![0f32; 1 + c.rank()];
                        c.all_reduce_sum_f32(&mut v).unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errs {
            assert!(e.contains("different lengths"), "{e}");
        }
    }
}
