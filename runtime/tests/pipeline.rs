//! Model parallel (issue 16) on stages that are threads of this process
//! (`collective::Threads`): a model split into pipeline stages, each running its own plan
//! (`memwise_plan::stage`) on its own rank with 4 micro-batches, under GPipe and 1F1B, trains
//! to the weights one device reaches at the same global batch — the MLP in 2 stages, a
//! 4-block GPT with dropout in 2 and in 4 (its masks drawn by micro-batch from the
//! counter-based streams), and one stage of 4 micro-batches (gradient accumulation).

use std::collections::BTreeMap;
use std::sync::Arc;

use memwise_plan::pipeline::PipelineSchedule;
use memwise_plan::stage::{plan_stage, Pipeline};
use memwise_plan::zoo::mnist_mlp as mlp;
use memwise_plan::{plan, DType, ModelSpec, Optimizer};
use memwise_runtime::collective::{Collective, ThreadGroup};
use memwise_runtime::executor::{stage_inputs, Batch, Executor};
use memwise_runtime::Device;

const STEPS: u64 = 10;

/// The small GPT under momentum SGD (Adam turns the rounding noise of the attention key
/// bias, whose gradient is zero up to rounding, into full steps: docs/PIPELINE.md).
fn gpt(blocks: usize, batch: usize) -> ModelSpec {
    let mut m = memwise_plan::zoo::small_gpt(blocks, batch);
    m.optimizer = Optimizer::MOMENTUM;
    m
}
const SEED: u64 = 3;

/// One step's whole batch, one owned buffer per model input.
enum Owned {
    U8(Vec<u8>),
    I32(Vec<i32>),
    F32(Vec<f32>),
}

impl Owned {
    fn batch(&self) -> Batch<'_> {
        match self {
            Owned::U8(x) => Batch::U8(x),
            Owned::I32(x) => Batch::I32(x),
            Owned::F32(x) => Batch::F32(x),
        }
    }
}

/// Step `step`'s inputs for `spec`'s one-device plan: a different batch every step.
fn batch_of(spec: &ModelSpec, step: u64) -> Vec<Owned> {
    let p = plan(&spec.one_device()).unwrap();
    let mut state = 0x2545_f491_4f6c_dd1d_u64 ^ step.wrapping_mul(0x9e37_79b9);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (p.inputs.iter())
        .map(|&id| {
            let t = p.tensor(id);
            let n = t.elems();
            match t.dtype {
                DType::U8 => Owned::U8((0..n).map(|_| next() as u8).collect()),
                DType::I32 => Owned::I32((0..n).map(|_| (next() % 10) as i32).collect()),
                _ => Owned::F32(
                    (0..n)
                        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                        .collect(),
                ),
            }
        })
        .collect()
}

type Weights = BTreeMap<String, Vec<f32>>;

fn weights_of(ex: &Executor) -> Weights {
    (ex.plan().params.iter())
        .map(|p| (p.name.to_string(), ex.param(&p.name).unwrap()))
        .collect()
}

/// `spec` trained on one device: its weights before and after, and its losses.
fn one_device(spec: &ModelSpec) -> (Weights, Weights, Vec<f32>) {
    let spec = &spec.one_device();
    let mut ex = Executor::new(plan(spec).unwrap(), &Device::cpu(), SEED).unwrap();
    let start = weights_of(&ex);
    let losses = (0..STEPS)
        .map(|step| {
            let data = batch_of(spec, step);
            let batches: Vec<Batch<'_>> = data.iter().map(Owned::batch).collect();
            ex.train_step(&batches).unwrap().loss
        })
        .collect();
    (start, weights_of(&ex), losses)
}

/// What a pipelined run ends with: every stage's weights (before and after) together, the
/// losses and skipped steps every stage reports (the same on all), and the loss scale.
struct Run {
    start: Weights,
    end: Weights,
    losses: Vec<f32>,
    skipped: Vec<bool>,
    loss_scale: f32,
}

/// `spec` trained split by `pipe`, each stage (of each of `spec.replicas` pipelines) a
/// thread: every stage's weights (before and after) together, and the losses every rank
/// reports (the same on all).
fn pipelined(spec: &ModelSpec, pipe: &Pipeline) -> (Weights, Weights, Vec<f32>) {
    let run = pipelined_run(spec, pipe);
    (run.start, run.end, run.losses)
}

fn pipelined_run(spec: &ModelSpec, pipe: &Pipeline) -> Run {
    let names: Vec<String> = {
        let p = plan(&spec.one_device()).unwrap();
        (p.inputs.iter())
            .map(|&i| p.tensor(i).name.to_string())
            .collect()
    };
    let replicas = spec.replicas.max(1);
    let ranks = ThreadGroup::new(pipe.stages() * replicas);
    let results: Vec<(usize, Run)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (ranks.into_iter().enumerate())
            .map(|(rank, c)| {
                let names = &names;
                let (s, replica) = memwise_plan::stage::stage_of_rank(rank, replicas);
                scope.spawn(move || {
                    let stage = plan_stage(spec, pipe, s).unwrap();
                    let mut ex = Executor::new(stage, &Device::cpu(), SEED).unwrap();
                    ex.set_collective(Arc::new(c) as Arc<dyn Collective>)
                        .unwrap();
                    let start = weights_of(&ex);
                    let model_inputs: Vec<&str> = names.iter().map(String::as_str).collect();
                    let (mut losses, mut skipped) = (Vec::new(), Vec::new());
                    for step in 0..STEPS {
                        let data = batch_of(spec, step);
                        let whole: Vec<Batch<'_>> = data.iter().map(Owned::batch).collect();
                        let mine = stage_inputs(ex.plan(), &model_inputs, &whole, replica).unwrap();
                        let out = ex.train_step(&mine).unwrap();
                        losses.push(out.loss);
                        skipped.push(out.skipped);
                    }
                    let (end, loss_scale) = (weights_of(&ex), ex.loss_scale());
                    let run = Run {
                        start,
                        end,
                        losses,
                        skipped,
                        loss_scale,
                    };
                    (replica, run)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Replica 0's stages; every other replica's stage must hold the same weights, bit for bit.
    let (first, others): (Vec<_>, Vec<_>) = results.into_iter().partition(|(r, _)| *r == 0);
    let mut results = first.into_iter().map(|(_, run)| run);
    let mut all = results.next().unwrap();
    let mut rest: Vec<Run> = results.collect();
    for (replica, run) in others {
        for (name, w) in &run.end {
            let mine = (std::iter::once(&all).chain(&rest)).find_map(|r| r.end.get(name));
            assert!(
                mine == Some(w),
                "replica {replica}'s `{name}` is not replica 0's"
            );
        }
        assert_eq!(
            run.losses, all.losses,
            "replica {replica} reports other losses"
        );
    }
    for run in rest.drain(..) {
        assert_eq!(run.losses, all.losses, "the stages report different losses");
        assert_eq!(
            run.skipped, all.skipped,
            "the stages skipped different steps"
        );
        assert_eq!(
            run.loss_scale, all.loss_scale,
            "the stages' loss scales differ"
        );
        all.start.extend(run.start);
        all.end.extend(run.end);
    }
    all
}

/// The largest difference over the tensor's largest value.
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

/// The largest [`scaled_diff`] between `a`'s tensors and `b`'s of the same names, and its
/// tensor's name.
fn largest_difference<'a>(a: &'a Weights, b: &Weights) -> (f32, &'a str) {
    (a.iter())
        .map(|(name, x)| (scaled_diff(x, &b[name]), name.as_str()))
        .fold((0f32, ""), |m, d| if d.0 > m.0 { d } else { m })
}

fn check(spec: &ModelSpec, boundaries: &[&str], schedule: PipelineSchedule) {
    let (start, end, losses) = one_device(spec);
    let pipe = Pipeline::new(schedule, 4, boundaries);
    let (p_start, p_end, p_losses) = pipelined(spec, &pipe);
    // Each stage starts from the one-device model's initial weights (keyed by the model's
    // parameter index, whatever the stage holds) and the stages hold every parameter once.
    assert!(
        p_start == start,
        "the stages' initial weights are not one device's"
    );
    assert_eq!(p_end.len(), end.len());
    let (mut worst, mut which) = (0f32, String::new());
    for (name, a) in &end {
        let d = scaled_diff(a, &p_end[name]);
        if d > worst {
            (worst, which) = (d, name.clone());
        }
    }
    let loss_gap = (losses.iter().zip(&p_losses))
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
        .fold(0f32, f32::max);
    eprintln!(
        "{} in {} stages × {} replicas, 4 micro-batches, {}: after {STEPS} steps the \
         largest weight difference from one device is {worst:e} of its tensor's largest value \
         ({which}); losses within {loss_gap:e}",
        spec.name,
        pipe.stages(),
        spec.replicas,
        schedule.name()
    );
    assert!(worst <= 1e-5, "{which} differs by {worst:e}");
    assert!(loss_gap <= 1e-5, "losses {losses:?} vs {p_losses:?}");
}

#[test]
fn the_mlp_in_two_stages_trains_as_one_device() {
    for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
        check(&mlp(64), &["logits"], schedule);
    }
}

#[test]
fn a_gpt_in_two_and_four_stages_trains_as_one_device_dropout_included() {
    let spec = gpt(4, 8);
    for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
        check(&spec, &["b2_ln1"], schedule);
        check(&spec, &["b1_ln1", "b2_ln1", "b3_ln1"], schedule);
    }
}

/// Data parallelism composes with stages, a replica being a whole pipeline: the MLP and
/// the 4-block GPT (dropout included) in 2 stages × 2 replicas, 4 ranks, each replica's
/// 4 micro-batches its half of the global batch, train to one device's weights.
#[test]
fn replicated_pipelines_train_as_one_device() {
    for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
        check(&mlp(64).with_replicas(2), &["logits"], schedule);
        check(&gpt(4, 8).with_replicas(2), &["b2_ln1"], schedule);
    }
}

#[test]
fn one_stage_of_four_micro_batches_is_gradient_accumulation() {
    check(&gpt(2, 8), &[], PipelineSchedule::OneFOneB);
}

/// A stage that stops mid-training (its rank gone after 2 steps): the other stage's next
/// step is an `Err` that says so, at once, not a hang.
#[test]
fn a_stage_that_leaves_ends_the_others_step_with_an_error() {
    let spec = mlp(64);
    let pipe = Pipeline::new(PipelineSchedule::OneFOneB, 4, &["logits"]);
    let names: Vec<String> = {
        let p = plan(&spec).unwrap();
        (p.inputs.iter())
            .map(|&i| p.tensor(i).name.to_string())
            .collect()
    };
    let ranks = ThreadGroup::with_timeout(2, std::time::Duration::from_secs(30));
    let outcomes: Vec<Result<u64, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (ranks.into_iter().enumerate())
            .map(|(s, c)| {
                let (spec, pipe, names) = (&spec, &pipe, &names);
                scope.spawn(move || {
                    let stage = plan_stage(spec, pipe, s).unwrap();
                    let mut ex = Executor::new(stage, &Device::cpu(), SEED).unwrap();
                    ex.set_collective(Arc::new(c) as Arc<dyn Collective>)
                        .unwrap();
                    let model_inputs: Vec<&str> = names.iter().map(String::as_str).collect();
                    let last = if s == 1 { 2 } else { STEPS };
                    for step in 0..last {
                        let data = batch_of(spec, step);
                        let whole: Vec<Batch<'_>> = data.iter().map(Owned::batch).collect();
                        let mine = stage_inputs(ex.plan(), &model_inputs, &whole, 0).unwrap();
                        if let Err(e) = ex.train_step(&mine) {
                            return Err(e.to_string());
                        }
                    }
                    Ok(last)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(outcomes[1], Ok(2));
    let err = outcomes[0].as_ref().unwrap_err();
    eprintln!("stage 0 after stage 1 left: {err}");
    assert!(err.contains("rank 1"), "{err}");
}

/// `StageTrainer` on the bundled digits, alone and over 2 replicas: every rank trains the
/// same steps to the same losses, and its report says which stage of which replica it is and
/// counts its estimate as its plan plus the host bytes beside it (with replicas, its
/// gradient sums' buffers too).
#[test]
fn stage_trainers_report_their_stage_and_estimate() {
    let alone = stage_reports(1);
    let replicated = stage_reports(2);
    let host = |r: &serde_json::Value| {
        r["estimate"]["total"].as_u64().unwrap() - r["estimate"]["plan_total"].as_u64().unwrap()
    };
    // Rank k of the replicated job is stage k / 2: its sums hold the threads' copies.
    for (k, r) in replicated.iter().enumerate() {
        assert!(host(r) > host(&alone[k / 2]), "rank {k}");
    }
}

/// Every rank's report after 3 steps of the MLP in 2 stages × `replicas`.
fn stage_reports(replicas: usize) -> Vec<serde_json::Value> {
    use memwise_runtime::data::dataset::InMemory;
    use memwise_runtime::data::idx::load_bundled_digits;
    use memwise_runtime::stage::StageTrainer;
    let mut spec = mlp(32).with_replicas(replicas);
    spec.pipeline = Some(Pipeline::new(PipelineSchedule::GPipe, 2, &["logits"]));
    let (train, _) = load_bundled_digits().unwrap();
    let data = InMemory::mnist(&train);
    let reports: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = (ThreadGroup::new(2 * replicas).into_iter())
            .map(|c| {
                let (spec, data) = (&spec, &data);
                scope.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let mut t = StageTrainer::build(spec, &Device::cpu(), SEED, c).unwrap();
                    let losses = t.train_steps(data, 3).unwrap();
                    let r = t.report(&Device::cpu(), &losses, Some(1 << 20));
                    assert_eq!(
                        r["estimate"]["total"],
                        t.plan().memory.total + t.host_bytes()
                    );
                    assert_eq!(r["estimate"]["plan_total"], t.plan().memory.total);
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (k, r) in reports.iter().enumerate() {
        assert_eq!(r["stage"], (k / replicas) as u64);
        assert_eq!(r["replica"], (k % replicas) as u64);
        assert_eq!(r["replicas"], replicas as u64);
        assert_eq!(r["stages"], 2);
        assert_eq!(r["micro_batches"], 2);
        assert_eq!(r["schedule"], "gpipe");
        assert_eq!(r["batch"], 32);
        assert_eq!(r["steps"], 3);
        assert_eq!(r["measured"]["peak_rss_growth_bytes"], 1 << 20);
        assert!(r["loss"][0].as_f64().unwrap().is_finite());
        assert_eq!(r["loss"], reports[0]["loss"]);
    }
    reports
}

/// Dynamic loss scaling across stages: the VAE in float16 (its reconstruction loss weighted
/// so that the first scales overflow float16 and steps are skipped), in 2 stages of 4
/// micro-batches, skips the same steps with the same loss scale on every stage as one device
/// accumulating the same 4 micro-batches, and ends at the same weights; and so it does over
/// 2 replicas of the pipeline. Each stage checks its own gradients (summed over its
/// replicas) and the stages then agree (`memwise_plan::stage`'s flag sum).
#[test]
fn float16_stages_skip_the_steps_one_device_skips_with_its_loss_scale() {
    let mut spec = memwise_plan::zoo::conv_vae(32);
    spec.precision = memwise_plan::Precision::MixedFloat16;
    // Weighted up so that the first scales overflow float16 (4 of the 10 steps skip).
    spec.loss[0].weight = 2000.0;
    let split = Pipeline::new(PipelineSchedule::OneFOneB, 4, &["dec_dense"]);
    let whole = Pipeline::new(PipelineSchedule::OneFOneB, 4, &[]);
    let (two, one) = (pipelined_run(&spec, &split), pipelined_run(&spec, &whole));
    let skips = one.skipped.iter().filter(|&&s| s).count();
    eprintln!(
        "float16 VAE: {skips} of {STEPS} steps skipped, loss scale now {}",
        one.loss_scale
    );
    assert!(skips > 0 && skips < STEPS as usize, "{:?}", one.skipped);
    assert_eq!(two.skipped, one.skipped);
    assert_eq!(two.loss_scale, one.loss_scale);
    assert!(two.start == one.start);
    let worst = largest_difference(&one.end, &two.end);
    eprintln!(
        "float16 VAE in 2 stages: largest weight difference {:e} ({})",
        worst.0, worst.1
    );
    assert!(worst.0 <= 1e-5, "{} differs by {:e}", worst.1, worst.0);
    // Over 2 replicas of the 2 stages (4 ranks) every rank settles the same flag: the same
    // steps skipped, the same weights. Under momentum SGD: each replica sums its own half's
    // micro-batches first, and Adam would turn that rounding, on the decoder's dense bias
    // whose gradient is zero but for rounding, into full steps (as docs/PIPELINE.md says of
    // the GPT's attention key bias).
    spec.optimizer = memwise_plan::Optimizer::MOMENTUM;
    let one = pipelined_run(&spec, &whole);
    let four = pipelined_run(&spec.with_replicas(2), &split);
    assert!(one.skipped.iter().any(|&s| s), "{:?}", one.skipped);
    assert_eq!(four.skipped, one.skipped);
    assert_eq!(four.loss_scale, one.loss_scale);
    let worst = largest_difference(&one.end, &four.end);
    eprintln!(
        "float16 VAE in 2 stages × 2 replicas: largest weight difference {:e} ({})",
        worst.0, worst.1
    );
    assert!(worst.0 <= 1e-5, "{} differs by {:e}", worst.1, worst.0);
}

/// Checkpointing composes with stages: the 4-block GPT with every block a checkpoint
/// segment, split in 2 stages between blocks, trains under both schedules to the weights the
/// same checkpointed model reaches on one device, and each stage holds less than without.
#[test]
fn checkpointed_blocks_in_stages_train_as_one_device_and_hold_less() {
    let block = |n: &str| {
        (n.starts_with('b') && n.contains('_')).then(|| n.split('_').next().unwrap_or(n).into())
    };
    let mut spec = gpt(4, 8);
    let plain = spec.clone();
    memwise_plan::zoo::checkpoint_blocks(&mut spec, block);
    assert!(spec.layers.iter().any(|l| l.checkpoint.is_some()));
    for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
        check(&spec, &["b2_ln1"], schedule);
        let pipe = Pipeline::new(schedule, 4, &["b2_ln1"]);
        for s in 0..2 {
            let (with, without) = (
                plan_stage(&spec, &pipe, s).unwrap(),
                plan_stage(&plain, &pipe, s).unwrap(),
            );
            eprintln!(
                "GPT stage {s} ({}): activations peak {} B checkpointed, {} B without",
                schedule.name(),
                with.memory.activations_peak,
                without.memory.activations_peak
            );
            assert!(with.memory.activations_peak < without.memory.activations_peak);
            assert!(with
                .steps
                .iter()
                .any(|st| st.phase == memwise_plan::Phase::Recompute));
        }
    }
}

/// `StageTrainer::fit` trains a split model as `Trainer::fit` trains it on one device: the
/// MLP in 2 stages, 2 epochs reshuffled from the same seed (40 steps of 32 of the bundled
/// digits), ends at one device's weights with its losses, and every stage logs each epoch.
#[test]
fn stage_fit_reshuffles_as_one_device_fit_and_ends_at_its_weights() {
    use memwise_runtime::data::dataset::InMemory;
    use memwise_runtime::data::idx::load_bundled_digits;
    use memwise_runtime::train::{FitOptions, Trainer};
    let spec = mlp(32);
    let (train, _) = load_bundled_digits().unwrap();
    let data = InMemory::mnist(&train);
    let opts = FitOptions {
        epochs: 2,
        seed: 7,
        steps_per_epoch: Some(20),
        verbose: false,
        ..Default::default()
    };
    let mut one = Trainer::build(&spec, &Device::cpu(), SEED).unwrap();
    let history = one.fit(&data, None, &opts, &mut []).unwrap();
    let names: Vec<String> = (one.plan().params.iter())
        .map(|p| p.name.to_string())
        .collect();
    assert_eq!(history.step_losses.len(), 40);
    for replicas in [1, 2] {
        let mut split = spec.with_replicas(replicas);
        split.pipeline = Some(Pipeline::new(PipelineSchedule::OneFOneB, 4, &["logits"]));
        let worst = fit_stages(&split, &data, &opts, (&one, &history.step_losses), &names);
        eprintln!(
            "MLP fit in 2 stages × {replicas} replicas vs one device, 2 epochs: largest weight \
             difference {worst:e}"
        );
        assert!(worst <= 1e-5, "{worst:e}");
    }
}

/// `split` fit on its stages (× its replicas) as threads: every rank's losses checked
/// against one device's (`losses`), the stages holding `names` once per replica; the largest
/// weight difference from `one`'s.
fn fit_stages(
    split: &ModelSpec,
    data: &memwise_runtime::data::dataset::InMemory,
    opts: &memwise_runtime::train::FitOptions,
    (one, history): (&memwise_runtime::train::Trainer, &[f32]),
    names: &[String],
) -> f32 {
    use memwise_runtime::stage::StageTrainer;
    let ranks = 2 * split.replicas;
    let stages: Vec<(Weights, Vec<f32>, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (ThreadGroup::new(ranks).into_iter())
            .map(|c| {
                let (split, data, opts) = (split, data, opts);
                scope.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let mut t = StageTrainer::build(split, &Device::cpu(), SEED, c).unwrap();
                    let h = t.fit(data, None, opts).unwrap();
                    let w: Weights = (t.plan().params.iter())
                        .map(|p| (p.name.to_string(), t.engine().param(&p.name).unwrap()))
                        .collect();
                    (w, h.step_losses, h.epochs.len())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut worst = 0f32;
    for (w, losses, epochs) in &stages {
        assert_eq!(*epochs, 2);
        assert_eq!(losses.len(), 40);
        for (a, b) in losses.iter().zip(history) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        for (name, v) in w {
            worst = worst.max(scaled_diff(&one.engine().param(name).unwrap(), v));
        }
    }
    let held: usize = stages.iter().map(|s| s.0.len()).sum();
    assert_eq!(held, names.len() * split.replicas);
    worst
}

/// What one pass over held-out samples gives: per epoch of `fit` its training accuracy, its
/// validation loss and accuracy; then `evaluate`'s loss and accuracy, and `predict`'s values.
#[derive(Debug)]
struct HeldOut {
    epochs: Vec<(Option<f32>, Option<f32>, Option<f32>)>,
    loss: f32,
    accuracy: Option<f32>,
    predictions: Vec<f32>,
}

/// `spec` fit on `train` with `validation` on one device, then evaluated and predicted on it.
fn held_out_on_one_device(
    spec: &ModelSpec,
    train: &memwise_runtime::data::dataset::InMemory,
    validation: &memwise_runtime::data::dataset::InMemory,
    opts: &memwise_runtime::train::FitOptions,
) -> HeldOut {
    use memwise_runtime::train::Trainer;
    let mut t = Trainer::build(&spec.one_device(), &Device::cpu(), SEED).unwrap();
    let h = t.fit(train, Some(validation), opts, &mut []).unwrap();
    let e = t.evaluate(validation).unwrap();
    HeldOut::of(&h, &e, t.predict(validation).unwrap())
}

impl HeldOut {
    fn of(
        h: &memwise_runtime::train::History,
        e: &memwise_runtime::train::Evaluation,
        predictions: Vec<f32>,
    ) -> HeldOut {
        HeldOut {
            epochs: (h.epochs.iter())
                .map(|l| (l.accuracy, l.val_loss, l.val_accuracy))
                .collect(),
            loss: e.loss,
            accuracy: e.accuracy,
            predictions,
        }
    }
}

/// The same on `split`'s stages (× its replicas) as threads: every rank's figures.
fn held_out_on_stages(
    split: &ModelSpec,
    train: &memwise_runtime::data::dataset::InMemory,
    validation: &memwise_runtime::data::dataset::InMemory,
    opts: &memwise_runtime::train::FitOptions,
) -> Vec<HeldOut> {
    use memwise_runtime::stage::StageTrainer;
    let stages = split.pipeline.as_ref().unwrap().stages();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (ThreadGroup::new(stages * split.replicas.max(1)).into_iter())
            .map(|c| {
                scope.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let mut t = StageTrainer::build(split, &Device::cpu(), SEED, c).unwrap();
                    let h = t.fit(train, Some(validation), opts).unwrap();
                    let e = t.evaluate(validation).unwrap();
                    HeldOut::of(&h, &e, t.predict(validation).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two figures that are both absent, or both present and within `tol` of each other
/// relative to the larger (at least 1).
fn close(a: Option<f32>, b: Option<f32>, tol: f32) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0),
        _ => false,
    }
}

/// A split model validates, evaluates and predicts as one device does: the MLP in 2 stages
/// (alone and over 2 replicas), a classifier whose accuracy is scored on the last stage, and
/// the VAE in 2 stages, whose KL term is the encoder stage's and whose reconstruction and
/// prediction are the decoder's, in 3, whose middle stage relays the encoder's output, and
/// in mixed float16. Each is fit for 2 epochs validating on held-out digits whose
/// count is no multiple of the batch (a smaller tail, split unevenly over 2 replicas), then
/// evaluated and predicted; every rank returns one device's figures.
#[test]
fn split_models_validate_evaluate_and_predict_as_one_device() {
    use memwise_runtime::data::dataset::{Dataset, InMemory};
    use memwise_runtime::data::idx::load_bundled_digits;
    use memwise_runtime::train::FitOptions;
    let (train, test) = load_bundled_digits().unwrap();
    let opts = FitOptions {
        epochs: 2,
        seed: 11,
        steps_per_epoch: Some(3),
        verbose: false,
        ..Default::default()
    };
    let digits = (InMemory::mnist(&train), InMemory::mnist(&test));
    let images = (
        InMemory::mnist_images(&train),
        InMemory::mnist_images(&test),
    );
    // 75 held-out digits: 2 batches of 32 and a tail of 11 (5 and 6 over 2 replicas).
    let held = |d: &InMemory| d.validation_split(75.0 / 2000.0).1;
    let vae = memwise_plan::zoo::conv_vae(32);
    let mut vae16 = vae.clone();
    vae16.precision = memwise_plan::Precision::MixedFloat16;
    let cases: [(&str, ModelSpec, &[&str], usize, _); 5] = [
        ("MLP", mlp(32), &["logits"], 1, &digits),
        ("MLP", mlp(32), &["logits"], 2, &digits),
        ("VAE", vae.clone(), &["dec_dense"], 1, &images),
        // Three stages: the middle one relays the encoder's output to the decoder.
        ("VAE", vae, &["enc_flatten", "dec_dense"], 1, &images),
        // Mixed precision: float16 activations cross between the stages.
        ("float16 VAE", vae16, &["dec_dense"], 1, &images),
    ];
    for (name, spec, boundaries, replicas, (train, test)) in cases {
        let validation = held(test);
        assert_eq!(validation.len(), 75);
        let one = held_out_on_one_device(&spec, train, &validation, &opts);
        let mut split = spec.with_replicas(replicas);
        split.pipeline = Some(Pipeline::new(PipelineSchedule::OneFOneB, 4, boundaries));
        let stages = boundaries.len() + 1;
        for (rank, got) in held_out_on_stages(&split, train, &validation, &opts)
            .iter()
            .enumerate()
        {
            let worst = scaled_diff(&one.predictions, &got.predictions);
            eprintln!(
                "{name} in {stages} stages × {replicas} replicas, rank {rank}: evaluate loss {} vs {} \
                 on one device, accuracy {:?} vs {:?}, predictions within {worst:e}",
                got.loss, one.loss, got.accuracy, one.accuracy
            );
            assert!(close(Some(got.loss), Some(one.loss), 1e-5), "{got:?}");
            assert!(close(got.accuracy, one.accuracy, 1e-6), "{got:?}");
            assert_eq!(got.predictions.len(), one.predictions.len());
            // The stages' weights differ from one device's by the rounding of their
            // micro-batches' sums; a float16 prediction made from them may round to its
            // neighbour, one float16 step (2^-11 of its value) away. (From the same weights,
            // before any step, the stages' float16 predictions are one device's bit for bit.)
            let float16 = split.precision == memwise_plan::Precision::MixedFloat16;
            let tolerance = if float16 { 2f32.powi(-10) } else { 1e-5 };
            assert!(worst <= tolerance, "{worst:e}");
            assert_eq!(got.epochs.len(), 2);
            for (g, o) in got.epochs.iter().zip(&one.epochs) {
                assert!(close(g.0, o.0, 1e-6), "training accuracy {g:?} vs {o:?}");
                assert!(close(g.1, o.1, 1e-5), "validation loss {g:?} vs {o:?}");
                assert!(close(g.2, o.2, 1e-6), "validation accuracy {g:?} vs {o:?}");
            }
        }
    }
}

/// Runs `each` on every rank of `split`'s stages (× its replicas) as threads, each with a
/// `StageTrainer` built from `seed`; every rank's result, rank 0 first.
fn on_stages<T: Send>(
    split: &ModelSpec,
    seed: u64,
    each: impl Fn(&mut memwise_runtime::stage::StageTrainer) -> T + Sync,
) -> Vec<T> {
    use memwise_runtime::stage::StageTrainer;
    let ranks = split.pipeline.as_ref().unwrap().stages() * split.replicas.max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (ThreadGroup::new(ranks).into_iter())
            .map(|c| {
                let each = &each;
                scope.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    each(&mut StageTrainer::build(split, &Device::cpu(), seed, c).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A stage's weights by name.
fn stage_weights(t: &memwise_runtime::stage::StageTrainer) -> Weights {
    (t.plan().params.iter())
        .map(|p| (p.name.to_string(), t.engine().param(&p.name).unwrap()))
        .collect()
}

/// A split model resumes exactly: the MLP under Adam in 2 stages, alone and over 2
/// replicas, trained 4 steps on the bundled digits and checkpointed (`PREFIX.stage<k>`, from
/// replica 0), then restored into fresh stages built from another seed and trained 3 more,
/// gives every loss and every weight bit for bit of 7 uninterrupted steps. A checkpoint whose
/// stage files are of different steps, or that lacks a stage's file, is refused on every rank,
/// and every stage keeps the state it had.
#[test]
fn a_split_model_resumes_from_its_stages_checkpoint_bit_for_bit() {
    use memwise_runtime::data::dataset::InMemory;
    use memwise_runtime::data::idx::load_bundled_digits;
    use memwise_runtime::stage::stage_checkpoint_path;
    let (train, _) = load_bundled_digits().unwrap();
    let data = InMemory::mnist(&train);
    let dir = std::env::temp_dir().join(format!("memwise-stage-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for replicas in [1, 2] {
        let mut split = mlp(32).with_replicas(replicas);
        // Adam: its bias correction counts the updates, which the checkpoint must carry.
        split.optimizer = Optimizer::ADAM;
        split.pipeline = Some(Pipeline::new(PipelineSchedule::OneFOneB, 4, &["logits"]));
        let at = |name: &str| dir.join(format!("{name}.{replicas}"));
        let whole = on_stages(&split, SEED, |t| {
            (t.train_steps(&data, 7).unwrap(), stage_weights(t))
        });
        // Checkpoints after 4 steps and (for the mixed one) after 6.
        on_stages(&split, SEED, |t| {
            t.train_steps(&data, 4).unwrap();
            t.save_checkpoint(&at("four")).unwrap();
            t.train_steps(&data, 2).unwrap();
            t.save_checkpoint(&at("six")).unwrap();
        });
        let resumed = on_stages(&split, SEED + 1, |t| {
            t.load_checkpoint(&at("four")).unwrap();
            (t.train_steps(&data, 3).unwrap(), stage_weights(t))
        });
        for (rank, (w, r)) in whole.iter().zip(&resumed).enumerate() {
            assert_eq!(
                w.0[4..],
                r.0[..],
                "replicas {replicas}, rank {rank}: losses"
            );
            assert!(
                w.1 == r.1,
                "replicas {replicas}, rank {rank}: weights differ"
            );
        }
        // Stage 0 of step 4 beside stage 1 of step 6; and a checkpoint without stage 1.
        std::fs::copy(
            stage_checkpoint_path(&at("four"), 0),
            stage_checkpoint_path(&at("mixed"), 0),
        )
        .unwrap();
        std::fs::copy(
            stage_checkpoint_path(&at("six"), 1),
            stage_checkpoint_path(&at("mixed"), 1),
        )
        .unwrap();
        std::fs::copy(
            stage_checkpoint_path(&at("four"), 0),
            stage_checkpoint_path(&at("torn"), 0),
        )
        .unwrap();
        for (bad, says) in [
            ("mixed", "of different checkpoints"),
            ("torn", "No such file"),
        ] {
            let refused = on_stages(&split, SEED + 1, |t| {
                let before = stage_weights(t);
                let err = t.load_checkpoint(&at(bad)).unwrap_err().to_string();
                let kept = stage_weights(t) == before && t.engine().step_counter() == 0;
                (err, kept)
            });
            assert!(
                refused.iter().all(|(_, kept)| *kept),
                "{bad}: a stage changed"
            );
            let errors: Vec<&str> = refused.iter().map(|(e, _)| e.as_str()).collect();
            eprintln!("{bad} checkpoint, {replicas} replicas: {errors:?}");
            assert!(errors.iter().any(|e| e.contains(says)), "{bad}: {errors:?}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
