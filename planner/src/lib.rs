//! The memory planner: from a model description to a validated static memory plan.
//!
//! Pure Rust, no device code: it runs inside the `#[memwise::model]` macro at compile time
//! and in the runtime (re-planning for another batch). The pipeline, one type per stage:
//! [`ModelSpec`] → [`graph::Graph`] → [`autodiff::StepGraph`] → [`schedule::Schedule`] →
//! [`liveness::Lifetimes`] → [`arena::ArenaPlan`] → [`StaticPlan`] with its [`MemoryReport`].

pub mod advice;
pub mod arena;
pub mod autodiff;
pub mod checkpoint;
pub mod compile;
pub mod cost;
pub mod data_parallel;
pub mod dtype;
pub mod error;
pub mod estimate;
// The test models, random (`generate`) and the benchmark graphs (`zoo`), are behind the
// `test-models` feature: the `#[memwise::model]` macro does not compile them.
#[cfg(feature = "test-models")]
pub mod generate;
pub mod graph;
pub mod io;
pub mod layers;
pub mod liveness;
pub mod op;
pub mod pipeline;
pub mod plan;
pub mod rng;
pub mod schedule;
pub mod spec;
pub mod split;
pub mod stage;
#[cfg(feature = "test-models")]
pub mod zoo;

pub use compile::{
    compile, BudgetVerdict, CompileError, CompileOptions, Compiled, OverBudget, Stages,
    DEFAULT_BATCH,
};
pub use dtype::{DType, Precision};
pub use error::PlanError;
pub use op::{column_parts, column_parts_scratch_f32, loss_value_parts, Op, Window2d};
pub use plan::{
    LayerMemory, List, MemoryReport, Phase, PlanParam, PlanStep, PlanTensor, Role, StaticPlan,
    Text, NONE, NO_OFFSET,
};
pub use spec::{
    Activation, LayerKind, LayerSpec, LossKind, LossTerm, Metric, ModelSpec, Optimizer, Padding,
    Reduction,
};

/// Arena alignment in bytes (cudaMalloc's guarantee; also a cache-line multiple).
pub const ALIGNMENT: u64 = 256;

/// Plans one inference pass of `spec` (for evaluate and predict): the forward pass and the
/// loss values, batch norm from its running statistics, no dropout, nothing kept for a
/// backward pass. Its parameters are laid out exactly as in [`plan()`]'s persistent region.
pub fn plan_inference(spec: &ModelSpec) -> Result<StaticPlan, PlanError> {
    // An inference pass is one device's: it has no gradients to sum.
    let spec = &spec.one_device();
    let graph = graph::Graph::build_inference(spec)?;
    let step = autodiff::StepGraph::inference(&graph);
    finish(spec, &graph, &step)
}

/// Plans one training step of `spec`: every step, every tensor's lifetime and offset,
/// and the memory report. The plan is validated before it is returned.
pub fn plan(spec: &ModelSpec) -> Result<StaticPlan, PlanError> {
    // Data parallel: one replica's step (its share of the batch, the gradient sums).
    let spec = &spec.per_replica()?;
    let mut graph = graph::Graph::build(spec)?;
    let step = autodiff::StepGraph::build(&mut graph, spec)?;
    finish(spec, &graph, &step)
}

fn finish(
    spec: &ModelSpec,
    graph: &graph::Graph,
    step: &autodiff::StepGraph,
) -> Result<StaticPlan, PlanError> {
    let schedule = schedule::Schedule::build(graph, step);
    let lifetimes = liveness::Lifetimes::compute(&schedule, ALIGNMENT);
    let arena = arena::ArenaPlan::build(&schedule, &lifetimes, ALIGNMENT);
    let plan = estimate::assemble(spec, graph, &schedule, &lifetimes, &arena);
    arena::validate(&plan)
        .map_err(|e| PlanError::internal(format!("plan failed validation: {e}")))?;
    Ok(plan)
}
