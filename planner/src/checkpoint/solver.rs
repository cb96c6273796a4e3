//! The [`Solver`]: a model's units and cut points, the real evaluation of a segmentation
//! (persistent bytes plus the arena's lower bound of its schedule), and the answers —
//! the least-recomputation segmentation that fits, the smallest total — which the chain
//! program ([`super::chain`]) or the general search ([`super::search`]) find.

use std::cell::{Cell, OnceCell, RefCell};

use super::chain::{blocks_to_selection, Block, Objective, Terms};
use super::search::{labels_to_segments, Goal};
use super::{arena_lower_bound, persistent_bytes, CheckpointChoice, Evaluation, Method};
use crate::advice::format_bytes;
use crate::autodiff::StepGraph;
use crate::error::PlanError;
use crate::graph::{Graph, TensorId};
use crate::liveness::Lifetimes;
use crate::plan::Phase;
use crate::schedule::Schedule;
use crate::spec::{LayerKind, ModelSpec};
use crate::ALIGNMENT;

/// What the solver chooses: checkpoint segments of units, and the units whose norms recompute
/// their outputs instead of keeping them (`LayerSpec::recompute_output`: selective
/// recomputation, per op, weighed next to whole segments).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// `(start, end)`, 1-based, inclusive.
    pub segments: Vec<(usize, usize)>,
    /// Units, each stored (not in a segment).
    pub outputs: Vec<usize>,
}

impl Selection {
    /// Only checkpoint segments.
    pub fn segments(segments: Vec<(usize, usize)>) -> Selection {
        Selection {
            segments,
            outputs: Vec::new(),
        }
    }
}

/// Solves one model for any number of budgets: the graph, its units and the probe terms
/// are computed once.
pub struct Solver {
    pub(super) spec: ModelSpec,
    pub(super) graph: RefCell<Graph>,
    pub(super) step: StepGraph,
    /// `units[0]`: the input layers; `units[u]` for `u >= 1`: layer indices in order.
    pub(super) units: Vec<Vec<usize>>,
    pub(super) unit_of_layer: Vec<usize>,
    /// Tensors crossing into unit `u` (born in units before it, read by it or later).
    pub(super) cross: Vec<Vec<TensorId>>,
    pub(super) chain: bool,
    /// Per unit: recomputing its norms' outputs changes the plan (a norm whose output a later
    /// backward keeps). Only on chains: the general search weighs segments alone.
    pub(super) selectable: Vec<bool>,
    /// The spec's `recompute_output` marks are kept as given (the general-graph solver over
    /// "every norm that can recompute its output does"), not chosen.
    fixed_outputs: bool,
    /// For a general graph with such norms: that solver, built on first use.
    everywhere: OnceCell<Option<Box<Solver>>>,
    pub(super) persistent: u64,
    pub(super) forward_flops: u64,
    pub(super) unchecked: Evaluation,
    pub(super) terms: Terms,
    /// Distinct segmentations the general search has evaluated, over all its runs.
    pub(super) searched: Cell<usize>,
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

/// Per unit: it holds a norm whose output another op's backward keeps — what marking the
/// layer `recompute_output` would remake instead.
fn selectable_units(
    spec: &ModelSpec,
    graph: &Graph,
    step: &StepGraph,
    units: &[Vec<usize>],
    unit_of_layer: &[usize],
) -> Vec<bool> {
    let mut kept_by = vec![Vec::new(); graph.tensors.len()];
    for (o, r) in step.backward.iter().enumerate() {
        for &t in r.iter().flat_map(|r| &r.saved) {
            kept_by[t].push(o);
        }
    }
    let mut out = vec![false; units.len()];
    for (o, op) in graph.ops.iter().enumerate() {
        let kept_elsewhere = |y: &TensorId| kept_by[*y].iter().any(|&j| j != o);
        if op.op.recomputes_output_by_choice()
            && spec.layers[op.layer].can_recompute_output()
            && step.backward[o].is_some()
            && op.outputs.first().is_some_and(kept_elsewhere)
        {
            out[unit_of_layer[op.layer]] = true;
        }
    }
    out[0] = false;
    out
}

impl Solver {
    /// Lowers `spec` (with its checkpoint ids and output recomputation cleared), finds its
    /// units and probes them.
    pub fn new(spec: &ModelSpec) -> Result<Solver, PlanError> {
        Solver::build(spec, false)
    }

    fn build(spec: &ModelSpec, fixed_outputs: bool) -> Result<Solver, PlanError> {
        let mut spec = spec.clone();
        for l in spec.layers.iter_mut() {
            l.checkpoint = None;
            l.recompute_output &= fixed_outputs;
        }
        let mut graph = Graph::build(&spec)?;
        let step = StepGraph::build(&mut graph, &spec)?;
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
        let selectable = if chain && !fixed_outputs {
            selectable_units(&spec, &graph, &step, &units, &unit_of_layer)
        } else {
            vec![false; units.len()]
        };
        let mut solver = Solver {
            spec,
            graph: RefCell::new(graph),
            step,
            units,
            unit_of_layer,
            cross,
            chain,
            selectable,
            fixed_outputs,
            everywhere: OnceCell::new(),
            persistent: 0,
            forward_flops: 0,
            unchecked: Evaluation {
                total: 0,
                recompute_flops: 0,
            },
            terms: Terms::default(),
            searched: Cell::new(0),
        };
        {
            let g = solver.graph.borrow();
            let s = Schedule::build(&g, &solver.step);
            solver.persistent = persistent_bytes(&solver.spec, &g, &s);
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

    /// Units whose norms can recompute their outputs, which the solver weighs next to
    /// segments (only on chains).
    pub fn output_units(&self) -> Vec<usize> {
        (1..self.units.len())
            .filter(|&u| self.selectable[u])
            .collect()
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
        self.evaluate_blocks(&Block::segments(segments))
    }

    /// Real memory and cost of a [`Selection`].
    pub fn evaluate(&self, selection: &Selection) -> Evaluation {
        self.evaluate_blocks(&selection_blocks(selection))
    }

    pub(super) fn evaluate_blocks(&self, blocks: &[Block]) -> Evaluation {
        self.evaluate_schedule(&self.schedule(blocks))
    }

    fn evaluate_schedule(&self, s: &Schedule) -> Evaluation {
        let life = Lifetimes::compute(s, ALIGNMENT);
        Evaluation {
            total: self.persistent + arena_lower_bound(&life),
            recompute_flops: recompute_flops(s),
        }
    }

    /// The real schedule with `blocks` checkpointed (and their outputs recomputed where
    /// marked: that changes what the norms keep, so the step graph is derived again).
    pub(super) fn schedule(&self, blocks: &[Block]) -> Schedule {
        let mut g = self.graph.borrow_mut();
        self.mark(&mut g, blocks);
        if !blocks.iter().any(|b| b.out) {
            return Schedule::build(&g, &self.step);
        }
        let mut marked = g.clone();
        drop(g);
        for b in blocks.iter().filter(|b| b.out) {
            for &l in &self.units[b.start] {
                marked.layers[l].recompute_output = self.spec.layers[l].can_recompute_output();
            }
        }
        let step = StepGraph::build(&mut marked, &self.spec)
            .expect("the model's step graph was built once already");
        Schedule::build(&marked, &step)
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
}

/// The blocks of a selection: its segments, checkpointed, and its output units.
fn selection_blocks(selection: &Selection) -> Vec<Block> {
    let mut blocks = Block::segments(&selection.segments);
    blocks.extend(selection.outputs.iter().map(|&u| Block::outputs(u)));
    blocks.sort_by_key(|b| b.start);
    blocks
}

/// Forward FLOPs of a schedule's chosen recompute steps ([`Schedule::chosen_recompute`]).
pub(super) fn recompute_flops(s: &Schedule) -> u64 {
    (0..s.steps.len())
        .filter(|&i| s.chosen_recompute(i))
        .map(|i| s.steps[i].op.forward_flops())
        .sum()
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

    /// Names of the layers whose outputs `units` recompute.
    pub fn output_names(&self, units: &[usize]) -> Vec<String> {
        units
            .iter()
            .flat_map(|&u| &self.units[u])
            .filter(|&&l| self.spec.layers[l].can_recompute_output())
            .map(|&l| self.spec.layers[l].name.clone())
            .collect()
    }

    fn choice(
        &self,
        selection: &Selection,
        budget: u64,
        method: Method,
    ) -> Result<CheckpointChoice, PlanError> {
        let segments = self.segment_names(&selection.segments);
        let mut outputs = self.output_names(&selection.outputs);
        // The fixed marks of layers outside the segments.
        outputs.extend(
            (self.spec.layers.iter())
                .filter(|l| l.recompute_output && !segments.iter().flatten().any(|n| *n == l.name))
                .map(|l| l.name.clone()),
        );
        let mut choice = CheckpointChoice {
            segments,
            recompute_outputs: outputs,
            total: 0,
            budget,
            unchecked_total: 0,
            recompute_flops: 0,
            forward_flops: self.forward_flops,
            method,
        };
        let plan = crate::plan(&choice.apply(&self.spec))?;
        choice.total = plan.memory.total;
        choice.recompute_flops = plan.checkpoint_recompute_flops();
        choice.forward_flops = plan.phase_flops(Phase::Forward);
        choice.unchecked_total = crate::plan(&self.unmarked_spec())?.memory.total;
        Ok(choice)
    }

    /// The spec without the fixed `recompute_output` marks: the model as declared.
    fn unmarked_spec(&self) -> ModelSpec {
        let mut spec = self.spec.clone();
        for l in spec.layers.iter_mut() {
            l.recompute_output = false;
        }
        spec
    }

    /// For a general graph whose norms can recompute outputs a later backward keeps: the
    /// solver over the model with all of them doing so. The general search ranges over
    /// segments; this second run is how it weighs the norms' outputs (all or none).
    fn everywhere(&self) -> Option<&Solver> {
        self.everywhere
            .get_or_init(|| {
                if self.chain || self.fixed_outputs {
                    return None;
                }
                let g = self.graph.borrow();
                let layer_units: Vec<Vec<usize>> =
                    (0..self.spec.layers.len()).map(|l| vec![l]).collect();
                let own: Vec<usize> = (0..self.spec.layers.len()).collect();
                let marks = selectable_units(&self.spec, &g, &self.step, &layer_units, &own);
                drop(g);
                if !marks.iter().any(|&m| m) {
                    return None;
                }
                let mut spec = self.spec.clone();
                for (l, &m) in spec.layers.iter_mut().zip(&marks) {
                    l.recompute_output = m;
                }
                Solver::build(&spec, true).ok().map(Box::new)
            })
            .as_deref()
    }

    /// The selection with the smallest total found, and that total (persistent bytes plus
    /// the arena's lower bound). Exact for chains; for general graphs the least the search
    /// reached.
    pub fn smallest_total(&self) -> (u64, Selection) {
        let own = self.smallest_total_alone();
        let Some(other) = self.everywhere() else {
            return own;
        };
        let (total, mut selection) = other.smallest_total_alone();
        if total >= own.0 {
            return own;
        }
        // A general graph's units are its layers in both solvers: the marked norms outside
        // the segments are the units whose outputs are recomputed.
        let in_segment = |u: usize| selection.segments.iter().any(|&(a, b)| a <= u && u <= b);
        selection.outputs = (1..other.units.len())
            .filter(|&u| !in_segment(u))
            .filter(|&u| {
                other.units[u]
                    .iter()
                    .any(|&l| other.spec.layers[l].recompute_output)
            })
            .collect();
        (total, selection)
    }

    fn smallest_total_alone(&self) -> (u64, Selection) {
        let mut best = (self.unchecked.total, Selection::default());
        if let Some((blocks, _, _)) = self.program(u64::MAX, Objective::Peak) {
            let selection = blocks_to_selection(&blocks);
            let e = self.evaluate(&selection);
            if e.total < best.0 {
                best = (e.total, selection);
            }
        }
        if !self.chain {
            let (labels, e) = self.search(Goal::Smallest, &self.seeds(None));
            if e.total < best.0 {
                best = (e.total, Selection::segments(labels_to_segments(&labels)));
            }
        }
        best
    }

    /// The least-recomputation segmentation (unit runs) whose total — persistent bytes plus
    /// the arena's lower bound — fits `budget`, with its real evaluation; `None` when none
    /// is found. Exact for chains ([`Solver::is_chain`]).
    pub fn optimal(&self, budget: u64) -> Option<(Selection, Evaluation)> {
        if self.chain {
            let (blocks, _, _) =
                self.program(budget.checked_sub(self.persistent)?, Objective::Cost)?;
            let selection = blocks_to_selection(&blocks);
            let e = self.evaluate(&selection);
            Some((selection, e))
        } else {
            let (labels, e) = self.search(Goal::Fit(budget), &self.seeds(Some(budget)));
            (e.total <= budget).then(|| (Selection::segments(labels_to_segments(&labels)), e))
        }
    }

    /// The least-recomputation segmentation (and norm outputs recomputed) whose planned
    /// total fits `budget`; on a general graph, the cheaper of the search without and with
    /// every norm's output recomputed.
    pub fn solve(&self, budget: u64) -> Result<CheckpointChoice, PlanError> {
        let own = self.solve_alone(budget);
        let Some(other) = self.everywhere() else {
            return own;
        };
        match (own, other.solve_alone(budget)) {
            (Ok(a), Ok(b)) if (b.recompute_flops, b.total) < (a.recompute_flops, a.total) => Ok(b),
            (Ok(a), _) => Ok(a),
            (Err(_), Ok(b)) => Ok(b),
            (Err(_), Err(_)) => Err(self.no_fit(budget)),
        }
    }

    fn solve_alone(&self, budget: u64) -> Result<CheckpointChoice, PlanError> {
        let method = if self.chain {
            Method::ChainOptimal
        } else {
            Method::GraphSearch
        };
        // The objective's memory is the arena's lower bound; the packer nearly always meets
        // it. When it does not, ask again for the difference less.
        let mut target = budget;
        for _ in 0..4 {
            let Some((selection, _)) = self.optimal(target) else {
                break;
            };
            let c = self.choice(&selection, budget, method)?;
            if c.total <= budget {
                return Ok(c);
            }
            target = target.saturating_sub(c.total - budget);
        }
        let (smallest, selection) = self.smallest_total_alone();
        if smallest <= budget {
            let c = self.choice(&selection, budget, method)?;
            if c.total <= budget {
                return Ok(c);
            }
        }
        Err(self.no_fit(budget))
    }

    /// The error when nothing fits `budget`: the smallest total any choice reaches.
    fn no_fit(&self, budget: u64) -> PlanError {
        let smallest = self.smallest_total().0;
        let unchecked = match crate::plan(&self.unmarked_spec()) {
            Ok(p) => p.memory.total,
            Err(e) => return e,
        };
        PlanError::model(format!(
            "no checkpointing fits the budget of {}: the smallest total any checkpointing reaches is {} ({} without checkpointing; {} of it persistent: parameters, gradients, optimizer state)",
            format_bytes(budget),
            format_bytes(smallest),
            format_bytes(unchecked),
            format_bytes(self.persistent),
        ))
    }
}
