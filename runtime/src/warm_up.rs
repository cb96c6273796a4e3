//! The runtime's one-time costs in a process, paid once before the first model's memory is
//! measured: rayon's worker threads and their stacks, the CPU GEMM library's per-thread
//! cache slabs, and the pages of the kernels' code, which the kernel maps into memory the
//! first time each kernel runs.
//!
//! When the warm-up runs on the process's main thread, that thread also becomes one of the
//! pool's workers ([`main_thread_joins_pool`]), so that the kernels a step runs from it share
//! the cores with one other thread and not with two.
//!
//! None of these belongs to a model: a second model in the same process pays none of them.
//! Left to the first model, they showed as 1.3–3.3 MiB of resident growth its plan cannot
//! know (+16 % to +60 % on a small model). So [`warm_up`] pays them once, by training one
//! step of tiny models that run every kind of kernel in every precision, and says what that
//! cost; `Trainer` calls it before it takes a model's memory baseline.

use std::sync::OnceLock;
use std::time::Instant;

use memwise_plan::{
    plan, plan_inference, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer,
    Padding, Precision, Reduction,
};

use crate::device::Device;
use crate::executor::Executor;
use crate::monitor::rss;
use crate::reference::{batches, random_inputs};

/// What the warm-up cost the process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmUp {
    /// Resident growth over the warm-up (code pages, thread stacks, GEMM slabs), in bytes;
    /// 0 where /proc cannot be read.
    pub resident_bytes: u64,
    pub seconds: f64,
    /// Whether the thread that warmed up (the process's main thread) became one of rayon's
    /// workers ([`main_thread_joins_pool`]).
    pub main_thread_in_pool: bool,
}

static WARM: OnceLock<WarmUp> = OnceLock::new();

/// Pays the runtime's one-time costs for `device`, once per process (later calls return the
/// first call's figures at once). The CPU side always runs: every device's trainer runs its
/// host parts there too.
pub fn warm_up(_device: &Device) -> WarmUp {
    *WARM.get_or_init(|| {
        if let Some(warning) = unoptimised_warning() {
            eprintln!("{warning}");
        }
        let t0 = Instant::now();
        let before = rss().map_or(0, |r| r.current);
        let main_thread_in_pool = main_thread_joins_pool();
        warm_cpu();
        let after = rss().map_or(0, |r| r.current);
        WarmUp {
            resident_bytes: after.saturating_sub(before),
            seconds: t0.elapsed().as_secs_f64(),
            main_thread_in_pool,
        }
    })
}

/// Builds rayon's global pool with the calling thread as its worker 0
/// (`ThreadPoolBuilder::use_current_thread`), when that thread is the process's main thread
/// and nothing has built the pool yet; returns whether it did. The pool keeps its size (the
/// cores, or `RAYON_NUM_THREADS`): the main thread counts as one of them.
///
/// Why: a step runs its kernels one after another from the thread that trains. From outside
/// the pool, each parallel kernel handed its work to the pool's workers and blocked, so on two
/// cores three threads took turns; and after the pool had been idle for a millisecond or so
/// (a kernel too small to split, run by the caller alone) the scheduler often woke both
/// workers onto one core, and the next GEMMs ran at one core's speed (a 2048×128·128×512 f32
/// GEMM after a 5 ms idle gap: 1.3–1.5 ms from outside the pool, 0.9–1.1 ms from inside it,
/// 0.9 ms with no gap). As a worker, the main thread runs its share of each kernel itself and
/// wakes one other thread, which the scheduler puts on the idle core. Measured by
/// `--roofline --steps 40`, two runs each: the GPT's step 38.5 → 35.2 ms, the convnet's
/// 26.4 → 22.9 ms, the MLP's 1.76 → 1.49 ms (docs/BENCHMARKS.md, 2026-12-07, Intel).
///
/// Only the main thread: it lives as long as the process, so the pool never waits on a
/// worker that has gone. Any other thread (a test's, a user's) leaves the pool as rayon
/// builds it; and a pool of one is left alone ([`pool_threads`]). The cost: a job another
/// thread hands the pool while the main thread is busy outside rayon waits for the other
/// workers only. Training hands none (its CPU kernels run on the thread that steps); the
/// replicas of `collective::Threads` (tests, emulated GPUs), each a thread of its own, would
/// share the other workers if the main thread spawned them.
fn main_thread_joins_pool() -> bool {
    std::thread::current().name() == Some("main")
        && pool_threads() >= 2
        && rayon::ThreadPoolBuilder::new()
            .use_current_thread()
            .build_global()
            .is_ok()
}

/// The threads rayon's global pool gets when built with its defaults: `RAYON_NUM_THREADS`
/// when set above 0, else the cores this process may use. A pool of one with the main thread
/// as its only worker would never run a job another thread hands it while the main thread
/// waits outside rayon (a thread it joins), so [`main_thread_joins_pool`] needs two.
fn pool_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The warning the first model of a process prints when memwise's kernels were compiled
/// without optimisations (a debug build of a crate that depends on memwise), where a
/// training step runs about 100× slower; `None` in an optimised build.
pub fn unoptimised_warning() -> Option<String> {
    (memwise_kernels::OPT_LEVEL == "0").then(|| {
        "memwise: warning: its kernels were compiled without optimisations (a debug build), \
         so training runs about 100x slower than it can. Build with `--release`, or optimise \
         dependencies in debug builds by adding to your Cargo.toml:\n\n    \
         [profile.dev.package.\"*\"]\n    opt-level = 3\n"
            .to_string()
    })
}

/// The figures of the warm-up this process ran, if it ran.
pub fn warm_up_cost() -> Option<WarmUp> {
    WARM.get().copied()
}

/// Rayon's pool, then one training step and one inference pass of each coverage model in
/// each precision. Errors are ignored: a warm-up that cannot run leaves the first model to
/// pay these costs itself, which only makes its measurement less exact.
fn warm_cpu() {
    // Every thread that runs GEMMs keeps the library's cache slab for life: rayon's workers
    // and the calling thread (small GEMMs run where they are called).
    rayon::broadcast(|_| memwise_kernels::gemm_heap::touch_thread_slab());
    memwise_kernels::gemm_heap::touch_thread_slab();
    let device = Device::cpu();
    let precisions = [
        (Precision::Float32, Optimizer::RMSPROP),
        (Precision::MixedFloat16, Optimizer::ADAM),
        (Precision::MixedBFloat16, Optimizer::ADAMW),
    ];
    for (precision, optimizer) in precisions {
        for mut spec in [image_model(), sequence_model()] {
            spec.precision = precision;
            spec.optimizer = optimizer;
            run_once(&spec, &device);
        }
    }
    let mut sgd = image_model();
    sgd.optimizer = Optimizer::Momentum {
        lr: 0.01,
        momentum: 0.9,
        nesterov: true,
    };
    run_once(&sgd, &device);
}

fn run_once(spec: &ModelSpec, device: &Device) {
    for p in [plan(spec), plan_inference(spec)].into_iter().flatten() {
        let Ok(mut ex) = Executor::new(p, device, 1) else {
            continue;
        };
        let raw = random_inputs(ex.plan(), 1);
        if let Some(b) = batches(ex.plan(), &raw) {
            let _ = ex.train_step(&b);
        }
    }
}

/// Image layers: u8 pixels through every convolution, pooling and normalisation, three
/// heads with the classification and binary losses.
fn image_model() -> ModelSpec {
    let mut m = ModelSpec::new("WarmUpImage", 2);
    m.input("pixels", &[8, 8, 3], DType::U8, 1.0 / 255.0);
    m.input("label", &[], DType::I32, 1.0);
    m.input("mask", &[4, 4, 1], DType::F32, 1.0);
    let same = Padding::Same;
    m.add(
        "conv",
        LayerKind::conv2d(4, 3, 1, same, Activation::Linear),
        &["pixels"],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    let groups = LayerKind::GroupNorm {
        groups: 2,
        epsilon: 1e-3,
    };
    m.add("gn", groups, &[]);
    m.add("relu", LayerKind::Activation(Activation::Relu), &[]);
    m.add(
        "dw",
        LayerKind::depthwise_conv2d(3, 2, same, Activation::Silu),
        &[],
    );
    m.add(
        "sep",
        LayerKind::separable_conv2d(4, 3, 1, same, Activation::Tanh),
        &[],
    );
    m.add("max", LayerKind::max_pool2d(2, 1, same), &[]);
    m.add("avg", LayerKind::avg_pool2d(2, 1, same), &["dw"]);
    m.add("sum", LayerKind::add(), &["max", "avg"]);
    m.add("both", LayerKind::Concat, &["sum", "sep"]);
    m.add(
        "up",
        LayerKind::conv2d_transpose(2, 3, 2, same, Activation::Gelu),
        &[],
    );
    m.add(
        "down",
        LayerKind::conv2d(1, 2, 2, Padding::Valid, Activation::Linear),
        &[],
    );
    m.add("gap", LayerKind::GlobalAvgPool, &["both"]);
    m.add("drop", LayerKind::Dropout { rate: 0.25 }, &[]);
    m.add("probs", LayerKind::dense(3, Activation::Softmax), &[]);
    m.add("logits", LayerKind::dense(3, Activation::Linear), &["drop"]);
    m.add("bin", LayerKind::dense(3, Activation::Sigmoid), &["drop"]);
    m.add(
        "bin_logits",
        LayerKind::dense(3, Activation::Linear),
        &["drop"],
    );
    m.add(
        "bin_probs",
        LayerKind::Activation(Activation::Sigmoid),
        &["bin_logits"],
    );
    m.add("reg", LayerKind::dense(3, Activation::Linear), &["drop"]);
    let scce = LossKind::SparseCategoricalCrossentropy;
    let bce = LossKind::BinaryCrossentropy;
    m.loss.push(LossTerm::new(scce).on(&["probs", "label"]));
    m.loss.push(LossTerm::new(scce).on(&["logits", "label"]));
    m.loss.push(LossTerm::new(bce).on(&["down", "mask"]));
    m.loss.push(LossTerm::new(bce).on(&["bin", "bin_probs"]));
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["reg", "bin_probs"]));
    m
}

/// Sequence layers: token ids through an embedding and a positional one, layer and RMS norm
/// and causal attention with dropout, and a VAE head (sampling, KL divergence).
fn sequence_model() -> ModelSpec {
    let mut m = ModelSpec::new("WarmUpSequence", 2);
    m.input("ids", &[4], DType::I32, 1.0);
    m.input("next", &[4], DType::I32, 1.0);
    m.input("x", &[8], DType::F32, 1.0);
    m.add("embed", LayerKind::Embedding { vocab: 8, dim: 8 }, &["ids"]);
    m.add("positions", LayerKind::PositionalEmbedding, &[]);
    m.add("norm", LayerKind::layer_norm(), &[]);
    m.add("rms", LayerKind::rms_norm(), &[]);
    let attention = LayerKind::Attention {
        heads: 2,
        causal: true,
        dropout: 0.1,
    };
    m.add("attn", attention, &[]);
    m.add("logits", LayerKind::dense(8, Activation::Linear), &[]);
    m.add("enc", LayerKind::dense(8, Activation::Relu), &["x"]);
    m.add("mean", LayerKind::dense(2, Activation::Linear), &["enc"]);
    m.add("log_var", LayerKind::dense(2, Activation::Linear), &["enc"]);
    m.add("z", LayerKind::SampleNormal, &["mean", "log_var"]);
    m.add("dec", LayerKind::dense(8, Activation::Sigmoid), &["z"]);
    let scce = LossKind::SparseCategoricalCrossentropy;
    m.loss.push(LossTerm::new(scce).on(&["logits", "next"]));
    m.loss.push(
        LossTerm::new(LossKind::BinaryCrossentropy)
            .on(&["dec", "x"])
            .reduction(Reduction::SumOverFeatures),
    );
    m.loss
        .push(LossTerm::new(LossKind::KlNormal).on(&["mean", "log_var"]));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warning appears exactly in unoptimised builds, and says how to fix it.
    #[test]
    fn an_unoptimised_build_is_told_how_to_fix_it() {
        let warning = unoptimised_warning();
        assert_eq!(warning.is_some(), memwise_kernels::OPT_LEVEL == "0");
        if let Some(w) = warning {
            assert!(w.contains("[profile.dev.package.\"*\"]") && w.contains("opt-level = 3"));
            assert!(w.contains("--release"));
        }
    }

    /// The coverage models plan, train and infer: a warm-up that silently skipped one would
    /// leave its kernels' first run to the user's first model.
    #[test]
    fn every_coverage_model_runs() {
        let device = Device::cpu();
        for precision in [
            Precision::Float32,
            Precision::MixedFloat16,
            Precision::MixedBFloat16,
        ] {
            for mut spec in [image_model(), sequence_model()] {
                spec.precision = precision;
                for p in [plan(&spec).unwrap(), plan_inference(&spec).unwrap()] {
                    let mut ex = Executor::new(p, &device, 1).unwrap();
                    let raw = random_inputs(ex.plan(), 1);
                    let b = batches(ex.plan(), &raw).unwrap();
                    ex.train_step(&b).unwrap();
                }
            }
        }
    }
}
