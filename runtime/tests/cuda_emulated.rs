//! The CUDA executor without a GPU: `GpuExecutor` (the one walk over `CudaKernels`) over a
//! backend whose "device memory" is host memory, whose kernels are the `.cu` sources run by
//! the host emulation (`memwise-cuda-emu`) and whose GEMMs are the column-major reference of
//! `cublas_map` — everything the CUDA backend does except the silicon. Every model trains next
//! to the CPU executor from the same seed and inputs; losses, gradients and weights must agree.
//!
//! The whole `Trainer` (fit, evaluate, predict, the device-memory peak) runs over the emulated
//! engine too, next to a CPU trainer, and checkpoints move between the two.
//!
//! The backend also records "graphs" the way stream capture does (launches are recorded, not
//! run) and replays them, so the whole-step capture is checked too: a per-step value baked
//! into a launch would make the replayed steps differ. It holds a capture to CUDA's rules: a
//! host copy, an allocation, a synchronisation or a memory query inside a capture is an error,
//! and so is a kernel (or a cuBLAS GEMM of a kind) launched for the first time inside one —
//! with CUDA's lazy loading its module would be loaded there. A sticky device error (an
//! illegal address) can be injected: every later call fails, as on a GPU.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

use half::{bf16, f16};
use memwise_kernels::cublas_map::{self as cm, CublasGemm, GemmBuffers};
use memwise_kernels::cuda::{Float, KernelCall};
use memwise_plan::data_parallel::Sharding;
use memwise_plan::generate::{random_chain, random_dag};
use memwise_plan::{plan, zoo, DType, ModelSpec, Precision, StaticPlan};
use memwise_runtime::collective::{Collective, DeviceCollective, ThreadGroup, Threads};
use memwise_runtime::cuda::{scalars_bytes, Backend, GpuExecutor};
use memwise_runtime::monitor::MemoryMonitor;
use memwise_runtime::reference::{random_digits, random_inputs};
use memwise_runtime::train::epoch_line;
use memwise_runtime::{Batch, Device, Engine, Executor, FitOptions, Trainer};

#[derive(Debug)]
enum Cmd {
    Launch(KernelCall),
    Gemm(CublasGemm, GemmBuffers),
    Memset(u64, usize, u8),
}

/// Memory of the emulated device: 64 GiB, of which `used` bytes are allocated by the backends
/// that share it (a backend and those it opens with `open_another`, as on one GPU).
const EMU_DEVICE_BYTES: u64 = 64 << 30;

/// The emulated collective stream's handle (`Backend::fork_collective`).
const EMU_COLLECTIVE_STREAM: u64 = 1;

/// A job on the emulated collective stream.
type CollectiveJob = Box<dyn FnOnce() -> memwise_runtime::Result<()>>;

thread_local! {
    /// The emulated collective stream of this thread's device: a device collective enqueued
    /// on it waits here until the backend's stream joins it (`join_collectives`), as on a GPU
    /// it runs beside the launches that follow. A launch that read a gradient before the join
    /// would read it unsummed, and the replicas would drift from the host path's weights.
    static COLLECTIVE_STREAM: RefCell<Vec<CollectiveJob>> = RefCell::new(Vec::new());
}

#[derive(Default)]
struct EmuBackend {
    blocks: Vec<(*mut u8, Layout)>,
    recording: RefCell<Option<Vec<Cmd>>>,
    graph: Vec<Cmd>,
    launches: RefCell<u64>,
    used: Rc<Cell<u64>>,
    /// Captures begun, and how many of the next ones fail when they end (an injected fault:
    /// what an illegal call inside a real capture does).
    captures: Cell<u64>,
    failing_captures: Cell<u64>,
    /// Kernels and kinds of GEMM run outside a capture so far (their modules are loaded).
    loaded: RefCell<std::collections::BTreeSet<String>>,
    /// Calls that break a capture's rules but cannot return an error (memory queries).
    violations: RefCell<Vec<String>>,
    /// After this many launches the device has a sticky error (injected): the launch that
    /// reaches it, and every call after it, fail.
    sticky_after: Cell<Option<u64>>,
}

impl Drop for EmuBackend {
    fn drop(&mut self) {
        for &(p, l) in &self.blocks {
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { dealloc(p, l) };
            self.used.set(self.used.get() - l.size() as u64);
        }
    }
}

unsafe fn slice<'a, T>(addr: u64, n: usize) -> &'a [T] {
    std::slice::from_raw_parts(addr as *const T, n)
}
#[allow(clippy::mut_from_ref)]
unsafe fn slice_mut<'a, T>(addr: u64, n: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(addr as *mut T, n)
}

/// cuBLAS leaves a GEMM whose output overlaps an input undefined: the bytes `C` spans must
/// not meet those `A` or `B` span (spans from the first to one past the last element).
fn gemm_output_apart(g: &CublasGemm, b: &GemmBuffers) -> Result<(), String> {
    let e = g.extents();
    let span = |base: u64, first: usize, end: usize, t: Float| {
        let size = t.size() as u64;
        (base + first as u64 * size, base + end as u64 * size)
    };
    let a = span(b.a, g.a.1, e[0].1, b.types[0]);
    let bb = span(b.b, g.b.1, e[1].1, b.types[1]);
    let c = span(b.c, g.c.1, e[2].1, b.types[2]);
    for (name, x) in [("A", a), ("B", bb)] {
        if x.0 < c.1 && c.0 < x.1 {
            return Err(format!(
                "GEMM {}×{}×{}: its output C {c:x?} overlaps its input {name} {x:x?}",
                g.m, g.n, g.k
            ));
        }
    }
    Ok(())
}

/// What a capture must not be the first to use: a kernel, or a kind of cuBLAS GEMM.
fn lazily_loaded(c: &Cmd) -> Option<String> {
    match c {
        Cmd::Launch(call) => Some(call.name.clone()),
        Cmd::Gemm(g, b) => Some(format!("gemm {:?} {} {}", b.types, g.transa, g.transb)),
        Cmd::Memset(..) => None,
    }
}

impl EmuBackend {
    /// The injected sticky error, once it has happened.
    fn sticky(&self) -> Result<(), String> {
        match self.sticky_after.get() {
            Some(n) if *self.launches.borrow() >= n => {
                Err("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access (injected)".into())
            }
            _ => Ok(()),
        }
    }

    unsafe fn run(&self, c: &Cmd) -> Result<(), String> {
        self.sticky()?;
        *self.launches.borrow_mut() += 1;
        match c {
            Cmd::Launch(call) => memwise_cuda_emu::launch(
                &call.name,
                call.cfg.grid,
                call.cfg.block,
                &call.params(),
                &call.signature(),
            ),
            Cmd::Memset(dst, n, value) => {
                std::ptr::write_bytes(*dst as *mut u8, *value, *n);
                Ok(())
            }
            Cmd::Gemm(g, GemmBuffers { a, b, c, types: t }) => {
                let e = g.extents();
                macro_rules! go {
                    ($A:ty, $C:ty) => {
                        cm::reference_gemm::<$A, $A, $C>(
                            g,
                            slice(*a, e[0].1),
                            slice(*b, e[1].1),
                            slice_mut(*c, e[2].1),
                        )
                    };
                }
                match t {
                    [Float::F32, Float::F32, Float::F32] => go!(f32, f32),
                    [Float::F16, Float::F16, Float::F16] => go!(f16, f16),
                    [Float::F16, Float::F16, Float::F32] => go!(f16, f32),
                    [Float::Bf16, Float::Bf16, Float::Bf16] => go!(bf16, bf16),
                    [Float::Bf16, Float::Bf16, Float::F32] => go!(bf16, f32),
                    other => return Err(format!("no GEMM for {other:?}")),
                }
                Ok(())
            }
        }
    }

    unsafe fn submit(&self, c: Cmd) -> Result<(), String> {
        let first_use = lazily_loaded(&c);
        if let Some(rec) = self.recording.borrow_mut().as_mut() {
            if let Some(name) = first_use.filter(|n| !self.loaded.borrow().contains(n)) {
                return Err(format!(
                    "`{name}` first used inside a graph capture (its module would load there)"
                ));
            }
            rec.push(c);
            return Ok(());
        }
        self.loaded.borrow_mut().extend(first_use);
        self.run(&c)
    }

    fn no_capture(&self, what: &str) -> Result<(), String> {
        if self.recording.borrow().is_some() {
            Err(format!("{what} inside a graph capture"))
        } else {
            self.sticky()
        }
    }
}

impl Backend for EmuBackend {
    fn name(&self) -> String {
        "emulated".into()
    }
    fn memory(&self) -> Option<(u64, u64)> {
        if self.no_capture("a memory query").is_err() {
            self.violations
                .borrow_mut()
                .push("a memory query inside a capture".into());
        }
        Some((EMU_DEVICE_BYTES - self.used.get(), EMU_DEVICE_BYTES))
    }
    fn alloc(&mut self, bytes: usize) -> Result<u64, String> {
        self.no_capture("an allocation")?;
        let l = Layout::from_size_align(bytes.max(1), 256).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(l) };
        self.blocks.push((p, l));
        self.used.set(self.used.get() + l.size() as u64);
        Ok(p as u64)
    }
    unsafe fn upload(&self, src: &[u8], dst: u64) -> Result<(), String> {
        self.no_capture("a host-to-device copy")?;
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len());
        Ok(())
    }
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        self.no_capture("a device-to-host copy")?;
        std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len());
        Ok(())
    }
    unsafe fn memset(&self, dst: u64, bytes: usize, value: u8) -> Result<(), String> {
        self.submit(Cmd::Memset(dst, bytes, value))
    }
    unsafe fn launch(&self, call: &KernelCall) -> Result<(), String> {
        self.submit(Cmd::Launch(call.clone()))
    }
    unsafe fn gemm(&self, g: &CublasGemm, bufs: GemmBuffers) -> Result<(), String> {
        g.validate()?;
        gemm_output_apart(g, &bufs)?;
        self.submit(Cmd::Gemm(*g, bufs))
    }
    fn synchronize(&self) -> Result<(), String> {
        self.no_capture("a synchronisation")
    }
    fn begin_capture(&mut self) -> Result<bool, String> {
        *self.recording.borrow_mut() = Some(Vec::new());
        self.captures.set(self.captures.get() + 1);
        Ok(true)
    }
    fn end_capture(&mut self) -> Result<(), String> {
        let recorded = self.recording.borrow_mut().take().ok_or("not capturing")?;
        if self.failing_captures.get() > 0 {
            self.failing_captures.set(self.failing_captures.get() - 1);
            return Err("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (injected)".into());
        }
        self.graph = recorded;
        Ok(())
    }
    fn replay(&self) -> Result<(), String> {
        for c in &self.graph {
            // SAFETY: recorded from launches the executor made on its own regions.
            unsafe { self.run(c)? };
        }
        Ok(())
    }
    fn clear_graph(&mut self) {
        self.graph.clear();
    }
    fn fork_collective(&self) -> Result<Option<u64>, String> {
        // Data-parallel steps are never captured.
        self.no_capture("a collective")?;
        Ok(Some(EMU_COLLECTIVE_STREAM))
    }
    fn join_collectives(&self) -> Result<(), String> {
        // What the collective stream holds runs now, before any later launch.
        let pending = COLLECTIVE_STREAM.with(|q| std::mem::take(&mut *q.borrow_mut()));
        pending
            .into_iter()
            .try_for_each(|job| job().map_err(|e| e.to_string()))
    }
    fn open_another(&self) -> Result<EmuBackend, String> {
        let mut b = EmuBackend::default();
        b.used = self.used.clone();
        Ok(b)
    }
}

fn cast<T>(r: &[u8]) -> &[T] {
    assert_eq!(r.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: plain-old-data, aligned (checked), length in whole elements.
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

/// `e <= tol`, false for NaN.
fn within(e: f64, tol: f64) -> bool {
    e <= tol
}

/// Relative L2 distance of `a` from `b`, with a floor of 1e-5 per element on the norm of `b`
/// (a gradient that cancels to rounding noise, like a layer norm over one feature, is not
/// compared digit for digit).
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-10 * b.len() as f64)).sqrt()
}

/// Trains `spec` for `steps` steps on the CPU and on the emulated device (graph on or off).
/// Every step's loss must agree; after the first step every gradient and weight. Tolerances:
/// float32 models agree to f32 rounding of different summation orders, 16-bit models to a
/// few ulps of their storage. A gradient that is rounding noise — a sum that cancels, like a
/// layer norm over one feature, below 1e-5 of the model's largest gradient — is not compared
/// digit for digit, and neither is the weight an optimizer moved by it.
fn compare(name: &str, spec: &ModelSpec, steps: usize, graph: bool) -> Result<(), String> {
    let p = plan(spec).map_err(|e| format!("{name}: plan: {e}"))?;
    let half = p
        .tensors
        .iter()
        .any(|t| t.dtype == DType::F16 || t.dtype == DType::BF16);
    let bf = p.tensors.iter().any(|t| t.dtype == DType::BF16);
    let (loss_tol, tol) = if bf {
        (3e-2, 1e-1)
    } else if half {
        (1e-2, 3e-2)
    } else {
        (1e-4, 2e-3)
    };
    let mut cpu =
        Executor::new(p.clone(), &Device::cpu(), 11).map_err(|e| format!("{name}: cpu: {e}"))?;
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 11)
        .map_err(|e| format!("{name}: gpu: {e}"))?;
    gpu.kernels_mut().set_graph(graph);
    for step in 0..steps {
        let raw = random_inputs(&p, 100 + step as u64);
        let b = batches(&p, &raw);
        let oc = cpu
            .train_step(&b)
            .map_err(|e| format!("{name}: cpu step {step}: {e}"))?;
        let og = gpu
            .train_step(&b)
            .map_err(|e| format!("{name}: gpu step {step}: {e}"))?;
        if oc.skipped != og.skipped {
            return Err(format!(
                "{name} step {step}: skipped {} on the CPU, {} on the device",
                oc.skipped, og.skipped
            ));
        }
        let dl = (oc.loss - og.loss).abs() / oc.loss.abs().max(1e-3);
        if !(within(dl as f64, loss_tol) || oc.loss.is_nan() && og.loss.is_nan()) {
            return Err(format!(
                "{name} step {step}: loss {} on the CPU, {} on the device",
                oc.loss, og.loss
            ));
        }
        if oc.correct != og.correct && !half {
            return Err(format!(
                "{name} step {step}: {} correct on the CPU, {} on the device",
                oc.correct, og.correct
            ));
        }
        if step == 0 {
            compare_weights(name, &p, &cpu, &gpu, tol)?;
        }
    }
    let violations = gpu.kernels().backend().violations.borrow().clone();
    if !violations.is_empty() {
        return Err(format!("{name}: capture rules broken: {violations:?}"));
    }
    if graph && steps > 1 && gpu.kernels().graph_replays() != steps as u64 - 1 {
        return Err(format!(
            "{name}: {} of {steps} steps replayed the graph",
            gpu.kernels().graph_replays()
        ));
    }
    if !half && steps > 1 {
        compare_weights(name, &p, &cpu, &gpu, 10.0 * tol)?;
    }
    // After a training step the prediction's bytes may already hold a later tensor, so both
    // executors refuse to read it (predictions are compared through inference plans, in the
    // Trainer test below).
    if p.prediction != memwise_plan::NONE {
        let mut out = vec![0f32; p.tensor(p.prediction).elems()];
        let (g, c) = (gpu.read_prediction(&mut out), cpu.read_prediction(&mut out));
        match (g, c) {
            (Err(g), Err(c)) if g.to_string() == c.to_string() => {}
            (g, c) => {
                return Err(format!(
                    "{name}: reading the prediction of a training plan: gpu {g:?}, cpu {c:?}"
                ))
            }
        }
    }
    Ok(())
}

fn compare_weights(
    name: &str,
    p: &StaticPlan,
    cpu: &Executor,
    gpu: &GpuExecutor<EmuBackend>,
    tol: f64,
) -> Result<(), String> {
    let gmax = p
        .params
        .iter()
        .filter(|q| q.trainable)
        .flat_map(|q| {
            cpu.grad(&q.name)
                .unwrap()
                .iter()
                .map(|g| g.abs())
                .collect::<Vec<_>>()
        })
        .filter(|g| g.is_finite())
        .fold(0f32, f32::max);
    for prm in p.params.iter() {
        if prm.trainable {
            let (ga, gb) = (
                gpu.grad(&prm.name).unwrap(),
                cpu.grad(&prm.name).unwrap().to_vec(),
            );
            let e = rel(&ga, &gb);
            let noise = ga
                .iter()
                .zip(&gb)
                .all(|(a, b)| (a - b).abs() <= 1e-5 * gmax);
            if noise && !within(e, tol) {
                continue;
            }
            if !within(e, tol) && gb.iter().all(|v| v.is_finite()) {
                return Err(format!(
                    "{name}: gradient of `{}` differs by {e:.2e} (relative L2)",
                    prm.name
                ));
            }
        }
        let (a, b) = (
            gpu.param(&prm.name).unwrap(),
            cpu.param(&prm.name).unwrap().to_vec(),
        );
        let e = rel(&a, &b);
        if !within(e, tol) {
            return Err(format!(
                "{name}: parameter `{}` differs by {e:.2e} (relative L2)",
                prm.name
            ));
        }
    }
    Ok(())
}

#[test]
fn mnist_mlp_trains_the_same_on_the_emulated_device() {
    compare("mnist_mlp", &zoo::mnist_mlp(16), 3, true).unwrap();
    compare("mnist_mlp (no graph)", &zoo::mnist_mlp(16), 2, false).unwrap();
}

#[test]
fn conv_vae_trains_the_same_on_the_emulated_device() {
    compare("conv_vae", &zoo::conv_vae(2), 2, true).unwrap();
}

/// Random chains and DAGs from the planner's generators: every layer kind, checkpoints,
/// in-place ops, mixed precision.
#[test]
fn random_models_train_the_same_on_the_emulated_device() {
    let n: u64 = std::env::var("MEMWISE_EMU_MODELS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut failures = Vec::new();
    let mut ops = std::collections::BTreeSet::new();
    for seed in 0..n {
        for (kind, spec) in [("chain", random_chain(seed)), ("dag", random_dag(seed))] {
            if let Ok(p) = plan(&spec) {
                ops.extend(p.steps.iter().map(|s| s.op.name()));
            }
            if let Err(e) = compare(&format!("{kind} {seed}"), &spec, 2, seed % 2 == 0) {
                failures.push(e);
            }
        }
    }
    println!("ops covered: {ops:?}");
    assert!(
        failures.is_empty(),
        "{} of {} models differ:\n{}",
        failures.len(),
        2 * n,
        failures.join("\n")
    );
}

/// The poisoned arena on the emulated device: every tensor overwritten with NaN the instant
/// its life ends, and the arena's padding (bytes no tensor occupies) NaN before every step. A
/// kernel that reads past its tensor, or a tensor the plan freed too early, then changes the
/// result; it must not: the poisoned device trains bit for bit as the plain one, eager and
/// through the captured graph (the poisoning is recorded into it).
#[test]
fn a_poisoned_arena_trains_the_same_on_the_emulated_device() {
    let mut models: Vec<(String, ModelSpec)> = (0..6)
        .flat_map(|seed| {
            [("chain", random_chain(seed)), ("dag", random_dag(seed))]
                .map(|(k, m)| (format!("{k} {seed}"), m))
        })
        .collect();
    models.extend(
        new_layer_models()
            .into_iter()
            .map(|(n, m)| (n.to_string(), m)),
    );
    let mut checked = 0;
    for (i, (name, spec)) in models.iter().enumerate() {
        let Ok(p) = plan(spec) else { continue };
        let padding: u64 = p.arena_padding().iter().map(|g| g.1).sum();
        let run = |poisoned: bool| {
            let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 5)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            gpu.kernels_mut().set_graph(i % 2 == 0);
            if poisoned {
                gpu.enable_poisoning().unwrap();
            }
            let losses: Vec<u32> = (0..2)
                .map(|step| {
                    let raw = random_inputs(&p, 40 + step);
                    let out = gpu
                        .train_step(&batches(&p, &raw))
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    out.loss.to_bits()
                })
                .collect();
            let params: Vec<Vec<u32>> = p
                .params
                .iter()
                .map(|q| {
                    gpu.param(&q.name)
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect();
            (losses, params)
        };
        let (plain, poisoned) = (run(false), run(true));
        assert_eq!(
            plain.0, poisoned.0,
            "{name}: losses differ with a poisoned arena"
        );
        for (q, (a, b)) in p.params.iter().zip(plain.1.iter().zip(&poisoned.1)) {
            assert!(
                a == b,
                "{name}: parameter `{}` differs with a poisoned arena",
                q.name
            );
        }
        println!("{name}: same bits; {padding} bytes of padding poisoned");
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} models planned");
}

/// The layers and activations added through the catalogue and the one walk (issue 13), each
/// in a model of its own, in float32 and mixed precision: the emulated device must train them
/// as the CPU does. The random generators do not draw them (their plans are pinned), so they
/// are named here.
fn new_layer_models() -> Vec<(&'static str, ModelSpec)> {
    use memwise_plan::{Activation as A, LayerKind, LossKind, LossTerm};
    let mut out = Vec::new();
    for precision in [Precision::Float32, Precision::MixedFloat16] {
        let mut m = ModelSpec::new("Activations", 4);
        m.precision = precision;
        m.input("x", &[24], DType::F32, 1.0);
        m.input("y", &[8], DType::F32, 1.0);
        m.add(
            "leaky",
            LayerKind::dense(32, A::LeakyRelu { alpha: 0.1 }),
            &["x"],
        );
        m.add("elu", LayerKind::dense(32, A::Elu { alpha: 0.7 }), &[]);
        m.add(
            "leaky_default",
            LayerKind::Activation(A::parse("leaky_relu").unwrap()),
            &[],
        );
        m.add("out", LayerKind::dense(8, A::Linear), &[]);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "y"]));
        out.push(("activations", m));

        let mut m = ModelSpec::new("RmsNorm", 4);
        m.precision = precision;
        m.input("x", &[6, 20], DType::F32, 1.0);
        m.input("y", &[6, 8], DType::F32, 1.0);
        m.add("proj", LayerKind::dense(16, A::Linear), &["x"]);
        m.add("rms", LayerKind::rms_norm(), &[]);
        m.add("out", LayerKind::dense(8, A::Linear), &[]);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "y"]));
        out.push(("rms_norm", m));

        // A small convnet with group norm in two groups and in one group per channel (Keras's
        // InstanceNorm), batch 3 so that per-sample statistics differ from batch ones.
        let mut m = ModelSpec::new("GroupNorm", 3);
        m.precision = precision;
        m.input("image", &[6, 6, 3], DType::U8, 1.0 / 255.0);
        m.input("label", &[], DType::I32, 1.0);
        let conv = |f| LayerKind::conv2d(f, 3, 1, memwise_plan::Padding::Same, A::Linear);
        m.add("conv", conv(8), &["image"]);
        m.add(
            "gn",
            LayerKind::GroupNorm {
                groups: 2,
                epsilon: 1e-3,
            },
            &[],
        );
        m.add("act", LayerKind::Activation(A::Elu { alpha: 1.0 }), &[]);
        m.add("conv_2", conv(4), &[]);
        m.add(
            "instance",
            LayerKind::GroupNorm {
                groups: 4,
                epsilon: 1e-5,
            },
            &[],
        );
        m.add("gap", LayerKind::GlobalAvgPool, &[]);
        m.add("probs", LayerKind::dense(5, A::Softmax), &[]);
        m.loss
            .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "label"]));
        out.push(("group_norm", m));

        // A GPT's input as GPT-2 writes it: token vectors plus learned positions, then RMS
        // norm; the positional embedding runs in place on both passes.
        let mut m = ModelSpec::new("Positions", 3);
        m.precision = precision;
        m.input("ids", &[10], DType::I32, 1.0);
        m.input("next", &[10], DType::I32, 1.0);
        m.add("tok", LayerKind::Embedding { vocab: 17, dim: 12 }, &["ids"]);
        m.add("pos", LayerKind::PositionalEmbedding, &[]);
        m.add("rms", LayerKind::rms_norm(), &[]);
        m.add("logits", LayerKind::dense(17, A::Linear), &[]);
        let scce = LossKind::SparseCategoricalCrossentropy;
        m.loss.push(LossTerm::new(scce).on(&["logits", "next"]));
        out.push(("positional_embedding", m));

        // Attention long enough for the memory-efficient kernels (issue 19): 70 positions
        // cross the CPU's 64-row tile and the CUDA kernels' 32- and 16-row tiles; causal, with
        // dropout on the probabilities (regenerated in the backward from the stream).
        let mut m = ModelSpec::new("FlashAttention", 2);
        m.precision = precision;
        m.input("x", &[70, 24], DType::F32, 1.0);
        m.input("y", &[70, 24], DType::F32, 1.0);
        let attention = |causal, dropout| LayerKind::Attention {
            heads: 3,
            causal,
            dropout,
        };
        m.add("attn", attention(true, 0.1), &["x"]);
        m.add("attn_2", attention(false, 0.0), &[]);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["attn_2", "y"]));
        out.push(("flash_attention", m));
    }
    out
}

/// The attention model above plans the memory-efficient op for both its layers (else the
/// comparison below would not cover it).
#[test]
fn long_attention_plans_the_memory_efficient_op() {
    for (name, spec) in new_layer_models() {
        if name == "flash_attention" {
            let p = plan(&spec).unwrap();
            let flash = p
                .steps
                .iter()
                .filter(|s| s.phase == memwise_plan::Phase::Forward)
                .filter(|s| matches!(s.op, memwise_plan::Op::FlashAttention { .. }))
                .count();
            let ops: Vec<_> = p
                .steps
                .iter()
                .map(|s| (s.phase, s.op.name(), s.layer.to_string()))
                .collect();
            assert_eq!(flash, 2, "{:?} {ops:?}", spec.precision);
        }
    }
}

/// The new normalisations' scales start at ones and their shifts at zeros on both devices, as
/// their catalogue entries declare (`runtime/src/init.rs` once had to be told by name, and a
/// norm forgotten there started from Glorot noise).
#[test]
fn the_new_layers_start_from_their_catalogue_initialisers() {
    for (name, spec) in new_layer_models() {
        let p = plan(&spec).unwrap();
        let cpu = Executor::new(p.clone(), &Device::cpu(), 5).unwrap();
        let gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 5).unwrap();
        for prm in p.params.iter() {
            let (c, g) = (cpu.param(&prm.name).unwrap(), gpu.param(&prm.name).unwrap());
            assert_eq!(
                c, g,
                "{name}: `{}` starts differently on the device",
                prm.name
            );
            let want = match prm.name.rsplit_once('.').map(|(l, _)| l) {
                Some("rms" | "gn" | "instance") if prm.name.ends_with(".weight") => Some(1.0),
                Some("rms" | "gn" | "instance") if prm.name.ends_with(".bias") => Some(0.0),
                _ => None,
            };
            if let Some(v) = want {
                assert!(c.iter().all(|&x| x == v), "{name}: `{}` = {c:?}", prm.name);
            }
            // Keras's embedding initialiser, uniform in ±0.05, for the position table too.
            if prm.name == "pos.weight" {
                let spread = c.iter().fold(0f32, |m, &x| m.max(x.abs()));
                assert!(
                    spread <= 0.05 && spread > 0.04,
                    "{name}: `pos.weight` spread {spread}"
                );
            }
        }
    }
}

#[test]
fn the_new_layers_train_the_same_on_the_emulated_device() {
    for (name, spec) in new_layer_models() {
        let name = format!("{name} ({:?})", spec.precision);
        compare(&name, &spec, 3, true).unwrap();
        compare(&format!("{name}, no graph"), &spec, 2, false).unwrap();
    }
}

/// A model whose column reductions are long and narrow enough for the planner to split their
/// rows into parts (`column_parts`, issue 14): a convolution's bias gradient, batch norm's
/// statistics and gradients (x̂ kept, and rebuilt from an input another layer keeps), a
/// depthwise kernel's weight gradient over its taps, layer norm's and group norm's affine
/// gradients, each over 36,864 rows of 16 channels. The emulated device, which launches the
/// parts and their fixed-order sums, must train it as the CPU does (float32 here: the kernels'
/// 16-bit forms of the split are compared one by one in `kernels/tests/cuda_emulation.rs`).
fn split_reductions_model(precision: Precision) -> ModelSpec {
    use memwise_plan::{Activation as A, LayerKind, LossKind, LossTerm, Padding};
    let mut m = ModelSpec::new("SplitReductions", 16);
    m.precision = precision;
    m.input("image", &[64, 64, 3], DType::U8, 1.0 / 255.0);
    m.input("label", &[], DType::I32, 1.0);
    m.add(
        "conv",
        LayerKind::conv2d(16, 3, 1, Padding::Same, A::Linear),
        &["image"],
    );
    m.add("bn", LayerKind::batch_norm(), &["conv"]);
    // ReLU before the batch norm: a bias straight before one has a gradient of 0 up to
    // rounding (Σ of batch norm's dx is 0), which no comparison can test.
    let depthwise = LayerKind::depthwise_conv2d(3, 1, Padding::Same, A::Relu);
    m.add("side", depthwise, &["conv"]);
    m.add("bn_2", LayerKind::batch_norm(), &["side"]);
    m.add("sum", LayerKind::add(), &["bn", "bn_2"]);
    m.add("ln", LayerKind::layer_norm(), &[]);
    let groups = LayerKind::GroupNorm {
        groups: 4,
        epsilon: 1e-3,
    };
    m.add("gn", groups, &[]);
    m.add("gap", LayerKind::GlobalAvgPool, &[]);
    m.add("probs", LayerKind::dense(5, A::Softmax), &[]);
    let scce = LossKind::SparseCategoricalCrossentropy;
    m.loss.push(LossTerm::new(scce).on(&["probs", "label"]));
    m
}

#[test]
fn split_column_reductions_train_the_same_on_the_emulated_device() {
    let spec = split_reductions_model(Precision::Float32);
    let p = plan(&spec).unwrap();
    let split: Vec<&str> = p
        .steps
        .iter()
        .filter(|s| s.op.column_reduction_scratch_f32() > 0)
        .map(|s| s.op.name())
        .collect();
    for op in [
        "conv2d",
        "batch_norm",
        "depthwise_conv2d",
        "layer_norm",
        "group_norm",
    ] {
        assert!(split.contains(&op), "{op} is not split: {split:?}");
    }
    let rebuilds = |s: &&memwise_plan::PlanStep| {
        matches!(
            s.op,
            memwise_plan::Op::BatchNorm {
                rebuild_x_hat: true,
                ..
            }
        )
    };
    assert!(
        p.steps.iter().any(|s| rebuilds(&s)),
        "no batch norm rebuilds x̂: the rebuild kernels are not covered"
    );
    compare("split reductions", &spec, 2, true).unwrap();
}

#[test]
fn a_plan_larger_than_the_device_is_refused_before_allocating() {
    let p = plan(&zoo::mnist_mlp(16)).unwrap();
    let e = GpuExecutor::new(
        p,
        &Device::cpu().with_memory_limit(1 << 16),
        EmuBackend::default(),
        1,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("nothing was allocated"), "{e}");
}

/// The whole `Trainer` — fit with validation, evaluate, predict — over the emulated GPU
/// engine and over the CPU executor, from the same seed: every step's loss, the evaluation
/// (over full batches and a final partial one, so two inference engines) and the predictions
/// agree, within the float32 tolerances of `compare`.
#[test]
fn the_trainer_runs_the_same_on_the_emulated_device_and_the_cpu() {
    let spec = zoo::mnist_mlp(8);
    let p = plan(&spec).unwrap();
    let (train, held_out) = (random_digits(40, 3), random_digits(20, 4));
    let opts = FitOptions {
        epochs: 2,
        seed: 5,
        verbose: false,
        ..Default::default()
    };
    let mut cpu = Trainer::build(&spec, &Device::cpu(), 11).unwrap();
    let engine = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 11).unwrap();
    let mut gpu = Trainer::from_engine(
        &spec,
        Box::new(engine),
        &Device::cpu(),
        MemoryMonitor::start(),
    )
    .unwrap();
    assert!(cpu.cpu_executor().is_some() && gpu.cpu_executor().is_none());
    assert_eq!(gpu.engine().device_name(), "emulated");

    let hc = cpu.fit(&train, Some(&held_out), &opts, &mut []).unwrap();
    let hg = gpu.fit(&train, Some(&held_out), &opts, &mut []).unwrap();
    assert_eq!(hc.step_losses.len(), 10);
    assert_eq!(hg.step_losses.len(), hc.step_losses.len());
    for (k, (a, b)) in hg.step_losses.iter().zip(&hc.step_losses).enumerate() {
        let d = (a - b).abs() / b.abs().max(1e-3);
        assert!(
            within(d as f64, 1e-4),
            "step {k}: loss {a} on the device, {b} on the CPU"
        );
    }
    for (a, b) in hg.epochs.iter().zip(&hc.epochs) {
        let (va, vb) = (a.val_loss.unwrap(), b.val_loss.unwrap());
        assert!(
            within(((va - vb).abs() / vb.abs()) as f64, 1e-4),
            "val_loss {va} vs {vb}"
        );
        assert_eq!(a.val_accuracy, b.val_accuracy);
    }
    assert_eq!(gpu.engine().step_counter(), 10);

    let (ec, eg) = (
        cpu.evaluate(&held_out).unwrap(),
        gpu.evaluate(&held_out).unwrap(),
    );
    assert_eq!(eg.samples, 20);
    assert!(
        within(((eg.loss - ec.loss).abs() / ec.loss.abs()) as f64, 1e-4),
        "evaluate: loss {} on the device, {} on the CPU",
        eg.loss,
        ec.loss
    );
    assert_eq!(eg.accuracy, ec.accuracy);
    let (pc, pg) = (
        cpu.predict(&held_out).unwrap(),
        gpu.predict(&held_out).unwrap(),
    );
    assert_eq!(pg.len(), 20 * 10);
    let e = rel(&pg, &pc);
    assert!(within(e, 2e-3), "predictions differ by {e:.2e}");

    // Device memory: the emulated device reports what its backends allocated, so the peak
    // is the training engine's two regions plus the two inference engines' (built when `fit`
    // starts, for the validation's full and partial batches, so already in epoch 1's peak:
    // a model without room for them fails before training). The CPU has none.
    assert_eq!(cpu.device_peak_bytes(), None);
    assert_eq!(hc.epochs[1].device_peak_bytes, None);
    let regions = |p: &StaticPlan| p.persistent_bytes + scalars_bytes(p) + p.arena_bytes.max(1);
    let inference: u64 = [8, 4]
        .iter()
        .map(|&n| regions(&memwise_plan::plan_inference(&spec.with_batch(n)).unwrap()))
        .sum();
    assert_eq!(
        hg.epochs[0].device_peak_bytes,
        Some(regions(&p) + inference)
    );
    assert_eq!(gpu.device_peak_bytes(), Some(regions(&p) + inference));
    let line = epoch_line(&hg.epochs[1], 2, gpu.estimate_bytes());
    assert!(line.contains("device peak"), "{line}");
    assert!(!epoch_line(&hc.epochs[1], 2, cpu.estimate_bytes()).contains("device"));
}

/// Mixed precision through the trainer: the inference engines take the trained f32 weights
/// by name and round their 16-bit copies on the host (`GpuExecutor::set_param`) as the CPU
/// executor does, so evaluation and predictions agree within the 16-bit tolerances.
#[test]
fn the_trainer_runs_mixed_float16_the_same_on_the_emulated_device() {
    let mut spec = zoo::mnist_mlp(8);
    spec.precision = Precision::MixedFloat16;
    let p = plan(&spec).unwrap();
    assert!(p.params.iter().any(|q| q.half_copy.is_some()));
    let (train, held_out) = (random_digits(24, 5), random_digits(12, 6));
    let opts = FitOptions {
        epochs: 1,
        seed: 1,
        verbose: false,
        ..Default::default()
    };
    let mut cpu = Trainer::build(&spec, &Device::cpu(), 21).unwrap();
    let engine = GpuExecutor::new(p, &Device::cpu(), EmuBackend::default(), 21).unwrap();
    let monitor = MemoryMonitor::start();
    let mut gpu = Trainer::from_engine(&spec, Box::new(engine), &Device::cpu(), monitor).unwrap();
    let hc = cpu.fit(&train, None, &opts, &mut []).unwrap();
    let hg = gpu.fit(&train, None, &opts, &mut []).unwrap();
    for (a, b) in hg.step_losses.iter().zip(&hc.step_losses) {
        assert!(
            within(((a - b).abs() / b.abs()) as f64, 1e-2),
            "loss {a} vs {b}"
        );
    }
    let (ec, eg) = (
        cpu.evaluate(&held_out).unwrap(),
        gpu.evaluate(&held_out).unwrap(),
    );
    let d = ((eg.loss - ec.loss).abs() / ec.loss.abs()) as f64;
    assert!(within(d, 1e-2), "evaluate: {} vs {}", eg.loss, ec.loss);
    let (pc, pg) = (
        cpu.predict(&held_out).unwrap(),
        gpu.predict(&held_out).unwrap(),
    );
    let e = rel(&pg, &pc);
    assert!(within(e, 3e-2), "predictions differ by {e:.2e}");
}

/// Checkpoints cross engines: one saved from the emulated GPU engine (its persistent region
/// copied from the device: weights, optimizer state, counters) loads into the CPU executor
/// and back, bit for bit, and training resumes from it on either.
#[test]
fn checkpoints_move_between_the_emulated_device_and_the_cpu() {
    let spec = zoo::mnist_mlp(8);
    let p = plan(&spec).unwrap();
    let data = random_digits(24, 7);
    let opts = FitOptions {
        epochs: 1,
        seed: 2,
        verbose: false,
        ..Default::default()
    };
    let engine = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 13).unwrap();
    let mut gpu = Trainer::from_engine(
        &spec,
        Box::new(engine),
        &Device::cpu(),
        MemoryMonitor::start(),
    )
    .unwrap();
    gpu.fit(&data, None, &opts, &mut []).unwrap();
    let bytes = gpu.engine().checkpoint_to_bytes().unwrap();
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 0).unwrap();
    cpu.load_checkpoint_from_bytes(&bytes).unwrap();
    assert_eq!(cpu.checkpoint_to_bytes().unwrap(), bytes);
    assert_eq!((cpu.seed(), cpu.step_counter()), (13, 3));
    for prm in p.params.iter() {
        assert_eq!(
            gpu.engine().param(&prm.name).unwrap(),
            cpu.param(&prm.name).unwrap()
        );
    }

    // Back to a fresh emulated engine through a file; both resume with the same step.
    let path = std::env::temp_dir().join(format!("memwise-emu-{}.safetensors", std::process::id()));
    cpu.save_checkpoint(&path).unwrap();
    let mut fresh = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 99).unwrap();
    Engine::load_checkpoint(&mut fresh, &path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(Engine::checkpoint_to_bytes(&fresh).unwrap(), bytes);
    let raw = random_inputs(&p, 42);
    let b = batches(&p, &raw);
    let (og, oc) = (fresh.train_step(&b).unwrap(), cpu.train_step(&b).unwrap());
    assert!(within(
        ((og.loss - oc.loss).abs() / oc.loss.abs()) as f64,
        1e-4
    ));

    // Weights from another executor load into the emulated one; a file that does not fit
    // the model is refused and leaves the device copy as it was.
    let other = Executor::new(plan(&zoo::mnist_mlp(4)).unwrap(), &Device::cpu(), 1).unwrap();
    let w = other.weights_to_bytes().unwrap();
    let path =
        std::env::temp_dir().join(format!("memwise-emu-w-{}.safetensors", std::process::id()));
    std::fs::write(&path, &w).unwrap();
    let vae = plan(&zoo::conv_vae(2)).unwrap();
    let mut wrong = GpuExecutor::new(vae, &Device::cpu(), EmuBackend::default(), 1).unwrap();
    let before = Engine::weights_to_bytes(&wrong).unwrap();
    let e = Engine::load_weights(&mut wrong, &path).unwrap_err();
    assert!(e.to_string().contains("does not match"), "{e}");
    assert_eq!(Engine::weights_to_bytes(&wrong).unwrap(), before);
    Engine::load_weights(&mut fresh, &path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(Engine::weights_to_bytes(&fresh).unwrap(), w);
}

/// The RNG seed is a launch argument of the captured graph: a checkpoint that brings another
/// seed, loaded after the graph was captured, must be trained with its seed (the graph is
/// recorded again), as the CPU executor that loads it does.
#[test]
fn a_checkpoint_with_another_seed_is_trained_with_its_seed_after_a_capture() {
    let p = plan(&zoo::conv_vae(2)).unwrap();
    let inputs: Vec<Vec<Vec<u8>>> = (0..4).map(|k| random_inputs(&p, 300 + k)).collect();
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 11).unwrap();
    for raw in &inputs[..3] {
        gpu.train_step(&batches(&p, raw)).unwrap();
    }
    assert_eq!(gpu.kernels().graph_replays(), 2);
    let mut other = Executor::new(p.clone(), &Device::cpu(), 99).unwrap();
    other.train_step(&batches(&p, &inputs[0])).unwrap();
    let bytes = other.checkpoint_to_bytes().unwrap();
    gpu.load_checkpoint_from_bytes(&bytes).unwrap();
    other.load_checkpoint_from_bytes(&bytes).unwrap();
    let b = batches(&p, &inputs[3]);
    let (og, oc) = (gpu.train_step(&b).unwrap(), other.train_step(&b).unwrap());
    assert_eq!(gpu.kernels().graph_replays(), 3);
    assert!(
        within(((og.loss - oc.loss).abs() / oc.loss.abs()) as f64, 1e-4),
        "loss {} on the device, {} on the CPU",
        og.loss,
        oc.loss
    );
    compare_weights("conv_vae after the checkpoint", &p, &other, &gpu, 2e-3).unwrap();
}

/// A non-finite float32 loss: the device finds it, the optimizer kernels skip the update,
/// and the walk names the first layer whose output is not finite, as on the CPU.
#[test]
fn a_non_finite_loss_is_reported_as_on_the_cpu_and_the_weights_stay() {
    let p = plan(&zoo::mnist_mlp(8)).unwrap();
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 3).unwrap();
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 3).unwrap();
    let raw = random_inputs(&p, 5);
    let b = batches(&p, &raw);
    // A graph is captured first, so that the failing step is a replay.
    for _ in 0..2 {
        gpu.train_step(&b).unwrap();
        cpu.train_step(&b).unwrap();
    }
    // The output layer's bias: a NaN there reaches the loss (one in the hidden layer's
    // weights would stop at its ReLU).
    let name = &p.params.last().unwrap().name;
    let mut w = gpu.param(name).unwrap();
    w[0] = f32::NAN;
    gpu.set_param(name, &w).unwrap();
    cpu.set_param(name, &w).unwrap();
    let before: Vec<Vec<f32>> = p
        .params
        .iter()
        .map(|q| gpu.param(&q.name).unwrap())
        .collect();
    let (eg, ec) = (
        gpu.train_step(&b).unwrap_err(),
        cpu.train_step(&b).unwrap_err(),
    );
    assert_eq!(eg.to_string(), ec.to_string());
    assert!(eg.to_string().contains("first non-finite value"), "{eg}");
    for (q, v) in p.params.iter().zip(&before) {
        let after = gpu.param(&q.name).unwrap();
        assert!(
            after.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
            "`{}` changed",
            q.name
        );
    }
}

/// Debugging aid: `ONE=chain:7 cargo test -p memwise-runtime --test cuda_emulated debug_one --
/// --ignored --nocapture` prints a random model's plan and its per-parameter differences.
#[test]
#[ignore = "a debugging aid, not a check: run it by hand with ONE=chain:7 (see its doc)"]
fn debug_one() {
    let which = std::env::var("ONE").unwrap();
    let (kind, seed) = which.split_once(':').unwrap();
    let seed: u64 = seed.parse().unwrap();
    let spec = if kind == "chain" {
        random_chain(seed)
    } else {
        random_dag(seed)
    };
    let p = plan(&spec).unwrap();
    for s in p.steps.iter() {
        let dts: Vec<String> = s
            .reads
            .iter()
            .chain(s.writes.iter())
            .map(|&t| {
                if t == memwise_plan::NONE {
                    "-".into()
                } else {
                    format!("{}:{}@{}", t, p.tensor(t).dtype.name(), p.tensor(t).offset)
                }
            })
            .collect();
        println!(
            "{:3} {:?} {:12} {:?} {:?}",
            s.index, s.phase, s.layer, s.op, dts
        );
    }
    println!("prediction {}", p.prediction);
    let mut cpu = Executor::new(p.clone(), &Device::cpu(), 11).unwrap();
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 11).unwrap();
    gpu.kernels_mut().set_graph(false);
    let raw = random_inputs(&p, 100);
    let b = batches(&p, &raw);
    let oc = cpu.train_step(&b).unwrap();
    let og = gpu.train_step(&b).unwrap();
    println!("loss {} vs {}", oc.loss, og.loss);
    for prm in p.params.iter() {
        let (a, bb) = (
            gpu.param(&prm.name).unwrap(),
            cpu.param(&prm.name).unwrap().to_vec(),
        );
        println!("{} param {:.2e}", prm.name, rel(&a, &bb));
        if prm.trainable {
            let (ga, gb) = (
                gpu.grad(&prm.name).unwrap(),
                cpu.grad(&prm.name).unwrap().to_vec(),
            );
            println!(
                "   grad {:.2e}  gpu {:?} cpu {:?}",
                rel(&ga, &gb),
                &ga[..ga.len().min(4)],
                &gb[..gb.len().min(4)]
            );
        }
    }
}

/// A capture that fails (here at its end, as an invalidated capture does) is not an error of
/// training: the step runs eagerly, so do all later ones, no capture is tried again, and the
/// first error is kept. The weights are those of an executor that never captured.
#[test]
fn a_failed_capture_falls_back_to_eager_launches_for_good() {
    let p = plan(&zoo::mnist_mlp(8)).unwrap();
    let inputs: Vec<Vec<Vec<u8>>> = (0..5).map(|k| random_inputs(&p, 40 + k)).collect();
    let failing = EmuBackend::default();
    failing.failing_captures.set(1);
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), failing, 4).unwrap();
    let mut eager = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 4).unwrap();
    eager.kernels_mut().set_graph(false);
    for raw in &inputs {
        let b = batches(&p, raw);
        let (g, e) = (gpu.train_step(&b).unwrap(), eager.train_step(&b).unwrap());
        assert_eq!(g.loss.to_bits(), e.loss.to_bits());
    }
    let k = gpu.kernels();
    assert_eq!(
        k.backend().captures.get(),
        1,
        "a failed capture is not tried again"
    );
    assert_eq!(k.graph_replays(), 0);
    let e = k.capture_error().expect("the capture's error is kept");
    assert!(e.contains("STREAM_CAPTURE_INVALIDATED"), "{e}");
    assert_eq!(
        Engine::weights_to_bytes(&gpu).unwrap(),
        Engine::weights_to_bytes(&eager).unwrap()
    );
}

/// A checkpoint's step counter does not make the first step a capture: an executor runs one
/// step eagerly (loading its kernels) before it records one.
#[test]
fn a_resumed_executor_runs_its_first_step_eagerly() {
    let p = plan(&zoo::mnist_mlp(8)).unwrap();
    let raw = random_inputs(&p, 9);
    let b = batches(&p, &raw);
    let mut trained = Executor::new(p.clone(), &Device::cpu(), 6).unwrap();
    for _ in 0..3 {
        trained.train_step(&b).unwrap();
    }
    let bytes = trained.checkpoint_to_bytes().unwrap();
    let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 6).unwrap();
    gpu.load_checkpoint_from_bytes(&bytes).unwrap();
    gpu.train_step(&b).unwrap();
    assert_eq!(
        gpu.kernels().backend().captures.get(),
        0,
        "first step captured"
    );
    gpu.train_step(&b).unwrap();
    assert_eq!(gpu.kernels().backend().captures.get(), 1);
    assert_eq!(gpu.kernels().graph_replays(), 1);
}

/// A step captured again (after the graph was dropped, as loading weights drops it) records
/// exactly the launches of the first capture, in the same order with the same arguments: no
/// per-step value is baked into a launch, so replaying one graph is every later step.
#[test]
fn a_step_recorded_again_after_replays_is_the_same_graph() {
    for spec in [zoo::mnist_mlp(8), zoo::conv_vae(2)] {
        let p = plan(&spec).unwrap();
        let mut gpu =
            GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 5).unwrap();
        let graph = |g: &GpuExecutor<EmuBackend>| format!("{:?}", g.kernels().backend().graph);
        let mut recorded = Vec::new();
        for round in 0..2 {
            for step in 0..4u64 {
                let raw = random_inputs(&p, 10 * round + step);
                gpu.train_step(&batches(&p, &raw)).unwrap();
            }
            recorded.push(graph(&gpu));
            gpu.kernels_mut().set_graph(false);
            gpu.kernels_mut().set_graph(true);
        }
        assert_eq!(gpu.kernels().backend().captures.get(), 2);
        assert!(recorded[0].len() > 100, "nothing was recorded");
        assert!(
            recorded[0] == recorded[1],
            "{}: the re-recorded graph differs",
            spec.name
        );
    }
}

/// A capture is held to CUDA's rules by the emulated backend: a kernel first launched inside a
/// capture, a synchronisation, an allocation and a host copy are errors there, and the
/// executor then falls back to eager launches (the rules are what make the other tests'
/// captures count).
#[test]
fn the_emulated_capture_refuses_what_a_real_one_refuses() {
    let mut b = EmuBackend::default();
    assert!(b.begin_capture().unwrap());
    let call = KernelCall::new(
        "mw_relu_f32",
        memwise_kernels::cuda::LaunchCfg::pointwise(1),
        vec![],
    );
    // SAFETY: refused before anything runs.
    let first = unsafe { b.launch(&call) }.unwrap_err();
    assert!(
        first.contains("first used inside a graph capture"),
        "{first}"
    );
    assert!(b.synchronize().unwrap_err().contains("synchronisation"));
    assert!(b.alloc(16).unwrap_err().contains("allocation"));
    // SAFETY: refused before anything is copied.
    assert!(unsafe { b.upload(&[0u8; 4], 0) }
        .unwrap_err()
        .contains("copy"));
    let _ = b.memory();
    assert_eq!(
        b.violations.borrow().len(),
        1,
        "the memory query is recorded"
    );
    b.end_capture().unwrap();
}

/// A GEMM whose output overlaps one of its inputs (undefined in cuBLAS) is refused by the
/// emulated backend: a dense layer's forward with `y` placed over the end of `x`, and then
/// apart from it.
#[test]
fn a_gemm_whose_output_overlaps_an_input_is_refused() {
    let d = memwise_kernels::dense::DenseDims {
        batch: 4,
        in_features: 3,
        out_features: 5,
    };
    let g = cm::to_cublas(&cm::dense_forward(d));
    let mut b = EmuBackend::default();
    let base = b.alloc(4 * 64).unwrap();
    let (x, w) = (base, base + 4 * 12);
    let types = [Float::F32; 3];
    let overlapping = GemmBuffers {
        a: x,
        b: w,
        c: base + 4 * 8,
        types,
    };
    // SAFETY: refused before anything runs.
    let e = unsafe { b.gemm(&g, overlapping) }.unwrap_err();
    assert!(e.contains("overlaps its input"), "{e}");
    let apart = GemmBuffers {
        a: x,
        b: w,
        c: base + 4 * 27,
        types,
    };
    // SAFETY: x [4×3], w [3×5] and y [4×5] lie apart inside the 64 floats allocated.
    unsafe { b.gemm(&g, apart) }.unwrap();
}

/// `MEMWISE_CUDA_SYNC=1` (here `set_sync_each_launch`): a sticky device error is reported by
/// the kernel that caused it, with its step; without it, by the next call that reads the
/// device, which cannot say which kernel it was. Steps are never captured in this mode, and
/// train as with a graph.
#[test]
fn synchronising_each_launch_names_the_kernel_of_a_sticky_error() {
    let p = plan(&zoo::mnist_mlp(8)).unwrap();
    let raw = random_inputs(&p, 3);
    let b = batches(&p, &raw);
    let failing = |sync: bool| {
        let backend = EmuBackend::default();
        let mut gpu = GpuExecutor::new(p.clone(), &Device::cpu(), backend, 5).unwrap();
        gpu.kernels_mut().set_sync_each_launch(sync);
        let before = *gpu.kernels().backend().launches.borrow();
        gpu.kernels().backend().sticky_after.set(Some(before + 7));
        gpu.train_step(&b).unwrap_err().to_string()
    };
    let named = failing(true);
    assert!(named.contains("ILLEGAL_ADDRESS"), "{named}");
    assert!(named.contains("MEMWISE_CUDA_SYNC=1"), "{named}");
    assert!(
        named.contains("found by the synchronisation after `"),
        "{named}"
    );
    assert!(named.contains("step"), "the walk names the step: {named}");
    let unnamed = failing(false);
    assert!(unnamed.contains("ILLEGAL_ADDRESS"), "{unnamed}");
    assert!(!unnamed.contains("synchronisation after"), "{unnamed}");

    let mut synced = GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 5).unwrap();
    synced.kernels_mut().set_sync_each_launch(true);
    let mut graphed =
        GpuExecutor::new(p.clone(), &Device::cpu(), EmuBackend::default(), 5).unwrap();
    for _ in 0..3 {
        let (s, g) = (
            synced.train_step(&b).unwrap(),
            graphed.train_step(&b).unwrap(),
        );
        assert_eq!(s.loss.to_bits(), g.loss.to_bits());
    }
    assert_eq!(
        synced.kernels().backend().captures.get(),
        0,
        "a synchronising step was captured"
    );
    assert_eq!(graphed.kernels().graph_replays(), 2);
}

/// `Trainer::set_cuda_graphs(false)` reaches the engine: `fit` then never captures.
#[test]
fn the_trainer_turns_graph_capture_off() {
    let spec = zoo::mnist_mlp(8);
    let p = plan(&spec).unwrap();
    let engine = GpuExecutor::new(p, &Device::cpu(), EmuBackend::default(), 2).unwrap();
    let mut t = Trainer::from_engine(
        &spec,
        Box::new(engine),
        &Device::cpu(),
        MemoryMonitor::start(),
    )
    .unwrap();
    t.set_cuda_graphs(false);
    let opts = FitOptions {
        epochs: 1,
        verbose: false,
        ..Default::default()
    };
    t.fit(&random_digits(32, 1), None, &opts, &mut []).unwrap();
    let gpu = t
        .engine()
        .downcast_ref::<GpuExecutor<EmuBackend>>()
        .unwrap();
    assert_eq!(gpu.kernels().backend().captures.get(), 0);
    assert_eq!(gpu.kernels().graph_replays(), 0);
}

/// Data parallel on the GPU executor (issue 15): two emulated devices, each a replica on its
/// own thread meeting through `collective::Threads`, train the MLP, the VAE and flash
/// attention with dropout to the weights the CPU reaches on one device at the global batch; each replica's gradient sums are plan steps of
/// the one walk. A model with batch norm keeps each replica's own batch statistics (as
/// TensorFlow's MirroredStrategy without SyncBatchNorm): its trained weights stay equal
/// across the replicas, its running statistics are each replica's.
#[test]
fn replicas_on_emulated_devices_train_as_one_cpu_at_the_global_batch() {
    for (name, spec, as_one_device) in [
        ("mnist_mlp", zoo::mnist_mlp(32), true),
        // Sampling: each replica draws its share of one device's noise (`first_block`).
        ("conv_vae", zoo::conv_vae(4), true),
        (
            "split_reductions",
            split_reductions_model(Precision::Float32).with_batch(4),
            false,
        ),
        // Flash attention with dropout: each replica's kernels draw its share of one
        // device's masks (`first_block`), forward and backward.
        (
            "flash_attention",
            new_layer_models()
                .into_iter()
                .find(|(n, m)| *n == "flash_attention" && m.precision == Precision::Float32)
                .map(|(_, m)| m)
                .unwrap(),
            true,
        ),
    ] {
        let one = plan(&spec).unwrap();
        let inputs: Vec<Vec<Vec<u8>>> = (0..3).map(|s| random_inputs(&one, 300 + s)).collect();
        let mut cpu = Executor::new(one.clone(), &Device::cpu(), 11).unwrap();
        let cpu_losses: Vec<f32> = inputs
            .iter()
            .map(|raw| cpu.train_step(&batches(&one, raw)).unwrap().loss)
            .collect();
        let two = plan(&spec.with_replicas(2)).unwrap();
        let results = emulated_replicas(&two, &inputs);
        for (k, p) in two.params.iter().enumerate() {
            let (a, b) = (&results[0].1[k], &results[1].1[k]);
            if p.trainable {
                assert_eq!(a, b, "{name}: `{}` drifted apart on the replicas", p.name);
            }
        }
        if !as_one_device {
            continue;
        }
        assert_eq!(results[0].0, results[1].0, "{name}: the replicas' losses");
        for (c, g) in cpu_losses.iter().zip(&results[0].0) {
            assert!(
                (c - g).abs() / c.abs().max(1e-3) < 1e-4,
                "{name}: loss {c} vs {g}"
            );
        }
        for (p, w) in one.params.iter().zip(&results[0].1) {
            let e = rel(w, &cpu.param(&p.name).unwrap());
            assert!(
                e < 2e-3,
                "{name}: `{}` differs by {e:.2e} (relative L2)",
                p.name
            );
        }
    }
}

/// ZeRO stage 1 on the GPU executor: each emulated device's multi-tensor update covers its
/// own shard (its chunk table rebuilt for its rank) and the gather brings the others' back,
/// so the replicas end with the bits unsharded replicas reach.
#[test]
fn sharded_replicas_on_emulated_devices_train_as_unsharded_ones() {
    for spec in [zoo::mnist_mlp(32), zoo::conv_vae(4)] {
        let one = plan(&spec).unwrap();
        let inputs: Vec<Vec<Vec<u8>>> = (0..3).map(|s| random_inputs(&one, 500 + s)).collect();
        let two = spec.with_replicas(2);
        let plain = emulated_replicas(&plan(&two).unwrap(), &inputs);
        let sharded_plan = plan(&two.with_sharding(Sharding::OptimizerState)).unwrap();
        assert!(sharded_plan.memory.optimizer < plan(&two).unwrap().memory.optimizer);
        let sharded = emulated_replicas(&sharded_plan, &inputs);
        assert_eq!(
            sharded[0], sharded[1],
            "{}: the replicas drifted apart",
            spec.name
        );
        assert_eq!(
            plain[0], sharded[0],
            "{}: sharded differs from unsharded",
            spec.name
        );
    }
}

/// The GPU executor's device-memory path (what NCCL carries on GPUs) against its host path,
/// on emulated devices: each bucket summed in place at its device address, each ZeRO shard
/// (values and 16-bit copies) broadcast in place from its replica — the same weights, bit for
/// bit, as the sums through the host, with the device path taken and no gradient downloaded.
#[test]
fn sums_on_device_memory_train_as_sums_through_the_host() {
    let mut mixed = zoo::mnist_mlp(32);
    mixed.precision = Precision::MixedFloat16;
    for spec in [zoo::mnist_mlp(32), zoo::conv_vae(4), mixed] {
        let one = plan(&spec).unwrap();
        let inputs: Vec<Vec<Vec<u8>>> = (0..3).map(|s| random_inputs(&one, 700 + s)).collect();
        for sharding in [Sharding::Replicated, Sharding::OptimizerState] {
            let two = plan(&spec.with_replicas(2).with_sharding(sharding)).unwrap();
            let (host, host_calls) = emulated_replicas_summing(&two, &inputs, false);
            let (device, device_calls) = emulated_replicas_summing(&two, &inputs, true);
            let what = format!(
                "{} ({precision:?}, {sharding:?})",
                spec.name,
                precision = spec.precision
            );
            assert_eq!(host_calls, 0, "{what}");
            // A sum per bucket each step at least (ZeRO adds a broadcast per shard and copy).
            let sums = two
                .steps
                .iter()
                .filter(|s| matches!(s.op, memwise_plan::Op::AllReduceGradients { .. }))
                .count();
            assert!(
                sums > 0 && device_calls >= 3 * sums,
                "{what}: {device_calls} device calls"
            );
            assert_eq!(
                host, device,
                "{what}: the device path differs from the host path"
            );
        }
    }
}

/// One replica's losses, step by step, and its parameters' values at the end.
type ReplicaRun = (Vec<f32>, Vec<Vec<f32>>);

/// Trains replica plan `two` on two emulated devices (threads), each on its half of every
/// batch of `inputs`: each replica's losses and parameters.
fn emulated_replicas(two: &StaticPlan, inputs: &[Vec<Vec<u8>>]) -> Vec<ReplicaRun> {
    emulated_replicas_summing(two, inputs, false).0
}

/// [`emulated_replicas`], summing on the emulated devices' memory (`on_device`: through
/// [`HostMemorySums`]) or through the host; also the device collectives' call count.
fn emulated_replicas_summing(
    two: &StaticPlan,
    inputs: &[Vec<Vec<u8>>],
    on_device: bool,
) -> (Vec<ReplicaRun>, usize) {
    use std::sync::Arc;
    let ranks = ThreadGroup::new(2);
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|c| {
                let calls = &calls;
                s.spawn(move || {
                    let r = c.rank();
                    let mut gpu =
                        GpuExecutor::new(two.clone(), &Device::cpu(), EmuBackend::default(), 11)
                            .unwrap();
                    let sums = Arc::new(HostMemorySums::new(c, None, on_device));
                    gpu.set_collective(sums.clone() as Arc<dyn Collective>)
                        .unwrap();
                    let losses = inputs
                        .iter()
                        .map(|raw| {
                            // This replica's half of every input.
                            let mine: Vec<Vec<u8>> = raw
                                .iter()
                                .map(|x| x[r * x.len() / 2..(r + 1) * x.len() / 2].to_vec())
                                .collect();
                            gpu.train_step(&batches(two, &mine)).unwrap().loss
                        })
                        .collect();
                    let weights = two
                        .params
                        .iter()
                        .map(|p| gpu.param(&p.name).unwrap())
                        .collect();
                    assert!(gpu.kernels().backend().violations.borrow().is_empty());
                    let joined = COLLECTIVE_STREAM.with(|q| q.borrow().is_empty());
                    assert!(joined, "a collective was never joined");
                    let n = sums.calls.load(std::sync::atomic::Ordering::Relaxed);
                    calls.fetch_max(n, std::sync::atomic::Ordering::Relaxed);
                    (losses, weights)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (results, calls.into_inner())
}

/// A replica of `collective::Threads` that, with `on_device`, also offers collectives on
/// device memory ([`DeviceCollective`]) — on the emulated device, whose memory is host memory:
/// each call is queued on the emulated collective stream and runs when the backend joins it.
/// The GPU executor's NCCL path without NCCL. Counts its device calls.
struct HostMemorySums {
    threads: std::sync::Arc<dyn Collective>,
    on_device: bool,
    calls: std::sync::atomic::AtomicUsize,
    /// With pipeline stages: a second group of the same ranks, on which each receive is
    /// acknowledged, so that a device send waits for its receiver as NCCL's does (its stream
    /// stops until the peer posts the receive); two stages whose sends cross then wait on
    /// each other, unless the sends are in one group with the receives.
    acks: Option<std::sync::Arc<dyn Collective>>,
    /// Inside a group: the ranks whose acknowledgements this rank's sends wait for when the
    /// group ends.
    grouped: std::sync::Mutex<Option<Vec<usize>>>,
}

impl HostMemorySums {
    /// Rank `c`'s device collective (device calls when `on_device`), its sends waiting for
    /// acknowledgements on `acks` (the same ranks), as NCCL's wait for their receivers.
    fn new(c: Threads, acks: Option<Threads>, on_device: bool) -> HostMemorySums {
        HostMemorySums {
            threads: std::sync::Arc::new(c),
            on_device,
            calls: Default::default(),
            acks: acks.map(|a| std::sync::Arc::new(a) as std::sync::Arc<dyn Collective>),
            grouped: Default::default(),
        }
    }
}

impl Collective for HostMemorySums {
    fn rank(&self) -> usize {
        self.threads.rank()
    }
    fn size(&self) -> usize {
        self.threads.size()
    }
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> memwise_runtime::Result<()> {
        self.threads.all_reduce_sum_f32(values)
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> memwise_runtime::Result<()> {
        self.threads.all_reduce_sum_f64(values)
    }
    fn broadcast(&self, root: usize, bytes: &mut [u8]) -> memwise_runtime::Result<()> {
        self.threads.broadcast(root, bytes)
    }
    fn barrier(&self) -> memwise_runtime::Result<()> {
        self.threads.barrier()
    }
    fn send(&self, to: usize, bytes: &[u8]) -> memwise_runtime::Result<()> {
        self.threads.send(to, bytes)
    }
    fn recv(&self, from: usize, bytes: &mut [u8]) -> memwise_runtime::Result<()> {
        self.threads.recv(from, bytes)
    }
    fn split(
        &self,
        color: usize,
        key: usize,
    ) -> memwise_runtime::Result<std::sync::Arc<dyn Collective>> {
        Ok(std::sync::Arc::new(HostMemorySums {
            threads: self.threads.split(color, key)?,
            on_device: self.on_device,
            calls: Default::default(),
            acks: (self.acks.as_ref())
                .map(|a| a.split(color, key))
                .transpose()?,
            grouped: Default::default(),
        }))
    }
    fn engine(&self) -> &'static str {
        "emulated device memory"
    }
    fn device(&self) -> Option<&dyn DeviceCollective> {
        self.on_device.then_some(self as _)
    }
    fn scratch_bytes(&self, largest: usize) -> u64 {
        self.threads.scratch_bytes(largest)
    }
}

impl DeviceCollective for HostMemorySums {
    unsafe fn all_reduce_sum_f32(
        &self,
        values: u64,
        n: usize,
        stream: u64,
    ) -> memwise_runtime::Result<()> {
        let threads = self.enqueue(stream);
        COLLECTIVE_STREAM.with(|q| {
            q.borrow_mut().push(Box::new(move || {
                // SAFETY: `values` is the emulated device's memory (host memory), which the
                // executor leaves alone until the join runs this.
                let values = unsafe { std::slice::from_raw_parts_mut(values as *mut f32, n) };
                threads.all_reduce_sum_f32(values)
            }))
        });
        Ok(())
    }
    unsafe fn broadcast(
        &self,
        root: usize,
        at: u64,
        bytes: usize,
        stream: u64,
    ) -> memwise_runtime::Result<()> {
        let threads = self.enqueue(stream);
        COLLECTIVE_STREAM.with(|q| {
            q.borrow_mut().push(Box::new(move || {
                // SAFETY: as above.
                let bytes = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, bytes) };
                threads.broadcast(root, bytes)
            }))
        });
        Ok(())
    }
    unsafe fn send(
        &self,
        to: usize,
        at: u64,
        bytes: usize,
        stream: u64,
    ) -> memwise_runtime::Result<()> {
        let wait_now = match self.grouped.lock().unwrap().as_mut() {
            Some(peers) => {
                peers.push(to);
                false
            }
            None => true,
        };
        self.transfer_job(stream, move |threads, acks| {
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, bytes) };
            threads.send(to, bytes)?;
            // Alone, the stream waits here for the receiver; in a group, at its end.
            if wait_now {
                acks.recv(to, &mut [0u8])?;
            }
            Ok(())
        });
        Ok(())
    }
    unsafe fn recv(
        &self,
        from: usize,
        at: u64,
        bytes: usize,
        stream: u64,
    ) -> memwise_runtime::Result<()> {
        self.transfer_job(stream, move |threads, acks| {
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, bytes) };
            threads.recv(from, bytes)?;
            acks.send(from, &[1])
        });
        Ok(())
    }
    fn begin_group(&self) -> memwise_runtime::Result<()> {
        *self.grouped.lock().unwrap() = Some(Vec::new());
        Ok(())
    }
    fn end_group(&self) -> memwise_runtime::Result<()> {
        let Some(peers) = self.grouped.lock().unwrap().take() else {
            return Ok(());
        };
        let Some(acks) = self.acks.clone() else {
            return Ok(());
        };
        // The group's sends are done once their receivers have received.
        COLLECTIVE_STREAM.with(|q| {
            q.borrow_mut().push(Box::new(move || {
                (peers.into_iter()).try_for_each(|p| acks.recv(p, &mut [0u8]))
            }))
        });
        Ok(())
    }
    fn ranks(&self) -> usize {
        self.threads.size()
    }
}

impl HostMemorySums {
    /// Queues a transfer on the emulated collective stream: `job` gets the data ranks and
    /// the acknowledgement ranks.
    fn transfer_job(
        &self,
        stream: u64,
        job: impl FnOnce(&dyn Collective, &dyn Collective) -> memwise_runtime::Result<()> + 'static,
    ) {
        let threads = self.enqueue(stream);
        let acks = (self.acks.clone()).expect("a pipeline job's acknowledgements");
        COLLECTIVE_STREAM.with(|q| {
            q.borrow_mut()
                .push(Box::new(move || job(&*threads, &*acks)))
        });
    }

    /// Checks a call is for the emulated collective stream and counts it.
    fn enqueue(&self, stream: u64) -> std::sync::Arc<dyn Collective> {
        assert_eq!(
            stream, EMU_COLLECTIVE_STREAM,
            "the emulated collective stream"
        );
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.threads.clone()
    }
}

/// Model parallel on the GPU executor: the MLP in 2 pipeline stages of 4 micro-batches, each
/// stage an emulated device on its own thread, trains as one CPU at the global batch, its
/// transfers through the host or (`on_device`) device to device as NCCL's: each send waits
/// for its receiver, so 1F1B's crossing sends pass only because each run of transfers is one
/// group — and the GPU executor's stages never capture a graph.
#[test]
fn pipeline_stages_on_emulated_devices_train_as_one_cpu() {
    use memwise_plan::pipeline::PipelineSchedule;
    use memwise_plan::stage::{plan_stage, Pipeline};
    use memwise_runtime::executor::stage_inputs;
    use std::sync::Arc;
    let spec = zoo::mnist_mlp(32);
    let one = plan(&spec).unwrap();
    let inputs: Vec<Vec<Vec<u8>>> = (0..3).map(|s| random_inputs(&one, 500 + s)).collect();
    let mut cpu = Executor::new(one.clone(), &Device::cpu(), 11).unwrap();
    let cpu_losses: Vec<f32> = (inputs.iter())
        .map(|raw| cpu.train_step(&batches(&one, raw)).unwrap().loss)
        .collect();
    let names: Vec<String> = (one.inputs.iter())
        .map(|&i| one.tensor(i).name.to_string())
        .collect();
    let runs = [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB]
        .into_iter()
        .flat_map(|schedule| [(schedule, false), (schedule, true)]);
    for (schedule, on_device) in runs {
        let pipe = Pipeline::new(schedule, 4, &["logits"]);
        let device_calls = std::sync::atomic::AtomicUsize::new(0);
        // Per stage: its losses, and its parameters by name.
        type StageRun = (Vec<f32>, Vec<(String, Vec<f32>)>);
        let ranks = ThreadGroup::new(2).into_iter().zip(ThreadGroup::new(2));
        let results: Vec<StageRun> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .map(|(c, acks)| {
                    let (spec, pipe, one, inputs, names) = (&spec, &pipe, &one, &inputs, &names);
                    let device_calls = &device_calls;
                    s.spawn(move || {
                        let stage = plan_stage(spec, pipe, c.rank()).unwrap();
                        let mut gpu =
                            GpuExecutor::new(stage, &Device::cpu(), EmuBackend::default(), 11)
                                .unwrap();
                        let job = Arc::new(HostMemorySums::new(c, Some(acks), on_device));
                        gpu.set_collective(job.clone() as Arc<dyn Collective>)
                            .unwrap();
                        let model_inputs: Vec<&str> = names.iter().map(String::as_str).collect();
                        let losses = (inputs.iter())
                            .map(|raw| {
                                let whole = batches(one, raw);
                                let mine =
                                    stage_inputs(gpu.plan(), &model_inputs, &whole, 0).unwrap();
                                gpu.train_step(&mine).unwrap().loss
                            })
                            .collect();
                        let weights = (gpu.plan().params.iter())
                            .map(|p| (p.name.to_string(), gpu.param(&p.name).unwrap()))
                            .collect();
                        let joined = COLLECTIVE_STREAM.with(|q| q.borrow().is_empty());
                        assert!(joined, "a transfer was never joined");
                        let n = job.calls.load(std::sync::atomic::Ordering::Relaxed);
                        device_calls.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                        (losses, weights)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Device to device: every transfer (2 a micro-batch, 4 micro-batches, 3 steps, at
        // both ends) and nothing else.
        let calls = device_calls.into_inner();
        assert_eq!(calls, if on_device { 2 * 2 * 4 * 3 } else { 0 });
        for (c, g) in cpu_losses.iter().zip(&results[0].0) {
            assert!(
                (c - g).abs() / c.abs().max(1e-3) < 1e-4,
                "{schedule:?}, on device {on_device}: loss {c} vs {g}"
            );
        }
        let mut seen = 0;
        for (name, w) in results.iter().flat_map(|r| r.1.iter()) {
            let e = rel(w, &cpu.param(name).unwrap());
            assert!(
                e < 2e-3,
                "{schedule:?}: `{name}` differs by {e:.2e} (relative L2)"
            );
            seen += 1;
        }
        assert_eq!(seen, one.params.len());
    }
}

/// A split model's `fit` with validation, `evaluate` and `predict` on emulated GPUs give the
/// CPU stages' figures: the MLP in 2 stages of 4 micro-batches, 2 epochs validating on 19
/// held-out samples (2 batches of 8 and a tail of 3), the inference stages built of the
/// training engine's kind (the emulated backend), their transfers through the walk's host
/// copies.
#[test]
fn a_split_model_evaluates_on_emulated_devices_as_on_the_cpu() {
    use memwise_plan::pipeline::PipelineSchedule;
    use memwise_plan::stage::Pipeline;
    use memwise_runtime::stage::StageTrainer;
    use std::sync::Arc;
    let mut spec = zoo::mnist_mlp(8);
    spec.pipeline = Some(Pipeline::new(PipelineSchedule::OneFOneB, 4, &["logits"]));
    let (train, held_out) = (random_digits(40, 3), random_digits(19, 4));
    let opts = FitOptions {
        epochs: 2,
        seed: 5,
        verbose: false,
        ..Default::default()
    };
    // Per rank: its engine's device, the validation losses, `evaluate`'s loss and accuracy,
    // and the predictions.
    type Figures = (String, Vec<Option<f32>>, f32, Option<f32>, Vec<f32>);
    let run = |emulated: bool| -> Vec<Figures> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (ThreadGroup::new(2).into_iter())
                .map(|c| {
                    let (spec, train, held_out, opts) = (&spec, &train, &held_out, &opts);
                    s.spawn(move || {
                        let c: Arc<dyn Collective> = Arc::new(c);
                        let mut make = |p: StaticPlan| -> memwise_runtime::Result<Box<dyn Engine>> {
                            let cpu = Device::cpu();
                            Ok(match emulated {
                                true => {
                                    Box::new(GpuExecutor::new(p, &cpu, EmuBackend::default(), 11)?)
                                }
                                false => Box::new(Executor::new(p, &cpu, 11)?),
                            })
                        };
                        let mut t =
                            StageTrainer::build_with(spec, &Device::cpu(), c, &mut make).unwrap();
                        let h = t.fit(train, Some(held_out), opts).unwrap();
                        let e = t.evaluate(held_out).unwrap();
                        let val = h.epochs.iter().map(|l| l.val_loss).collect();
                        let p = t.predict(held_out).unwrap();
                        (t.engine().device_name(), val, e.loss, e.accuracy, p)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let (cpu, gpu) = (run(false), run(true));
    let near = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
    for (rank, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        assert_eq!((c.0.as_str(), g.0.as_str()), ("cpu", "emulated"));
        eprintln!(
            "rank {rank}: evaluate loss {} emulated, {} on the CPU; accuracy {:?} / {:?}",
            g.2, c.2, g.3, c.3
        );
        assert_eq!(g.1.len(), 2);
        for (a, b) in g.1.iter().zip(&c.1) {
            assert!(
                near(a.unwrap(), b.unwrap()),
                "validation loss {a:?} vs {b:?}"
            );
        }
        assert!(near(g.2, c.2) && g.3 == c.3, "{g:?} vs {c:?}");
        assert_eq!(g.4.len(), 19 * 10);
        assert!(rel(&g.4, &c.4) < 1e-4, "predictions {:e}", rel(&g.4, &c.4));
    }
}
