//! One rule for every loss: a `sigmoid`/`softmax` output is probabilities, any other output
//! is logits (the loss then fuses the sigmoid or softmax, numerically stable). These tests pin
//! which loss op each pairing plans.

use memwise_plan::{
    plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Op, Phase, StaticPlan,
};

/// A one-layer model whose output `out` (8 features, or 8 classes) has activation `act`,
/// trained with `loss` against `target`; `extra_reader` makes a second layer read `out`.
fn model(act: Activation, loss: LossKind, extra_reader: bool) -> ModelSpec {
    let mut m = ModelSpec::new("Losses", 4);
    m.input("x", &[16], DType::F32, 1.0);
    if loss == LossKind::SparseCategoricalCrossentropy {
        m.input("target", &[], DType::I32, 1.0);
    } else {
        m.input("target", &[8], DType::F32, 1.0);
    }
    m.add("out", LayerKind::dense(8, act), &["x"]);
    if extra_reader {
        m.add("side", LayerKind::dense(8, Activation::Linear), &["out"]);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["side", "target"]));
    }
    m.loss.push(LossTerm::new(loss).on(&["out", "target"]));
    m
}

fn loss_ops(p: &StaticPlan) -> Vec<&'static str> {
    p.steps
        .iter()
        .filter(|s| s.phase == Phase::Loss)
        .map(|s| s.op.name())
        .collect()
}

#[test]
fn binary_crossentropy_reads_a_linear_output_as_logits() {
    for act in [Activation::Linear, Activation::Relu, Activation::Tanh] {
        let p = plan(&model(act, LossKind::BinaryCrossentropy, false)).unwrap();
        assert_eq!(loss_ops(&p), ["binary_crossentropy_from_logits"], "{act:?}");
        // The gradient flows into the layer's output as with any other loss.
        let s = p.steps.iter().find(|s| s.phase == Phase::Loss).unwrap();
        assert!(matches!(
            s.op,
            Op::BinaryCrossentropyFromLogits {
                rows: 4,
                features: 8,
                ..
            }
        ));
    }
}

#[test]
fn binary_crossentropy_reads_a_sigmoid_or_softmax_output_as_probabilities() {
    let p = plan(&model(
        Activation::Sigmoid,
        LossKind::BinaryCrossentropy,
        false,
    ))
    .unwrap();
    assert_eq!(loss_ops(&p), ["sigmoid_binary_crossentropy"]);
    // The sigmoid's output read elsewhere too: the loss cannot fuse it, and reads probabilities.
    let p = plan(&model(
        Activation::Sigmoid,
        LossKind::BinaryCrossentropy,
        true,
    ))
    .unwrap();
    assert_eq!(loss_ops(&p), ["mse", "binary_crossentropy"]);
    let p = plan(&model(
        Activation::Softmax,
        LossKind::BinaryCrossentropy,
        false,
    ))
    .unwrap();
    assert_eq!(loss_ops(&p), ["binary_crossentropy"]);
}

#[test]
fn sparse_categorical_crossentropy_follows_the_same_rule() {
    let scce = LossKind::SparseCategoricalCrossentropy;
    let p = plan(&model(Activation::Softmax, scce, false)).unwrap();
    assert_eq!(loss_ops(&p), ["softmax_cross_entropy"]);
    for act in [Activation::Linear, Activation::Relu] {
        let p = plan(&model(act, scce, false)).unwrap();
        assert_eq!(loss_ops(&p), ["softmax_cross_entropy_from_logits"]);
    }
    // Sigmoid outputs are probabilities, but not over classes: refused with the fix.
    let e = plan(&model(Activation::Sigmoid, scce, false)).unwrap_err();
    assert_eq!(e.layer.as_deref(), Some("out"));
    assert!(
        e.message.contains("a sigmoid output") && e.message.contains("activation = softmax"),
        "{}",
        e.message
    );
}

#[test]
fn regression_losses_read_any_output_as_values() {
    for act in [Activation::Linear, Activation::Sigmoid] {
        let p = plan(&model(act, LossKind::MeanSquaredError, false)).unwrap();
        assert_eq!(loss_ops(&p), ["mse"]);
    }
}
