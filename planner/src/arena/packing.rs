//! Offsets for the transient tensors of one training step in a single arena: TFLite's
//! greedy-by-size baseline, and the planner's packer, which is never worse than it.
//!
//! Giving buffers with fixed lifetimes offsets so that the arena is as small as possible is
//! *dynamic storage allocation*, which is NP-hard. No packing can beat [`lower_bound`], the
//! most bytes live at any one step, so that is the yardstick. [`pack`] runs, until a packing
//! meets the lower bound:
//!
//! 1. TFLite's greedy-by-size, the baseline it keeps if nothing beats it;
//! 2. other constructions: greedy placement (each buffer, in some order, into a gap left by
//!    the placed buffers whose lifetimes meet its own) by breadth, size, area and lifetime,
//!    and a skyline heuristic that always places next the buffer that can sit lowest, which
//!    stacks the nested lifetimes of a training step (forward activations, freed in reverse
//!    by the backward pass) without gaps;
//! 3. a ruin-and-recreate local search around the buffers that reach the top of the arena;
//! 4. an exact branch and bound ([`pack_exact`]) on instances of at most
//!    [`EXACT_MAX_BUFFERS`] buffers.
//!
//! Every stage is bounded by counted work, never by wall time, and the local search draws
//! from a fixed seed: the macro computes the plan at compile time, and a model must get the
//! same plan on every machine.

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

/// [`pack`] hands instances of at most this many non-empty buffers that its heuristics leave
/// above the lower bound to the exact search.
pub const EXACT_MAX_BUFFERS: usize = 14;

/// Nodes the branch and bound may visit (about a microsecond each at 14 buffers). Instances
/// of up to 28 buffers from training steps or random lifetimes close in far fewer; the limit
/// guards adversarial ones.
const EXACT_NODE_BUDGET: u64 = 100_000;

/// Work the heuristics may do, counted in placed-buffer visits: one comparison of a buffer
/// being placed with one already placed, a few nanoseconds. A greedy pass over n buffers
/// costs up to n²/2, so at 3,000 buffers this is a dozen passes' worth, about 0.1 s on a
/// slow machine, and only spent when the lower bound is not met early.
const WORK_BUDGET: u64 = 30_000_000;

/// Smaller instances get at most this many greedy passes' worth of work, so that one whose
/// lower bound cannot be met gives up in proportion to its size.
const BUDGET_PASSES: u64 = 2000;

/// Work one heap pop of the skyline heuristic costs (a heap operation and a tree query,
/// each logarithmic), in placed-buffer visits.
const SKYLINE_POP_WORK: u64 = 24;

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

/// TFLite's greedy-by-size offset assignment (`GreedyBySizeAssignment`, in the GPU
/// delegate's memory management), decision for decision: buffers in non-increasing size
/// order; each goes into the smallest gap that fits it (the lowest such gap on ties)
/// between the placed buffers whose lifetimes meet its own, or above the highest of them
/// when none fits. Only the list of placed buffers is a faster structure here.
///
/// TFLite sorts with `std::sort`, which leaves equal sizes in an unspecified order; here they
/// keep request order, so the result is deterministic.
///
/// # Panics
/// When a request has `first > last`.
pub fn greedy_by_size(reqs: &[BufferRequest], alignment: u64) -> Packing {
    check_lifetimes(reqs);
    // Zero-byte requests stay in: TFLite places them too (sorted last, they can only split
    // gaps that other zero-byte requests see).
    let instance = Instance::new(reqs, alignment.max(1), true);
    let order = tflite_order(&instance.items);
    let mut placer = Placer::new(&instance.items);
    placer.place(&order, Fit::Best, u64::MAX);
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

/// The planner's packing: the best of TFLite's greedy-by-size, other greedy orders, a
/// skyline heuristic, a local search and, for small instances, the exact search (see the
/// module documentation). Offsets are multiples of `alignment` (requests of zero bytes get
/// offset 0); the result is deterministic, and its arena is never larger than
/// [`greedy_by_size`]'s.
///
/// # Panics
/// When a request has `first > last`.
pub fn pack(reqs: &[BufferRequest], alignment: u64) -> Packing {
    check_lifetimes(reqs);
    // Zero-byte requests overlap nothing; they keep offset 0.
    let instance = Instance::new(reqs, alignment.max(1), false);
    let mut offsets = vec![0u64; reqs.len()];
    if instance.items.is_empty() {
        return Packing {
            offsets,
            arena_bytes: 0,
        };
    }
    let mut search = Search::new(&instance);
    search.run();
    // Inside, sizes are rounded up to the alignment; should a request not be a multiple,
    // compare with TFLite's packing on the real sizes, so that the promise holds anyway.
    let mut best: Option<Packing> = None;
    for candidate in [&search.best.offsets, &search.tflite] {
        for (k, &i) in instance.index.iter().enumerate() {
            offsets[i] = candidate[k];
        }
        let arena_bytes = arena_bytes(reqs, &offsets);
        if best.as_ref().is_none_or(|b| arena_bytes < b.arena_bytes) {
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
/// the same search, seeded with its best packing, on instances of at most
/// [`EXACT_MAX_BUFFERS`] buffers that its heuristics leave above the lower bound.
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

/// The first pair `(i, j)`, `i < j`, smallest `i` then smallest `j`, of requests whose
/// lifetimes intersect and whose byte ranges `offset..offset + bytes` intersect; `None`
/// when there is none. Empty byte ranges intersect nothing.
///
/// # Panics
/// When `packing` has not one offset per request.
pub fn overlaps(reqs: &[BufferRequest], packing: &Packing) -> Option<(usize, usize)> {
    assert_eq!(reqs.len(), packing.offsets.len(), "one offset per request");
    // In u128: a corrupt offset near u64::MAX must be reported, not wrap around.
    let start = |i: usize| u128::from(packing.offsets[i]);
    let end = |i: usize| start(i) + u128::from(reqs[i].bytes);
    for (i, a) in reqs.iter().enumerate() {
        if a.bytes == 0 {
            continue;
        }
        for (j, b) in reqs.iter().enumerate().skip(i + 1) {
            if b.bytes == 0 || a.last < b.first || b.last < a.first {
                continue;
            }
            if start(i) < end(j) && start(j) < end(i) {
                return Some((i, j));
            }
        }
    }
    None
}

fn check_lifetimes(reqs: &[BufferRequest]) {
    for (i, r) in reqs.iter().enumerate() {
        assert!(
            r.first <= r.last,
            "buffer {i} has first {} > last {}",
            r.first,
            r.last
        );
    }
}

fn arena_bytes(reqs: &[BufferRequest], offsets: &[u64]) -> u64 {
    reqs.iter()
        .zip(offsets)
        .map(|(r, &o)| o + r.bytes)
        .max()
        .unwrap_or(0)
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

/// A buffer with its lifetime mapped onto compressed time: the distinct `first` and `last`
/// values of all requests, ranked. Ranking keeps every `<=` between them, so lifetimes meet
/// exactly when their compressed ones do, and steps where nothing starts or ends drop out.
#[derive(Clone, Copy, Debug)]
struct Item {
    /// Rounded up to the alignment, so that every end is aligned too.
    bytes: u64,
    /// As requested, for TFLite's order.
    requested: u64,
    first: u32,
    last: u32,
    /// Lifetime in original steps, for the orders.
    steps: u64,
}

impl Item {
    fn meets(&self, other: &Item) -> bool {
        self.first <= other.last && other.first <= self.last
    }

    fn at(&self, offset: u64) -> Slot {
        Slot {
            offset,
            end: offset + self.bytes,
            first: self.first,
            last: self.last,
        }
    }
}

/// A placed buffer.
#[derive(Clone, Copy, Debug)]
struct Slot {
    offset: u64,
    end: u64,
    first: u32,
    last: u32,
}

/// Which gap a greedy placement takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fit {
    /// The lowest that fits.
    First,
    /// The smallest that fits, the lowest on ties (TFLite's rule).
    Best,
}

/// Placed buffers ordered by offset, in chunks: a greedy pass inserts every buffer once,
/// and shifting one chunk instead of the whole list keeps that cheap at thousands of
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
            .extend(slots.chunks(CHUNK / 2).map(<[Slot]>::to_vec));
    }

    /// After every slot with an offset at or below the new one's (where TFLite puts it).
    fn insert(&mut self, slot: Slot) {
        let c = self
            .chunks
            .partition_point(|chunk| chunk[0].offset <= slot.offset)
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
    /// A gap runs from the highest end so far among slots whose lifetimes meet the item's to
    /// the offset of the next such slot; other slots are skipped. The loops do not branch on
    /// which slots meet the item: about half do, unpredictably.
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

/// The buffers to place, in compressed time.
struct Instance {
    items: Vec<Item>,
    /// `items[k]` is request `index[k]`.
    index: Vec<usize>,
    /// Number of compressed time coordinates.
    coords: usize,
    /// [`lower_bound`] of the rounded sizes.
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
                    requested: r.bytes,
                    first: rank(r.first),
                    last: rank(r.last),
                    steps: (r.last - r.first) as u64 + 1,
                }
            })
            .collect();
        let mut instance = Instance {
            items,
            index,
            coords: times.len(),
            lower_bound: 0,
        };
        instance.lower_bound = instance.breadth().into_iter().max().unwrap_or(0);
        instance
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

/// TFLite's order: non-increasing requested size; equal sizes in request order.
fn tflite_order(items: &[Item]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..items.len() as u32).collect();
    order.sort_by_key(|&k| Reverse(items[k as usize].requested));
    order
}

/// Greedy placement in a given order, with reusable scratch space.
struct Placer<'a> {
    items: &'a [Item],
    slots: SlotList,
    offsets: Vec<u64>,
    /// Placed-buffer visits so far (see [`WORK_BUDGET`]).
    work: u64,
}

impl<'a> Placer<'a> {
    fn new(items: &'a [Item]) -> Placer<'a> {
        Placer {
            items,
            slots: SlotList::new(),
            offsets: vec![0; items.len()],
            work: 0,
        }
    }

    /// Places the items in `order` into `offsets`; the arena, or `None` as soon as a
    /// buffer would end above `cutoff`.
    fn place(&mut self, order: &[u32], fit: Fit, cutoff: u64) -> Option<u64> {
        self.slots.rebuild(&[]);
        let mut arena = 0;
        for &k in order {
            let it = self.items[k as usize];
            let (offset, seen) = self.slots.find(&it, fit);
            // The insertion shifts part of a chunk.
            self.work += seen + CHUNK as u64 / 4;
            let slot = it.at(offset);
            if slot.end > cutoff {
                return None;
            }
            arena = arena.max(slot.end);
            self.offsets[k as usize] = offset;
            self.slots.insert(slot);
        }
        Some(arena)
    }
}

/// A packing of an instance's items.
#[derive(Clone, Debug)]
struct Solution {
    offsets: Vec<u64>,
    arena: u64,
}

/// A way to build a packing from scratch.
#[derive(Clone, Copy, Debug)]
enum Construction {
    Skyline(SkylineRule),
    Greedy(Order, Fit),
}

/// Greedy placement orders (ties in item order).
#[derive(Clone, Copy, Debug)]
enum Order {
    /// Largest first, the longest-lived among equals.
    Size,
    /// Longest-lived first, the largest among equals: the activations kept for backward.
    Span,
    /// Largest bytes × steps first.
    Area,
    /// TFLite's "greedy by breadth": steps by decreasing live bytes, and each step's
    /// buffers by decreasing size.
    Breadth,
}

/// The constructions after TFLite's, most useful first: on the synthetic training steps the
/// skyline (longest first) is most often the best, breadth wins most of the others and is
/// cheap where the skyline is not (thousands of nested lifetimes), and each of the rest
/// alone finds the best packing of some instance.
const CONSTRUCTIONS: [Construction; 7] = [
    Construction::Greedy(Order::Breadth, Fit::First),
    Construction::Skyline(SkylineRule::Longest),
    Construction::Skyline(SkylineRule::Largest),
    Construction::Greedy(Order::Size, Fit::First),
    Construction::Greedy(Order::Area, Fit::First),
    Construction::Greedy(Order::Span, Fit::First),
    Construction::Greedy(Order::Breadth, Fit::Best),
];

/// The heuristic search, keeping the best packing found.
struct Search<'a> {
    inst: &'a Instance,
    placer: Placer<'a>,
    best: Solution,
    /// TFLite's greedy-by-size packing, which `pack` must never lose to.
    tflite: Vec<u64>,
    /// Work allowed in all (see [`WORK_BUDGET`]).
    budget: u64,
}

impl<'a> Search<'a> {
    fn new(inst: &'a Instance) -> Search<'a> {
        let n = inst.items.len() as u64;
        Search {
            inst,
            placer: Placer::new(&inst.items),
            best: Solution {
                offsets: Vec::new(),
                arena: u64::MAX,
            },
            tflite: Vec::new(),
            budget: WORK_BUDGET.min(BUDGET_PASSES / 2 * n * n),
        }
    }

    fn optimal(&self) -> bool {
        self.best.arena <= self.inst.lower_bound
    }

    fn offer(&mut self, offsets: &[u64], arena: u64) {
        if arena < self.best.arena {
            self.best = Solution {
                offsets: offsets.to_vec(),
                arena,
            };
        }
    }

    fn run(&mut self) {
        let tflite = tflite_order(&self.inst.items);
        let arena = self.placer.place(&tflite, Fit::Best, u64::MAX);
        self.tflite = self.placer.offsets.clone();
        self.best = Solution {
            offsets: self.tflite.clone(),
            arena: arena.expect("no cutoff"),
        };
        // Constructions may take half the budget; the local search gets the rest.
        let orders = self.orders();
        for construction in CONSTRUCTIONS {
            if self.optimal() || self.placer.work >= self.budget / 2 {
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
                    let arena = self
                        .inst
                        .items
                        .iter()
                        .zip(&offsets)
                        .map(|(it, &o)| o + it.bytes)
                        .max()
                        .unwrap_or(0);
                    self.offer(&offsets, arena);
                }
                Construction::Greedy(order, fit) => {
                    let order = &orders[order as usize];
                    if let Some(arena) = self.placer.place(order, fit, self.best.arena) {
                        let offsets = std::mem::take(&mut self.placer.offsets);
                        self.offer(&offsets, arena);
                        self.placer.offsets = offsets;
                    }
                }
            }
        }
        self.settle();
        if self.optimal() {
            return;
        }
        if self.inst.items.len() <= EXACT_MAX_BUFFERS {
            let incumbent = self.best.arena;
            if let (Some(better), _) = exact(&self.inst.items, self.inst.coords, incumbent) {
                self.best = better;
            }
            return;
        }
        self.local_search();
    }

    /// Re-places the best packing's buffers in offset order with first-fit. Each then lands
    /// at or below its old offset (that spot is free: everything placed before it that meets
    /// it sits no higher than before), so this never hurts, and it closes the gaps best-fit
    /// can leave under a buffer.
    fn settle(&mut self) {
        let mut order: Vec<u32> = (0..self.inst.items.len() as u32).collect();
        order.sort_by_key(|&k| (self.best.offsets[k as usize], k));
        let arena = self.placer.place(&order, Fit::First, u64::MAX);
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
        // Ascending keys; `wide` packs two keys into one.
        let sorted = |key: &dyn Fn(&Item) -> u128| {
            let mut order: Vec<u32> = (0..items.len() as u32).collect();
            order.sort_by_key(|&k| key(&items[k as usize]));
            order
        };
        let wide = |hi: u64, lo: u64| u128::from(hi) << 64 | u128::from(lo);
        // Walking the steps by decreasing live bytes, a buffer is first met at the hottest
        // step of its lifetime.
        let breadth = self.inst.breadth();
        let mut steps: Vec<u32> = (0..self.inst.coords as u32).collect();
        steps.sort_by_key(|&c| Reverse(breadth[c as usize]));
        let mut rank = vec![0u32; self.inst.coords];
        for (r, &c) in steps.iter().enumerate() {
            rank[c as usize] = r as u32;
        }
        let hottest = RangeMin::new(&rank);
        [
            sorted(&|it| !wide(it.bytes, it.steps)),
            sorted(&|it| !wide(it.steps, it.bytes)),
            sorted(&|it| !(u128::from(it.bytes) * u128::from(it.steps))),
            sorted(&|it| {
                let hot = hottest.min(it.first as usize, it.last as usize);
                wide(u64::from(hot), !it.bytes)
            }),
        ]
    }

    /// Ruin and recreate: take a buffer that reaches the top of the arena, lift out the
    /// buffers that meet a random time window around it and end above a random level, and
    /// put them back (first-fit or best-fit, in a randomly chosen and shaken order) around
    /// the buffers left in place. Keep the result unless the arena grows; an equal arena is
    /// kept unless more buffers touch the top, which is how a flat peak is worn down before
    /// it drops. A try costs the lifted buffers times the placed ones, not a full pass.
    fn local_search(&mut self) {
        let items = &self.inst.items;
        let n = items.len();
        let coords = self.inst.coords;
        let mut rng = SplitMix(SEED);
        let mut offsets = self.best.offsets.clone();
        let mut arena = self.best.arena;
        let mut tops = count_tops(items, &offsets, arena);
        let mut by_offset: Vec<u32> = (0..n as u32).collect();
        by_offset.sort_by_key(|&k| (offsets[k as usize], k));
        let mut lifted = vec![false; n];
        let mut ruin: Vec<u32> = Vec::new();
        let mut kept: Vec<Slot> = Vec::with_capacity(n);
        let mut slots = SlotList::new();
        let mut trial = offsets.clone();
        while self.placer.work < self.budget && arena > self.inst.lower_bound {
            // The linear scans below, in the budget's unit.
            self.placer.work += 4 * n as u64;
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
            // it is a band across the whole window, as good where it is as anywhere else.
            let (near_lo, near_hi) = (lo.saturating_sub(reach as u32), hi + reach as u32);
            let meeting: Vec<u32> = (0..n as u32)
                .filter(|&k| {
                    let it = &items[k as usize];
                    it.meets(&window) && it.first >= near_lo && it.last <= near_hi
                })
                .collect();
            // `x` is among them, so the level is below the top.
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
            // Only buffers that meet a lifted one can be in the way of putting it back.
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
                if lifted[k as usize] {
                    continue;
                }
                let slot = items[k as usize].at(offsets[k as usize]);
                new_arena = new_arena.max(slot.end);
                if items[k as usize].meets(&span) {
                    kept.push(slot);
                }
            }
            slots.rebuild(&kept);
            // Put them back in a random one of the greedy orders, shaken by a few swaps.
            let key = rng.below(4);
            ruin.sort_by_key(|&k| {
                let it = items[k as usize];
                let key = match key {
                    0 => u128::from(it.bytes),
                    1 => u128::from(it.steps) << 64 | u128::from(it.bytes),
                    2 => u128::from(it.bytes) * u128::from(it.steps),
                    _ => !u128::from(offsets[k as usize]),
                };
                (Reverse(key), k)
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
            let mut fits = true;
            for &k in &ruin {
                let it = items[k as usize];
                let (offset, seen) = slots.find(&it, fit);
                self.placer.work += seen + CHUNK as u64 / 4;
                let slot = it.at(offset);
                if slot.end > arena {
                    fits = false;
                    break;
                }
                new_arena = new_arena.max(slot.end);
                trial[k as usize] = offset;
                slots.insert(slot);
            }
            for &k in &ruin {
                lifted[k as usize] = false;
            }
            let new_tops = if fits {
                count_tops(items, &trial, new_arena)
            } else {
                usize::MAX
            };
            if fits && (new_arena < arena || new_tops <= tops) {
                arena = new_arena;
                tops = new_tops;
                offsets.copy_from_slice(&trial);
                by_offset.sort_by_key(|&k| (offsets[k as usize], k));
                self.placer.work += 8 * n as u64;
                if arena < self.best.arena {
                    self.best = Solution {
                        offsets: offsets.clone(),
                        arena,
                    };
                }
            } else {
                for &k in &ruin {
                    trial[k as usize] = offsets[k as usize];
                }
            }
        }
    }
}

/// How many buffers reach `arena`.
fn count_tops(items: &[Item], offsets: &[u64], arena: u64) -> usize {
    items
        .iter()
        .zip(offsets)
        .filter(|&(it, &o)| o + it.bytes == arena)
        .count()
}

/// How the skyline heuristic breaks ties between buffers that can sit equally low.
#[derive(Clone, Copy, Debug)]
enum SkylineRule {
    /// Longest lifetime first, then largest.
    Longest,
    /// Largest first, then longest lifetime.
    Largest,
}

/// Repeatedly places the unplaced buffer that can sit lowest. Offsets then never decrease
/// from one placement to the next, so above the current level every step holds at most one
/// placed buffer: the lowest place for a buffer is the highest top (the "skyline") over its
/// lifetime. The heap holds stale levels, which only ever rise; a popped buffer whose level
/// is still current is the true minimum.
///
/// Placing a long-lived buffer makes every pending buffer under it stale, so nested
/// lifetimes cost pops quadratic in the buffers. When `budget` work runs out, the buffers
/// still pending are placed by best-fit in TFLite's order instead.
fn skyline(
    items: &[Item],
    coords: usize,
    rule: SkylineRule,
    budget: u64,
    work: &mut u64,
) -> Vec<u64> {
    // A heap entry is one integer, (the lowest level the buffer may have, its rank under
    // the rule), smallest first: between equal levels the better rank wins.
    let mut by_rule: Vec<u32> = (0..items.len() as u32).collect();
    by_rule.sort_by_key(|&k| {
        let it = items[k as usize];
        Reverse(match rule {
            SkylineRule::Longest => (it.steps, it.bytes),
            SkylineRule::Largest => (it.bytes, it.steps),
        })
    });
    let entry = |level: u64, rank: usize| Reverse(u128::from(level) << 32 | rank as u128);
    let mut heap: BinaryHeap<Reverse<u128>> = (0..items.len()).map(|rank| entry(0, rank)).collect();
    let mut sky = MaxTree::new(coords);
    let mut offsets = vec![0u64; items.len()];
    let mut placed = vec![false; items.len()];
    let start = *work;
    while *work - start <= budget {
        let Some(Reverse(key)) = heap.pop() else {
            return offsets;
        };
        *work += SKYLINE_POP_WORK;
        let (level, rank) = ((key >> 32) as u64, (key as u32) as usize);
        let k = by_rule[rank];
        let it = items[k as usize];
        let now = sky.max(it.first as usize, it.last as usize);
        if now > level {
            heap.push(entry(now, rank));
            continue;
        }
        offsets[k as usize] = level;
        placed[k as usize] = true;
        sky.raise(it.first as usize, it.last as usize, level + it.bytes);
    }
    let mut slots: Vec<Slot> = (0..items.len())
        .filter(|&k| placed[k])
        .map(|k| items[k].at(offsets[k]))
        .collect();
    slots.sort_unstable_by_key(|s| s.offset);
    let mut list = SlotList::new();
    list.rebuild(&slots);
    for k in tflite_order(items) {
        let it = items[k as usize];
        if placed[k as usize] {
            continue;
        }
        let (offset, seen) = list.find(&it, Fit::Best);
        *work += seen + CHUNK as u64 / 4;
        offsets[k as usize] = offset;
        list.insert(it.at(offset));
    }
    offsets
}

/// Range "raise to at least v" and range maximum over compressed time: a bottom-up segment
/// tree; raises commute, so they never need pushing down.
struct MaxTree {
    size: usize,
    /// Maximum over the node's range, raises recorded at its ancestors excluded.
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
        // The nodes that meet the range without lying inside it are the ancestors of its
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
        // Raises recorded above the covering nodes sit on the paths from the two ends.
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

/// Minimum over index ranges (a sparse table).
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

/// Branch and bound for a packing with an arena below `incumbent` (at most 32 items): the
/// best found (`None` when none is below it), and whether the search finished, which proves
/// it optimal, within the node budget.
///
/// Why it may search placement sequences with first-fit only, and few of them: take an
/// optimal packing with the smallest sum of offsets. Placing its buffers in order of
/// (offset, index) with first-fit puts each at or below its offset (the spot is free:
/// everything placed earlier that meets it ends no higher than before), and minimality
/// makes that "at". So some sequence of non-decreasing (offset, index) reproduces an
/// optimum, and the search only extends a sequence with a buffer whose first-fit offset is
/// at least the last one's. Above that level each step then holds at most one placed
/// buffer, which gives the bound: every unplaced buffer lies above the level, and above
/// what occupies it.
fn exact(items: &[Item], coords: usize, incumbent: u64) -> (Option<Solution>, bool) {
    let n = items.len();
    assert!(n <= 32, "bit sets of 32 items");
    // A buffer identical to an earlier one goes after it (swapping the two changes
    // nothing), which cuts symmetric branches.
    let twin: Vec<Option<usize>> = (0..n)
        .map(|c| {
            (0..c).rev().find(|&d| {
                items[d].bytes == items[c].bytes
                    && items[d].first == items[c].first
                    && items[d].last == items[c].last
            })
        })
        .collect();
    let live: Vec<u32> = (0..coords as u32)
        .map(|t| {
            (0..n)
                .filter(|&k| items[k].first <= t && t <= items[k].last)
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

    /// `mask`: the placed items; `level` and `last`: offset and index of the last one.
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
        for c in (0..n).filter(|&c| mask & 1 << c == 0) {
            let ff = self.first_fit(c);
            let size = self.items[c].bytes;
            if ff < level {
                if ff + size <= level {
                    // A gap below the level, which nothing placed from now on can close:
                    // this buffer could never come next in non-decreasing order.
                    return;
                }
                bound = bound.max(level + size);
                continue;
            }
            bound = bound.max(ff + size);
            let after_last = ff > level || last.is_none_or(|l| c > l);
            let after_twin = self.twin[c].is_none_or(|d| mask & 1 << d != 0);
            if after_last && after_twin {
                candidates.push((ff, c));
            }
        }
        for &live in &self.live {
            let unplaced = live & !mask;
            if unplaced == 0 {
                continue;
            }
            let (mut need, mut top) = (0, level);
            for k in 0..n {
                let bit = 1u32 << k;
                if unplaced & bit != 0 {
                    need += self.items[k].bytes;
                } else if live & bit != 0 {
                    top = top.max(self.offsets[k] + self.items[k].bytes);
                }
            }
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
