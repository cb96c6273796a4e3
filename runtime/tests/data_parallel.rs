//! Data parallelism (issue 15) on replicas that are threads of this process
//! (`collective::Threads`): two replicas at a global batch train to the same weights as one
//! device at that batch, through `Trainer::fit`'s distributed sampler, the plan's gradient
//! sums and the replicas' random streams.

use std::sync::Arc;

use memwise_plan::{zoo, ModelSpec, Op};
use memwise_runtime::collective::{Collective, ThreadGroup};
use memwise_runtime::data::dataset::{Column, Dataset, InMemory};
use memwise_runtime::train::{Evaluation, FitOptions, Trainer};
use memwise_runtime::Device;

mod support;
use support::replicas::{digits, on_replicas, pixels_only, weights, Weights};

fn options() -> FitOptions {
    FitOptions {
        epochs: 2,
        steps_per_epoch: Some(5),
        shuffle: true,
        seed: 11,
        verbose: false,
        ..FitOptions::default()
    }
}

/// What one training ran to: its weights and its per-step losses.
type Trained = (Weights, Vec<f32>);

/// `spec` trained by `fit` on one device: its weights and per-step losses.
fn one_device(spec: &ModelSpec, data: &InMemory) -> Trained {
    let mut t = Trainer::build(spec, &Device::cpu(), 5).unwrap();
    let h = t.fit(data, None, &options(), &mut []).unwrap();
    (weights(&t), h.step_losses)
}

/// `spec` trained by `fit` on `n` replicas (threads): every rank's weights and losses.
fn replicas(spec: &ModelSpec, data: &InMemory, n: usize) -> Vec<Trained> {
    let spec = spec.with_replicas(n);
    on_replicas(&spec, n, |_, t| {
        // Different seeds (`on_replicas`): rank 0's weights must reach the others.
        assert_eq!(t.plan().batch * n, spec.batch);
        let h = t.fit(data, None, &options(), &mut []).unwrap();
        (weights(t), h.step_losses)
    })
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

/// The largest difference over the tensor's largest value: how far apart two trainings
/// are at the tensor's own scale (an element near zero, which Adam's step moves by the
/// learning rate whatever its gradient's last bits, does not dominate it).
fn scaled_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Trains `spec` on one device and on 2 replicas and compares: the replicas' weights are
/// bit-identical to each other and within `tol` of one device's, as are the losses.
fn check_equivalent(spec: &ModelSpec, data: &InMemory, tol: f32) {
    let (single, single_losses) = one_device(spec, data);
    let ranks = replicas(spec, data, 2);
    assert_eq!(
        ranks[0].0, ranks[1].0,
        "the replicas' weights drifted apart"
    );
    assert_eq!(
        ranks[0].1, ranks[1].1,
        "the replicas report different losses"
    );
    assert_eq!(single_losses.len(), 10);
    let d = max_rel_diff(&single_losses, &ranks[0].1);
    assert!(
        d <= tol,
        "losses differ by {d:e}: {single_losses:?} vs {:?}",
        ranks[0].1
    );
    let (mut worst, mut elementwise) = ((0f32, String::new()), 0f32);
    for ((name, a), (_, b)) in single.iter().zip(&ranks[0].0) {
        let d = scaled_diff(a, b);
        if d > worst.0 {
            worst = (d, name.clone());
        }
        elementwise = elementwise.max(max_rel_diff(a, b));
    }
    eprintln!(
        "{}: 2 replicas vs one device after 10 steps: largest weight difference {:e} of its \
         tensor's largest value ({}); elementwise relative {:e}",
        spec.name, worst.0, worst.1, elementwise
    );
    assert!(worst.0 <= tol, "{} differs by {:e}", worst.1, worst.0);
}

#[test]
fn two_replicas_train_the_mlp_as_one_device_at_the_global_batch() {
    // 1,317 samples: 10 global batches of 128 and an uneven tail the sampler leaves out.
    check_equivalent(&zoo::mnist_mlp(128), &digits(1317), 1e-5);
}

#[test]
fn two_replicas_train_the_vae_as_one_device_including_its_sampling() {
    // The VAE draws its latent noise: each replica draws its own samples' share of the
    // one device's stream.
    check_equivalent(&zoo::conv_vae(16), &pixels_only(170), 1e-5);
}

/// `evaluate` and `predict` on replicas: each rank evaluates and predicts its share of the
/// samples (an uneven split of 1,001 samples, with partial batches) and every rank returns
/// the whole set's figures and every sample's prediction, those one device gets with the same
/// weights.
#[test]
fn evaluate_and_predict_on_replicas_return_the_whole_sets_results() {
    let (train, held_out) = (digits(640), digits(1001));
    let spec = zoo::mnist_mlp(128).with_replicas(2);
    let results: Vec<(Weights, Evaluation, Vec<f32>)> = on_replicas(&spec, 2, |_, t| {
        t.fit(&train, None, &options(), &mut []).unwrap();
        let e = t.evaluate(&held_out).unwrap();
        (weights(t), e, t.predict(&held_out).unwrap())
    });
    let mut one = Trainer::build(&zoo::mnist_mlp(128), &Device::cpu(), 7).unwrap();
    for (name, values) in &results[0].0 {
        one.engine_mut().set_param(name, values).unwrap();
    }
    let whole = one.evaluate(&held_out).unwrap();
    let predictions = one.predict(&held_out).unwrap();
    assert_eq!(predictions.len(), 1001 * 10);
    for (_, _, p) in &results {
        // The same rows through GEMMs of other heights: equal to rounding.
        let worst = p
            .iter()
            .zip(&predictions)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "predictions differ by {worst:e}");
    }
    assert_eq!(results[0].2, results[1].2, "the ranks' predictions");
    for (_, e, _) in &results {
        assert_eq!(e.samples, 1001);
        assert_eq!(e.accuracy, whole.accuracy, "accuracy over the ranks");
        let d = (e.loss - whole.loss).abs() / whole.loss;
        assert!(
            d < 1e-6,
            "loss {} on the ranks vs {} on one device",
            e.loss,
            whole.loss
        );
    }
    assert_eq!(results[0].1.loss, results[1].1.loss, "the ranks' losses");
}

#[test]
fn a_replica_plan_is_one_share_of_the_batch_with_gradient_sums() {
    let one = memwise_plan::plan(&zoo::mnist_mlp(128)).unwrap();
    let two = memwise_plan::plan(&zoo::mnist_mlp(128).with_replicas(2)).unwrap();
    assert_eq!((two.batch, two.replicas), (64, 2));
    let sums: Vec<_> = two
        .steps
        .iter()
        .filter_map(|s| match s.op {
            Op::AllReduceGradients { bytes, last } => Some((bytes, last, s.params.len())),
            _ => None,
        })
        .collect();
    // 407,050 f32 gradients fit one 25 MiB bucket, after the last backward step.
    assert_eq!(sums, vec![(407_050 * 4, true, 4)]);
    assert!(!one
        .steps
        .iter()
        .any(|s| matches!(s.op, Op::AllReduceGradients { .. })));
    // Same parameters and optimizer state; the activations of half the batch.
    assert_eq!(two.memory.params, one.memory.params);
    assert_eq!(two.memory.optimizer, one.memory.optimizer);
    assert!(two.memory.activations_peak < one.memory.activations_peak);
    let e = memwise_plan::plan(&zoo::mnist_mlp(100).with_replicas(3)).unwrap_err();
    assert!(
        e.message.contains("does not split evenly over 3 replicas"),
        "{}",
        e.message
    );
    assert!(
        e.message.contains("`batch = 99` or `batch = 102`"),
        "{}",
        e.message
    );
}

#[test]
fn a_replica_without_its_job_or_with_the_wrong_one_is_an_error() {
    let spec = zoo::mnist_mlp(128).with_replicas(2);
    let mut t = Trainer::build(&spec, &Device::cpu(), 1).unwrap();
    let e = t
        .fit(&digits(256), None, &options(), &mut [])
        .unwrap_err()
        .to_string();
    assert!(e.contains("set_collective"), "{e}");
    let three = ThreadGroup::new(3).pop().unwrap();
    let e = t
        .set_data_parallel(Arc::new(three) as Arc<dyn Collective>)
        .unwrap_err()
        .to_string();
    assert!(e.contains("one of 2 data-parallel replicas"), "{e}");
}

#[test]
fn a_replica_that_fails_stops_the_other_with_an_error_not_a_hang() {
    let spec = zoo::mnist_mlp(128).with_replicas(2);
    let good = digits(256);
    // Rank 1's dataset has a label out of range in its first batch: it fails before its
    // first gradient sum and leaves the job; rank 0 must not wait for it.
    let bad = InMemory::new(vec![
        good.columns()[0].clone(),
        Column::I32 {
            data: vec![99; 256],
            per_sample: 1,
        },
    ])
    .unwrap();
    let ranks = ThreadGroup::new(2);
    let t0 = std::time::Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .zip([&good, &bad])
            .map(|(c, data)| {
                let spec = spec.clone();
                s.spawn(move || {
                    let mut t = Trainer::build(&spec, &Device::cpu(), 5).unwrap();
                    t.set_data_parallel(Arc::new(c) as Arc<dyn Collective>)
                        .unwrap();
                    let opts = FitOptions {
                        shuffle: false,
                        ..options()
                    };
                    let e = t.fit(data, None, &opts, &mut []).unwrap_err();
                    e.to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errors[1].contains("label"), "{}", errors[1]);
    assert!(
        errors[0].contains("rank 1 has left the job"),
        "{}",
        errors[0]
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(60));
}
