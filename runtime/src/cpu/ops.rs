//! The CPU's kernel for every op and phase: typed views of the arena and the persistent
//! region at the places the step's [`memwise_plan::io`] struct names, handed to
//! `memwise_kernels`.
//!
//! Safety, for every `unsafe` block here: the plan (validated) gives every tensor live at a
//! step its own bytes, except in-place pairs, which are detected by equal offsets
//! ([`CpuKernels::same`]) and passed as one mutable view; parameters, gradients and optimizer
//! state are disjoint ranges of the persistent region.

use std::borrow::Cow;

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_plan::io::*;
use memwise_plan::liveness::align_up;
use memwise_plan::{Activation as Act, DType, PlanStep, Reduction, StaticPlan, NONE};

use super::CpuKernels;
use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use crate::executor::match_float;
use crate::executor::Batch;
use crate::kernels::{
    gradient_ranges, pointwise, BceInput, Kernels, OpError, OpResult, StepFlags, StepScalars,
    UpdateStep,
};

/// Runs `$body` with `$T` bound to the element type of float dtype `$dt`.
macro_rules! with_float {
    ($dt:expr, $T:ident, $body:block) => {
        match_float!($dt, $T, $body, other => {
            return Err(OpError::Runtime(RuntimeError::Memory(format!(
                "expected a float tensor, found {}",
                other.name()
            ))))
        })
    };
}

macro_rules! float2 {
    ($a:expr, $A:ident, $b:expr, $B:ident, $body:block) => {
        with_float!($a, $A, { with_float!($b, $B, $body) })
    };
}

fn reduction(r: Reduction) -> k::loss::Reduction {
    match r {
        Reduction::Mean => k::loss::Reduction::Mean,
        Reduction::SumOverFeatures => k::loss::Reduction::SumOverFeaturesMeanOverBatch,
    }
}

impl CpuKernels {
    /// The gradient a training loss writes; an inference plan writes none.
    fn loss_grad(&self, id: TensorId, op: &str) -> std::result::Result<Option<TensorId>, OpError> {
        if !self.plan.training {
            return Ok(None);
        }
        if id == NONE {
            return Err(OpError::Runtime(RuntimeError::Memory(format!(
                "loss `{op}`: its input depends on no parameter"
            ))));
        }
        Ok(Some(id))
    }

    /// Batch norm's (per channel) or layer norm's (per row, `layer`) backward: both read
    /// `x̂`, the saved `1/σ`, `γ` and `dy` and write `dx`, `dγ` and `dβ` alike.
    fn norm_backward(&self, io: &NormBackward, d: k::norm::NormDims, layer: bool) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.x_hat), T, {
                let kernel = if layer {
                    k::norm::layer_norm_backward::<T>
                } else {
                    k::norm::batch_norm_backward::<T>
                };
                let grads = self.affine_grads(io.gamma, io.beta)?;
                kernel(
                    d,
                    self.r::<T>(io.x_hat)?,
                    self.r::<f32>(io.inv_std)?,
                    self.pf32(io.gamma)?,
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                    grads,
                )?
            })
        }
        Ok(())
    }

    /// Writes a loss term's weighted value; without loss scaling a non-finite one flags the
    /// step, so the optimizer keeps the weights.
    fn loss_value(&self, value_id: TensorId, value: f32, correct: usize) -> OpResult {
        // SAFETY: the loss value tensor is written only by its loss step.
        unsafe { self.w::<f32>(value_id)?[0] = value };
        self.correct.set(self.correct.get() + correct);
        if self.plan.training && !self.plan.loss_scaling && !value.is_finite() {
            self.nonfinite.set(true);
        }
        Ok(())
    }
}

impl Kernels for CpuKernels {
    fn device_name(&self) -> String {
        crate::device::Device::cpu().name()
    }

    fn plan(&self) -> &StaticPlan {
        &self.plan
    }

    fn device_bytes_used(&self) -> Option<u64> {
        None
    }

    fn another(&self, plan: StaticPlan, device: &crate::device::Device, seed: u64) -> Result<Self> {
        CpuKernels::new(plan, device, seed)
    }

    fn load_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        self.copy_inputs(inputs)
    }

    fn begin_step(&mut self, scalars: &StepScalars) -> Result<()> {
        self.scalars.set(*scalars);
        self.correct.set(0);
        self.nonfinite.set(false);
        self.zero_grads();
        Ok(())
    }

    fn run_steps(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        steps(self)
    }

    fn end_step(&mut self) -> Result<StepFlags> {
        self.end()
    }

    fn flagged_now(&self) -> Option<bool> {
        Some(self.nonfinite.get())
    }

    fn set_graphs(&mut self, _on: bool) {
        // The CPU runs every step as it comes: there is nothing to record.
    }

    fn read_param(&self, pid: u32, grad: bool) -> Result<Vec<f32>> {
        let p = &self.plan.params[pid as usize];
        let offset = if grad { p.grad_offset } else { p.offset };
        // SAFETY: shared view between steps.
        unsafe { Ok(self.persistent.view::<f32>(offset, p.elems())?.to_vec()) }
    }

    fn write_param(&mut self, pid: u32, values: &[f32]) -> Result<()> {
        let p = &self.plan.params[pid as usize];
        // SAFETY: &mut self: no other view is live.
        let dst = unsafe { self.persistent.view_mut::<f32>(p.offset, p.elems())? };
        dst.copy_from_slice(values);
        self.refresh_half_copies(Some(pid as usize))
    }

    fn read_tensor(&self, id: u32, out: &mut [f32]) -> Result<()> {
        let t = self.plan.tensor(id);
        let mut run = || -> OpResult {
            // SAFETY: shared view after the step.
            unsafe {
                with_float!(t.dtype, T, {
                    k::elementwise::cast::<T, f32>(self.r::<T>(id)?, out)?;
                })
            }
            Ok(())
        };
        run().map_err(|e| match e {
            OpError::Kernel(e) => RuntimeError::Memory(e.0),
            OpError::Runtime(e) => e,
        })
    }

    fn tensor_finite(&self, id: u32) -> Result<bool> {
        self.finite(id)
    }

    fn persistent_image(&self) -> Result<Cow<'_, [u8]>> {
        Ok(self.image())
    }

    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        write(self.persistent.bytes_mut())?;
        self.refresh_half_copies(None)
    }

    fn set_replica(&mut self, _rank: usize) -> Result<()> {
        Ok(()) // each update step carries the rank (`UpdateStep::rank`)
    }

    fn poison(&self, ids: &[u32], padding: &[(u64, u64)]) -> Result<()> {
        self.poison_tensors(ids, padding)
    }

    // ---- forward ----

    fn input_cast(&self, io: &UnaryForward, scale: f32) -> OpResult {
        unsafe {
            let x = self.r::<u8>(io.x)?;
            with_float!(self.dtype(io.y), T, {
                k::elementwise::cast_u8::<T>(x, self.w::<T>(io.y)?, scale, 0.0)?
            })
        }
        Ok(())
    }

    fn cast(&self, io: &UnaryForward) -> OpResult {
        unsafe {
            float2!(self.dtype(io.x), S, self.dtype(io.y), D, {
                k::elementwise::cast::<S, D>(self.r::<S>(io.x)?, self.w::<D>(io.y)?)?
            })
        }
        Ok(())
    }

    fn dense(&self, io: &LinearForward, d: k::dense::DenseDims) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::dense::dense_forward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.pf32_opt(io.bias)?,
                    self.w::<T>(io.y)?,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn conv2d(&self, io: &LinearForward, d: k::conv::Conv2dDims, chunk: usize) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::conv::conv2d_forward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.pf32_opt(io.bias)?,
                    self.w::<T>(io.y)?,
                    self.ws::<T>(io.ws)?,
                    chunk,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn depthwise_conv2d(&self, io: &LinearForward, d: k::conv::DepthwiseConv2dDims) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::conv::depthwise_conv2d_forward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.pf32_opt(io.bias)?,
                    self.w::<T>(io.y)?,
                )?
            })
        }
        Ok(())
    }

    fn conv2d_transpose(
        &self,
        io: &LinearForward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::conv::conv2d_transpose_forward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.pf32_opt(io.bias)?,
                    self.w::<T>(io.y)?,
                    self.ws::<T>(io.ws)?,
                    chunk,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn max_pool2d(&self, io: &MaxPoolForward, d: &k::pool::Pool2d) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::pool::max_pool2d_forward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.w::<T>(io.y)?,
                    self.w::<u8>(io.argmax)?,
                )?
            })
        }
        Ok(())
    }

    fn avg_pool2d(&self, io: &UnaryForward, d: &k::pool::Pool2d) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::pool::avg_pool2d_forward::<T>(d, self.r::<T>(io.x)?, self.w::<T>(io.y)?)?
            })
        }
        Ok(())
    }

    fn global_avg_pool(&self, io: &UnaryForward, n: usize, hw: usize, c: usize) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::pool::global_avg_pool_forward::<T>(
                    self.r::<T>(io.x)?,
                    self.w::<T>(io.y)?,
                    n,
                    hw,
                    c,
                )?
            })
        }
        Ok(())
    }

    fn batch_norm(
        &self,
        io: &BatchNormForward,
        d: k::norm::NormDims,
        cfg: k::norm::BatchNormConfig,
        move_running: bool,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                let affine = k::norm::Affine {
                    gamma: self.pf32(io.gamma)?,
                    beta: self.pf32(io.beta)?,
                };
                let saved = k::norm::BatchNormSaved {
                    x_hat: self.w::<T>(io.x_hat)?,
                    mean: self.w::<f32>(io.mean)?,
                    inv_std: self.w::<f32>(io.inv_std)?,
                };
                // Recomputation must not move the running statistics a second time.
                let running = if move_running {
                    Some(k::norm::RunningStats {
                        mean: self.pf32_mut(io.running_mean)?,
                        var: self.pf32_mut(io.running_var)?,
                    })
                } else {
                    None
                };
                if self.same(io.x, io.y) {
                    k::norm::batch_norm_train_forward_inplace::<T>(
                        d,
                        cfg,
                        self.w::<T>(io.y)?,
                        affine,
                        saved,
                        running,
                    )?
                } else {
                    k::norm::batch_norm_train_forward::<T>(
                        d,
                        cfg,
                        self.r::<T>(io.x)?,
                        affine,
                        self.w::<T>(io.y)?,
                        saved,
                        running,
                    )?
                }
            })
        }
        Ok(())
    }

    fn batch_norm_inference(
        &self,
        io: &BatchNormInferenceForward,
        d: k::norm::NormDims,
        epsilon: f32,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                let affine = k::norm::Affine {
                    gamma: self.pf32(io.gamma)?,
                    beta: self.pf32(io.beta)?,
                };
                let (rm, rv) = (self.pf32(io.running_mean)?, self.pf32(io.running_var)?);
                if self.same(io.x, io.y) {
                    k::norm::batch_norm_infer_forward_inplace::<T>(
                        d,
                        epsilon,
                        self.w::<T>(io.y)?,
                        affine,
                        rm,
                        rv,
                    )?
                } else {
                    k::norm::batch_norm_infer_forward::<T>(
                        d,
                        epsilon,
                        self.r::<T>(io.x)?,
                        affine,
                        rm,
                        rv,
                        self.w::<T>(io.y)?,
                    )?
                }
            })
        }
        Ok(())
    }

    fn layer_norm(&self, io: &LayerNormForward, d: k::norm::NormDims, epsilon: f32) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                let affine = k::norm::Affine {
                    gamma: self.pf32(io.gamma)?,
                    beta: self.pf32(io.beta)?,
                };
                k::norm::layer_norm_forward::<T>(
                    d,
                    epsilon,
                    self.r::<T>(io.x)?,
                    affine,
                    self.w::<T>(io.y)?,
                    self.w::<T>(io.x_hat)?,
                    self.w::<f32>(io.rstd)?,
                )?
            })
        }
        Ok(())
    }

    fn group_norm(
        &self,
        io: &GroupNormForward,
        d: k::norm::GroupNormDims,
        epsilon: f32,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::norm::group_norm_forward::<T>(
                    d,
                    epsilon,
                    self.r::<T>(io.x)?,
                    self.pf32(io.gamma)?,
                    self.pf32_opt(io.beta)?,
                    self.w::<T>(io.y)?,
                    self.w::<T>(io.x_hat)?,
                    self.w::<f32>(io.rstd)?,
                )?
            })
        }
        Ok(())
    }

    fn positional_embedding(
        &self,
        io: &PositionalEmbeddingForward,
        batch: usize,
        len: usize,
    ) -> OpResult {
        unsafe {
            let table = self.pf32(io.table)?;
            with_float!(self.dtype(io.y), T, {
                if self.same(io.x, io.y) {
                    k::embedding::positional_embedding_forward_inplace::<T>(
                        batch,
                        len,
                        self.w::<T>(io.y)?,
                        table,
                    )?
                } else {
                    k::embedding::positional_embedding_forward::<T>(
                        batch,
                        len,
                        self.r::<T>(io.x)?,
                        table,
                        self.w::<T>(io.y)?,
                    )?
                }
            })
        }
        Ok(())
    }

    fn dropout(&self, io: &DropoutForward, rate: f32, key: k::random::RngKey) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                if self.same(io.x, io.y) {
                    k::random::dropout_forward_inplace::<T>(
                        key,
                        rate,
                        self.w::<T>(io.y)?,
                        self.w::<u8>(io.mask)?,
                    )?
                } else {
                    k::random::dropout_forward::<T>(
                        key,
                        rate,
                        self.r::<T>(io.x)?,
                        self.w::<T>(io.y)?,
                        self.w::<u8>(io.mask)?,
                    )?
                }
            })
        }
        Ok(())
    }

    fn activation(&self, io: &UnaryForward, act: Act, rows: usize, cols: usize) -> OpResult {
        unsafe {
            match act {
                Act::Softmax if self.same(io.x, io.y) => with_float!(self.dtype(io.y), T, {
                    k::activation::softmax_inplace::<T>(self.w::<T>(io.y)?, rows, cols)?
                }),
                Act::Softmax => float2!(self.dtype(io.x), I, self.dtype(io.y), O, {
                    k::activation::softmax_forward::<I, O>(
                        self.r::<I>(io.x)?,
                        self.w::<O>(io.y)?,
                        rows,
                        cols,
                    )?
                }),
                // Every other activation runs by name (`pointwise`, whose test proves each
                // has a kernel), so a new one needs no arm here.
                _ => {
                    let a = pointwise(act)?;
                    with_float!(self.dtype(io.y), T, {
                        if self.same(io.x, io.y) {
                            a.forward_inplace::<T>(self.w::<T>(io.y)?)
                        } else {
                            a.forward::<T>(self.r::<T>(io.x)?, self.w::<T>(io.y)?)?
                        }
                    })
                }
            }
        }
        Ok(())
    }

    fn add(&self, io: &AddForward) -> OpResult {
        let xs = &io.xs;
        if xs.len() > 8 {
            return Err(OpError::Runtime(RuntimeError::Memory(
                "add of more than 8 inputs".into(),
            )));
        }
        unsafe {
            with_float!(self.dtype(io.y), T, {
                // The summands' views live on the stack: at most 8.
                let mut others: [&[T]; 8] = [&[]; 8];
                let n = xs.len();
                if self.same(xs[0], io.y) {
                    for (j, &t) in xs[1..].iter().enumerate() {
                        others[j] = self.r::<T>(t)?;
                    }
                    k::elementwise::add_n_inplace::<T>(self.w::<T>(io.y)?, &others[..n - 1])?
                } else {
                    for (j, &t) in xs.iter().enumerate() {
                        others[j] = self.r::<T>(t)?;
                    }
                    k::elementwise::add_n::<T>(&others[..n], self.w::<T>(io.y)?)?
                }
            })
        }
        Ok(())
    }

    fn concat(&self, io: &ConcatForward, rows: usize, a: usize, b: usize) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::elementwise::concat_last::<T>(
                    &[self.r::<T>(io.a)?, self.r::<T>(io.b)?],
                    &[a, b],
                    rows,
                    self.w::<T>(io.y)?,
                )?
            })
        }
        Ok(())
    }

    fn embedding(&self, io: &EmbeddingForward, d: k::embedding::EmbeddingDims) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.y), T, {
                k::embedding::embedding_forward::<f32, T>(
                    d,
                    self.r::<i32>(io.ids)?,
                    self.pf32(io.table)?,
                    self.w::<T>(io.y)?,
                )?
            })
        }
        Ok(())
    }

    fn attention(
        &self,
        io: &AttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let scale = d.scale();
        let rows = d.batch * d.heads * d.seq;
        unsafe {
            with_float!(self.dtype(io.probs), T, {
                let qkv = self.r::<T>(io.qkv)?;
                let sc = self.ws::<f32>(io.scratch)?;
                {
                    let probs = self.w::<T>(io.probs)?;
                    k::attention::scores_forward::<T>(d, qkv, probs, scale, causal, sc)?;
                    k::activation::softmax_inplace::<T>(probs, rows, d.seq)?;
                }
                let probs = self.r::<T>(io.probs)?;
                if dropout > 0.0 {
                    k::random::dropout_forward::<T>(
                        key,
                        dropout,
                        probs,
                        self.w::<T>(io.probs_dropped)?,
                        self.w::<u8>(io.mask)?,
                    )?;
                    let dropped = self.r::<T>(io.probs_dropped)?;
                    k::attention::context_forward::<T>(d, dropped, qkv, self.w::<T>(io.ctx)?, sc)?
                } else {
                    k::attention::context_forward::<T>(d, probs, qkv, self.w::<T>(io.ctx)?, sc)?
                }
            })
        }
        Ok(())
    }

    fn flash_attention(
        &self,
        io: &FlashAttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let scale = d.scale();
        let dropout =
            (dropout > 0.0).then_some(k::flash_attention::FlashDropout { key, rate: dropout });
        unsafe {
            with_float!(self.dtype(io.ctx), T, {
                k::flash_attention::flash_attention_forward::<T>(
                    d,
                    self.r::<T>(io.qkv)?,
                    self.w::<T>(io.ctx)?,
                    self.w::<f32>(io.lse)?,
                    scale,
                    causal,
                    dropout,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn sample_normal(&self, io: &SampleNormalForward, key: k::random::RngKey) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.z), T, {
                k::random::sample_normal_forward::<T>(
                    key,
                    self.r::<T>(io.mean)?,
                    self.r::<T>(io.log_var)?,
                    self.w::<T>(io.z)?,
                )?
            })
        }
        Ok(())
    }

    // ---- backward ----

    fn cast_backward(&self, io: &UnaryBackward) -> OpResult {
        unsafe {
            float2!(self.dtype(io.dx), S, self.dtype(io.dy), D, {
                k::elementwise::cast_backward::<S, D>(self.r::<D>(io.dy)?, self.w::<S>(io.dx)?)?
            })
        }
        Ok(())
    }

    fn dense_backward(&self, io: &LinearBackward, d: k::dense::DenseDims) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::dense::dense_backward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.r::<T>(io.dy)?,
                    self.wo::<T>(io.dx)?,
                    self.grad_mut(io.weight)?,
                    self.grad_opt(io.bias)?,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::Conv2dDims,
        chunk: usize,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::conv::conv2d_backward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.r::<T>(io.dy)?,
                    self.wo::<T>(io.dx)?,
                    self.grad_mut(io.weight)?,
                    self.grad_opt(io.bias)?,
                    self.ws::<T>(io.ws)?,
                    chunk,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn depthwise_conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::DepthwiseConv2dDims,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                // The step's scratch (the GPU's split partial sums) holds the CPU's row parts.
                k::conv::depthwise_conv2d_backward_ws::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.r::<T>(io.dy)?,
                    self.wo::<T>(io.dx)?,
                    self.grad_mut(io.weight)?,
                    self.grad_opt(io.bias)?,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn conv2d_transpose_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::conv::conv2d_transpose_backward::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.weight::<T>(io.weight)?,
                    self.r::<T>(io.dy)?,
                    self.wo::<T>(io.dx)?,
                    self.grad_mut(io.weight)?,
                    self.grad_opt(io.bias)?,
                    self.ws::<T>(io.ws)?,
                    chunk,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn max_pool2d_backward(&self, io: &SavedBackward, d: &k::pool::Pool2d) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::pool::max_pool2d_backward::<T>(
                    d,
                    self.r::<u8>(io.saved)?,
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                )?
            })
        }
        Ok(())
    }

    fn avg_pool2d_backward(&self, io: &UnaryBackward, d: &k::pool::Pool2d) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::pool::avg_pool2d_backward::<T>(d, self.r::<T>(io.dy)?, self.w::<T>(io.dx)?)?
            })
        }
        Ok(())
    }

    fn global_avg_pool_backward(
        &self,
        io: &UnaryBackward,
        n: usize,
        hw: usize,
        c: usize,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::pool::global_avg_pool_backward::<T>(
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                    n,
                    hw,
                    c,
                )?
            })
        }
        Ok(())
    }

    fn batch_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult {
        self.norm_backward(io, d, false)
    }

    fn layer_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult {
        self.norm_backward(io, d, true)
    }

    fn batch_norm_backward_rebuild(
        &self,
        io: &BatchNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.x), T, {
                let grads = self.affine_grads(io.gamma, io.beta)?;
                k::norm::batch_norm_backward_rebuild::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.r::<f32>(io.mean)?,
                    self.r::<f32>(io.inv_std)?,
                    self.pf32(io.gamma)?,
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                    grads,
                )?
            })
        }
        Ok(())
    }

    fn layer_norm_backward_rebuild(
        &self,
        io: &LayerNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.x), T, {
                let grads = self.affine_grads(io.gamma, io.beta)?;
                k::norm::layer_norm_backward_rebuild::<T>(
                    d,
                    self.r::<T>(io.x)?,
                    self.r::<f32>(io.rstd)?,
                    self.pf32(io.gamma)?,
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                    self.ws::<f32>(io.scratch)?,
                    grads,
                )?
            })
        }
        Ok(())
    }

    fn group_norm_backward(&self, io: &GroupNormBackward, d: k::norm::GroupNormDims) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.x_hat), T, {
                // RMS norm has no shift, hence no shift gradient.
                let dbeta = match io.beta {
                    NONE => None,
                    beta => Some(self.grad_mut(beta)?),
                };
                k::norm::group_norm_backward::<T>(
                    d,
                    self.r::<T>(io.x_hat)?,
                    self.r::<f32>(io.rstd)?,
                    self.pf32(io.gamma)?,
                    self.r::<T>(io.dy)?,
                    self.w::<T>(io.dx)?,
                    self.grad_mut(io.gamma)?,
                    dbeta,
                )?
            })
        }
        Ok(())
    }

    fn positional_embedding_backward(
        &self,
        io: &PositionalEmbeddingBackward,
        batch: usize,
        len: usize,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                let dy = self.r::<T>(io.dy)?;
                k::embedding::positional_embedding_backward::<T>(
                    batch,
                    len,
                    dy,
                    self.grad_mut(io.table)?,
                )?;
                // dx = dy: nothing to move when the plan put one over the other.
                if io.dx != NONE && !self.same(io.dy, io.dx) {
                    k::elementwise::cast::<T, T>(dy, self.w::<T>(io.dx)?)?
                }
            })
        }
        Ok(())
    }

    fn dropout_backward(&self, io: &SavedBackward, rate: f32) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                if self.same(io.dy, io.dx) {
                    k::random::dropout_backward_inplace::<T>(
                        rate,
                        self.r::<u8>(io.saved)?,
                        self.w::<T>(io.dx)?,
                    )?
                } else {
                    k::random::dropout_backward::<T>(
                        rate,
                        self.r::<u8>(io.saved)?,
                        self.r::<T>(io.dy)?,
                        self.w::<T>(io.dx)?,
                    )?
                }
            })
        }
        Ok(())
    }

    fn activation_backward(
        &self,
        io: &SavedBackward,
        act: Act,
        rows: usize,
        cols: usize,
    ) -> OpResult {
        let (saved, dy, dx) = (io.saved, io.dy, io.dx);
        unsafe {
            match act {
                Act::Softmax if self.same(dy, dx) => {
                    float2!(self.dtype(saved), Y, self.dtype(dy), G, {
                        k::activation::softmax_backward_inplace::<Y, G>(
                            self.r::<Y>(saved)?,
                            self.w::<G>(dx)?,
                            rows,
                            cols,
                        )?
                    })
                }
                Act::Softmax => float2!(self.dtype(saved), Y, self.dtype(dy), G, {
                    with_float!(self.dtype(dx), D, {
                        k::activation::softmax_backward::<Y, G, D>(
                            self.r::<Y>(saved)?,
                            self.r::<G>(dy)?,
                            self.w::<D>(dx)?,
                            rows,
                            cols,
                        )?
                    })
                }),
                // Every other activation runs by name (`pointwise`, whose test proves each
                // has a kernel), so a new one needs no arm here.
                _ => {
                    let a = pointwise(act)?;
                    with_float!(self.dtype(dy), T, {
                        if self.same(dy, dx) {
                            a.backward_inplace::<T>(self.r::<T>(saved)?, self.w::<T>(dx)?)?
                        } else {
                            a.backward::<T>(
                                self.r::<T>(saved)?,
                                self.r::<T>(dy)?,
                                self.w::<T>(dx)?,
                            )?
                        }
                    })
                }
            }
        }
        Ok(())
    }

    fn concat_backward(&self, io: &ConcatBackward, rows: usize, a: usize, b: usize) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                // A part that takes no gradient still needs somewhere to go: the planner
                // always schedules both (see autodiff).
                k::elementwise::concat_last_backward::<T>(
                    self.r::<T>(io.dy)?,
                    &[a, b],
                    rows,
                    &mut [self.w::<T>(io.da)?, self.w::<T>(io.db)?],
                )?
            })
        }
        Ok(())
    }

    fn embedding_backward(
        &self,
        io: &EmbeddingBackward,
        d: k::embedding::EmbeddingDims,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.dy), T, {
                k::embedding::embedding_backward::<T>(
                    d,
                    self.r::<i32>(io.ids)?,
                    self.r::<T>(io.dy)?,
                    self.grad_mut(io.table)?,
                )?
            })
        }
        Ok(())
    }

    fn attention_backward(
        &self,
        io: &AttentionBackward,
        d: k::attention::AttentionDims,
        dropout: f32,
    ) -> OpResult {
        let scale = d.scale();
        let rows = d.batch * d.heads * d.seq;
        unsafe {
            with_float!(self.dtype(io.qkv), T, {
                let qkv = self.r::<T>(io.qkv)?;
                let probs = self.r::<T>(io.probs)?;
                let used = if dropout > 0.0 {
                    self.r::<T>(io.probs_dropped)?
                } else {
                    probs
                };
                let dctx = self.r::<T>(io.dctx)?;
                let dqkv = self.w::<T>(io.dqkv)?;
                let dp = self.w::<T>(io.ws)?;
                let sc = self.ws::<f32>(io.scratch)?;
                k::attention::context_backward::<T>(d, dctx, used, qkv, dp, dqkv, sc)?;
                if dropout > 0.0 {
                    k::random::dropout_backward_inplace::<T>(dropout, self.r::<u8>(io.mask)?, dp)?;
                }
                k::activation::softmax_backward_inplace::<T, T>(probs, dp, rows, d.seq)?;
                k::attention::scores_backward::<T>(d, dp, qkv, dqkv, scale, sc)?
            })
        }
        Ok(())
    }

    fn flash_attention_backward(
        &self,
        io: &FlashAttentionBackward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult {
        let scale = d.scale();
        let dropout =
            (dropout > 0.0).then_some(k::flash_attention::FlashDropout { key, rate: dropout });
        unsafe {
            with_float!(self.dtype(io.qkv), T, {
                k::flash_attention::flash_attention_backward::<T>(
                    d,
                    self.r::<T>(io.qkv)?,
                    self.r::<T>(io.ctx)?,
                    self.r::<f32>(io.lse)?,
                    self.r::<T>(io.dctx)?,
                    self.w::<T>(io.dqkv)?,
                    scale,
                    causal,
                    dropout,
                    self.ws::<f32>(io.scratch)?,
                )?
            })
        }
        Ok(())
    }

    fn sample_normal_backward(
        &self,
        io: &SampleNormalBackward,
        key: k::random::RngKey,
    ) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.log_var), T, {
                k::random::sample_normal_backward::<T>(
                    key,
                    self.r::<T>(io.log_var)?,
                    self.r::<T>(io.dz)?,
                    self.w::<T>(io.dmean)?,
                    self.w::<T>(io.dlog_var)?,
                    k::elementwise::GradWrite::Overwrite,
                )?
            })
        }
        Ok(())
    }

    fn accumulate(&self, io: &AccumulateIo) -> OpResult {
        unsafe {
            with_float!(self.dtype(io.g), T, {
                if self.same(io.a, io.g) {
                    k::elementwise::accumulate::<T, T>(self.w::<T>(io.g)?, self.r::<T>(io.b)?)?
                } else if self.same(io.b, io.g) {
                    k::elementwise::accumulate::<T, T>(self.w::<T>(io.g)?, self.r::<T>(io.a)?)?
                } else {
                    let g = self.w::<T>(io.g)?;
                    g.copy_from_slice(self.r::<T>(io.a)?);
                    k::elementwise::accumulate::<T, T>(g, self.r::<T>(io.b)?)?
                }
            })
        }
        Ok(())
    }

    // ---- losses ----

    fn sparse_categorical_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        classes: usize,
        weight: f32,
        from_logits: bool,
    ) -> OpResult {
        let op = "sparse_categorical_crossentropy";
        let grad = self.loss_grad(io.grad, op)?;
        let scale = self.scalars.get().loss_scale;
        let labels = unsafe { self.r::<i32>(io.target)? };
        // The probabilities: the fused softmax's output, or computed here from the logits.
        let (probs_id, probs_f32) = if from_logits {
            let probs = unsafe { self.w::<f32>(io.ws)? };
            unsafe {
                with_float!(self.dtype(io.prediction), P, {
                    k::activation::softmax_forward::<P, f32>(
                        self.r::<P>(io.prediction)?,
                        probs,
                        rows,
                        classes,
                    )?
                })
            }
            (io.ws, true)
        } else {
            (io.prediction, false)
        };
        let r = unsafe {
            match grad {
                None if probs_f32 => k::loss::sparse_categorical_crossentropy_eval::<f32>(
                    self.r::<f32>(probs_id)?,
                    labels,
                    rows,
                    classes,
                )?,
                None => with_float!(self.dtype(probs_id), P, {
                    k::loss::sparse_categorical_crossentropy_eval::<P>(
                        self.r::<P>(probs_id)?,
                        labels,
                        rows,
                        classes,
                    )?
                }),
                Some(g) if probs_f32 => with_float!(self.dtype(g), G, {
                    k::loss::sparse_categorical_crossentropy::<f32, G>(
                        self.r::<f32>(probs_id)?,
                        labels,
                        rows,
                        classes,
                        weight * scale,
                        self.w::<G>(g)?,
                    )?
                }),
                Some(g) => float2!(self.dtype(probs_id), P, self.dtype(g), G, {
                    k::loss::sparse_categorical_crossentropy::<P, G>(
                        self.r::<P>(probs_id)?,
                        labels,
                        rows,
                        classes,
                        weight * scale,
                        self.w::<G>(g)?,
                    )?
                }),
            }
        };
        self.loss_value(io.value, weight * r.loss, r.correct)
    }

    fn binary_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        red: Reduction,
        weight: f32,
        input: BceInput,
    ) -> OpResult {
        let grad = self.loss_grad(io.grad, "binary_crossentropy")?;
        let scale = self.scalars.get().loss_scale;
        let (p, t) = (io.prediction, io.target);
        let value = unsafe {
            float2!(self.dtype(p), P, self.dtype(t), Y, {
                let (pv, tv) = (self.r::<P>(p)?, self.r::<Y>(t)?);
                let red = reduction(red);
                match (grad, input) {
                    (None, BceInput::Logits) => k::loss::binary_crossentropy_from_logits_eval::<
                        P,
                        Y,
                    >(pv, tv, rows, features, red)?,
                    (None, BceInput::FusedSigmoid | BceInput::Probabilities) => {
                        k::loss::binary_crossentropy_eval::<P, Y>(pv, tv, rows, features, red)?
                    }
                    (Some(g), input) => with_float!(self.dtype(g), G, {
                        let gv = self.w::<G>(g)?;
                        let s = weight * scale;
                        match input {
                            BceInput::FusedSigmoid => {
                                k::loss::binary_crossentropy_with_sigmoid::<P, Y, G>(
                                    pv, tv, rows, features, red, s, gv,
                                )?
                            }
                            BceInput::Logits => {
                                k::loss::binary_crossentropy_from_logits::<P, Y, G>(
                                    pv, tv, rows, features, red, s, gv,
                                )?
                            }
                            BceInput::Probabilities => k::loss::binary_crossentropy::<P, Y, G>(
                                pv, tv, rows, features, red, s, gv,
                            )?,
                        }
                    }),
                }
            })
        };
        self.loss_value(io.value, weight * value, 0)
    }

    fn mean_squared_error(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        red: Reduction,
        weight: f32,
    ) -> OpResult {
        let grad = self.loss_grad(io.grad, "mse")?;
        let scale = self.scalars.get().loss_scale;
        let (p, t) = (io.prediction, io.target);
        let value = unsafe {
            float2!(self.dtype(p), P, self.dtype(t), Y, {
                let (pv, tv) = (self.r::<P>(p)?, self.r::<Y>(t)?);
                match grad {
                    None => k::loss::mean_squared_error_eval::<P, Y>(
                        pv,
                        tv,
                        rows,
                        features,
                        reduction(red),
                    )?,
                    Some(g) => with_float!(self.dtype(g), G, {
                        k::loss::mean_squared_error::<P, Y, G>(
                            pv,
                            tv,
                            rows,
                            features,
                            reduction(red),
                            weight * scale,
                            self.w::<G>(g)?,
                        )?
                    }),
                }
            })
        };
        self.loss_value(io.value, weight * value, 0)
    }

    fn kl_normal(&self, io: &KlIo, rows: usize, features: usize, weight: f32) -> OpResult {
        let scale = self.scalars.get().loss_scale;
        let value = unsafe {
            with_float!(self.dtype(io.mean), T, {
                let (m, lv) = (self.r::<T>(io.mean)?, self.r::<T>(io.log_var)?);
                match self.loss_grad(io.dmean, "kl_normal")? {
                    None => {
                        k::loss::kl_divergence_standard_normal_eval::<T>(m, lv, rows, features)?
                    }
                    Some(gm) => {
                        let gl = io.dlog_var;
                        self.loss_grad(gl, "kl_normal")?;
                        with_float!(self.dtype(gm), G, {
                            k::loss::kl_divergence_standard_normal::<T, G>(
                                m,
                                lv,
                                rows,
                                features,
                                weight * scale,
                                self.w::<G>(gm)?,
                                self.w::<G>(gl)?,
                            )?
                        })
                    }
                }
            })
        };
        self.loss_value(io.value, weight * value, 0)
    }

    // ---- update ----

    fn check_finite(&self) -> OpResult {
        if !self.grads_finite()? {
            self.nonfinite.set(true);
        }
        Ok(())
    }

    fn all_reduce_gradients(&self, params: &[u32], last: bool, c: &dyn Collective) -> OpResult {
        // The plan lays a bucket's gradients out contiguously, each padded to the alignment
        // (zeros, summed to zeros): one sum of the persistent region itself per bucket.
        for (start, end) in gradient_ranges(&self.plan, params) {
            // SAFETY: no other view of the gradients is live between steps.
            let grads = unsafe {
                self.persistent
                    .view_mut::<f32>(start, ((end - start) / 4) as usize)?
            };
            c.all_reduce_sum_f32(grads).map_err(OpError::Runtime)?;
        }
        if last {
            let mut flag = [self.nonfinite.get() as u8 as f64];
            c.all_reduce_sum_f64(&mut flag).map_err(OpError::Runtime)?;
            self.nonfinite.set(flag[0] > 0.0);
        }
        Ok(())
    }

    fn send_tensor(&self, io: &SendIo, to: usize, c: &dyn Collective) -> OpResult {
        let t = self.plan.tensor(io.x);
        // SAFETY: a shared view; the step that wrote the tensor has returned.
        let bytes = unsafe {
            self.arena
                .view::<u8>(t.offset, t.elems() * t.dtype.size() as usize)?
        };
        c.send(to, bytes).map_err(OpError::Runtime)
    }

    fn transfer_run(&self, _begin: bool, _c: &dyn Collective) -> OpResult {
        // Each transfer is a call of its own: a send is buffered or waits for a receive
        // that the other stage's order posts first (`Collective::reserve_sends`).
        Ok(())
    }

    fn recv_tensor(&self, io: &RecvIo, from: usize, c: &dyn Collective) -> OpResult {
        let t = self.plan.tensor(io.x);
        // SAFETY: the receive is the tensor's writer; no other view of its bytes is live.
        let bytes = unsafe {
            self.arena
                .view_mut::<u8>(t.offset, t.elems() * t.dtype.size() as usize)?
        };
        c.recv(from, bytes).map_err(OpError::Runtime)
    }

    fn update(&self, _step: &PlanStep, u: UpdateStep<'_>) -> OpResult {
        if self.nonfinite.get() {
            return Ok(()); // the step is skipped: the weights stay as they were
        }
        let sc = self.scalars.get();
        let slots = u.optimizer.state_slots() as usize;
        for &pid in u.params {
            let p = &self.plan.params[pid as usize];
            // Under ZeRO stage 1 this replica's shard; its state holds just that.
            let shard = self.plan.shard(p, u.rank);
            let n = shard.len();
            let stride = align_up(self.plan.state_elems(p) as u64 * 4, self.plan.alignment);
            let stride = (stride / 4) as usize;
            unsafe {
                let vals = self.persistent.view_mut::<f32>(p.offset, p.elems())?;
                let grads = self.persistent.view::<f32>(p.grad_offset, p.elems())?;
                let mut states: [&mut [f32]; 3] = [&mut [], &mut [], &mut []];
                if slots > 0 {
                    let all = self
                        .persistent
                        .view_mut::<f32>(p.state_offset, stride * slots)?;
                    for (slot, chunk) in states.iter_mut().zip(all.chunks_mut(stride)) {
                        *slot = &mut chunk[..n];
                    }
                }
                self.opt.update(
                    sc.update,
                    &mut vals[shard.clone()],
                    &grads[shard.clone()],
                    &mut states[..slots],
                    sc.grad_unscale,
                )?;
            }
            if p.half_copy.is_some() {
                refresh_one(self, pid as usize, shard)?;
            }
        }
        Ok(())
    }

    fn all_gather_params(&self, params: &[u32], c: &dyn Collective) -> OpResult {
        if self.nonfinite.get() {
            return Ok(()); // no replica updated: every one holds the same weights still
        }
        for &pid in params {
            let p = &self.plan.params[pid as usize];
            // SAFETY: no other view of the parameters is live between steps.
            let values = unsafe { self.persistent.view_mut::<u8>(p.offset, p.elems() * 4)? };
            c.all_gather_shards(values, 4).map_err(OpError::Runtime)?;
            if p.half_copy.is_some() {
                refresh_one(self, pid as usize, 0..p.elems())?;
            }
        }
        Ok(())
    }
}

/// Refreshes elements `range` of parameter `pid`'s 16-bit copy from its f32 values (after
/// an update).
fn refresh_one(k: &CpuKernels, pid: usize, range: std::ops::Range<usize>) -> OpResult {
    let p = &k.plan.params[pid];
    let (at, n) = (range.start as u64, range.len());
    unsafe {
        let src = k.persistent.view::<f32>(p.offset + 4 * at, n)?;
        match p.half_copy {
            Some(DType::F16) => k::elementwise::cast(
                src,
                k.persistent.view_mut::<f16>(p.half_offset + 2 * at, n)?,
            )?,
            Some(DType::BF16) => k::elementwise::cast(
                src,
                k.persistent.view_mut::<bf16>(p.half_offset + 2 * at, n)?,
            )?,
            _ => {}
        }
    }
    Ok(())
}
