//! Offsets for the transient tensors of one training step in a single arena: TFLite's
//! greedy-by-size baseline and the planner's packer, which is never worse than it.
//!
//! Giving buffers with fixed lifetimes offsets so that the arena is as small as possible is
//! *dynamic storage allocation*, which is NP-hard. No packing can beat [`lower_bound`], the
//! most bytes live at any one step, so that is the yardstick. [`pack`] tries, in order:
//!
//! 1. greedy placement — buffers taken in some order, each put in a gap left by the
//!    buffers already placed whose lifetimes intersect its own (first-fit or best-fit) —
//!    under several orderings, TFLite's among them;
//! 2. a skyline heuristic that always places next the buffer that can sit lowest, which
//!    stacks the nested lifetimes of a training step (forward activations freed in reverse
//!    order by the backward pass) without gaps;
//! 3. a local search over the placement order (move a buffer that reaches the top of the
//!    arena earlier, re-place everything after it), seeded deterministically;
//! 4. an exact branch and bound when there are at most [`EXACT_MAX_BUFFERS`] buffers.
//!
//! It stops as soon as a packing meets the lower bound. Every stage is bounded by counted
//! work, never by wall time: the macro computes the plan at compile time, and the same model
//! must get the same plan on every machine.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// One buffer to place. `bytes` is already a multiple of the alignment.
///
/// It is live at every step in `first..=last` (`first <= last`); two buffers whose step
/// ranges intersect must not share a byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferRequest {
    pub bytes: u64,
    pub first: usize,
    pub last: usize,
}

/// An offset for every request, in request order, and the arena size they need
/// (the largest `offset + bytes`, 0 when there is nothing to place).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packing {
    pub offsets: Vec<u64>,
    pub arena_bytes: u64,
}

/// Instances with at most this many non-empty buffers are solved exactly (branch and bound),
/// unless the search exceeds its node budget, in which case the best packing found is kept.
pub const EXACT_MAX_BUFFERS: usize = 14;

/// Nodes the branch and bound may visit. Enough to close every instance the tests and the
/// synthetic training steps produce; the limit only guards adversarial inputs.
const EXACT_NODE_BUDGET: u64 = 300_000;

/// Work allowed to the heuristics, counted in placed-buffer visits (one visit is one
/// comparison of a buffer being placed with one already placed, a few nanoseconds). Sized so
/// that a ResNet-50 training step (about 3,000 buffers) packs in well under 100 ms.
const WORK_BUDGET: u64 = 40_000_000;

/// Seed of the local search; fixed so that plans are reproducible.
const SEED: u64 = 0x6d65_6d77_6973_6521;

/// The most bytes live at any one step: no packing's arena can be smaller.
pub fn lower_bound(reqs: &[BufferRequest]) -> u64 {
    // Sweep over lifetime boundaries; at equal steps starts come before ends, because a
    // buffer that ends at step t is still live at t.
    let mut events: Vec<(usize, u8, u64)> = Vec::with_capacity(2 * reqs.len());
    for r in reqs {
        events.push((r.first, 0, r.bytes));
        events.push((r.last, 1, r.bytes));
    }
    events.sort_unstable();
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, kind, bytes) in events {
        if kind == 0 {
            live += bytes;
            peak = peak.max(live);
        } else {
            live -= bytes;
        }
    }
    peak
}

/// TFLite's greedy-by-size offset assignment (`GreedyBySizeAssignment` of the GPU delegate's
/// memory management), step for step: buffers in non-increasing size order; each goes into
/// the smallest gap, between buffers already placed whose lifetimes intersect its own, that
/// fits it (the lowest such gap on ties), or after the highest of them when none fits.
///
/// TFLite sorts with `std::sort`, which leaves equal sizes in an unspecified order; here they
/// keep request order, so the result is deterministic.
pub fn greedy_by_size(reqs: &[BufferRequest], alignment: u64) -> Packing {
    let align = alignment.max(1);
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by(|&a, &b| reqs[b].bytes.cmp(&reqs[a].bytes));
    let mut offsets = vec![0u64; reqs.len()];
    let mut arena_bytes = 0u64;
    // Placed buffers, ordered by offset.
    let mut placed: Vec<usize> = Vec::with_capacity(reqs.len());
    for &i in &order {
        let r = reqs[i];
        let mut best_diff = u64::MAX;
        let mut best_offset = None;
        let mut prev_end = 0u64;
        for &j in &placed {
            let q = reqs[j];
            if q.last < r.first || q.first > r.last {
                continue;
            }
            let cur = offsets[j];
            if cur >= prev_end {
                let diff = cur - prev_end;
                if diff >= r.bytes && diff < best_diff {
                    best_diff = diff;
                    best_offset = Some(prev_end);
                }
            }
            prev_end = prev_end.max(align_up(cur + q.bytes, align));
        }
        let offset = best_offset.unwrap_or(prev_end);
        let at = placed.partition_point(|&j| offsets[j] <= offset);
        placed.insert(at, i);
        offsets[i] = offset;
        arena_bytes = arena_bytes.max(offset + r.bytes);
    }
    Packing {
        offsets,
        arena_bytes,
    }
}

/// The planner's packing: the best of TFLite's greedy-by-size, several other greedy
/// orderings, a skyline heuristic, a local search and, for small instances, an exact search.
/// Offsets are multiples of `alignment` (requests of zero bytes get offset 0); the result is
/// deterministic and its arena is never larger than [`greedy_by_size`]'s.
///
/// # Panics
/// When a request has `first > last`.
pub fn pack(reqs: &[BufferRequest], alignment: u64) -> Packing {
    for (i, r) in reqs.iter().enumerate() {
        assert!(r.first <= r.last, "buffer {i} has first {} > last {}", r.first, r.last);
    }
    let align = alignment.max(1);
    let baseline = greedy_by_size(reqs, align);
    let instance = Instance::new(reqs, align);
    if instance.items.is_empty() {
        return Packing {
            offsets: vec![0; reqs.len()],
            arena_bytes: 0,
        };
    }
    let ours = instance.solve();
    let mut offsets = vec![0u64; reqs.len()];
    for (k, &i) in instance.index.iter().enumerate() {
        offsets[i] = ours[k];
    }
    let arena_bytes = reqs
        .iter()
        .zip(&offsets)
        .map(|(r, &o)| if r.bytes == 0 { 0 } else { o + r.bytes })
        .max()
        .unwrap_or(0);
    if arena_bytes < baseline.arena_bytes {
        Packing {
            offsets,
            arena_bytes,
        }
    } else {
        baseline
    }
}

/// The first pair `(i, j)`, `i < j`, smallest `i` then smallest `j`, of requests whose
/// lifetimes intersect and whose byte ranges `offset..offset + bytes` intersect; `None`
/// when the packing is valid in that respect. Empty byte ranges intersect nothing.
///
/// # Panics
/// When `packing` has not one offset per request.
pub fn overlaps(reqs: &[BufferRequest], packing: &Packing) -> Option<(usize, usize)> {
    assert_eq!(reqs.len(), packing.offsets.len(), "one offset per request");
    let end = |i: usize| u128::from(packing.offsets[i]) + u128::from(reqs[i].bytes);
    for i in 0..reqs.len() {
        if reqs[i].bytes == 0 {
            continue;
        }
        for j in i + 1..reqs.len() {
            let (a, b) = (reqs[i], reqs[j]);
            if b.bytes == 0 || a.last < b.first || b.last < a.first {
                continue;
            }
            if u128::from(packing.offsets[i]) < end(j) && u128::from(packing.offsets[j]) < end(i) {
                return Some((i, j));
            }
        }
    }
    None
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

/// A non-empty buffer with its lifetime mapped onto compressed time: the distinct `first`
/// and `last` values of all requests, ranked. Ranking keeps every `<=` between them, so
/// lifetimes intersect exactly when their compressed ones do, and the steps in between
/// (where nothing starts or ends) never matter.
#[derive(Clone, Copy, Debug)]
struct Item {
    /// Rounded up to the alignment, so that every end is aligned too.
    bytes: u64,
    first: u32,
    last: u32,
    /// Lifetime in original steps, for the orderings.
    steps: u64,
}

impl Item {
    fn meets(&self, other: &Item) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// A placed buffer in the greedy placer's offset-ordered list.
#[derive(Clone, Copy, Debug)]
struct Slot {
    offset: u64,
    end: u64,
    first: u32,
    last: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fit {
    /// The lowest gap that fits (with placement in offset order this reproduces any
    /// packing, so it is the fit the local search and the exact search use).
    First,
    /// The smallest gap that fits, the lowest on ties (TFLite's rule).
    Best,
}

/// The offset `item` gets among `slots` (ordered by offset), and the number of slots looked at.
fn find_gap(slots: &[Slot], item: &Item, fit: Fit) -> (u64, u64) {
    let mut prev_end = 0u64;
    let mut best: Option<(u64, u64)> = None;
    for (seen, s) in slots.iter().enumerate() {
        if s.last < item.first || s.first > item.last {
            continue;
        }
        if s.offset >= prev_end {
            let gap = s.offset - prev_end;
            if gap >= item.bytes {
                match fit {
                    // Every later slot starts at or above `s.offset`: the gap stays free.
                    Fit::First => return (prev_end, seen as u64 + 1),
                    Fit::Best => {
                        if best.is_none_or(|(g, _)| gap < g) {
                            best = Some((gap, prev_end));
                        }
                    }
                }
            }
        }
        prev_end = prev_end.max(s.end);
    }
    (best.map_or(prev_end, |(_, o)| o), slots.len() as u64)
}

fn insert_slot(slots: &mut Vec<Slot>, slot: Slot) {
    let at = slots.partition_point(|s| s.offset <= slot.offset);
    slots.insert(at, slot);
}

/// A packing of the instance's items.
#[derive(Clone, Debug)]
struct Solution {
    offsets: Vec<u64>,
    arena: u64,
}

struct Instance {
    items: Vec<Item>,
    /// `items[k]` is request `index[k]`.
    index: Vec<usize>,
    /// Number of compressed time coordinates.
    coords: usize,
    lower_bound: u64,
}

impl Instance {
    fn new(reqs: &[BufferRequest], align: u64) -> Instance {
        let index: Vec<usize> = (0..reqs.len()).filter(|&i| reqs[i].bytes > 0).collect();
        let mut times: Vec<usize> = index
            .iter()
            .flat_map(|&i| [reqs[i].first, reqs[i].last])
            .collect();
        times.sort_unstable();
        times.dedup();
        let rank = |t: usize| times.binary_search(&t).expect("a boundary") as u32;
        let items: Vec<Item> = index
            .iter()
            .map(|&i| {
                let r = reqs[i];
                Item {
                    bytes: align_up(r.bytes, align),
                    first: rank(r.first),
                    last: rank(r.last),
                    steps: (r.last - r.first) as u64 + 1,
                }
            })
            .collect();
        let coords = times.len();
        let lower_bound = {
            let mut delta = vec![0i128; coords + 1];
            for it in &items {
                delta[it.first as usize] += i128::from(it.bytes);
                delta[it.last as usize + 1] -= i128::from(it.bytes);
            }
            let mut live = 0i128;
            let mut peak = 0i128;
            for d in &delta[..coords] {
                live += d;
                peak = peak.max(live);
            }
            peak as u64
        };
        Instance {
            items,
            index,
            coords,
            lower_bound,
        }
    }

    /// Bytes live at every compressed coordinate.
    fn breadth(&self) -> Vec<u64> {
        let mut delta = vec![0i128; self.coords + 1];
        for it in &self.items {
            delta[it.first as usize] += i128::from(it.bytes);
            delta[it.last as usize + 1] -= i128::from(it.bytes);
        }
        let mut live = 0i128;
        delta[..self.coords]
            .iter()
            .map(|d| {
                live += d;
                live as u64
            })
            .collect()
    }

    fn solve(&self) -> Vec<u64> {
        let mut search = Search::new(self);
        search.run();
        search.best.offsets
    }
}

/// Greedy placement of items in a given order, with reusable scratch space.
struct Placer<'a> {
    items: &'a [Item],
    slots: Vec<Slot>,
    offsets: Vec<u64>,
    /// Placed-buffer visits so far (see [`WORK_BUDGET`]).
    work: u64,
}

impl<'a> Placer<'a> {
    fn new(items: &'a [Item]) -> Placer<'a> {
        Placer {
            items,
            slots: Vec::with_capacity(items.len()),
            offsets: vec![0; items.len()],
            work: 0,
        }
    }

    /// Places `order[from..]` on top of `order[..from]`, which keep their current offsets.
    /// Returns the arena, or `None` as soon as a buffer would end above `cutoff`.
    fn place(&mut self, order: &[u32], from: usize, fit: Fit, cutoff: u64) -> Option<u64> {
        self.slots.clear();
        let mut arena = 0;
        for &k in &order[..from] {
            let (it, offset) = (self.items[k as usize], self.offsets[k as usize]);
            arena = arena.max(offset + it.bytes);
            self.slots.push(Slot {
                offset,
                end: offset + it.bytes,
                first: it.first,
                last: it.last,
            });
        }
        self.slots.sort_unstable_by_key(|s| s.offset);
        self.work += from as u64;
        for &k in &order[from..] {
            let it = self.items[k as usize];
            let (offset, seen) = find_gap(&self.slots, &it, fit);
            self.work += seen;
            let end = offset + it.bytes;
            if end > cutoff {
                return None;
            }
            arena = arena.max(end);
            self.offsets[k as usize] = offset;
            insert_slot(
                &mut self.slots,
                Slot {
                    offset,
                    end,
                    first: it.first,
                    last: it.last,
                },
            );
        }
        Some(arena)
    }
}

/// The whole heuristic search, keeping the best solution found.
struct Search<'a> {
    inst: &'a Instance,
    placer: Placer<'a>,
    best: Solution,
    /// The order whose first-fit placement gives `best` (the local search starts from it).
    best_order: Vec<u32>,
}

impl<'a> Search<'a> {
    fn new(inst: &'a Instance) -> Search<'a> {
        Search {
            inst,
            placer: Placer::new(&inst.items),
            best: Solution {
                offsets: Vec::new(),
                arena: u64::MAX,
            },
            best_order: Vec::new(),
        }
    }

    fn optimal(&self) -> bool {
        self.best.arena <= self.inst.lower_bound
    }

    fn budget_left(&self) -> bool {
        self.placer.work < WORK_BUDGET
    }

    /// Records the placer's current offsets if they beat the best.
    fn offer(&mut self, arena: u64, order: &[u32]) {
        if arena < self.best.arena {
            self.best = Solution {
                offsets: self.placer.offsets.clone(),
                arena,
            };
            self.best_order = order.to_vec();
        }
    }

    /// Re-places the best solution's items in offset order with first-fit. Each buffer then
    /// lands at or below its old offset (it fits there, as everything placed before it sits
    /// no higher than before), so this never hurts; it closes gaps best-fit left behind and
    /// yields the order the local search perturbs.
    fn settle(&mut self) {
        let mut order: Vec<u32> = (0..self.inst.items.len() as u32).collect();
        order.sort_by_key(|&k| (self.best.offsets[k as usize], k));
        let arena = self
            .placer
            .place(&order, 0, Fit::First, u64::MAX)
            .expect("no cutoff");
        debug_assert!(arena <= self.best.arena);
        self.best = Solution {
            offsets: self.placer.offsets.clone(),
            arena,
        };
        self.best_order = order;
    }

    fn run(&mut self) {
        let n = self.inst.items.len();
        for order in self.orderings() {
            for fit in [Fit::Best, Fit::First] {
                let cutoff = self.best.arena;
                if let Some(arena) = self.placer.place(&order, 0, fit, cutoff) {
                    self.offer(arena, &order);
                }
                if self.optimal() {
                    return;
                }
            }
        }
        for rule in SKYLINE_RULES {
            let offsets = skyline(&self.inst.items, self.inst.coords, rule);
            let arena = arena_of(&self.inst.items, &offsets);
            if arena < self.best.arena {
                let mut order: Vec<u32> = (0..n as u32).collect();
                order.sort_by_key(|&k| (offsets[k as usize], k));
                self.best = Solution { offsets, arena };
                self.best_order = order;
            }
            if self.optimal() {
                return;
            }
        }
        self.settle();
        if self.optimal() {
            return;
        }
        if n <= EXACT_MAX_BUFFERS {
            if let Some(better) = exact(&self.inst.items, self.inst.coords, self.best.arena) {
                self.best = better;
            }
            return;
        }
        self.local_search();
    }

    /// The greedy orderings tried, each a permutation of item indices.
    fn orderings(&self) -> Vec<Vec<u32>> {
        let items = &self.inst.items;
        let n = items.len() as u32;
        let sorted = |key: &dyn Fn(&Item) -> (u128, u128)| {
            let mut order: Vec<u32> = (0..n).collect();
            order.sort_by_key(|&k| (key(&items[k as usize]), k));
            order
        };
        let big = u128::MAX;
        // Breadth (TFLite's "greedy by breadth"): steps by decreasing live bytes, and at each
        // step its buffers by decreasing size. A buffer is first met at the hottest step of
        // its lifetime, so the order is (hottest step's rank, size).
        let breadth = self.inst.breadth();
        let mut steps: Vec<u32> = (0..self.inst.coords as u32).collect();
        steps.sort_by_key(|&c| (Reverse(breadth[c as usize]), c));
        let mut rank = vec![0u32; self.inst.coords];
        for (r, &c) in steps.iter().enumerate() {
            rank[c as usize] = r as u32;
        }
        let hottest = RangeMin::new(&rank);
        vec![
            // TFLite's order, so the local search can start from it too.
            sorted(&|it| (big - u128::from(it.bytes), big - u128::from(it.steps))),
            // Long-lived first: the activations a training step keeps for backward.
            sorted(&|it| (big - u128::from(it.steps), big - u128::from(it.bytes))),
            sorted(&|it| (big - u128::from(it.bytes) * u128::from(it.steps), 0)),
            // First use, longest first among equals: a stack for nested lifetimes.
            sorted(&|it| (u128::from(it.first), big - u128::from(it.last))),
            sorted(&|it| {
                let hot = hottest.min(it.first as usize, it.last as usize);
                (u128::from(hot), big - u128::from(it.bytes))
            }),
        ]
    }

    /// Iterated greedy over the placement order: take a buffer that reaches the top of the
    /// arena, move it to a random earlier place in the order, re-place everything from there
    /// (first-fit), and keep the change unless the arena grows. Equal arenas are accepted when
    /// fewer buffers touch the top, which is how a flat peak is worn down before it drops.
    fn local_search(&mut self) {
        let n = self.inst.items.len();
        let mut rng = SplitMix(SEED);
        let mut order = self.best_order.clone();
        let mut offsets = self.best.offsets.clone();
        let mut arena = self.best.arena;
        let mut tops = count_tops(&self.inst.items, &offsets, arena);
        let mut pos = vec![0usize; n];
        while self.budget_left() && !self.optimal() {
            for (p, &k) in order.iter().enumerate() {
                pos[k as usize] = p;
            }
            let top: Vec<u32> = (0..n as u32)
                .filter(|&k| offsets[k as usize] + self.inst.items[k as usize].bytes == arena)
                .collect();
            let x = top[rng.below(top.len())];
            let from = pos[x as usize];
            if from == 0 {
                // Already placed first: shake a random other buffer instead.
                let y = rng.below(n);
                let to = rng.below(n);
                let mut trial = order.clone();
                let v = trial.remove(y);
                trial.insert(to, v);
                self.try_order(trial, y.min(to), &mut order, &mut offsets, &mut arena, &mut tops);
                continue;
            }
            let to = rng.below(from);
            let mut trial = order.clone();
            let v = trial.remove(from);
            trial.insert(to, v);
            self.try_order(trial, to, &mut order, &mut offsets, &mut arena, &mut tops);
        }
    }

    fn try_order(
        &mut self,
        trial: Vec<u32>,
        from: usize,
        order: &mut Vec<u32>,
        offsets: &mut Vec<u64>,
        arena: &mut u64,
        tops: &mut usize,
    ) {
        self.placer.offsets.copy_from_slice(offsets);
        if let Some(a) = self.placer.place(&trial, from, Fit::First, *arena) {
            let t = count_tops(&self.inst.items, &self.placer.offsets, a);
            if a < *arena || t <= *tops {
                *arena = a;
                *tops = t;
                offsets.copy_from_slice(&self.placer.offsets);
                *order = trial;
                self.offer(a, order);
            }
        }
    }
}

fn arena_of(items: &[Item], offsets: &[u64]) -> u64 {
    items
        .iter()
        .zip(offsets)
        .map(|(it, &o)| o + it.bytes)
        .max()
        .unwrap_or(0)
}

fn count_tops(items: &[Item], offsets: &[u64], arena: u64) -> usize {
    items
        .iter()
        .zip(offsets)
        .filter(|(it, &o)| o + it.bytes == arena)
        .count()
}

/// Minimum over index ranges (sparse table).
struct RangeMin {
    levels: Vec<Vec<u32>>,
}

impl RangeMin {
    fn new(values: &[u32]) -> RangeMin {
        let mut levels = vec![values.to_vec()];
        let mut width = 1;
        while 2 * width <= values.len() {
            let prev = levels.last().expect("a level");
            let next: Vec<u32> = (0..prev.len() - width)
                .map(|i| prev[i].min(prev[i + width]))
                .collect();
            levels.push(next);
            width *= 2;
        }
        RangeMin { levels }
    }

    /// Minimum of `values[lo..=hi]`.
    fn min(&self, lo: usize, hi: usize) -> u32 {
        let level = (usize::BITS - 1 - (hi - lo + 1).leading_zeros()) as usize;
        let row = &self.levels[level];
        row[lo].min(row[hi + 1 - (1 << level)])
    }
}

/// How the skyline heuristic breaks ties between buffers that can sit equally low.
#[derive(Clone, Copy, Debug)]
enum SkylineRule {
    /// Longest lifetime first, then largest.
    Longest,
    /// Largest first, then longest lifetime.
    Largest,
}

const SKYLINE_RULES: [SkylineRule; 2] = [SkylineRule::Longest, SkylineRule::Largest];

/// Repeatedly places the unplaced buffer that can sit lowest. Offsets then never decrease
/// from one placement to the next, so above the current level every step holds at most one
/// placed buffer: the lowest place for a buffer is the highest top ("skyline") over its
/// lifetime. The heap holds stale levels, which only ever rise; a popped buffer whose level
/// is still current is the true minimum.
fn skyline(items: &[Item], coords: usize, rule: SkylineRule) -> Vec<u64> {
    let mut sky = MaxTree::new(coords);
    let tie = |it: &Item| match rule {
        SkylineRule::Longest => (it.steps, it.bytes),
        SkylineRule::Largest => (it.bytes, it.steps),
    };
    let mut heap: BinaryHeap<(Reverse<u64>, (u64, u64), Reverse<u32>)> = items
        .iter()
        .enumerate()
        .map(|(k, it)| (Reverse(0), tie(it), Reverse(k as u32)))
        .collect();
    let mut offsets = vec![0u64; items.len()];
    while let Some((Reverse(level), t, Reverse(k))) = heap.pop() {
        let it = items[k as usize];
        let now = sky.max(it.first as usize, it.last as usize);
        if now > level {
            heap.push((Reverse(now), t, Reverse(k)));
            continue;
        }
        offsets[k as usize] = level;
        sky.raise(it.first as usize, it.last as usize, level + it.bytes);
    }
    offsets
}

/// Range "raise to at least v" and range maximum over compressed time.
struct MaxTree {
    n: usize,
    /// Maximum over the node's range.
    max: Vec<u64>,
    /// A raise that covers the node's whole range.
    tag: Vec<u64>,
}

impl MaxTree {
    fn new(n: usize) -> MaxTree {
        MaxTree {
            n,
            max: vec![0; 4 * n.max(1)],
            tag: vec![0; 4 * n.max(1)],
        }
    }

    fn raise(&mut self, lo: usize, hi: usize, v: u64) {
        self.raise_at(1, 0, self.n - 1, lo, hi, v);
    }

    fn raise_at(&mut self, node: usize, l: usize, r: usize, lo: usize, hi: usize, v: u64) {
        if hi < l || r < lo {
            return;
        }
        self.max[node] = self.max[node].max(v);
        if lo <= l && r <= hi {
            self.tag[node] = self.tag[node].max(v);
            return;
        }
        let m = (l + r) / 2;
        self.raise_at(2 * node, l, m, lo, hi, v);
        self.raise_at(2 * node + 1, m + 1, r, lo, hi, v);
    }

    fn max(&self, lo: usize, hi: usize) -> u64 {
        self.max_at(1, 0, self.n - 1, lo, hi)
    }

    fn max_at(&self, node: usize, l: usize, r: usize, lo: usize, hi: usize) -> u64 {
        if hi < l || r < lo {
            return 0;
        }
        if lo <= l && r <= hi {
            return self.max[node];
        }
        let m = (l + r) / 2;
        self.tag[node]
            .max(self.max_at(2 * node, l, m, lo, hi))
            .max(self.max_at(2 * node + 1, m + 1, r, lo, hi))
    }
}

/// Deterministic pseudo-random numbers (SplitMix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

/// Branch and bound for a packing with an arena below `incumbent`; `None` when there is
/// none or the node budget ran out first.
///
/// Why it can search placement orders with first-fit only, and few of them: take an optimal
/// packing with the smallest sum of offsets. Placing its buffers in order of (offset, index)
/// with first-fit puts each at or below its offset (the spot is free: everything placed
/// earlier that meets it in time ends no higher than before), and minimality makes that
/// "at". So some sequence with non-decreasing (offset, index) reproduces an optimum, and
/// the search only extends a sequence with a buffer whose first-fit offset is at least the
/// last one's. Above that level each step holds at most one placed buffer, which gives the
/// bound: every unplaced buffer lies above the level and above what occupies it.
fn exact(items: &[Item], coords: usize, incumbent: u64) -> Option<Solution> {
    let n = items.len();
    debug_assert!(n <= 32);
    // Buffers identical to an earlier one are placed after it (swapping them changes
    // nothing), which removes symmetric branches.
    let twin: Vec<Option<usize>> = (0..n)
        .map(|c| {
            (0..c).rev().find(|&d| {
                items[d].bytes == items[c].bytes
                    && items[d].first == items[c].first
                    && items[d].last == items[c].last
            })
        })
        .collect();
    let live: Vec<u32> = (0..coords)
        .map(|t| {
            (0..n)
                .filter(|&k| items[k].first as usize <= t && t <= items[k].last as usize)
                .fold(0u32, |m, k| m | 1 << k)
        })
        .collect();
    let mut bnb = Bnb {
        items,
        twin,
        live,
        offsets: vec![0; n],
        placed: Vec::with_capacity(n),
        best: incumbent,
        best_offsets: None,
        nodes: 0,
    };
    bnb.descend(0, 0, None, 0);
    bnb.best_offsets.map(|offsets| Solution {
        offsets,
        arena: bnb.best,
    })
}

struct Bnb<'a> {
    items: &'a [Item],
    twin: Vec<Option<usize>>,
    /// Items live at each compressed coordinate, as bit sets.
    live: Vec<u32>,
    offsets: Vec<u64>,
    /// Placed items in placement order, which is non-decreasing offset order.
    placed: Vec<usize>,
    best: u64,
    best_offsets: Option<Vec<u64>>,
    nodes: u64,
}

impl Bnb<'_> {
    fn first_fit(&self, c: usize) -> u64 {
        let it = &self.items[c];
        let mut prev_end = 0;
        for &k in &self.placed {
            let p = &self.items[k];
            if !p.meets(it) {
                continue;
            }
            let o = self.offsets[k];
            if o >= prev_end && o - prev_end >= it.bytes {
                return prev_end;
            }
            prev_end = prev_end.max(o + p.bytes);
        }
        prev_end
    }

    /// `mask`: placed items; `level`/`last`: offset and index of the last placement.
    fn descend(&mut self, mask: u32, level: u64, last: Option<usize>, arena: u64) {
        let n = self.items.len();
        if self.placed.len() == n {
            if arena < self.best {
                self.best = arena;
                self.best_offsets = Some(self.offsets.clone());
            }
            return;
        }
        self.nodes += 1;
        if self.nodes > EXACT_NODE_BUDGET {
            return;
        }
        let mut bound = arena;
        let mut candidates: Vec<(u64, usize)> = Vec::with_capacity(n);
        for c in 0..n {
            if mask & 1 << c != 0 {
                continue;
            }
            let ff = self.first_fit(c);
            let size = self.items[c].bytes;
            if ff < level {
                if ff + size <= level {
                    // A gap below the level that nothing placed later can close: this
                    // buffer could never be placed in non-decreasing order.
                    return;
                }
                bound = bound.max(level + size);
                continue;
            }
            bound = bound.max(ff + size);
            let after_last = ff > level || last.is_none_or(|l| c > l);
            let twin_placed = self.twin[c].is_none_or(|d| mask & 1 << d != 0);
            if after_last && twin_placed {
                candidates.push((ff, c));
            }
        }
        for (t, &m) in self.live.iter().enumerate() {
            let unplaced = m & !mask;
            if unplaced == 0 {
                continue;
            }
            let mut need = 0;
            let mut top = level;
            for k in 0..n {
                let bit = 1u32 << k;
                if unplaced & bit != 0 {
                    need += self.items[k].bytes;
                } else if m & bit != 0 {
                    top = top.max(self.offsets[k] + self.items[k].bytes);
                }
            }
            let _ = t;
            bound = bound.max(top + need);
        }
        if bound >= self.best {
            return;
        }
        candidates.sort_unstable();
        for (ff, c) in candidates {
            self.offsets[c] = ff;
            self.placed.push(c);
            let end = ff + self.items[c].bytes;
            self.descend(mask | 1 << c, ff, Some(c), arena.max(end));
            self.placed.pop();
            if self.nodes > EXACT_NODE_BUDGET {
                return;
            }
        }
    }
}
