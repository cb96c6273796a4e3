//! Every loss reads a linear output as logits and a `sigmoid`/`softmax` output as
//! probabilities, so the two spellings of one model train the same: the fused gradient is
//! `σ(x) − t` (or `softmax(x) − onehot`) either way.

use memwise_plan::{Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer};
use memwise_runtime::data::dataset::{Column, InMemory};
use memwise_runtime::{Device, FitOptions, Trainer};

const FEATURES: usize = 8;
const SAMPLES: usize = 256;

fn classifier(out_units: usize, act: Activation, loss: LossKind) -> ModelSpec {
    let mut m = ModelSpec::new("Classifier", 32);
    m.optimizer = Optimizer::Adam {
        lr: 1e-2,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };
    m.input("x", &[FEATURES], DType::F32, 1.0);
    if loss == LossKind::SparseCategoricalCrossentropy {
        m.input("y", &[], DType::I32, 1.0);
    } else {
        m.input("y", &[out_units], DType::F32, 1.0);
    }
    m.add("hidden", LayerKind::dense(16, Activation::Relu), &["x"]);
    m.add("out", LayerKind::dense(out_units, act), &[]);
    m.loss.push(LossTerm::new(loss).on(&["out", "y"]));
    m
}

/// Features in [-1, 1]; the class is whether the first three features sum above 0.
fn data(int_labels: bool) -> InMemory {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..SAMPLES * FEATURES).map(|_| next()).collect();
    let class = |i: usize| (x[i * FEATURES..i * FEATURES + 3].iter().sum::<f32>() > 0.0) as i32;
    let y = if int_labels {
        Column::I32 {
            data: (0..SAMPLES).map(class).collect(),
            per_sample: 1,
        }
    } else {
        Column::F32 {
            data: (0..SAMPLES).map(|i| class(i) as f32).collect(),
            per_sample: 1,
        }
    };
    InMemory::new(vec![
        Column::F32 {
            data: x,
            per_sample: FEATURES,
        },
        y,
    ])
    .unwrap()
}

/// Trains `spec` for 3 epochs from seed 7 and returns the epoch losses and the output weights.
fn train(spec: &ModelSpec, data: &InMemory) -> (Vec<f32>, Vec<f32>) {
    let mut t = Trainer::build(spec, &Device::cpu(), 7).unwrap();
    let opts = FitOptions {
        epochs: 3,
        verbose: false,
        ..Default::default()
    };
    let h = t.fit(data, None, &opts, &mut []).unwrap();
    let losses = h.epochs.iter().map(|e| e.loss).collect();
    (losses, t.engine().param("out.weight").unwrap())
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn binary_crossentropy_on_a_linear_output_learns_as_with_sigmoid() {
    let d = data(false);
    let bce = LossKind::BinaryCrossentropy;
    let (logit_losses, logit_w) = train(&classifier(1, Activation::Linear, bce), &d);
    let (prob_losses, prob_w) = train(&classifier(1, Activation::Sigmoid, bce), &d);
    // It learns: from ln 2 ≈ 0.69 at chance to well below it.
    assert!(
        logit_losses[2] < 0.5 && logit_losses[2] < logit_losses[0],
        "{logit_losses:?}"
    );
    // Same gradients, so the same weights (the values differ only where Keras's clip of
    // probabilities bites, which these moderate logits never reach).
    assert!(
        max_rel_diff(&logit_w, &prob_w) < 1e-4,
        "{logit_w:?} vs {prob_w:?}"
    );
    for (a, b) in logit_losses.iter().zip(&prob_losses) {
        assert!((a - b).abs() < 1e-4, "{logit_losses:?} vs {prob_losses:?}");
    }
}

#[test]
fn sparse_categorical_crossentropy_on_a_linear_output_learns_as_with_softmax() {
    let d = data(true);
    let scce = LossKind::SparseCategoricalCrossentropy;
    let (logit_losses, logit_w) = train(&classifier(2, Activation::Linear, scce), &d);
    let (prob_losses, prob_w) = train(&classifier(2, Activation::Softmax, scce), &d);
    assert!(
        logit_losses[2] < 0.5 && logit_losses[2] < logit_losses[0],
        "{logit_losses:?}"
    );
    assert!(
        max_rel_diff(&logit_w, &prob_w) < 1e-4,
        "{logit_w:?} vs {prob_w:?}"
    );
    for (a, b) in logit_losses.iter().zip(&prob_losses) {
        assert!((a - b).abs() < 1e-4, "{logit_losses:?} vs {prob_losses:?}");
    }
}
