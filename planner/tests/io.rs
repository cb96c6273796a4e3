//! Every step of every plan decodes into its op's named tensors: the zoo (training and
//! inference), random models of every layer kind, and the checkpointed zoo (recompute steps).

use memwise_plan::io::StepIo;
use memwise_plan::{plan, plan_inference, zoo, Op, Phase, StaticPlan};

fn decode_all(p: &StaticPlan) -> usize {
    for s in p.steps.iter() {
        StepIo::of(s).unwrap_or_else(|e| panic!("{}: {e}", p.model));
    }
    p.steps.len()
}

#[test]
fn every_zoo_step_decodes() {
    let mut steps = 0;
    for (name, spec) in zoo::all(0.25) {
        steps += decode_all(&plan(&spec).unwrap());
        steps += decode_all(&plan_inference(&spec).unwrap());
        let mut checkpointed = spec.clone();
        zoo::checkpoint_blocks(&mut checkpointed, |l| {
            l.split('.').next().map(str::to_string)
        });
        steps += decode_all(&plan(&checkpointed).unwrap_or_else(|e| panic!("{name}: {e}")));
    }
    assert!(steps > 1000, "{steps} steps");
}

#[test]
fn every_generated_step_decodes() {
    let mut decoded = 0;
    for seed in 0..150u64 {
        for spec in [
            memwise_plan::generate::random_chain(seed),
            memwise_plan::generate::random_dag(seed),
        ] {
            if let Ok(p) = plan(&spec) {
                decoded += decode_all(&p);
            }
            if let Ok(p) = plan_inference(&spec) {
                decoded += decode_all(&p);
            }
        }
    }
    assert!(decoded > 0);
}

/// The generated models the poisoned-arena and emulated-device tests train include batch and
/// layer norms that rebuild x̂ from an input another op keeps, and ones that keep x̂.
#[test]
fn generated_models_cover_both_norm_backwards() {
    // [batch norm, layer norm] × [rebuild, keep]
    let mut count = [[0usize; 2]; 2];
    for seed in 0..150u64 {
        for spec in [
            memwise_plan::generate::random_chain(seed),
            memwise_plan::generate::random_dag(seed),
        ] {
            let Ok(p) = plan(&spec) else { continue };
            for s in p.steps.iter().filter(|s| s.phase == Phase::Backward) {
                let (norm, rebuild) = match s.op {
                    Op::BatchNorm { rebuild_x_hat, .. } => (0, rebuild_x_hat),
                    Op::LayerNorm { rebuild_x_hat, .. } => (1, rebuild_x_hat),
                    _ => continue,
                };
                count[norm][usize::from(!rebuild)] += 1;
            }
        }
    }
    let [[bn_rebuild, bn_keep], [ln_rebuild, ln_keep]] = count;
    println!("batch norm backwards: {bn_rebuild} rebuild x̂, {bn_keep} keep it");
    println!("layer norm backwards: {ln_rebuild} rebuild x̂, {ln_keep} keep it");
    assert!(count.iter().flatten().all(|&n| n >= 5), "{count:?}");
}
