//! What every example shares: the flags of the architecture's contract, data loading, and
//! the plan, report and picture outputs.
#![allow(dead_code)]

use std::path::PathBuf;

use clap::Parser;
use memwise::plan::{LayerKind, ModelSpec, StaticPlan};
use memwise::runtime::data::dataset::{Column, Dataset, InMemory};
use memwise::runtime::data::idx::{load_bundled_digits, load_mnist_dir};
use memwise::runtime::{Device, FitOptions, History, RuntimeError, Trainer};

/// Flags every example takes.
#[derive(Parser, Debug, Clone)]
pub struct Flags {
    /// Print the model summary (Keras-style) and exit.
    #[arg(long)]
    pub summary: bool,
    /// With --summary: every column (dtype, recomputed bytes, in-place, FLOPs, persistent
    /// bytes) and full layer names, wider than 80 columns.
    #[arg(long)]
    pub wide: bool,
    /// Choose the batch (or checkpoints) from the memory the device has free, less a safety
    /// margin, instead of the declared batch: as declared if it fits, else checkpointed,
    /// else the largest batch that fits.
    #[arg(long, conflicts_with = "batch")]
    pub fit_to_device: bool,
    /// Write the static plan as JSON (memwise.plan/1).
    #[arg(long, value_name = "PATH")]
    pub plan_json: Option<PathBuf>,
    /// Write the run report as JSON (memwise.report/1).
    #[arg(long, value_name = "PATH")]
    pub report_json: Option<PathBuf>,
    /// Write the memory timeline picture (SVG).
    #[arg(long, value_name = "PATH")]
    pub timeline_svg: Option<PathBuf>,
    /// Write the model graph picture (SVG, or DOT when the path ends in .dot).
    #[arg(long, value_name = "PATH")]
    pub graph_svg: Option<PathBuf>,
    /// Where to run: cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Batch size (re-plans the model at run time when it differs from the declared one).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Stop after this many training steps.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Number of epochs.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// A folder with the standard MNIST IDX files (train-images-idx3-ubyte[.gz] …);
    /// without it the bundled 10,000 digits are used (8,000 train / 2,000 held out).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Seed for weights, shuffling and dropout.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Train on the samples in their stored order (no per-epoch shuffle): step `s` sees
    /// samples `s·batch .. (s+1)·batch` of the training set.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Write the initial weights (before the first step) as safetensors, Keras layouts
    /// (docs/WEIGHTS.md): what bench/twins.py loads.
    #[arg(long, value_name = "PATH")]
    pub save_initial_weights: Option<PathBuf>,
    /// Write the trained weights (after the last step) as safetensors.
    #[arg(long, value_name = "PATH")]
    pub save_weights: Option<PathBuf>,
    /// Write the batches of the first `--steps` training steps (default 20) as safetensors,
    /// one tensor per model input, `[steps, batch, …]` in the stored dtype; needs
    /// `--no-shuffle`. Its metadata names the model's layers in order (the random streams of
    /// dropout and sampling are keyed by that index, see kernels/src/random.rs).
    #[arg(long, value_name = "PATH")]
    pub dump_batches: Option<PathBuf>,
}

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// `FitOptions` from the flags: `--epochs` (else `default_epochs`), `--steps`, `--seed`,
/// `--no-shuffle`.
pub fn fit_options(flags: &Flags, default_epochs: usize) -> FitOptions {
    FitOptions {
        epochs: flags.epochs.unwrap_or(default_epochs),
        max_steps: flags.steps,
        seed: flags.seed,
        shuffle: !flags.no_shuffle,
        ..Default::default()
    }
}

/// Writes `--dump-batches`: the batches the first `--steps` (default 20) steps of an
/// unshuffled first epoch will see. Call it before the memory baseline is taken.
pub fn dump_batches(flags: &Flags, spec: &ModelSpec, batch: usize, train: &InMemory) -> Res<()> {
    let Some(path) = &flags.dump_batches else {
        return Ok(());
    };
    if !flags.no_shuffle {
        return Err(
            "--dump-batches needs --no-shuffle (the batches are the training set in order)".into(),
        );
    }
    let steps = flags.steps.unwrap_or(20).min(train.len() / batch.max(1));
    let n = steps * batch;
    let idx: Vec<usize> = (0..n).collect();
    let mut bufs: Vec<Column> = train.columns().iter().map(|c| c.buffer(n)).collect();
    train.gather(&idx, &mut bufs)?;
    let names: Vec<&str> = spec
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Input { .. }))
        .map(|l| l.name.as_str())
        .collect();
    let mut tensors: Vec<(String, &'static str, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, b) in bufs.iter().enumerate() {
        let name = names
            .get(k)
            .map_or_else(|| format!("input{k}"), |s| s.to_string());
        let shape = match spec.layers.iter().find(|l| l.name == name).map(|l| &l.kind) {
            Some(LayerKind::Input { shape, .. }) => shape.clone(),
            _ => vec![b.per_sample()],
        };
        let dims = [vec![steps, batch], shape].concat();
        let (dtype, bytes) = match b {
            Column::U8 { data, .. } => ("U8", data.clone()),
            Column::I32 { data, .. } => {
                ("I32", data.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
            Column::F32 { data, .. } => {
                ("F32", data.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
        };
        tensors.push((name, dtype, dims, bytes));
    }
    let layers: Vec<&str> = spec.layers.iter().map(|l| l.name.as_str()).collect();
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "memwise.model": spec.name, "memwise.seed": flags.seed.to_string(),
            "memwise.steps": steps.to_string(), "memwise.batch": batch.to_string(),
            "memwise.layers": serde_json::to_string(&layers)?,
        }),
    );
    let mut at = 0usize;
    for (name, dtype, dims, bytes) in &tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": dims, "data_offsets": [at, at + bytes.len()]}));
        at += bytes.len();
    }
    let mut h = serde_json::to_string(&header)?.into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + at);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, _, bytes) in &tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out)?;
    eprintln!("{steps} batches written to {}", path.display());
    Ok(())
}

/// Writes `--save-initial-weights` (the freshly initialised model's parameters).
pub fn save_initial_weights(flags: &Flags, trainer: &Trainer) -> Res<()> {
    if let Some(p) = &flags.save_initial_weights {
        trainer.engine().save_weights(p)?;
        eprintln!("initial weights written to {}", p.display());
    }
    Ok(())
}

/// Writes `--save-weights` (the parameters after training).
pub fn save_weights(flags: &Flags, trainer: &Trainer) -> Res<()> {
    if let Some(p) = &flags.save_weights {
        trainer.engine().save_weights(p)?;
        eprintln!("weights written to {}", p.display());
    }
    Ok(())
}

/// The plan to run: the compile-time one, or a re-plan for `--batch`.
pub fn plan_for(
    spec: &ModelSpec,
    compiled: StaticPlan,
    flags: &Flags,
) -> Res<(ModelSpec, StaticPlan)> {
    if flags.fit_to_device {
        let device = device(flags)?;
        let chosen = memwise::runtime::fit_device::fit_to_device(spec, &device)?;
        eprintln!("fit to device: {chosen}");
        return Ok((chosen.fit.spec, chosen.fit.plan));
    }
    match flags.batch {
        Some(b) if b != spec.batch => {
            let s = spec.with_batch(b);
            let p = memwise::plan::plan(&s)?;
            Ok((s, p))
        }
        _ => Ok((spec.clone(), compiled)),
    }
}

/// The summary `--summary` prints (`--wide` for every column) for model `M` planned as
/// `plan` (the declared plan, or one re-planned for `--batch`).
pub fn summary<M: memwise::Model>(flags: &Flags, plan: &StaticPlan) -> String {
    memwise::summary::Summary::new(plan)
        .budget(M::BUDGET)
        .auto_checkpoint(M::AUTO_CHECKPOINT_CHOICE)
        .with_wide(flags.wide)
        .to_string()
}

/// After training: the summary's memory block with the peak measured during `fit` beside
/// the estimate.
pub fn print_measured_memory(trainer: &Trainer, history: &History) {
    // On CUDA the device memory the model held at its peak, which the plan describes alone;
    // on the CPU the resident growth, which also holds the host buffers beside the plan.
    let (peak, outside_plan) = match trainer.device_peak_bytes() {
        Some(device) => (Some(device), 0),
        None => {
            let host = trainer.host_bytes();
            (
                history.epochs.last().map(|e| e.peak_rss_growth),
                host.staging + host.gemm + host.prefetch,
            )
        }
    };
    let text = memwise::summary::Summary::new(trainer.plan())
        .measured_peak(peak, outside_plan)
        .totals();
    eprint!("{text}");
}

/// `(train, held-out)` MNIST digits as (pixels u8, labels i32) datasets.
pub fn mnist(flags: &Flags) -> Res<(InMemory, InMemory, String)> {
    match &flags.data {
        Some(dir) => {
            let set = load_mnist_dir(dir)?;
            Ok((
                InMemory::mnist(&set.train),
                InMemory::mnist(&set.test),
                format!("MNIST from {}", dir.display()),
            ))
        }
        None => {
            let (tr, te) = load_bundled_digits()?;
            Ok((
                InMemory::mnist(&tr),
                InMemory::mnist(&te),
                "bundled MNIST digits (8,000 train / 2,000 held out)".into(),
            ))
        }
    }
}

/// Same, images only (autoencoders).
pub fn mnist_images(flags: &Flags) -> Res<(InMemory, InMemory)> {
    match &flags.data {
        Some(dir) => {
            let set = load_mnist_dir(dir)?;
            Ok((
                InMemory::mnist_images(&set.train),
                InMemory::mnist_images(&set.test),
            ))
        }
        None => {
            let (tr, te) = load_bundled_digits()?;
            Ok((InMemory::mnist_images(&tr), InMemory::mnist_images(&te)))
        }
    }
}

/// The `--device` to run on. `auto` says which it picked (and why not CUDA); an explicit
/// choice is said here, so every run names its device.
pub fn device(flags: &Flags) -> Res<Device> {
    let d = Device::parse(&flags.device)?;
    if flags.device != "auto" {
        eprintln!("memwise: using {}", d.name());
    }
    Ok(d)
}

/// Writes `--plan-json`.
pub fn write_plan(flags: &Flags, plan: &StaticPlan) -> Res<()> {
    if let Some(p) = &flags.plan_json {
        std::fs::write(p, plan.to_json())?;
        eprintln!("plan written to {}", p.display());
    }
    Ok(())
}

/// Writes `--timeline-svg` and `--graph-svg` (DOT when the path ends in `.dot`).
pub fn write_pictures(flags: &Flags, spec: &ModelSpec, plan: &StaticPlan) -> Res<()> {
    if let Some(p) = &flags.timeline_svg {
        std::fs::write(p, memwise::runtime::plot::timeline::svg(plan, spec.budget))?;
        eprintln!("memory timeline written to {}", p.display());
    }
    if let Some(p) = &flags.graph_svg {
        let text = if p.extension().is_some_and(|e| e == "dot") {
            memwise::runtime::plot::graph::dot(spec, plan)
        } else {
            memwise::runtime::plot::graph::svg(spec, plan)
        };
        std::fs::write(p, text)?;
        eprintln!("model graph written to {}", p.display());
    }
    Ok(())
}

/// Writes `--report-json` (memwise.report/1).
pub fn write_report(
    flags: &Flags,
    trainer: &Trainer,
    device: &Device,
    history: &History,
    metrics: serde_json::Value,
) -> Res<()> {
    let Some(path) = &flags.report_json else {
        return Ok(());
    };
    let plan = trainer.plan();
    let m = &plan.memory;
    // What training measured and what it was estimated to take: the peak at the end of the
    // last epoch (the examples evaluate afterwards, with inference executors of their own),
    // and the plan's total plus what the trainer holds on the host besides it during `fit`
    // (batch staging, the CPU GEMM library's buffers; see `Trainer::host_bytes`). On CUDA,
    // the device memory the model held at its peak during `fit` (`Trainer::device_peak_bytes`:
    // in use after each step minus in use before the model was built); null on the CPU.
    let peak = match history.epochs.last() {
        Some(e) => Some(e.peak_rss_growth),
        None => trainer.monitor().growth().map(|g| g.peak),
    };
    let host = trainer.host_bytes();
    // (and a streaming dataset's prefetch queue and decode buffers, `HostBytes::prefetch`)
    let host = host.staging + host.gemm + host.prefetch;
    let median = history.step_ms_median();
    let report = serde_json::json!({
        "schema": "memwise.report/1",
        "model": plan.model,
        "device": device.name(),
        "batch": plan.batch,
        "steps": history.step_losses.len(),
        "estimate": {
            "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
            "activations_peak": m.activations_peak, "workspace_peak": m.workspace_peak,
            "inputs": m.inputs, "plan_total": m.total, "host": host, "total": m.total + host,
        },
        "measured": {
            "peak_rss_growth_bytes": peak,
            "device_peak_bytes": trainer.device_peak_bytes(),
            "step_ms_median": median,
            "samples_per_s": if median > 0.0 { plan.batch as f64 / (median / 1e3) } else { 0.0 },
            "data_wait_ms_after_warmup": history.data_wait_ms_after_warmup(),
        },
        "loss": history.step_losses,
        "metrics": metrics,
    });
    std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    eprintln!("report written to {}", path.display());
    Ok(())
}

/// Turns a runtime error into the example's error.
pub fn rt<T>(r: Result<T, RuntimeError>) -> Res<T> {
    r.map_err(|e| e.into())
}
