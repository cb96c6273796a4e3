//! The guide's convolutional VAE split over two devices (model parallel): the encoder is
//! pipeline stage 0, the decoder (from `dec_dense`, marked `#[stage(1)]`) stage 1; each batch
//! of 128 runs as 4 micro-batches of 32 under the 1F1B schedule. Every stage's memory is a
//! const (`ConvVae::STAGE_MEMORY`), and `--summary` prints them.
//!
//! `cargo run --release --example pipeline` trains both stages as threads of this process on
//! the bundled MNIST digits; `--one-device` trains the whole model on one device instead,
//! on the same batches (for comparison: `--save-weights` from both, then
//! `scripts/compare_weights.py`). Built with `--features mpi`, `mpirun -n 2 … --mpi` runs
//! each stage as its own process; each writes its stage's weights (`PATH.stage0`, …).
//! `--replicas 2` trains 2 replicas of the whole pipeline data-parallel (`mpirun -n 4`, or 4
//! threads), each on half of every batch: rank `2·s + r` runs stage `s` of replica `r`.
//! After training, every run evaluates the 2,000 held-out digits through the same pipeline
//! (`StageTrainer::evaluate`) and prints their loss, which one device's run matches.
//! `--save-checkpoint PATH` writes the pipeline's training checkpoint after the steps (a file
//! per stage), and `--resume PATH` goes on from one.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use memwise::prelude::*;
use memwise::runtime::collective::{Collective, ThreadGroup};
use memwise::runtime::data::dataset::InMemory;
use memwise::runtime::data::idx::load_bundled_digits;
use memwise::runtime::stage::StageTrainer;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[memwise::model(
    batch = 128,
    optimizer = adam,
    micro_batches = 4,
    loss = binary_crossentropy(decoded, pixels, reduction = sum) + kl_normal(z_mean, z_log_var),
    budget = "1 GiB"
)]
pub struct ConvVae {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[conv2d(32, 3, strides = 2, padding = same, activation = relu)]
    enc_conv1: Conv2d,
    #[conv2d(64, 3, strides = 2, padding = same, activation = relu)]
    enc_conv2: Conv2d,
    #[flatten]
    enc_flatten: Flatten,
    #[dense(16, activation = relu)]
    enc_dense: Dense,
    #[dense(2, from = enc_dense)]
    z_mean: Dense,
    #[dense(2, from = enc_dense)]
    z_log_var: Dense,
    #[sample_normal(z_mean, z_log_var)]
    z: SampleNormal,
    #[stage(1)]
    #[dense(7 * 7 * 64, activation = relu)]
    dec_dense: Dense,
    #[reshape([7, 7, 64])]
    dec_reshape: Reshape,
    #[conv2d_transpose(64, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv1: Conv2dTranspose,
    #[conv2d_transpose(32, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv2: Conv2dTranspose,
    #[conv2d_transpose(1, 3, padding = same, activation = sigmoid)]
    decoded: Conv2dTranspose,
}

// Each stage fits the declared budget: checked when this compiles.
const _: () = assert!(ConvVae::STAGES.len() == 2);

#[derive(Parser, Debug)]
struct Flags {
    /// Print the summary (each stage's memory) and exit.
    #[arg(long)]
    summary: bool,
    /// Training steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The global batch, instead of the declared 128 (a multiple of the 4 micro-batches).
    #[arg(long)]
    batch: Option<usize>,
    /// Train the whole model on one device (the comparison).
    #[arg(long)]
    one_device: bool,
    /// This process is one stage of an `mpirun -n 2` job (built with `--features mpi`).
    #[arg(long)]
    mpi: bool,
    /// Write the trained weights here (a stage's: `PATH.stage<k>`, from replica 0).
    #[arg(long)]
    save_weights: Option<PathBuf>,
    /// Write each stage's run report (JSON: its estimate beside its measured peak) here
    /// (`PATH.stage<k>`; with replicas `PATH.stage<k>.replica<r>`).
    #[arg(long)]
    report_json: Option<PathBuf>,
    /// Data-parallel replicas of the whole pipeline, each on its share of every batch (a
    /// rank per stage of each: `mpirun -n 4` for 2).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The pipeline schedule, instead of the declared 1F1B: `gpipe` or `one_f_one_b`.
    #[arg(long)]
    schedule: Option<String>,
    /// The seed the weights start from.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// After training, write the pipeline's training checkpoint here (`PATH.stage<k>`).
    #[arg(long)]
    save_checkpoint: Option<PathBuf>,
    /// Before training, resume from the checkpoint `--save-checkpoint` wrote: the steps go on
    /// with the batches after it.
    #[arg(long)]
    resume: Option<PathBuf>,
}

fn main() -> Res<()> {
    let flags = Flags::parse();
    if flags.summary {
        println!("{}", ConvVae::summary());
        return Ok(());
    }
    let (train, test) = load_bundled_digits()?;
    let data = (
        InMemory::mnist_images(&train),
        InMemory::mnist_images(&test),
    );
    if flags.one_device {
        return one_device(&flags, &data);
    }
    if flags.mpi {
        return on_mpi(&flags, &data);
    }
    let stages = ThreadGroup::new(ConvVae::STAGES.len() * flags.replicas.max(1));
    let losses: Vec<Res<Trained>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (stages.into_iter())
            .map(|c| {
                let (flags, data) = (&flags, &data);
                scope.spawn(move || run_stage(flags, data, Arc::new(c)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a stage's thread panicked".into()))
            })
            .collect()
    });
    let mut first = None;
    for l in losses {
        first = first.or(Some(l?));
    }
    let (losses, held_out) = first.unwrap_or_default();
    print_losses(&ranks_text(&flags, "threads"), &losses, held_out);
    Ok(())
}

/// A run's training losses by step, and its loss on the held-out digits afterwards.
type Trained = (Vec<f32>, f32);

/// The model as declared, under `--schedule` if given.
fn spec(flags: &Flags) -> Res<memwise::plan::ModelSpec> {
    use memwise::plan::pipeline::PipelineSchedule;
    let mut spec = ConvVae::spec().with_replicas(flags.replicas);
    if let Some(b) = flags.batch {
        spec = spec.with_batch(b);
    }
    if let (Some(name), Some(pipe)) = (&flags.schedule, spec.pipeline.as_mut()) {
        pipe.schedule = match name.as_str() {
            "gpipe" => PipelineSchedule::GPipe,
            "one_f_one_b" => PipelineSchedule::OneFOneB,
            other => return Err(format!("--schedule {other}: `gpipe` or `one_f_one_b`").into()),
        };
    }
    Ok(spec)
}

/// "2 stages (MPI ranks)", or with replicas "2 stages × 2 replicas (MPI ranks)".
fn ranks_text(flags: &Flags, what: &str) -> String {
    match flags.replicas {
        0 | 1 => format!("{} stages ({what})", ConvVae::STAGES.len()),
        r => format!("{} stages × {r} replicas ({what})", ConvVae::STAGES.len()),
    }
}

/// Trains rank `c.rank()`'s stage, writes its weights (replica 0's) and report, and
/// evaluates the held-out digits (`data.1`) with the other stages.
fn run_stage(flags: &Flags, data: &(InMemory, InMemory), c: Arc<dyn Collective>) -> Res<Trained> {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut t = StageTrainer::build(&spec(flags)?, &Device::cpu(), flags.seed, c)?;
    let (stage, replica) = (t.plan().stage as usize, t.replica());
    // Stage `k` of replica `r` (`replica<r>` only with replicas).
    let who = match flags.replicas {
        0 | 1 => format!("stage {stage}"),
        _ => format!("stage {stage} replica {replica}"),
    };
    say(format!(
        "{who}: training {} steps; its plan holds {:.2} MiB",
        flags.steps,
        mib(t.plan().memory.total)
    ));
    if let Some(p) = &flags.resume {
        t.load_checkpoint(p)?;
        say(format!(
            "{who}: resumed from {} at step {}",
            p.display(),
            t.engine().step_counter()
        ));
    }
    let losses = t.train_steps(&data.0, flags.steps)?;
    if let Some(p) = &flags.save_checkpoint {
        t.save_checkpoint(p)?;
        if replica == 0 {
            say(format!(
                "{who}: checkpoint written to {}.stage{stage}",
                p.display()
            ));
        }
    }
    // Per process: meaningful when each stage is its own process (`--mpi`).
    // (The stage's baseline is taken before it is built: its growth is what it holds.)
    let peak = t.peak_rss_growth().filter(|_| flags.mpi);
    let report = t.report(&Device::cpu(), &losses, peak);
    if let Some(peak) = peak {
        let (plan, host) = (t.plan().memory.total, t.host_bytes());
        say(format!(
            "{who} memory: measured peak RSS growth {:.2} MiB, estimate {:.2} MiB \
             (plan {:.2} + host {:.2}): {:+.1} %",
            mib(peak),
            mib(plan + host),
            mib(plan),
            mib(host),
            report["measured"]["error_percent"].as_f64().unwrap_or(0.0)
        ));
    }
    // The replicas hold the same weights: replica 0 writes them, as rank 0 does in PyTorch.
    if let Some(p) = flags.save_weights.as_ref().filter(|_| replica == 0) {
        let path = PathBuf::from(format!("{}.stage{stage}", p.display()));
        t.engine().save_weights(&path)?;
        say(format!("{who}'s weights written to {}", path.display()));
    }
    if let Some(p) = &flags.report_json {
        let path = match flags.replicas {
            0 | 1 => PathBuf::from(format!("{}.stage{stage}", p.display())),
            _ => PathBuf::from(format!("{}.stage{stage}.replica{replica}", p.display())),
        };
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
        say(format!("{who}'s report written to {}", path.display()));
    }
    // After the report: its peak is the training's.
    let held_out = t.evaluate(&data.1)?;
    Ok((losses, held_out.loss))
}

/// One line on stderr in one write: the stages share it (threads, or ranks whose output
/// `mpirun` merges), and `eprintln!` writes a formatted line piece by piece.
fn say(mut line: String) {
    use std::io::Write;
    line.push('\n');
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[cfg(feature = "mpi")]
fn on_mpi(flags: &Flags, data: &(InMemory, InMemory)) -> Res<()> {
    let mpi = memwise::runtime::collective::Mpi::init()?;
    let rank = mpi.rank();
    let (losses, held_out) = run_stage(flags, data, Arc::new(mpi))?;
    if rank == 0 {
        print_losses(&ranks_text(flags, "MPI ranks"), &losses, held_out);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn on_mpi(_: &Flags, _: &(InMemory, InMemory)) -> Res<()> {
    Err("--mpi needs the example built with `--features mpi`".into())
}

/// The whole model on one device, on the same batches in the same order.
fn one_device(flags: &Flags, data: &(InMemory, InMemory)) -> Res<()> {
    let mut spec = ConvVae::spec();
    spec.pipeline = None;
    let whole = memwise::plan::plan(&spec)?;
    let mut pipe = spec.clone();
    pipe.pipeline = Some(memwise::plan::stage::Pipeline::new(
        memwise::plan::pipeline::PipelineSchedule::OneFOneB,
        1,
        &[],
    ));
    // One stage of one micro-batch is the one-device plan; its trainer feeds the batches.
    let one = ThreadGroup::new(1).pop().ok_or("no rank")?;
    let mut t = StageTrainer::build(&pipe, &Device::cpu(), flags.seed, Arc::new(one))?;
    if t.plan().memory.total != whole.memory.total {
        return Err("one stage of one micro-batch should plan as the whole model".into());
    }
    let losses = t.train_steps(&data.0, flags.steps)?;
    if let Some(p) = &flags.save_weights {
        t.engine().save_weights(p)?;
        eprintln!("weights written to {}", p.display());
    }
    print_losses("one device", &losses, t.evaluate(&data.1)?.loss);
    Ok(())
}

fn print_losses(what: &str, losses: &[f32], held_out: f32) {
    let text: Vec<String> = losses.iter().map(|l| format!("{l:.2}")).collect();
    println!("{what}: loss by step {}", text.join(", "));
    println!("{what}: held-out loss {held_out:.6} (2000 test digits)");
}
