//! The general-graph search (U-Net skips, the VAE's heads): seeds from the chain program and
//! the baselines, then descent, variable neighbourhoods and kicks over segmentations, every
//! candidate evaluated by the real schedule.

use std::collections::HashMap;

use super::chain::{blocks_to_segments, Block, Objective};
use super::solver::recompute_flops;
use super::solver::Solver;
use super::Evaluation;
use crate::liveness::Lifetimes;
use crate::rng::SplitMix64;
use crate::ALIGNMENT;

/// A segmentation over units: `labels[u - 1]` is 0 (not checkpointed) or a segment label;
/// maximal runs of one nonzero label are segments.
type Labels = Vec<u32>;

pub(super) fn labels_to_segments(labels: &[u32]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut u = 0;
    while u < labels.len() {
        if labels[u] == 0 {
            u += 1;
            continue;
        }
        let start = u;
        while u + 1 < labels.len() && labels[u + 1] == labels[start] {
            u += 1;
        }
        out.push((start + 1, u + 1));
        u += 1;
    }
    out
}

fn segments_to_labels(m: usize, segments: &[(usize, usize)]) -> Labels {
    let mut labels = vec![0u32; m];
    for (k, &(s, e)) in segments.iter().enumerate() {
        for l in labels.iter_mut().take(e).skip(s - 1) {
            *l = k as u32 + 1;
        }
    }
    canonical(&labels)
}

/// Renumbers segment labels in order of appearance, so equal segmentations compare equal.
fn canonical(labels: &[u32]) -> Labels {
    let mut out = vec![0u32; labels.len()];
    let mut next = 0u32;
    for u in 0..labels.len() {
        if labels[u] == 0 {
            continue;
        }
        if u == 0 || labels[u - 1] != labels[u] {
            next += 1;
        }
        out[u] = next;
    }
    out
}

/// What the general search aims for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Goal {
    /// The least recomputation within the budget (and, failing that, the smallest total).
    Fit(u64),
    /// The smallest total.
    Smallest,
}

// ---- The general-graph search ----

impl Solver {
    /// Starting points of the search: the program's choices at a ladder of arena budgets
    /// (its memory terms are exact only on chains), the least-peak choice, and the baselines.
    pub(super) fn seeds(&self, budget: Option<u64>) -> Vec<Labels> {
        let m = self.unit_count();
        let mut seeds: Vec<Labels> = vec![vec![0; m]];
        for (_, b) in self.baselines() {
            seeds.push(segments_to_labels(m, &b));
        }
        // One segment anywhere: where a single recomputed region is the answer (a U-Net
        // level, a VAE decoder), the moves would have to build it a unit at a time.
        // Likewise every unit of a range as its own segment (the layer-by-layer end).
        if m <= SEARCH_SINGLE_SEGMENT_UNITS {
            for i in 1..=m {
                for j in i..=m {
                    seeds.push(segments_to_labels(m, &[(i, j)]));
                    if j > i {
                        let each: Vec<(usize, usize)> = (i..=j).map(|u| (u, u)).collect();
                        seeds.push(segments_to_labels(m, &each));
                    }
                }
            }
        }
        if let Some((blocks, _, _)) = self.program(u64::MAX, Objective::Peak) {
            seeds.push(segments_to_labels(m, &blocks_to_segments(&blocks)));
        }
        if let (Some(budget), true) = (budget, m <= SEARCH_SINGLE_SEGMENT_UNITS) {
            // Every two separate segments, screened by the program's memory (approximate
            // here, but cheap): the cheapest it believes fit, give or take 5 % of the arena.
            let screen = budget + budget.saturating_sub(self.persistent) / 20;
            let mut pairs: Vec<(u64, Vec<(usize, usize)>)> = Vec::new();
            for a in 1..=m {
                for b in a..=m {
                    for c in b + 2..=m {
                        for d in c..=m {
                            let segs = [(a, b), (c, d)];
                            if let Some((total, cost)) = self.model(&segs) {
                                if total <= screen {
                                    pairs.push((cost, segs.to_vec()));
                                }
                            }
                        }
                    }
                }
            }
            pairs.sort();
            for (_, segs) in pairs.into_iter().take(SEARCH_SCREENED_PAIRS) {
                seeds.push(segments_to_labels(m, &segs));
            }
        }
        if let Some(budget) = budget {
            // The program's memory is exact only on chains: ask it at a ladder of arena
            // budgets around the real one, and walk down while its answer overshoots.
            let arena = budget.saturating_sub(self.persistent);
            for pct in [70u64, 85, 95, 105, 120] {
                if let Some((blocks, _, _)) = self.program(arena / 100 * pct, Objective::Cost) {
                    seeds.push(segments_to_labels(m, &blocks_to_segments(&blocks)));
                }
            }
            let mut arena = arena;
            for _ in 0..6 {
                let Some((blocks, _, _)) = self.program(arena, Objective::Cost) else {
                    break;
                };
                let segs = blocks_to_segments(&blocks);
                let e = self.evaluate_units(&segs);
                seeds.push(segments_to_labels(m, &segs));
                if e.total <= budget {
                    break;
                }
                arena = arena.saturating_sub(e.total - budget);
            }
        }
        seeds.sort();
        seeds.dedup();
        seeds
    }

    /// Local search over segmentations, every one evaluated by the real schedule, within
    /// [`SEARCH_EVALUATIONS`] distinct evaluations:
    ///
    /// 1. descend from each seed, taking the best single move (a unit added to or removed
    ///    from a segment, two neighbouring segments merged, one split, a boundary moved);
    /// 2. at a local optimum, try adding a whole new segment anywhere, then pairs of moves
    ///    (variable-neighbourhood descent), because a peak is a maximum over steps: lowering
    ///    it often takes several changes at once;
    /// 3. with evaluations left, perturb the best by three random moves and descend again
    ///    (iterated local search, a fixed seed so that answers are reproducible).
    ///
    /// A fitting segmentation ranks by `(recompute, total)`; one that does not fit, by the
    /// bytes above the budget summed over steps (so that moves which lower the live bytes
    /// at some over-budget steps count as progress before the peak itself drops), then its
    /// total. For [`Goal::Smallest`] the rank is the total.
    pub(super) fn search(&self, goal: Goal, seeds: &[Labels]) -> (Labels, Evaluation) {
        let m = self.unit_count();
        let cap = if m <= SEARCH_SMALL_UNITS {
            2 * SEARCH_EVALUATIONS
        } else {
            SEARCH_EVALUATIONS
        };
        let mut cache: HashMap<Labels, Rank> = HashMap::new();
        let mut evals = 0usize;
        let mut rank = |l: &Labels, evals: &mut usize| -> Option<Rank> {
            if let Some(r) = cache.get(l) {
                return Some(*r);
            }
            if *evals >= cap {
                return None;
            }
            *evals += 1;
            self.searched.set(self.searched.get() + 1);
            let (e, over) = self.evaluate_over(&labels_to_segments(l), goal);
            let key = match goal {
                Goal::Smallest => (0, e.total, e.recompute_flops),
                Goal::Fit(b) if e.total <= b => (0, e.recompute_flops, e.total),
                Goal::Fit(_) => (1, over, e.total),
            };
            let r = Rank { key, e };
            cache.insert(l.clone(), r);
            Some(r)
        };
        // Rank every seed, then descend from the best few (below).
        let mut ranked: Vec<(Rank, Labels)> = Vec::new();
        for seed in seeds {
            let l = canonical(seed);
            if let Some(r) = rank(&l, &mut evals) {
                ranked.push((r, l));
            }
        }
        ranked.sort_by(|a, b| a.0.key.cmp(&b.0.key).then_with(|| a.1.cmp(&b.1)));
        // Best single move, then best pair, until neither improves or evaluations run out.
        let mut descend = |start: Labels, evals: &mut usize| -> Option<(Labels, Rank)> {
            let mut cur = canonical(&start);
            let mut cur_r = rank(&cur, evals)?;
            'outer: loop {
                let ones = neighbours(&cur);
                let mut best: Option<(Labels, Rank)> = None;
                for n in &ones {
                    let Some(r) = rank(n, evals) else {
                        break 'outer;
                    };
                    if r.key < best.as_ref().map_or(cur_r.key, |b| b.1.key) {
                        best = Some((n.clone(), r));
                    }
                }
                if let Some((n, r)) = best {
                    cur = n;
                    cur_r = r;
                    continue;
                }
                // The first improving new segment, then the first improving pair of moves.
                let pairs = ones.iter().flat_map(|a| neighbours(a));
                for n in new_segments(&cur).into_iter().chain(pairs) {
                    let Some(r) = rank(&n, evals) else {
                        break 'outer;
                    };
                    if r.key < cur_r.key {
                        cur = n;
                        cur_r = r;
                        continue 'outer;
                    }
                }
                break;
            }
            Some((cur, cur_r))
        };
        let mut best: Option<(Labels, Rank)> = None;
        let keep = |c: Option<(Labels, Rank)>, best: &mut Option<(Labels, Rank)>| {
            if let Some((l, r)) = c {
                if best.as_ref().is_none_or(|(_, b)| r.key < b.key) {
                    *best = Some((l, r));
                }
            }
        };
        for (_, l) in ranked.into_iter().take(SEARCH_DESCENTS) {
            let c = descend(l, &mut evals);
            keep(c, &mut best);
        }
        // Iterated local search: kick the best by 2–5 random moves and descend again.
        let mut rng = SplitMix64::new(0x6d65_6d77_6973_6521);
        let mut stale = 0;
        while evals < cap && stale < SEARCH_STALE_KICKS {
            let Some((start, start_rank)) = best.clone() else {
                break;
            };
            let mut l = start;
            for _ in 0..rng.range(2, 5) {
                let ns = neighbours(&l);
                if ns.is_empty() {
                    break;
                }
                l = ns[rng.below(ns.len())].clone();
            }
            let c = descend(l, &mut evals);
            keep(c, &mut best);
            let improved = best.as_ref().is_some_and(|(_, r)| r.key < start_rank.key);
            stale = if improved { 0 } else { stale + 1 };
        }
        best.map_or_else(|| (vec![0; m], self.unchecked), |(l, r)| (l, r.e))
    }

    /// The real evaluation of a segmentation and, for [`Goal::Fit`], its live bytes above
    /// the budget summed over the steps.
    fn evaluate_over(&self, segments: &[(usize, usize)], goal: Goal) -> (Evaluation, u64) {
        let s = self.schedule(&Block::segments(segments));
        let life = Lifetimes::compute(&s, ALIGNMENT);
        let n = s.steps.len();
        let mut delta = vec![0i128; n + 1];
        for &(bytes, first, last) in &life.buffers {
            delta[(first as usize).min(n)] += bytes as i128;
            delta[(last as usize + 1).min(n)] -= bytes as i128;
        }
        let arena = match goal {
            Goal::Fit(b) => b.saturating_sub(self.persistent) as i128,
            Goal::Smallest => i128::MAX,
        };
        let (mut live, mut peak, mut over) = (0i128, 0i128, 0i128);
        for d in delta.iter().take(n) {
            live += d;
            peak = peak.max(live);
            over += (live - arena).max(0);
        }
        let e = Evaluation {
            total: self.persistent + peak as u64,
            recompute_flops: recompute_flops(&s),
        };
        (e, over as u64)
    }
}

/// Distinct segmentations the general search may evaluate (each a real schedule: about
/// 0.5 ms for the U-Net, 20 µs for a ten-layer graph, in release); twice as many on graphs
/// of at most [`SEARCH_SMALL_UNITS`] units, where each costs little.
pub const SEARCH_EVALUATIONS: usize = 3000;
/// See [`SEARCH_EVALUATIONS`].
pub const SEARCH_SMALL_UNITS: usize = 16;
/// Seeds the general search descends from (the best-ranked).
const SEARCH_DESCENTS: usize = 12;
/// Consecutive kicks without improvement after which the search stops.
const SEARCH_STALE_KICKS: usize = 150;
/// Two-segment seeds the general search takes from the program's screening.
const SEARCH_SCREENED_PAIRS: usize = 24;
/// Units up to which every single segment, and every range of one-unit segments, is a seed
/// of the general search, and every pair of segments is screened.
const SEARCH_SINGLE_SEGMENT_UNITS: usize = 40;

/// A segmentation's rank in the search (smaller is better) and its evaluation.
#[derive(Clone, Copy, Debug)]
struct Rank {
    key: (u8, u64, u64),
    e: Evaluation,
}

/// `l` with one more segment over any run of units no segment holds.
fn new_segments(l: &[u32]) -> Vec<Labels> {
    let fresh = l.iter().copied().max().unwrap_or(0) + 1;
    let mut out = Vec::new();
    for i in 0..l.len() {
        for j in i..l.len() {
            if l[j] != 0 {
                break;
            }
            let mut n = l.to_vec();
            n[i..=j].fill(fresh);
            out.push(canonical(&n));
        }
    }
    out
}

/// Every segmentation one move away from `l` (canonical, deduplicated).
fn neighbours(l: &[u32]) -> Vec<Labels> {
    let m = l.len();
    let fresh = l.iter().copied().max().unwrap_or(0) + 1;
    let mut out: Vec<Labels> = Vec::new();
    let mut with = |f: &dyn Fn(&mut Labels)| {
        let mut n = l.to_vec();
        f(&mut n);
        out.push(canonical(&n));
    };
    // Drop a whole segment.
    for seg in 1..fresh {
        with(&|n| {
            for x in n.iter_mut().filter(|x| **x == seg) {
                *x = 0;
            }
        });
    }
    for u in 0..m {
        if l[u] == 0 {
            with(&|n| n[u] = fresh);
            if u > 0 && l[u - 1] != 0 {
                with(&|n| n[u] = l[u - 1]);
            }
            if u + 1 < m && l[u + 1] != 0 {
                with(&|n| n[u] = l[u + 1]);
            }
        } else {
            with(&|n| n[u] = 0);
            if u + 1 < m && l[u + 1] != 0 && l[u + 1] != l[u] {
                // Merge with the next segment, or move the boundary either way.
                with(&|n| {
                    let (a, b) = (l[u], l[u + 1]);
                    for x in n.iter_mut() {
                        if *x == b {
                            *x = a;
                        }
                    }
                });
                with(&|n| n[u] = l[u + 1]);
                with(&|n| n[u + 1] = l[u]);
            }
            if u > 0 && l[u - 1] == l[u] {
                // Split before u.
                with(&|n| {
                    let mut v = u;
                    while v < m && l[v] == l[u] {
                        n[v] = fresh;
                        v += 1;
                    }
                });
            }
        }
    }
    out.sort();
    out.dedup();
    out.retain(|n| n.as_slice() != l);
    out
}
