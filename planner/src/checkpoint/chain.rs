//! The chain dynamic program: each block's memory terms read off real schedules ("probes"),
//! and the program over segmentations of whole blocks that minimises recomputation within
//! an arena budget (or the peak) — exact on chains (`docs/CHECKPOINTING.md`).

use std::cmp::Reverse;
use std::collections::HashMap;

use super::solver::{Selection, Solver};
use crate::graph::TensorId;
use crate::liveness::Lifetimes;
use crate::op::Op;
use crate::plan::{Phase, Role, NONE};
use crate::schedule::Schedule;
use crate::ALIGNMENT;

/// A run of units `start..=end` (1-based unit indices), checkpointed as one segment or, for
/// a single unit, stored (not checkpointed) — with its norms' outputs recomputed when `out`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Block {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) ckpt: bool,
    /// A stored unit whose norms recompute their outputs (`LayerSpec::recompute_output`).
    pub(super) out: bool,
}

/// The contexts a block's terms depend on: the kind of the block before it.
const CONTEXTS: usize = 3;

impl Block {
    pub(super) fn stored(u: usize) -> Block {
        Block {
            start: u,
            end: u,
            ckpt: false,
            out: false,
        }
    }

    pub(super) fn checkpointed(start: usize, end: usize) -> Block {
        Block {
            start,
            end,
            ckpt: true,
            out: false,
        }
    }

    pub(super) fn outputs(u: usize) -> Block {
        Block {
            out: true,
            ..Block::stored(u)
        }
    }

    /// Each segment of units `(start, end)` as a checkpointed block.
    pub(super) fn segments(segments: &[(usize, usize)]) -> Vec<Block> {
        segments
            .iter()
            .map(|&(start, end)| Block::checkpointed(start, end))
            .collect()
    }

    /// The context it makes for the block after it: 0 stored, 1 checkpointed, 2 stored with
    /// its outputs recomputed.
    fn context(&self) -> usize {
        match (self.ckpt, self.out) {
            (true, _) => 1,
            (false, false) => 0,
            (false, true) => 2,
        }
    }
}

/// What one block contributes to the live bytes, given whether the block before it is
/// checkpointed (see `docs/CHECKPOINTING.md`, "Why a chain decomposes").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Term {
    /// Most live bytes at a step of the block's region, less what earlier blocks keep there.
    peak: u64,
    /// Bytes born in the block's forward steps (its output aside) that are still live when
    /// the backward pass starts: kept across every later block.
    keep: u64,
    /// Bytes of the tensors crossing into the block that are still live when the backward
    /// pass starts.
    bkeep: u64,
    /// Forward FLOPs of its recompute steps.
    cost: u64,
}

/// Probe results: every block's [`Term`] in each context.
#[derive(Clone, Debug, Default)]
pub(super) struct Terms {
    /// Unit 0's (the inputs'), by whether unit 1 recomputes its outputs (a norm reading a
    /// model input then keeps the input, which changes what unit 0 keeps).
    unit0: [Option<Term>; 2],
    /// `stored[u][tau]`: unit `u` not checkpointed; `tau` = the context the block before
    /// makes ([`Block::context`]).
    stored: Vec<[Option<Term>; CONTEXTS]>,
    /// `outputs[u][tau]`: unit `u` stored, its norms' outputs recomputed.
    outputs: Vec<[Option<Term>; CONTEXTS]>,
    /// `ckpt[(i, j)][tau]`.
    ckpt: HashMap<(usize, usize), [Option<Term>; CONTEXTS]>,
    /// Some block measured twice differed (the decomposition did not hold).
    pub(super) inconsistent: bool,
    pub(super) probes: usize,
}

impl Solver {
    /// Model memory of a segmentation given as blocks covering units `1..=m`: what the
    /// dynamic program believes. Equal to [`Solver::evaluate_units`]'s total on chains.
    pub fn model_total(&self, segments: &[(usize, usize)]) -> Option<u64> {
        self.model(segments).map(|(total, _)| total)
    }

    /// The program's total and recompute FLOPs of a segmentation.
    pub(super) fn model(&self, segments: &[(usize, usize)]) -> Option<(u64, u64)> {
        let blocks = self.cover(segments);
        let t0 = self.terms.unit0[0]?;
        let (mut k, mut peak) = (t0.keep, t0.peak);
        let (mut tau, mut cost) = (0usize, 0u64);
        for b in &blocks {
            let t = self.term(b, tau)?;
            peak = peak.max(k + t.peak);
            k += t.keep + t.bkeep;
            cost += t.cost;
            tau = b.context();
        }
        Some((self.persistent + peak, cost))
    }

    /// Blocks covering every unit: the given segments checkpointed, every other unit stored.
    fn cover(&self, segments: &[(usize, usize)]) -> Vec<Block> {
        let mut blocks = Vec::new();
        let mut u = 1;
        let mut segs: Vec<(usize, usize)> = segments.to_vec();
        segs.sort_unstable();
        for (s, e) in segs {
            while u < s {
                blocks.push(Block::stored(u));
                u += 1;
            }
            blocks.push(Block::checkpointed(s, e));
            u = e + 1;
        }
        while u <= self.unit_count() {
            blocks.push(Block::stored(u));
            u += 1;
        }
        blocks
    }

    fn term(&self, b: &Block, tau: usize) -> Option<Term> {
        if b.ckpt {
            self.terms.ckpt.get(&(b.start, b.end)).and_then(|t| t[tau])
        } else if b.out {
            self.terms.outputs.get(b.start).and_then(|t| t[tau])
        } else {
            self.terms.stored.get(b.start).and_then(|t| t[tau])
        }
    }

    /// The blocks that may start at unit `p`: checkpointed runs, longest first, then the unit
    /// with its outputs recomputed (where it has a norm to do it), then stored.
    fn blocks_at(&self, p: usize) -> Vec<Block> {
        let m = self.unit_count();
        let mut out: Vec<Block> = (p..=m).rev().map(|e| Block::checkpointed(p, e)).collect();
        if self.selectable[p] {
            out.push(Block::outputs(p));
        }
        out.push(Block::stored(p));
        out
    }
}

// ---- Probes: reading each block's terms off real schedules ----

impl Solver {
    /// Builds probes (segmentations) until every block has been seen in every context, and
    /// records the terms each probe shows.
    pub(super) fn probe_all(&mut self) {
        let m = self.unit_count();
        let mut terms = Terms {
            stored: vec![[None; CONTEXTS]; m + 1],
            outputs: vec![[None; CONTEXTS]; m + 1],
            ..Terms::default()
        };
        // The contexts unit `i` can be reached in: unit 1 only after unit 0; the outputs
        // context only after a unit that has a norm to recompute.
        let reachable = |i: usize, tau: usize| match tau {
            _ if i <= 1 => tau == 0,
            2 => self.selectable[i - 1],
            _ => true,
        };
        // What is still to be seen: per start unit, each block that may start there and the
        // contexts it is still to be seen in.
        type Todo = Vec<Vec<(Block, [bool; CONTEXTS])>>;
        let mut todo: Todo = (0..=m + 1)
            .map(|p| match p {
                0 => Vec::new(),
                p if p > m => Vec::new(),
                p => (self.blocks_at(p).into_iter())
                    .map(|b| (b, std::array::from_fn(|tau| reachable(p, tau))))
                    .collect(),
            })
            .collect();
        let open_at = |todo: &Todo, i: usize, tau: usize| -> usize {
            todo.get(i)
                .map_or(0, |bs| bs.iter().filter(|(_, open)| open[tau]).count())
        };
        loop {
            let remaining: usize = (1..=m)
                .flat_map(|i| (0..CONTEXTS).map(move |tau| (i, tau)))
                .map(|(i, tau)| open_at(&todo, i, tau))
                .sum();
            if remaining == 0 {
                break;
            }
            // One probe, left to right: at each unit take the first block not yet seen in the
            // current context (the longest run first); when there is none, a one-unit filler
            // whose context suits the next unit best (stored on a tie).
            let mut blocks = Vec::new();
            let (mut p, mut tau) = (1usize, 0usize);
            while p <= m {
                let b = match todo[p].iter_mut().find(|(_, open)| open[tau]) {
                    Some((b, open)) => {
                        open[tau] = false;
                        *b
                    }
                    None => {
                        let fillers = [
                            Block::stored(p),
                            Block::checkpointed(p, p),
                            Block::outputs(p),
                        ];
                        let next =
                            |b: &Block| (open_at(&todo, p + 1, b.context()), Reverse(b.context()));
                        (fillers.into_iter())
                            .filter(|b| !b.out || self.selectable[p])
                            .max_by_key(next)
                            .expect("a stored filler")
                    }
                };
                blocks.push(b);
                tau = b.context();
                p = b.end + 1;
            }
            self.probe(&blocks, &mut terms);
        }
        if m == 0 {
            self.probe(&[], &mut terms);
        }
        self.terms = terms;
    }

    /// Runs one probe and records the terms of its blocks.
    fn probe(&self, blocks: &[Block], terms: &mut Terms) {
        let s = self.schedule(blocks);
        let life = Lifetimes::compute(&s, ALIGNMENT);
        let measured = self.measure(blocks, &s, &life);
        terms.probes += 1;
        terms.unit0[blocks.first().is_some_and(|b| b.out) as usize] = Some(measured[0]);
        for (k, b) in blocks.iter().enumerate() {
            let tau = if k == 0 { 0 } else { blocks[k - 1].context() };
            let t = measured[k + 1];
            let slot = if b.ckpt {
                &mut terms
                    .ckpt
                    .entry((b.start, b.end))
                    .or_insert([None; CONTEXTS])[tau]
            } else if b.out {
                &mut terms.outputs[b.start][tau]
            } else {
                &mut terms.stored[b.start][tau]
            };
            match slot {
                Some(old) if *old != t => {
                    terms.inconsistent = true;
                    // Keep the larger memory: the safer of two readings.
                    old.peak = old.peak.max(t.peak);
                    old.keep = old.keep.max(t.keep);
                    old.bkeep = old.bkeep.max(t.bkeep);
                }
                Some(_) => {}
                None => *slot = Some(t),
            }
        }
    }

    /// The terms of every block of a probe (index 0: unit 0, then `blocks` in order).
    ///
    /// Each step belongs to a region: a block's forward steps, its recompute steps, its
    /// backward steps (with the accumulations they trigger), the loss steps (the last
    /// block's) and the update steps (unit 0's). Each tensor is live from its first step to
    /// its last, except that a tensor handing its bytes over in place ends the step before,
    /// so that live bytes per step equal the lifetimes' buffers exactly. A tensor is born
    /// in the region of its first step (inputs: unit 0).
    fn measure(&self, blocks: &[Block], s: &Schedule, life: &Lifetimes) -> Vec<Term> {
        let nb = blocks.len() + 1;
        let mut block_of_unit = vec![0usize; self.units.len()];
        for (k, b) in blocks.iter().enumerate() {
            block_of_unit[b.start..=b.end].fill(k + 1);
        }
        let of_layer = |l: Option<usize>| l.map(|l| block_of_unit[self.unit_of_layer[l]]);
        let last_block = nb - 1;
        let n = s.steps.len();
        let (region, last_loss) = step_regions(s, &of_layer, last_block);
        // The first step of the backward pass: what is live there is kept across it.
        let lambda = last_loss.map_or(n, |l| l + 1);
        let nt = s.tensors.len();
        let mut donates = vec![false; nt];
        for &d in &life.in_place_of {
            if d != NONE {
                donates[d as usize] = true;
            }
        }
        let mut delta = vec![0i128; n + 1];
        // Bytes live at `lambda`, by birth block; and of those, born in forward steps.
        let mut kept_by_birth = vec![0u64; nb];
        let mut fwd_kept_by_birth = vec![0u64; nb];
        let mut span = vec![None; nt];
        let mut born = vec![0usize; nt];
        for t in 0..nt {
            let first = life.first[t] as usize;
            let mut last = life.last[t] as usize;
            if donates[t] {
                if last == first {
                    continue;
                }
                last -= 1;
            }
            let bytes = life.buffers[life.buffer_of[t]].0;
            delta[first.min(n)] += bytes as i128;
            delta[(last + 1).min(n)] -= bytes as i128;
            born[t] = if s.tensors[t].role == Role::Input || n == 0 {
                0
            } else {
                region[first.min(n - 1)]
            };
            span[t] = Some((first, last, bytes));
            if first <= lambda && lambda <= last {
                kept_by_birth[born[t]] += bytes;
                let forward = s.tensors[t].role == Role::Input
                    || s.steps
                        .get(first)
                        .is_some_and(|st| st.phase == Phase::Forward);
                if forward {
                    fwd_kept_by_birth[born[t]] += bytes;
                }
            }
        }
        let kept_at_lambda = |t: TensorId| -> u64 {
            match span.get(t).copied().flatten() {
                Some((first, last, bytes)) if first <= lambda && lambda <= last => bytes,
                _ => 0,
            }
        };
        let mut live = vec![0i128; n];
        let mut cur = 0i128;
        for (i, d) in delta.iter().take(n).enumerate() {
            cur += d;
            live[i] = cur;
        }
        let mut peak = vec![i128::MIN; nb];
        let mut cost = vec![0u64; nb];
        for i in 0..n {
            peak[region[i]] = peak[region[i]].max(live[i]);
            if s.chosen_recompute(i) {
                cost[region[i]] += s.steps[i].op.forward_flops();
            }
        }
        let first_unit = |k: usize| if k == 0 { 0 } else { blocks[k - 1].start };
        let after = |k: usize| if k == 0 { 1 } else { blocks[k - 1].end + 1 };
        let mut out = Vec::with_capacity(nb);
        let mut older = 0u64; // kept bytes born in blocks before k
        for k in 0..nb {
            let into: &[TensorId] = if k == 0 {
                &[]
            } else {
                &self.cross[first_unit(k)]
            };
            let bkeep: u64 = into
                .iter()
                .filter(|&&t| born[t] < k)
                .map(|&t| kept_at_lambda(t))
                .sum();
            let base = older - bkeep.min(older);
            let outgoing: u64 = self.cross.get(after(k)).map_or(0, |ts| {
                ts.iter()
                    .filter(|&&t| born[t] == k)
                    .map(|&t| kept_at_lambda(t))
                    .sum()
            });
            let p = if peak[k] == i128::MIN {
                0
            } else {
                (peak[k] - base as i128).max(0) as u64
            };
            out.push(Term {
                peak: p,
                keep: fwd_kept_by_birth[k].saturating_sub(outgoing),
                bkeep,
                cost: cost[k],
            });
            older += kept_by_birth[k];
        }
        out
    }
}

// ---- The dynamic program over blocks ----

/// What the program minimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Objective {
    /// Recompute FLOPs, subject to the peak fitting the arena budget.
    Cost,
    /// The peak, whatever the cost.
    Peak,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    k: u64,
    cost: u64,
    peak: u64,
    node: u32,
}

impl Solver {
    /// Runs the program: the blocks of the best segmentation, its model peak (arena bytes)
    /// and its cost, or `None` when no segmentation's peak fits `arena_budget`.
    pub(super) fn program(
        &self,
        arena_budget: u64,
        objective: Objective,
    ) -> Option<(Vec<Block>, u64, u64)> {
        let m = self.unit_count();
        // Unit 0 as the start, by the first block's kind.
        let start = |out: bool| {
            let t0 = self.terms.unit0[out as usize]?;
            (t0.peak <= arena_budget).then_some(Entry {
                k: t0.keep,
                cost: t0.cost,
                peak: t0.peak,
                node: u32::MAX,
            })
        };
        if m == 0 {
            let e = start(false)?;
            return Some((Vec::new(), e.peak, e.cost));
        }
        let mut nodes: Vec<(u32, Block)> = Vec::new();
        let mut states: Vec<[Vec<Entry>; CONTEXTS]> =
            (0..=m + 1).map(|_| Default::default()).collect();
        // From entry `e`, block `b` with terms `t`, when its peak fits.
        let mut extend = |e: Entry, b: Block, t: Term, states: &mut Vec<[Vec<Entry>; CONTEXTS]>| {
            let at = e.k + t.peak;
            if at > arena_budget {
                return;
            }
            nodes.push((e.node, b));
            states[b.end + 1][b.context()].push(Entry {
                k: e.k + t.keep + t.bkeep,
                cost: e.cost + t.cost,
                peak: e.peak.max(at),
                node: (nodes.len() - 1) as u32,
            });
        };
        // Unit 1 after unit 0, whose terms depend on unit 1's kind.
        for b in self.blocks_at(1) {
            if let (Some(e), Some(t)) = (start(b.out), self.term(&b, 0)) {
                extend(e, b, t, &mut states);
            }
        }
        for i in 2..=m {
            for tau in 0..CONTEXTS {
                let front = prune(std::mem::take(&mut states[i][tau]), objective);
                for e in front {
                    // Unit `i` stored (its outputs recomputed or not), or a run `[i..j]`
                    // checkpointed.
                    for b in self.blocks_at(i) {
                        if let Some(t) = self.term(&b, tau) {
                            extend(e, b, t, &mut states);
                        }
                    }
                }
            }
        }
        let finals: Vec<Entry> = states[m + 1].iter().flatten().copied().collect();
        let best = finals.into_iter().min_by_key(|e| match objective {
            Objective::Cost => (e.cost, e.peak, 0),
            Objective::Peak => (e.peak, e.cost, 0),
        })?;
        let mut blocks = Vec::new();
        let mut node = best.node;
        while node != u32::MAX {
            let (parent, b) = nodes[node as usize];
            blocks.push(b);
            node = parent;
        }
        blocks.reverse();
        Some((blocks, best.peak, best.cost))
    }
}

/// Drops entries another entry dominates: no more kept bytes and no worse objective.
fn prune(mut front: Vec<Entry>, objective: Objective) -> Vec<Entry> {
    let key = |e: &Entry| match objective {
        Objective::Cost => (e.k, e.cost, e.peak),
        Objective::Peak => (e.k, e.peak, e.cost),
    };
    front.sort_by_key(key);
    let mut out: Vec<Entry> = Vec::with_capacity(front.len());
    let mut best = u64::MAX;
    for e in front {
        let v = key(&e).1;
        if v < best {
            best = v;
            out.push(e);
        }
    }
    out
}

pub(super) fn blocks_to_segments(blocks: &[Block]) -> Vec<(usize, usize)> {
    blocks
        .iter()
        .filter(|b| b.ckpt)
        .map(|b| (b.start, b.end))
        .collect()
}

/// The segments and the units whose outputs are recomputed.
pub(super) fn blocks_to_selection(blocks: &[Block]) -> Selection {
    Selection {
        segments: blocks_to_segments(blocks),
        outputs: blocks.iter().filter(|b| b.out).map(|b| b.start).collect(),
    }
}

/// The region of every step of `s` (see `Solver::measure`), and the last loss step.
fn step_regions(
    s: &Schedule,
    of_layer: &dyn Fn(Option<usize>) -> Option<usize>,
    last_block: usize,
) -> (Vec<usize>, Option<usize>) {
    let n = s.steps.len();
    let mut region = vec![0usize; n];
    let mut current: Option<usize> = None;
    let mut last_loss: Option<usize> = None;
    // An input layer declared late (a loss target) casts where it is declared: its step
    // belongs to the block running then.
    let mut forward_block = 0usize;
    for (i, st) in s.steps.iter().enumerate() {
        region[i] = match st.phase {
            Phase::Forward => {
                let b = of_layer(st.layer).unwrap_or(0);
                if b != 0 {
                    forward_block = b;
                }
                forward_block
            }
            Phase::Loss => {
                last_loss = Some(i);
                last_block
            }
            Phase::Recompute => of_layer(st.layer).unwrap_or(last_block),
            Phase::Backward if matches!(st.op, Op::Accumulate { .. }) => {
                current.unwrap_or(last_block)
            }
            Phase::Backward => {
                let b = of_layer(st.layer).unwrap_or(last_block);
                current = Some(b);
                b
            }
            Phase::Update => 0,
        };
    }
    // A tensor redone for a backward (schedule.rs, `redone_in_backward`) is redone in the
    // region of the step it precedes, whichever block its layer is in.
    for i in (0..n.saturating_sub(1)).rev() {
        if s.steps[i].phase == Phase::Recompute && !s.checkpoint_recompute(i) {
            region[i] = region[i + 1];
        }
    }
    (region, last_loss)
}
