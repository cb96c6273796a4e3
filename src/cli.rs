//! `Args`: the command-line flags every memwise program takes — the examples' and your own —
//! and the two calls that act on them around `fit`.
//!
//! ```no_run
//! use memwise::prelude::*;
//! # #[memwise::model(batch = 32, loss = mse(out, y))]
//! # struct Net {
//! #     #[input(shape = [4])] x: Input,
//! #     #[input(shape = [1])] y: Input,
//! #     #[dense(1, from = x)] out: Dense,
//! # }
//! # fn data() -> memwise::runtime::data::dataset::InMemory { unimplemented!() }
//! fn main() -> Result<(), memwise::runtime::RuntimeError> {
//!     let args = memwise::cli::Args::parse();
//!     let train = data(); // load data first: the memory baseline is taken when the model is built
//!     let Some(mut trainer) = args.build::<Net>()? else { return Ok(()) }; // `--summary` printed
//!     let history = trainer.fit(&train, None, &args.fit_options(5), &mut [])?;
//!     args.finish(&trainer, &history, memwise::serde_json::json!({}))?;
//!     Ok(())
//! }
//! ```
//!
//! To add flags of your own, flatten it into your parser:
//! `#[derive(clap::Parser)] struct MyArgs { #[command(flatten)] memwise: memwise::cli::Args, … }`.

use std::path::PathBuf;

use crate::plan::data_parallel::Sharding;
use crate::plan::{ModelSpec, StaticPlan};
use crate::runtime::monitor::MemoryMonitor;
use crate::runtime::roofline::{by_op, by_op_table, MachinePeak, Roofline};
use crate::runtime::{Device, FitOptions, History, RuntimeError, Trainer};
use crate::summary::Summary;
use crate::Model;

/// The flags of the architecture's contract (`docs/` and the README list them).
#[derive(clap::Parser, Debug, Clone, PartialEq)]
#[command(version, about)]
// clap names a flattened struct's argument group after the struct: without an id of its own,
// a user's `struct Args { #[command(flatten)] memwise: memwise::cli::Args }` would hold two
// groups called `Args`, which clap refuses (a panic in debug builds).
#[group(id = "memwise::cli::Args")]
pub struct Args {
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
    /// Where to run: cpu, cuda, cuda:N or auto (CUDA when it works, else the CPU).
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
    /// Where the training data is (what the program reads there is its own: the examples
    /// read the standard MNIST IDX files).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Seed for weights, shuffling and dropout.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Train on the samples in their stored order (no per-epoch shuffle).
    #[arg(long)]
    pub no_shuffle: bool,
    /// Start from these weights (safetensors, as --save-weights writes them).
    #[arg(long, value_name = "PATH")]
    pub load_weights: Option<PathBuf>,
    /// Write the initial weights (before the first step) as safetensors.
    #[arg(long, value_name = "PATH")]
    pub save_initial_weights: Option<PathBuf>,
    /// Write the trained weights (after the last step) as safetensors.
    #[arg(long, value_name = "PATH")]
    pub save_weights: Option<PathBuf>,
    /// After training on the CPU, measure this machine's peak (GEMM FLOP/s, copy bandwidth;
    /// about two seconds) and say how close the median step came to the plan's roofline
    /// (also in `--report-json`, as `roofline`).
    #[arg(long)]
    pub roofline: bool,
    /// Train data-parallel: this process is one rank of an `mpirun -n N …` job (needs the
    /// `mpi` feature). The declared batch is the global one; each rank plans and trains its
    /// share. Rank 0 prints and writes `--save-weights`; every rank writes its own
    /// `--report-json` (rank k beside rank 0's, `.rankK` before the extension).
    #[arg(long)]
    pub data_parallel: bool,
    /// With --data-parallel: the ZeRO stage, overriding the model's `zero`: 1 shards the
    /// optimizer state (each rank keeps and updates 1/N of it, then the updated weights are
    /// gathered), 0 shards nothing.
    #[arg(long, value_name = "STAGE", requires = "data_parallel", value_parser = clap::value_parser!(u8).range(0..=1))]
    pub zero: Option<u8>,
}

fn io(e: std::io::Error, what: &str, path: &std::path::Path) -> RuntimeError {
    RuntimeError::Io(format!("{what} {}: {e}", path.display()))
}

impl Args {
    /// The flags of this process's command line (exits with clap's message on a bad one, and
    /// prints `--help`).
    pub fn parse() -> Args {
        <Args as clap::Parser>::parse()
    }

    /// The device `--device` names. `auto` says which it picked (and why not CUDA); an
    /// explicit choice is said here, so every run names its device.
    pub fn device(&self) -> Result<Device, RuntimeError> {
        let d = Device::parse(&self.device)?;
        if self.device != "auto" {
            eprintln!("memwise: using {}", d.name());
        }
        Ok(d)
    }

    /// `M`'s spec and plan as the flags choose them: the compile-time plan, re-planned for
    /// `--batch`, or fitted to the device's free memory with `--fit-to-device`.
    pub fn plan<M: Model>(&self, device: &Device) -> Result<(ModelSpec, StaticPlan), RuntimeError> {
        let spec = M::spec();
        if self.fit_to_device {
            let chosen = crate::runtime::fit_device::fit_to_device(&spec, device)?;
            eprintln!("fit to device: {chosen}");
            return Ok((chosen.fit.spec, chosen.fit.plan));
        }
        match self.batch {
            Some(b) if b != spec.batch => {
                let s = spec.with_batch(b);
                let p = crate::plan::plan(&s)?;
                Ok((s, p))
            }
            _ => Ok((spec, M::PLAN)),
        }
    }

    /// The summary `--summary` prints for `M` planned as `plan` (`--wide`: every column).
    pub fn summary<M: Model>(&self, plan: &StaticPlan) -> String {
        Summary::new(plan)
            .budget(M::BUDGET)
            .auto_checkpoint(M::AUTO_CHECKPOINT_CHOICE)
            .with_wide(self.wide)
            .to_string()
    }

    /// Writes `--plan-json`, `--timeline-svg` and `--graph-svg` for `plan`.
    pub fn write_plan_outputs(
        &self,
        spec: &ModelSpec,
        plan: &StaticPlan,
    ) -> Result<(), RuntimeError> {
        use crate::runtime::plot;
        let mut outputs: Vec<(&PathBuf, String, &str)> = Vec::new();
        if let Some(p) = &self.plan_json {
            outputs.push((p, plan.to_json(), "plan"));
        }
        if let Some(p) = &self.timeline_svg {
            outputs.push((p, plot::timeline::svg(plan, spec.budget), "memory timeline"));
        }
        if let Some(p) = &self.graph_svg {
            let text = if p.extension().is_some_and(|e| e == "dot") {
                plot::graph::dot(spec, plan)
            } else {
                plot::graph::svg(spec, plan)
            };
            outputs.push((p, text, "model graph"));
        }
        for (path, text, what) in outputs {
            std::fs::write(path, text).map_err(|e| io(e, "cannot write", path))?;
            eprintln!("{what} written to {}", path.display());
        }
        Ok(())
    }

    /// Everything before `fit`: prints `--summary` and returns `None` (the program then
    /// exits); otherwise writes the plan outputs, opens `--device`, builds `M` on it as
    /// [`Args::plan`] chooses (the memory baseline is taken here: load data before), loads
    /// `--load-weights` and writes `--save-initial-weights`.
    pub fn build<M: Model>(&self) -> Result<Option<Trainer>, RuntimeError> {
        let mut device = if self.summary {
            Device::cpu()
        } else {
            self.device()?
        };
        let (spec, plan) = self.plan::<M>(&device)?;
        if self.summary {
            println!("{}", self.summary::<M>(&plan));
            return Ok(None);
        }
        let collective = self.collective(&mut device)?;
        let (spec, plan) = match &collective {
            Some(c) => {
                let mut s = spec.with_replicas(c.size());
                if let Some(stage) = self.zero.and_then(Sharding::from_zero_stage) {
                    s = s.with_sharding(stage);
                }
                let p = crate::plan::plan(&s)?;
                (s, p)
            }
            None => (spec, plan),
        };
        if collective.as_ref().is_none_or(|c| c.rank() == 0) {
            self.write_plan_outputs(&spec, &plan)?;
        }
        let monitor = MemoryMonitor::start_on(&device);
        let mut trainer = Trainer::from_plan(&spec, plan, &device, self.seed, monitor)?;
        if let Some(c) = collective {
            let (rank, size) = (c.rank(), c.size());
            trainer.set_data_parallel(c)?;
            if rank == 0 {
                let zero = match trainer.plan().sharding {
                    Sharding::Replicated => String::new(),
                    s => format!(
                        ", ZeRO stage {} (1/{size} of the optimizer state each)",
                        s.zero_stage()
                    ),
                };
                eprintln!(
                    "data parallel: {size} ranks over {}, {} samples each per global batch of {}{zero}",
                    trainer.engine().collective().map_or("?", |c| c.engine()),
                    trainer.plan().batch,
                    trainer.plan().batch * size
                );
            }
        }
        if self.roofline {
            trainer.engine_mut().enable_profiling();
        }
        if let Some(p) = &self.load_weights {
            trainer.engine_mut().load_weights(p)?;
            eprintln!("weights loaded from {}", p.display());
        }
        if let Some(p) = &self.save_initial_weights {
            trainer.engine().save_weights(p)?;
            eprintln!("initial weights written to {}", p.display());
        }
        Ok(Some(trainer))
    }

    /// `--data-parallel`: this process's rank of the MPI job. On CUDA, one process per GPU:
    /// plain `--device cuda` becomes the GPU of this rank's index on its node, and the ranks
    /// sum on device memory through NCCL (the `nccl` feature), else through the host.
    /// (`--device cuda:N` keeps GPU N for every rank: a node's ranks must then name theirs.)
    #[cfg(feature = "mpi")]
    fn collective(
        &self,
        device: &mut Device,
    ) -> Result<Option<std::sync::Arc<dyn crate::runtime::collective::Collective>>, RuntimeError>
    {
        if !self.data_parallel {
            return Ok(None);
        }
        let mpi = crate::runtime::collective::Mpi::init()?;
        if !device.is_cuda() {
            return Ok(Some(std::sync::Arc::new(mpi)));
        }
        // `cuda` or `auto`: the GPU of this rank's index on its node; `cuda:N` as given.
        if !self.device.starts_with("cuda:") {
            *device = Device::cuda(mpi.local_rank())?;
        }
        self.device_collective(mpi, device)
    }

    /// Ranks on GPUs: NCCL for device memory, MPI for the rest.
    #[cfg(feature = "nccl")]
    fn device_collective(
        &self,
        mpi: crate::runtime::collective::Mpi,
        device: &Device,
    ) -> Result<Option<std::sync::Arc<dyn crate::runtime::collective::Collective>>, RuntimeError>
    {
        let nccl = crate::runtime::collective::Nccl::init(mpi, device)?;
        if crate::runtime::collective::Collective::rank(&nccl) == 0 {
            eprintln!(
                "NCCL communicator: {:.1} MiB of device memory (NCCL's own, outside the plan)",
                nccl.device_bytes() as f64 / (1 << 20) as f64
            );
        }
        Ok(Some(std::sync::Arc::new(nccl)))
    }

    /// Ranks on GPUs without the `nccl` feature: the gradients go through the host.
    #[cfg(all(feature = "mpi", not(feature = "nccl")))]
    fn device_collective(
        &self,
        mpi: crate::runtime::collective::Mpi,
        _device: &Device,
    ) -> Result<Option<std::sync::Arc<dyn crate::runtime::collective::Collective>>, RuntimeError>
    {
        if crate::runtime::collective::Collective::rank(&mpi) == 0 {
            eprintln!(
                "data parallel on CUDA without NCCL: gradients are summed through the host \
                 over MPI (build with --features nccl to sum on the GPUs)"
            );
        }
        Ok(Some(std::sync::Arc::new(mpi)))
    }

    /// `--data-parallel` needs MPI, which this build does not have.
    #[cfg(not(feature = "mpi"))]
    fn collective(
        &self,
        _device: &mut Device,
    ) -> Result<Option<std::sync::Arc<dyn crate::runtime::collective::Collective>>, RuntimeError>
    {
        if self.data_parallel {
            return Err(RuntimeError::Device(
                "--data-parallel runs the ranks of an MPI job: build with `--features mpi` \
                 (scripts/install-mpi.sh installs Open MPI) and launch with `mpirun -n N`"
                    .into(),
            ));
        }
        Ok(None)
    }

    /// `FitOptions` from `--epochs` (else `default_epochs`), `--steps`, `--seed` and
    /// `--no-shuffle`.
    pub fn fit_options(&self, default_epochs: usize) -> FitOptions {
        FitOptions {
            epochs: self.epochs.unwrap_or(default_epochs),
            max_steps: self.steps,
            seed: self.seed,
            shuffle: !self.no_shuffle,
            ..Default::default()
        }
    }

    /// Everything after `fit`: prints the measured peak beside the estimate, writes
    /// `--save-weights` and `--report-json` (with `metrics`, e.g. the held-out accuracy).
    pub fn finish(
        &self,
        trainer: &Trainer,
        history: &History,
        metrics: serde_json::Value,
    ) -> Result<(), RuntimeError> {
        let rank = trainer.rank();
        if rank == 0 {
            eprint!("{}", measured_memory(trainer, history));
        }
        let roofline = self.roofline(trainer, history);
        if let (Some(p), 0) = (&self.save_weights, rank) {
            trainer.engine().save_weights(p)?;
            eprintln!("weights written to {}", p.display());
        }
        if let Some(p) = &self.report_json {
            let p = &rank_path(p, rank);
            let mut report = trainer.report(history, metrics);
            report["roofline"] = roofline.unwrap_or(serde_json::Value::Null);
            let text = serde_json::to_string_pretty(&report)
                .map_err(|e| RuntimeError::Io(e.to_string()))?;
            std::fs::write(p, text).map_err(|e| io(e, "cannot write", p))?;
            eprintln!("report written to {}", p.display());
        }
        Ok(())
    }

    /// `--roofline`: the median step against this CPU's measured peak, printed, and the
    /// report's `roofline` object (`None` without the flag or on a GPU, whose peak this does
    /// not measure).
    fn roofline(&self, trainer: &Trainer, history: &History) -> Option<serde_json::Value> {
        if !self.roofline {
            return None;
        }
        if trainer.device().kind != crate::runtime::device::DeviceKind::Cpu {
            eprintln!(
                "roofline: measures the CPU's peak only; this run was on {}",
                trainer.device().name()
            );
            return None;
        }
        let peak = MachinePeak::measure_cpu();
        let r = Roofline::of(trainer.plan(), peak);
        let median = history.step_ms_median();
        eprintln!("{}", r.describe(median));
        let profile = trainer.engine().profile();
        let groups = by_op(trainer.plan(), peak, &profile, history.step_ms.len());
        eprint!("{}", by_op_table(&groups, 12));
        Some(r.to_json(median))
    }
}

/// Where rank `rank` writes a file rank 0 writes at `path`: `r.json` → `r.rank1.json`.
pub fn rank_path(path: &std::path::Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map_or_else(Default::default, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// The summary's memory block with the peak `fit` measured beside the estimate: on a GPU the
/// device memory the model held at its peak, on the CPU the resident growth, which also holds
/// the host memory beside the plan.
pub fn measured_memory(trainer: &Trainer, history: &History) -> String {
    let (peak, outside_plan) = match trainer.device_peak_bytes() {
        Some(device) => (Some(device), 0),
        None => {
            let estimate = history
                .epochs
                .last()
                .map_or_else(|| trainer.estimate_bytes(), |e| e.estimate_bytes);
            (
                history.epochs.last().map(|e| e.peak_rss_growth),
                estimate.saturating_sub(trainer.plan().memory.total),
            )
        }
    };
    Summary::new(trainer.plan())
        .measured_peak(peak, outside_plan)
        .totals()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    /// What a user writes: a struct of their own named `Args` — the name clash that used to
    /// panic in debug builds — with the library's flags flattened in.
    mod user {
        #[derive(clap::Parser, Debug)]
        pub struct Args {
            #[command(flatten)]
            pub memwise: crate::cli::Args,
            #[arg(long)]
            pub workers: Option<usize>,
        }
    }

    /// And one more level, as the examples' shared `Flags` adds.
    #[derive(Parser, Debug)]
    struct Outer {
        #[command(flatten)]
        user: user::Args,
    }

    #[test]
    fn flattening_into_a_struct_named_args_is_a_valid_command() {
        // `debug_assert` runs the consistency checks (unique ids and group names) that a
        // debug build runs at parse time.
        crate::cli::Args::command().debug_assert();
        user::Args::command().debug_assert();
        Outer::command().debug_assert();
        let parsed = Outer::try_parse_from(["user", "--summary", "--workers", "2"]).unwrap();
        assert!(parsed.user.memwise.summary);
        assert_eq!(parsed.user.workers, Some(2));
    }
}
