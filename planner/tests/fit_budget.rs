//! `checkpoint::fit_budget`: a model made to fit a budget — as declared, checkpointed at the
//! declared batch, at a smaller batch, or refused with the smallest total it could reach.

use memwise_plan::checkpoint::{fit_budget, max_batch_with, solve, Policy, Solver};
use memwise_plan::{plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec};

/// Eight dense layers of 1024 at batch 4096: activations dominate, so checkpointing helps.
const BATCH: usize = 4096;

fn deep(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("Deep", batch);
    m.input("x", &[256], DType::F32, 1.0);
    m.input("target", &[256], DType::F32, 1.0);
    let mut prev = "x".to_string();
    for i in 0..8 {
        let name = format!("h{i}");
        m.add(&name, LayerKind::dense(1024, Activation::Gelu), &[&prev]);
        prev = name;
    }
    m.add("out", LayerKind::dense(256, Activation::Linear), &[&prev]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "target"]));
    m
}

#[test]
fn a_model_that_fits_is_kept_as_declared() {
    let spec = deep(BATCH);
    let total = plan(&spec).unwrap().memory.total;
    let fit = fit_budget(&spec, total).unwrap();
    assert_eq!(fit.plan.batch, BATCH);
    assert!(fit.checkpoint.is_none());
    assert_eq!(fit.plan.memory.total, total);
    assert!(
        fit.to_string().starts_with("batch 4096 as declared"),
        "{fit}"
    );
}

#[test]
fn over_the_budget_it_checkpoints_at_the_declared_batch() {
    let spec = deep(BATCH);
    let total = plan(&spec).unwrap().memory.total;
    let (smallest, _) = Solver::new(&spec).unwrap().smallest_total();
    assert!(smallest < total);
    let budget = smallest + (total - smallest) / 3;
    let fit = fit_budget(&spec, budget).unwrap();
    assert_eq!(fit.plan.batch, BATCH, "the batch stays");
    assert!(fit.plan.memory.total <= budget);
    let choice = fit.checkpoint.as_ref().expect("checkpointed");
    // The same choice the solver makes on its own.
    assert_eq!(choice, &solve(&spec, budget).unwrap());
    assert!(fit.spec.layers.iter().any(|l| l.checkpoint.is_some()));
    assert!(fit.to_string().contains("recomputes"), "{fit}");
}

#[test]
fn below_the_smallest_checkpointed_total_it_lowers_the_batch() {
    let spec = deep(BATCH);
    let (smallest, _) = Solver::new(&spec).unwrap().smallest_total();
    let budget = smallest - smallest / 5;
    let fit = fit_budget(&spec, budget).unwrap();
    assert!(fit.plan.batch < BATCH);
    assert!(fit.plan.memory.total <= budget);
    // The largest batch that fits with checkpointing, and no larger.
    let best = max_batch_with(&spec, budget, Policy::AutoCheckpoint).unwrap();
    assert_eq!(fit.plan.batch, best);
    assert!(solve(&spec.with_batch(best + 1), budget).is_err());
    assert!(fit.to_string().contains("declared 4096"), "{fit}");
}

#[test]
fn a_budget_below_batch_one_is_an_error_with_the_numbers() {
    let spec = deep(BATCH);
    let e = fit_budget(&spec, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("even at batch 1"), "{e}");
    assert!(e.contains("1 MiB"), "{e}");
}
