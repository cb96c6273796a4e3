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
const WORK_BUDGET: u64 = 30_000_000;

/// Small instances get at most this many full greedy passes' worth of work (a pass visits
/// about n²/2 placed buffers), so that one whose lower bound cannot be met stops early.
const BUDGET_PASSES: u64 = 2000;

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
    // Requests of zero bytes stay in: TFLite places them too, and, sorted last, they can
    // only split gaps other zero-byte requests see.
    let instance = Instance::new(reqs, align, true);
    let order = tflite_order(&instance.items);
    let mut placer = Placer::new(&instance.items);
    placer.place(&order, 0, Fit::Best, u64::MAX);
    let mut offsets = vec![0u64; reqs.len()];
    for (k, &i) in instance.index.iter().enumerate() {
        offsets[i] = placer.offsets[k];
    }
    let arena_bytes = arena_bytes(reqs, &offsets);
    Packing {
        offsets,
        arena_bytes,
    }
}

/// TFLite's order: non-increasing size; equal sizes in request order (TFLite's `std::sort`
/// leaves them unspecified).
fn tflite_order(items: &[Item]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..items.len() as u32).collect();
    order.sort_by_key(|&k| Reverse(items[k as usize].bytes));
    order
}

fn arena_bytes(reqs: &[BufferRequest], offsets: &[u64]) -> u64 {
    reqs.iter()
        .zip(offsets)
        .map(|(r, &o)| o + r.bytes)
        .max()
        .unwrap_or(0)
}

/// The planner's packing: the best of TFLite's greedy-by-size, several other greedy
/// orderings, a skyline heuristic, a local search and, for small instances, an exact search.
/// Offsets are multiples of `alignment` (requests of zero bytes get offset 0); the result is
/// deterministic and its arena is never larger than [`greedy_by_size`]'s.
///
/// # Panics
/// When a request has `first > last`.
pub fn pack(reqs: &[BufferRequest], alignment: u64) -> Packing {
    check_lifetimes(reqs);
    let align = alignment.max(1);
    // Zero-byte requests overlap nothing; they keep offset 0.
    let instance = Instance::new(reqs, align, false);
    let mut offsets = vec![0u64; reqs.len()];
    if instance.items.is_empty() {
        return Packing {
            offsets,
            arena_bytes: 0,
        };
    }
    let mut search = Search::new(&instance);
    search.run();
    // Sizes not a multiple of the alignment were rounded up inside; compare with TFLite's
    // packing on the real sizes, so that the promise holds for them too.
    let mut best = None;
    for candidate in [&search.best.offsets, &search.tflite] {
        for (k, &i) in instance.index.iter().enumerate() {
            offsets[i] = candidate[k];
        }
        let arena_bytes = arena_bytes(reqs, &offsets);
        if best
            .as_ref()
            .is_none_or(|b: &Packing| arena_bytes < b.arena_bytes)
        {
            best = Some(Packing {
                offsets: offsets.clone(),
                arena_bytes,
            });
        }
    }
    best.expect("two candidates")
}

/// The smallest arena any packing of `reqs` can have, with offsets that achieve it, found
/// by branch and bound (sizes rounded up to `alignment`); `None` when there are more than
/// 32 non-empty requests or the search cannot finish within its node budget. [`pack`] runs
/// the same search on instances of at most [`EXACT_MAX_BUFFERS`] buffers that its
/// heuristics leave above the lower bound.
///
/// # Panics
/// When a request has `first > last`.
pub fn pack_exact(reqs: &[BufferRequest], alignment: u64) -> Option<Packing> {
    check_lifetimes(reqs);
    let instance = Instance::new(reqs, alignment.max(1), false);
    if instance.items.len() > 32 {
        return None;
    }
    let mut offsets = vec![0u64; reqs.len()];
    if !instance.items.is_empty() {
        let (best, finished) = exact(&instance.items, instance.coords, u64::MAX);
        let best = best.filter(|_| finished)?;
        for (k, &i) in instance.index.iter().enumerate() {
            offsets[i] = best.offsets[k];
        }
    }
    let arena_bytes = arena_bytes(reqs, &offsets);
    Some(Packing {
        offsets,
        arena_bytes,
    })
}

fn check_lifetimes(reqs: &[BufferRequest]) {
    for (i, r) in reqs.iter().enumerate() {
        assert!(r.first <= r.last, "buffer {i} has first {} > last {}", r.first, r.last);
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

/// Placed buffers ordered by offset, in chunks: a greedy pass inserts every buffer once,
/// and shifting a chunk instead of the whole list keeps insertion cheap at thousands of
/// buffers.
struct SlotList {
    chunks: Vec<Vec<Slot>>,
}

/// A chunk splits in two when it grows past this many slots.
const CHUNK: usize = 128;

impl SlotList {
    fn new() -> SlotList {
        SlotList { chunks: Vec::new() }
    }

    /// Replaces the contents with `slots`, which must be ordered by offset.
    fn rebuild(&mut self, slots: &[Slot]) {
        self.chunks.clear();
        self.chunks
            .extend(slots.chunks(CHUNK / 2).map(|c| c.to_vec()));
    }

    /// After every slot with an offset at or below the new one (TFLite's position).
    fn insert(&mut self, slot: Slot) {
        let c = self
            .chunks
            .partition_point(|ch| ch[0].offset <= slot.offset)
            .saturating_sub(1);
        let Some(chunk) = self.chunks.get_mut(c) else {
            self.chunks.push(vec![slot]);
            return;
        };
        let at = chunk.partition_point(|s| s.offset <= slot.offset);
        chunk.insert(at, slot);
        if chunk.len() > CHUNK {
            let tail = chunk.split_off(CHUNK / 2);
            self.chunks.insert(c + 1, tail);
        }
    }

    /// The offset `item` gets, and the number of slots looked at.
    ///
    /// A gap is the space between the highest end so far of slots whose lifetimes meet the
    /// item's and the next such slot's offset; slots that do not meet it are skipped. The
    /// loops avoid branching on which slots meet the item: half of them do, unpredictably.
    fn find(&self, item: &Item, fit: Fit) -> (u64, u64) {
        let (first, last, need) = (item.first, item.last, item.bytes);
        let mut prev_end = 0u64;
        let mut seen = 0u64;
        match fit {
            Fit::First => {
                for chunk in &self.chunks {
                    for s in chunk {
                        let meets = (s.last >= first) & (s.first <= last);
                        // Every later slot starts at or above `s.offset`: the gap stays free.
                        if meets & (s.offset >= prev_end.saturating_add(need)) {
                            return (prev_end, seen + 1);
                        }
                        seen += 1;
                        prev_end = prev_end.max(if meets { s.end } else { 0 });
                    }
                }
                (prev_end, seen)
            }
            Fit::Best => {
                let (mut best_gap, mut best_offset) = (u64::MAX, u64::MAX);
                for chunk in &self.chunks {
                    for s in chunk {
                        let meets = (s.last >= first) & (s.first <= last);
                        let gap = s.offset.wrapping_sub(prev_end);
                        let better =
                            meets & (s.offset >= prev_end) & (gap >= need) & (gap < best_gap);
                        best_offset = if better { prev_end } else { best_offset };
                        best_gap = if better { gap } else { best_gap };
                        seen += 1;
                        // A gap of exactly the right size is the smallest there can be.
                        if best_gap == need {
                            return (best_offset, seen);
                        }
                        prev_end = prev_end.max(if meets { s.end } else { 0 });
                    }
                }
                if best_gap == u64::MAX {
                    (prev_end, seen)
                } else {
                    (best_offset, seen)
                }
            }
        }
    }
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
    fn new(reqs: &[BufferRequest], align: u64, with_empty: bool) -> Instance {
        let index: Vec<usize> = (0..reqs.len())
            .filter(|&i| with_empty || reqs[i].bytes > 0)
            .collect();
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
}

/// Greedy placement of items in a given order, with reusable scratch space.
struct Placer<'a> {
    items: &'a [Item],
    slots: SlotList,
    /// Scratch for rebuilding `slots` from a prefix.
    prefix: Vec<Slot>,
    offsets: Vec<u64>,
    /// Placed-buffer visits so far (see [`WORK_BUDGET`]).
    work: u64,
}

impl<'a> Placer<'a> {
    fn new(items: &'a [Item]) -> Placer<'a> {
        Placer {
            items,
            slots: SlotList::new(),
            prefix: Vec::with_capacity(items.len()),
            offsets: vec![0; items.len()],
            work: 0,
        }
    }

    /// Places `order[from..]` on top of `order[..from]`, which keep their current offsets.
    /// Returns the arena, or `None` as soon as a buffer would end above `cutoff`.
    fn place(&mut self, order: &[u32], from: usize, fit: Fit, cutoff: u64) -> Option<u64> {
        let mut arena = 0;
        self.prefix.clear();
        for &k in &order[..from] {
            let (it, offset) = (self.items[k as usize], self.offsets[k as usize]);
            arena = arena.max(offset + it.bytes);
            self.prefix.push(Slot {
                offset,
                end: offset + it.bytes,
                first: it.first,
                last: it.last,
            });
        }
        self.prefix.sort_unstable_by_key(|s| s.offset);
        self.slots.rebuild(&self.prefix);
        // Sorting and rebuilding, in the budget's unit.
        self.work += from as u64 * (1 + u64::from(usize::BITS - from.leading_zeros()));
        for &k in &order[from..] {
            let it = self.items[k as usize];
            let (offset, seen) = self.slots.find(&it, fit);
            self.work += seen + CHUNK as u64 / 4;
            let end = offset + it.bytes;
            if end > cutoff {
                return None;
            }
            arena = arena.max(end);
            self.offsets[k as usize] = offset;
            self.slots.insert(Slot {
                offset,
                end,
                first: it.first,
                last: it.last,
            });
        }
        Some(arena)
    }
}

/// The whole heuristic search, keeping the best solution found.
struct Search<'a> {
    inst: &'a Instance,
    placer: Placer<'a>,
    best: Solution,
    /// TFLite's greedy-by-size packing, which `pack` must never lose to.
    tflite: Vec<u64>,
    /// Which stage found `best` (for tracing while tuning).
    stage: &'static str,
    /// Work allowed in all (see [`WORK_BUDGET`]).
    budget: u64,
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
            tflite: Vec::new(),
            stage: "",
            budget: {
                let n = inst.items.len() as u64;
                let b = WORK_BUDGET.min(BUDGET_PASSES / 2 * n * n);
                std::env::var("MEMWISE_PACK_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(b)
            },
        }
    }

    fn optimal(&self) -> bool {
        std::env::var_os("MEMWISE_PACK_TRACE2").is_none() && self.best.arena <= self.inst.lower_bound
    }

    /// Keeps `offsets` if they beat the best.
    fn offer(&mut self, offsets: &[u64], arena: u64, stage: &'static str) {
        if arena < self.best.arena {
            self.best = Solution {
                offsets: offsets.to_vec(),
                arena,
            };
            self.stage = stage;
        }
    }

    fn run(&mut self) {
        let n = self.inst.items.len();
        let tflite = tflite_order(&self.inst.items);
        let arena = self.placer.place(&tflite, 0, Fit::Best, u64::MAX);
        self.tflite = self.placer.offsets.clone();
        let offsets = self.tflite.clone();
        self.offer(&offsets, arena.expect("no cutoff"), "tflite");
        // Constructions, most useful first (measured on the synthetic training steps); they
        // may take part of the budget, the local search gets the rest.
        let orders = self.orders();
        let constructions = [
            Construction::Greedy(Order::Breadth, Fit::First),
            Construction::Skyline(SkylineRule::Longest),
            Construction::Skyline(SkylineRule::Largest),
            Construction::Greedy(Order::Size, Fit::First),
            Construction::Greedy(Order::Area, Fit::First),
            Construction::Greedy(Order::Span, Fit::First),
            Construction::Greedy(Order::Breadth, Fit::Best),
        ];
        for construction in constructions {
            if self.optimal() || (self.placer.work >= self.budget / 2 && std::env::var_os("MEMWISE_PACK_TRACE2").is_none()) {
                break;
            }
            match construction {
                Construction::Skyline(rule) => {
                    let offsets = skyline(
                        &self.inst.items,
                        self.inst.coords,
                        rule,
                        self.budget / 5,
                        &mut self.placer.work,
                    );
                    let arena = arena_of(&self.inst.items, &offsets);
                    trace2(&format!("skyline/{rule:?}"), arena, self.inst.lower_bound);
                    self.offer(&offsets, arena, "skyline");
                }
                Construction::Greedy(order, fit) => {
                    let order_ = &orders[order as usize];
                    let cutoff = if std::env::var_os("MEMWISE_PACK_TRACE2").is_some() { u64::MAX } else { self.best.arena };
                    if let Some(arena) = self.placer.place(order_, 0, fit, cutoff) {
                        trace2(&format!("{order:?}/{fit:?}"), arena, self.inst.lower_bound);
                        let offsets = std::mem::take(&mut self.placer.offsets);
                        self.offer(&offsets, arena, "greedy");
                        self.placer.offsets = offsets;
                    }
                }
            }
        }
        self.settle();
        if self.optimal() {
            return self.trace();
        }
        if n <= EXACT_MAX_BUFFERS {
            let incumbent = self.best.arena;
            if let (Some(better), _) = exact(&self.inst.items, self.inst.coords, incumbent) {
                self.best = better;
                self.stage = "exact";
            }
            return self.trace();
        }
        if std::env::var_os("MEMWISE_PACK_TRACE").is_some() {
            eprintln!(
                "before local: work={} best={}",
                self.placer.work, self.best.arena
            );
        }
        self.local_search();
        self.trace();
    }

    fn trace(&self) {
        if std::env::var_os("MEMWISE_PACK_TRACE").is_some() {
            eprintln!("iters={} fails={} ruin_total={}", DBG_ITERS.with(|c| c.get()), DBG_FAIL.with(|c| c.get()), DBG_RUIN.with(|c| c.get()));
            eprintln!(
                "pack n={} lb={} best={} ({:.5}) by {} work={}",
                self.inst.items.len(),
                self.inst.lower_bound,
                self.best.arena,
                self.best.arena as f64 / self.inst.lower_bound as f64,
                self.stage,
                self.placer.work
            );
        }
    }

    /// Re-places the best solution's items in offset order with first-fit. Each buffer then
    /// lands at or below its old offset (it fits there, as everything placed before it sits
    /// no higher than before), so this never hurts; it closes gaps best-fit left behind.
    fn settle(&mut self) {
        let order = offset_order(&self.best.offsets);
        let arena = self.placer.place(&order, 0, Fit::First, u64::MAX);
        let arena = arena.expect("no cutoff");
        debug_assert!(arena <= self.best.arena);
        self.best = Solution {
            offsets: self.placer.offsets.clone(),
            arena,
        };
    }

    /// The greedy orders, indexed by [`Order`].
    fn orders(&self) -> [Vec<u32>; 4] {
        let items = &self.inst.items;
        let n = items.len() as u32;
        let sorted = |key: &dyn Fn(&Item) -> (Reverse<u128>, u128)| {
            let mut order: Vec<u32> = (0..n).collect();
            order.sort_by_key(|&k| (key(&items[k as usize]), k));
            order
        };
        // A buffer is first met, walking the steps by decreasing live bytes, at the hottest
        // step of its lifetime.
        let breadth = self.inst.breadth();
        let mut steps: Vec<u32> = (0..self.inst.coords as u32).collect();
        steps.sort_by_key(|&c| (Reverse(breadth[c as usize]), c));
        let mut rank = vec![0u32; self.inst.coords];
        for (r, &c) in steps.iter().enumerate() {
            rank[c as usize] = r as u32;
        }
        let hottest = RangeMin::new(&rank);
        let wide = |hi: u64, lo: u64| u128::from(hi) << 64 | u128::from(lo);
        [
            sorted(&|it| (Reverse(wide(it.bytes, it.steps)), 0)),
            sorted(&|it| (Reverse(wide(it.steps, it.bytes)), 0)),
            sorted(&|it| (Reverse(u128::from(it.bytes) * u128::from(it.steps)), 0)),
            sorted(&|it| {
                let hot = hottest.min(it.first as usize, it.last as usize);
                (Reverse(u128::from(u32::MAX - hot)), u128::MAX - u128::from(it.bytes))
            }),
        ]
    }

    /// Ruin and recreate: take a buffer that reaches the top of the arena, lift out the
    /// buffers that meet a random time window around it and end above a random level, and
    /// put them back (first-fit or best-fit, in a randomly chosen and shaken order) around
    /// the buffers left in place. Keep the result unless the arena grows; equal arenas are
    /// kept unless more buffers touch the top, which is how a flat peak is worn down before
    /// it drops. Each try costs the lifted buffers times the placed ones, not a full pass.
    fn local_search(&mut self) {
        let items = &self.inst.items;
        let n = items.len();
        let coords = self.inst.coords;
        let mut rng = SplitMix(SEED);
        let mut offsets = self.best.offsets.clone();
        let mut arena = self.best.arena;
        let mut tops = count_tops(items, &offsets, arena);
        let mut by_offset = offset_order(&offsets);
        let mut lifted = vec![false; n];
        let mut ruin: Vec<u32> = Vec::new();
        let mut kept: Vec<Slot> = Vec::with_capacity(n);
        let mut slots = SlotList::new();
        let mut trial = offsets.clone();
        let budget = self.budget;
        while self.placer.work < budget && arena > self.inst.lower_bound {
            self.placer.work += 4 * n as u64;
            // The buffer to lower, and the window and level of the ruin.
            let top: Vec<u32> = (0..n as u32)
                .filter(|&k| offsets[k as usize] + items[k as usize].bytes == arena)
                .collect();
            let x = items[top[rng.below(top.len())] as usize];
            let reach = 1 + rng.below(coords.min(64));
            let lo = (x.first as usize).saturating_sub(rng.below(reach)) as u32;
            let hi = (x.last as usize + rng.below(reach)).min(coords - 1) as u32;
            let window = Item {
                first: lo,
                last: hi,
                ..x
            };
            // Lift buffers that meet the window and stay near it: one that lives far beyond
            // is a band across the whole window, as good where it is as anywhere else.
            let (near_lo, near_hi) = (lo.saturating_sub(reach as u32), hi + reach as u32);
            let meeting: Vec<u32> = (0..n as u32)
                .filter(|&k| {
                    let it = &items[k as usize];
                    it.meets(&window) && it.first >= near_lo && it.last <= near_hi
                })
                .collect();
            let level = if rng.below(3) == 0 {
                0
            } else {
                offsets[meeting[rng.below(meeting.len())] as usize]
            };
            ruin.clear();
            ruin.extend(meeting.iter().copied().filter(|&k| {
                let k = k as usize;
                offsets[k] + items[k].bytes > level
            }));
            // Only buffers that meet some lifted one can be in the way of re-placing them.
            let mut span = Item {
                first: u32::MAX,
                last: 0,
                ..x
            };
            for &k in &ruin {
                let it = items[k as usize];
                lifted[k as usize] = true;
                span.first = span.first.min(it.first);
                span.last = span.last.max(it.last);
            }
            kept.clear();
            let mut new_arena = 0;
            for &k in &by_offset {
                let (it, o) = (items[k as usize], offsets[k as usize]);
                if lifted[k as usize] {
                    continue;
                }
                new_arena = new_arena.max(o + it.bytes);
                if it.meets(&span) {
                    kept.push(Slot {
                        offset: o,
                        end: o + it.bytes,
                        first: it.first,
                        last: it.last,
                    });
                }
            }
            slots.rebuild(&kept);
            // Recreate in a random one of the greedy orders, shaken by a few swaps.
            let key = rng.below(4);
            ruin.sort_by_key(|&k| {
                let it = items[k as usize];
                match key {
                    0 => (Reverse(u128::from(it.bytes)), k),
                    1 => (
                        Reverse(u128::from(it.steps) << 64 | u128::from(it.bytes)),
                        k,
                    ),
                    2 => (Reverse(u128::from(it.bytes) * u128::from(it.steps)), k),
                    _ => (Reverse(u128::MAX - u128::from(offsets[k as usize])), k),
                }
            });
            for _ in 0..rng.below(3) {
                let (a, b) = (rng.below(ruin.len()), rng.below(ruin.len()));
                ruin.swap(a, b);
            }
            let fit = if rng.below(2) == 0 {
                Fit::First
            } else {
                Fit::Best
            };
            let mut ok = true;
            for &k in &ruin {
                let it = items[k as usize];
                let (o, seen) = slots.find(&it, fit);
                self.placer.work += seen + CHUNK as u64 / 4;
                if o + it.bytes > arena {
                    ok = false;
                    break;
                }
                new_arena = new_arena.max(o + it.bytes);
                trial[k as usize] = o;
                slots.insert(Slot {
                    offset: o,
                    end: o + it.bytes,
                    first: it.first,
                    last: it.last,
                });
            }
            for &k in &ruin {
                lifted[k as usize] = false;
            }
            if !ok {
                DBG_FAIL.with(|c| c.set(c.get() + 1));
                for &k in &ruin {
                    trial[k as usize] = offsets[k as usize];
                }
                continue;
            }
            DBG_ITERS.with(|c| c.set(c.get() + 1));
            DBG_RUIN.with(|c| c.set(c.get() + ruin.len()));
            let t = count_tops(items, &trial, new_arena);
            if new_arena < arena || t <= tops {
                arena = new_arena;
                tops = t;
                offsets.copy_from_slice(&trial);
                by_offset.sort_by_key(|&k| (offsets[k as usize], k));
                self.placer.work += 8 * n as u64;
                if arena < self.best.arena {
                    self.best = Solution {
                        offsets: offsets.clone(),
                        arena,
                    };
                    self.stage = "local";
                }
            } else {
                trial.copy_from_slice(&offsets);
            }
        }
    }
}

/// Item indices by (offset, index): with first-fit this order reproduces a packing or
/// lowers it (see [`Search::settle`]).
fn offset_order(offsets: &[u64]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..offsets.len() as u32).collect();
    order.sort_by_key(|&k| (offsets[k as usize], k));
    order
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

/// A way to build a packing from scratch.
#[derive(Clone, Copy, Debug)]
enum Construction {
    Skyline(SkylineRule),
    Greedy(Order, Fit),
}

/// Greedy placement orders (ties: request order).
#[derive(Clone, Copy, Debug)]
enum Order {
    /// Largest first, longest-lived among equals.
    Size,
    /// Longest-lived first, largest among equals: the activations kept for backward.
    Span,
    /// Largest bytes × steps first.
    Area,
    /// TFLite's "greedy by breadth": steps by decreasing live bytes, each step's buffers by
    /// decreasing size.
    Breadth,
}

fn trace2(what: &str, arena: u64, lb: u64) {
    if std::env::var_os("MEMWISE_PACK_TRACE2").is_some() {
        eprintln!("STAGE {what} {:.5}", arena as f64 / lb as f64);
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

/// Work units one heap pop of the skyline heuristic costs (a heap operation and a tree
/// query, each logarithmic), relative to one placed-buffer visit.
const SKYLINE_POP_WORK: u64 = 24;

/// Repeatedly places the unplaced buffer that can sit lowest. Offsets then never decrease
/// from one placement to the next, so above the current level every step holds at most one
/// placed buffer: the lowest place for a buffer is the highest top ("skyline") over its
/// lifetime. The heap holds stale levels, which only ever rise; a popped buffer whose level
/// is still current is the true minimum.
///
/// Placing a long-lived buffer makes every pending buffer under it stale, so nested
/// lifetimes cost a number of pops quadratic in the buffers. When `budget` work runs out,
/// the buffers still pending are placed by best-fit in TFLite's order instead.
fn skyline(items: &[Item], coords: usize, rule: SkylineRule, budget: u64, work: &mut u64) -> Vec<u64> {
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
    let mut placed = vec![false; items.len()];
    let start = *work;
    while let Some((Reverse(level), t, Reverse(k))) = heap.pop() {
        *work += SKYLINE_POP_WORK;
        if *work - start > budget {
            break;
        }
        let it = items[k as usize];
        let now = sky.max(it.first as usize, it.last as usize);
        if now > level {
            heap.push((Reverse(now), t, Reverse(k)));
            continue;
        }
        offsets[k as usize] = level;
        placed[k as usize] = true;
        sky.raise(it.first as usize, it.last as usize, level + it.bytes);
    }
    if placed.iter().all(|&p| p) {
        return offsets;
    }
    let mut slots: Vec<Slot> = (0..items.len())
        .filter(|&k| placed[k])
        .map(|k| Slot {
            offset: offsets[k],
            end: offsets[k] + items[k].bytes,
            first: items[k].first,
            last: items[k].last,
        })
        .collect();
    slots.sort_unstable_by_key(|s| s.offset);
    let mut list = SlotList::new();
    list.rebuild(&slots);
    for k in tflite_order(items) {
        let k = k as usize;
        if placed[k] {
            continue;
        }
        let (offset, seen) = list.find(&items[k], Fit::Best);
        *work += seen + CHUNK as u64 / 4;
        offsets[k] = offset;
        list.insert(Slot {
            offset,
            end: offset + items[k].bytes,
            first: items[k].first,
            last: items[k].last,
        });
    }
    offsets
}

/// Range "raise to at least v" and range maximum over compressed time (a bottom-up segment
/// tree: raises commute, so they need no pushing down).
struct MaxTree {
    size: usize,
    /// Maximum over the node's range, raises of ancestors excluded.
    max: Vec<u64>,
    /// Raises that covered an inner node's whole range.
    tag: Vec<u64>,
}

impl MaxTree {
    fn new(n: usize) -> MaxTree {
        let size = n.next_power_of_two();
        MaxTree {
            size,
            max: vec![0; 2 * size],
            tag: vec![0; size],
        }
    }

    /// Raises `lo..=hi` to at least `v`.
    fn raise(&mut self, lo: usize, hi: usize, v: u64) {
        let (mut l, mut r) = (lo + self.size, hi + self.size + 1);
        while l < r {
            if l & 1 == 1 {
                self.apply(l, v);
                l += 1;
            }
            if r & 1 == 1 {
                r -= 1;
                self.apply(r, v);
            }
            l >>= 1;
            r >>= 1;
        }
        // Every node that meets the range but is not covered by it lies above one of its
        // two ends.
        for leaf in [lo + self.size, hi + self.size] {
            let mut p = leaf >> 1;
            while p > 0 {
                self.max[p] = self.max[p].max(v);
                p >>= 1;
            }
        }
    }

    fn apply(&mut self, p: usize, v: u64) {
        self.max[p] = self.max[p].max(v);
        if p < self.size {
            self.tag[p] = self.tag[p].max(v);
        }
    }

    /// Maximum of `lo..=hi`.
    fn max(&self, lo: usize, hi: usize) -> u64 {
        let mut best = 0;
        let (mut l, mut r) = (lo + self.size, hi + self.size + 1);
        while l < r {
            if l & 1 == 1 {
                best = best.max(self.max[l]);
                l += 1;
            }
            if r & 1 == 1 {
                r -= 1;
                best = best.max(self.max[r]);
            }
            l >>= 1;
            r >>= 1;
        }
        // Raises recorded above the covering nodes: all on the paths from the two ends.
        for leaf in [lo + self.size, hi + self.size] {
            let mut p = leaf >> 1;
            while p > 0 {
                best = best.max(self.tag[p]);
                p >>= 1;
            }
        }
        best
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

/// Branch and bound for a packing with an arena below `incumbent`: the best found (`None`
/// when none is below it), and whether the search finished, proving it optimal, within the
/// node budget.
///
/// Why it can search placement orders with first-fit only, and few of them: take an optimal
/// packing with the smallest sum of offsets. Placing its buffers in order of (offset, index)
/// with first-fit puts each at or below its offset (the spot is free: everything placed
/// earlier that meets it in time ends no higher than before), and minimality makes that
/// "at". So some sequence with non-decreasing (offset, index) reproduces an optimum, and
/// the search only extends a sequence with a buffer whose first-fit offset is at least the
/// last one's. Above that level each step holds at most one placed buffer, which gives the
/// bound: every unplaced buffer lies above the level and above what occupies it.
fn exact(items: &[Item], coords: usize, incumbent: u64) -> (Option<Solution>, bool) {
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
    let finished = bnb.nodes <= EXACT_NODE_BUDGET;
    let best = bnb.best_offsets.map(|offsets| Solution {
        offsets,
        arena: bnb.best,
    });
    (best, finished)
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

thread_local! {
    static DBG_ITERS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static DBG_FAIL: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static DBG_RUIN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}
