//! `GpuExecutor`: one training step of a static plan as device kernels and cuBLAS GEMMs.
//!
//! Memory is two allocations made once: the arena (`plan.arena_bytes`) and the persistent
//! region (`plan.persistent_bytes`, plus 256 bytes at its end for [`MwScalars`]). Before
//! allocating, the plan's total is compared with the device's free memory (and the device's
//! memory limit) and refused with the numbers. Every tensor is `arena + offset`, every
//! parameter `persistent + offset`: a step launches kernels on those addresses and allocates
//! nothing. Inputs travel host → device in their stored dtype (u8 pixels stay u8; the plan's
//! `input_cast` step converts them on the device).
//!
//! Each op runs the same sequence as the CPU executor (`crate::executor`), with these
//! documented differences: GEMMs accumulate in f32 in cuBLAS's order; with 16-bit storage a
//! GEMM's output is rounded before its bias is added (the CPU adds the bias first: one more
//! rounding); embedding gradients are summed with atomics (order varies); non-finite losses
//! (float32) and out-of-range labels are found on the device and reported after the step,
//! with the update skipped as on the CPU.

use std::borrow::Cow;

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_kernels::cublas_map::{self as cm, CublasGemm, Operand, RowGemm};
use memwise_kernels::cuda::launch::{
    self as kl, name1, name2, name3, Float, KArg, KernelCall, LaunchCfg, MwDepthwise, MwGeom,
    MwPool, MwScalars,
};
use memwise_plan::liveness::align_up;
use memwise_plan::{
    Activation as Act, DType, Op, Optimizer, Phase, PlanStep, Reduction, StaticPlan, Window2d,
    NONE, NO_OFFSET,
};

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::executor::{
    attention_dims, check_param_values, conv_dims, convt_dims, dw_dims, param_named,
    readable_prediction, trainable_param_named, Batch, StepOutput,
};
use crate::memory::Region;
use crate::weights::{PersistentState, TrainingCounters};

/// What the executor needs from a device. Addresses are `u64` device pointers.
pub trait Backend {
    /// A short description (`cuda:0 (NVIDIA H200)`, `emulated` …).
    fn name(&self) -> String;
    /// `(free, total)` device memory in bytes, when the device knows it.
    fn memory(&self) -> Option<(u64, u64)>;
    /// One zeroed allocation of `bytes`, owned by the backend; returns its address.
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String>;
    /// Host → device copy (ordered with the launches).
    ///
    /// # Safety
    /// `dst` must have room for `src`.
    unsafe fn upload(&self, src: &[u8], dst: u64) -> std::result::Result<(), String>;
    /// Device → host copy; returns when the data is there.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes.
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> std::result::Result<(), String>;
    /// Zeroes `bytes` bytes at `dst` (capturable).
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory.
    unsafe fn zero(&self, dst: u64, bytes: usize) -> std::result::Result<(), String>;
    /// Launches a kernel.
    ///
    /// # Safety
    /// The call's pointers must be valid for what the kernel touches.
    unsafe fn launch(&self, call: &KernelCall) -> std::result::Result<(), String>;
    /// Runs a mapped GEMM; `a`, `b`, `c` are the addresses of the buffers `g.a.0`, `g.b.0`,
    /// `g.c.0`, of element types `types`.
    ///
    /// # Safety
    /// The addresses must hold what `g.extents()` says the call touches.
    unsafe fn gemm(
        &self,
        g: &CublasGemm,
        a: u64,
        b: u64,
        c: u64,
        types: [Float; 3],
    ) -> std::result::Result<(), String>;
    fn synchronize(&self) -> std::result::Result<(), String>;
    /// Starts recording the launches that follow into a graph; `false` when this backend
    /// has no graphs (then nothing is recorded and launches run as usual).
    fn begin_capture(&mut self) -> std::result::Result<bool, String>;
    /// Ends the recording and instantiates the graph.
    fn end_capture(&mut self) -> std::result::Result<(), String>;
    /// Replays the recorded graph.
    fn replay(&self) -> std::result::Result<(), String>;
    /// Forgets the recorded graph.
    fn clear_graph(&mut self);
    /// A new backend on the same device, holding no allocations and no graph: for the
    /// inference executors a trainer builds beside its training executor.
    fn open_another(&self) -> std::result::Result<Self, String>
    where
        Self: Sized;
}

fn dev(e: String) -> RuntimeError {
    RuntimeError::Device(e)
}

/// Bytes reserved after the persistent region for [`MwScalars`].
const SCALARS_BYTES: u64 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Graph {
    /// No graph: every step launches its kernels (the first step always does).
    Eager,
    /// The step is captured; steps replay it.
    Captured,
    /// The backend cannot capture.
    Unsupported,
}

/// Runs training steps of one plan on a device.
pub struct GpuExecutor<B: Backend> {
    plan: StaticPlan,
    backend: B,
    arena: u64,
    persistent: u64,
    scalars: u64,
    seed: u64,
    step_counter: u64,
    updates: u64,
    scaler: k::optimizer::LossScaler,
    /// Byte range of the gradients in the persistent region.
    grads_range: (u64, u64),
    graph: Graph,
    use_graph: bool,
    /// Device bytes in use before the model's allocations (for the measured peak).
    used_before: Option<u64>,
    /// Steps whose launches were replayed from the graph.
    pub graph_replays: u64,
}

fn float(dt: DType) -> Result<Float> {
    match dt {
        DType::F32 => Ok(Float::F32),
        DType::F16 => Ok(Float::F16),
        DType::BF16 => Ok(Float::Bf16),
        other => Err(RuntimeError::Memory(format!(
            "expected a float tensor, found {}",
            other.name()
        ))),
    }
}

fn p(addr: u64) -> KArg {
    KArg::Ptr(addr)
}
fn u(n: usize) -> KArg {
    KArg::U64(n as u64)
}

fn pool_dims(d: &Window2d) -> Result<k::pool::Pool2d> {
    crate::executor::pool_dims(d).map_err(|e| RuntimeError::Memory(e.0))
}
fn act_code(a: Act) -> i32 {
    use k::activation::Activation as A;
    kl::activation_code(match a {
        Act::Linear | Act::Softmax => A::Linear,
        Act::Relu => A::Relu,
        Act::Sigmoid => A::Sigmoid,
        Act::Tanh => A::Tanh,
        Act::Gelu => A::Gelu,
        Act::Silu => A::Silu,
    })
}

impl<B: Backend> GpuExecutor<B> {
    /// Allocates the plan's two regions on `backend` — after checking that they fit the
    /// device's free memory and `device.memory_limit` (an `Err` with the numbers, nothing
    /// allocated) — and initialises the weights exactly as the CPU executor does for `seed`.
    pub fn new(
        plan: StaticPlan,
        device: &Device,
        mut backend: B,
        seed: u64,
    ) -> Result<GpuExecutor<B>> {
        let total = plan.persistent_bytes + SCALARS_BYTES + plan.arena_bytes;
        let mem = backend.memory();
        let available = match (device.memory_limit, mem) {
            (Some(l), Some((free, _))) => Some(l.min(free)),
            (l, m) => l.or(m.map(|m| m.0)),
        };
        if let Some(avail) = available {
            if total > avail {
                return Err(RuntimeError::OutOfMemory {
                    needed: total,
                    available: avail,
                    device: backend.name(),
                });
            }
        }
        let used_before = mem.map(|(free, t)| t - free);
        // Weights: initialised on the host exactly as the CPU executor does, then uploaded.
        let mut host = Region::new(
            plan.persistent_bytes as usize,
            "persistent region (host copy)",
        )?;
        crate::init::initialise(&plan, &mut host, seed)?;
        refresh_half_copies(&plan, &mut host)?;
        let persistent = backend
            .alloc((plan.persistent_bytes + SCALARS_BYTES) as usize)
            .map_err(dev)?;
        let arena = backend.alloc(plan.arena_bytes as usize).map_err(dev)?;
        // SAFETY: the persistent allocation holds persistent_bytes.
        unsafe { backend.upload(host.bytes(), persistent).map_err(dev)? };
        let grads_range = plan.grads_range();
        let scaler = if plan.loss_scaling {
            k::optimizer::LossScaler::new()
        } else {
            k::optimizer::LossScaler::disabled()
        };
        backend.synchronize().map_err(dev)?;
        Ok(GpuExecutor {
            scalars: persistent + plan.persistent_bytes,
            plan,
            backend,
            arena,
            persistent,
            seed,
            step_counter: 0,
            updates: 0,
            scaler,
            grads_range,
            graph: Graph::Eager,
            use_graph: true,
            used_before,
            graph_replays: 0,
        })
    }

    pub fn plan(&self) -> &StaticPlan {
        &self.plan
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The seed the weights were initialised from; it keys dropout and sampling.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Training steps run so far.
    pub fn step_counter(&self) -> u64 {
        self.step_counter
    }

    /// The dynamic loss scale (1.0 when loss scaling is off).
    pub fn loss_scale(&self) -> f32 {
        self.scaler.scale()
    }

    /// Whether steps after the first are captured once as a CUDA graph and replayed (on by
    /// default). Turning it off drops a captured graph.
    pub fn set_graph(&mut self, on: bool) {
        self.use_graph = on;
        if !on && self.graph == Graph::Captured {
            self.backend.clear_graph();
            self.graph = Graph::Eager;
        }
    }

    /// Device bytes in use now minus before the model was allocated (the measured footprint
    /// of the model, to set beside the plan's total), when the device reports its memory.
    pub fn device_bytes_used(&self) -> Option<u64> {
        let (free, total) = self.backend.memory()?;
        Some((total - free).saturating_sub(self.used_before?))
    }

    /// The f32 values of parameter `name`.
    pub fn param(&self, name: &str) -> Result<Vec<f32>> {
        let (_, p) = param_named(&self.plan, name)?;
        self.download_f32(self.persistent + p.offset, p.elems())
    }

    /// The f32 gradient of parameter `name` from the last step.
    pub fn grad(&self, name: &str) -> Result<Vec<f32>> {
        let p = trainable_param_named(&self.plan, name)?;
        self.download_f32(self.persistent + p.grad_offset, p.elems())
    }

    /// Overwrites parameter `name` with `values`, and its 16-bit copy when it has one
    /// (rounded on the host as the CPU executor rounds it).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let (_, p) = param_named(&self.plan, name)?;
        check_param_values(p, values)?;
        let half: Option<Vec<u8>> = match p.half_copy {
            Some(DType::F16) => {
                let mut h = vec![f16::ZERO; values.len()];
                k::elementwise::cast(values, &mut h).map_err(|e| RuntimeError::Memory(e.0))?;
                Some(h.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            Some(DType::BF16) => {
                let mut h = vec![bf16::ZERO; values.len()];
                k::elementwise::cast(values, &mut h).map_err(|e| RuntimeError::Memory(e.0))?;
                Some(h.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            _ => None,
        };
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: the parameter's f32 values and its 16-bit copy lie inside the persistent
        // region, at the plan's offsets.
        unsafe {
            self.backend
                .upload(&bytes, self.persistent + p.offset)
                .map_err(dev)?;
            if let Some(h) = half {
                self.backend
                    .upload(&h, self.persistent + p.half_offset)
                    .map_err(dev)?;
            }
        }
        Ok(())
    }

    /// The prediction tensor's values after the last step of an inference plan, as f32 (a
    /// training plan is refused, as on the CPU: later steps may reuse the prediction's bytes).
    pub fn read_prediction(&self, out: &mut [f32]) -> Result<()> {
        let t = readable_prediction(&self.plan, out.len())?;
        let mut raw = vec![0u8; t.elems() * t.dtype.size() as usize];
        // SAFETY: the tensor's bytes are inside the arena.
        unsafe {
            self.backend
                .download(self.arena + t.offset, &mut raw)
                .map_err(dev)?
        };
        for (o, c) in out
            .iter_mut()
            .zip(raw.chunks_exact(t.dtype.size() as usize))
        {
            *o = match t.dtype {
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
                DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
                other => {
                    return Err(RuntimeError::Input(format!(
                        "prediction is {}",
                        other.name()
                    )))
                }
            };
        }
        Ok(())
    }

    fn download_f32(&self, addr: u64, n: usize) -> Result<Vec<f32>> {
        let mut raw = vec![0u8; n * 4];
        // SAFETY: callers pass ranges of the persistent region.
        unsafe { self.backend.download(addr, &mut raw).map_err(dev)? };
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Runs the plan's forward and loss steps (an inference plan).
    pub fn evaluate_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        if self.plan.training {
            return Err(RuntimeError::Input(
                "evaluate_step needs an inference plan (plan_inference)".into(),
            ));
        }
        self.train_step(inputs)
    }

    /// Runs one training step on `inputs` (one batch per model input, in declaration order).
    pub fn train_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        self.load_inputs(inputs)?;
        let sc = MwScalars {
            step: self.step_counter,
            loss_scale: self.scaler.scale(),
            grad_unscale: 1.0 / self.scaler.scale(),
            adam_alpha: self.adam_alpha(),
            nonfinite: 0,
            correct: 0,
            bad_index: 0,
        };
        // SAFETY: the scalars block is SCALARS_BYTES at the end of the persistent allocation.
        unsafe {
            self.backend
                .upload(struct_bytes(&sc), self.scalars)
                .map_err(dev)?
        };
        match self.graph {
            Graph::Captured => {
                self.backend.replay().map_err(dev)?;
                self.graph_replays += 1;
            }
            Graph::Eager if self.use_graph && self.step_counter > 0 => {
                if self.backend.begin_capture().map_err(dev)? {
                    let r = self.record_step();
                    self.backend.end_capture().map_err(dev)?;
                    r?;
                    self.graph = Graph::Captured;
                    self.backend.replay().map_err(dev)?;
                    self.graph_replays += 1;
                } else {
                    self.graph = Graph::Unsupported;
                    self.record_step()?;
                }
            }
            _ => self.record_step()?,
        }
        // Read back the flags and the loss values.
        let mut raw = [0u8; std::mem::size_of::<MwScalars>()];
        // SAFETY: as above.
        unsafe { self.backend.download(self.scalars, &mut raw).map_err(dev)? };
        // SAFETY: MwScalars is plain old data and raw holds exactly one.
        let after: MwScalars =
            unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const MwScalars) };
        let mut loss = 0f32;
        for &id in self.plan.losses.iter() {
            let mut b = [0u8; 4];
            // SAFETY: a loss value is one f32 in the arena.
            unsafe {
                self.backend
                    .download(self.arena + self.plan.tensor(id).offset, &mut b)
                    .map_err(dev)?
            };
            loss += f32::from_le_bytes(b);
        }
        if after.bad_index != 0 {
            return Err(RuntimeError::Input(format!(
                "sample or token {} has a label or id out of range; the weights were not updated",
                after.bad_index - 1
            )));
        }
        let mut out = StepOutput {
            loss,
            correct: after.correct.max(0) as usize,
            skipped: false,
        };
        if self.plan.training {
            if self.plan.loss_scaling {
                if let k::optimizer::StepDecision::Skip = self.scaler.update(after.nonfinite != 0) {
                    out.skipped = true;
                }
            } else if after.nonfinite != 0 {
                return Err(RuntimeError::NonFinite(format!(
                    "training step {}: the loss is {loss}; the weights were not updated",
                    self.step_counter + 1
                )));
            }
        }
        if !out.skipped {
            self.updates += 1;
        }
        self.step_counter += 1;
        Ok(out)
    }

    fn adam_alpha(&self) -> f32 {
        match self.plan.optimizer {
            Optimizer::Adam {
                lr, beta_1, beta_2, ..
            }
            | Optimizer::AdamW {
                lr, beta_1, beta_2, ..
            } => kl::adam_alpha(lr, beta_1, beta_2, self.updates + 1),
            _ => 0.0,
        }
    }

    /// Checks `inputs` against the model's inputs (the CPU executor's checks: count, dtype,
    /// length, finite floats, labels and ids in range) and copies them into their tensors.
    fn load_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        crate::executor::check_inputs(&self.plan, inputs)?;
        let ids = &self.plan.inputs;
        for (b, &id) in inputs.iter().zip(ids.iter()) {
            let t = self.plan.tensor(id);
            if t.first > t.last {
                continue;
            }
            // SAFETY: the input tensor's bytes are inside the arena.
            unsafe {
                self.backend
                    .upload(batch_bytes(b), self.arena + t.offset)
                    .map_err(dev)?
            };
        }
        Ok(())
    }

    /// Launches every step of the plan (recorded into the graph when capturing).
    fn record_step(&self) -> Result<()> {
        let (g0, g1) = self.grads_range;
        if self.plan.training && g1 > g0 {
            // SAFETY: the gradient range is inside the persistent region.
            unsafe {
                self.backend
                    .zero(self.persistent + g0, (g1 - g0) as usize)
                    .map_err(dev)?
            };
        }
        for s in self.plan.steps.iter() {
            let r = match (s.phase, s.op) {
                (_, Op::CheckFinite) => self.check_finite(),
                (_, Op::Update) => self.update(s),
                (Phase::Loss, _) => self.loss(s),
                (Phase::Backward, _) => self.backward(s),
                _ => self.forward(s),
            };
            r.map_err(|e| match e {
                RuntimeError::Device(m) | RuntimeError::Memory(m) => RuntimeError::Device(format!(
                    "step {} ({} of layer `{}`): {m}",
                    s.index,
                    s.op.name(),
                    s.layer
                )),
                other => other,
            })?;
        }
        Ok(())
    }

    // ---- addresses ----

    /// Address of tensor `id`.
    fn t(&self, id: u32) -> Result<u64> {
        if id == NONE {
            return Err(RuntimeError::Memory(
                "a needed tensor is absent (NONE)".into(),
            ));
        }
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| RuntimeError::Memory(format!("no tensor {id}")))?;
        Ok(self.arena + t.offset)
    }
    /// Address of tensor `id`, or a null pointer for NONE.
    fn t_or_null(&self, id: u32) -> Result<u64> {
        if id == NONE {
            Ok(0)
        } else {
            self.t(id)
        }
    }
    fn ft(&self, id: u32) -> Result<Float> {
        float(self.plan.tensors[id as usize].dtype)
    }
    fn elems(&self, id: u32) -> usize {
        self.plan.tensors[id as usize].elems()
    }
    fn same(&self, a: u32, b: u32) -> bool {
        a != NONE
            && b != NONE
            && self.plan.tensors[a as usize].offset == self.plan.tensors[b as usize].offset
    }
    /// The f32 values of parameter `pid`.
    fn pv(&self, pid: u32) -> u64 {
        self.persistent + self.plan.params[pid as usize].offset
    }
    /// The weights a GEMM reads in storage type `t`: the f32 values or their 16-bit copy.
    fn pw(&self, pid: u32, t: Float) -> Result<u64> {
        let p = &self.plan.params[pid as usize];
        let want = match t {
            Float::F32 => return Ok(self.persistent + p.offset),
            Float::F16 => DType::F16,
            Float::Bf16 => DType::BF16,
        };
        if p.half_copy == Some(want) {
            Ok(self.persistent + p.half_offset)
        } else {
            Err(RuntimeError::Memory(format!(
                "parameter `{}` has no {} copy",
                p.name,
                want.name()
            )))
        }
    }
    fn pg(&self, pid: u32) -> Result<u64> {
        let p = &self.plan.params[pid as usize];
        if p.grad_offset == NO_OFFSET {
            return Err(RuntimeError::Memory(format!(
                "parameter `{}` has no gradient",
                p.name
            )));
        }
        Ok(self.persistent + p.grad_offset)
    }
    fn sc(&self) -> KArg {
        p(self.scalars)
    }
    fn key_seed(&self) -> KArg {
        KArg::U64(self.seed)
    }

    fn k(&self, name: String, cfg: LaunchCfg, args: Vec<KArg>) -> Result<()> {
        let call = KernelCall::new(name, cfg, args);
        // SAFETY: every pointer argument is an address inside the two regions, at a tensor's
        // or parameter's planned offset, sized by the plan for the dims passed.
        unsafe { self.backend.launch(&call).map_err(dev) }
    }

    /// Runs row-major GEMM `g`, resolving its operands with `buf` to (address, type).
    fn gemm(&self, g: &RowGemm, buf: &dyn Fn(Operand) -> Result<(u64, Float)>) -> Result<()> {
        let cg = cm::to_cublas(g);
        if cg.m == 0 || cg.n == 0 || cg.batch == 0 {
            return Ok(());
        }
        let (a, ta) = buf(cg.a.0)?;
        let (b, tb) = buf(cg.b.0)?;
        let (c, tc) = buf(cg.c.0)?;
        // SAFETY: the mapping's extents lie inside the planned tensors (tests/cublas_map.rs).
        unsafe { self.backend.gemm(&cg, a, b, c, [ta, tb, tc]).map_err(dev) }
    }

    // ---- steps ----

    fn check_finite(&self) -> Result<()> {
        let (g0, g1) = self.grads_range;
        let n = ((g1 - g0) / 4) as usize;
        if n == 0 {
            return Ok(());
        }
        self.k(
            "mw_all_finite_f32".into(),
            LaunchCfg::pointwise(n as u64),
            vec![p(self.persistent + g0), u(n), self.sc()],
        )
    }

    fn update(&self, s: &PlanStep) -> Result<()> {
        let slots = self.plan.optimizer.state_slots();
        for &pid in s.params.iter() {
            let prm = &self.plan.params[pid as usize];
            if prm.grad_offset == NO_OFFSET {
                continue;
            }
            let n = prm.elems();
            let stride = align_up(n as u64 * 4, self.plan.alignment);
            let state = |slot: u64| {
                if slot < slots {
                    p(self.persistent + prm.state_offset + slot * stride)
                } else {
                    p(0)
                }
            };
            let (pv, g, cfg) = (
                p(self.pv(pid)),
                p(self.pg(pid)?),
                LaunchCfg::pointwise(n as u64),
            );
            match self.plan.optimizer {
                Optimizer::Sgd { lr } => self.k(
                    "mw_sgd".into(),
                    cfg,
                    vec![
                        pv,
                        g,
                        p(0),
                        u(n),
                        KArg::F32(lr),
                        KArg::F32(0.0),
                        KArg::I32(0),
                        self.sc(),
                    ],
                )?,
                Optimizer::Momentum {
                    lr,
                    momentum,
                    nesterov,
                } => {
                    let m = if momentum != 0.0 { state(0) } else { p(0) };
                    self.k(
                        "mw_sgd".into(),
                        cfg,
                        vec![
                            pv,
                            g,
                            m,
                            u(n),
                            KArg::F32(lr),
                            KArg::F32(momentum),
                            KArg::I32(nesterov as i32),
                            self.sc(),
                        ],
                    )?
                }
                Optimizer::RmsProp {
                    lr,
                    rho,
                    epsilon,
                    momentum,
                    centered,
                } => {
                    let mom = if momentum > 0.0 { state(1) } else { p(0) };
                    let avg = if centered {
                        state(1 + (momentum > 0.0) as u64)
                    } else {
                        p(0)
                    };
                    self.k(
                        "mw_rmsprop".into(),
                        cfg,
                        vec![
                            pv,
                            g,
                            state(0),
                            mom,
                            avg,
                            u(n),
                            KArg::F32(lr),
                            KArg::F32(rho),
                            KArg::F32(momentum),
                            KArg::F32(epsilon),
                            self.sc(),
                        ],
                    )?
                }
                Optimizer::Adam {
                    beta_1,
                    beta_2,
                    epsilon,
                    ..
                } => self.k(
                    "mw_adam".into(),
                    cfg,
                    vec![
                        pv,
                        g,
                        state(0),
                        state(1),
                        u(n),
                        KArg::F32(beta_1),
                        KArg::F32(beta_2),
                        KArg::F32(epsilon),
                        KArg::F32(0.0),
                        self.sc(),
                    ],
                )?,
                Optimizer::AdamW {
                    lr,
                    beta_1,
                    beta_2,
                    epsilon,
                    weight_decay,
                } => self.k(
                    "mw_adam".into(),
                    cfg,
                    vec![
                        pv,
                        g,
                        state(0),
                        state(1),
                        u(n),
                        KArg::F32(beta_1),
                        KArg::F32(beta_2),
                        KArg::F32(epsilon),
                        KArg::F32(weight_decay * lr),
                        self.sc(),
                    ],
                )?,
            }
            if let Some(h) = prm.half_copy {
                let hf = float(h)?;
                self.k(
                    name2("mw_cast", Float::F32, hf),
                    cfg,
                    vec![pv, p(self.persistent + prm.half_offset), u(n)],
                )?;
            }
        }
        Ok(())
    }

    fn forward(&self, s: &PlanStep) -> Result<()> {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let (ws_id, _sc_id) = (wr[nw - 2], wr[nw - 1]);
        let recompute = s.phase == Phase::Recompute;
        match s.op {
            Op::InputCast { scale, .. } => {
                let n = self.elems(wr[0]);
                self.k(
                    name1("mw_cast_u8", self.ft(wr[0])?),
                    LaunchCfg::pointwise(n as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(wr[0])?),
                        u(n),
                        KArg::F32(scale),
                        KArg::F32(0.0),
                    ],
                )
            }
            Op::Cast { elems } => self.k(
                name2("mw_cast", self.ft(rd[0])?, self.ft(wr[0])?),
                LaunchCfg::pointwise(elems as u64),
                vec![p(self.t(rd[0])?), p(self.t(wr[0])?), u(elems)],
            ),
            Op::Dense {
                rows,
                in_features,
                units,
                bias,
            } => {
                let t = self.ft(wr[0])?;
                let d = k::dense::DenseDims {
                    batch: rows,
                    in_features,
                    out_features: units,
                };
                let (x, w, y) = (self.t(rd[0])?, self.pw(s.params[0], t)?, self.t(wr[0])?);
                self.gemm(&cm::dense_forward(d), &|o| match o {
                    Operand::X => Ok((x, t)),
                    Operand::W => Ok((w, t)),
                    _ => Ok((y, t)),
                })?;
                if bias {
                    self.k(
                        name1("mw_bias_add", t),
                        LaunchCfg::pointwise((rows * units) as u64),
                        vec![p(y), p(self.pv(s.params[1])), u(rows), u(units)],
                    )?;
                }
                Ok(())
            }
            Op::Conv2d { dims, bias, chunk } => {
                let t = self.ft(wr[0])?;
                let d = conv_dims(&dims);
                let g = MwGeom::conv2d(&d);
                let (x, w, y) = (self.t(rd[0])?, self.pw(s.params[0], t)?, self.t(wr[0])?);
                let col = self.t_or_null(ws_id)?;
                let bufs = |o: Operand| -> Result<(u64, Float)> {
                    Ok(match o {
                        Operand::X => (x, t),
                        Operand::W => (w, t),
                        Operand::Col => (col, t),
                        _ => (y, t),
                    })
                };
                if d.is_pointwise() {
                    self.gemm(&cm::conv2d_forward_pointwise(&d), &bufs)?;
                } else {
                    let p_ = d.out_h() * d.out_w();
                    for (n0, cn) in cm::chunks(d.n, chunk) {
                        self.k(
                            name1("mw_im2col", t),
                            LaunchCfg::pointwise((cn * p_ * g.k()) as u64),
                            vec![
                                p(x),
                                p(col),
                                KArg::Geom(g),
                                KArg::I32(n0 as i32),
                                KArg::I32(cn as i32),
                            ],
                        )?;
                        self.gemm(&cm::conv2d_forward_chunk(&d, n0, cn), &bufs)?;
                    }
                }
                if bias {
                    let rows = d.y_len() / d.c_out;
                    self.k(
                        name1("mw_bias_add", t),
                        LaunchCfg::pointwise(d.y_len() as u64),
                        vec![p(y), p(self.pv(s.params[1])), u(rows), u(d.c_out)],
                    )?;
                }
                Ok(())
            }
            Op::Conv2dTranspose { dims, bias, chunk } => {
                let t = self.ft(wr[0])?;
                let d = convt_dims(&dims);
                let g = MwGeom::conv2d_transpose(&d);
                let (x, w, y) = (self.t(rd[0])?, self.pw(s.params[0], t)?, self.t(wr[0])?);
                let col = self.t_or_null(ws_id)?;
                let b = if bias { self.pv(s.params[1]) } else { 0 };
                let bufs = |o: Operand| -> Result<(u64, Float)> {
                    Ok(match o {
                        Operand::X => (x, t),
                        Operand::W => (w, t),
                        Operand::Col => (col, t),
                        _ => (y, t),
                    })
                };
                if d.is_pointwise() {
                    self.gemm(&cm::conv2d_transpose_forward_pointwise(&d), &bufs)?;
                    if bias {
                        self.k(
                            name1("mw_bias_add", t),
                            LaunchCfg::pointwise(d.y_len() as u64),
                            vec![p(y), p(b), u(d.y_len() / d.c_out), u(d.c_out)],
                        )?;
                    }
                } else {
                    let img = d.out_h() * d.out_w() * d.c_out;
                    for (n0, cn) in cm::chunks(d.n, chunk) {
                        self.gemm(&cm::conv2d_transpose_forward_chunk(&d, n0, cn), &bufs)?;
                        let yc = y + (n0 * img * t.size()) as u64;
                        self.k(
                            name1("mw_col2im", t),
                            LaunchCfg::pointwise((cn * img) as u64),
                            vec![p(col), p(yc), KArg::Geom(g), KArg::I32(cn as i32), p(b)],
                        )?;
                    }
                }
                Ok(())
            }
            Op::DepthwiseConv2d { dims, bias } => {
                let t = self.ft(wr[0])?;
                let d = dw_dims(&dims);
                let b = if bias { self.pv(s.params[1]) } else { 0 };
                self.k(
                    name1("mw_dw_fwd", t),
                    LaunchCfg::pointwise(d.y_len() as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.pw(s.params[0], t)?),
                        p(b),
                        p(self.t(wr[0])?),
                        KArg::Depthwise(MwDepthwise::from(&d)),
                    ],
                )
            }
            Op::MaxPool2d { dims } => {
                let d = pool_dims(&dims)?;
                self.k(
                    name1("mw_maxpool_fwd", self.ft(wr[0])?),
                    LaunchCfg::pointwise(d.out_len() as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(wr[0])?),
                        p(self.t(wr[1])?),
                        KArg::Pool(MwPool::from(&d)),
                    ],
                )
            }
            Op::AvgPool2d { dims } => {
                let d = pool_dims(&dims)?;
                self.k(
                    name1("mw_avgpool_fwd", self.ft(wr[0])?),
                    LaunchCfg::pointwise(d.out_len() as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(wr[0])?),
                        KArg::Pool(MwPool::from(&d)),
                    ],
                )
            }
            Op::GlobalAvgPool { n, hw, c } => self.k(
                name1("mw_gap_fwd", self.ft(wr[0])?),
                LaunchCfg::pointwise((n * c) as u64),
                vec![p(self.t(rd[0])?), p(self.t(wr[0])?), u(n), u(hw), u(c)],
            ),
            Op::BatchNorm {
                rows,
                channels,
                momentum,
                epsilon,
            } => {
                let (rm, rv) = if recompute {
                    (0, 0)
                } else {
                    (self.pv(s.params[2]), self.pv(s.params[3]))
                };
                self.k(
                    name1("mw_bn_train_fwd", self.ft(wr[0])?),
                    LaunchCfg::strip(channels as u64, 1),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(wr[0])?),
                        p(self.t(wr[1])?),
                        p(self.t(wr[2])?),
                        p(self.t(wr[3])?),
                        p(rm),
                        p(rv),
                        p(self.pv(s.params[0])),
                        p(self.pv(s.params[1])),
                        u(rows),
                        u(channels),
                        KArg::F32(epsilon),
                        KArg::F32(momentum),
                    ],
                )
            }
            Op::BatchNormInference {
                rows,
                channels,
                epsilon,
            } => self.k(
                name1("mw_bn_infer", self.ft(wr[0])?),
                LaunchCfg::pointwise((rows * channels) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(wr[0])?),
                    p(self.pv(s.params[0])),
                    p(self.pv(s.params[1])),
                    p(self.pv(s.params[2])),
                    p(self.pv(s.params[3])),
                    u(rows),
                    u(channels),
                    KArg::F32(epsilon),
                ],
            ),
            Op::LayerNorm {
                rows,
                features,
                epsilon,
            } => self.k(
                name1("mw_ln_fwd", self.ft(wr[0])?),
                LaunchCfg::rows(rows as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(wr[0])?),
                    p(self.t(wr[1])?),
                    p(self.t(wr[2])?),
                    p(self.pv(s.params[0])),
                    p(self.pv(s.params[1])),
                    u(rows),
                    u(features),
                    KArg::F32(epsilon),
                ],
            ),
            Op::Dropout { elems, rate, key } => self.k(
                name1("mw_dropout_fwd", self.ft(wr[0])?),
                LaunchCfg::pointwise(elems.div_ceil(4) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(wr[0])?),
                    p(self.t(wr[1])?),
                    u(elems),
                    KArg::F32(rate),
                    self.key_seed(),
                    KArg::U32(key),
                    self.sc(),
                ],
            ),
            Op::Activation {
                act: Act::Softmax,
                elems,
                cols,
            } => {
                let rows = elems / cols.max(1);
                self.k(
                    name2("mw_softmax", self.ft(rd[0])?, self.ft(wr[0])?),
                    LaunchCfg::rows(rows as u64),
                    vec![p(self.t(rd[0])?), p(self.t(wr[0])?), u(rows), u(cols)],
                )
            }
            Op::Activation { act, elems, .. } => self.k(
                name1("mw_act_fwd", self.ft(wr[0])?),
                LaunchCfg::pointwise(elems as u64),
                vec![
                    KArg::I32(act_code(act)),
                    p(self.t(rd[0])?),
                    p(self.t(wr[0])?),
                    u(elems),
                ],
            ),
            Op::Add { elems, .. } => {
                if rd.len() > 8 {
                    return Err(RuntimeError::Memory("add of more than 8 inputs".into()));
                }
                let mut args = vec![p(self.t(wr[0])?)];
                for j in 0..8 {
                    args.push(if j < rd.len() {
                        p(self.t(rd[j])?)
                    } else {
                        p(0)
                    });
                }
                args.extend([KArg::I32(rd.len() as i32), u(elems)]);
                self.k(
                    name1("mw_add_n", self.ft(wr[0])?),
                    LaunchCfg::pointwise(elems as u64),
                    args,
                )
            }
            Op::Concat { rows, a, b } => self.k(
                name1("mw_concat", self.ft(wr[0])?),
                LaunchCfg::pointwise((rows * (a + b)) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.t(wr[0])?),
                    u(rows),
                    u(a),
                    u(b),
                ],
            ),
            Op::Embedding { tokens, vocab, dim } => self.k(
                name1("mw_embedding_fwd", self.ft(wr[0])?),
                LaunchCfg::pointwise((tokens * dim) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.pv(s.params[0])),
                    p(self.t(wr[0])?),
                    u(tokens),
                    u(vocab),
                    u(dim),
                    self.sc(),
                ],
            ),
            Op::Attention {
                batch,
                seq,
                heads,
                head_dim,
                causal,
                dropout,
                key,
            } => {
                let t = self.ft(wr[0])?;
                let (d, scale) = attention_dims(batch, seq, heads, head_dim);
                let (qkv, probs) = (self.t(rd[0])?, self.t(wr[0])?);
                let (used, ctx) = if dropout > 0.0 {
                    (self.t(wr[2])?, self.t(wr[3])?)
                } else {
                    (probs, self.t(wr[1])?)
                };
                for g in cm::attention_scores(&d, scale) {
                    self.gemm(&g, &|o| {
                        Ok((if o == Operand::Qkv { qkv } else { probs }, t))
                    })?;
                }
                let pairs = batch * heads;
                if causal {
                    self.k(
                        name1("mw_causal_mask", t),
                        LaunchCfg::pointwise(d.scores_len() as u64),
                        vec![p(probs), u(pairs), u(seq)],
                    )?;
                }
                self.k(
                    name2("mw_softmax", t, t),
                    LaunchCfg::rows((pairs * seq) as u64),
                    vec![p(probs), p(probs), u(pairs * seq), u(seq)],
                )?;
                if dropout > 0.0 {
                    let n = d.scores_len();
                    self.k(
                        name1("mw_dropout_fwd", t),
                        LaunchCfg::pointwise(n.div_ceil(4) as u64),
                        vec![
                            p(probs),
                            p(used),
                            p(self.t(wr[1])?),
                            u(n),
                            KArg::F32(dropout),
                            self.key_seed(),
                            KArg::U32(key),
                            self.sc(),
                        ],
                    )?;
                }
                for g in cm::attention_context(&d) {
                    self.gemm(&g, &|o| {
                        Ok((
                            match o {
                                Operand::Qkv => qkv,
                                Operand::Probs => used,
                                _ => ctx,
                            },
                            t,
                        ))
                    })?;
                }
                Ok(())
            }
            Op::SampleNormal { elems, key } => self.k(
                name1("mw_sample_normal_fwd", self.ft(wr[0])?),
                LaunchCfg::pointwise(elems.div_ceil(4) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.t(wr[0])?),
                    u(elems),
                    self.key_seed(),
                    KArg::U32(key),
                    self.sc(),
                ],
            ),
            other => Err(RuntimeError::Memory(format!(
                "{} is not a forward op",
                other.name()
            ))),
        }
    }

    fn backward(&self, s: &PlanStep) -> Result<()> {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let ws_id = wr[nw - 2];
        match s.op {
            Op::Cast { elems } => self.k(
                name2("mw_cast", self.ft(rd[0])?, self.ft(wr[0])?),
                LaunchCfg::pointwise(elems as u64),
                vec![p(self.t(rd[0])?), p(self.t(wr[0])?), u(elems)],
            ),
            Op::Dense {
                rows,
                in_features,
                units,
                bias,
            } => {
                let t = self.ft(rd[0])?;
                let d = k::dense::DenseDims {
                    batch: rows,
                    in_features,
                    out_features: units,
                };
                let (x, w, dy, dx, dw) = (
                    self.t(rd[0])?,
                    self.pw(s.params[0], t)?,
                    self.t(rd[1])?,
                    self.t_or_null(wr[0])?,
                    self.pg(s.params[0])?,
                );
                for g in cm::dense_backward(d, wr[0] != NONE) {
                    self.gemm(&g, &|o| {
                        Ok(match o {
                            Operand::X => (x, t),
                            Operand::W => (w, t),
                            Operand::Dy => (dy, t),
                            Operand::Dw => (dw, Float::F32),
                            _ => (dx, t),
                        })
                    })?;
                }
                if bias {
                    self.k(
                        name1("mw_column_sums", t),
                        LaunchCfg::strip(units as u64, 1),
                        vec![p(dy), u(rows), u(units), p(self.pg(s.params[1])?)],
                    )?;
                }
                Ok(())
            }
            Op::Conv2d { dims, bias, chunk } => {
                let t = self.ft(rd[0])?;
                let d = conv_dims(&dims);
                let g = MwGeom::conv2d(&d);
                let (x, w, dy, dx, dw) = (
                    self.t(rd[0])?,
                    self.pw(s.params[0], t)?,
                    self.t(rd[1])?,
                    self.t_or_null(wr[0])?,
                    self.pg(s.params[0])?,
                );
                let col = self.t_or_null(ws_id)?;
                let bufs = |o: Operand| -> Result<(u64, Float)> {
                    Ok(match o {
                        Operand::X => (x, t),
                        Operand::W => (w, t),
                        Operand::Dy => (dy, t),
                        Operand::Dw => (dw, Float::F32),
                        Operand::Col => (col, t),
                        _ => (dx, t),
                    })
                };
                if d.is_pointwise() {
                    for gm in cm::conv2d_backward_pointwise(&d, wr[0] != NONE) {
                        self.gemm(&gm, &bufs)?;
                    }
                } else {
                    let (p_, img) = (d.out_h() * d.out_w(), d.h * d.w * d.c_in);
                    for (n0, cn) in cm::chunks(d.n, chunk) {
                        self.k(
                            name1("mw_im2col", t),
                            LaunchCfg::pointwise((cn * p_ * g.k()) as u64),
                            vec![
                                p(x),
                                p(col),
                                KArg::Geom(g),
                                KArg::I32(n0 as i32),
                                KArg::I32(cn as i32),
                            ],
                        )?;
                        let (gw, gx) = cm::conv2d_backward_chunk(&d, n0, cn);
                        self.gemm(&gw, &bufs)?;
                        if wr[0] != NONE {
                            self.gemm(&gx, &bufs)?;
                            let dxc = dx + (n0 * img * t.size()) as u64;
                            self.k(
                                name1("mw_col2im", t),
                                LaunchCfg::pointwise((cn * img) as u64),
                                vec![p(col), p(dxc), KArg::Geom(g), KArg::I32(cn as i32), p(0)],
                            )?;
                        }
                    }
                }
                if bias {
                    self.k(
                        name1("mw_column_sums", t),
                        LaunchCfg::strip(d.c_out as u64, 1),
                        vec![
                            p(dy),
                            u(d.y_len() / d.c_out),
                            u(d.c_out),
                            p(self.pg(s.params[1])?),
                        ],
                    )?;
                }
                Ok(())
            }
            Op::Conv2dTranspose { dims, bias, chunk } => {
                let t = self.ft(rd[0])?;
                let d = convt_dims(&dims);
                let g = MwGeom::conv2d_transpose(&d);
                let (x, w, dy, dx, dw) = (
                    self.t(rd[0])?,
                    self.pw(s.params[0], t)?,
                    self.t(rd[1])?,
                    self.t_or_null(wr[0])?,
                    self.pg(s.params[0])?,
                );
                let col = self.t_or_null(ws_id)?;
                let bufs = |o: Operand| -> Result<(u64, Float)> {
                    Ok(match o {
                        Operand::X => (x, t),
                        Operand::W => (w, t),
                        Operand::Dy => (dy, t),
                        Operand::Dw => (dw, Float::F32),
                        Operand::Col => (col, t),
                        _ => (dx, t),
                    })
                };
                if d.is_pointwise() {
                    for gm in cm::conv2d_transpose_backward_pointwise(&d, wr[0] != NONE) {
                        self.gemm(&gm, &bufs)?;
                    }
                } else {
                    let hw = d.h * d.w;
                    for (n0, cn) in cm::chunks(d.n, chunk) {
                        self.k(
                            name1("mw_im2col", t),
                            LaunchCfg::pointwise((cn * hw * g.k()) as u64),
                            vec![
                                p(dy),
                                p(col),
                                KArg::Geom(g),
                                KArg::I32(n0 as i32),
                                KArg::I32(cn as i32),
                            ],
                        )?;
                        for gm in cm::conv2d_transpose_backward_chunk(&d, n0, cn, wr[0] != NONE) {
                            self.gemm(&gm, &bufs)?;
                        }
                    }
                }
                if bias {
                    self.k(
                        name1("mw_column_sums", t),
                        LaunchCfg::strip(d.c_out as u64, 1),
                        vec![
                            p(dy),
                            u(d.y_len() / d.c_out),
                            u(d.c_out),
                            p(self.pg(s.params[1])?),
                        ],
                    )?;
                }
                Ok(())
            }
            Op::DepthwiseConv2d { dims, bias } => {
                let t = self.ft(rd[0])?;
                let d = dw_dims(&dims);
                let md = KArg::Depthwise(MwDepthwise::from(&d));
                let (x, w, dy) = (self.t(rd[0])?, self.pw(s.params[0], t)?, self.t(rd[1])?);
                if wr[0] != NONE {
                    self.k(
                        name1("mw_dw_bwd_dx", t),
                        LaunchCfg::pointwise(d.x_len() as u64),
                        vec![p(w), p(dy), p(self.t(wr[0])?), md],
                    )?;
                }
                self.k(
                    name1("mw_dw_bwd_dw", t),
                    LaunchCfg::strip(d.c_out() as u64, (d.kh * d.kw) as u32),
                    vec![p(x), p(dy), p(self.pg(s.params[0])?), md],
                )?;
                if bias {
                    self.k(
                        name1("mw_column_sums", t),
                        LaunchCfg::strip(d.c_out() as u64, 1),
                        vec![
                            p(dy),
                            u(d.y_len() / d.c_out()),
                            u(d.c_out()),
                            p(self.pg(s.params[1])?),
                        ],
                    )?;
                }
                Ok(())
            }
            Op::MaxPool2d { dims } => {
                let d = pool_dims(&dims)?;
                self.k(
                    name1("mw_maxpool_bwd", self.ft(rd[1])?),
                    LaunchCfg::pointwise(d.in_len() as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(rd[1])?),
                        p(self.t(wr[0])?),
                        KArg::Pool(MwPool::from(&d)),
                    ],
                )
            }
            Op::AvgPool2d { dims } => {
                let d = pool_dims(&dims)?;
                self.k(
                    name1("mw_avgpool_bwd", self.ft(rd[0])?),
                    LaunchCfg::pointwise(d.in_len() as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(wr[0])?),
                        KArg::Pool(MwPool::from(&d)),
                    ],
                )
            }
            Op::GlobalAvgPool { n, hw, c } => self.k(
                name1("mw_gap_bwd", self.ft(rd[0])?),
                LaunchCfg::pointwise((n * hw * c) as u64),
                vec![p(self.t(rd[0])?), p(self.t(wr[0])?), u(n), u(hw), u(c)],
            ),
            Op::BatchNorm { rows, channels, .. } => self.k(
                name1("mw_bn_bwd", self.ft(rd[0])?),
                LaunchCfg::strip(channels as u64, 1),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.pv(s.params[0])),
                    p(self.t(rd[2])?),
                    p(self.t(wr[0])?),
                    p(self.pg(s.params[0])?),
                    p(self.pg(s.params[1])?),
                    u(rows),
                    u(channels),
                ],
            ),
            Op::LayerNorm { rows, features, .. } => {
                let t = self.ft(rd[0])?;
                let (h, rs, dy) = (self.t(rd[0])?, self.t(rd[1])?, self.t(rd[2])?);
                self.k(
                    name1("mw_ln_param_grads", t),
                    LaunchCfg::strip(features as u64, 1),
                    vec![
                        p(h),
                        p(dy),
                        p(self.pg(s.params[0])?),
                        p(self.pg(s.params[1])?),
                        u(rows),
                        u(features),
                    ],
                )?;
                self.k(
                    name1("mw_ln_bwd", t),
                    LaunchCfg::rows(rows as u64),
                    vec![
                        p(h),
                        p(rs),
                        p(self.pv(s.params[0])),
                        p(dy),
                        p(self.t(wr[0])?),
                        u(rows),
                        u(features),
                    ],
                )
            }
            Op::Dropout { elems, rate, .. } => self.k(
                name1("mw_dropout_bwd", self.ft(rd[1])?),
                LaunchCfg::pointwise(elems as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.t(wr[0])?),
                    u(elems),
                    KArg::F32(rate),
                ],
            ),
            Op::Activation {
                act: Act::Softmax,
                elems,
                cols,
            } => {
                let rows = elems / cols.max(1);
                self.k(
                    name3(
                        "mw_softmax_bwd",
                        self.ft(rd[0])?,
                        self.ft(rd[1])?,
                        self.ft(wr[0])?,
                    ),
                    LaunchCfg::rows(rows as u64),
                    vec![
                        p(self.t(rd[0])?),
                        p(self.t(rd[1])?),
                        p(self.t(wr[0])?),
                        u(rows),
                        u(cols),
                    ],
                )
            }
            Op::Activation { act, elems, .. } => self.k(
                name1("mw_act_bwd", self.ft(rd[1])?),
                LaunchCfg::pointwise(elems as u64),
                vec![
                    KArg::I32(act_code(act)),
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.t(wr[0])?),
                    u(elems),
                ],
            ),
            Op::Concat { rows, a, b } => self.k(
                name1("mw_concat_backward", self.ft(rd[0])?),
                LaunchCfg::pointwise((rows * (a + b)) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(wr[0])?),
                    p(self.t(wr[1])?),
                    u(rows),
                    u(a),
                    u(b),
                ],
            ),
            Op::Embedding { tokens, vocab, dim } => self.k(
                name1("mw_embedding_bwd", self.ft(rd[1])?),
                LaunchCfg::pointwise((tokens * dim) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.pg(s.params[0])?),
                    u(tokens),
                    u(vocab),
                    u(dim),
                ],
            ),
            Op::Attention {
                batch,
                seq,
                heads,
                head_dim,
                dropout,
                ..
            } => {
                let t = self.ft(rd[0])?;
                let (d, scale) = attention_dims(batch, seq, heads, head_dim);
                let (qkv, probs) = (self.t(rd[0])?, self.t(rd[1])?);
                let (used, dctx) = if dropout > 0.0 {
                    (self.t(rd[3])?, self.t(rd[4])?)
                } else {
                    (probs, self.t(rd[2])?)
                };
                let (dqkv, dp) = (self.t(wr[0])?, self.t(ws_id)?);
                let bufs = |o: Operand| -> Result<(u64, Float)> {
                    Ok((
                        match o {
                            Operand::Qkv => qkv,
                            Operand::Probs => used,
                            Operand::Dctx => dctx,
                            Operand::Dprobs => dp,
                            _ => dqkv,
                        },
                        t,
                    ))
                };
                let (gdp, gdv) = cm::attention_context_backward(&d);
                for g in gdp.iter().chain(gdv.iter()) {
                    self.gemm(g, &bufs)?;
                }
                let n = d.scores_len();
                if dropout > 0.0 {
                    self.k(
                        name1("mw_dropout_bwd", t),
                        LaunchCfg::pointwise(n as u64),
                        vec![p(self.t(rd[2])?), p(dp), p(dp), u(n), KArg::F32(dropout)],
                    )?;
                }
                let rows = batch * heads * seq;
                self.k(
                    name3("mw_softmax_bwd", t, t, t),
                    LaunchCfg::rows(rows as u64),
                    vec![p(probs), p(dp), p(dp), u(rows), u(seq)],
                )?;
                for g in cm::attention_scores_backward(&d, scale) {
                    self.gemm(&g, &bufs)?;
                }
                Ok(())
            }
            Op::SampleNormal { elems, key } => self.k(
                name1("mw_sample_normal_bwd", self.ft(rd[0])?),
                LaunchCfg::pointwise(elems.div_ceil(4) as u64),
                vec![
                    p(self.t(rd[0])?),
                    p(self.t(rd[1])?),
                    p(self.t(wr[0])?),
                    p(self.t(wr[1])?),
                    u(elems),
                    self.key_seed(),
                    KArg::U32(key),
                    self.sc(),
                    KArg::I32(0),
                ],
            ),
            Op::Accumulate { elems } => {
                let t = self.ft(wr[0])?;
                let cfg = LaunchCfg::pointwise(elems as u64);
                let g = self.t(wr[0])?;
                let other = if self.same(rd[0], wr[0]) {
                    rd[1]
                } else if self.same(rd[1], wr[0]) {
                    rd[0]
                } else {
                    self.k(
                        name2("mw_cast", t, t),
                        cfg,
                        vec![p(self.t(rd[0])?), p(g), u(elems)],
                    )?;
                    rd[1]
                };
                self.k(
                    name1("mw_accumulate", t),
                    cfg,
                    vec![p(g), p(self.t(other)?), u(elems)],
                )
            }
            other => Err(RuntimeError::Memory(format!(
                "{} has no backward step",
                other.name()
            ))),
        }
    }

    /// A loss step: the gradient (training) and the weighted value into the loss tensor.
    fn loss(&self, s: &PlanStep) -> Result<()> {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let ws_id = wr[nw - 2];
        let train = self.plan.training;
        let need = |id: u32| -> Result<u64> {
            if id == NONE {
                Err(RuntimeError::Memory(format!(
                    "loss `{}`: its input depends on no parameter",
                    s.op.name()
                )))
            } else {
                self.t(id)
            }
        };
        let loss = self.t(wr[0])?;
        let single = LaunchCfg::single();
        match s.op {
            Op::SoftmaxCrossEntropy {
                rows,
                classes,
                weight,
            }
            | Op::SoftmaxCrossEntropyFromLogits {
                rows,
                classes,
                weight,
            } => {
                let (probs, pt) = if matches!(s.op, Op::SoftmaxCrossEntropyFromLogits { .. }) {
                    let ws = self.t(ws_id)?;
                    self.k(
                        name2("mw_softmax", self.ft(rd[0])?, Float::F32),
                        LaunchCfg::rows(rows as u64),
                        vec![p(self.t(rd[0])?), p(ws), u(rows), u(classes)],
                    )?;
                    (ws, Float::F32)
                } else {
                    (self.t(rd[0])?, self.ft(rd[0])?)
                };
                let labels = self.t(rd[1])?;
                if train {
                    let g = need(wr[1])?;
                    self.k(
                        name2("mw_scce", pt, self.ft(wr[1])?),
                        LaunchCfg::rows(rows as u64),
                        vec![
                            p(probs),
                            p(labels),
                            p(g),
                            u(rows),
                            u(classes),
                            KArg::F32(weight),
                            self.sc(),
                        ],
                    )?;
                }
                self.k(
                    name1("mw_scce_value", pt),
                    single,
                    vec![
                        p(probs),
                        p(labels),
                        u(rows),
                        u(classes),
                        KArg::F32(weight),
                        p(loss),
                        self.sc(),
                    ],
                )?;
            }
            Op::SigmoidBinaryCrossentropy {
                rows,
                features,
                reduction: red,
                weight,
            }
            | Op::BinaryCrossentropyFromLogits {
                rows,
                features,
                reduction: red,
                weight,
            }
            | Op::BinaryCrossentropy {
                rows,
                features,
                reduction: red,
                weight,
            }
            | Op::MeanSquaredError {
                rows,
                features,
                reduction: red,
                weight,
            } => {
                let kind = match s.op {
                    Op::SigmoidBinaryCrossentropy { .. } => kl::LOSS_BCE_SIGMOID,
                    Op::BinaryCrossentropyFromLogits { .. } => kl::LOSS_BCE_LOGITS,
                    Op::BinaryCrossentropy { .. } => kl::LOSS_BCE,
                    _ => kl::LOSS_MSE,
                };
                let n = rows * features;
                let denom = match red {
                    Reduction::Mean => n as f64,
                    Reduction::SumOverFeatures => rows as f64,
                };
                let (pt, yt) = (self.ft(rd[0])?, self.ft(rd[1])?);
                let (pr, tg) = (self.t(rd[0])?, self.t(rd[1])?);
                if train {
                    let g = need(wr[1])?;
                    if self.ft(wr[1])? != pt {
                        return Err(RuntimeError::Memory("a loss gradient in another dtype than its prediction has no CUDA kernel".into()));
                    }
                    self.k(
                        name2("mw_elem_loss", pt, yt),
                        LaunchCfg::pointwise(n as u64),
                        vec![
                            KArg::I32(kind),
                            p(pr),
                            p(tg),
                            p(g),
                            u(n),
                            KArg::F64(denom),
                            KArg::F32(weight),
                            self.sc(),
                        ],
                    )?;
                }
                self.k(
                    name2("mw_elem_loss_value", pt, yt),
                    single,
                    vec![
                        KArg::I32(kind),
                        p(pr),
                        p(tg),
                        u(n),
                        KArg::F64(denom),
                        KArg::F32(weight),
                        p(loss),
                    ],
                )?;
            }
            Op::KlNormal {
                rows,
                features,
                reduction: red,
                weight,
            } => {
                let w = if red == Reduction::Mean {
                    weight / features as f32
                } else {
                    weight
                };
                let t = self.ft(rd[0])?;
                let n = rows * features;
                let (m, lv) = (self.t(rd[0])?, self.t(rd[1])?);
                if train {
                    let (gm, gl) = (need(wr[1])?, need(wr[2])?);
                    if self.ft(wr[1])? != t {
                        return Err(RuntimeError::Memory(
                            "a KL gradient in another dtype than its inputs has no CUDA kernel"
                                .into(),
                        ));
                    }
                    self.k(
                        name1("mw_kl", t),
                        LaunchCfg::pointwise(n as u64),
                        vec![
                            p(m),
                            p(lv),
                            p(gm),
                            p(gl),
                            u(n),
                            u(rows),
                            KArg::F32(w),
                            self.sc(),
                        ],
                    )?;
                }
                self.k(
                    name1("mw_kl_value", t),
                    single,
                    vec![p(m), p(lv), u(n), u(rows), KArg::F32(w), p(loss)],
                )?;
            }
            other => {
                return Err(RuntimeError::Memory(format!(
                    "{} is not a loss",
                    other.name()
                )))
            }
        }
        // Without loss scaling, a non-finite loss must stop the update (as on the CPU): the
        // flag makes the optimizer kernels skip, and the host reports it after the step.
        if train && !self.plan.loss_scaling {
            self.k(
                "mw_all_finite_f32".into(),
                LaunchCfg::pointwise(1),
                vec![p(loss), u(1), self.sc()],
            )?;
        }
        Ok(())
    }
}

/// Weights and checkpoints (`crate::weights`): the persistent region travels to the host and
/// back, so a GPU checkpoint holds what a CPU one holds (optimizer state, counters, loss
/// scaler) and either loads into the other.
impl<B: Backend> PersistentState for GpuExecutor<B> {
    fn state_plan(&self) -> &StaticPlan {
        &self.plan
    }

    fn persistent_image(&self) -> Result<Cow<'_, [u8]>> {
        let mut host = vec![0u8; self.plan.persistent_bytes as usize];
        // SAFETY: the persistent allocation holds persistent_bytes (and the scalars after).
        unsafe {
            self.backend
                .download(self.persistent, &mut host)
                .map_err(dev)?
        };
        Ok(Cow::Owned(host))
    }

    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        let mut host = Region::new(
            self.plan.persistent_bytes as usize,
            "persistent region (host copy)",
        )?;
        // SAFETY: as above.
        unsafe {
            self.backend
                .download(self.persistent, host.bytes_mut())
                .map_err(dev)?
        };
        write(host.bytes_mut())?;
        refresh_half_copies(&self.plan, &mut host)?;
        // SAFETY: as above.
        unsafe {
            self.backend
                .upload(host.bytes(), self.persistent)
                .map_err(dev)?
        };
        self.backend.synchronize().map_err(dev)
    }

    fn counters(&self) -> TrainingCounters {
        TrainingCounters {
            seed: self.seed,
            step: self.step_counter,
            updates: self.updates,
            scaler: self.scaler,
        }
    }

    fn set_counters(&mut self, c: TrainingCounters) {
        self.seed = c.seed;
        self.step_counter = c.step;
        self.updates = c.updates;
        self.scaler = c.scaler;
        // The seed is a launch argument: a captured graph holds the old one.
        if self.graph == Graph::Captured {
            self.backend.clear_graph();
        }
        if self.graph != Graph::Unsupported {
            self.graph = Graph::Eager;
        }
    }
}

/// Fills the 16-bit copies of the parameters that have one, from their f32 values.
fn refresh_half_copies(plan: &StaticPlan, region: &mut Region) -> Result<()> {
    for p in plan.params.iter() {
        let Some(h) = p.half_copy else { continue };
        // SAFETY: the f32 values and the 16-bit copy are disjoint ranges of the region.
        unsafe {
            let src = region.view::<f32>(p.offset, p.elems())?;
            match h {
                DType::F16 => {
                    k::elementwise::cast(src, region.view_mut::<f16>(p.half_offset, p.elems())?)
                }
                DType::BF16 => {
                    k::elementwise::cast(src, region.view_mut::<bf16>(p.half_offset, p.elems())?)
                }
                _ => Ok(()),
            }
            .map_err(|e| RuntimeError::Memory(e.0))?;
        }
    }
    Ok(())
}

fn struct_bytes<T>(v: &T) -> &[u8] {
    // SAFETY: plain-old-data struct viewed as its bytes.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

fn batch_bytes<'a>(b: &Batch<'a>) -> &'a [u8] {
    fn bytes<T>(x: &[T]) -> &[u8] {
        // SAFETY: plain-old-data element types, reinterpreted as their bytes.
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
    }
    match *b {
        Batch::U8(x) => x,
        Batch::I32(x) => bytes(x),
        Batch::F32(x) => bytes(x),
        Batch::F16(x) => bytes(x),
        Batch::BF16(x) => bytes(x),
    }
}
