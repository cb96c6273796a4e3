//! `Executor`: walks a `StaticPlan` step by step over one arena and one persistent region,
//! calling one kernel (or a fixed short sequence) per step with typed views at the planned
//! offsets. Nothing is allocated per step.

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_plan::liveness::align_up;
use memwise_plan::{
    Activation as Act, DType, Op, Optimizer, Padding, Phase, PlanParam, PlanStep, PlanTensor,
    Reduction, StaticPlan, Window2d, NONE, NO_OFFSET,
};

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::init;
use crate::memory::Region;

/// One input batch, in the input's stored dtype.
#[derive(Clone, Copy, Debug)]
pub enum Batch<'a> {
    U8(&'a [u8]),
    I32(&'a [i32]),
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Batch<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Batch::U8(_) => DType::U8,
            Batch::I32(_) => DType::I32,
            Batch::F32(_) => DType::F32,
            Batch::F16(_) => DType::F16,
            Batch::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Batch::U8(x) => x.len(),
            Batch::I32(x) => x.len(),
            Batch::F32(x) => x.len(),
            Batch::F16(x) => x.len(),
            Batch::BF16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn bytes(&self) -> &[u8] {
        fn b<T>(x: &[T]) -> &[u8] {
            // SAFETY: plain-old-data element types, reinterpreted as their bytes.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
        }
        match self {
            Batch::U8(x) => x,
            Batch::I32(x) => b(x),
            Batch::F32(x) => b(x),
            Batch::F16(x) => b(x),
            Batch::BF16(x) => b(x),
        }
    }
}

/// What one training step produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// Sum of the weighted loss terms (unscaled).
    pub loss: f32,
    /// Predictions (rows of the classification losses: samples, or tokens of a sequence) whose
    /// arg-max matched the label, else 0.
    pub correct: usize,
    /// Mixed precision found a non-finite gradient: the update was skipped.
    pub skipped: bool,
}

/// A storage type and its plan dtype.
pub trait Stored: Copy + 'static {
    const DTYPE: DType;
}
impl Stored for f32 {
    const DTYPE: DType = DType::F32;
}
impl Stored for f16 {
    const DTYPE: DType = DType::F16;
}
impl Stored for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Stored for u8 {
    const DTYPE: DType = DType::U8;
}
impl Stored for i32 {
    const DTYPE: DType = DType::I32;
}

/// Runs `$body` with `$T` bound to the element type of float dtype `$dt`.
macro_rules! with_float {
    ($dt:expr, $T:ident, $body:block) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            other => {
                return Err(RuntimeError::Memory(format!(
                    "expected a float tensor, found {}",
                    other.name()
                ))
                .into())
            }
        }
    };
}

/// The optimizer's kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Opt {
    Sgd(k::optimizer::Sgd),
    RmsProp(k::optimizer::RmsProp),
    Adam(k::optimizer::Adam),
    AdamW(k::optimizer::AdamW),
}

impl Opt {
    fn from_plan(o: &Optimizer) -> Opt {
        use k::optimizer as ko;
        match *o {
            Optimizer::Sgd { lr } => Opt::Sgd(ko::Sgd {
                learning_rate: lr,
                momentum: 0.0,
                nesterov: false,
            }),
            Optimizer::Momentum {
                lr,
                momentum,
                nesterov,
            } => Opt::Sgd(ko::Sgd {
                learning_rate: lr,
                momentum,
                nesterov,
            }),
            Optimizer::RmsProp {
                lr,
                rho,
                epsilon,
                momentum,
                centered,
            } => Opt::RmsProp(ko::RmsProp {
                learning_rate: lr,
                rho,
                momentum,
                epsilon,
                centered,
            }),
            Optimizer::Adam {
                lr,
                beta_1,
                beta_2,
                epsilon,
            } => Opt::Adam(ko::Adam {
                learning_rate: lr,
                beta_1,
                beta_2,
                epsilon,
            }),
            Optimizer::AdamW {
                lr,
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => Opt::AdamW(ko::AdamW {
                adam: ko::Adam {
                    learning_rate: lr,
                    beta_1,
                    beta_2,
                    epsilon,
                },
                weight_decay,
            }),
        }
    }

    fn update(
        &self,
        step: u64,
        p: &mut [f32],
        g: &[f32],
        s: &mut [&mut [f32]],
        unscale: f32,
    ) -> k::KResult {
        use k::optimizer::Optimizer as _;
        match self {
            Opt::Sgd(o) => o.update(step, p, g, s, unscale),
            Opt::RmsProp(o) => o.update(step, p, g, s, unscale),
            Opt::Adam(o) => o.update(step, p, g, s, unscale),
            Opt::AdamW(o) => o.update(step, p, g, s, unscale),
        }
    }
}

/// Runs training steps of one plan on the CPU.
pub struct Executor {
    pub(crate) plan: StaticPlan,
    pub(crate) arena: Region,
    pub(crate) persistent: Region,
    pub(crate) seed: u64,
    /// Training steps run so far (keys dropout and sampling, counts optimizer updates).
    pub(crate) step_counter: u64,
    /// Optimizer updates applied (Adam's bias correction counts these).
    pub(crate) updates: u64,
    pub(crate) scaler: k::optimizer::LossScaler,
    pub(crate) opt: Opt,
    /// Byte range of the gradients in the persistent region (zeroed at each step).
    pub(crate) grads_range: (usize, usize),
    /// Test hook: tensors to overwrite with NaN right after each step (their last use).
    pub(crate) poison_after: Option<Vec<Vec<u32>>>,
    /// Kernel steps executed (for tests).
    pub steps_executed: u64,
    /// Seconds spent in each step of the plan, summed over training steps, when profiling
    /// is on ([`Executor::enable_profiling`]).
    pub(crate) profile: Option<Vec<f64>>,
}

fn kerr(step: &PlanStep, e: k::KernelError) -> RuntimeError {
    RuntimeError::Kernel {
        step: step.index,
        op: step.op.name(),
        layer: step.layer.to_string(),
        error: e,
    }
}

// The plan's window geometry in the kernels' terms; the GPU executor uses the same.
pub(crate) fn conv_padding(p: Padding) -> k::conv::Padding {
    match p {
        Padding::Same => k::conv::Padding::Same,
        Padding::Valid => k::conv::Padding::Valid,
    }
}

pub(crate) fn conv_dims(d: &Window2d) -> k::conv::Conv2dDims {
    k::conv::Conv2dDims {
        n: d.n,
        h: d.h,
        w: d.w,
        c_in: d.c_in,
        c_out: d.c_out,
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: conv_padding(d.padding),
    }
}

pub(crate) fn convt_dims(d: &Window2d) -> k::conv::ConvTranspose2dDims {
    k::conv::ConvTranspose2dDims {
        n: d.n,
        h: d.h,
        w: d.w,
        c_in: d.c_in,
        c_out: d.c_out,
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: conv_padding(d.padding),
    }
}

pub(crate) fn dw_dims(d: &Window2d) -> k::conv::DepthwiseConv2dDims {
    k::conv::DepthwiseConv2dDims {
        n: d.n,
        h: d.h,
        w: d.w,
        c: d.c_in,
        multiplier: d.c_out / d.c_in.max(1),
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: conv_padding(d.padding),
    }
}

pub(crate) fn pool_dims(d: &Window2d) -> std::result::Result<k::pool::Pool2d, k::KernelError> {
    let p = match d.padding {
        Padding::Same => k::pool::Padding::Same,
        Padding::Valid => k::pool::Padding::Valid,
    };
    let (out_h, pad_top) = k::pool::tf_out_and_pad(d.h, d.kh, d.sh, p)?;
    let (out_w, pad_left) = k::pool::tf_out_and_pad(d.w, d.kw, d.sw, p)?;
    Ok(k::pool::Pool2d {
        n: d.n,
        h: d.h,
        w: d.w,
        c: d.c_in,
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: p,
        out_h,
        out_w,
        pad_top,
        pad_left,
    })
}

fn reduction(r: Reduction) -> k::loss::Reduction {
    match r {
        Reduction::Mean => k::loss::Reduction::Mean,
        Reduction::SumOverFeatures => k::loss::Reduction::SumOverFeaturesMeanOverBatch,
    }
}

fn kact(a: Act) -> k::activation::Activation {
    match a {
        Act::Linear | Act::Softmax => k::activation::Activation::Linear,
        Act::Relu => k::activation::Activation::Relu,
        Act::Sigmoid => k::activation::Activation::Sigmoid,
        Act::Tanh => k::activation::Activation::Tanh,
        Act::Gelu => k::activation::Activation::Gelu,
        Act::Silu => k::activation::Activation::Silu,
    }
}

impl Executor {
    /// Allocates the two regions of `plan` on `device` (failing with the numbers, before any
    /// allocation, when the plan exceeds the device's memory) and initialises the weights as
    /// Keras does (Glorot-uniform kernels, zero biases, unit norm scales), seeded.
    pub fn new(plan: StaticPlan, device: &Device, seed: u64) -> Result<Executor> {
        if device.is_cuda() {
            // The CPU executor must not pretend to run on a GPU: `engine::build_engine` (what
            // `Trainer` calls) builds the CUDA executor for a CUDA device.
            return Err(RuntimeError::Device(format!(
                "{}: the CPU executor runs on the CPU only; build the CUDA executor \
                 (`memwise_runtime::engine::build_engine`, or `Trainer`) for a CUDA device",
                device.name()
            )));
        }
        // The GEMM library's per-call blocks must not stay resident after they are freed.
        crate::memory::return_large_frees();
        let total = plan.persistent_bytes + plan.arena_bytes;
        if let Some(avail) = device.available_bytes() {
            if total > avail {
                return Err(RuntimeError::OutOfMemory {
                    needed: total,
                    available: avail,
                    device: device.name(),
                });
            }
        }
        let persistent = Region::new(plan.persistent_bytes as usize, "persistent region")?;
        let arena = Region::new(plan.arena_bytes as usize, "arena")?;
        let (g0, g1) = plan.grads_range();
        let grads_range = (g0 as usize, g1 as usize);
        let scaler = if plan.loss_scaling {
            k::optimizer::LossScaler::new()
        } else {
            k::optimizer::LossScaler::disabled()
        };
        let opt = Opt::from_plan(&plan.optimizer);
        let mut ex = Executor {
            plan,
            arena,
            persistent,
            seed,
            step_counter: 0,
            updates: 0,
            scaler,
            opt,
            grads_range,
            poison_after: None,
            steps_executed: 0,
            profile: None,
        };
        init::initialise(&ex.plan, &mut ex.persistent, seed)?;
        ex.refresh_half_copies(None)?;
        Ok(ex)
    }

    pub fn plan(&self) -> &StaticPlan {
        &self.plan
    }

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

    /// Starts timing every step of the plan (see [`Executor::profile`]).
    pub fn enable_profiling(&mut self) {
        self.profile = Some(vec![0.0; self.plan.steps.len()]);
    }

    /// Seconds spent per `(phase, op)` so far, largest first (profiling must be on).
    pub fn profile(&self) -> Vec<(String, f64)> {
        let Some(p) = &self.profile else {
            return Vec::new();
        };
        let mut by: Vec<(String, f64)> = Vec::new();
        for (s, t) in self.plan.steps.iter().zip(p) {
            let key = format!("{} {}", s.phase.name(), s.op.name());
            match by.iter_mut().find(|(k, _)| *k == key) {
                Some(e) => e.1 += t,
                None => by.push((key, *t)),
            }
        }
        by.sort_by(|a, b| b.1.total_cmp(&a.1));
        by
    }

    /// Test hook: after each step, overwrite with NaN every tensor whose life ends there
    /// (unless another tensor took its bytes over in place). A plan that frees anything too
    /// early then poisons the result.
    pub fn enable_poisoning(&mut self) {
        let mut by_step = vec![Vec::new(); self.plan.steps.len()];
        let donated: std::collections::HashSet<u32> = self
            .plan
            .tensors
            .iter()
            .filter(|t| t.in_place_of != NONE)
            .map(|t| t.in_place_of)
            .collect();
        for t in self.plan.tensors.iter() {
            if !donated.contains(&t.id)
                && (t.last as usize) < by_step.len()
                && !self.plan.losses.contains(&t.id)
            {
                by_step[t.last as usize].push(t.id);
            }
        }
        self.poison_after = Some(by_step);
    }

    /// The f32 values of parameter `name` (`hidden.weight` …).
    pub fn param(&self, name: &str) -> Result<&[f32]> {
        let (_, p) = param_named(&self.plan, name)?;
        // SAFETY: shared borrow of self; no mutable views are live.
        unsafe { self.persistent.view::<f32>(p.offset, p.elems()) }
    }

    /// The f32 gradient of parameter `name` from the last step.
    pub fn grad(&self, name: &str) -> Result<&[f32]> {
        let p = trainable_param_named(&self.plan, name)?;
        // SAFETY: as above.
        unsafe { self.persistent.view::<f32>(p.grad_offset, p.elems()) }
    }

    /// Overwrites parameter `name` with `values` (and its 16-bit copy).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let (id, p) = param_named(&self.plan, name)?;
        check_param_values(p, values)?;
        // SAFETY: &mut self: no other view is live.
        let dst = unsafe { self.persistent.view_mut::<f32>(p.offset, p.elems())? };
        dst.copy_from_slice(values);
        self.refresh_half_copies(Some(id))
    }

    /// Copies every parameter's values (and statistics) from `other`, a model with the same
    /// parameters (the training executor, into an inference one). Names and shapes must match.
    pub fn copy_params_from(&mut self, other: &Executor) -> Result<()> {
        if self.plan.params.len() != other.plan.params.len() {
            return Err(RuntimeError::Input(format!(
                "cannot copy weights: {} parameters here, {} there",
                self.plan.params.len(),
                other.plan.params.len()
            )));
        }
        for (a, b) in self.plan.params.iter().zip(other.plan.params.iter()) {
            if a.name != b.name || a.shape != b.shape {
                return Err(RuntimeError::Input(format!(
                    "cannot copy weights: `{}` {:?} here, `{}` {:?} there",
                    a.name,
                    &a.shape[..],
                    b.name,
                    &b.shape[..]
                )));
            }
            // SAFETY: two different executors' regions; no other views are live.
            unsafe {
                let src = other.persistent.view::<f32>(b.offset, b.elems())?;
                self.persistent
                    .view_mut::<f32>(a.offset, a.elems())?
                    .copy_from_slice(src);
            }
        }
        self.refresh_half_copies(None)
    }

    /// Runs the plan's forward and loss steps without updating (an inference plan). Returns
    /// the loss and the correct predictions.
    pub fn evaluate_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        if self.plan.training {
            return Err(RuntimeError::Input(
                "evaluate_step needs an inference plan (plan_inference)".into(),
            ));
        }
        self.train_step(inputs)
    }

    /// The prediction tensor's values after the last step (f32 copies into `out`).
    pub fn read_prediction(&self, out: &mut [f32]) -> Result<()> {
        let t = readable_prediction(&self.plan, out.len())?;
        // SAFETY: shared view after the step.
        unsafe {
            with_float!(t.dtype, T, {
                k::elementwise::cast::<T, f32>(self.arena.view::<T>(t.offset, t.elems())?, out)
                    .map_err(|e| RuntimeError::Memory(e.0))?;
            })
        }
        Ok(())
    }

    /// The whole persistent region (parameters, 16-bit copies, gradients, optimizer state).
    pub fn persistent_bytes(&self) -> &[u8] {
        self.persistent.bytes()
    }

    /// Value of loss term `k` from the last step.
    pub fn loss_term(&self, k: usize) -> Result<f32> {
        let id = *self
            .plan
            .losses
            .get(k)
            .ok_or_else(|| RuntimeError::Input(format!("no loss term {k}")))?;
        let t = self.plan.tensor(id);
        // SAFETY: shared borrow; no mutable views.
        Ok(unsafe { self.arena.view::<f32>(t.offset, 1)? }[0])
    }

    pub(crate) fn refresh_half_copies(&mut self, only: Option<usize>) -> Result<()> {
        for (i, p) in self.plan.params.iter().enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let Some(h) = p.half_copy else { continue };
            // SAFETY: the f32 values and the 16-bit copy are disjoint ranges of the region.
            unsafe {
                let src = self.persistent.view::<f32>(p.offset, p.elems())?;
                match h {
                    DType::F16 => k::elementwise::cast(
                        src,
                        self.persistent.view_mut::<f16>(p.half_offset, p.elems())?,
                    ),
                    DType::BF16 => k::elementwise::cast(
                        src,
                        self.persistent.view_mut::<bf16>(p.half_offset, p.elems())?,
                    ),
                    _ => Ok(()),
                }
                .map_err(|e| RuntimeError::Memory(e.0))?;
            }
        }
        Ok(())
    }

    /// Checks `inputs` against the model's inputs ([`check_inputs`]) and copies them into
    /// the arena.
    fn load_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        check_inputs(&self.plan, inputs)?;
        let ids = &self.plan.inputs;
        for (b, &id) in inputs.iter().zip(ids.iter()) {
            let t = self.plan.tensor(id);
            if t.first > t.last {
                continue;
            }
            let bytes = b.bytes();
            // SAFETY: &mut self; input tensors are disjoint from each other at step 0.
            let dst = unsafe { self.arena.view_mut::<u8>(t.offset, bytes.len())? };
            dst.copy_from_slice(bytes);
        }
        Ok(())
    }

    /// Runs one training step on `inputs` (one batch per model input, in declaration order).
    pub fn train_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        self.load_inputs(inputs)?;
        let (g0, g1) = self.grads_range;
        self.persistent.bytes_mut()[g0..g1].fill(0);
        let mut out = StepOutput {
            loss: 0.0,
            correct: 0,
            skipped: false,
        };
        let mut unscale = 1.0f32;
        let n = self.plan.steps.len();
        for i in 0..n {
            let t0 = self.profile.is_some().then(std::time::Instant::now);
            let phase = self.plan.steps[i].phase;
            match self.plan.steps[i].op {
                Op::CheckFinite => {
                    let finite = self.grads_finite()?;
                    match self.scaler.update(!finite) {
                        k::optimizer::StepDecision::Apply { grad_unscale } => {
                            unscale = grad_unscale
                        }
                        k::optimizer::StepDecision::Skip => out.skipped = true,
                    }
                }
                Op::Update => {
                    if !out.skipped {
                        self.update(i, unscale)?;
                    }
                }
                _ if phase == Phase::Loss => {
                    let (loss, correct) = self.loss_step(i)?;
                    out.loss += loss;
                    out.correct += correct;
                    // Without loss scaling a non-finite loss would poison the weights: stop
                    // before any gradient is applied, and say where it started.
                    if !loss.is_finite() && !self.plan.loss_scaling && self.plan.training {
                        let culprit = self.first_non_finite(inputs)?;
                        return Err(RuntimeError::NonFinite(format!(
                            "training step {}: the loss is {loss}; {culprit}. \
                             The weights were not updated.",
                            self.step_counter + 1
                        )));
                    }
                }
                _ => self.run(i)?,
            }
            self.steps_executed += 1;
            if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
                p[i] += t0.elapsed().as_secs_f64();
            }
            self.poison(i)?;
        }
        if !out.skipped {
            self.updates += 1;
        }
        self.step_counter += 1;
        Ok(out)
    }

    /// Re-runs the forward steps on `inputs`, checking every float output, and names the
    /// first layer whose output is not finite (weights are untouched: this runs before any
    /// update).
    fn first_non_finite(&mut self, inputs: &[Batch<'_>]) -> Result<String> {
        self.load_inputs(inputs)?;
        for (k, &id) in self.plan.inputs.iter().enumerate() {
            if !self.tensor_finite(id)? {
                return Ok(format!(
                    "input {k} (`{}`) holds non-finite values",
                    self.plan.tensor(id).name
                ));
            }
        }
        for i in 0..self.plan.steps.len() {
            if self.plan.steps[i].phase != Phase::Forward {
                break;
            }
            self.run(i)?;
            let s = &self.plan.steps[i];
            let n = s.writes.len().saturating_sub(2);
            for &w in &s.writes[..n] {
                if w != NONE && !self.tensor_finite(w)? {
                    let t = self.plan.tensor(w);
                    return Ok(format!(
                        "the first non-finite value appears in the output `{}` of layer `{}` ({} at step {})",
                        t.name, s.layer, s.op.name(), s.index
                    ));
                }
            }
        }
        Ok("every forward output is finite: the loss itself overflowed".to_string())
    }

    fn tensor_finite(&self, id: u32) -> Result<bool> {
        let t = self.plan.tensor(id);
        // SAFETY: shared view between steps.
        unsafe {
            Ok(match t.dtype {
                DType::F32 => {
                    k::elementwise::all_finite(self.arena.view::<f32>(t.offset, t.elems())?)
                }
                DType::F16 => {
                    k::elementwise::all_finite(self.arena.view::<f16>(t.offset, t.elems())?)
                }
                DType::BF16 => {
                    k::elementwise::all_finite(self.arena.view::<bf16>(t.offset, t.elems())?)
                }
                DType::U8 | DType::I32 => true,
            })
        }
    }

    fn poison(&mut self, i: usize) -> Result<()> {
        let Some(by_step) = &self.poison_after else {
            return Ok(());
        };
        for &id in &by_step[i] {
            let t = &self.plan.tensors[id as usize];
            let len = t.elems();
            // SAFETY: the tensor's life ended; nothing else views its bytes now.
            unsafe {
                match t.dtype {
                    DType::F32 => self.arena.view_mut::<f32>(t.offset, len)?.fill(f32::NAN),
                    DType::F16 => self.arena.view_mut::<f16>(t.offset, len)?.fill(f16::NAN),
                    DType::BF16 => self.arena.view_mut::<bf16>(t.offset, len)?.fill(bf16::NAN),
                    DType::U8 => self.arena.view_mut::<u8>(t.offset, len)?.fill(0xA5),
                    DType::I32 => self.arena.view_mut::<i32>(t.offset, len)?.fill(i32::MIN),
                }
            }
        }
        Ok(())
    }

    fn grads_finite(&self) -> Result<bool> {
        for p in self
            .plan
            .params
            .iter()
            .filter(|p| p.grad_offset != NO_OFFSET)
        {
            // SAFETY: shared views only.
            let g = unsafe { self.persistent.view::<f32>(p.grad_offset, p.elems())? };
            if !k::elementwise::all_finite(g) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn update(&mut self, i: usize, unscale: f32) -> Result<()> {
        let step = &self.plan.steps[i];
        let slots = self.plan.optimizer.state_slots() as usize;
        for &pid in step.params.iter() {
            let p = &self.plan.params[pid as usize];
            let n = p.elems();
            let stride = (align_up(n as u64 * 4, self.plan.alignment) / 4) as usize;
            // SAFETY: values, gradient and state are disjoint ranges of the region.
            unsafe {
                let vals = self.persistent.view_mut::<f32>(p.offset, n)?;
                let grads = self.persistent.view::<f32>(p.grad_offset, n)?;
                let r = if slots == 0 {
                    self.opt
                        .update(self.updates + 1, vals, grads, &mut [], unscale)
                } else {
                    let all = self
                        .persistent
                        .view_mut::<f32>(p.state_offset, stride * slots)?;
                    let (s0, rest) = all.split_at_mut(stride);
                    match slots {
                        1 => self.opt.update(
                            self.updates + 1,
                            vals,
                            grads,
                            &mut [&mut s0[..n]],
                            unscale,
                        ),
                        2 => {
                            let (s1, _) = rest.split_at_mut(stride);
                            self.opt.update(
                                self.updates + 1,
                                vals,
                                grads,
                                &mut [&mut s0[..n], &mut s1[..n]],
                                unscale,
                            )
                        }
                        _ => {
                            let (s1, s2) = rest.split_at_mut(stride);
                            self.opt.update(
                                self.updates + 1,
                                vals,
                                grads,
                                &mut [&mut s0[..n], &mut s1[..n], &mut s2[..n]],
                                unscale,
                            )
                        }
                    }
                };
                r.map_err(|e| kerr(step, e))?;
            }
        }
        for j in 0..self.plan.steps[i].params.len() {
            let pid = self.plan.steps[i].params[j] as usize;
            if self.plan.params[pid].half_copy.is_some() {
                self.refresh_half_copies(Some(pid))?;
            }
        }
        Ok(())
    }

    // ---- views ----

    /// A read view of tensor `id`.
    ///
    /// # Safety
    /// No mutable view of an overlapping tensor may be live (the plan's rule 3).
    unsafe fn r<T: Stored>(&self, id: u32) -> Result<&[T]> {
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| RuntimeError::Memory(format!("no tensor {id}")))?;
        if t.dtype != T::DTYPE {
            return Err(RuntimeError::Memory(format!(
                "tensor `{}` is {}, read as {}",
                t.name,
                t.dtype.name(),
                T::DTYPE.name()
            )));
        }
        self.arena.view::<T>(t.offset, t.elems())
    }

    /// A write view of tensor `id`.
    ///
    /// # Safety
    /// No other view of an overlapping tensor may be live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn w<T: Stored>(&self, id: u32) -> Result<&mut [T]> {
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| RuntimeError::Memory(format!("no tensor {id}")))?;
        if t.dtype != T::DTYPE {
            return Err(RuntimeError::Memory(format!(
                "tensor `{}` is {}, written as {}",
                t.name,
                t.dtype.name(),
                T::DTYPE.name()
            )));
        }
        self.arena.view_mut::<T>(t.offset, t.elems())
    }

    /// An optional write view (`NONE` → `None`).
    #[allow(clippy::mut_from_ref)]
    unsafe fn wo<T: Stored>(&self, id: u32) -> Result<Option<&mut [T]>> {
        if id == NONE {
            Ok(None)
        } else {
            self.w::<T>(id).map(Some)
        }
    }

    /// A workspace view, empty when the slot is `NONE`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn ws<T: Stored>(&self, id: u32) -> Result<&mut [T]> {
        Ok(self.wo::<T>(id)?.unwrap_or(&mut []))
    }

    fn dtype(&self, id: u32) -> DType {
        self.plan.tensors[id as usize].dtype
    }

    fn same(&self, a: u32, b: u32) -> bool {
        a != NONE
            && b != NONE
            && self.plan.tensors[a as usize].offset == self.plan.tensors[b as usize].offset
    }

    /// The weights a GEMM reads: the f32 values, or their 16-bit copy.
    unsafe fn weight<T: Stored>(&self, pid: u32) -> Result<&[T]> {
        let p = &self.plan.params[pid as usize];
        if T::DTYPE == DType::F32 {
            self.persistent.view::<T>(p.offset, p.elems())
        } else if p.half_copy == Some(T::DTYPE) {
            self.persistent.view::<T>(p.half_offset, p.elems())
        } else {
            Err(RuntimeError::Memory(format!(
                "parameter `{}` has no {} copy",
                p.name,
                T::DTYPE.name()
            )))
        }
    }

    unsafe fn pf32(&self, pid: u32) -> Result<&[f32]> {
        let p = &self.plan.params[pid as usize];
        self.persistent.view::<f32>(p.offset, p.elems())
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn pf32_mut(&self, pid: u32) -> Result<&mut [f32]> {
        let p = &self.plan.params[pid as usize];
        self.persistent.view_mut::<f32>(p.offset, p.elems())
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn grad_mut(&self, pid: u32) -> Result<&mut [f32]> {
        let p = &self.plan.params[pid as usize];
        if p.grad_offset == NO_OFFSET {
            return Err(RuntimeError::Memory(format!(
                "parameter `{}` has no gradient",
                p.name
            )));
        }
        self.persistent.view_mut::<f32>(p.grad_offset, p.elems())
    }

    fn key(&self, layer: u32) -> k::random::RngKey {
        k::random::RngKey {
            seed: self.seed,
            layer,
            step: self.step_counter,
        }
    }

    /// Runs a forward, recompute or backward step.
    fn run(&mut self, i: usize) -> Result<()> {
        let step = &self.plan.steps[i];
        let backward = step.phase == Phase::Backward;
        let r = if backward {
            self.backward(step)
        } else {
            self.forward(step)
        };
        r.map_err(|e| match e {
            Kerr(e) => kerr(step, e),
            Rt(e) => e,
        })
    }
}

/// Errors inside a step: a kernel's (wrapped with the step afterwards) or the runtime's.
enum StepErr {
    Kerr(k::KernelError),
    Rt(RuntimeError),
}
use StepErr::{Kerr, Rt};

impl From<k::KernelError> for StepErr {
    fn from(e: k::KernelError) -> Self {
        Kerr(e)
    }
}
impl From<RuntimeError> for StepErr {
    fn from(e: RuntimeError) -> Self {
        Rt(e)
    }
}

type SResult<T = ()> = std::result::Result<T, StepErr>;

macro_rules! float2 {
    ($a:expr, $A:ident, $b:expr, $B:ident, $body:block) => {
        with_float!($a, $A, { with_float!($b, $B, $body) })
    };
}

impl Executor {
    fn forward(&self, s: &PlanStep) -> SResult {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let (ws_id, sc_id) = (wr[nw - 2], wr[nw - 1]);
        let recompute = s.phase == Phase::Recompute;
        // SAFETY (whole block): the plan (validated) gives every tensor live at this step its
        // own bytes, except in-place pairs, which are detected by equal offsets and passed
        // as one mutable view.
        unsafe {
            match s.op {
                Op::InputCast { scale, .. } => {
                    let x = self.r::<u8>(rd[0])?;
                    with_float!(self.dtype(wr[0]), T, {
                        k::elementwise::cast_u8::<T>(x, self.w::<T>(wr[0])?, scale, 0.0)?
                    })
                }
                Op::Cast { .. } => float2!(self.dtype(rd[0]), S, self.dtype(wr[0]), D, {
                    k::elementwise::cast::<S, D>(self.r::<S>(rd[0])?, self.w::<D>(wr[0])?)?
                }),
                Op::Dense {
                    rows,
                    in_features,
                    units,
                    bias,
                } => with_float!(self.dtype(wr[0]), T, {
                    let d = k::dense::DenseDims {
                        batch: rows,
                        in_features,
                        out_features: units,
                    };
                    let b = if bias {
                        Some(self.pf32(s.params[1])?)
                    } else {
                        None
                    };
                    k::dense::dense_forward::<T>(
                        d,
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        b,
                        self.w::<T>(wr[0])?,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::Conv2d { dims, bias, chunk } => with_float!(self.dtype(wr[0]), T, {
                    let b = if bias {
                        Some(self.pf32(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::conv2d_forward::<T>(
                        conv_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        b,
                        self.w::<T>(wr[0])?,
                        self.ws::<T>(ws_id)?,
                        chunk,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::Conv2dTranspose { dims, bias, chunk } => with_float!(self.dtype(wr[0]), T, {
                    let b = if bias {
                        Some(self.pf32(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::conv2d_transpose_forward::<T>(
                        convt_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        b,
                        self.w::<T>(wr[0])?,
                        self.ws::<T>(ws_id)?,
                        chunk,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::DepthwiseConv2d { dims, bias } => with_float!(self.dtype(wr[0]), T, {
                    let b = if bias {
                        Some(self.pf32(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::depthwise_conv2d_forward::<T>(
                        dw_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        b,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                Op::MaxPool2d { dims } => with_float!(self.dtype(wr[0]), T, {
                    let d = pool_dims(&dims)?;
                    k::pool::max_pool2d_forward::<T>(
                        &d,
                        self.r::<T>(rd[0])?,
                        self.w::<T>(wr[0])?,
                        self.w::<u8>(wr[1])?,
                    )?
                }),
                Op::AvgPool2d { dims } => with_float!(self.dtype(wr[0]), T, {
                    let d = pool_dims(&dims)?;
                    k::pool::avg_pool2d_forward::<T>(&d, self.r::<T>(rd[0])?, self.w::<T>(wr[0])?)?
                }),
                Op::GlobalAvgPool { n, hw, c } => with_float!(self.dtype(wr[0]), T, {
                    k::pool::global_avg_pool_forward::<T>(
                        self.r::<T>(rd[0])?,
                        self.w::<T>(wr[0])?,
                        n,
                        hw,
                        c,
                    )?
                }),
                Op::BatchNorm {
                    rows,
                    channels,
                    momentum,
                    epsilon,
                } => with_float!(self.dtype(wr[0]), T, {
                    let d = k::norm::NormDims { rows, channels };
                    let cfg = k::norm::BatchNormConfig { epsilon, momentum };
                    let affine = k::norm::Affine {
                        gamma: self.pf32(s.params[0])?,
                        beta: self.pf32(s.params[1])?,
                    };
                    let saved = k::norm::BatchNormSaved {
                        x_hat: self.w::<T>(wr[1])?,
                        mean: self.w::<f32>(wr[2])?,
                        inv_std: self.w::<f32>(wr[3])?,
                    };
                    // Recomputation must not move the running statistics a second time.
                    let running = if recompute {
                        None
                    } else {
                        Some(k::norm::RunningStats {
                            mean: self.pf32_mut(s.params[2])?,
                            var: self.pf32_mut(s.params[3])?,
                        })
                    };
                    if self.same(rd[0], wr[0]) {
                        k::norm::batch_norm_train_forward_inplace::<T>(
                            d,
                            cfg,
                            self.w::<T>(wr[0])?,
                            affine,
                            saved,
                            running,
                        )?
                    } else {
                        k::norm::batch_norm_train_forward::<T>(
                            d,
                            cfg,
                            self.r::<T>(rd[0])?,
                            affine,
                            self.w::<T>(wr[0])?,
                            saved,
                            running,
                        )?
                    }
                }),
                Op::BatchNormInference {
                    rows,
                    channels,
                    epsilon,
                } => with_float!(self.dtype(wr[0]), T, {
                    let d = k::norm::NormDims { rows, channels };
                    let affine = k::norm::Affine {
                        gamma: self.pf32(s.params[0])?,
                        beta: self.pf32(s.params[1])?,
                    };
                    let (rm, rv) = (self.pf32(s.params[2])?, self.pf32(s.params[3])?);
                    if self.same(rd[0], wr[0]) {
                        k::norm::batch_norm_infer_forward_inplace::<T>(
                            d,
                            epsilon,
                            self.w::<T>(wr[0])?,
                            affine,
                            rm,
                            rv,
                        )?
                    } else {
                        k::norm::batch_norm_infer_forward::<T>(
                            d,
                            epsilon,
                            self.r::<T>(rd[0])?,
                            affine,
                            rm,
                            rv,
                            self.w::<T>(wr[0])?,
                        )?
                    }
                }),
                Op::LayerNorm {
                    rows,
                    features,
                    epsilon,
                } => with_float!(self.dtype(wr[0]), T, {
                    let d = k::norm::NormDims {
                        rows,
                        channels: features,
                    };
                    let affine = k::norm::Affine {
                        gamma: self.pf32(s.params[0])?,
                        beta: self.pf32(s.params[1])?,
                    };
                    k::norm::layer_norm_forward::<T>(
                        d,
                        epsilon,
                        self.r::<T>(rd[0])?,
                        affine,
                        self.w::<T>(wr[0])?,
                        self.w::<T>(wr[1])?,
                        self.w::<f32>(wr[2])?,
                    )?
                }),
                Op::Dropout { rate, key, .. } => with_float!(self.dtype(wr[0]), T, {
                    if self.same(rd[0], wr[0]) {
                        k::random::dropout_forward_inplace::<T>(
                            self.key(key),
                            rate,
                            self.w::<T>(wr[0])?,
                            self.w::<u8>(wr[1])?,
                        )?
                    } else {
                        k::random::dropout_forward::<T>(
                            self.key(key),
                            rate,
                            self.r::<T>(rd[0])?,
                            self.w::<T>(wr[0])?,
                            self.w::<u8>(wr[1])?,
                        )?
                    }
                }),
                Op::Activation {
                    act: Act::Softmax,
                    elems,
                    cols,
                } => {
                    let rows = elems / cols.max(1);
                    if self.same(rd[0], wr[0]) {
                        with_float!(self.dtype(wr[0]), T, {
                            k::activation::softmax_inplace::<T>(self.w::<T>(wr[0])?, rows, cols)?
                        })
                    } else {
                        float2!(self.dtype(rd[0]), I, self.dtype(wr[0]), O, {
                            k::activation::softmax_forward::<I, O>(
                                self.r::<I>(rd[0])?,
                                self.w::<O>(wr[0])?,
                                rows,
                                cols,
                            )?
                        })
                    }
                }
                Op::Activation { act, .. } => with_float!(self.dtype(wr[0]), T, {
                    if self.same(rd[0], wr[0]) {
                        kact(act).forward_inplace::<T>(self.w::<T>(wr[0])?)
                    } else {
                        kact(act).forward::<T>(self.r::<T>(rd[0])?, self.w::<T>(wr[0])?)?
                    }
                }),
                Op::Add { .. } => with_float!(self.dtype(wr[0]), T, {
                    // At most 4 summands are passed on the stack; more are folded in place.
                    let mut others: [&[T]; 8] = [&[]; 8];
                    let n = rd.len().min(8);
                    if rd.len() > 8 {
                        return Err(Rt(RuntimeError::Memory("add of more than 8 inputs".into())));
                    }
                    if self.same(rd[0], wr[0]) {
                        for (j, &t) in rd[1..].iter().enumerate() {
                            others[j] = self.r::<T>(t)?;
                        }
                        k::elementwise::add_n_inplace::<T>(self.w::<T>(wr[0])?, &others[..n - 1])?
                    } else {
                        for (j, &t) in rd.iter().enumerate() {
                            others[j] = self.r::<T>(t)?;
                        }
                        k::elementwise::add_n::<T>(&others[..n], self.w::<T>(wr[0])?)?
                    }
                }),
                Op::Concat { rows, a, b } => with_float!(self.dtype(wr[0]), T, {
                    k::elementwise::concat_last::<T>(
                        &[self.r::<T>(rd[0])?, self.r::<T>(rd[1])?],
                        &[a, b],
                        rows,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                Op::Embedding { tokens, vocab, dim } => with_float!(self.dtype(wr[0]), T, {
                    let d = k::embedding::EmbeddingDims { tokens, vocab, dim };
                    k::embedding::embedding_forward::<f32, T>(
                        d,
                        self.r::<i32>(rd[0])?,
                        self.pf32(s.params[0])?,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                Op::Attention {
                    batch,
                    seq,
                    heads,
                    head_dim,
                    causal,
                    dropout,
                    key,
                } => with_float!(self.dtype(wr[0]), T, {
                    let (d, scale) = attention_dims(batch, seq, heads, head_dim);
                    let qkv = self.r::<T>(rd[0])?;
                    let sc = self.ws::<f32>(sc_id)?;
                    {
                        let probs = self.w::<T>(wr[0])?;
                        k::attention::scores_forward::<T>(d, qkv, probs, scale, causal, sc)?;
                        k::activation::softmax_inplace::<T>(probs, batch * heads * seq, seq)?;
                    }
                    let probs = self.r::<T>(wr[0])?;
                    if dropout > 0.0 {
                        k::random::dropout_forward::<T>(
                            self.key(key),
                            dropout,
                            probs,
                            self.w::<T>(wr[2])?,
                            self.w::<u8>(wr[1])?,
                        )?;
                        k::attention::context_forward::<T>(
                            d,
                            self.r::<T>(wr[2])?,
                            qkv,
                            self.w::<T>(wr[3])?,
                            sc,
                        )?
                    } else {
                        k::attention::context_forward::<T>(d, probs, qkv, self.w::<T>(wr[1])?, sc)?
                    }
                }),
                Op::SampleNormal { key, .. } => with_float!(self.dtype(wr[0]), T, {
                    k::random::sample_normal_forward::<T>(
                        self.key(key),
                        self.r::<T>(rd[0])?,
                        self.r::<T>(rd[1])?,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                other => {
                    return Err(Rt(RuntimeError::Memory(format!(
                        "{} is not a forward op",
                        other.name()
                    ))))
                }
            }
        }
        Ok(())
    }

    fn backward(&self, s: &PlanStep) -> SResult {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let (ws_id, sc_id) = (wr[nw - 2], wr[nw - 1]);
        // SAFETY: as in `forward`.
        unsafe {
            match s.op {
                Op::Cast { .. } => float2!(self.dtype(wr[0]), S, self.dtype(rd[0]), D, {
                    k::elementwise::cast_backward::<S, D>(self.r::<D>(rd[0])?, self.w::<S>(wr[0])?)?
                }),
                Op::Dense {
                    rows,
                    in_features,
                    units,
                    bias,
                } => with_float!(self.dtype(rd[0]), T, {
                    let d = k::dense::DenseDims {
                        batch: rows,
                        in_features,
                        out_features: units,
                    };
                    let db = if bias {
                        Some(self.grad_mut(s.params[1])?)
                    } else {
                        None
                    };
                    k::dense::dense_backward::<T>(
                        d,
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        self.r::<T>(rd[1])?,
                        self.wo::<T>(wr[0])?,
                        self.grad_mut(s.params[0])?,
                        db,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::Conv2d { dims, bias, chunk } => with_float!(self.dtype(rd[0]), T, {
                    let db = if bias {
                        Some(self.grad_mut(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::conv2d_backward::<T>(
                        conv_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        self.r::<T>(rd[1])?,
                        self.wo::<T>(wr[0])?,
                        self.grad_mut(s.params[0])?,
                        db,
                        self.ws::<T>(ws_id)?,
                        chunk,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::Conv2dTranspose { dims, bias, chunk } => with_float!(self.dtype(rd[0]), T, {
                    let db = if bias {
                        Some(self.grad_mut(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::conv2d_transpose_backward::<T>(
                        convt_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        self.r::<T>(rd[1])?,
                        self.wo::<T>(wr[0])?,
                        self.grad_mut(s.params[0])?,
                        db,
                        self.ws::<T>(ws_id)?,
                        chunk,
                        self.ws::<f32>(sc_id)?,
                    )?
                }),
                Op::DepthwiseConv2d { dims, bias } => with_float!(self.dtype(rd[0]), T, {
                    let db = if bias {
                        Some(self.grad_mut(s.params[1])?)
                    } else {
                        None
                    };
                    k::conv::depthwise_conv2d_backward::<T>(
                        dw_dims(&dims),
                        self.r::<T>(rd[0])?,
                        self.weight::<T>(s.params[0])?,
                        self.r::<T>(rd[1])?,
                        self.wo::<T>(wr[0])?,
                        self.grad_mut(s.params[0])?,
                        db,
                    )?
                }),
                Op::MaxPool2d { dims } => with_float!(self.dtype(rd[1]), T, {
                    k::pool::max_pool2d_backward::<T>(
                        &pool_dims(&dims)?,
                        self.r::<u8>(rd[0])?,
                        self.r::<T>(rd[1])?,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                Op::AvgPool2d { dims } => with_float!(self.dtype(rd[0]), T, {
                    k::pool::avg_pool2d_backward::<T>(
                        &pool_dims(&dims)?,
                        self.r::<T>(rd[0])?,
                        self.w::<T>(wr[0])?,
                    )?
                }),
                Op::GlobalAvgPool { n, hw, c } => with_float!(self.dtype(rd[0]), T, {
                    k::pool::global_avg_pool_backward::<T>(
                        self.r::<T>(rd[0])?,
                        self.w::<T>(wr[0])?,
                        n,
                        hw,
                        c,
                    )?
                }),
                Op::BatchNorm { rows, channels, .. } => with_float!(self.dtype(rd[0]), T, {
                    let d = k::norm::NormDims { rows, channels };
                    let grads = k::norm::AffineGrads {
                        dgamma: self.grad_mut(s.params[0])?,
                        dbeta: self.grad_mut(s.params[1])?,
                    };
                    k::norm::batch_norm_backward::<T>(
                        d,
                        self.r::<T>(rd[0])?,
                        self.r::<f32>(rd[1])?,
                        self.pf32(s.params[0])?,
                        self.r::<T>(rd[2])?,
                        self.w::<T>(wr[0])?,
                        grads,
                    )?
                }),
                Op::LayerNorm { rows, features, .. } => with_float!(self.dtype(rd[0]), T, {
                    let d = k::norm::NormDims {
                        rows,
                        channels: features,
                    };
                    let grads = k::norm::AffineGrads {
                        dgamma: self.grad_mut(s.params[0])?,
                        dbeta: self.grad_mut(s.params[1])?,
                    };
                    k::norm::layer_norm_backward::<T>(
                        d,
                        self.r::<T>(rd[0])?,
                        self.r::<f32>(rd[1])?,
                        self.pf32(s.params[0])?,
                        self.r::<T>(rd[2])?,
                        self.w::<T>(wr[0])?,
                        grads,
                    )?
                }),
                Op::Dropout { rate, .. } => with_float!(self.dtype(rd[1]), T, {
                    if self.same(rd[1], wr[0]) {
                        k::random::dropout_backward_inplace::<T>(
                            rate,
                            self.r::<u8>(rd[0])?,
                            self.w::<T>(wr[0])?,
                        )?
                    } else {
                        k::random::dropout_backward::<T>(
                            rate,
                            self.r::<u8>(rd[0])?,
                            self.r::<T>(rd[1])?,
                            self.w::<T>(wr[0])?,
                        )?
                    }
                }),
                Op::Activation {
                    act: Act::Softmax,
                    elems,
                    cols,
                } => {
                    let rows = elems / cols.max(1);
                    if self.same(rd[1], wr[0]) {
                        float2!(self.dtype(rd[0]), Y, self.dtype(rd[1]), G, {
                            k::activation::softmax_backward_inplace::<Y, G>(
                                self.r::<Y>(rd[0])?,
                                self.w::<G>(wr[0])?,
                                rows,
                                cols,
                            )?
                        })
                    } else {
                        float2!(self.dtype(rd[0]), Y, self.dtype(rd[1]), G, {
                            with_float!(self.dtype(wr[0]), D, {
                                k::activation::softmax_backward::<Y, G, D>(
                                    self.r::<Y>(rd[0])?,
                                    self.r::<G>(rd[1])?,
                                    self.w::<D>(wr[0])?,
                                    rows,
                                    cols,
                                )?
                            })
                        })
                    }
                }
                Op::Activation { act, .. } => with_float!(self.dtype(rd[1]), T, {
                    if self.same(rd[1], wr[0]) {
                        kact(act).backward_inplace::<T>(self.r::<T>(rd[0])?, self.w::<T>(wr[0])?)?
                    } else {
                        kact(act).backward::<T>(
                            self.r::<T>(rd[0])?,
                            self.r::<T>(rd[1])?,
                            self.w::<T>(wr[0])?,
                        )?
                    }
                }),
                Op::Concat { rows, a, b } => with_float!(self.dtype(rd[0]), T, {
                    let dy = self.r::<T>(rd[0])?;
                    // A summand that takes no gradient still needs somewhere to go: the
                    // planner always schedules both (see autodiff).
                    k::elementwise::concat_last_backward::<T>(
                        dy,
                        &[a, b],
                        rows,
                        &mut [self.w::<T>(wr[0])?, self.w::<T>(wr[1])?],
                    )?
                }),
                Op::Embedding { tokens, vocab, dim } => with_float!(self.dtype(rd[1]), T, {
                    let d = k::embedding::EmbeddingDims { tokens, vocab, dim };
                    k::embedding::embedding_backward::<T>(
                        d,
                        self.r::<i32>(rd[0])?,
                        self.r::<T>(rd[1])?,
                        self.grad_mut(s.params[0])?,
                    )?
                }),
                Op::Attention {
                    batch,
                    seq,
                    heads,
                    head_dim,
                    dropout,
                    ..
                } => with_float!(self.dtype(rd[0]), T, {
                    let (d, scale) = attention_dims(batch, seq, heads, head_dim);
                    let qkv = self.r::<T>(rd[0])?;
                    let probs = self.r::<T>(rd[1])?;
                    let (used, dctx) = if dropout > 0.0 {
                        (self.r::<T>(rd[3])?, self.r::<T>(rd[4])?)
                    } else {
                        (probs, self.r::<T>(rd[2])?)
                    };
                    let dqkv = self.w::<T>(wr[0])?;
                    let dp = self.w::<T>(ws_id)?;
                    let sc = self.ws::<f32>(sc_id)?;
                    k::attention::context_backward::<T>(d, dctx, used, qkv, dp, dqkv, sc)?;
                    if dropout > 0.0 {
                        k::random::dropout_backward_inplace::<T>(
                            dropout,
                            self.r::<u8>(rd[2])?,
                            dp,
                        )?;
                    }
                    k::activation::softmax_backward_inplace::<T, T>(
                        probs,
                        dp,
                        batch * heads * seq,
                        seq,
                    )?;
                    k::attention::scores_backward::<T>(d, dp, qkv, dqkv, scale, sc)?
                }),
                Op::SampleNormal { key, .. } => with_float!(self.dtype(rd[0]), T, {
                    k::random::sample_normal_backward::<T>(
                        self.key(key),
                        self.r::<T>(rd[0])?,
                        self.r::<T>(rd[1])?,
                        self.w::<T>(wr[0])?,
                        self.w::<T>(wr[1])?,
                        k::elementwise::GradWrite::Overwrite,
                    )?
                }),
                Op::Accumulate { .. } => with_float!(self.dtype(wr[0]), T, {
                    if self.same(rd[0], wr[0]) {
                        k::elementwise::accumulate::<T, T>(
                            self.w::<T>(wr[0])?,
                            self.r::<T>(rd[1])?,
                        )?
                    } else if self.same(rd[1], wr[0]) {
                        k::elementwise::accumulate::<T, T>(
                            self.w::<T>(wr[0])?,
                            self.r::<T>(rd[0])?,
                        )?
                    } else {
                        let g = self.w::<T>(wr[0])?;
                        g.copy_from_slice(self.r::<T>(rd[0])?);
                        k::elementwise::accumulate::<T, T>(g, self.r::<T>(rd[1])?)?
                    }
                }),
                other => {
                    return Err(Rt(RuntimeError::Memory(format!(
                        "{} has no backward step",
                        other.name()
                    ))))
                }
            }
        }
        Ok(())
    }

    /// Runs a loss step; returns (weighted loss, correct predictions).
    fn loss_step(&mut self, i: usize) -> Result<(f32, usize)> {
        let s = &self.plan.steps[i];
        let r = self.loss_inner(s).map_err(|e| match e {
            Kerr(e) => kerr(s, e),
            Rt(e) => e,
        })?;
        // SAFETY: the loss value tensor is written only here.
        unsafe {
            self.arena
                .view_mut::<f32>(self.plan.tensor(s.writes[0]).offset, 1)?[0] = r.0
        };
        Ok(r)
    }

    /// A loss value without gradients (inference plans).
    fn loss_eval(&self, s: &PlanStep) -> SResult<(f32, usize)> {
        let (rd, wr) = (&s.reads, &s.writes);
        let ws_id = wr[wr.len() - 2];
        // SAFETY: as in `forward`.
        unsafe {
            Ok(match s.op {
                Op::SoftmaxCrossEntropy {
                    rows,
                    classes,
                    weight,
                } => with_float!(self.dtype(rd[0]), P, {
                    let r = k::loss::sparse_categorical_crossentropy_eval::<P>(
                        self.r::<P>(rd[0])?,
                        self.r::<i32>(rd[1])?,
                        rows,
                        classes,
                    )?;
                    (weight * r.loss, r.correct)
                }),
                Op::SoftmaxCrossEntropyFromLogits {
                    rows,
                    classes,
                    weight,
                } => {
                    let probs = self.w::<f32>(ws_id)?;
                    with_float!(self.dtype(rd[0]), P, {
                        k::activation::softmax_forward::<P, f32>(
                            self.r::<P>(rd[0])?,
                            probs,
                            rows,
                            classes,
                        )?
                    });
                    let r = k::loss::sparse_categorical_crossentropy_eval::<f32>(
                        probs,
                        self.r::<i32>(rd[1])?,
                        rows,
                        classes,
                    )?;
                    (weight * r.loss, r.correct)
                }
                Op::SigmoidBinaryCrossentropy {
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
                } => float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                    (
                        weight
                            * k::loss::binary_crossentropy_eval::<P, Y>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                            )?,
                        0,
                    )
                }),
                Op::BinaryCrossentropyFromLogits {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                    (
                        weight
                            * k::loss::binary_crossentropy_from_logits_eval::<P, Y>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                            )?,
                        0,
                    )
                }),
                Op::MeanSquaredError {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                    (
                        weight
                            * k::loss::mean_squared_error_eval::<P, Y>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                            )?,
                        0,
                    )
                }),
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
                    with_float!(self.dtype(rd[0]), T, {
                        (
                            w * k::loss::kl_divergence_standard_normal_eval::<T>(
                                self.r::<T>(rd[0])?,
                                self.r::<T>(rd[1])?,
                                rows,
                                features,
                            )?,
                            0,
                        )
                    })
                }
                other => {
                    return Err(Rt(RuntimeError::Memory(format!(
                        "{} is not a loss",
                        other.name()
                    ))))
                }
            })
        }
    }

    fn loss_inner(&self, s: &PlanStep) -> SResult<(f32, usize)> {
        let (rd, wr) = (&s.reads, &s.writes);
        let nw = wr.len();
        let ws_id = wr[nw - 2];
        let scale = self.scaler.scale();
        let need = |id: u32| -> SResult<u32> {
            if id == NONE {
                Err(Rt(RuntimeError::Memory(format!(
                    "loss `{}`: its input depends on no parameter",
                    s.op.name()
                ))))
            } else {
                Ok(id)
            }
        };
        if !self.plan.training {
            return self.loss_eval(s);
        }
        // SAFETY: as in `forward`.
        unsafe {
            Ok(match s.op {
                Op::SoftmaxCrossEntropy {
                    rows,
                    classes,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    float2!(self.dtype(rd[0]), P, self.dtype(g), G, {
                        let r = k::loss::sparse_categorical_crossentropy::<P, G>(
                            self.r::<P>(rd[0])?,
                            self.r::<i32>(rd[1])?,
                            rows,
                            classes,
                            weight * scale,
                            self.w::<G>(g)?,
                        )?;
                        (weight * r.loss, r.correct)
                    })
                }
                Op::SoftmaxCrossEntropyFromLogits {
                    rows,
                    classes,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    let probs = self.w::<f32>(ws_id)?;
                    with_float!(self.dtype(rd[0]), P, {
                        k::activation::softmax_forward::<P, f32>(
                            self.r::<P>(rd[0])?,
                            probs,
                            rows,
                            classes,
                        )?
                    });
                    with_float!(self.dtype(g), G, {
                        let r = k::loss::sparse_categorical_crossentropy::<f32, G>(
                            probs,
                            self.r::<i32>(rd[1])?,
                            rows,
                            classes,
                            weight * scale,
                            self.w::<G>(g)?,
                        )?;
                        (weight * r.loss, r.correct)
                    })
                }
                Op::SigmoidBinaryCrossentropy {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                        with_float!(self.dtype(g), G, {
                            let l = k::loss::binary_crossentropy_with_sigmoid::<P, Y, G>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                                weight * scale,
                                self.w::<G>(g)?,
                            )?;
                            (weight * l, 0)
                        })
                    })
                }
                Op::BinaryCrossentropyFromLogits {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                        with_float!(self.dtype(g), G, {
                            let l = k::loss::binary_crossentropy_from_logits::<P, Y, G>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                                weight * scale,
                                self.w::<G>(g)?,
                            )?;
                            (weight * l, 0)
                        })
                    })
                }
                Op::BinaryCrossentropy {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                        with_float!(self.dtype(g), G, {
                            let l = k::loss::binary_crossentropy::<P, Y, G>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                                weight * scale,
                                self.w::<G>(g)?,
                            )?;
                            (weight * l, 0)
                        })
                    })
                }
                Op::MeanSquaredError {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => {
                    let g = need(wr[1])?;
                    float2!(self.dtype(rd[0]), P, self.dtype(rd[1]), Y, {
                        with_float!(self.dtype(g), G, {
                            let l = k::loss::mean_squared_error::<P, Y, G>(
                                self.r::<P>(rd[0])?,
                                self.r::<Y>(rd[1])?,
                                rows,
                                features,
                                reduction(red),
                                weight * scale,
                                self.w::<G>(g)?,
                            )?;
                            (weight * l, 0)
                        })
                    })
                }
                Op::KlNormal {
                    rows,
                    features,
                    reduction: red,
                    weight,
                } => {
                    let (gm, gl) = (need(wr[1])?, need(wr[2])?);
                    // The kernel sums over the latent features; `Mean` also divides by them.
                    let w = if red == Reduction::Mean {
                        weight / features as f32
                    } else {
                        weight
                    };
                    float2!(self.dtype(rd[0]), T, self.dtype(gm), G, {
                        let l = k::loss::kl_divergence_standard_normal::<T, G>(
                            self.r::<T>(rd[0])?,
                            self.r::<T>(rd[1])?,
                            rows,
                            features,
                            w * scale,
                            self.w::<G>(gm)?,
                            self.w::<G>(gl)?,
                        )?;
                        (w * l, 0)
                    })
                }
                other => {
                    return Err(Rt(RuntimeError::Memory(format!(
                        "{} is not a loss",
                        other.name()
                    ))))
                }
            })
        }
    }
}

/// Parameter `name` of `plan` and its index; the error names it. Shared by the CPU and GPU
/// executors, like the lookups below, so both answer a wrong name in the same words.
pub(crate) fn param_named<'p>(plan: &'p StaticPlan, name: &str) -> Result<(usize, &'p PlanParam)> {
    plan.params
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == name)
        .ok_or_else(|| RuntimeError::Input(format!("the model has no parameter `{name}`")))
}

/// Trainable parameter `name` of `plan` (one with a gradient).
pub(crate) fn trainable_param_named<'p>(plan: &'p StaticPlan, name: &str) -> Result<&'p PlanParam> {
    plan.params
        .iter()
        .find(|p| p.name == name && p.grad_offset != NO_OFFSET)
        .ok_or_else(|| {
            RuntimeError::Input(format!("the model has no trainable parameter `{name}`"))
        })
}

/// Checks that `values` are exactly parameter `p`'s values.
pub(crate) fn check_param_values(p: &PlanParam, values: &[f32]) -> Result<()> {
    if values.len() != p.elems() {
        return Err(RuntimeError::Input(format!(
            "parameter `{}` has {} values ({:?}), got {}",
            p.name,
            p.elems(),
            &p.shape[..],
            values.len()
        )));
    }
    Ok(())
}

/// The prediction tensor of an inference plan, checked against a buffer of `len` values. A
/// training plan is refused: its later steps may reuse the prediction's bytes, so what is
/// read there after a step is not the prediction.
pub(crate) fn readable_prediction(plan: &StaticPlan, len: usize) -> Result<&PlanTensor> {
    if plan.prediction == NONE {
        return Err(RuntimeError::Input("the model has no prediction".into()));
    }
    if plan.training {
        return Err(RuntimeError::Input(
            "read_prediction needs an inference plan (plan_inference)".into(),
        ));
    }
    let t = plan.tensor(plan.prediction);
    if len != t.elems() {
        return Err(RuntimeError::Input(format!(
            "prediction has {} values, buffer {len}",
            t.elems()
        )));
    }
    Ok(t)
}

/// An attention step's GEMM geometry and its score scale, 1/√head_dim.
pub(crate) fn attention_dims(
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
) -> (k::attention::AttentionDims, f32) {
    let d = k::attention::AttentionDims {
        batch,
        seq,
        hidden: heads * head_dim,
        heads,
    };
    (d, 1.0 / (head_dim as f32).sqrt())
}

/// Checks `inputs` against `plan`'s inputs before anything is copied or run: their count,
/// dtypes and lengths; no NaN or infinity in float inputs; labels and token ids in range.
/// Shared by the CPU and GPU executors, so both refuse the same batches with the same words.
pub(crate) fn check_inputs(plan: &StaticPlan, inputs: &[Batch<'_>]) -> Result<()> {
    let ids = &plan.inputs;
    if inputs.len() != ids.len() {
        let names: Vec<&str> = ids.iter().map(|&i| plan.tensor(i).name.as_ref()).collect();
        return Err(RuntimeError::Input(format!(
            "the model takes {} inputs ({}), got {}",
            ids.len(),
            names.join(", "),
            inputs.len()
        )));
    }
    for (b, &id) in inputs.iter().zip(ids.iter()) {
        let t = plan.tensor(id);
        if b.dtype() != t.dtype {
            return Err(RuntimeError::Input(format!(
                "input `{}` holds {} values, got {}",
                t.name,
                t.dtype.name(),
                b.dtype().name()
            )));
        }
        if b.len() != t.elems() {
            // Say what the batch was, when it is whole samples: a batch larger than the
            // plan's is refused here, before a byte is copied into the arena.
            let per = t.shape.get(1..).map_or(1, |s| s.iter().product::<usize>());
            let samples = match b.len().checked_div(per) {
                Some(n) if n * per == b.len() => format!(
                    " (a batch of {n}; this plan's batch is {}: plan the model for {n} or split the batch)",
                    plan.batch
                ),
                _ => String::new(),
            };
            return Err(RuntimeError::Input(format!(
                "input `{}` expects {} values (shape {:?}), got {}{samples}",
                t.name,
                t.elems(),
                &t.shape[..],
                b.len()
            )));
        }
    }
    for (b, &id) in inputs.iter().zip(ids.iter()) {
        let bad = match b {
            Batch::F32(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::F16(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::BF16(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::U8(_) | Batch::I32(_) => None,
        };
        if let Some((i, value)) = bad {
            let t = plan.tensor(id);
            let per = (t.elems() / t.shape.first().copied().unwrap_or(1).max(1)).max(1);
            return Err(RuntimeError::InputSample {
                input: t.name.to_string(),
                sample: i / per,
                problem: format!(
                    "holds a non-finite value ({value} at element {i} of the batch, \
                     expected a finite {}); clean the data or drop such samples \
                     (`InMemory::drop_non_finite`)",
                    t.dtype.name()
                ),
                context: String::new(),
            });
        }
    }
    check_index_ranges(plan, inputs)?;
    Ok(())
}

/// Checks the integer inputs that index something: labels read by a sparse
/// cross-entropy (`0..classes`) and token ids read by an embedding (`0..vocab`), so a bad
/// value is refused before any step runs, naming the input, the sample and the range.
fn check_index_ranges(plan: &StaticPlan, inputs: &[Batch<'_>]) -> Result<()> {
    for s in plan.steps.iter() {
        let (at, limit, what) = match s.op {
            Op::SoftmaxCrossEntropy { classes, .. }
            | Op::SoftmaxCrossEntropyFromLogits { classes, .. } => (1, classes, "classes"),
            Op::Embedding { vocab, .. } => (0, vocab, "tokens in the vocabulary"),
            _ => continue,
        };
        let Some(&id) = s.reads.get(at) else { continue };
        let Some(k) = plan.inputs.iter().position(|&i| i == id) else {
            continue;
        };
        let Some(Batch::I32(x)) = inputs.get(k) else {
            continue;
        };
        let Some(i) = x
            .iter()
            .position(|&v| !usize::try_from(v).is_ok_and(|v| v < limit))
        else {
            continue;
        };
        let t = plan.tensor(id);
        let per = (t.elems() / t.shape.first().copied().unwrap_or(1).max(1)).max(1);
        let (name, range_of) = match s.op {
            Op::Embedding { .. } => (
                "token id",
                format!("the embedding `{}` has {limit} {what}", s.layer),
            ),
            _ => {
                let prediction = s.reads.first().map_or("", |&p| &*plan.tensor(p).layer);
                (
                    "label",
                    format!(
                        "the sparse categorical cross-entropy on `{prediction}` has {limit} {what}"
                    ),
                )
            }
        };
        return Err(RuntimeError::InputSample {
            input: t.name.to_string(),
            sample: i / per,
            problem: format!(
                "has {name} {} (element {i} of the batch), expected 0..={}: {range_of}",
                x[i],
                limit as i64 - 1,
            ),
            context: String::new(),
        });
    }
    Ok(())
}
