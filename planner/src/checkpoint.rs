//! Automatic checkpointing: which layers to recompute so that one training step fits a memory
//! budget with the least recomputation, and the largest batch each policy
//! ([`Policy`]) fits in a budget.
//!
//! The memory of a choice is the planner's own accounting — persistent bytes plus the most
//! bytes live at any step of the real [`Schedule`] (the arena's lower bound, which the packer
//! meets on every benchmark graph) — and [`solve`] checks its answer with a full
//! [`crate::plan`]. The cost of a choice is the forward FLOPs of the schedule's `recompute`
//! steps ([`Op::forward_flops`]).
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

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

use crate::advice::{format_bytes, max_batch};
use crate::arena::packing::{lower_bound, BufferRequest};
use crate::autodiff::StepGraph;
use crate::dtype::Precision;
use crate::error::PlanError;
use crate::graph::{Graph, TensorId};
use crate::liveness::Lifetimes;
use crate::op::Op;
use crate::plan::{Phase, Role, NONE};
use crate::schedule::Schedule;
use crate::spec::{LayerKind, ModelSpec};
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

    /// `spec` with exactly these segments checkpointed (any other `checkpoint` cleared).
    pub fn apply(&self, spec: &ModelSpec) -> ModelSpec {
        let mut s = spec.clone();
        for l in s.layers.iter_mut() {
            l.checkpoint = None;
        }
        for (k, seg) in self.segments.iter().enumerate() {
            for l in s.layers.iter_mut() {
                if seg.contains(&l.name) {
                    l.checkpoint = Some(k as u32);
                }
            }
        }
        s
    }
}

impl fmt::Display for CheckpointChoice {
    /// `checkpoints 3 segments (12 layers): 5.2 GiB of 6 GiB (9.8 GiB without); recomputes
    /// 11% of forward FLOPs`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.segments.is_empty() {
            return write!(
                f,
                "no checkpointing needed: {} of {}",
                format_bytes(self.total),
                format_bytes(self.budget)
            );
        }
        let layers: usize = self.segments.iter().map(Vec::len).sum();
        write!(
            f,
            "checkpoints {} segment{} ({layers} layers): {} of {} ({} without); recomputes {:.0}% of forward FLOPs",
            self.segments.len(),
            if self.segments.len() == 1 { "" } else { "s" },
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

/// The largest batch (at most [`BATCH_LIMIT`]) whose step fits `budget` under `policy`, or
/// `None` when batch 1 does not.
///
/// Memory grows with the batch, so this is a search over the batch. For the checkpointing
/// policies a full solve per batch tried would cost a solver each; instead the segmentation
/// with the smallest total at one batch is carried up the batches (planning it is cheap)
/// until it no longer fits, and only there is the solver asked again whether any other
/// segmentation fits. The answer is checked by [`Solver::solve`].
pub fn max_batch_with(spec: &ModelSpec, budget: u64, policy: Policy) -> Option<usize> {
    let base = policy.spec(spec);
    let plain = max_batch(&base, budget);
    if matches!(policy, Policy::Plain | Policy::Fp16) {
        return plain;
    }
    // What fits unchecked fits checkpointed: start there.
    let mut lo = plain.unwrap_or(0);
    while lo < BATCH_LIMIT {
        let Ok(solver) = Solver::new(&base.with_batch(lo + 1)) else {
            break;
        };
        let (smallest, segs) = solver.smallest_total();
        if smallest > budget {
            break;
        }
        let names = solver.segment_names(&segs);
        let fits = |b: usize| {
            let s = with_segments(&base.with_batch(b), &names);
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

/// `spec` with exactly `segments` (layer names) checkpointed, one id each.
fn with_segments(spec: &ModelSpec, segments: &[Vec<String>]) -> ModelSpec {
    let mut s = spec.clone();
    for l in s.layers.iter_mut() {
        l.checkpoint = segments
            .iter()
            .position(|seg| seg.contains(&l.name))
            .map(|k| k as u32);
    }
    s
}

/// Persistent bytes plus the arena's lower bound of `spec` as declared: what the solver's
/// objective counts, without packing the arena.
pub fn lower_bound_total(spec: &ModelSpec) -> Result<u64, PlanError> {
    let g = Graph::build(spec)?;
    let st = StepGraph::build(&g, spec)?;
    let s = Schedule::build(&g, &st);
    let life = Lifetimes::compute(&s, ALIGNMENT);
    let reqs: Vec<BufferRequest> = life
        .buffers
        .iter()
        .map(|&(bytes, first, last)| BufferRequest {
            bytes,
            first: first as usize,
            last: last as usize,
        })
        .collect();
    let (_, p) = crate::estimate::layout_params(spec, &g, &s.updated, ALIGNMENT);
    Ok(p.params + p.grads + p.optimizer + lower_bound(&reqs))
}

/// Largest batch any search here tries (as `advice::max_batch`).
pub const BATCH_LIMIT: usize = 1 << 24;

/// The largest `b` in `1..=BATCH_LIMIT` with `fits(b)`, given that `start` fits (0: nothing
/// known), assuming `fits` is monotone. Exponential search up from `start`, then bisection.
fn largest_batch(start: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
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

/// A run of units `start..=end` (1-based unit indices), checkpointed as one segment or, for
/// a single unit, stored (not checkpointed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Block {
    start: usize,
    end: usize,
    ckpt: bool,
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
struct Terms {
    unit0: Term,
    /// `stored[u][tau]`: unit `u` not checkpointed; `tau` = the block before is checkpointed.
    stored: Vec<[Option<Term>; 2]>,
    /// `ckpt[(i, j)][tau]`.
    ckpt: HashMap<(usize, usize), [Option<Term>; 2]>,
    /// Some block measured twice differed (the decomposition did not hold).
    inconsistent: bool,
    probes: usize,
}

/// Solves one model for any number of budgets: the graph, its units and the probe terms
/// are computed once.
pub struct Solver {
    spec: ModelSpec,
    graph: RefCell<Graph>,
    step: StepGraph,
    /// `units[0]`: the input layers; `units[u]` for `u >= 1`: layer indices in order.
    units: Vec<Vec<usize>>,
    unit_of_layer: Vec<usize>,
    /// Tensors crossing into unit `u` (born in units before it, read by it or later).
    cross: Vec<Vec<TensorId>>,
    chain: bool,
    persistent: u64,
    forward_flops: u64,
    unchecked: Evaluation,
    terms: Terms,
    /// Distinct segmentations the general search has evaluated, over all its runs.
    searched: std::cell::Cell<usize>,
}

/// Units of declaration order: unit 0 holds the input layers; every other unit is one layer
/// with ops plus the op-less views before it. Returns the units, the tensors crossing into
/// each, and whether every input layer comes before the first layer with ops.
fn layer_units(spec: &ModelSpec, graph: &Graph) -> (Vec<Vec<usize>>, bool) {
    let mut units: Vec<Vec<usize>> = vec![Vec::new()];
    let mut pending: Vec<usize> = Vec::new();
    let mut inputs_first = true;
    let mut seen_op_layer = false;
    // Tensors some non-input layer reads.
    let mut read_by_layers = vec![false; graph.tensors.len()];
    for op in &graph.ops {
        if !matches!(spec.layers[op.layer].kind, LayerKind::Input { .. }) {
            for &t in &op.inputs {
                read_by_layers[t] = true;
            }
        }
    }
    for (l, ls) in spec.layers.iter().enumerate() {
        if matches!(ls.kind, LayerKind::Input { .. }) {
            // An input declared after the first layer is fine when only losses read it (a
            // target); one that a layer reads makes a second entry into the chain.
            let gl = &graph.layers[l];
            let mut mine = vec![gl.output.tensor];
            for op in &graph.ops[gl.ops.clone()] {
                mine.extend(&op.inputs);
                mine.extend(&op.outputs);
            }
            inputs_first &= !seen_op_layer || !mine.iter().any(|&t| read_by_layers[t]);
            units[0].push(l);
        } else if graph.layers[l].ops.is_empty() {
            pending.push(l);
        } else {
            seen_op_layer = true;
            pending.push(l);
            units.push(std::mem::take(&mut pending));
        }
    }
    if !pending.is_empty() {
        match units.len() {
            1 => units[0].extend(pending),
            n => units[n - 1].extend(pending),
        }
    }
    (units, inputs_first)
}

/// For units `0..n`, the tensors crossing into each unit `u >= 1`: born in a unit before
/// `u`, read by an op of unit `u` or later or by a loss. Tensors born in unit 0 that only
/// unit 0 and the losses read (labels, targets) never cross: they are the same for every
/// segmentation.
fn crossings(graph: &Graph, units: &[Vec<usize>], unit_of_layer: &[usize]) -> Vec<Vec<TensorId>> {
    let n = units.len();
    let nt = graph.tensors.len();
    let mut born = vec![0usize; nt];
    let mut last_use = vec![0usize; nt];
    for op in &graph.ops {
        let u = unit_of_layer[op.layer];
        for &t in &op.outputs {
            born[t] = u;
        }
        for &t in &op.inputs {
            last_use[t] = last_use[t].max(u);
        }
    }
    for (b, t) in born.iter_mut().zip(&graph.tensors) {
        if t.is_input {
            *b = 0;
        }
    }
    for l in &graph.losses {
        for &t in &l.reads {
            // A loss reads after every unit, except what only unit 0 and losses touch.
            if !(born[t] == 0 && last_use[t] == 0) {
                last_use[t] = n;
            }
        }
    }
    let mut cross = vec![Vec::new(); n + 1];
    for t in 0..nt {
        for c in cross
            .iter_mut()
            .take(last_use[t].min(n - 1) + 1)
            .skip(born[t] + 1)
        {
            c.push(t);
        }
    }
    cross.truncate(n);
    cross
}

impl Solver {
    /// Lowers `spec` (with its checkpoint ids cleared), finds its units and probes them.
    pub fn new(spec: &ModelSpec) -> Result<Solver, PlanError> {
        let mut spec = spec.clone();
        for l in spec.layers.iter_mut() {
            l.checkpoint = None;
        }
        let graph = Graph::build(&spec)?;
        let step = StepGraph::build(&graph, &spec)?;
        let (lunits, inputs_first) = layer_units(&spec, &graph);
        let mut unit_of_layer = vec![0usize; spec.layers.len()];
        for (u, ls) in lunits.iter().enumerate() {
            for &l in ls {
                unit_of_layer[l] = u;
            }
        }
        let lcross = crossings(&graph, &lunits, &unit_of_layer);
        // Merge layer units into blocks: a new block starts at each cut point, where only
        // one tensor crosses.
        let mut units: Vec<Vec<usize>> = vec![lunits[0].clone()];
        for u in 1..lunits.len() {
            if u == 1 || lcross[u].len() == 1 {
                units.push(lunits[u].clone());
            } else {
                units.last_mut().expect("a block").extend(&lunits[u]);
            }
        }
        let op_layers = lunits.len() - 1;
        let largest = units.iter().skip(1).map(Vec::len).max().unwrap_or(0);
        // A chain of blocks is solved exactly at block granularity; when one block holds a
        // large part of the model (U-Net's skips, the VAE's heads), the general search over
        // layers does better.
        let chain = inputs_first && (units.len() == lunits.len() || largest * 4 <= op_layers);
        let units = if chain { units } else { lunits };
        let mut unit_of_layer = vec![0usize; spec.layers.len()];
        for (u, ls) in units.iter().enumerate() {
            for &l in ls {
                unit_of_layer[l] = u;
            }
        }
        let cross = if chain {
            crossings(&graph, &units, &unit_of_layer)
        } else {
            // For the general search's candidate generator: what the previous unit hands on.
            let all = crossings(&graph, &units, &unit_of_layer);
            let mut born = vec![0usize; graph.tensors.len()];
            for op in &graph.ops {
                for &t in &op.outputs {
                    born[t] = unit_of_layer[op.layer];
                }
            }
            all.iter()
                .enumerate()
                .map(|(u, ts)| {
                    ts.iter()
                        .copied()
                        .filter(|&t| u == 1 || born[t] + 1 == u)
                        .collect()
                })
                .collect()
        };
        let mut solver = Solver {
            spec,
            graph: RefCell::new(graph),
            step,
            units,
            unit_of_layer,
            cross,
            chain,
            persistent: 0,
            forward_flops: 0,
            unchecked: Evaluation {
                total: 0,
                recompute_flops: 0,
            },
            terms: Terms::default(),
            searched: std::cell::Cell::new(0),
        };
        {
            let g = solver.graph.borrow();
            let s = Schedule::build(&g, &solver.step);
            let (_, p) = crate::estimate::layout_params(&solver.spec, &g, &s.updated, ALIGNMENT);
            solver.persistent = p.params + p.grads + p.optimizer;
            solver.forward_flops = s
                .steps
                .iter()
                .filter(|st| st.phase == Phase::Forward)
                .map(|st| st.op.forward_flops())
                .sum();
        }
        solver.unchecked = solver.evaluate_blocks(&[]);
        solver.probe_all();
        Ok(solver)
    }

    /// Number of units (unit 0, the inputs, excluded).
    pub fn unit_count(&self) -> usize {
        self.units.len() - 1
    }

    /// Layer names of unit `u` (1-based).
    pub fn unit_layers(&self, u: usize) -> Vec<String> {
        self.units[u]
            .iter()
            .map(|&l| self.spec.layers[l].name.clone())
            .collect()
    }

    /// True when the model is a chain of units and [`Solver::solve`] is exact over
    /// segmentations of whole units.
    pub fn is_chain(&self) -> bool {
        self.chain
    }

    /// Probes the model took (real schedules built to read the terms off).
    pub fn probes(&self) -> usize {
        self.terms.probes
    }

    /// Some block's terms differed between two probes: the chain decomposition did not hold
    /// (never expected for a chain; the real check still guards every answer).
    pub fn inconsistent(&self) -> bool {
        self.terms.inconsistent
    }

    /// Distinct segmentations the general search has evaluated so far (0 on chains).
    pub fn search_evaluations(&self) -> usize {
        self.searched.get()
    }

    /// Persistent bytes (parameters, gradients, optimizer state).
    pub fn persistent(&self) -> u64 {
        self.persistent
    }

    /// Forward FLOPs of one forward pass.
    pub fn forward_flops(&self) -> u64 {
        self.forward_flops
    }

    /// The real memory and cost of the unchecked model.
    pub fn unchecked(&self) -> Evaluation {
        self.unchecked
    }

    /// Real memory and cost of checkpointing `segments`, each a list of layer indices of
    /// `spec.layers` forming one segment (other layers are not checkpointed).
    pub fn evaluate_layers(&self, segments: &[Vec<usize>]) -> Evaluation {
        let mut g = self.graph.borrow_mut();
        for l in g.layers.iter_mut() {
            l.checkpoint = None;
        }
        for (k, seg) in segments.iter().enumerate() {
            for &l in seg {
                g.layers[l].checkpoint = Some(k as u32 + 1);
            }
        }
        let s = Schedule::build(&g, &self.step);
        drop(g);
        self.evaluate_schedule(&s)
    }

    /// Real memory and cost of checkpointing `segments` of units (each `(start, end)`,
    /// 1-based, inclusive).
    pub fn evaluate_units(&self, segments: &[(usize, usize)]) -> Evaluation {
        let blocks: Vec<Block> = segments
            .iter()
            .map(|&(start, end)| Block {
                start,
                end,
                ckpt: true,
            })
            .collect();
        self.evaluate_blocks(&blocks)
    }

    fn evaluate_blocks(&self, blocks: &[Block]) -> Evaluation {
        let mut g = self.graph.borrow_mut();
        self.mark(&mut g, blocks);
        let s = Schedule::build(&g, &self.step);
        drop(g);
        self.evaluate_schedule(&s)
    }

    fn evaluate_schedule(&self, s: &Schedule) -> Evaluation {
        let life = Lifetimes::compute(s, ALIGNMENT);
        let reqs: Vec<BufferRequest> = life
            .buffers
            .iter()
            .map(|&(bytes, first, last)| BufferRequest {
                bytes,
                first: first as usize,
                last: last as usize,
            })
            .collect();
        Evaluation {
            total: self.persistent + lower_bound(&reqs),
            recompute_flops: recompute_flops(s),
        }
    }

    /// Sets the graph's checkpoint ids: one id per checkpointed block.
    fn mark(&self, g: &mut Graph, blocks: &[Block]) {
        for l in g.layers.iter_mut() {
            l.checkpoint = None;
        }
        for (k, b) in blocks.iter().enumerate().filter(|(_, b)| b.ckpt) {
            for u in b.start..=b.end {
                for &l in &self.units[u] {
                    g.layers[l].checkpoint = Some(k as u32 + 1);
                }
            }
        }
    }

    /// Model memory of a segmentation given as blocks covering units `1..=m`: what the
    /// dynamic program believes. Equal to [`Solver::evaluate_units`]'s total on chains.
    pub fn model_total(&self, segments: &[(usize, usize)]) -> Option<u64> {
        self.model(segments).map(|(total, _)| total)
    }

    /// The program's total and recompute FLOPs of a segmentation.
    fn model(&self, segments: &[(usize, usize)]) -> Option<(u64, u64)> {
        let blocks = self.cover(segments);
        let (mut k, mut peak) = (self.terms.unit0.keep, self.terms.unit0.peak);
        let (mut tau, mut cost) = (0usize, 0u64);
        for b in &blocks {
            let t = self.term(b, tau)?;
            peak = peak.max(k + t.peak);
            k += t.keep + t.bkeep;
            cost += t.cost;
            tau = b.ckpt as usize;
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
                blocks.push(Block {
                    start: u,
                    end: u,
                    ckpt: false,
                });
                u += 1;
            }
            blocks.push(Block {
                start: s,
                end: e,
                ckpt: true,
            });
            u = e + 1;
        }
        while u <= self.unit_count() {
            blocks.push(Block {
                start: u,
                end: u,
                ckpt: false,
            });
            u += 1;
        }
        blocks
    }

    fn term(&self, b: &Block, tau: usize) -> Option<Term> {
        if b.ckpt {
            self.terms.ckpt.get(&(b.start, b.end)).and_then(|t| t[tau])
        } else {
            self.terms.stored.get(b.start).and_then(|t| t[tau])
        }
    }
}

/// Forward FLOPs of a schedule's recompute steps.
fn recompute_flops(s: &Schedule) -> u64 {
    s.steps
        .iter()
        .filter(|st| st.phase == Phase::Recompute)
        .map(|st| st.op.forward_flops())
        .sum()
}

// ---- Probes: reading each block's terms off real schedules ----

impl Solver {
    /// Builds probes (segmentations) until every block has been seen in every context, and
    /// records the terms each probe shows.
    fn probe_all(&mut self) {
        let m = self.unit_count();
        let mut terms = Terms {
            stored: vec![[None, None]; m + 1],
            ..Terms::default()
        };
        // What is still to be seen: (start, end, ckpt, tau).
        let allowed = |i: usize, tau: usize| i > 1 || tau == 0;
        let mut todo_ckpt: Vec<Vec<[bool; 2]>> = vec![Vec::new(); m + 2];
        for (i, row) in todo_ckpt.iter_mut().enumerate().take(m + 1).skip(1) {
            *row = (i..=m).map(|_| [allowed(i, 0), allowed(i, 1)]).collect();
        }
        let mut todo_stored: Vec<[bool; 2]> = (0..=m)
            .map(|i| [i >= 1 && allowed(i, 0), i >= 1 && allowed(i, 1)])
            .collect();
        let open_at = |todo_ckpt: &Vec<Vec<[bool; 2]>>,
                       todo_stored: &Vec<[bool; 2]>,
                       i: usize,
                       tau: usize| {
            if i > m {
                return 0;
            }
            todo_ckpt[i].iter().filter(|x| x[tau]).count() + todo_stored[i][tau] as usize
        };
        loop {
            let remaining: usize = (1..=m)
                .map(|i| {
                    open_at(&todo_ckpt, &todo_stored, i, 0)
                        + open_at(&todo_ckpt, &todo_stored, i, 1)
                })
                .sum();
            if remaining == 0 {
                break;
            }
            // One probe, left to right: at each unit take the longest block not yet seen in
            // the current context; when there is none, a filler whose context suits the
            // next unit best.
            let mut blocks = Vec::new();
            let (mut p, mut tau) = (1usize, 0usize);
            while p <= m {
                let pick = todo_ckpt[p]
                    .iter()
                    .rposition(|x| x[tau])
                    .map(|k| (p + k, true))
                    .or_else(|| todo_stored[p][tau].then_some((p, false)));
                let (end, ckpt) = pick.unwrap_or_else(|| {
                    let ck = open_at(&todo_ckpt, &todo_stored, p + 1, 1)
                        > open_at(&todo_ckpt, &todo_stored, p + 1, 0);
                    (p, ck)
                });
                if ckpt {
                    todo_ckpt[p][end - p][tau] = false;
                } else {
                    todo_stored[p][tau] = false;
                }
                blocks.push(Block {
                    start: p,
                    end,
                    ckpt,
                });
                tau = ckpt as usize;
                p = end + 1;
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
        let mut g = self.graph.borrow_mut();
        self.mark(&mut g, blocks);
        let s = Schedule::build(&g, &self.step);
        drop(g);
        let life = Lifetimes::compute(&s, ALIGNMENT);
        let measured = self.measure(blocks, &s, &life);
        terms.probes += 1;
        terms.unit0 = measured[0];
        for (k, b) in blocks.iter().enumerate() {
            let tau = if k == 0 {
                0
            } else {
                blocks[k - 1].ckpt as usize
            };
            let t = measured[k + 1];
            let slot = if b.ckpt {
                &mut terms.ckpt.entry((b.start, b.end)).or_insert([None, None])[tau]
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
            if s.steps[i].phase == Phase::Recompute {
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
enum Objective {
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
    fn program(&self, arena_budget: u64, objective: Objective) -> Option<(Vec<Block>, u64, u64)> {
        let m = self.unit_count();
        let t0 = self.terms.unit0;
        if t0.peak > arena_budget {
            return None;
        }
        let mut nodes: Vec<(u32, Block)> = Vec::new();
        let mut states: Vec<[Vec<Entry>; 2]> =
            (0..=m + 1).map(|_| [Vec::new(), Vec::new()]).collect();
        states[1][0].push(Entry {
            k: t0.keep,
            cost: 0,
            peak: t0.peak,
            node: u32::MAX,
        });
        for i in 1..=m {
            for tau in 0..2 {
                let front = prune(std::mem::take(&mut states[i][tau]), objective);
                for e in front {
                    let mut push = |b: Block, t: Term, states: &mut Vec<[Vec<Entry>; 2]>| {
                        let at = e.k + t.peak;
                        if at > arena_budget {
                            return;
                        }
                        nodes.push((e.node, b));
                        states[b.end + 1][b.ckpt as usize].push(Entry {
                            k: e.k + t.keep + t.bkeep,
                            cost: e.cost + t.cost,
                            peak: e.peak.max(at),
                            node: (nodes.len() - 1) as u32,
                        });
                    };
                    let stored = Block {
                        start: i,
                        end: i,
                        ckpt: false,
                    };
                    if let Some(t) = self.term(&stored, tau) {
                        push(stored, t, &mut states);
                    }
                    for j in i..=m {
                        let b = Block {
                            start: i,
                            end: j,
                            ckpt: true,
                        };
                        if let Some(t) = self.term(&b, tau) {
                            push(b, t, &mut states);
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

// ---- Answers ----

/// A segmentation over units: `labels[u - 1]` is 0 (not checkpointed) or a segment label;
/// maximal runs of one nonzero label are segments.
type Labels = Vec<u32>;

fn blocks_to_segments(blocks: &[Block]) -> Vec<(usize, usize)> {
    blocks
        .iter()
        .filter(|b| b.ckpt)
        .map(|b| (b.start, b.end))
        .collect()
}

fn labels_to_segments(labels: &[u32]) -> Vec<(usize, usize)> {
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

/// `n` units split into `k` runs as evenly as possible (`checkpoint_sequential`'s split).
pub fn even_runs(n: usize, k: usize) -> Vec<(usize, usize)> {
    let k = k.clamp(1, n.max(1));
    (0..k)
        .map(|r| (r * n / k + 1, (r + 1) * n / k))
        .filter(|&(s, e)| s <= e)
        .collect()
}

impl Solver {
    /// The baseline segmentations over units: PyTorch's `checkpoint_sequential` with
    /// `round(√n)` even segments (Chen et al. 2016; the last segment runs unchecked, as
    /// there), and every unit its own segment.
    pub fn baselines(&self) -> [(&'static str, Vec<(usize, usize)>); 2] {
        let n = self.unit_count();
        let k = ((n as f64).sqrt().round() as usize).max(1);
        let mut sqrt = even_runs(n, k);
        if sqrt.len() > 1 {
            sqrt.pop();
        }
        let every = (1..=n).map(|u| (u, u)).collect();
        [("sqrt_n", sqrt), ("every_unit", every)]
    }

    /// Layer names of each segment of units.
    pub fn segment_names(&self, segments: &[(usize, usize)]) -> Vec<Vec<String>> {
        segments
            .iter()
            .map(|&(s, e)| (s..=e).flat_map(|u| self.unit_layers(u)).collect())
            .collect()
    }

    fn choice(
        &self,
        segments: &[(usize, usize)],
        budget: u64,
        method: Method,
    ) -> Result<CheckpointChoice, PlanError> {
        let names = self.segment_names(segments);
        let mut choice = CheckpointChoice {
            segments: names,
            total: 0,
            budget,
            unchecked_total: 0,
            recompute_flops: 0,
            forward_flops: self.forward_flops,
            method,
        };
        let plan = crate::plan(&choice.apply(&self.spec))?;
        choice.total = plan.memory.total;
        choice.recompute_flops = plan.phase_flops(Phase::Recompute);
        choice.forward_flops = plan.phase_flops(Phase::Forward);
        choice.unchecked_total = crate::plan(&self.spec)?.memory.total;
        Ok(choice)
    }

    /// The segmentation with the smallest total found, and that total (persistent bytes
    /// plus the arena's lower bound). Exact for chains; for general graphs the least the
    /// search reached.
    pub fn smallest_total(&self) -> (u64, Vec<(usize, usize)>) {
        let mut best = (self.unchecked.total, Vec::new());
        if let Some((blocks, _, _)) = self.program(u64::MAX, Objective::Peak) {
            let segs = blocks_to_segments(&blocks);
            let e = self.evaluate_units(&segs);
            if e.total < best.0 {
                best = (e.total, segs);
            }
        }
        if !self.chain {
            let (labels, e) = self.search(Goal::Smallest, &self.seeds(None));
            if e.total < best.0 {
                best = (e.total, labels_to_segments(&labels));
            }
        }
        best
    }

    /// The least-recomputation segmentation (unit runs) whose total — persistent bytes plus
    /// the arena's lower bound — fits `budget`, with its real evaluation; `None` when none
    /// is found. Exact for chains ([`Solver::is_chain`]).
    pub fn optimal(&self, budget: u64) -> Option<(Vec<(usize, usize)>, Evaluation)> {
        if self.chain {
            let (blocks, _, _) =
                self.program(budget.checked_sub(self.persistent)?, Objective::Cost)?;
            let segs = blocks_to_segments(&blocks);
            let e = self.evaluate_units(&segs);
            Some((segs, e))
        } else {
            let (labels, e) = self.search(Goal::Fit(budget), &self.seeds(Some(budget)));
            (e.total <= budget).then(|| (labels_to_segments(&labels), e))
        }
    }

    /// The least-recomputation segmentation whose planned total fits `budget`.
    pub fn solve(&self, budget: u64) -> Result<CheckpointChoice, PlanError> {
        let method = if self.chain {
            Method::ChainOptimal
        } else {
            Method::GraphSearch
        };
        // The objective's memory is the arena's lower bound; the packer nearly always meets
        // it. When it does not, ask again for the difference less.
        let mut target = budget;
        for _ in 0..4 {
            let Some((segs, _)) = self.optimal(target) else {
                break;
            };
            let c = self.choice(&segs, budget, method)?;
            if c.total <= budget {
                return Ok(c);
            }
            target = target.saturating_sub(c.total - budget);
        }
        let (smallest, segs) = self.smallest_total();
        if smallest <= budget {
            let c = self.choice(&segs, budget, method)?;
            if c.total <= budget {
                return Ok(c);
            }
        }
        let unchecked = crate::plan(&self.spec)?.memory.total;
        Err(PlanError::model(format!(
            "no checkpointing fits the budget of {}: the smallest total any checkpointing reaches is {} ({} without checkpointing; {} of it persistent: parameters, gradients, optimizer state)",
            format_bytes(budget),
            format_bytes(smallest),
            format_bytes(unchecked),
            format_bytes(self.persistent),
        )))
    }
}

/// What the general search aims for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Goal {
    /// The least recomputation within the budget (and, failing that, the smallest total).
    Fit(u64),
    /// The smallest total.
    Smallest,
}

// ---- The general-graph search ----

impl Solver {
    /// Starting points of the search: the program's choices at a ladder of arena budgets
    /// (its memory terms are exact only on chains), the least-peak choice, and the baselines.
    fn seeds(&self, budget: Option<u64>) -> Vec<Labels> {
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
    fn search(&self, goal: Goal, seeds: &[Labels]) -> (Labels, Evaluation) {
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
                for n in new_segments(&cur) {
                    let Some(r) = rank(&n, evals) else {
                        break 'outer;
                    };
                    if r.key < cur_r.key {
                        cur = n;
                        cur_r = r;
                        continue 'outer;
                    }
                }
                for a in &ones {
                    for n in neighbours(a) {
                        let Some(r) = rank(&n, evals) else {
                            break 'outer;
                        };
                        if r.key < cur_r.key {
                            cur = n;
                            cur_r = r;
                            continue 'outer;
                        }
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
        let mut rng = crate::generate::SplitMix64::new(0x6d65_6d77_6973_6521);
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
        let blocks: Vec<Block> = segments
            .iter()
            .map(|&(start, end)| Block {
                start,
                end,
                ckpt: true,
            })
            .collect();
        let mut g = self.graph.borrow_mut();
        self.mark(&mut g, &blocks);
        let s = Schedule::build(&g, &self.step);
        drop(g);
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
