//! Activations with a parameter: leaky_relu and elu at their defaults, by name and by
//! position, as a layer option and as an activation layer.
use memwise::prelude::*;

#[memwise::model(batch = 8, optimizer = sgd(lr = 0.1), loss = mse(out, x))]
struct Acts {
    #[input(shape = [16])]
    x: Input,
    #[dense(16, activation = leaky_relu)]
    leaky_default: Dense,
    #[dense(16, activation = leaky_relu(alpha = 0.1))]
    leaky_named: Dense,
    #[dense(16, activation = elu)]
    elu_default: Dense,
    #[activation(elu(0.5))]
    elu_layer: Activation,
    #[dense(16)]
    out: Dense,
}

fn main() {
    use memwise::plan::{Activation as A, LayerKind, Op};
    let spec = Acts::spec();
    let act = |name: &str| match spec.layer(name).unwrap().kind {
        LayerKind::Dense { activation, .. } | LayerKind::Activation(activation) => activation,
        ref other => panic!("{other:?}"),
    };
    // Keras's LeakyReLU layer's default slope, and ELU's.
    assert_eq!(act("leaky_default"), A::LeakyRelu { alpha: 0.3 });
    assert_eq!(act("leaky_named"), A::LeakyRelu { alpha: 0.1 });
    assert_eq!(act("elu_default"), A::Elu { alpha: 1.0 });
    assert_eq!(act("elu_layer"), A::Elu { alpha: 0.5 });
    // The compile-time plan carries the parameter to the kernels.
    let slopes: Vec<A> = Acts::PLAN
        .steps
        .iter()
        .filter_map(|s| match s.op {
            Op::Activation { act, .. } if s.phase == memwise::plan::Phase::Forward => Some(act),
            _ => None,
        })
        .collect();
    assert!(slopes.contains(&A::LeakyRelu { alpha: 0.1 }), "{slopes:?}");
    assert!(slopes.contains(&A::Elu { alpha: 0.5 }), "{slopes:?}");
    assert_eq!(Acts::plan_for_batch(8).unwrap(), Acts::PLAN);
}
