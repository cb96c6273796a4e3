//! `compile`: everything the `#[memwise::model]` macro asks of the planner, in one call — the
//! plan, what `checkpoint = auto` chose, the largest batch under the budget (`MAX_BATCH`) and
//! the budget verdict with its planned fixes and message. The macro only turns the answer
//! into tokens and puts errors on spans (serde_derive's split: syntax there, logic here).

use std::fmt;

use crate::advice::{self, Fixes, UserCheckpoints};
use crate::checkpoint::{self, max_batch_with, CheckpointChoice, Policy};
use crate::error::PlanError;
use crate::plan::StaticPlan;
use crate::spec::ModelSpec;
use crate::stage::{Pipeline, PipelinePlan};

/// The batch of a model attribute without `batch = …`: Keras's default batch size in `fit`.
pub const DEFAULT_BATCH: usize = 32;

/// What the model attribute asks beyond the spec.
#[derive(Default)]
pub struct CompileOptions<'a> {
    /// `budget = "…"` in bytes: `MAX_BATCH` and the verdict are computed against it.
    pub budget: Option<u64>,
    /// `checkpoint = auto`: choose the checkpoint segments that fit `budget` with the least
    /// recomputation (needs a budget).
    pub auto_checkpoint: bool,
    /// The units the user checkpoints with one annotation each (fields, blocks), for the
    /// over-budget error's checkpoint fix; `None`: every non-input layer is a unit.
    pub checkpoints: Option<&'a UserCheckpoints<'a>>,
    /// `stages = N` or `stages = auto`: the planner chooses the split (the spec's pipeline,
    /// if any, gives the micro-batches and the schedule).
    pub stages: Option<Stages>,
}

/// A split the planner chooses ([`crate::split`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stages {
    /// `stages = N`: the split of N stages whose largest stage is smallest.
    Count(usize),
    /// `stages = auto`: the fewest stages whose largest fits the budget.
    Auto,
}

/// The compiled model.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The spec as planned: as declared, with the segments `checkpoint = auto` chose.
    pub spec: ModelSpec,
    pub plan: StaticPlan,
    /// What `checkpoint = auto` chose (its `Display` is the `AUTO_CHECKPOINT` text).
    pub auto_checkpoint: Option<CheckpointChoice>,
    /// With a budget: the largest batch and whether the plan fits.
    pub budget: Option<BudgetVerdict>,
    /// A model split into stages: every stage's plan (`plan` is then the whole model on one
    /// device, for comparison), and the budget applies to each stage.
    pub pipeline: Option<PipelinePlan>,
}

/// The plan against the declared budget.
#[derive(Clone, Debug)]
pub struct BudgetVerdict {
    pub budget: u64,
    /// The model's own policy: [`Policy::AutoCheckpoint`] with `checkpoint = auto`, else
    /// [`Policy::Plain`].
    pub policy: Policy,
    /// The largest batch that fits under `policy` ([`max_batch_with`]): `MAX_BATCH`.
    pub max_batch: Option<usize>,
    /// Why the plan does not fit and what would fit; `None` when it fits.
    pub over: Option<OverBudget>,
}

/// A plan over its budget: the fixes, each planned, and the error's text.
#[derive(Clone, Debug)]
pub struct OverBudget {
    pub fixes: Fixes,
    /// The whole error: headline, breakdown, fixes (`advice::budget_message`).
    pub message: String,
}

/// Why a model does not compile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompileError {
    /// The model cannot be planned; [`PlanError::layer`] names the layer at fault.
    Plan(PlanError),
    /// `checkpoint = auto` without a budget to fit.
    AutoCheckpointWithoutBudget,
    /// `stages = auto` without a budget to fit.
    AutoStagesWithoutBudget,
    /// `checkpoint = auto` fits nothing at the declared batch: the solver's reason, and the
    /// largest batch that fits with it.
    AutoCheckpointOverBudget {
        reason: PlanError,
        max_batch: Option<usize>,
    },
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompileError::Plan(e) => write!(f, "{e}"),
            CompileError::AutoCheckpointWithoutBudget => f.write_str(
                "`checkpoint = auto` chooses the checkpoints that fit the budget: add `budget = \"…\"`",
            ),
            CompileError::AutoStagesWithoutBudget => f.write_str(
                "`stages = auto` chooses the fewest stages whose largest fits the budget: add \
                 `budget = \"…\"`, or say how many (`stages = 2`)",
            ),
            CompileError::AutoCheckpointOverBudget { reason, max_batch } => {
                write!(f, "`checkpoint = auto`: {}", reason.message)?;
                match max_batch {
                    Some(b) => write!(f, "\n= help: `batch = {b}` fits with `checkpoint = auto` (the largest batch that does)"),
                    None => f.write_str("\n= note: not even batch 1 fits with `checkpoint = auto`"),
                }
            }
        }
    }
}

impl std::error::Error for CompileError {}

/// Compiles `spec`: applies `checkpoint = auto`, plans the step, and, with a budget, finds
/// the largest batch that fits and, when the plan does not, the planned fixes.
pub fn compile(spec: &ModelSpec, options: &CompileOptions<'_>) -> Result<Compiled, CompileError> {
    let (spec, auto_checkpoint) = match (options.auto_checkpoint, options.budget) {
        (false, _) => (spec.clone(), None),
        (true, None) => return Err(CompileError::AutoCheckpointWithoutBudget),
        (true, Some(budget)) => match checkpoint::solve(spec, budget) {
            Ok(choice) => (choice.apply(spec), Some(choice)),
            // A model that cannot be planned at all says so at the layer at fault.
            Err(reason) => {
                crate::plan(spec).map_err(CompileError::Plan)?;
                return Err(CompileError::AutoCheckpointOverBudget {
                    max_batch: max_batch_with(spec, budget, Policy::AutoCheckpoint),
                    reason,
                });
            }
        },
    };
    let plan = crate::plan(&spec).map_err(CompileError::Plan)?;
    if let Some(pp) = pipeline_of(&spec, options)? {
        let mut spec = spec;
        spec.pipeline = Some(pp.pipeline.clone());
        let budget = options
            .budget
            .map(|budget| pipeline_verdict(&spec, &pp, budget));
        return Ok(Compiled {
            spec,
            plan,
            auto_checkpoint,
            budget,
            pipeline: Some(pp),
        });
    }
    let policy = if auto_checkpoint.is_some() {
        Policy::AutoCheckpoint
    } else {
        Policy::Plain
    };
    let budget = options.budget.map(|budget| {
        let max_batch = max_batch_with(&spec, budget, policy);
        let over = (plan.memory.total > budget).then(|| {
            let fixes = match options.checkpoints {
                Some(c) => {
                    let plain = match policy {
                        Policy::Plain => max_batch,
                        _ => max_batch_with(&spec, budget, Policy::Plain),
                    };
                    advice::fixes_planned(&spec, Some(&plan), budget, plain, c)
                }
                None => advice::fixes(&spec, budget),
            };
            let message = advice::budget_message(&spec, &plan, &fixes);
            OverBudget { fixes, message }
        });
        BudgetVerdict {
            budget,
            policy,
            max_batch,
            over,
        }
    });
    Ok(Compiled {
        spec,
        plan,
        auto_checkpoint,
        budget,
        pipeline: None,
    })
}

/// The stages' plans of a split model: the spec's split, or the one `options.stages` chooses
/// (with the spec's micro-batches and schedule, one micro-batch and 1F1B if it has none).
fn pipeline_of(
    spec: &ModelSpec,
    options: &CompileOptions<'_>,
) -> Result<Option<PipelinePlan>, CompileError> {
    let declared = spec.pipeline.clone();
    let base = declared
        .clone()
        .unwrap_or_else(|| Pipeline::new(crate::pipeline::PipelineSchedule::OneFOneB, 1, &[]));
    let (m, schedule) = (base.micro_batches, base.schedule);
    let chosen = match (options.stages, options.budget) {
        (None, _) => match declared {
            Some(pipe) => crate::stage::plan_pipeline(spec, &pipe),
            None => return Ok(None),
        },
        (Some(Stages::Count(p)), _) => crate::split::balance(spec, p, m, schedule),
        (Some(Stages::Auto), Some(budget)) => {
            crate::split::fewest_stages(spec, budget, m, schedule)
        }
        (Some(Stages::Auto), None) => return Err(CompileError::AutoStagesWithoutBudget),
    };
    chosen.map(Some).map_err(CompileError::Plan)
}

/// Every stage against the budget: the largest batch at which all fit, and the error when
/// the largest does not.
fn pipeline_verdict(spec: &ModelSpec, pp: &PipelinePlan, budget: u64) -> BudgetVerdict {
    let largest = pp.largest_stage().1;
    let over = (largest > budget).then(|| OverBudget {
        fixes: Fixes {
            budget,
            needed: largest,
            max_batch: None,
            precision: None,
            checkpoint: None,
            checkpoint_best: None,
        },
        message: crate::split::over_budget_message(spec, pp, budget),
    });
    BudgetVerdict {
        budget,
        policy: Policy::Plain,
        max_batch: crate::split::max_batch(spec, &pp.pipeline, budget),
        over,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zoo;

    #[test]
    fn a_model_that_fits_gets_its_plan_and_largest_batch() {
        let spec = zoo::mnist_mlp(128);
        let options = CompileOptions {
            budget: Some(2 << 30),
            ..CompileOptions::default()
        };
        let c = compile(&spec, &options).unwrap();
        assert_eq!(c.spec, spec);
        assert_eq!(c.plan, crate::plan(&spec).unwrap());
        assert!(c.auto_checkpoint.is_none());
        let v = c.budget.unwrap();
        assert_eq!(v.policy, Policy::Plain);
        assert_eq!(v.max_batch, max_batch_with(&spec, 2 << 30, Policy::Plain));
        assert!(v.over.is_none());
    }

    #[test]
    fn over_budget_carries_the_planned_fixes_and_the_message() {
        let spec = zoo::mnist_mlp(8192);
        let budget = crate::plan(&spec).unwrap().memory.total * 3 / 4;
        // Each non-input layer a unit, as the macro describes its fields.
        let units = (2..spec.layers.len())
            .map(|i| advice::CheckpointUnit {
                label: spec.layers[i].name.clone(),
                position: i,
                layers: vec![spec.layers[i].name.clone()],
            })
            .collect();
        let apply = |runs: &[Vec<usize>], _: advice::Annotation| {
            let mut s = spec.clone();
            for (id, run) in (0..).zip(runs) {
                for &u in run {
                    s.layers[u + 2].checkpoint = Some(id);
                }
            }
            s
        };
        let checkpoints = UserCheckpoints {
            units,
            first_segment: 1,
            apply: &apply,
        };
        let options = CompileOptions {
            budget: Some(budget),
            auto_checkpoint: false,
            checkpoints: Some(&checkpoints),
            stages: None,
        };
        let c = compile(&spec, &options).unwrap();
        let v = c.budget.unwrap();
        let over = v.over.expect("over budget");
        // What compile planned once equals the fixes planned from scratch.
        assert_eq!(over.fixes, advice::fixes_with(&spec, budget, &checkpoints));
        assert_eq!(over.fixes, advice::fixes(&spec, budget));
        let (b, _) = over.fixes.max_batch.unwrap();
        assert_eq!(v.max_batch, Some(b));
        assert!(over.message.starts_with("model `MnistMlp` needs "));
        assert!(over
            .message
            .contains(&format!("`batch = {b}` (the largest batch that fits)")));
    }

    #[test]
    fn auto_checkpoint_applies_the_solver_choice() {
        let spec = zoo::gpt2_stack(1, 2);
        let unchecked = crate::plan(&spec).unwrap().memory.total;
        let budget = unchecked - unchecked / 50;
        let options = CompileOptions {
            budget: Some(budget),
            auto_checkpoint: true,
            checkpoints: None,
            stages: None,
        };
        let c = compile(&spec, &options).unwrap();
        let choice = c.auto_checkpoint.expect("a choice");
        assert_eq!(choice, checkpoint::solve(&spec, budget).unwrap());
        assert_eq!(c.spec, choice.apply(&spec));
        assert!(c.plan.memory.total <= budget);
        let v = c.budget.unwrap();
        assert_eq!(v.policy, Policy::AutoCheckpoint);
        assert_eq!(
            v.max_batch,
            max_batch_with(&c.spec, budget, Policy::AutoCheckpoint)
        );
    }

    #[test]
    fn auto_checkpoint_errors_say_where_they_belong() {
        let spec = zoo::mnist_mlp(64);
        let options = CompileOptions {
            auto_checkpoint: true,
            ..CompileOptions::default()
        };
        assert_eq!(
            compile(&spec, &options).unwrap_err(),
            CompileError::AutoCheckpointWithoutBudget
        );
        let options = CompileOptions {
            budget: Some(1 << 10),
            auto_checkpoint: true,
            checkpoints: None,
            stages: None,
        };
        let e = compile(&spec, &options).unwrap_err();
        assert!(matches!(
            e,
            CompileError::AutoCheckpointOverBudget {
                max_batch: None,
                ..
            }
        ));
        assert!(e
            .to_string()
            .ends_with("not even batch 1 fits with `checkpoint = auto`"));
        // A model the planner rejects is a plan error, whatever the options.
        let mut bad = spec.clone();
        bad.layers[2].inputs = vec!["nowhere".into()];
        for auto_checkpoint in [false, true] {
            let options = CompileOptions {
                budget: Some(1 << 30),
                auto_checkpoint,
                checkpoints: None,
                stages: None,
            };
            assert!(matches!(
                compile(&bad, &options),
                Err(CompileError::Plan(_))
            ));
        }
    }

    #[test]
    fn the_batch_search_is_exact_at_its_edges() {
        let spec = zoo::mnist_mlp(1);
        let total = |b: usize| crate::plan(&spec.with_batch(b)).unwrap().memory.total;
        // Batch 1 not fitting: None, for every policy.
        for policy in Policy::ALL {
            assert_eq!(max_batch_with(&spec, total(1) - 1, policy), None);
        }
        // Exactly batch 1, and exactly batch 1000.
        assert_eq!(max_batch_with(&spec, total(1), Policy::Plain), Some(1));
        assert_eq!(
            max_batch_with(&spec, total(1000), Policy::Plain),
            Some(1000)
        );
    }
}
