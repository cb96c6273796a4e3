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
use memwise_plan::layers::{LayerDef, OptValue, OptionDefault, OptionType, CATALOGUE};
use memwise_plan::spec::{Activation, LayerKind, LossKind, LossTerm, Padding};
use memwise_plan::{plan, zoo, DType, ModelSpec, Optimizer, Precision, StaticPlan};
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

/// The bound on a model's gradient error (relative L2, CUDA vs CPU): float32 throughout, or
/// with some 16-bit storage (each rounds its activations differently from the other).
fn bound(p: &StaticPlan) -> (&'static str, f64) {
    if p.tensors
        .iter()
        .any(|t| matches!(t.dtype, DType::F16 | DType::BF16))
    {
        ("16-bit", 3e-2)
    } else {
        ("f32", 1e-4)
    }
}

/// An error as the tables show it: "≈0" where every gradient was within 1e-5 of the
/// model's largest, element by element (noise level, not counted).
fn shown(err: f64) -> String {
    if err == 0.0 {
        "≈0".to_string()
    } else {
        format!("{err:.2e}")
    }
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-10 * b.len() as f64)).sqrt()
}

/// One step of a model on both devices: each trainable parameter's gradient error.
struct StepErrors {
    plan: StaticPlan,
    grads: Vec<GradError>,
    largest: f32,
}

/// One parameter's gradient, CUDA vs CPU.
struct GradError {
    name: String,
    /// Relative L2 error.
    err: f64,
    /// |CPU gradient|.
    size: f64,
    /// Every element within 1e-5 of the model's largest gradient: noise level, not counted.
    noise: bool,
    /// In a 16-bit model: how much 16-bit storage itself changes this gradient on the CPU
    /// (relative L2, the model in float32 vs as declared). Where a gradient is a near
    /// cancellation (a bias before a normalisation), 16-bit rounding alone moves it far, and
    /// two devices that round at different points may differ as much.
    precision: f64,
}

impl StepErrors {
    /// The largest counted error and where it is.
    fn worst(&self) -> (f64, String) {
        self.grads
            .iter()
            .filter(|g| !g.noise)
            .max_by(|a, b| a.err.total_cmp(&b.err))
            .map_or((0.0, String::new()), |g| {
                (
                    g.err,
                    format!(
                        "{}, |grad| {:.2e}, largest grad {:.2e}, 16-bit storage alone moves it {:.2e}",
                        g.name, g.size, self.largest, g.precision
                    ),
                )
            })
    }

    /// Whether a counted gradient is over its bound: the model's (`bound`) or, where larger,
    /// what 16-bit storage alone does to it.
    fn over(&self, bound: f64) -> bool {
        self.grads
            .iter()
            .any(|g| !g.noise && g.err > bound.max(g.precision))
    }
}

/// The CPU executor of `p` after one step on `raw` (its gradients).
fn cpu_grads(p: &StaticPlan, raw: &[Vec<u8>]) -> Result<Executor, String> {
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 11).map_err(|e| e.to_string())?;
    cpu.train_step(&batches(p, raw))
        .map_err(|e| format!("cpu: {e}"))?;
    Ok(cpu)
}

fn one_step(dev: &Device, spec: &ModelSpec) -> Result<StepErrors, String> {
    let p = plan(spec).map_err(|e| e.to_string())?;
    let raw = random_inputs(&p, 100);
    let cpu = cpu_grads(&p, &raw)?;
    let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 11).map_err(|e| e.to_string())?;
    gpu.train_step(&batches(&p, &raw))
        .map_err(|e| format!("cuda: {e}"))?;
    let f32_cpu = match bound(&p).0 {
        "f32" => None,
        _ => {
            let p32 = plan(&all_float32(spec)).map_err(|e| e.to_string())?;
            Some(cpu_grads(&p32, &raw)?)
        }
    };
    let mut grads = Vec::new();
    let mut largest = 0f32;
    for q in p.params.iter().filter(|q| q.trainable) {
        let cuda = gpu.grad(&q.name).map_err(|e| format!("cuda: {e}"))?;
        let host = cpu.grad(&q.name).map_err(|e| format!("cpu: {e}"))?;
        largest = host
            .iter()
            .map(|v| v.abs())
            .filter(|v| v.is_finite())
            .fold(largest, f32::max);
        let precision = match &f32_cpu {
            Some(c) => rel(&host, &c.grad(&q.name).map_err(|e| format!("cpu: {e}"))?),
            None => 0.0,
        };
        grads.push((q.name.to_string(), cuda, host, precision));
    }
    let grads = grads
        .into_iter()
        .map(|(name, a, b, precision)| GradError {
            noise: a
                .iter()
                .zip(&b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * largest),
            size: b.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt(),
            err: rel(&a, &b),
            name,
            precision,
        })
        .collect();
    Ok(StepErrors {
        plan: p,
        grads,
        largest,
    })
}

/// `spec` with every layer in float32.
fn all_float32(spec: &ModelSpec) -> ModelSpec {
    let mut all = spec.clone();
    all.precision = Precision::Float32;
    for l in &mut all.layers {
        l.dtype = None;
    }
    all
}

/// For a model over its bound: every gradient's error, then the model again with all layers
/// in float32, and with one 16-bit layer at a time made float32 — a change that brings the
/// error within the bound points at that layer's kernels.
fn diagnose(dev: &Device, spec: &ModelSpec, e: &StepErrors) {
    for g in &e.grads {
        let note = if g.noise { " (noise level)" } else { "" };
        println!(
            "    {:<32} {:.2e}  |grad| {:.2e}  16-bit alone {:.2e}{note}",
            g.name, g.err, g.size, g.precision
        );
    }
    let all = all_float32(spec);
    let show = |what: &str, s: &ModelSpec| match one_step(dev, s) {
        Ok(e) => println!("    {what:<40} worst {:.2e}", e.worst().0),
        Err(err) => println!("    {what:<40} {err}"),
    };
    show("every layer float32", &all);
    for l in &spec.layers {
        let half = e
            .plan
            .tensors
            .iter()
            .any(|t| *t.layer == *l.name && matches!(t.dtype, DType::F16 | DType::BF16));
        if half {
            let mut one = spec.clone();
            one.set_dtype(&l.name, DType::F32);
            show(&format!("`{}` float32", l.name), &one);
        }
    }
}

/// A value for a required option of a single-layer model (`None`: the check has no model
/// for the layer yet, and says so).
fn required_value(name: &str, ty: OptionType) -> Option<OptValue> {
    let n = match name {
        "units" | "output_dim" => 8,
        "filters" => 4,
        "kernel_size" => 3,
        "num_heads" => 2,
        "input_dim" => 16,
        "rate" => return Some(OptValue::Float(0.25)),
        "activation" => return Some(OptValue::Activation(Activation::Gelu)),
        "target_shape" => return Some(OptValue::Shape(vec![4, 4])),
        _ => return None,
    };
    Some(match ty {
        OptionType::Pair => OptValue::Pair([n, n]),
        _ => OptValue::Usize(n),
    })
}

/// One model per layer kind of the catalogue: the layer alone between inputs of a shape it
/// takes and a dense softmax head, so that an error names the layer's kernels. `dtype` is the
/// layer's (float16 or bfloat16 for the 16-bit variants); the head stays float32.
fn single_layer_model(def: &LayerDef, dtype: DType) -> Option<ModelSpec> {
    let mut given = Vec::new();
    for o in def.options {
        if let OptionDefault::Required { .. } = o.default {
            given.push((o.name, required_value(o.name, o.ty)?));
        } else if o.name == "groups" {
            given.push(("groups", OptValue::Usize(2)));
        }
    }
    let kind = def.build_with(&given);
    let (shape, inputs): (&[usize], usize) = match def.name {
        "input" => return None,
        "conv2d" | "conv2d_transpose" | "separable_conv2d" | "depthwise_conv2d" | "max_pool2d"
        | "avg_pool2d" | "batch_norm" | "group_norm" | "global_avg_pool" => (&[8, 8, 4], 1),
        "attention" | "positional_embedding" => (&[6, 8], 1),
        "add" | "concat" | "sample_normal" => (&[16], 2),
        _ => (&[16], 1),
    };
    let mut m = ModelSpec::new(&format!("single_{}", def.name), 16);
    // Each float input passes through a float32 layer with parameters first, so that the
    // layer's backward has a gradient to carry (that layer is checked alone too). No bias:
    // before a normalisation its true gradient is zero, and its error would be all noise.
    let mut pre = match shape.len() {
        3 => LayerKind::conv2d(4, 1, 1, Padding::Same, Activation::Linear),
        _ => LayerKind::dense(*shape.last().unwrap(), Activation::Linear),
    };
    if let LayerKind::Dense { use_bias, .. } | LayerKind::Conv2d { use_bias, .. } = &mut pre {
        *use_bias = false;
    }
    let mut names = Vec::new();
    for k in 0..inputs {
        let name = format!("x{k}");
        if def.name == "embedding" {
            m.input(&name, &[6], DType::I32, 1.0);
            names.push(name);
        } else {
            m.input(&name, shape, DType::F32, 1.0);
            names.push(m.add(&format!("pre{k}"), pre.clone(), &[&name]));
        }
    }
    m.input("labels", &[], DType::I32, 1.0);
    let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    m.add("layer", kind, &refs);
    m.set_dtype("layer", dtype);
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("probs", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "labels"]));
    Some(m)
}

/// Part 0: every layer kind alone, in float32, float16 and bfloat16, one step on both
/// devices.
fn single_layers(dev: &Device, failures: &mut Vec<String>) {
    println!("== every layer alone: CUDA vs CPU, relative L2 gradient error (bound)");
    for def in CATALOGUE {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let Some(spec) = single_layer_model(def, dtype) else {
                if dtype == DType::F32 && def.name != "input" {
                    println!("{:<22} no single-layer model in this check", def.name);
                }
                continue;
            };
            let line = match one_step(dev, &spec) {
                Ok(e) => {
                    let ((class, b), (worst, which)) = (bound(&e.plan), e.worst());
                    let verdict = if e.over(b) { "FAIL" } else { "pass" };
                    if e.over(b) {
                        failures.push(format!(
                            "layer {} {class}: {worst:.2e} > {b:.0e} ({which})",
                            def.name
                        ));
                    }
                    format!("{:>10} ({class} {b:.0e}) {verdict}", shown(worst))
                }
                Err(e) => {
                    failures.push(format!("layer {} {dtype:?}: {e}", def.name));
                    format!("FAIL {e}")
                }
            };
            println!("{:<22} {:<5} {line}", def.name, format!("{dtype:?}"));
        }
    }
}

/// Per op, over the random models that use it.
#[derive(Default)]
struct OpErrors {
    models: usize,
    f32_worst: f64,
    half_worst: f64,
    over: usize,
}

impl OpErrors {
    fn add(&mut self, f32_model: bool, worst: f64, over: bool) {
        self.models += 1;
        if f32_model {
            self.f32_worst = self.f32_worst.max(worst);
        } else {
            self.half_worst = self.half_worst.max(worst);
        }
        self.over += usize::from(over);
    }
}

/// Whether the last failure is a sticky device fault: the context is unusable after one, so
/// every later result would be noise.
fn sticky(failures: &[String]) -> bool {
    failures.last().is_some_and(|f| {
        [
            "ILLEGAL_ADDRESS",
            "LAUNCH_FAILED",
            "MISALIGNED_ADDRESS",
            "ILLEGAL_INSTRUCTION",
            "HARDWARE_STACK_ERROR",
            "INVALID_PC",
            "ASSERT",
        ]
        .iter()
        .any(|k| f.contains(k))
    })
}

fn stop(failures: &[String]) -> ExitCode {
    println!(
        "STOPPED at a sticky device fault (rerun with MEMWISE_CUDA_SYNC=1 to name its kernel): {}",
        failures.last().map(String::as_str).unwrap_or_default()
    );
    ExitCode::FAILURE
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

/// Steps between restarts of the device from the CPU's state in the training comparison.
const RESYNC: usize = 10;

/// The bound on a training loss's relative gap within `RESYNC` steps of one state. Not
/// tighter: RMSprop divides each gradient by its own running size, so a weight whose
/// gradients are rounding noise moves by a whole step in the noise's direction, and the two
/// devices' noise differs (the MLP's gap reached 6e-3 within 20 steps on an H200).
const LOSS_GAP: f64 = 1e-2;

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
    // A second device executor that never captures: its weights must equal the graph's. It
    // is built first, so that `gpu`'s measured memory is its own.
    let mut eager = CudaExecutor::on_cuda(p.clone(), dev, 5).map_err(|e| e.to_string())?;
    eager.kernels_mut().set_graph(false);
    let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 5).map_err(|e| e.to_string())?;
    let data: Vec<Vec<Vec<u8>>> = (0..8).map(|k| random_inputs(&p, 1000 + k)).collect();
    let (mut losses, mut max_gap, mut graph_vs_eager) = (Vec::new(), 0f64, 0f64);
    let t_cpu = Instant::now();
    for step in 0..steps {
        // Training amplifies rounding differences step by step (the two devices sum in
        // different orders), so the device restarts from the CPU's whole state (weights,
        // optimizer state, counters) every `RESYNC` steps: the gap measured is what a few
        // steps from one state make of it, not chaos. Loading also drops the graph, which
        // the next step captures again.
        if step % RESYNC == 0 && step > 0 {
            let state = cpu.checkpoint_to_bytes().map_err(|e| e.to_string())?;
            gpu.load_checkpoint_from_bytes(&state)
                .map_err(|e| format!("cuda loading the CPU's state: {e}"))?;
            eager
                .load_checkpoint_from_bytes(&state)
                .map_err(|e| format!("cuda loading the CPU's state: {e}"))?;
        }
        let b = batches(&p, &data[step % data.len()]);
        let lc = cpu
            .train_step(&b)
            .map_err(|e| format!("cpu step {step}: {e}"))?
            .loss;
        let lg = gpu
            .train_step(&b)
            .map_err(|e| format!("cuda step {step}: {e}"))?
            .loss;
        let le = eager
            .train_step(&b)
            .map_err(|e| format!("cuda eager step {step}: {e}"))?
            .loss;
        max_gap = max_gap.max(((lc - lg).abs() / lc.abs().max(1e-3)) as f64);
        graph_vs_eager = graph_vs_eager.max((lg - le).abs() as f64);
        if [0, steps / 4, steps / 2, steps - 1].contains(&step) {
            losses.push((step + 1, lc, lg));
        }
    }
    for q in p.params.iter().filter(|q| q.trainable) {
        let (a, b) = (gpu.param(&q.name), eager.param(&q.name));
        if a.map_err(|e| e.to_string())? != b.map_err(|e| e.to_string())? {
            return Err(format!(
                "the graph's weights differ from eager launches' ({})",
                q.name
            ));
        }
    }
    if graph_vs_eager > 0.0 {
        return Err(format!(
            "graph and eager losses differ by {graph_vs_eager:e}"
        ));
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
    let used = |t: &Trainer| t.engine().device_bytes_used().map_or("-".into(), mib);
    let mut stages = vec![format!("built {}", used(&gpu))];
    let hg = gpu
        .fit(&train, Some(&held_out), &opts, &mut [])
        .map_err(e)?;
    stages.push(format!("fit (with validation) {}", used(&gpu)));
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
    stages.push(format!("evaluate {}", used(&gpu)));
    let (pc, pg) = (
        cpu.predict(&held_out).map_err(e)?,
        gpu.predict(&held_out).map_err(e)?,
    );
    stages.push(format!("predict {}", used(&gpu)));
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
        "{} steps, loss gap {max_gap:.2e}, evaluation {:.4}/{:.4}, predictions {pred:.2e}; device peak {} (plan {} + inference), checkpoint round-trips\n  device memory in use after: {}",
        hg.step_losses.len(),
        ec.loss,
        eg.loss,
        mib(peak),
        mib(gpu.plan().memory.total),
        stages.join(", ")
    ))
}

/// PyTorch's figures: (model, batch) → (samples/s, max_memory_allocated in bytes).
type TorchRows = std::collections::HashMap<(String, usize), (f64, u64)>;

/// PyTorch's figures from `torch_bench.py`'s output (the file the environment variable
/// `var` names): (model, batch) → (samples/s, max_memory_allocated in bytes).
fn torch_rows(var: &str) -> TorchRows {
    let text = std::env::var(var)
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // torch NAME batch B SPS samples/s max_memory_allocated MIB MiB
            if w.len() < 8 || w[0] != "torch" || w[2] != "batch" {
                return None;
            }
            let mib: f64 = w[7].parse().ok()?;
            Some((
                (w[1].to_string(), w[3].parse().ok()?),
                (w[4].parse().ok()?, (mib * (1u64 << 20) as f64) as u64),
            ))
        })
        .collect()
}

/// The device memory of a model at `batch`, after a few steps (the graph captured): the
/// plan's estimate and what the device measured.
fn memory_at(dev: &Device, spec: &ModelSpec) -> Result<(u64, u64), String> {
    let p = plan(spec).map_err(|e| e.to_string())?;
    let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 5).map_err(|e| e.to_string())?;
    let data = random_inputs(&p, 77);
    for _ in 0..3 {
        gpu.train_step(&batches(&p, &data))
            .map_err(|e| e.to_string())?;
    }
    let measured = gpu
        .device_bytes_used()
        .ok_or("the device reports no memory figures")?;
    Ok((p.persistent_bytes + p.arena_bytes, measured))
}

/// One row of the memory table: model, batch, and (estimate, measured) or why not.
type MemoryRow<'a> = (&'a str, usize, Result<(u64, u64), String>);

/// Part 3: estimate vs measured, at the timed batches and at large ones (where the driver's
/// 2 MiB granularity is lost in the total), next to PyTorch's `max_memory_allocated`.
/// PyTorch's figure counts its cuBLAS workspace; memwise's is allocated with the device's
/// lane, before the model, and shown on its own.
fn memory_table(dev: &Device, trained: &[Trained], small: &TorchRows, failures: &mut Vec<String>) {
    let big = torch_rows("GPU_CHECK_TORCH_MEM");
    let ws = memwise_kernels::cuda::lane::CUBLAS_WORKSPACE_BYTES as u64;
    println!(
        "== device memory (memwise's cuBLAS workspace, {} per engine, not in these figures)",
        mib(ws)
    );
    println!(
        "{:<10} {:>5} {:>12} {:>12} {:>7} {:>14} {:>9} {:>12}",
        "model",
        "batch",
        "estimate",
        "measured",
        "meas/est",
        "PT max_alloc",
        "meas/PT",
        "(meas+ws)/PT"
    );
    let mut rows: Vec<MemoryRow> = trained
        .iter()
        .map(|r| {
            (
                r.name,
                r.batch,
                r.measured.map(|m| (r.estimate, m)).ok_or("-".into()),
            )
        })
        .collect();
    for (name, spec) in [
        (
            "mnist_mlp",
            zoo::mnist_mlp(env("GPU_CHECK_MEM_MLP_BATCH", 16384)),
        ),
        ("convnet", convnet(env("GPU_CHECK_MEM_CONV_BATCH", 2048))),
        ("vae", zoo::conv_vae(env("GPU_CHECK_MEM_VAE_BATCH", 2048))),
    ] {
        rows.push((name, spec.batch, memory_at(dev, &spec)));
    }
    for (name, batch, row) in rows {
        let (est, meas) = match row {
            Ok(r) => r,
            Err(e) => {
                println!("{name:<10} {batch:>5} {e}");
                if e != "-" {
                    failures.push(format!("memory {name} {batch}: {e}"));
                }
                continue;
            }
        };
        let pt = big
            .get(&(name.to_string(), batch))
            .or(small.get(&(name.to_string(), batch)));
        let ratio = |x: u64| pt.map_or("-".into(), |t| format!("{:.3}", x as f64 / t.1 as f64));
        println!(
            "{name:<10} {batch:>5} {:>12} {:>12} {:>7.3} {:>14} {:>9} {:>12}",
            mib(est),
            mib(meas),
            meas as f64 / est as f64,
            pt.map_or("-".into(), |t| mib(t.1)),
            ratio(meas),
            ratio(meas + ws),
        );
    }
    println!();
}

/// `GPU_CHECK_PROBE=1`: where the device memory goes, in a fresh process — the memory in use
/// (total − free) after each stage of two training engines and an inference engine.
fn memory_probe(dev: &Device) -> Result<(), String> {
    let cuda = memwise_runtime::cuda::device::open(0).map_err(|e| e.to_string())?;
    let used = || -> u64 { cuda.mem_get_info().map(|(f, t)| t - f).unwrap_or_default() };
    let mut last = used();
    let mut stage = |what: &str| {
        let now = used();
        println!(
            "probe {what:<44} in use {:>12}  +{}",
            mib(now),
            mib(now.saturating_sub(last))
        );
        last = now;
    };
    stage("device open");
    let lane = memwise_kernels::cuda::lane::Lane::open(cuda.clone())?;
    stage("one lane (stream, cuBLAS handle, workspace)");
    drop(lane);
    stage("lane dropped");
    let spec = zoo::mnist_mlp(64);
    let p = plan(&spec).map_err(|e| e.to_string())?;
    let data = random_inputs(&p, 3);
    for engine in ["first", "second"] {
        let mut gpu = CudaExecutor::on_cuda(p.clone(), dev, 5).map_err(|e| e.to_string())?;
        stage(&format!("{engine} training engine built"));
        for k in 0..3 {
            gpu.train_step(&batches(&p, &data))
                .map_err(|e| e.to_string())?;
            stage(&format!("{engine} engine step {k} (1: captured)"));
        }
        std::mem::forget(gpu);
    }
    let ip = memwise_plan::plan_inference(&spec.with_batch(200)).map_err(|e| e.to_string())?;
    let mut inf = CudaExecutor::on_cuda(ip.clone(), dev, 5).map_err(|e| e.to_string())?;
    stage("inference engine on a lane of its own");
    let idata = random_inputs(&ip, 4);
    inf.evaluate_step(&batches(&ip, &idata))
        .map_err(|e| e.to_string())?;
    stage("its step");
    let mut trainer = Trainer::build(&spec, dev, 7).map_err(|e| e.to_string())?;
    stage("a Trainer built (its lane and plan)");
    let (train, held_out) = (random_digits(640, 3), random_digits(200, 4));
    let opts = FitOptions {
        epochs: 1,
        seed: 5,
        verbose: false,
        ..Default::default()
    };
    trainer
        .fit(&train, Some(&held_out), &opts, &mut [])
        .map_err(|e| e.to_string())?;
    stage("fit with validation (inference engines share its lane)");
    Ok(())
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
    if env("GPU_CHECK_PROBE", 0) == 1 {
        return match memory_probe(&dev) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("probe failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let t0 = Instant::now();

    let mut failures = Vec::new();
    single_layers(&dev, &mut failures);
    if sticky(&failures) {
        return stop(&failures);
    }

    // 1. every op: random models, one step on both devices.
    let n = env("GPU_CHECK_MODELS", 40) as u64;
    let mut per_op: std::collections::BTreeMap<&'static str, OpErrors> = Default::default();
    for seed in 0..n {
        for (kind, spec) in [("chain", random_chain(seed)), ("dag", random_dag(seed))] {
            match one_step(&dev, &spec) {
                Ok(e) => {
                    let ((class, b), (worst, which)) = (bound(&e.plan), e.worst());
                    let over = e.over(b);
                    if over {
                        failures.push(format!(
                            "{kind} {seed} ({class}): {worst:.2e} > {b:.0e} ({which})"
                        ));
                        println!("FAILED {kind} {seed} ({class}): {worst:.2e} > {b:.0e}");
                        diagnose(&dev, &spec, &e);
                    }
                    let p = e.plan;
                    let ops: std::collections::BTreeSet<&'static str> =
                        p.steps.iter().map(|s| s.op.name()).collect();
                    for op in ops {
                        per_op
                            .entry(op)
                            .or_default()
                            .add(class == "f32", worst, over);
                    }
                }
                Err(e) => failures.push(format!("{kind} {seed}: {e}")),
            }
            if sticky(&failures) {
                return stop(&failures);
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
                if r.max_gap > LOSS_GAP {
                    failures.push(format!(
                        "{name}: losses differ by {:.2e} (bound {LOSS_GAP:e})",
                        r.max_gap
                    ));
                }
                trained.push(r);
            }
            Err(e) => {
                println!("  FAILED {name}: {e}");
                failures.push(format!("{name}: {e}"));
            }
        }
    }

    println!();
    println!(
        "== per op: CUDA vs CPU, largest relative L2 gradient error of the random models using it"
    );
    println!("   (over: models past their bound; a 16-bit model's gradient may differ by as much as 16-bit storage alone moves it on the CPU)");
    println!(
        "{:<36} {:>7} {:>10} {:>10} {:>8}",
        "op", "models", "f32 ≤1e-4", "16-bit ≤3e-2", "over"
    );
    for (op, e) in &per_op {
        println!(
            "{op:<36} {:>7} {:>10} {:>12} {:>8}",
            e.models,
            shown(e.f32_worst),
            shown(e.half_worst),
            e.over
        );
    }
    println!();
    println!(
        "== training: loss (CPU / CUDA) at a few steps, same seed and batches; the device restarts from the CPU's state every {RESYNC} steps (gap bound {LOSS_GAP:e}); a second device engine without the graph gives bit-identical weights"
    );
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
    let torch = torch_rows("GPU_CHECK_TORCH");
    println!("== speed (samples/s; PyTorch eager on the same GPU, same batch)");
    println!(
        "{:<10} {:>5} {:>10} {:>12} {:>12} {:>7} {:>12} {:>9}",
        "model", "batch", "cpu", "eager", "graph", "graph×", "PyTorch", "graph/PT"
    );
    for r in &trained {
        let pt = torch.get(&(r.name.to_string(), r.batch));
        println!(
            "{:<10} {:>5} {:>10.0} {:>12.0} {:>12.0} {:>7.2} {:>12} {:>9}",
            r.name,
            r.batch,
            r.cpu_sps,
            r.eager_sps,
            r.graph_sps,
            r.graph_sps / r.eager_sps,
            pt.map_or("-".into(), |t| format!("{:.0}", t.0)),
            pt.map_or("-".into(), |t| format!("{:.2}", r.graph_sps / t.0)),
        );
    }
    println!();
    memory_table(&dev, &trained, &torch, &mut failures);
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
