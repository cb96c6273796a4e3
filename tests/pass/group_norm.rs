//! group_norm on images: Keras's defaults where 32 groups divide the channels, a group count by
//! position and by name, its scale and shift per channel, and the op it plans.
use memwise::prelude::*;

#[memwise::model(batch = 2, optimizer = adam, loss = sparse_categorical_crossentropy)]
struct Groups {
    #[input(shape = [8, 8, 3], dtype = u8, scale = 1.0 / 255.0)]
    image: Input,
    #[conv2d(64, 3, padding = same)]
    conv: Conv2d,
    #[group_norm]
    gn: GroupNorm,
    #[activation(leaky_relu)]
    act: Activation,
    #[conv2d(8, 3, padding = same)]
    conv_2: Conv2d,
    #[group_norm(4, epsilon = 1e-5)]
    gn_2: GroupNorm,
    #[conv2d(6, 1)]
    conv_3: Conv2d,
    #[group_norm(groups = 3)]
    gn_3: GroupNorm,
    #[global_avg_pool]
    gap: GlobalAvgPool,
    #[dense(10, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

fn main() {
    use memwise::plan::{LayerKind, Op};
    let spec = Groups::spec();
    let kind = |n: &str| spec.layer(n).unwrap().kind.clone();
    assert_eq!(kind("gn"), LayerKind::GroupNorm { groups: 32, epsilon: 1e-3 });
    assert_eq!(kind("gn_2"), LayerKind::GroupNorm { groups: 4, epsilon: 1e-5 });
    assert_eq!(kind("gn_3"), LayerKind::GroupNorm { groups: 3, epsilon: 1e-3 });
    let names: Vec<&str> = Groups::PLAN.params.iter().map(|p| &*p.name).collect();
    assert!(names.contains(&"gn.weight") && names.contains(&"gn.bias"), "{names:?}");
    let step = Groups::PLAN.steps.iter().find(|s| s.layer == "gn_2").unwrap();
    assert_eq!(step.op.name(), "group_norm");
    assert!(matches!(
        step.op,
        Op::GroupNorm { samples: 2, spatial: 64, channels: 8, groups: 4, center: true, .. }
    ));
    assert_eq!(Groups::plan_for_batch(2).unwrap(), Groups::PLAN);
}
