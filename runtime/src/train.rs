//! `Trainer`: fit / evaluate / predict around an engine (the CPU executor, or the CUDA one on
//! a CUDA device), with a Keras-like progress bar and epoch line, callbacks, and the memory
//! monitor that sets the measured peak beside the compile-time estimate.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use memwise_plan::advice::format_bytes;
use memwise_plan::{plan, plan_inference, ModelSpec, Op, StaticPlan, NONE};

use crate::collective::Collective;
use crate::data::dataset::{Column, Dataset};
use crate::device::Device;
use crate::engine::{build_engine, Engine};
use crate::error::{Result, RuntimeError};
use crate::executor::{Batch, Executor, StepOutput};
use crate::monitor::{error_percent, MemoryMonitor};

/// What `fit` does.
#[derive(Clone, Debug)]
pub struct FitOptions {
    pub epochs: usize,
    /// Reshuffle the samples every epoch (seeded).
    pub shuffle: bool,
    pub seed: u64,
    /// Stop an epoch after this many steps (None: every full batch).
    pub steps_per_epoch: Option<usize>,
    /// Stop training after this many steps in all (None: run every epoch).
    pub max_steps: Option<usize>,
    /// Print the progress bar (when stderr is a terminal) and one line per epoch.
    pub verbose: bool,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            epochs: 1,
            shuffle: true,
            seed: 0,
            steps_per_epoch: None,
            max_steps: None,
            verbose: true,
        }
    }
}

/// One epoch's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochLog {
    pub epoch: usize,
    pub steps: usize,
    pub loss: f32,
    /// Fraction of correct predictions (classification losses): a mean over what is scored,
    /// one prediction per sample for a class label, one per token for a sequence; else `None`.
    pub accuracy: Option<f32>,
    pub val_loss: Option<f32>,
    pub val_accuracy: Option<f32>,
    pub seconds: f64,
    /// Resident-size growth since the model was built: now, and the peak.
    pub rss_growth: u64,
    pub peak_rss_growth: u64,
    /// On a GPU, the device memory the model has held at its peak so far (sampled after every
    /// step; see [`Trainer::device_peak_bytes`]); `None` on the CPU.
    pub device_peak_bytes: Option<u64>,
    /// What the trainer estimated for this moment ([`Trainer::estimate_bytes`]: the plan and
    /// the host memory beside it, validation's inference engines included), the figure the
    /// peak is measured against.
    pub estimate_bytes: u64,
    /// Time the epoch's steps waited for their batch (`Dataset::gather`: a copy for data in
    /// memory, time blocked on the prefetch queue for a streamed folder), in seconds.
    pub data_wait_seconds: f64,
}

/// What `fit` returns: every epoch, and every step's loss and time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    pub epochs: Vec<EpochLog>,
    pub step_losses: Vec<f32>,
    pub step_ms: Vec<f64>,
    /// Per step, the milliseconds it waited for its batch (see [`EpochLog::data_wait_seconds`]).
    pub data_wait_ms: Vec<f64>,
}

impl History {
    /// Median step time in milliseconds.
    pub fn step_ms_median(&self) -> f64 {
        let mut v = self.step_ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// Mean milliseconds a step waited for its batch after the first step (the warm-up, when a
    /// streaming dataset's workers have only just started); 0 with fewer than two steps.
    pub fn data_wait_ms_after_warmup(&self) -> f64 {
        let rest = self.data_wait_ms.get(1..).unwrap_or_default();
        if rest.is_empty() {
            return 0.0;
        }
        rest.iter().sum::<f64>() / rest.len() as f64
    }
}

/// Loss and accuracy over a dataset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub loss: f32,
    pub accuracy: Option<f32>,
    pub samples: usize,
}

/// Called by `fit`.
pub trait Callback {
    fn on_epoch_end(&mut self, _log: &EpochLog, _model: &Trainer) {}
}

/// The seed's `MemoryCallback`, done right: after each epoch, prints the measured current and
/// peak resident growth next to the compile-time estimate and the error between them (rank 0
/// prints; every rank keeps its own lines).
#[derive(Clone, Debug, Default)]
pub struct MemoryCallback {
    pub lines: Vec<String>,
}

impl Callback for MemoryCallback {
    fn on_epoch_end(&mut self, log: &EpochLog, model: &Trainer) {
        let est = model.estimate_bytes();
        let line = match log.device_peak_bytes {
            Some(device) => format!(
                "memory: estimate {} | device peak {} ({:+.1}% vs estimate) | cuBLAS handle and workspace {} beside it | host resident current {} peak {}",
                format_bytes(est),
                format_bytes(device),
                error_percent(device, est),
                format_bytes(model.device_lane_bytes().unwrap_or_default()),
                format_bytes(log.rss_growth),
                format_bytes(log.peak_rss_growth)
            ),
            None => format!(
                "memory: estimate {} | measured current {} | peak {} ({:+.1}% vs estimate)",
                format_bytes(est),
                format_bytes(log.rss_growth),
                format_bytes(log.peak_rss_growth),
                error_percent(log.peak_rss_growth, est)
            ),
        };
        // Each data-parallel rank keeps its own figures; only rank 0 prints, as `fit` does (two
        // processes writing one terminal would interleave their lines).
        if model.rank() == 0 {
            eprintln!("{line}");
        }
        self.lines.push(line);
    }
}

/// Host memory a [`Trainer`] holds besides its training plan's two regions, in bytes: what
/// the CPU estimate adds to the plan's total so that it can be set beside the measured
/// resident growth (`docs/BENCHMARKS.md`, "Measured vs estimated").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostBytes {
    /// `fit`'s staging buffers: one batch of every input in its stored dtype, gathered from
    /// the dataset before the step copies it into the arena.
    pub staging: u64,
    /// The CPU GEMM library's (the `gemm` crate's) packing buffers, resident at their peak:
    /// the largest call under 1 MiB, whose heap pages stay resident, plus the largest mapped
    /// one ([`crate::cpu_heap::gemm_library_resident_bytes`], each call exact for the
    /// library's rule). Its per-thread cache slabs are claimed once per process by the
    /// warm-up ([`crate::warm_up`]), not by a model. 0 on CUDA.
    pub gemm: u64,
    /// The inference executors `evaluate` and `predict` have built so far (arena and
    /// persistent region each; on CUDA these live in device memory).
    pub inference: u64,
    /// What the datasets `fit` last trained and validated on allocate to serve batches: a
    /// streaming dataset's prefetch queue and its workers' decode buffers
    /// (`Dataset::prefetch_bytes`; 0 for data held in memory).
    pub prefetch: u64,
    /// `fit`'s sample indices at their peak ([`order_bytes`]): the epoch's order, the next
    /// epoch's when one follows (shuffled one epoch early), and the larger of the indices
    /// announced to the dataset and validation's announcement. 60,000 samples hold 469 KiB.
    pub order: u64,
    /// Data parallel: what summing the gradients over the replicas holds on the host at
    /// its peak ([`Trainer::collective_bytes`]); 0 on one device.
    pub collective: u64,
}

impl HostBytes {
    pub fn total(&self) -> u64 {
        self.staging + self.gemm + self.inference + self.prefetch + self.order + self.collective
    }
}

/// The bytes of `fit`'s index vectors at their peak, for `train` samples in batches of
/// `batch`, `steps` steps in the first epoch and `next_steps` in the one after it (0 when none
/// follows), and `validation` held-out samples: `order` and `next_order` live through the
/// epoch; `announce_epoch`'s list (exactly `steps + next_steps` batches) and `evaluate`'s
/// (one index per validation sample) are each alive only beside them, never together.
fn order_bytes(train: usize, batch: usize, steps: (usize, usize), validation: usize) -> u64 {
    let orders = train * if steps.1 > 0 { 2 } else { 1 };
    let announced = (steps.0 + steps.1) * batch;
    ((orders + announced.max(validation)) * std::mem::size_of::<usize>()) as u64
}

/// A model built on a device: the training engine, and inference engines of the same kind
/// made on demand for evaluate and predict.
pub struct Trainer {
    spec: ModelSpec,
    device: Device,
    train: Box<dyn Engine>,
    /// Inference engines by batch size (the plan's, and a final partial batch's).
    infer: Vec<InferenceEngine>,
    monitor: MemoryMonitor,
    /// `HostBytes::prefetch` and `HostBytes::order`, set by `fit`.
    prefetch: u64,
    order: u64,
    /// Whether CUDA graphs are on, for the engines built later (`set_cuda_graphs`).
    graphs: bool,
}

/// An inference engine of the trainer, and whether its weights are the training engine's
/// current ones (they go stale when the training engine steps or is handed out mutably).
struct InferenceEngine {
    engine: Box<dyn Engine>,
    current: bool,
}

/// Consecutive steps loss scaling may skip before `fit` stops. Each skip halves the scale
/// from 2^15; after 40 it is 2^-25, below float16's smallest subnormal (2^-24): no finite
/// gradient overflows there, so what keeps the step non-finite is NaN or infinity in the
/// weights, the inputs or the forward pass, and skipping forever would train on nothing.
pub const MAX_SKIPPED_IN_A_ROW: u32 = 40;

/// An input error about one sample of a batch, told in the dataset's terms: the sample's
/// index in the dataset, and where (`fit`'s epoch and step, or `evaluate`).
pub(crate) fn in_dataset(e: RuntimeError, idx: &[usize], at: &str) -> RuntimeError {
    match e {
        RuntimeError::InputSample {
            input,
            sample,
            problem,
            context,
        } if sample < idx.len() => RuntimeError::InputSample {
            input,
            sample: idx[sample],
            problem,
            context: format!("{context} (in {at}: sample {sample} of its batch)"),
        },
        other => other,
    }
}

/// Sets `order` to this epoch's order — `next`, when the previous epoch shuffled it, else
/// shuffled now — shuffles the next epoch's one epoch early when `steps.1` steps follow, and
/// tells `train` which samples the `steps.0` steps of this epoch and those of the next will
/// gather ([`Dataset::will_gather`]), so a streaming dataset prepares the next epoch's first
/// batches while this one ends. The shuffles are the same, in the same order, as without it.
fn announce_epoch(
    train: &dyn Dataset,
    (order, next, rng): (&mut Vec<usize>, &mut Option<Vec<usize>>, &mut u64),
    shuffled: bool,
    steps: (usize, usize),
    shard: Shard,
) {
    match next.take() {
        Some(n) => *order = n,
        None if shuffled => shuffle(order, rng),
        None => {}
    }
    let batch = shard.batch;
    // Sized once, so its capacity is exactly what `order_bytes` plans.
    let mut upcoming = Vec::with_capacity((steps.0 + steps.1) * batch);
    for s in 0..steps.0 {
        upcoming.extend_from_slice(shard.of(order, s));
    }
    if steps.1 > 0 {
        let mut n = order.clone();
        if shuffled {
            shuffle(&mut n, rng);
        }
        for s in 0..steps.1 {
            upcoming.extend_from_slice(shard.of(&n, s));
        }
        *next = Some(n);
    }
    train.will_gather(&upcoming, batch);
}

/// Which samples of each global batch this replica trains on: `fit`'s distributed sampler.
/// Every rank shuffles the same order (the same seed); global batch `s` is
/// `order[s·G .. (s+1)·G]` with `G = batch · replicas`, and replica `r` takes its `r`-th
/// run of `batch` samples — so the replicas together see exactly the batches one device
/// would at the global batch, and the samples past the last whole global batch wait for
/// the next epoch's shuffle, as on one device.
#[derive(Clone, Copy, Debug)]
struct Shard {
    /// One replica's batch (the plan's).
    batch: usize,
    rank: usize,
    replicas: usize,
}

impl Shard {
    fn global(&self) -> usize {
        self.batch * self.replicas
    }

    /// This replica's samples of global batch `step`.
    fn of<'o>(&self, order: &'o [usize], step: usize) -> &'o [usize] {
        &order[step * self.global() + self.rank * self.batch..][..self.batch]
    }
}

/// `fit`'s checks after step `at` (epoch, step): a float32 loss that is not finite, or loss
/// scaling that has skipped [`MAX_SKIPPED_IN_A_ROW`] steps in a row (counted in
/// `skipped_in_a_row`; `loss_scale` is the scale now), ends training with an error.
pub(crate) fn check_step(
    out: &StepOutput,
    skipped_in_a_row: &mut u32,
    loss_scale: f32,
    (epoch, step): (usize, usize),
) -> Result<()> {
    *skipped_in_a_row = if out.skipped {
        *skipped_in_a_row + 1
    } else {
        0
    };
    if *skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW {
        return Err(RuntimeError::NonFinite(format!(
            "epoch {epoch}, step {step}: loss scaling skipped the last {skipped_in_a_row} steps in a row \
             (loss scale now {loss_scale:e}, the loss {}): no scale makes these gradients finite, so \
             the weights, the inputs or the forward pass hold NaN or infinity; the weights \
             are those before the first skipped step",
            out.loss
        )));
    }
    if !out.loss.is_finite() && !out.skipped {
        return Err(RuntimeError::NonFinite(format!(
            "epoch {epoch}, step {step}: the loss is {} (float32 training diverged; lower the learning rate)",
            out.loss
        )));
    }
    Ok(())
}

/// The state `fit`'s shuffles start from, for `seed` (every rank and stage the same).
pub(crate) fn shuffle_seed(seed: u64) -> u64 {
    seed ^ 0x006D_656D_7769_7365 // "memwise"
}

/// Fisher–Yates with [`splitmix`]: `fit`'s per-epoch shuffle.
pub(crate) fn shuffle(order: &mut [usize], rng: &mut u64) {
    for i in (1..order.len()).rev() {
        let j = (splitmix(rng) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
}

pub(crate) fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The predictions one pass of `p` scores for accuracy: the rows of its classification losses
/// — one per sample for a class label, one per token for a sequence of labels — so that
/// accuracy is a mean over what is scored, never over samples.
pub(crate) fn scored_predictions(p: &StaticPlan) -> usize {
    p.steps
        .iter()
        .map(|s| match s.op {
            Op::SoftmaxCrossEntropy { rows, .. }
            | Op::SoftmaxCrossEntropyFromLogits { rows, .. } => rows,
            _ => 0,
        })
        .sum()
}

impl Trainer {
    /// Plans `spec` and allocates it on `device` (weights initialised from `seed`). The
    /// memory baseline is taken first, so the monitor measures what the model costs.
    pub fn build(spec: &ModelSpec, device: &Device, seed: u64) -> Result<Trainer> {
        let monitor = MemoryMonitor::start_on(device);
        let p = plan(spec)?;
        Trainer::from_plan(spec, p, device, seed, monitor)
    }

    /// Builds from a plan made earlier (the macro's `PLAN`): the CPU executor, or on a CUDA
    /// device the CUDA executor ([`build_engine`]; without the `cuda` feature a CUDA device is
    /// an `Err`).
    pub fn from_plan(
        spec: &ModelSpec,
        p: StaticPlan,
        device: &Device,
        seed: u64,
        monitor: MemoryMonitor,
    ) -> Result<Trainer> {
        let train = build_engine(p, device, seed)?;
        Trainer::from_engine(spec, train, device, monitor)
    }

    /// Builds around a ready training engine (any [`Engine`]: a GPU executor over another
    /// backend, a restored one …). `device` is where its inference engines go; `spec` is the
    /// model the engine's plan was made from.
    pub fn from_engine(
        spec: &ModelSpec,
        engine: Box<dyn Engine>,
        device: &Device,
        monitor: MemoryMonitor,
    ) -> Result<Trainer> {
        let p = engine.plan();
        if !p.training {
            return Err(RuntimeError::Input(format!(
                "the trainer needs a training plan; `{}` was planned for inference",
                p.model
            )));
        }
        let mut monitor = monitor;
        monitor.record_device_bytes(engine.device_bytes_used());
        Ok(Trainer {
            spec: spec.clone(),
            device: device.clone(),
            train: engine,
            infer: Vec::new(),
            monitor,
            prefetch: 0,
            order: 0,
            graphs: true,
        })
    }

    /// Data parallel: makes this trainer replica `c.rank()` of `c.size()` (the plan's
    /// `replicas`). Rank 0's weights are copied to every rank first, as PyTorch's
    /// `DistributedDataParallel` does when it wraps a model, so the replicas start equal
    /// whatever each loaded. `fit` then trains this rank on its share of every global batch
    /// ([`Trainer::fit`]), and only rank 0 prints.
    pub fn set_data_parallel(&mut self, c: Arc<dyn Collective>) -> Result<()> {
        self.train.set_collective(c)?;
        self.mark_inference_stale();
        Ok(())
    }

    /// This trainer's rank in its data-parallel job (0 on one device): what prints and
    /// saves is rank 0's, as `torch.distributed.get_rank() == 0` decides in PyTorch.
    pub fn rank(&self) -> usize {
        self.shard().rank
    }

    /// This replica's share of each batch (the whole batch on one device).
    fn shard(&self) -> Shard {
        let c = self.train.collective();
        Shard {
            batch: self.plan().batch,
            rank: c.map_or(0, |c| c.rank()),
            replicas: c.map_or(1, |c| c.size()),
        }
    }

    /// The training engine.
    pub fn engine(&self) -> &dyn Engine {
        &*self.train
    }

    /// The training engine, to change (weights, checkpoints): the inference engines copy its
    /// weights again before they next run.
    pub fn engine_mut(&mut self) -> &mut dyn Engine {
        self.mark_inference_stale();
        &mut *self.train
    }

    /// The training engine as the CPU executor (profiling, poisoning), when it is one.
    pub fn cpu_executor(&self) -> Option<&Executor> {
        self.train.downcast_ref::<Executor>()
    }

    /// [`Trainer::cpu_executor`], to change.
    pub fn cpu_executor_mut(&mut self) -> Option<&mut Executor> {
        self.mark_inference_stale();
        self.train.downcast_mut::<Executor>()
    }

    fn mark_inference_stale(&mut self) {
        for e in self.infer.iter_mut() {
            e.current = false;
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Writes the model's weights as safetensors, Keras's layouts and PyTorch's names
    /// (`docs/WEIGHTS.md`); the file is replaced atomically.
    pub fn save_weights(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.train.save_weights(path.as_ref())
    }

    /// Loads weights written by [`Trainer::save_weights`] (or converted from PyTorch or
    /// Keras): every name, shape and dtype is checked before anything is replaced.
    pub fn load_weights(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.mark_inference_stale();
        self.train.load_weights(path.as_ref())
    }

    /// Turns CUDA graph capture on or off (on by default; nothing changes on the CPU). With
    /// it on, a CUDA trainer runs its first step's kernels one by one, records the second
    /// step as a graph and replays it from then on; a capture that fails says so once and
    /// leaves every later step eager. Off, every step launches its kernels one by one: for
    /// profilers that do not follow graphs, or to rule capture out when hunting a bug.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs = on;
        self.train.set_graphs(on);
        for e in &mut self.infer {
            e.engine.set_graphs(on);
        }
    }

    /// On a GPU: the device memory the model has held at its peak, in bytes — the most the
    /// device had in use, sampled when the model was built and after every training step,
    /// minus what it had in use before the model was built (`cuMemGetInfo`; the run report's
    /// `device_peak_bytes`). `None` on the CPU.
    pub fn device_peak_bytes(&self) -> Option<u64> {
        self.monitor.device_peak()
    }

    /// The device memory of the trainer's stream and cuBLAS handle and workspace (one for
    /// the training and inference engines), measured when they opened, before the model's
    /// baseline: beside [`Trainer::device_peak_bytes`], not in it. `None` on the CPU.
    pub fn device_lane_bytes(&self) -> Option<u64> {
        self.train.device_lane_bytes()
    }

    pub fn plan(&self) -> &StaticPlan {
        self.train.plan()
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn monitor(&self) -> &MemoryMonitor {
        &self.monitor
    }

    /// The estimate the monitor compares with: the plan's total plus [`Trainer::host_bytes`],
    /// what this trainer holds outside the plan.
    pub fn estimate_bytes(&self) -> u64 {
        self.plan().memory.total + self.host_bytes().total()
    }

    /// Host memory the trainer uses besides the plan's regions (see [`HostBytes`]).
    pub fn host_bytes(&self) -> HostBytes {
        let p = self.plan();
        let staging = p.inputs.iter().map(|&id| {
            let t = p.tensor(id);
            t.elems() as u64 * t.dtype.size()
        });
        let gemm = if self.device.is_cuda() {
            0
        } else {
            // Evaluation's engines run GEMMs of their own shapes (one call at a time).
            let engines = std::iter::once(p).chain(self.infer.iter().map(|e| e.engine.plan()));
            crate::cpu_heap::gemm_library_resident_bytes(engines)
        };
        HostBytes {
            staging: staging.sum(),
            gemm,
            inference: self
                .infer
                .iter()
                .map(|e| e.engine.plan().arena_bytes + e.engine.plan().persistent_bytes)
                .sum(),
            prefetch: self.prefetch,
            order: self.order,
            collective: self.collective_bytes(),
        }
    }

    /// [`collective_host_bytes`] of this trainer's plan and collective (0 on one device).
    fn collective_bytes(&self) -> u64 {
        let Some(c) = self.train.collective() else {
            return 0;
        };
        collective_host_bytes(self.plan(), c, self.device.is_cuda())
    }

    fn is_classifier(p: &StaticPlan) -> bool {
        scored_predictions(p) > 0
    }

    /// Checks `data`'s columns against the model's inputs; `needs` says what the caller
    /// needs of it, for the empty-dataset message ("one batch of 128 samples to train").
    fn check_columns(&self, data: &dyn Dataset, needs: &str) -> Result<()> {
        let p = self.plan();
        if data.columns().len() != p.inputs.len() {
            let names: Vec<&str> = p
                .inputs
                .iter()
                .map(|&i| p.tensor(i).name.as_ref())
                .collect();
            return Err(RuntimeError::Input(format!(
                "the dataset has {} columns, the model takes {} inputs ({})",
                data.columns().len(),
                p.inputs.len(),
                names.join(", ")
            )));
        }
        for (c, &id) in data.columns().iter().zip(p.inputs.iter()) {
            let t = p.tensor(id);
            let per: usize = t.shape[1..].iter().product();
            if c.dtype() != t.dtype || c.per_sample() != per {
                return Err(RuntimeError::Input(format!(
                    "input `{}` takes {} values of {} per sample, the dataset column has {} of {}",
                    t.name,
                    per,
                    t.dtype.name(),
                    c.per_sample(),
                    c.dtype().name()
                )));
            }
        }
        if data.is_empty() {
            return Err(RuntimeError::Input(format!(
                "the dataset is empty: {needs}"
            )));
        }
        Ok(())
    }

    /// Checks `train` for `fit`, records the host bytes its datasets and sample order will
    /// take (`HostBytes::prefetch`, `HostBytes::order`), and returns the steps per epoch.
    fn prepare_fit(
        &mut self,
        train: &dyn Dataset,
        validation: Option<&dyn Dataset>,
        opts: &FitOptions,
    ) -> Result<usize> {
        let batch = self.plan().batch;
        let global = self.shard().global();
        self.check_columns(
            train,
            &format!("`fit` needs at least one batch of {global} samples"),
        )?;
        if train.len() < global {
            return Err(RuntimeError::Input(format!(
                "the dataset has {} samples, fewer than one batch of {global}",
                train.len()
            )));
        }
        self.prefetch =
            train.prefetch_bytes(batch) + validation.map_or(0, |v| v.prefetch_bytes(batch));
        let full = train.len() / global;
        let per_epoch = opts.steps_per_epoch.map_or(full, |s| s.min(full)).max(1);
        let steps = opts.max_steps.unwrap_or(usize::MAX);
        // The first epoch announces the most steps: later ones have as many or fewer left.
        let first = per_epoch.min(steps);
        let second = if opts.epochs > 1 {
            per_epoch.min(steps - first)
        } else {
            0
        };
        let held_out = validation.map_or(0, |v| v.len());
        self.order = order_bytes(train.len(), batch, (first, second), held_out);
        if let Some(v) = validation {
            let (first, end) = self.evaluation_share(v.len());
            self.reserve_inference(&self.inference_batches(end - first))?;
        }
        Ok(per_epoch)
    }

    /// Trains for `opts.epochs` epochs over full batches of `train` (the plan's batch is
    /// static: a final partial batch is left for the next epoch's shuffle), evaluating on
    /// `validation` after each epoch.
    pub fn fit(
        &mut self,
        train: &dyn Dataset,
        validation: Option<&dyn Dataset>,
        opts: &FitOptions,
        callbacks: &mut [&mut dyn Callback],
    ) -> Result<History> {
        let batch = self.plan().batch;
        let shard = self.shard();
        // Only one replica reports: the others train in silence, as DDP's other ranks.
        let verbose = opts.verbose && shard.rank == 0;
        let per_epoch = self.prepare_fit(train, validation, opts)?;
        let classifier = Trainer::is_classifier(self.plan());
        // The step's output is the whole global batch's (summed over the replicas).
        let scored_per_step = scored_predictions(self.plan()) * shard.replicas;
        let mut remaining = opts.max_steps.unwrap_or(usize::MAX);
        let mut order: Vec<usize> = (0..train.len()).collect();
        let mut bufs: Vec<Column> = train.columns().iter().map(|c| c.buffer(batch)).collect();
        let mut rng = shuffle_seed(opts.seed);
        let mut history = History::default();
        let mut skipped_in_a_row = 0u32;
        let tty = std::io::stderr().is_terminal();
        // The next epoch's order, shuffled one epoch early (`announce_epoch`).
        let mut next_order: Option<Vec<usize>> = None;
        for epoch in 1..=opts.epochs {
            if remaining == 0 {
                break;
            }
            let steps = per_epoch.min(remaining);
            remaining -= steps;
            let next_steps = if epoch < opts.epochs {
                per_epoch.min(remaining)
            } else {
                0
            };
            let orders = (&mut order, &mut next_order, &mut rng);
            announce_epoch(train, orders, opts.shuffle, (steps, next_steps), shard);
            let mut data_wait = 0f64;
            let bar = epoch_bar(verbose && tty, steps, (epoch, opts.epochs));
            let t0 = Instant::now();
            let (mut loss_sum, mut correct, mut seen) = (0f64, 0usize, 0usize);
            for s in 0..steps {
                let idx = shard.of(&order, s);
                let tw = Instant::now();
                train.gather(idx, &mut bufs)?;
                let waited = tw.elapsed().as_secs_f64();
                history.data_wait_ms.push(waited * 1e3);
                data_wait += waited;
                let batches: Vec<Batch<'_>> = bufs.iter().map(|b| b.as_batch(batch)).collect();
                let ts = Instant::now();
                self.mark_inference_stale();
                let out = self.train.train_step(&batches).map_err(|e| {
                    in_dataset(e, idx, &format!("`fit`, epoch {epoch}, step {}", s + 1))
                })?;
                history.step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
                self.monitor
                    .record_device_bytes(self.train.device_bytes_used());
                let scale = self.train.loss_scale();
                check_step(&out, &mut skipped_in_a_row, scale, (epoch, s + 1))?;
                history.step_losses.push(out.loss);
                loss_sum += out.loss as f64;
                correct += out.correct;
                seen += scored_per_step;
                let accuracy = classifier.then(|| correct as f64 / seen as f64);
                bar_step(&bar, loss_sum / (s + 1) as f64, accuracy);
            }
            bar.finish_and_clear();
            let seconds = t0.elapsed().as_secs_f64();
            let (val_loss, val_accuracy) = match validation {
                Some(v) => {
                    let e = self.evaluate(v)?;
                    (Some(e.loss), e.accuracy)
                }
                None => (None, None),
            };
            let g = self.monitor.growth().unwrap_or_default();
            let log = EpochLog {
                epoch,
                steps,
                loss: (loss_sum / steps as f64) as f32,
                accuracy: classifier.then_some(correct as f32 / seen as f32),
                val_loss,
                val_accuracy,
                seconds,
                rss_growth: g.current,
                peak_rss_growth: g.peak,
                device_peak_bytes: self.device_peak_bytes(),
                estimate_bytes: self.estimate_bytes(),
                data_wait_seconds: data_wait,
            };
            if verbose {
                eprintln!("{}", epoch_line(&log, opts.epochs, self.estimate_bytes()));
            }
            for c in callbacks.iter_mut() {
                c.on_epoch_end(&log, self);
            }
            history.epochs.push(log);
        }
        Ok(history)
    }

    /// The batch sizes `evaluate` and `predict` run over `samples` samples in (this rank's
    /// share of them, data parallel): full batches and the tail.
    fn inference_batches(&self, samples: usize) -> Vec<usize> {
        let batch = self.plan().batch;
        let mut sizes = vec![batch.min(samples), samples % batch];
        sizes.retain(|&n| n > 0);
        sizes.dedup();
        sizes
    }

    /// The samples `first..end` of `samples` this rank evaluates or predicts: all of them on
    /// one device, rank `r` of `N` replicas `r·samples/N .. (r+1)·samples/N`.
    fn evaluation_share(&self, samples: usize) -> (usize, usize) {
        let shard = self.shard();
        let bound = |r: usize| r * samples / shard.replicas;
        (bound(shard.rank), bound(shard.rank + 1))
    }

    /// Builds, before anything runs, the inference engines for batches of `sizes` that are
    /// not built yet: their device memory is then taken when a `fit`, `evaluate` or
    /// `predict` starts — a model without room for them fails there, with the figures,
    /// instead of after an epoch of training.
    fn reserve_inference(&mut self, sizes: &[usize]) -> Result<()> {
        for &n in sizes {
            self.inference_engine(n)?;
        }
        Ok(())
    }

    /// The index of the inference engine for batches of `n`, built on first use by the
    /// training engine (the same kind).
    fn inference_engine(&mut self, n: usize) -> Result<usize> {
        if let Some(k) = self.infer.iter().position(|e| e.engine.plan().batch == n) {
            return Ok(k);
        }
        let p = plan_inference(&self.spec.with_batch(n))?;
        let mut engine = self.train.inference_engine(p, &self.device)?;
        engine.set_graphs(self.graphs);
        self.infer.push(InferenceEngine {
            engine,
            current: false,
        });
        Ok(self.infer.len() - 1)
    }

    /// The inference engine for batches of `n` ([`Trainer::inference_engine`]), its weights
    /// copied from the training engine when they changed.
    fn inference(&mut self, n: usize) -> Result<usize> {
        let k = self.inference_engine(n)?;
        let (train, infer) = (&self.train, &mut self.infer[k]);
        if !infer.current {
            infer.engine.copy_params_from(&**train)?;
            infer.current = true;
        }
        Ok(k)
    }

    /// Runs this rank's share of `data` ([`Trainer::evaluation_share`]) through the inference
    /// engines, a batch at a time (the tail in a smaller one), and hands `each` the engine
    /// that ran it, the batch's first sample, its size and the step's output. `what` names
    /// the caller in an error, which also names the batch's samples.
    fn over_share(
        &mut self,
        data: &dyn Dataset,
        what: &str,
        mut each: impl FnMut(&dyn Engine, usize, usize, StepOutput) -> Result<()>,
    ) -> Result<()> {
        let batch = self.plan().batch;
        let (first, end) = self.evaluation_share(data.len());
        self.reserve_inference(&self.inference_batches(end - first))?;
        data.will_gather(&(first..end).collect::<Vec<_>>(), batch);
        let mut start = first;
        while start < end {
            let n = batch.min(end - start);
            let k = self.inference(n)?;
            let idx: Vec<usize> = (start..start + n).collect();
            let mut bufs: Vec<Column> = data.columns().iter().map(|c| c.buffer(n)).collect();
            data.gather(&idx, &mut bufs)?;
            let batches: Vec<Batch<'_>> = bufs.iter().map(|b| b.as_batch(n)).collect();
            let engine = &mut self.infer[k].engine;
            let out = engine
                .evaluate_step(&batches)
                .map_err(|e| in_dataset(e, &idx, what))?;
            each(&**engine, start, n, out)?;
            start += n;
        }
        Ok(())
    }

    /// Loss (and accuracy for classifiers) over every sample of `data`, in inference mode
    /// (batch norm from running statistics, no dropout).
    ///
    /// Data parallel, it is distributed as Keras's `evaluate` under a strategy: rank `r` of
    /// `N` evaluates samples `r·len/N .. (r+1)·len/N` (every rank must call it on the same
    /// data) and the sums are added over the ranks, so each returns the whole set's figures.
    /// With batch norm, each rank's share is normalised by that rank's running statistics
    /// (they are per replica, docs/DATA_PARALLEL.md).
    pub fn evaluate(&mut self, data: &dyn Dataset) -> Result<Evaluation> {
        self.check_columns(data, "`evaluate` needs at least one sample")?;
        let classifier = Trainer::is_classifier(self.plan());
        // (loss × samples, correct predictions, scored predictions), summed.
        let mut sums = [0f64; 3];
        self.over_share(data, "`evaluate`", |engine, _, n, out| {
            sums[0] += out.loss as f64 * n as f64;
            sums[1] += out.correct as f64;
            sums[2] += scored_predictions(engine.plan()) as f64;
            Ok(())
        })?;
        if let Some(c) = self.train.collective() {
            c.all_reduce_sum_f64(&mut sums)?;
        }
        let samples = data.len();
        Ok(Evaluation {
            loss: (sums[0] / samples as f64) as f32,
            accuracy: classifier.then_some((sums[1] / sums[2].max(1.0)) as f32),
            samples,
        })
    }

    /// The model's prediction for every sample (row-major, `[samples, …]`), in inference
    /// mode. Label columns are read but do not change the prediction. Data parallel, each
    /// rank predicts its share of the samples (as `evaluate` splits them) and every rank
    /// returns every sample's prediction, as Keras's `predict` under a strategy does.
    pub fn predict(&mut self, data: &dyn Dataset) -> Result<Vec<f32>> {
        self.check_columns(data, "`predict` needs at least one sample")?;
        let p = self.plan();
        let (batch, prediction) = (p.batch, p.prediction);
        if prediction == NONE {
            return Err(RuntimeError::Input(
                "`predict`: the model has no prediction (no loss reads a layer)".into(),
            ));
        }
        // Per sample, as the training plan's prediction tensor holds it.
        let width = p.tensor(prediction).elems() / batch.max(1);
        let mut out = vec![0f32; data.len() * width];
        self.over_share(data, "`predict`", |engine, start, n, _| {
            engine.read_prediction(&mut out[start * width..(start + n) * width])
        })?;
        if let Some(c) = self.train.collective() {
            // Each rank predicted its share; every rank returns every sample's prediction.
            let bound = |r: usize| r * data.len() / c.size() * width * 4;
            let part = |r: usize| bound(r)..bound(r + 1);
            // SAFETY: the f32 values' bytes, for as long as `out` is borrowed here.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4)
            };
            c.all_gather_parts(bytes, &part)?;
        }
        Ok(out)
    }
}

/// Keras's progress bar for one epoch of `steps` steps (`(epoch, epochs)`), shown when `shown`
/// (verbose, on a terminal), else hidden.
pub(crate) fn epoch_bar(shown: bool, steps: usize, (epoch, epochs): (usize, usize)) -> ProgressBar {
    if !shown {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(steps as u64);
    b.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_prefix(format!("Epoch {epoch}/{epochs}"));
    b
}

/// One step more on `bar`, with the epoch's running mean loss (and accuracy).
pub(crate) fn bar_step(bar: &ProgressBar, loss: f64, accuracy: Option<f64>) {
    bar.inc(1);
    match accuracy {
        Some(a) => bar.set_message(format!("loss: {loss:.4} - accuracy: {a:.4}")),
        None => bar.set_message(format!("loss: {loss:.4}")),
    }
}

/// Keras's line: `Epoch 3/5 - 62 steps - 4.1s - loss: 0.2311 - accuracy: 0.9312 - val_…`,
/// then the measured peak (host resident growth; on a GPU the device peak) and the estimate.
pub fn epoch_line(l: &EpochLog, epochs: usize, estimate: u64) -> String {
    let mut s = format!(
        "Epoch {}/{epochs} - {} steps - {:.1}s - loss: {:.4}",
        l.epoch, l.steps, l.seconds, l.loss
    );
    if let Some(a) = l.accuracy {
        s += &format!(" - accuracy: {a:.4}");
    }
    if let Some(v) = l.val_loss {
        s += &format!(" - val_loss: {v:.4}");
    }
    if let Some(a) = l.val_accuracy {
        s += &format!(" - val_accuracy: {a:.4}");
    }
    s += &format!(
        " - data wait: {:.2} ms/step",
        l.data_wait_seconds * 1e3 / l.steps.max(1) as f64
    );
    match l.device_peak_bytes {
        Some(device) => {
            s += &format!(
                " - memory: {} device peak / {} estimated",
                format_bytes(device),
                format_bytes(estimate)
            )
        }
        None => {
            s += &format!(
                " - memory: {} peak / {} estimated",
                format_bytes(l.peak_rss_growth),
                format_bytes(estimate)
            )
        }
    }
    s
}

/// Host bytes of the largest gradient sum or weight gather of `p` carried by `c`: the CPU
/// sums each bucket's gradients in place (one call per bucket, its padding included) and
/// gathers each parameter's shards in place (ZeRO stage 1), so only the engine's own buffers
/// count; CUDA (`cuda`) without NCCL sums one bucket at a time through the host, holding its
/// gradients downloaded (the bytes and the f32 values) and again as the bytes uploaded back,
/// and gathers one parameter's weights through the host (downloaded, as f32, as the bytes
/// uploaded and their 16-bit copy).
pub(crate) fn collective_host_bytes(p: &StaticPlan, c: &dyn Collective, cuda: bool) -> u64 {
    // On CUDA without device collectives (NCCL), the sums and gathers go through the host.
    let cuda = cuda && c.device().is_none();
    let largest =
        |s: &memwise_plan::PlanStep| s.params.iter().map(|&i| p.params[i as usize].elems()).max();
    // (elements the engine carries at once, bytes of CUDA's host copies)
    let (n, copies) = p
        .steps
        .iter()
        .filter_map(|s| match s.op {
            Op::AllReduceGradients { bytes, .. } => {
                let e = (bytes + s.params.len() as u64 * p.alignment) as usize / 4;
                Some((e, if cuda { 12 * e as u64 } else { 0 }))
            }
            Op::AllGatherParams { .. } => largest(s).map(|e| {
                let shard = memwise_plan::data_parallel::shard_elems(e, p.replicas);
                (shard, if cuda { 14 * e as u64 } else { 0 })
            }),
            _ => None,
        })
        .fold((0, 0), |(n, b), (m, c)| (n.max(m), b.max(c)));
    c.scratch_bytes(n) + copies
}
