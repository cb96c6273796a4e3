//! A pipeline split against a budget: the split that minimises the largest stage's memory
//! (`stages = N`), the fewest stages that fit (`stages = auto`), the largest batch whose
//! every stage fits (`MAX_BATCH`), and what the over-budget error suggests — each decided by
//! planning the stages ([`crate::stage::plan_pipeline`]), never by a formula.

use crate::advice::format_bytes;
use crate::error::PlanError;
use crate::pipeline::PipelineSchedule;
use crate::spec::{LayerKind, ModelSpec};
use crate::stage::{plan_pipeline, Pipeline, PipelinePlan};

/// The most stages `stages = auto` tries.
pub const MAX_AUTO_STAGES: usize = 8;

/// A split's cost: the largest stage's total, then the bubble (in millionths), lower first.
fn cost(pp: &PipelinePlan) -> (u64, u64) {
    (pp.largest_stage().1, (pp.bubble_fraction() * 1e6) as u64)
}

/// `spec` split into `stages` stages of `micro_batches` under `schedule`, the boundaries
/// chosen to minimise the largest stage's memory and then the bubble: a start that gives
/// each stage an equal share of the one-device plan's per-layer memory, then single-layer
/// moves of each boundary while one makes the split cheaper. `Err` when no split plans.
pub fn balance(
    spec: &ModelSpec,
    stages: usize,
    micro_batches: usize,
    schedule: PipelineSchedule,
) -> Result<PipelinePlan, PlanError> {
    let one = crate::plan(&spec.with_batch(spec.batch / micro_batches.max(1)))?;
    let is_input = |i: usize| matches!(spec.layers[i].kind, LayerKind::Input { .. });
    let first = (0..spec.layers.len()).take_while(|&i| is_input(i)).count();
    let layers = spec.layers.len();
    if stages == 0 || layers - first < stages {
        return Err(PlanError::model(format!(
            "{stages} stages for {} layers: every stage needs at least one layer",
            layers - first
        )));
    }
    let weight = |i: usize| {
        let row = one
            .memory
            .layers
            .iter()
            .find(|r| r.name == spec.layers[i].name);
        row.map_or(0, |r| r.persistent_bytes + r.saved_bytes).max(1)
    };
    // Stage k begins at the first layer where the memory before it reaches k shares, one
    // layer at least after the last boundary and early enough to leave each later stage one.
    let total: u64 = (first..layers).map(weight).sum();
    let mut before = vec![0u64; layers + 1];
    for i in first..layers {
        before[i + 1] = before[i] + weight(i);
    }
    let mut starts: Vec<usize> = Vec::with_capacity(stages - 1);
    for k in 1..stages {
        let lo = starts.last().map_or(first + 1, |&s| s + 1);
        let hi = layers - (stages - k);
        let share = total * k as u64 / stages as u64;
        let at = (lo..=hi).find(|&i| before[i] >= share).unwrap_or(hi);
        starts.push(at);
    }
    let plan_at = |starts: &[usize]| {
        let names: Vec<&str> = starts
            .iter()
            .map(|&i| spec.layers[i].name.as_str())
            .collect();
        plan_pipeline(spec, &Pipeline::new(schedule, micro_batches, &names)).ok()
    };
    let mut best = plan_at(&starts);
    let mut improved = true;
    while improved {
        improved = false;
        for b in 0..starts.len() {
            for step in [-1isize, 1] {
                let mut moved = starts.clone();
                let at = moved[b] as isize + step;
                let lo = if b == 0 { first + 1 } else { moved[b - 1] + 1 };
                let hi = moved.get(b + 1).copied().unwrap_or(layers);
                if at < lo as isize || at >= hi as isize {
                    continue;
                }
                moved[b] = at as usize;
                let Some(candidate) = plan_at(&moved) else {
                    continue;
                };
                if best.as_ref().is_none_or(|b| cost(&candidate) < cost(b)) {
                    (best, starts, improved) = (Some(candidate), moved, true);
                }
            }
        }
    }
    best.ok_or_else(|| {
        PlanError::model(format!(
            "no split of the model into {stages} stages plans (each stage boundary cuts a \
             checkpoint segment, or a tensor a later stage would need from an earlier one's \
             backward)"
        ))
    })
}

/// `stages = auto`: the fewest stages (up to [`MAX_AUTO_STAGES`]) whose balanced split fits
/// `budget`, or the split with the smallest largest stage when none does.
pub fn fewest_stages(
    spec: &ModelSpec,
    budget: u64,
    micro_batches: usize,
    schedule: PipelineSchedule,
) -> Result<PipelinePlan, PlanError> {
    let mut best: Option<PipelinePlan> = None;
    let mut last_err = None;
    for p in 1..=MAX_AUTO_STAGES {
        match balance(spec, p, micro_batches, schedule) {
            Ok(pp) if pp.largest_stage().1 <= budget => return Ok(pp),
            Ok(pp) => {
                if best.as_ref().is_none_or(|b| cost(&pp) < cost(b)) {
                    best = Some(pp);
                }
            }
            Err(e) => last_err = Some(e),
        }
    }
    best.ok_or_else(|| last_err.unwrap_or_else(|| PlanError::model("no split plans")))
}

/// The largest batch (a multiple of the micro-batch count times the replicas) at which every
/// stage of `pipe` fits `budget`.
pub fn max_batch(spec: &ModelSpec, pipe: &Pipeline, budget: u64) -> Option<usize> {
    // A batch every replica's micro-batches divide.
    let m = pipe.micro_batches.max(1) * spec.replicas.max(1);
    let fits = |k: usize| {
        plan_pipeline(&spec.with_batch(k * m), pipe).is_ok_and(|pp| pp.largest_stage().1 <= budget)
    };
    crate::checkpoint::largest_batch(0, fits).map(|k| k * m)
}

/// The over-budget error of a pipeline whose largest stage does not fit `budget`: each
/// stage's total, and the micro-batch count and the split that would fit, each planned.
pub fn over_budget_message(spec: &ModelSpec, pp: &PipelinePlan, budget: u64) -> String {
    let (s, largest) = pp.largest_stage();
    let p = pp.stages.len();
    let per_stage: Vec<String> = (pp.stages.iter().enumerate())
        .map(|(i, st)| format!("stage {i}: {}", format_bytes(st.memory.total)))
        .collect();
    let mut out = format!(
        "stage {s} of {p} needs {} for one training step: {} over the budget of {} ({})",
        format_bytes(largest),
        format_bytes(largest - budget),
        format_bytes(budget),
        per_stage.join(", ")
    );
    let pipe = &pp.pipeline;
    let more = (pipe.micro_batches + 1..=spec.batch)
        .filter(|m| spec.batch.is_multiple_of(*m))
        .find_map(|m| {
            let more = Pipeline {
                micro_batches: m,
                ..pipe.clone()
            };
            let total = plan_pipeline(spec, &more).ok()?.largest_stage().1;
            (total <= budget).then_some((m, total))
        });
    match more {
        Some((m, total)) => {
            out += &format!(
                "\n= help: `micro_batches = {m}` fits (largest stage {})",
                format_bytes(total)
            )
        }
        None => out += "\n= note: no micro-batch count that divides the batch fits",
    }
    if let Ok(split) = balance(spec, p, pipe.micro_batches, pipe.schedule) {
        let total = split.largest_stage().1;
        if total <= budget && split.pipeline.boundaries != pipe.boundaries {
            let names: Vec<String> = (split.pipeline.boundaries.iter())
                .map(|b| format!("`{b}`"))
                .collect();
            out += &format!(
                "\n= help: {p} stages beginning at {} fit (largest stage {}; `stages = {p}` \
                 chooses that split)",
                names.join(", "),
                format_bytes(total)
            );
        }
    }
    out
}
