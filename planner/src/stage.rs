//! One plan per pipeline stage (model parallel, issue 16): the model's one-micro-batch
//! schedule cut where the stages meet, the cut tensors sent and received as plan steps, and
//! each stage's forwards and backwards unrolled over the micro-batches in its schedule's
//! order ([`crate::pipeline::stage_work`]), so that liveness packs exactly the micro-batches
//! the schedule keeps in flight and each stage's memory report is exact.
//!
//! Pure, like the rest of the planner: what runs where, and in which order, is decided here;
//! the runtime walks each stage's plan on its own rank.
//!
//! The cut is made on the [`Schedule`] of one micro-batch, not on the model: every step
//! belongs to the stage of its layer (a loss term to the latest stage among the tensors it
//! reads), so a tensor one stage writes and another reads, activation or gradient, is a
//! transfer, and nothing about a layer has to know that the model is split. Messages between
//! two stages go one way per kind: activations from an earlier stage to a later one during
//! the forwards, gradients from a later one to an earlier one during the backwards; both ends
//! order each unit's messages alike, so a channel that keeps its messages in order (as every
//! [`Collective`](../../memwise_runtime/collective/trait.Collective.html) engine does) needs
//! no tags.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::autodiff::StepGraph;
use crate::error::PlanError;
use crate::graph::Graph;
use crate::op::Op;
use crate::pipeline::{replay, stage_work, PipelineSchedule, Work};
use crate::plan::{Phase, StaticPlan, NONE};
use crate::schedule::{gradient_sums, SStep, STensor, Schedule};
use crate::spec::ModelSpec;

/// How a model is split over devices: where each stage begins, how many micro-batches a
/// batch is cut into, and the order the stages run them in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// The first layer of every stage after the first, in layer order (empty: one stage,
    /// which with several micro-batches is gradient accumulation).
    pub boundaries: Vec<String>,
    pub micro_batches: usize,
    pub schedule: PipelineSchedule,
}

impl Pipeline {
    pub fn new(schedule: PipelineSchedule, micro_batches: usize, boundaries: &[&str]) -> Self {
        Pipeline {
            boundaries: boundaries.iter().map(|b| b.to_string()).collect(),
            micro_batches,
            schedule,
        }
    }

    pub fn stages(&self) -> usize {
        self.boundaries.len() + 1
    }

    /// Each layer's stage, checking that the boundaries name layers in order.
    pub fn stage_of_layers(&self, spec: &ModelSpec) -> Result<Vec<usize>, PlanError> {
        let mut starts = Vec::with_capacity(self.boundaries.len());
        for b in &self.boundaries {
            let at = spec
                .layers
                .iter()
                .position(|l| &l.name == b)
                .ok_or_else(|| {
                    PlanError::model(format!(
                        "the pipeline's stage boundary `{b}` names no layer"
                    ))
                })?;
            if at == 0 || starts.last().is_some_and(|&prev| at <= prev) {
                return Err(PlanError::at(
                    b,
                    "stage boundaries must follow the layers' order, each after the one before \
                     and after the first layer: every stage needs at least one layer",
                ));
            }
            starts.push(at);
        }
        Ok((0..spec.layers.len())
            .map(|i| starts.iter().filter(|&&s| s <= i).count())
            .collect())
    }

    /// The spec one micro-batch runs: the replica's share of the batch
    /// ([`ModelSpec::per_replica`]: a replica is a whole pipeline) cut `micro_batches` ways,
    /// each loss term weighted by its share, so that the gradients the micro-batches
    /// accumulate, summed over the replicas, are the whole batch's. `replicas` is kept: the
    /// stage plans sum their gradients over the replicas of their stage.
    pub fn micro_spec(&self, spec: &ModelSpec) -> Result<ModelSpec, PlanError> {
        let m = self.micro_batches;
        if m == 0 {
            return Err(PlanError::model("`micro_batches` must be at least 1"));
        }
        if spec.replicas > 1 && spec.sharding != crate::data_parallel::Sharding::Replicated {
            return Err(PlanError::model(
                "ZeRO sharding within a pipeline's replicas is not planned yet: the stages of \
                 a replicated pipeline keep their whole optimizer state (drop `zero = 1`)",
            ));
        }
        let replica = spec.per_replica()?;
        let r = spec.replicas.max(1);
        if !replica.batch.is_multiple_of(m) {
            let whole = r * m;
            let below = (spec.batch / whole * whole).max(whole);
            let replicas = if r > 1 {
                format!(" and {r} replicas")
            } else {
                String::new()
            };
            return Err(PlanError::model(format!(
                "`batch = {}` does not split into {m} micro-batches{replicas}: the batch must be \
                 a multiple of {whole} (`batch = {below}` or `batch = {}` would be)",
                spec.batch,
                spec.batch / whole * whole + whole
            )));
        }
        let mut micro = replica.with_batch(replica.batch / m);
        for term in &mut micro.loss {
            term.weight /= m as f32;
        }
        Ok(micro)
    }
}

/// Where stage `stage` of pipeline replica `replica` runs in a job of `stages × replicas`
/// ranks: rank `stage · replicas + replica`. A stage's replicas are neighbouring ranks, as
/// Megatron-LM orders them: their gradient sums, each step's heaviest traffic, stay among
/// the ranks of one node where they can, and the lighter activations cross between nodes.
pub fn stage_rank(stage: usize, replica: usize, replicas: usize) -> usize {
    stage * replicas.max(1) + replica
}

/// The `(stage, replica)` that rank `rank` of a job of `replicas` pipeline replicas runs
/// ([`stage_rank`]'s inverse).
pub fn stage_of_rank(rank: usize, replicas: usize) -> (usize, usize) {
    let r = replicas.max(1);
    (rank / r, rank % r)
}

/// The name of micro-batch `k`'s copy of tensor `name` in a stage's plan: `name@k`.
pub fn micro_batch_name(name: &str, k: usize) -> String {
    format!("{name}@{k}")
}

/// The tensor and micro-batch a stage plan's tensor name stands for
/// ([`micro_batch_name`]'s inverse), or `None` for a name of no micro-batch.
pub fn split_micro_batch_name(name: &str) -> Option<(&str, usize)> {
    let (base, k) = name.rsplit_once('@')?;
    Some((base, k.parse().ok()?))
}

/// Every stage's plan, and what follows from them.
#[derive(Clone, Debug)]
pub struct PipelinePlan {
    pub pipeline: Pipeline,
    /// One plan per stage, stage 0 first.
    pub stages: Vec<StaticPlan>,
}

impl PipelinePlan {
    /// The pipeline that `stages` (every stage's plan, stage 0 first, as [`plan_pipeline`]
    /// makes them) are the plans of: each stage begins at its first layer, and the last
    /// stage's order tells the schedule (1F1B runs a backward before its second forward).
    pub fn of_stages(stages: Vec<StaticPlan>) -> PipelinePlan {
        let boundaries: Vec<&str> = (stages.iter().skip(1))
            .filter_map(|s| s.memory.layers.first().map(|l| l.name.as_ref()))
            .collect();
        let m = stages.first().map_or(1, |s| s.micro_batches as usize);
        let last = stages.last().map(|s| &s.steps[..]).unwrap_or(&[]);
        let second_forward = last
            .iter()
            .position(|s| s.micro_batch == 1 && s.phase == Phase::Forward);
        let first_backward = last.iter().position(|s| s.phase == Phase::Backward);
        let schedule = match (first_backward, second_forward) {
            (Some(b), Some(f)) if b < f => PipelineSchedule::OneFOneB,
            _ if m > 1 => PipelineSchedule::GPipe,
            _ => PipelineSchedule::OneFOneB,
        };
        PipelinePlan {
            pipeline: Pipeline::new(schedule, m, &boundaries),
            stages,
        }
    }

    /// The stage with the largest memory total, and that total in bytes.
    pub fn largest_stage(&self) -> (usize, u64) {
        (self.stages.iter().enumerate())
            .map(|(s, p)| (s, p.memory.total))
            .max_by_key(|&(s, total)| (total, std::cmp::Reverse(s)))
            .unwrap_or((0, 0))
    }

    /// The share of the stages' time spent idle: the schedule replayed with a micro-batch's
    /// forward and backward taking, on every stage, as long as on the costliest stage (by
    /// FLOPs), which sets the pipeline's pace.
    pub fn bubble_fraction(&self) -> f64 {
        let m = self.pipeline.micro_batches.max(1) as u64;
        let per_unit = |p: &StaticPlan, backward: bool| -> u64 {
            let flops: u64 = (p.steps.iter())
                .filter(|s| matches!(s.phase, Phase::Recompute | Phase::Backward) == backward)
                .filter(|s| s.phase != Phase::Update)
                .map(|s| p.step_cost(s).flops)
                .sum();
            (flops / m).max(1)
        };
        let forward = self.stages.iter().map(|p| per_unit(p, false)).max();
        let backward = self.stages.iter().map(|p| per_unit(p, true)).max();
        let (p, m) = (self.stages.len(), self.pipeline.micro_batches);
        replay(
            self.pipeline.schedule,
            p,
            m,
            forward.unwrap_or(1),
            backward.unwrap_or(1),
        )
        .map_or(0.0, |t| t.bubble_fraction())
    }
}

/// Plans every stage of `spec` split by `pipeline`.
pub fn plan_pipeline(spec: &ModelSpec, pipeline: &Pipeline) -> Result<PipelinePlan, PlanError> {
    let stages = (0..pipeline.stages())
        .map(|s| plan_stage(spec, pipeline, s))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PipelinePlan {
        pipeline: pipeline.clone(),
        stages,
    })
}

/// Plans stage `stage` of `spec` split by `pipeline`: its layers' steps for every
/// micro-batch in its schedule's order, the transfers, one update, and its memory report
/// (its own parameters, the layers' rows of its own layers). Validated before it is returned.
pub fn plan_stage(
    spec: &ModelSpec,
    pipeline: &Pipeline,
    stage: usize,
) -> Result<StaticPlan, PlanError> {
    let p = check_stage(pipeline, stage)?;
    let micro = pipeline.micro_spec(spec)?;
    let mut graph = Graph::build(&micro)?;
    let mut step = StepGraph::build(&mut graph, &micro)?;
    // The base is one micro-batch of one replica: a stage sums its gradients over its
    // replicas once, after its last micro-batch's backward (`unroll`).
    step.replicas = 1;
    let base = Schedule::build(&graph, &step);
    let work = stage_work(pipeline.schedule, stage, p, pipeline.micro_batches);
    let mut plan = cut_stage(spec, pipeline, stage, (&micro, &graph, &base), &work)?;
    plan.micro_batches = pipeline.micro_batches as u32;
    crate::arena::validate(&plan)
        .map_err(|e| PlanError::internal(format!("stage {stage}'s plan failed validation: {e}")))?;
    Ok(plan)
}

/// Plans stage `stage` of `spec`'s pipeline in inference mode (batch norm from its running
/// statistics, no dropout, no backward), over `batch` samples of one replica run as one
/// micro-batch: its forward steps between its receives and sends, and on the last stage the
/// loss terms and the prediction, kept to the end as one device's inference plan keeps it —
/// what `evaluate` and `predict` of a split model run on every stage's rank. `replicas` is the
/// model's, so that each stage sends within its own replica of the pipeline.
pub fn plan_stage_inference(
    spec: &ModelSpec,
    pipeline: &Pipeline,
    stage: usize,
    batch: usize,
) -> Result<StaticPlan, PlanError> {
    check_stage(pipeline, stage)?;
    let one = spec.one_device().with_batch(batch);
    let graph = Graph::build_inference(&one)?;
    let base = Schedule::build(&graph, &StepGraph::inference(&graph));
    let mut plan = cut_stage(
        spec,
        pipeline,
        stage,
        (&one, &graph, &base),
        &[Work::Forward(0)],
    )?;
    (plan.micro_batches, plan.replicas) = (1, spec.replicas.max(1));
    crate::arena::validate(&plan).map_err(|e| {
        PlanError::internal(format!(
            "stage {stage}'s inference plan failed validation: {e}"
        ))
    })?;
    Ok(plan)
}

/// The pipeline's stage count, once `stage` is known to be one of its stages.
fn check_stage(pipeline: &Pipeline, stage: usize) -> Result<usize, PlanError> {
    let p = pipeline.stages();
    if stage >= p {
        return Err(PlanError::model(format!(
            "stage {stage} of a {p}-stage pipeline"
        )));
    }
    Ok(p)
}

/// Stage `stage`'s plan of `base` (the schedule of one micro-batch of `micro`, over `graph`)
/// unrolled over `work`: its steps, its own parameters, its packed arena and its memory
/// report, which lists its own layers only.
fn cut_stage(
    spec: &ModelSpec,
    pipeline: &Pipeline,
    stage: usize,
    (micro, graph, base): (&ModelSpec, &Graph, &Schedule),
    work: &[Work],
) -> Result<StaticPlan, PlanError> {
    let p = pipeline.stages();
    let stage_of_layer = pipeline.stage_of_layers(spec)?;
    check_segments(micro, &stage_of_layer)?;
    let cut = Cut::new(base, graph, &stage_of_layer, p)?;
    let held: Vec<u32> = (0..graph.params.len() as u32)
        .filter(|&p| stage_of_layer[graph.params[p as usize].layer] == stage)
        .collect();
    let m = (work.iter())
        .filter(|w| matches!(w, Work::Forward(_)))
        .count();
    // Per stage parameter: its elements if its gradients are summed over the replicas.
    let summed: Vec<Option<usize>> = (held.iter())
        .map(|&p| &graph.params[p as usize])
        .map(|q| (micro.replicas > 1 && q.trainable && base.training).then(|| q.elems()))
        .collect();
    let (schedule, micro_batch_of, inputs) =
        unroll(&cut, base, (&held, &summed), stage, work, m, &graph.inputs);
    let mut sub = graph.clone();
    sub.params = (held.iter())
        .map(|&p| graph.params[p as usize].clone())
        .collect();
    sub.inputs = inputs;
    let lifetimes = crate::liveness::Lifetimes::compute(&schedule, crate::ALIGNMENT);
    let arena = crate::arena::ArenaPlan::build(&schedule, &lifetimes, crate::ALIGNMENT);
    let mut plan = crate::estimate::assemble(micro, &sub, &schedule, &lifetimes, &arena);
    let mine: Vec<&str> = (spec.layers.iter().zip(&stage_of_layer))
        .filter(|(_, &s)| s == stage)
        .map(|(l, _)| l.name.as_str())
        .collect();
    let rows = plan
        .memory
        .layers
        .iter()
        .filter(|r| mine.contains(&&*r.name));
    plan.memory.layers = Cow::Owned(rows.cloned().collect());
    for (s, k) in plan.steps.to_mut().iter_mut().zip(micro_batch_of) {
        s.micro_batch = k;
    }
    for (param, &id) in plan.params.to_mut().iter_mut().zip(&held) {
        param.id = id;
    }
    (plan.stage, plan.stages) = (stage as u32, p as u32);
    Ok(plan)
}

/// A checkpoint segment recomputes in its stage's backward what its forward made: it cannot
/// reach across a boundary, since the stage before it has finished that micro-batch's
/// forward long before.
fn check_segments(spec: &ModelSpec, stage_of_layer: &[usize]) -> Result<(), PlanError> {
    let mut seen: HashMap<u32, (usize, &str)> = HashMap::new();
    for (l, &s) in spec.layers.iter().zip(stage_of_layer) {
        let Some(seg) = l.checkpoint else { continue };
        match seen.get(&seg) {
            Some(&(s0, first)) if s0 != s => {
                return Err(PlanError::at(
                    &l.name,
                    format!(
                        "checkpoint segment {seg} begins at `{first}` in stage {s0} and reaches \
                         stage {s}: a segment must lie within one stage (split it at the boundary)"
                    ),
                ))
            }
            Some(_) => {}
            None => {
                seen.insert(seg, (s, &l.name));
            }
        }
    }
    Ok(())
}

/// Which half of a micro-batch's work a step is part of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Half {
    /// Forward and loss steps.
    Forward,
    /// Recompute and backward steps.
    Backward,
}

fn half_of(phase: Phase) -> Option<Half> {
    match phase {
        Phase::Forward | Phase::Loss => Some(Half::Forward),
        Phase::Recompute | Phase::Backward => Some(Half::Backward),
        Phase::Update => None,
    }
}

/// One tensor crossing from stage `from` to stage `to` in every micro-batch's `half`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Message {
    tensor: u32,
    from: usize,
    to: usize,
    half: Half,
    /// The base step that writes it (its send ends the sender's unit, in the writers' order),
    /// or `None`: a gradient a loss wrote in the forward half, sent at the start of the
    /// sender's backward half.
    after: Option<usize>,
}

impl Message {
    /// The order both ends give a unit's messages on one channel.
    fn order(&self) -> (usize, usize, u32) {
        (self.from, self.after.map_or(0, |a| a + 1), self.tensor)
    }
}

/// The one-micro-batch schedule cut into stages.
struct Cut {
    stages: usize,
    /// Per base step: its stage.
    stage_of_step: Vec<usize>,
    messages: Vec<Message>,
}

impl Cut {
    fn new(
        base: &Schedule,
        graph: &Graph,
        stage_of_layer: &[usize],
        stages: usize,
    ) -> Result<Cut, PlanError> {
        let mut writer: Vec<Option<usize>> = vec![None; base.tensors.len()];
        let mut stage_of_step = Vec::with_capacity(base.steps.len());
        for (i, st) in base.steps.iter().enumerate() {
            let stage = match st.layer {
                Some(l) => stage_of_layer[l],
                // Every stage checks its own gradients (`unroll`).
                None if st.op == Op::CheckFinite => stages - 1,
                None if st.phase == Phase::Update => (st.params.first()).map_or(stages - 1, |&p| {
                    stage_of_layer[graph.params[p as usize].layer]
                }),
                // A loss term runs where the latest of its inputs is made.
                None => (st.reads.iter().filter(|&&r| r != NONE))
                    .filter_map(|&r| writer[r as usize].map(|w: usize| stage_of_step[w]))
                    .max()
                    .unwrap_or(stages - 1),
            };
            for &p in st.params.iter().filter(|_| st.op != Op::CheckFinite) {
                let home = stage_of_layer[graph.params[p as usize].layer];
                if home != stage {
                    let name = &graph.params[p as usize].name;
                    return Err(PlanError::model(format!(
                        "parameter `{name}` is stage {home}'s, and a step of stage {stage} uses \
                         it: a parameter shared by two layers must stay within one stage"
                    )));
                }
            }
            stage_of_step.push(stage);
            for &w in st.writes.iter().filter(|&&w| w != NONE) {
                if writer[w as usize].replace(i).is_some() {
                    return Err(PlanError::internal(format!(
                        "tensor `{}` has two writers",
                        base.tensors[w as usize].name
                    )));
                }
            }
        }
        let mut messages: Vec<Message> = Vec::new();
        for (i, st) in base.steps.iter().enumerate() {
            let to = stage_of_step[i];
            for &r in st.reads.iter().filter(|&&r| r != NONE) {
                let Some(w) = writer[r as usize] else {
                    continue;
                };
                let from = stage_of_step[w];
                if from == to || messages.iter().any(|m| m.tensor == r && m.to == to) {
                    continue;
                }
                messages.push(message(base, r, w, from, i, to)?);
            }
        }
        Ok(Cut {
            stages,
            stage_of_step,
            messages,
        })
    }
}

/// The message that brings tensor `t` (written by base step `w` on stage `from`) to base step
/// `reader` on stage `to`, or why the schedule cannot have one.
fn message(
    base: &Schedule,
    t: u32,
    w: usize,
    from: usize,
    reader: usize,
    to: usize,
) -> Result<Message, PlanError> {
    let name = &base.tensors[t as usize].name;
    let written = half_of(base.steps[w].phase);
    let read = half_of(base.steps[reader].phase);
    if from < to && written == Some(Half::Forward) {
        return Ok(Message {
            tensor: t,
            from,
            to,
            half: Half::Forward,
            after: Some(w),
        });
    }
    if from > to && read == Some(Half::Backward) {
        return Ok(Message {
            tensor: t,
            from,
            to,
            half: Half::Backward,
            after: (written == Some(Half::Backward)).then_some(w),
        });
    }
    Err(PlanError::model(format!(
        "stage {to} reads `{name}` in its {}, which stage {from} makes in its {}: a later \
         stage's forward cannot wait for an earlier stage's backward, nor an earlier stage's \
         forward for a later one (move the stage boundary)",
        base.steps[reader].phase.name(),
        base.steps[w].phase.name()
    )))
}

/// Stage `stage`'s schedule: for each unit of `work`, its receives, its steps and its sends
/// for that micro-batch's own tensors; with replicas, the sums of its
/// gradients over them, each after its last micro-batch's step that finishes them; then the
/// updates of its parameters (`held`, the base ids of the stage's parameters, renumbered in
/// order; `summed`, per renumbered parameter, its elements if its gradients are summed).
/// Returns it with each step's micro-batch, and the model inputs the stage reads,
/// micro-batch by micro-batch in `inputs`' order.
fn unroll(
    cut: &Cut,
    base: &Schedule,
    (held, summed): (&[u32], &[Option<usize>]),
    stage: usize,
    work: &[Work],
    micro_batches: usize,
    inputs: &[usize],
) -> (Schedule, Vec<u32>, Vec<usize>) {
    let param_id: HashMap<u32, u32> = (held.iter().enumerate())
        .map(|(i, &p)| (p, i as u32))
        .collect();
    let mut u = Unroller {
        base,
        param_id: &param_id,
        tensors: Vec::new(),
        steps: Vec::new(),
        micro_batch: Vec::new(),
        ids: HashMap::new(),
    };
    for &w in work {
        let (k, half) = match w {
            Work::Forward(k) => (k, Half::Forward),
            Work::Backward(k) => (k, Half::Backward),
        };
        u.unit(cut, stage, k, half);
    }
    // One stage alone settles the replicas' flag with its last sum, as a data-parallel
    // plan does; a pipeline's stages settle it together below.
    let sums = gradient_sums(&u.steps, |p| summed[p as usize], cut.stages == 1);
    for (at, sum) in sums.into_iter().rev() {
        u.micro_batch.insert(at + 1, u.micro_batch[at]);
        u.steps.insert(at + 1, sum);
    }
    // With loss scaling each stage checks its own gradients, then the stages agree.
    for st in base.steps.iter().filter(|st| st.op == Op::CheckFinite) {
        let mine: Vec<u32> = (st.params.iter())
            .filter_map(|p| param_id.get(p).copied())
            .collect();
        if !mine.is_empty() {
            u.micro_batch.push(0);
            u.steps.push(SStep {
                params: mine,
                ..st.clone()
            });
        }
    }
    if cut.stages > 1 && base.training {
        u.settle_flags();
    }
    for (i, st) in base.steps.iter().enumerate() {
        let update = st.phase == Phase::Update && st.op != Op::CheckFinite;
        if update && cut.stage_of_step[i] == stage {
            u.push_step(st, None);
        }
    }
    let each = |of: &[u32]| -> Vec<u32> {
        (0..micro_batches)
            .flat_map(|k| of.iter().map(move |&t| (k, t)))
            .filter_map(|key| u.ids.get(&key).copied())
            .collect()
    };
    let losses = each(&base.losses);
    let base_inputs: Vec<u32> = inputs.iter().map(|&t| t as u32).collect();
    let inputs = each(&base_inputs).into_iter().map(|t| t as usize).collect();
    let updated = held.iter().map(|&p| base.updated[p as usize]).collect();
    // In training no one prediction: a stage's metrics are read from each micro-batch's
    // prediction at its loss step, which keeps it alive that long. An inference stage runs
    // one micro-batch, whose prediction (on the last stage) is kept to the end for `predict`,
    // as a one-device plan keeps its one prediction to the end of its loss phase.
    let prediction = match u.ids.get(&(0, base.prediction)) {
        Some(&t) if !base.training && micro_batches == 1 => t,
        _ => NONE,
    };
    let micro_batch = u.micro_batch;
    let schedule = Schedule {
        tensors: u.tensors,
        steps: u.steps,
        losses,
        prediction,
        loss_scaling: base.loss_scaling,
        training: base.training,
        updated,
        segments: base.segments.clone(),
        recompute_output: base.recompute_output.clone(),
    };
    (schedule, micro_batch, inputs)
}

/// Builds a stage's steps and tensors, a micro-batch's copy of each base tensor made on
/// first use.
struct Unroller<'a> {
    base: &'a Schedule,
    param_id: &'a HashMap<u32, u32>,
    tensors: Vec<STensor>,
    steps: Vec<SStep>,
    /// Per step: its micro-batch.
    micro_batch: Vec<u32>,
    /// (micro-batch, base tensor) → the stage's tensor.
    ids: HashMap<(usize, u32), u32>,
}

impl Unroller<'_> {
    fn tensor(&mut self, k: usize, t: u32) -> u32 {
        if t == NONE {
            return NONE;
        }
        if let Some(&id) = self.ids.get(&(k, t)) {
            return id;
        }
        let mut copy = self.base.tensors[t as usize].clone();
        copy.name = micro_batch_name(&copy.name, k);
        self.tensors.push(copy);
        let id = (self.tensors.len() - 1) as u32;
        self.ids.insert((k, t), id);
        id
    }

    /// Appends base step `st` for micro-batch `k` (`None`: a step of the whole batch, an
    /// update, which has no tensors).
    fn push_step(&mut self, st: &SStep, k: Option<usize>) {
        let mut step = st.clone();
        if let Some(k) = k {
            step.reads = st.reads.iter().map(|&r| self.tensor(k, r)).collect();
            step.writes = st.writes.iter().map(|&w| self.tensor(k, w)).collect();
        }
        self.micro_batch.push(k.unwrap_or(0) as u32);
        step.params = (st.params.iter())
            .map(|p| self.param_id.get(p).copied().unwrap_or(NONE))
            .collect();
        self.steps.push(step);
    }

    fn transfer(&mut self, m: &Message, k: usize, send: bool) {
        let t = self.tensor(k, m.tensor);
        let bytes = self.tensors[t as usize].raw_bytes();
        let phase = match m.half {
            Half::Forward => Phase::Forward,
            Half::Backward => Phase::Backward,
        };
        let (op, reads, writes) = if send {
            let op = Op::SendTensor {
                bytes,
                stage: m.to as u32,
            };
            (op, vec![t], vec![NONE, NONE])
        } else {
            let op = Op::RecvTensor {
                bytes,
                stage: m.from as u32,
            };
            (op, vec![], vec![t, NONE, NONE])
        };
        let layer = self.tensors[t as usize].layer;
        self.micro_batch.push(k as u32);
        self.steps.push(SStep {
            phase,
            layer,
            op,
            reads,
            writes,
            params: vec![],
            in_place: vec![],
        });
    }

    /// Before the updates (after the finite check of the stage's gradients, with loss
    /// scaling): a gradient sum over no gradients, which settles the step's non-finite flag
    /// over every rank of the job, each stage of each replica (as a data-parallel plan's last
    /// sum does over the replicas), so that all stages update, or all keep their weights and
    /// halve their loss scale, alike.
    fn settle_flags(&mut self) {
        self.micro_batch.push(0);
        self.steps.push(SStep {
            phase: Phase::Update,
            layer: None,
            op: Op::AllReduceGradients {
                bytes: 0,
                last: true,
            },
            reads: vec![],
            writes: vec![],
            params: vec![],
            in_place: vec![],
        });
    }

    /// Micro-batch `k`'s `half` on `stage`: every receive first, in the senders' order; then
    /// the steps; then the sends of what they wrote, in the same order.
    fn unit(&mut self, cut: &Cut, stage: usize, k: usize, half: Half) {
        let mut recvs: Vec<&Message> = (cut.messages.iter())
            .filter(|m| m.to == stage && m.half == half)
            .collect();
        recvs.sort_by_key(|m| m.order());
        for m in recvs {
            self.transfer(m, k, false);
        }
        let mut sends: Vec<&Message> = (cut.messages.iter())
            .filter(|m| m.from == stage && m.half == half)
            .collect();
        sends.sort_by_key(|m| (m.order(), m.to));
        for m in sends.iter().filter(|m| m.after.is_none()) {
            self.transfer(m, k, true);
        }
        for (i, st) in self.base.steps.iter().enumerate() {
            if cut.stage_of_step[i] == stage && half_of(st.phase) == Some(half) {
                self.push_step(st, Some(k));
            }
        }
        // The sends end the unit, next to the next unit's receives: a device whose sends wait
        // for their receiver (NCCL) runs such a run of transfers as one group, so that 1F1B's
        // crossing sends (an activation down, a gradient up) cannot wait on each other.
        for m in sends.iter().filter(|m| m.after.is_some()) {
            self.transfer(m, k, true);
        }
    }
}
