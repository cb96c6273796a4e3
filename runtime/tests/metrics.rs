//! Metrics are means over the elements they score: accuracy counts one prediction per sample
//! for a class label and one per token for a sequence of labels, in `fit` and `evaluate`.

use memwise_plan::{Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer};
use memwise_runtime::data::dataset::{Column, InMemory};
use memwise_runtime::{Device, FitOptions, Trainer};

const VOCAB: usize = 4;
const SEQ: usize = 6;

/// Token ids → embedding (vocab × vocab) → dense logits over the vocabulary, one prediction per
/// token.
fn token_model(batch: usize, lr: f32) -> ModelSpec {
    let mut m = ModelSpec::new("TokenModel", batch);
    m.optimizer = Optimizer::Sgd { lr };
    m.input("ids", &[SEQ], DType::I32, 1.0);
    m.input("next", &[SEQ], DType::I32, 1.0);
    m.add(
        "embed",
        LayerKind::Embedding {
            vocab: VOCAB,
            dim: VOCAB,
        },
        &["ids"],
    );
    m.add("logits", LayerKind::dense(VOCAB, Activation::Linear), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "next"]));
    m
}

fn identity(n: usize) -> Vec<f32> {
    (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect()
}

fn dataset(ids: Vec<i32>, next: Vec<i32>) -> InMemory {
    InMemory::new(vec![
        Column::I32 {
            data: ids,
            per_sample: SEQ,
        },
        Column::I32 {
            data: next,
            per_sample: SEQ,
        },
    ])
    .unwrap()
}

/// With identity embedding and dense weights the model predicts each token's own id, so the
/// accuracy on a hand-made batch is known exactly: 11 of the 18 tokens of three samples have
/// `next == id`. Batch 2 makes `evaluate` run a full batch and a partial one.
#[test]
fn token_accuracy_is_a_fraction_of_tokens() {
    let mut t = Trainer::build(&token_model(2, 0.0), &Device::cpu(), 0).unwrap();
    t.engine_mut()
        .set_param("embed.weight", &identity(VOCAB))
        .unwrap();
    t.engine_mut()
        .set_param("logits.weight", &identity(VOCAB))
        .unwrap();
    t.engine_mut()
        .set_param("logits.bias", &[0.0; VOCAB])
        .unwrap();
    let ids = vec![0, 1, 2, 3, 0, 1, 2, 2, 2, 2, 3, 3, 1, 0, 1, 0, 1, 0];
    // Matches: sample 0: 4 of 6; sample 1: 3 of 6; sample 2: 4 of 6 → 11 of 18.
    let next = vec![0, 1, 2, 3, 1, 0, 2, 2, 2, 0, 0, 0, 1, 0, 1, 0, 3, 3];
    let matches = ids.iter().zip(&next).filter(|(a, b)| a == b).count();
    assert_eq!(matches, 11);
    let data = dataset(ids, next);
    let e = t.evaluate(&data).unwrap();
    assert_eq!(e.samples, 3);
    assert_eq!(e.accuracy, Some(11.0 / 18.0));

    // fit with a learning rate of 0 leaves the weights alone: its epoch accuracy over the
    // first two samples (one step of batch 2) is 7 of 12 tokens.
    let h = t
        .fit(
            &data,
            None,
            &FitOptions {
                shuffle: false,
                verbose: false,
                ..Default::default()
            },
            &mut [],
        )
        .unwrap();
    assert_eq!(h.epochs[0].accuracy, Some(7.0 / 12.0));
}

/// A token model that learns: its accuracies stay fractions in every epoch.
#[test]
fn a_trained_token_model_reports_fractions() {
    let mut t = Trainer::build(&token_model(8, 0.5), &Device::cpu(), 3).unwrap();
    // The next token is the id plus one (mod the vocabulary): learnable by the dense layer.
    let n = 64;
    let ids: Vec<i32> = (0..n * SEQ)
        .map(|i| ((i * 7 + i / 5) % VOCAB) as i32)
        .collect();
    let next: Vec<i32> = ids.iter().map(|&i| (i + 1) % VOCAB as i32).collect();
    let data = dataset(ids, next);
    let h = t
        .fit(
            &data,
            Some(&data),
            &FitOptions {
                epochs: 4,
                verbose: false,
                ..Default::default()
            },
            &mut [],
        )
        .unwrap();
    for e in &h.epochs {
        for a in [e.accuracy.unwrap(), e.val_accuracy.unwrap()] {
            assert!((0.0..=1.0).contains(&a), "accuracy {a} is not a fraction");
        }
    }
    let last = h.epochs.last().unwrap();
    assert!(
        last.val_accuracy.unwrap() > 0.9,
        "the mapping is learnable: {last:?}"
    );
}
