//! Automatic checkpointing: which layers to recompute so that one training step fits a memory
//! budget with the least recomputation, and the largest batch each policy
//! ([`Policy`]) fits in a budget.
//!
//! The memory of a choice is the planner's own accounting — persistent bytes plus the most
//! bytes live at any step of the real [`Schedule`] (the arena's lower bound, which the packer
//! meets on every benchmark graph) — and [`solve`] checks its answer with a full
//! [`crate::plan()`]. The cost of a choice is the forward FLOPs of the schedule's `recompute`
//! steps ([`crate::op::Op::forward_flops`]).
//!
//! - **Chains** of units (single layers, or single-entry single-exit blocks such as residual
//!   blocks: the layers between two cut points where only one tensor crosses) are solved
//!   exactly by a dynamic program over segments, in the spirit of Beaumont et al.'s optimal
//!   checkpointing for heterogeneous chains (rotor). Its memory terms are not a model of the
//!   planner: they are read off real schedules ("probes"), so the optimum is the optimum of
//!   the planner's real memory. `docs/CHECKPOINTING.md` proves why a chain's live bytes
//!   decompose that way and `tests/checkpoint_solver.rs` checks it against exhaustive search.
//! - **General graphs** (U-Net skips, concatenations, the VAE's two heads) use the same program
//!   on the layers in declaration order as a candidate generator, then a local search over
//!   segmentations in which every candidate is evaluated by the real schedule.

//!
//! The module, by concern: this file, the policy and the public answers ([`solve`],
//! [`Policy`], [`max_batch_with`] — the planner's one largest-batch search —, [`fit_budget`],
//! [`CheckpointChoice`]); [`Solver`] (`solver.rs`: units, cut points, real evaluations); the
//! chain dynamic program (`chain.rs`); the general-graph search (`search.rs`).

mod chain;
mod search;
mod solver;

use std::fmt;

pub use search::{SEARCH_EVALUATIONS, SEARCH_SMALL_UNITS};
pub use solver::{even_runs, Selection, Solver};

use crate::advice::format_bytes;
use crate::arena::packing::lower_bound;
use crate::autodiff::StepGraph;
use crate::dtype::Precision;
use crate::error::PlanError;
use crate::estimate::layout_params;
use crate::graph::Graph;
use crate::liveness::Lifetimes;
use crate::schedule::Schedule;
use crate::spec::ModelSpec;
use crate::ALIGNMENT;

/// How a [`CheckpointChoice`] was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// The dynamic program over a chain of units: the least recomputation among all
    /// segmentations whose segments are runs of whole units.
    ChainOptimal,
    /// The general-graph search (dynamic-program candidates, then local search).
    GraphSearch,
}

/// The checkpoint segments [`solve`] chose and what they cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointChoice {
    /// Layer names of each segment, in declaration order (each segment is one
    /// `checkpoint` id: consecutive layers dropped after forward and recomputed before
    /// their backward).
    pub segments: Vec<Vec<String>>,
    /// Layers outside the segments whose norm outputs are recomputed instead of kept
    /// (`LayerSpec::recompute_output`), in declaration order.
    pub recompute_outputs: Vec<String>,
    /// `plan().memory.total` with these segments.
    pub total: u64,
    /// The budget it was solved for.
    pub budget: u64,
    /// `plan().memory.total` with no checkpointing.
    pub unchecked_total: u64,
    /// Forward FLOPs of the recompute steps, per training step.
    pub recompute_flops: u64,
    /// Forward FLOPs of one forward pass.
    pub forward_flops: u64,
    pub method: Method,
}

impl CheckpointChoice {
    /// Recomputation as a percentage of the forward FLOPs.
    pub fn recompute_percent(&self) -> f64 {
        if self.forward_flops == 0 {
            0.0
        } else {
            100.0 * self.recompute_flops as f64 / self.forward_flops as f64
        }
    }

    /// `spec` with exactly these segments checkpointed and these outputs recomputed (any
    /// other `checkpoint` and `recompute_output` cleared).
    pub fn apply(&self, spec: &ModelSpec) -> ModelSpec {
        with_choice(spec, &self.segments, &self.recompute_outputs)
    }
}

impl fmt::Display for CheckpointChoice {
    /// `checkpoints 3 segments (12 layers): 5.2 GiB of 6 GiB (9.8 GiB without); recomputes
    /// 11% of forward FLOPs`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let outputs = self.recompute_outputs.len();
        if self.segments.is_empty() && outputs == 0 {
            return write!(
                f,
                "no checkpointing needed: {} of {}",
                format_bytes(self.total),
                format_bytes(self.budget)
            );
        }
        let layers: usize = self.segments.iter().map(Vec::len).sum();
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let segments = format!(
            "checkpoints {} segment{} ({layers} layers)",
            self.segments.len(),
            plural(self.segments.len())
        );
        let norms = format!("recomputes {outputs} norm output{}", plural(outputs));
        let what = match (self.segments.is_empty(), outputs) {
            (false, 0) => segments,
            (true, _) => norms,
            (false, _) => format!("{segments}, {norms}"),
        };
        write!(
            f,
            "{what}: {} of {} ({} without); recomputes {:.0}% of forward FLOPs",
            format_bytes(self.total),
            format_bytes(self.budget),
            format_bytes(self.unchecked_total),
            self.recompute_percent()
        )
    }
}

/// Chooses checkpoint segments so that `plan(spec).memory.total <= budget` with the fewest
/// recomputed forward FLOPs (ties: the smaller total). Checkpoint ids already in `spec` are
/// ignored. The error, when no checkpointing fits, says the smallest total one reaches.
pub fn solve(spec: &ModelSpec, budget: u64) -> Result<CheckpointChoice, PlanError> {
    Solver::new(spec)?.solve(budget)
}

/// What a batch search may change to make a model fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The model as declared.
    Plain,
    /// `precision = mixed_float16` (when declared float32).
    Fp16,
    /// Checkpoint segments chosen by [`solve`].
    AutoCheckpoint,
    /// Both.
    Fp16AndAutoCheckpoint,
}

impl Policy {
    pub const ALL: [Policy; 4] = [
        Policy::Plain,
        Policy::Fp16,
        Policy::AutoCheckpoint,
        Policy::Fp16AndAutoCheckpoint,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Policy::Plain => "plain",
            Policy::Fp16 => "fp16",
            Policy::AutoCheckpoint => "auto-checkpoint",
            Policy::Fp16AndAutoCheckpoint => "fp16 + auto-checkpoint",
        }
    }

    /// The spec this policy plans (mixed float16 where it asks for it).
    pub fn spec(self, spec: &ModelSpec) -> ModelSpec {
        let mut s = spec.clone();
        if matches!(self, Policy::Fp16 | Policy::Fp16AndAutoCheckpoint)
            && s.precision == Precision::Float32
        {
            s.precision = Precision::MixedFloat16;
        }
        s
    }
}

/// The largest batch whose step fits `budget` under `policy`: the planner's one
/// largest-batch search, used by the macro's `MAX_BATCH`, `Model::max_batch`, the budget
/// error's fixes and [`fit_budget`].
///
/// Edge behaviour, for every policy: `None` when batch 1 does not fit (or the model cannot be
/// planned at all); otherwise the largest `b` in `1..=`[`BATCH_LIMIT`] that fits. Memory grows
/// with the batch (every transient tensor scales with it), so "fits" is monotone in the batch
/// and the search is exponential, then bisection (`largest_batch`); a batch that cannot be
/// planned counts as not fitting.
///
/// For the checkpointing policies a full solve per batch tried would cost a solver each;
/// instead the segmentation with the smallest total at one batch is carried up the batches
/// (planning it is cheap) until it no longer fits, and only there is the solver asked again
/// whether any other segmentation fits. The answer is checked by [`Solver::solve`].
pub fn max_batch_with(spec: &ModelSpec, budget: u64, policy: Policy) -> Option<usize> {
    let n = spec.replicas.max(1);
    if n > 1 {
        // A replica at its share `b` of the batch holds what one device holds at batch `b`
        // (the gradient sums are in place) but for its shard of the optimizer state under
        // ZeRO, a difference the batch does not change: the largest global batch is `n`
        // shares of one device's under the budget less that difference.
        let one = spec.one_device();
        let state = |s: &ModelSpec| crate::plan(s).map(|p| p.memory.optimizer).ok();
        let saved = match (state(&one.with_batch(1)), state(&spec.with_batch(n))) {
            (Some(whole), Some(shard)) => whole.saturating_sub(shard),
            _ => 0,
        };
        return max_batch_with(&one, budget + saved, policy).map(|b| b * n);
    }
    let base = policy.spec(spec);
    let fits = |b: usize| crate::advice::total(&base.with_batch(b)).is_some_and(|t| t <= budget);
    let plain = largest_batch(0, fits);
    if matches!(policy, Policy::Plain | Policy::Fp16) {
        return plain;
    }
    // What fits unchecked fits checkpointed: start there.
    let mut lo = plain.unwrap_or(0);
    while lo < BATCH_LIMIT {
        let Ok(solver) = Solver::new(&base.with_batch(lo + 1)) else {
            break;
        };
        let (smallest, selection) = solver.smallest_total();
        if smallest > budget {
            break;
        }
        let names = solver.segment_names(&selection.segments);
        let outputs = solver.output_names(&selection.outputs);
        let fits = |b: usize| {
            let s = with_choice(&base.with_batch(b), &names, &outputs);
            lower_bound_total(&s).is_ok_and(|t| t <= budget)
        };
        lo = largest_batch(lo + 1, fits)?;
    }
    // The search used the arena's lower bound; the planned total must fit too.
    while lo > 0 {
        if Solver::new(&base.with_batch(lo)).is_ok_and(|s| s.solve(budget).is_ok()) {
            return Some(lo);
        }
        lo -= 1;
    }
    None
}

/// How [`fit_budget`] made a model fit a memory budget.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetFit {
    /// The spec to build: the declared one, or at a smaller batch and/or with the chosen
    /// checkpoint segments.
    pub spec: ModelSpec,
    /// Its plan; `plan.memory.total <= budget`.
    pub plan: crate::StaticPlan,
    pub budget: u64,
    /// The batch the model was declared with (`plan.batch` may be smaller).
    pub declared_batch: usize,
    /// The segments chosen, when the declared checkpointing did not fit.
    pub checkpoint: Option<CheckpointChoice>,
}

impl fmt::Display for BudgetFit {
    /// `batch 128 as declared: 5.55 MiB of 20 GiB` (then what checkpointing chose, if any).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.plan.batch == self.declared_batch {
            write!(f, "batch {} as declared", self.plan.batch)?;
        } else {
            write!(
                f,
                "batch {} (the largest that fits; declared {})",
                self.plan.batch, self.declared_batch
            )?;
        }
        write!(
            f,
            ": {} of {}",
            format_bytes(self.plan.memory.total),
            format_bytes(self.budget)
        )?;
        if let Some(c) = &self.checkpoint {
            write!(f, "; {c}")?;
        }
        Ok(())
    }
}

/// Makes `spec` fit `budget` without changing what it computes where possible: the model as
/// declared when it fits; else, at the declared batch, the checkpoint segments [`solve`]
/// chooses (the numbers stay the same, the step recomputes); else the largest batch that fits
/// with checkpointing ([`max_batch_with`], [`Policy::AutoCheckpoint`]) and its segments.
/// Never switches precision, which would change the numbers. The error says the smallest
/// total reachable at batch 1.
pub fn fit_budget(spec: &ModelSpec, budget: u64) -> Result<BudgetFit, PlanError> {
    let declared_batch = spec.batch;
    let fitted = |spec: ModelSpec, checkpoint: Option<CheckpointChoice>| {
        let plan = crate::plan(&spec)?;
        Ok(BudgetFit {
            spec,
            plan,
            budget,
            declared_batch,
            checkpoint,
        })
    };
    let declared = crate::plan(spec)?;
    if declared.memory.total <= budget {
        return fitted(spec.clone(), None);
    }
    if let Ok(choice) = solve(spec, budget) {
        return fitted(choice.apply(spec), Some(choice));
    }
    let Some(batch) = max_batch_with(spec, budget, Policy::AutoCheckpoint) else {
        let one = spec.with_batch(1);
        let smallest = Solver::new(&one).map(|s| s.smallest_total().0)?;
        return Err(PlanError::model(format!(
            "model `{}` does not fit {}: even at batch 1 with the most checkpointing it needs {}",
            spec.name,
            format_bytes(budget),
            format_bytes(smallest)
        )));
    };
    let smaller = spec.with_batch(batch);
    if crate::plan(&smaller)?.memory.total <= budget {
        return fitted(smaller, None);
    }
    let choice = solve(&smaller, budget)?;
    fitted(choice.apply(&smaller), Some(choice))
}

/// `spec` with exactly `segments` (layer names, disjoint) checkpointed: segment `k` gets
/// checkpoint id `k`, every other layer none.
pub fn with_segments(spec: &ModelSpec, segments: &[Vec<String>]) -> ModelSpec {
    with_choice(spec, segments, &[])
}

/// `spec` with exactly `segments` checkpointed ([`with_segments`]) and exactly the layers
/// named in `outputs` recomputing their outputs (`LayerSpec::recompute_output`).
pub fn with_choice(spec: &ModelSpec, segments: &[Vec<String>], outputs: &[String]) -> ModelSpec {
    let mut s = spec.clone();
    for l in s.layers.iter_mut() {
        l.checkpoint = segments
            .iter()
            .position(|seg| seg.contains(&l.name))
            .map(|k| k as u32);
        l.recompute_output = outputs.contains(&l.name);
    }
    s
}

/// Persistent bytes plus the arena's lower bound of `spec` as declared: what the solver's
/// objective counts, without packing the arena.
pub fn lower_bound_total(spec: &ModelSpec) -> Result<u64, PlanError> {
    let mut g = Graph::build(spec)?;
    let st = StepGraph::build(&mut g, spec)?;
    let s = Schedule::build(&g, &st);
    let life = Lifetimes::compute(&s, ALIGNMENT);
    Ok(persistent_bytes(spec, &g, &s) + arena_lower_bound(&life))
}

/// Parameters, their gradients and optimizer state: the same for every segmentation.
fn persistent_bytes(spec: &ModelSpec, g: &Graph, s: &Schedule) -> u64 {
    // The order of the gradients changes no size.
    let (_, p) = layout_params(spec, g, &s.updated, &[], ALIGNMENT);
    p.params + p.grads + p.optimizer
}

/// The most bytes live at one step of `life`'s buffers: the arena's lower bound.
fn arena_lower_bound(life: &Lifetimes) -> u64 {
    lower_bound(&crate::arena::requests(life))
}

/// Largest batch any search tries.
pub const BATCH_LIMIT: usize = 1 << 24;

/// The largest `b` in `1..=BATCH_LIMIT` with `fits(b)`, given that `start` fits (0: nothing
/// known), assuming `fits` is monotone. Exponential search up from `start`, then bisection.
pub(crate) fn largest_batch(start: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let mut lo = start.min(BATCH_LIMIT);
    if lo == 0 {
        if !fits(1) {
            return None;
        }
        lo = 1;
    }
    let mut hi = lo * 2;
    while hi <= BATCH_LIMIT && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    if hi > BATCH_LIMIT {
        if lo == BATCH_LIMIT || fits(BATCH_LIMIT) {
            return Some(BATCH_LIMIT);
        }
        hi = BATCH_LIMIT;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// The real memory and cost of one segmentation: persistent bytes plus the arena's lower
/// bound (the most bytes live at one step), and the forward FLOPs of the recompute steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evaluation {
    pub total: u64,
    pub recompute_flops: u64,
}
