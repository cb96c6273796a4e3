//! The GPU check (`scripts/gpu-check.sh` runs it on the GPU machine; built here with
//! `--features cuda`). Prints a short table last:
//!
//! 1. every op, forward and backward, on CUDA vs the CPU: random models from the planner's
//!    generators (every layer kind, checkpoints, in-place ops, mixed precision) trained one
//!    step on both from the same seed and inputs; per op, the largest relative L2 error of the
//!    gradients of the models that contain it;
//! 2. `mnist_mlp`, a small convnet and the conv VAE trained `STEPS` steps on both devices on
//!    the same synthetic batches: losses at a few steps and their largest relative gap;
//! 3. estimated (plan) vs measured device memory, and samples/s without and with the
//!    whole-step CUDA graph (and on the CPU);
//! 4. the `Trainer` on the device (the engine `Trainer::build` picks for a CUDA device): fit
//!    with validation, evaluate and predict next to a CPU trainer, the device peak it measured,
//!    and a checkpoint saved from the device loaded into the CPU executor.
//!
//! Exits 2 at once, with the reason, when no CUDA device can be opened.

use std::process::ExitCode;
use std::time::Instant;

use memwise_plan::generate::{random_chain, random_dag};
use memwise_plan::spec::{Activation, LayerKind, LossKind, LossTerm, Padding};
use memwise_plan::{plan, zoo, DType, ModelSpec, Optimizer, StaticPlan};
use memwise_runtime::cuda::device::CudaExecutor;
use memwise_runtime::reference::{random_digits, random_inputs};
use memwise_runtime::{Batch, Device, Executor, FitOptions, Trainer};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cast<T>(r: &[u8]) -> &[T] {
    // SAFETY: Vec<u8> allocations are at least 8-aligned here; whole elements.
    unsafe {
        std::slice::from_raw_parts(r.as_ptr() as *const T, r.len() / std::mem::size_of::<T>())
    }
}

fn batches<'a>(plan: &StaticPlan, raw: &'a [Vec<u8>]) -> Vec<Batch<'a>> {
    plan.inputs
        .iter()
        .zip(raw)
        .map(|(&id, r)| match plan.tensor(id).dtype {
            DType::U8 => Batch::U8(r),
            DType::I32 => Batch::I32(cast(r)),
            DType::F32 => Batch::F32(cast(r)),
            DType::F16 => Batch::F16(cast(r)),
            DType::BF16 => Batch::BF16(cast(r)),
        })
        .collect()
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-10 * b.len() as f64)).sqrt()
}

/// One step on both devices; the largest gradient error (noise-level gradients excluded).
fn one_step(dev: &Device, spec: &ModelSpec) -> Result<(StaticPlan, f64), String> {
    let p = plan(spec).map_err(|e| e.to_string())?;
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 11).map_err(|e| e.to_string())?;
    let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 11).map_err(|e| e.to_string())?;
    let raw = random_inputs(&p, 100);
    let b = batches(&p, &raw);
    cpu.train_step(&b).map_err(|e| format!("cpu: {e}"))?;
    gpu.train_step(&b).map_err(|e| format!("cuda: {e}"))?;
    let grads: Vec<(Vec<f32>, Vec<f32>)> = p
        .params
        .iter()
        .filter(|q| q.trainable)
        .map(|q| {
            (
                gpu.grad(&q.name).unwrap(),
                cpu.grad(&q.name).unwrap().to_vec(),
            )
        })
        .collect();
    let gmax = grads
        .iter()
        .flat_map(|(_, b)| b.iter().map(|v| v.abs()))
        .filter(|v| v.is_finite())
        .fold(0f32, f32::max);
    let worst = grads
        .iter()
        .filter(|(a, b)| {
            !a.iter()
                .zip(b.iter())
                .all(|(x, y)| (x - y).abs() <= 1e-5 * gmax)
        })
        .map(|(a, b)| rel(a, b))
        .fold(0f64, f64::max);
    Ok((p, worst))
}

fn convnet(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("SmallConvNet", batch);
    m.optimizer = Optimizer::RMSPROP;
    m.input("pixels", &[28, 28, 1], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "conv1",
        LayerKind::conv2d(32, 3, 1, Padding::Same, Activation::Relu),
        &["pixels"],
    );
    m.add("bn1", LayerKind::batch_norm(), &[]);
    m.add("pool1", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add(
        "conv2",
        LayerKind::conv2d(64, 3, 1, Padding::Same, Activation::Relu),
        &[],
    );
    m.add("pool2", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add("gap", LayerKind::GlobalAvgPool, &[]);
    m.add("drop", LayerKind::Dropout { rate: 0.5 }, &[]);
    m.add("probs", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "labels"]));
    m
}

struct Trained {
    name: &'static str,
    batch: usize,
    losses: Vec<(usize, f32, f32)>,
    max_gap: f64,
    estimate: u64,
    measured: Option<u64>,
    cpu_sps: f64,
    eager_sps: f64,
    graph_sps: f64,
}

fn train(
    dev: &Device,
    name: &'static str,
    spec: &ModelSpec,
    steps: usize,
    timed: usize,
) -> Result<Trained, String> {
    let p = plan(spec).map_err(|e| e.to_string())?;
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 5).map_err(|e| e.to_string())?;
    let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 5).map_err(|e| e.to_string())?;
    let data: Vec<Vec<Vec<u8>>> = (0..8).map(|k| random_inputs(&p, 1000 + k)).collect();
    let (mut losses, mut max_gap) = (Vec::new(), 0f64);
    let t_cpu = Instant::now();
    for step in 0..steps {
        let b = batches(&p, &data[step % data.len()]);
        let lc = cpu
            .train_step(&b)
            .map_err(|e| format!("cpu step {step}: {e}"))?
            .loss;
        let lg = gpu
            .train_step(&b)
            .map_err(|e| format!("cuda step {step}: {e}"))?
            .loss;
        max_gap = max_gap.max(((lc - lg).abs() / lc.abs().max(1e-3)) as f64);
        if [0, steps / 4, steps / 2, steps - 1].contains(&step) {
            losses.push((step + 1, lc, lg));
        }
    }
    let cpu_secs = t_cpu.elapsed().as_secs_f64();
    let measured = gpu.device_bytes_used();
    // Throughput: eager launches, then the captured graph (the first step after turning it
    // on captures; it is not timed).
    let time = |gpu: &mut CudaExecutor, n: usize| -> Result<f64, String> {
        let b = batches(&p, &data[0]);
        gpu.train_step(&b).map_err(|e| e.to_string())?;
        let t = Instant::now();
        for _ in 0..n {
            gpu.train_step(&b).map_err(|e| e.to_string())?;
        }
        Ok((n * p.batch) as f64 / t.elapsed().as_secs_f64())
    };
    gpu.kernels_mut().set_graph(false);
    let eager_sps = time(&mut gpu, timed)?;
    gpu.kernels_mut().set_graph(true);
    let graph_sps = time(&mut gpu, timed)?;
    Ok(Trained {
        name,
        batch: p.batch,
        losses,
        max_gap,
        estimate: p.persistent_bytes + p.arena_bytes,
        measured,
        // The CPU time above also waited for the device's steps, which are far shorter.
        cpu_sps: (steps * p.batch) as f64 / cpu_secs,
        eager_sps,
        graph_sps,
    })
}

/// Part 4: `Trainer::build` on the CUDA device next to one on the CPU. Every step's loss,
/// the validation and evaluation, and the predictions agree; the device peak is measured; a
/// checkpoint saved from the device loads into the CPU executor bit for bit.
fn trainer_check(dev: &Device) -> Result<String, String> {
    let spec = zoo::mnist_mlp(64);
    let (train, held_out) = (random_digits(640, 3), random_digits(200, 4));
    let opts = FitOptions {
        epochs: 2,
        seed: 5,
        verbose: false,
        ..Default::default()
    };
    let e = |e: memwise_runtime::RuntimeError| e.to_string();
    let mut cpu = Trainer::build(&spec, &Device::cpu(), 7).map_err(e)?;
    let mut gpu = Trainer::build(&spec, dev, 7).map_err(e)?;
    if gpu.cpu_executor().is_some() {
        return Err("the trainer built the CPU executor for a CUDA device".into());
    }
    let hc = cpu
        .fit(&train, Some(&held_out), &opts, &mut [])
        .map_err(e)?;
    let hg = gpu
        .fit(&train, Some(&held_out), &opts, &mut [])
        .map_err(e)?;
    let gap = |a: f32, b: f32| ((a - b).abs() / b.abs().max(1e-3)) as f64;
    let max_gap = hg
        .step_losses
        .iter()
        .zip(&hc.step_losses)
        .map(|(a, b)| gap(*a, *b))
        .fold(0f64, f64::max);
    let (ec, eg) = (
        cpu.evaluate(&held_out).map_err(e)?,
        gpu.evaluate(&held_out).map_err(e)?,
    );
    let (pc, pg) = (
        cpu.predict(&held_out).map_err(e)?,
        gpu.predict(&held_out).map_err(e)?,
    );
    let pred = rel(&pg, &pc);
    let peak = gpu
        .device_peak_bytes()
        .ok_or("no device peak measured on CUDA")?;
    let bytes = gpu.engine().checkpoint_to_bytes().map_err(e)?;
    let mut back = Executor::new(gpu.plan().clone(), &Device::cpu(), 0).map_err(e)?;
    back.load_checkpoint_from_bytes(&bytes).map_err(e)?;
    if back.checkpoint_to_bytes().map_err(e)? != bytes {
        return Err("a checkpoint from the device does not round-trip through the CPU".into());
    }
    // Looser than the emulation's bounds: cuBLAS sums in its own order over 20 steps.
    if max_gap > 1e-2 || gap(eg.loss, ec.loss) > 1e-2 || pred > 2e-2 {
        return Err(format!(
            "CUDA and CPU trainers differ: step losses by {max_gap:.2e}, evaluation {} vs {}, predictions by {pred:.2e}",
            eg.loss, ec.loss
        ));
    }
    Ok(format!(
        "{} steps, loss gap {max_gap:.2e}, evaluation {:.4}/{:.4}, predictions {pred:.2e}; device peak {} (plan {} + inference), checkpoint round-trips",
        hg.step_losses.len(),
        ec.loss,
        eg.loss,
        mib(peak),
        mib(gpu.plan().memory.total)
    ))
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

fn main() -> ExitCode {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_check: no CUDA device: {e}");
            return ExitCode::from(2);
        }
    };
    println!("device: {}", dev.name());
    let t0 = Instant::now();

    // 1. every op: random models, one step on both devices.
    let n = env("GPU_CHECK_MODELS", 40) as u64;
    let mut per_op: std::collections::BTreeMap<&'static str, (usize, f64)> = Default::default();
    let mut failures = Vec::new();
    for seed in 0..n {
        for (kind, spec) in [("chain", random_chain(seed)), ("dag", random_dag(seed))] {
            match one_step(&dev, &spec) {
                Ok((p, worst)) => {
                    for s in p.steps.iter() {
                        let e = per_op.entry(s.op.name()).or_default();
                        e.0 += 1;
                        e.1 = e.1.max(worst);
                    }
                }
                Err(e) => failures.push(format!("{kind} {seed}: {e}")),
            }
        }
    }
    println!(
        "ops: {} random models in {:.1}s",
        2 * n,
        t0.elapsed().as_secs_f64()
    );
    for f in &failures {
        println!("  FAILED {f}");
    }

    // 2. and 3. the three models.
    let steps = env("GPU_CHECK_STEPS", 200);
    let timed = env("GPU_CHECK_TIMED", 100);
    let mut trained = Vec::new();
    for (name, spec) in [
        ("mnist_mlp", zoo::mnist_mlp(env("GPU_CHECK_MLP_BATCH", 128))),
        ("convnet", convnet(env("GPU_CHECK_CONV_BATCH", 64))),
        ("vae", zoo::conv_vae(env("GPU_CHECK_VAE_BATCH", 128))),
    ] {
        let t = Instant::now();
        match train(&dev, name, &spec, steps, timed) {
            Ok(r) => {
                println!(
                    "{name}: trained {steps} steps on both devices in {:.1}s",
                    t.elapsed().as_secs_f64()
                );
                trained.push(r);
            }
            Err(e) => {
                println!("  FAILED {name}: {e}");
                failures.push(format!("{name}: {e}"));
            }
        }
    }

    println!();
    println!("== per op: CUDA vs CPU, largest relative L2 gradient error of the models using it");
    println!("{:<36} {:>7} {:>12}", "op", "models", "max rel err");
    for (op, (count, worst)) in &per_op {
        println!("{op:<36} {count:>7} {worst:>12.2e}");
    }
    println!();
    println!("== training: loss (CPU / CUDA) at a few steps, same seed and batches");
    for r in &trained {
        let l: Vec<String> = r
            .losses
            .iter()
            .map(|(s, c, g)| format!("{s}: {c:.4}/{g:.4}"))
            .collect();
        println!(
            "{:<10} batch {:<4} {}  max gap {:.2e}",
            r.name,
            r.batch,
            l.join("  "),
            r.max_gap
        );
    }
    println!();
    println!("== memory and speed");
    println!(
        "{:<10} {:>14} {:>14} {:>8} {:>12} {:>12} {:>12} {:>7}",
        "model",
        "estimate",
        "measured",
        "ratio",
        "cpu smp/s",
        "eager smp/s",
        "graph smp/s",
        "graph×"
    );
    for r in &trained {
        let (meas, ratio) = match r.measured {
            Some(m) => (mib(m), format!("{:.3}", m as f64 / r.estimate as f64)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<10} {:>14} {:>14} {:>8} {:>12.0} {:>12.0} {:>12.0} {:>7.2}",
            r.name,
            mib(r.estimate),
            meas,
            ratio,
            r.cpu_sps,
            r.eager_sps,
            r.graph_sps,
            r.graph_sps / r.eager_sps
        );
    }
    println!();
    println!("== Trainer on {} (CPU / CUDA)", dev.name());
    match trainer_check(&dev) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            println!("  FAILED trainer: {e}");
            failures.push(format!("trainer: {e}"));
        }
    }
    println!(
        "total {:.1}s; {} failures",
        t0.elapsed().as_secs_f64(),
        failures.len()
    );
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
