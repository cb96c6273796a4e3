//! rms_norm: its Keras default, an explicit epsilon, its one parameter (a scale, started at
//! ones) and the op it plans.
use memwise::prelude::*;

#[memwise::model(batch = 4, optimizer = sgd(lr = 0.1), loss = mse(out, y))]
struct Rms {
    #[input(shape = [6, 16])]
    x: Input,
    #[rms_norm]
    pre: RmsNorm,
    #[dense(8)]
    mix: Dense,
    #[rms_norm(epsilon = 1e-5)]
    out: RmsNorm,
    #[input(shape = [6, 8])]
    y: Input,
}

fn main() {
    use memwise::plan::{LayerKind, Op};
    let spec = Rms::spec();
    assert_eq!(spec.layer("pre").unwrap().kind, LayerKind::RmsNorm { epsilon: 1e-6 });
    assert_eq!(spec.layer("out").unwrap().kind, LayerKind::RmsNorm { epsilon: 1e-5 });
    assert_eq!(Rms::layers().out.name(), "out");
    let names: Vec<&str> = Rms::PLAN.params.iter().map(|p| &*p.name).collect();
    assert!(names.contains(&"pre.weight") && !names.contains(&"pre.bias"), "{names:?}");
    let step = Rms::PLAN.steps.iter().find(|s| s.layer == "out").unwrap();
    assert_eq!(step.op.name(), "rms_norm");
    assert!(matches!(step.op, Op::GroupNorm { samples: 24, channels: 8, center: false, .. }));
    assert_eq!(Rms::plan_for_batch(4).unwrap(), Rms::PLAN);
}
