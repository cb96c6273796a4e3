//! ZeRO stage 1 (issue 15) on replicas that are threads of this process: each replica keeps
//! and updates its 1/N of the optimizer state, then the updated weights are gathered. It
//! trains to the weights unsharded data parallelism reaches, its plan holds 1/N of the state,
//! and each replica's checkpoint holds its own shard.

use memwise_plan::data_parallel::{plan_params, replica_states, Sharding};
use memwise_plan::{zoo, ModelSpec, Op, Precision, NO_OFFSET};
use memwise_runtime::collective::{Collective, ThreadGroup, Threads};
use memwise_runtime::data::dataset::InMemory;
use memwise_runtime::train::{FitOptions, Trainer};
use memwise_runtime::Device;

mod support;
use support::replicas::{digits, on_replicas, pixels_only, weights, Weights};

fn options(steps: usize) -> FitOptions {
    FitOptions {
        epochs: 1,
        steps_per_epoch: Some(steps),
        shuffle: false,
        seed: 3,
        verbose: false,
        ..FitOptions::default()
    }
}

/// The largest difference of any tensor over that tensor's largest value, and its name.
fn worst_difference(a: &Weights, b: &Weights) -> (f32, String) {
    let mut worst = (0f32, String::new());
    for ((name, x), (_, y)) in a.iter().zip(b) {
        let scale = x.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
        let d = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max)
            / scale;
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

/// Trains `spec` for 10 steps on `n` replicas with and without ZeRO stage 1: every sharded
/// replica ends with the same weights, within 1e-6 of the unsharded replicas'.
fn check_sharded_equals_unsharded(spec: &ModelSpec, data: &InMemory, n: usize) {
    let spec = spec.with_replicas(n);
    let fit = |_: usize, t: &mut Trainer| {
        let h = t.fit(data, None, &options(10), &mut []).unwrap();
        (weights(t), h.step_losses)
    };
    let plain = on_replicas(&spec, n, fit);
    let sharded_spec = spec.with_sharding(Sharding::OptimizerState);
    let sharded = on_replicas(&sharded_spec, n, fit);
    for r in 1..n {
        assert_eq!(sharded[0].0, sharded[r].0, "replica {r}'s weights drifted");
    }
    assert_eq!(plain[0].1.len(), 10);
    assert_eq!(plain[0].1, sharded[0].1, "the losses differ");
    let (d, name) = worst_difference(&plain[0].0, &sharded[0].0);
    eprintln!(
        "{} ({:?}, {n} replicas): ZeRO stage 1 vs unsharded after 10 steps: largest weight \
         difference {d:e} of its tensor's largest value ({name})",
        spec.name, spec.precision
    );
    assert!(d <= 1e-6, "{name} differs by {d:e}");
}

#[test]
fn zero_stage_1_trains_the_mlp_as_unsharded_data_parallel() {
    check_sharded_equals_unsharded(&zoo::mnist_mlp(128), &digits(1280), 2);
}

#[test]
fn zero_stage_1_trains_the_vae_with_adam_as_unsharded_data_parallel() {
    check_sharded_equals_unsharded(&zoo::conv_vae(16), &pixels_only(160), 2);
}

/// Three replicas: shards that do not divide the parameters evenly (a bias of 10 is 4, 4
/// and 2 elements), and mixed precision, whose 16-bit copies are rebuilt after the gather.
#[test]
fn zero_stage_1_with_uneven_shards_and_16_bit_copies() {
    let mut spec = zoo::mnist_mlp(126);
    spec.precision = Precision::MixedBFloat16;
    check_sharded_equals_unsharded(&spec, &digits(1260), 3);
}

#[test]
fn a_sharded_plan_holds_one_nth_of_the_optimizer_state_and_gathers_after_each_update() {
    for (spec, n) in [
        (zoo::mnist_mlp(4096), 2),
        (zoo::conv_vae(2048), 2),
        (zoo::mnist_mlp(126), 3),
    ] {
        let whole = memwise_plan::plan(&spec.with_replicas(n)).unwrap();
        let sharded_spec = spec
            .with_replicas(n)
            .with_sharding(Sharding::OptimizerState);
        let sharded = memwise_plan::plan(&sharded_spec).unwrap();
        // The planner's formula (from the unsharded plan's parameters) is the sharded
        // plan's own layout, byte for byte.
        let formula = replica_states(
            &plan_params(&whole),
            n as u64,
            Sharding::OptimizerState,
            whole.alignment,
        );
        assert_eq!(sharded.memory.optimizer, formula.optimizer, "{}", spec.name);
        // 1/N of the state, plus less than one alignment per shard: its rounding up to
        // ⌈elems/N⌉ elements and to the alignment.
        let slots = whole.optimizer.state_slots();
        let shards = slots
            * whole
                .params
                .iter()
                .filter(|p| p.grad_offset != NO_OFFSET)
                .count() as u64;
        let exact = slots * 4 * whole.trainable_count / n as u64;
        let padding = sharded.memory.optimizer - exact;
        assert!(
            padding < shards * whole.alignment,
            "{}: {} B for 1/{n} = {exact} B",
            spec.name,
            sharded.memory.optimizer
        );
        eprintln!(
            "{} on {n} replicas: optimizer state {} B unsharded, {} B per replica sharded \
             (1/{n} = {exact} B, padding {padding} B over {shards} shards)",
            spec.name, whole.memory.optimizer, sharded.memory.optimizer
        );
        assert_eq!(sharded.memory.params, whole.memory.params);
        assert_eq!(sharded.memory.grads, whole.memory.grads);
        // Each update step is followed by the gather of the same parameters.
        let steps = &sharded.steps;
        let updates = steps.iter().filter(|s| matches!(s.op, Op::Update)).count();
        assert!(updates > 0);
        for (i, s) in steps.iter().enumerate() {
            if matches!(s.op, Op::Update) {
                let next = &steps[i + 1];
                assert!(
                    matches!(next.op, Op::AllGatherParams { .. }),
                    "{}",
                    spec.name
                );
                assert_eq!(next.params, s.params);
            }
        }
        assert!(!whole
            .steps
            .iter()
            .any(|s| matches!(s.op, Op::AllGatherParams { .. })));
    }
    let e = memwise_plan::plan(
        &zoo::mnist_mlp(128)
            .with_replicas(2)
            .with_sharding(Sharding::Gradients),
    )
    .unwrap_err();
    assert!(e.message.contains("`zero = 2`"), "{}", e.message);
}

/// Each replica saves its own shard; training resumed from the files goes on exactly as
/// the uninterrupted run; a file of another rank, or a save before joining the job, is an
/// error that says why.
#[test]
fn each_replica_checkpoints_its_own_shard_and_resumes_from_it() {
    let spec = zoo::mnist_mlp(128)
        .with_replicas(2)
        .with_sharding(Sharding::OptimizerState);
    let data = digits(1280);
    let dir = std::env::temp_dir().join(format!("memwise-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |r: usize| dir.join(format!("ckpt.rank{r}.safetensors"));
    let straight = on_replicas(&spec, 2, |r, t| {
        t.fit(&data, None, &options(3), &mut []).unwrap();
        t.engine().save_checkpoint(&file(r)).unwrap();
        t.fit(&data, None, &options(3), &mut []).unwrap();
        weights(t)
    });
    let resumed = on_replicas(&spec, 2, |r, t| {
        t.engine_mut().load_checkpoint(&file(r)).unwrap();
        t.fit(&data, None, &options(3), &mut []).unwrap();
        weights(t)
    });
    assert_eq!(straight[0], resumed[0], "resumed training differs");
    assert_eq!(resumed[0], resumed[1]);
    let swapped = on_replicas(&spec, 2, |r, t| {
        t.engine_mut()
            .load_checkpoint(&file(1 - r))
            .unwrap_err()
            .to_string()
    });
    for e in &swapped {
        assert!(e.contains("load each rank's own file"), "{e}");
    }
    assert!(swapped[0].contains("replica 1/2's shard"), "{}", swapped[0]);
    let alone = Trainer::build(&spec, &Device::cpu(), 1).unwrap();
    let e = alone
        .engine()
        .save_checkpoint(&dir.join("alone.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("join the job first"), "{e}");
    // An unsharded model refuses a shard, and the other way round.
    let unsharded = spec.with_sharding(Sharding::Replicated);
    let e = on_replicas(&unsharded, 2, |_, t: &mut Trainer| {
        t.engine_mut()
            .load_checkpoint(&file(0))
            .unwrap_err()
            .to_string()
    });
    assert!(
        e[0].contains("this engine keeps the whole optimizer state"),
        "{}",
        e[0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The collective's all-gather: each rank's shard (uneven ones included) reaches every rank.
#[test]
fn the_all_gather_copies_each_ranks_shard_to_every_rank() {
    let ranks: Vec<Threads> = ThreadGroup::new(3);
    let out: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    // 10 elements of 2 bytes: shards of 4, 4 and 2 elements; each rank's
                    // own shard holds its rank, the rest stale bytes.
                    let mut v = vec![0xEEu8; 20];
                    let shard = memwise_plan::data_parallel::shard_range(10, c.rank(), 3);
                    for b in &mut v[shard.start * 2..shard.end * 2] {
                        *b = c.rank() as u8;
                    }
                    c.all_gather_shards(&mut v, 2).unwrap();
                    v
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<u8> = [vec![0u8; 8], vec![1u8; 8], vec![2u8; 4]].concat();
    for v in out {
        assert_eq!(v, want);
    }
}
