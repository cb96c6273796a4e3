//! `Kernels`: what the one walk of a plan ([`crate::walk::PlanExecutor`]) asks of a device —
//! its memory (the arena, the persistent region, the step's scalars) and one typed method per
//! op and phase. The CPU ([`crate::cpu::CpuKernels`]) and CUDA (`crate::cuda::CudaKernels`)
//! implement it; a new op is one method here and one in each, and the walk's exhaustive match
//! makes an op without a kernel a compile error.
//!
//! Every op method reads and writes the tensors its [`memwise_plan::io`] struct names, at their
//! planned places. Losses write their weighted value into the plan's loss tensor; the step's
//! flags (a non-finite gradient or loss, correct predictions, a label out of range) live in
//! the kernels' [`StepScalars`]/[`StepFlags`], on the device where there is one, so that a
//! whole step can run (or be replayed as a CUDA graph) without the host deciding mid-step.

use memwise_kernels as k;
use memwise_plan::io::*;
use memwise_plan::{Activation, Optimizer, PlanStep, Reduction, StaticPlan};

use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use crate::executor::Batch;

/// Errors inside an op: a kernel's (the walk adds the step) or the runtime's.
#[derive(Debug)]
pub enum OpError {
    Kernel(k::KernelError),
    Runtime(RuntimeError),
}

impl From<k::KernelError> for OpError {
    fn from(e: k::KernelError) -> Self {
        OpError::Kernel(e)
    }
}

impl From<RuntimeError> for OpError {
    fn from(e: RuntimeError) -> Self {
        OpError::Runtime(e)
    }
}

/// What an op method returns.
pub type OpResult = std::result::Result<(), OpError>;

/// The kernels' pointwise activation that runs `act`: the one of the same name, with `act`'s
/// parameter. Matched by name, so a new activation needs no arm in either executor. Softmax
/// (rows, not elements) has kernels of its own and is not one.
pub fn pointwise(act: Activation) -> std::result::Result<k::activation::Activation, OpError> {
    let param = act.param().map_or(0.0, |(_, v)| v);
    k::activation::Activation::from_name(act.name(), param).ok_or_else(|| {
        OpError::Kernel(k::KernelError(format!(
            "no pointwise kernel runs the activation `{}`",
            act.name()
        )))
    })
}

/// The per-step scalars every kernel may read, set by the walk before a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// Training steps run before this one (keys the dropout and sampling streams).
    pub step: u64,
    /// The dynamic loss scale the loss gradients are multiplied by (1 without scaling).
    pub loss_scale: f32,
    /// `1 / loss_scale`, applied by the optimizer to the gradients.
    pub grad_unscale: f32,
    /// Optimizer updates applied so far, plus one: Adam's bias-correction step.
    pub update: u64,
}

/// What a step left in the kernels' flags, read back by the walk after it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepFlags {
    /// Sum of the weighted loss terms.
    pub loss: f32,
    /// Predictions whose arg-max matched the label.
    pub correct: usize,
    /// A gradient (with loss scaling) or the loss (without) was not finite: the optimizer
    /// skipped its updates.
    pub nonfinite: bool,
    /// `Some(i)`: element `i` of a label or id input was out of range (found on a device,
    /// which cannot return an error mid-step).
    pub bad_index: Option<usize>,
}

/// Which form of binary cross-entropy a loss step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BceInput {
    /// Probabilities of a sigmoid fused into the loss: the gradient is of its input.
    FusedSigmoid,
    /// Logits of a linear output, the sigmoid fused stably.
    Logits,
    /// Probabilities read as they are.
    Probabilities,
}

/// One optimizer update of a layer's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateStep<'a> {
    pub optimizer: Optimizer,
    pub params: &'a [u32],
    /// This replica's index: under ZeRO stage 1 it updates its shard of each parameter
    /// ([`StaticPlan::shard`](memwise_plan::StaticPlan::shard)), else all of it.
    pub rank: usize,
}

/// The byte ranges of the persistent region that hold the gradients of `params`, neighbours
/// merged (each gradient with its padding to the alignment): one range per bucket of a
/// data-parallel plan, whose gradients the planner lays out contiguously.
pub(crate) fn gradient_ranges(plan: &StaticPlan, params: &[u32]) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &pid in params {
        let p = &plan.params[pid as usize];
        let end =
            p.grad_offset + memwise_plan::liveness::align_up(p.elems() as u64 * 4, plan.alignment);
        match ranges.last_mut() {
            Some(r) if r.1 == p.grad_offset => r.1 = end,
            _ => ranges.push((p.grad_offset, end)),
        }
    }
    ranges
}

/// Turns on a device lane shared by several engines (a trainer's training and inference
/// engines share one CUDA stream and cuBLAS handle: each handle costs about 100 MiB of device
/// memory). An engine holds the turn for a whole step, so no other engine's launches land
/// in the middle of its step or inside its captured graph, whatever thread drives it.
#[derive(Default)]
pub struct DeviceTurn {
    busy: std::sync::Mutex<bool>,
    free: std::sync::Condvar,
}

impl DeviceTurn {
    /// Waits until no other engine holds the turn, then holds it until the `TurnHold` drops.
    pub fn take(self: &std::sync::Arc<Self>) -> TurnHold {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while *busy {
            busy = self.free.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy = true;
        TurnHold(Some(self.clone()))
    }
}

/// A held [`DeviceTurn`] (or none, where the device is not shared); released on drop, on
/// every path out of a step, errors and panics included.
pub struct TurnHold(Option<std::sync::Arc<DeviceTurn>>);

impl TurnHold {
    /// Nothing held: a device no other engine uses.
    pub fn none() -> TurnHold {
        TurnHold(None)
    }
}

impl Drop for TurnHold {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            *t.busy.lock().unwrap_or_else(|p| p.into_inner()) = false;
            t.free.notify_one();
        }
    }
}

/// A device's memory and one kernel per op and phase.
pub trait Kernels {
    /// The device's name (`cpu`, `cuda:0 (NVIDIA H200)`, `emulated` …).
    fn device_name(&self) -> String;
    /// The plan these kernels hold the memory of.
    fn plan(&self) -> &StaticPlan;
    /// Device memory in use minus what was in use before these kernels allocated; `None`
    /// on the CPU.
    fn device_bytes_used(&self) -> Option<u64>;
    /// Device memory taken for the device's stream and GEMM library (cuBLAS's handle and
    /// workspace) before the model's allocations, so not in `device_bytes_used`; `None` on
    /// the CPU.
    fn device_lane_bytes(&self) -> Option<u64> {
        None
    }
    /// Kernels of the same kind for another plan (an inference plan of the same model) on
    /// `device`, weights initialised from `seed`.
    fn another(&self, plan: StaticPlan, device: &crate::device::Device, seed: u64) -> Result<Self>
    where
        Self: Sized;

    // ---- a step's frame ----

    /// Exclusive use of the device for one step, where engines share it (see
    /// [`DeviceTurn`]); the walk holds it from the inputs' upload to the step's flags.
    fn take_turn(&self) -> TurnHold {
        TurnHold::none()
    }

    /// Copies checked inputs into their tensors.
    fn load_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()>;
    /// Before a step's kernels: sets the scalars, clears the flags, zeroes the gradients.
    fn begin_step(&mut self, scalars: &StepScalars) -> Result<()>;
    /// Runs `steps` (the walk's dispatch of every step), or replays what an earlier call
    /// recorded (CUDA graphs; the CPU always runs it).
    fn run_steps(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()>;
    /// After a step: its flags and loss.
    fn end_step(&mut self) -> Result<StepFlags>;
    /// Whether the running step has been flagged non-finite so far, where the device can
    /// tell mid-step (the CPU: then a float32 step stops at its loss, before any gradient is
    /// computed); `None` where it cannot (a GPU learns it when the step ends).
    fn flagged_now(&self) -> Option<bool>;
    /// Turns recording a step once and replaying it (CUDA graphs) on or off, where the
    /// device records steps; on by default.
    fn set_graphs(&mut self, on: bool);

    // ---- state ----

    /// The f32 values of parameter `pid` (or its gradient).
    fn read_param(&self, pid: u32, grad: bool) -> Result<Vec<f32>>;
    /// Overwrites parameter `pid`'s f32 values and its 16-bit copy.
    fn write_param(&mut self, pid: u32, values: &[f32]) -> Result<()>;
    /// Tensor `id` as f32 values (after a step).
    fn read_tensor(&self, id: u32, out: &mut [f32]) -> Result<()>;
    /// Whether every value of float tensor `id` is finite (integers always are).
    fn tensor_finite(&self, id: u32) -> Result<bool>;
    /// The whole persistent region's bytes (checkpoints, weights files).
    fn persistent_image(&self) -> Result<std::borrow::Cow<'_, [u8]>>;
    /// Lets `write` change the persistent region's bytes, then refreshes the 16-bit copies.
    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()>;
    /// Data parallel: these kernels run replica `rank`. The CUDA kernels rebuild their
    /// optimizer's chunk table for the replica's shards (ZeRO stage 1); the CPU's take the
    /// rank from each update step.
    fn set_replica(&mut self, rank: usize) -> Result<()>;
    /// Overwrites tensors `ids` with NaN (floats) or a fixed byte (integers), and the arena's
    /// `padding` ranges ([`memwise_plan::StaticPlan::arena_padding`]) with 0xFF bytes: the
    /// poisoned-arena tests' hook.
    fn poison(&self, ids: &[u32], padding: &[(u64, u64)]) -> Result<()>;

    // ---- forward ----

    fn input_cast(&self, io: &UnaryForward, scale: f32) -> OpResult;
    fn cast(&self, io: &UnaryForward) -> OpResult;
    fn dense(&self, io: &LinearForward, d: k::dense::DenseDims) -> OpResult;
    fn conv2d(&self, io: &LinearForward, d: k::conv::Conv2dDims, chunk: usize) -> OpResult;
    fn depthwise_conv2d(&self, io: &LinearForward, d: k::conv::DepthwiseConv2dDims) -> OpResult;
    fn conv2d_transpose(
        &self,
        io: &LinearForward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult;
    fn max_pool2d(&self, io: &MaxPoolForward, d: &k::pool::Pool2d) -> OpResult;
    fn avg_pool2d(&self, io: &UnaryForward, d: &k::pool::Pool2d) -> OpResult;
    fn global_avg_pool(&self, io: &UnaryForward, n: usize, hw: usize, c: usize) -> OpResult;
    /// Training-mode batch norm; `move_running` is false when recomputing (the running
    /// statistics move once per step).
    fn batch_norm(
        &self,
        io: &BatchNormForward,
        d: k::norm::NormDims,
        cfg: k::norm::BatchNormConfig,
        move_running: bool,
    ) -> OpResult;
    fn batch_norm_inference(
        &self,
        io: &BatchNormInferenceForward,
        d: k::norm::NormDims,
        epsilon: f32,
    ) -> OpResult;
    fn layer_norm(&self, io: &LayerNormForward, d: k::norm::NormDims, epsilon: f32) -> OpResult;
    /// Group norm, or RMS norm (`d.center` false and no `io.beta`).
    fn group_norm(
        &self,
        io: &GroupNormForward,
        d: k::norm::GroupNormDims,
        epsilon: f32,
    ) -> OpResult;
    fn dropout(&self, io: &DropoutForward, rate: f32, key: k::random::RngKey) -> OpResult;
    /// Element-wise activation, or softmax over rows of `cols`.
    fn activation(&self, io: &UnaryForward, act: Activation, rows: usize, cols: usize) -> OpResult;
    fn add(&self, io: &AddForward) -> OpResult;
    fn concat(&self, io: &ConcatForward, rows: usize, a: usize, b: usize) -> OpResult;
    fn embedding(&self, io: &EmbeddingForward, d: k::embedding::EmbeddingDims) -> OpResult;
    /// `y = x + table` per sample of `batch` samples of `len` elements; `y` may be `x`.
    fn positional_embedding(
        &self,
        io: &PositionalEmbeddingForward,
        batch: usize,
        len: usize,
    ) -> OpResult;
    fn attention(
        &self,
        io: &AttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult;
    /// Memory-efficient attention: `ctx` and one f32 log-sum-exp per query row
    /// (`kernels::flash_attention`'s contract).
    fn flash_attention(
        &self,
        io: &FlashAttentionForward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult;
    fn sample_normal(&self, io: &SampleNormalForward, key: k::random::RngKey) -> OpResult;

    // ---- backward ----

    fn cast_backward(&self, io: &UnaryBackward) -> OpResult;
    fn dense_backward(&self, io: &LinearBackward, d: k::dense::DenseDims) -> OpResult;
    fn conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::Conv2dDims,
        chunk: usize,
    ) -> OpResult;
    fn depthwise_conv2d_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::DepthwiseConv2dDims,
    ) -> OpResult;
    fn conv2d_transpose_backward(
        &self,
        io: &LinearBackward,
        d: k::conv::ConvTranspose2dDims,
        chunk: usize,
    ) -> OpResult;
    fn max_pool2d_backward(&self, io: &SavedBackward, d: &k::pool::Pool2d) -> OpResult;
    fn avg_pool2d_backward(&self, io: &UnaryBackward, d: &k::pool::Pool2d) -> OpResult;
    fn global_avg_pool_backward(
        &self,
        io: &UnaryBackward,
        n: usize,
        hw: usize,
        c: usize,
    ) -> OpResult;
    fn batch_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult;
    /// Batch-norm backward rebuilding x̂ from the input another op keeps.
    fn batch_norm_backward_rebuild(
        &self,
        io: &BatchNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult;
    fn layer_norm_backward(&self, io: &NormBackward, d: k::norm::NormDims) -> OpResult;
    /// Layer-norm backward rebuilding x̂ from the input another op keeps (the row means
    /// recomputed into the step's scratch).
    fn layer_norm_backward_rebuild(
        &self,
        io: &LayerNormRebuildBackward,
        d: k::norm::NormDims,
    ) -> OpResult;
    fn group_norm_backward(&self, io: &GroupNormBackward, d: k::norm::GroupNormDims) -> OpResult;
    fn dropout_backward(&self, io: &SavedBackward, rate: f32) -> OpResult;
    fn activation_backward(
        &self,
        io: &SavedBackward,
        act: Activation,
        rows: usize,
        cols: usize,
    ) -> OpResult;
    fn concat_backward(&self, io: &ConcatBackward, rows: usize, a: usize, b: usize) -> OpResult;
    fn embedding_backward(
        &self,
        io: &EmbeddingBackward,
        d: k::embedding::EmbeddingDims,
    ) -> OpResult;
    /// The table's gradient (accumulated) and `dx = dy`; `dx` may be `dy`.
    fn positional_embedding_backward(
        &self,
        io: &PositionalEmbeddingBackward,
        batch: usize,
        len: usize,
    ) -> OpResult;
    fn attention_backward(
        &self,
        io: &AttentionBackward,
        d: k::attention::AttentionDims,
        dropout: f32,
    ) -> OpResult;
    /// Recomputes the probabilities tile by tile (the dropout mask from `key`) and overwrites
    /// `dqkv`.
    fn flash_attention_backward(
        &self,
        io: &FlashAttentionBackward,
        d: k::attention::AttentionDims,
        causal: bool,
        dropout: f32,
        key: k::random::RngKey,
    ) -> OpResult;
    fn sample_normal_backward(&self, io: &SampleNormalBackward, key: k::random::RngKey)
        -> OpResult;
    fn accumulate(&self, io: &AccumulateIo) -> OpResult;

    // ---- losses (value into the loss tensor, gradient when training) ----

    /// Sparse categorical cross-entropy, the softmax fused (`from_logits`: computed here from
    /// the logits into the workspace; else the prediction is a fused softmax's output).
    fn sparse_categorical_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        classes: usize,
        weight: f32,
        from_logits: bool,
    ) -> OpResult;
    fn binary_crossentropy(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
        input: BceInput,
    ) -> OpResult;
    fn mean_squared_error(
        &self,
        io: &LossIo,
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    ) -> OpResult;
    /// KL divergence to N(0, 1); `weight` already divided by the features for a mean.
    fn kl_normal(&self, io: &KlIo, rows: usize, features: usize, weight: f32) -> OpResult;

    // ---- update ----

    /// With loss scaling: flags the step non-finite when a gradient is.
    fn check_finite(&self) -> OpResult;

    /// Data parallel: replaces parameters `params`' gradients by their sums over the
    /// replicas of `c`; with `last` (the step's final sum), flags the step non-finite on
    /// every replica when it is on any, so all keep or all update their weights.
    fn all_reduce_gradients(&self, params: &[u32], last: bool, c: &dyn Collective) -> OpResult;
    /// The optimizer update of one layer's parameters (skipped when the step is flagged
    /// non-finite) and their 16-bit copies.
    fn update(&self, step: &PlanStep, u: UpdateStep<'_>) -> OpResult;
    /// ZeRO stage 1, after [`Kernels::update`] of `params`: copies every replica's updated
    /// shard of them to the others, then refreshes their 16-bit copies (nothing when the
    /// step is flagged non-finite: no replica updated).
    fn all_gather_params(&self, params: &[u32], c: &dyn Collective) -> OpResult;
    /// Model parallel: sends the tensor's bytes to pipeline stage `to` (rank `to` of `c`),
    /// once the launches that write it have run.
    fn send_tensor(&self, io: &SendIo, to: usize, c: &dyn Collective) -> OpResult;
    /// Model parallel: writes the bytes pipeline stage `from` sends into the tensor.
    fn recv_tensor(&self, io: &RecvIo, from: usize, c: &dyn Collective) -> OpResult;
    /// Model parallel: a run of consecutive transfer steps begins (`begin`) or has ended.
    /// Where sends wait for their receiver on the device (NCCL), the run is one group, so
    /// that two stages' crossing sends do not wait on each other, and the later launches
    /// wait for what it received; the CPU's transfers are blocking calls and need nothing.
    fn transfer_run(&self, begin: bool, c: &dyn Collective) -> OpResult;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two threads stepping on one shared device take turns: a step never starts while
    /// another holds the turn, and a turn dropped on an error path (here a panic) frees it.
    #[test]
    fn engines_on_a_shared_device_take_turns_a_step_at_a_time() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let turn = Arc::new(DeviceTurn::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (turn, inside, most) = (turn.clone(), inside.clone(), most.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let _hold = turn.take();
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "two steps overlapped");
        let t2 = turn.clone();
        let failed = std::thread::spawn(move || {
            let _hold = t2.take();
            panic!("a step fails while holding the turn");
        })
        .join();
        assert!(failed.is_err());
        drop(turn.take()); // would wait forever had the panic kept the turn
        assert!(TurnHold::none().0.is_none());
    }

    /// Both executors run every activation but softmax by name through [`pointwise`], not by
    /// an arm per activation: so a planner activation without a kernel would compile and fail
    /// at its model's first step. This test is that check, at `cargo test` time.
    #[test]
    fn every_activation_but_softmax_has_a_pointwise_kernel_and_every_kernel_an_activation() {
        for act in Activation::ALL {
            let found = pointwise(act);
            if act == Activation::Softmax {
                assert!(
                    found.is_err(),
                    "softmax runs over rows, not as a pointwise kernel"
                );
                continue;
            }
            let kernel = found.unwrap_or_else(|_| panic!("no kernel runs `{}`", act.name()));
            assert_eq!(kernel.name(), act.name());
            assert_eq!(kernel.param(), act.param().map_or(0.0, |(_, v)| v));
            // A parameter other than the default reaches the kernel too.
            if let Some((_, v)) = act.param() {
                let moved = pointwise(act.with_param(v + 0.25)).unwrap();
                assert_eq!(moved.param(), v + 0.25, "`{}`'s parameter", act.name());
            }
        }
        for name in k::activation::Activation::NAMES {
            assert!(
                Activation::parse(name).is_some(),
                "the kernel `{name}` runs no planner activation"
            );
        }
    }

    /// The planner sizes the memory-efficient attention's scratch and the kernels cut it into
    /// `Dr` and lanes: the two formulas, written on either side of the device boundary, agree
    /// on every shape (and the CUDA kernels' `Dr` fits in it), and on the largest head the
    /// CUDA kernels take.
    #[test]
    fn the_planned_flash_scratch_is_what_the_kernels_use() {
        use k::flash_attention as fa;
        assert_eq!(memwise_plan::op::FLASH_TILE_Q, fa::FLASH_TILE_Q);
        assert_eq!(memwise_plan::op::FLASH_TILE_K, fa::FLASH_TILE_K);
        assert_eq!(memwise_plan::op::FLASH_LANES, fa::FLASH_LANES);
        assert_eq!(
            memwise_plan::op::FLASH_MAX_HEAD_DIM,
            k::cuda::flash::MAX_HEAD_DIM
        );
        for batch in [1, 2, 5] {
            for seq in [1, 3, 63, 64, 65, 200, 255, 256, 257, 1024, 1100] {
                for (heads, head_dim) in [(1, 4), (3, 8), (12, 64), (2, 128)] {
                    let d = k::attention::AttentionDims {
                        batch,
                        seq,
                        hidden: heads * head_dim,
                        heads,
                    };
                    let planned = memwise_plan::op::flash_attention_scratch_elems(
                        batch, seq, heads, head_dim,
                    );
                    assert_eq!(planned, fa::flash_scratch_len(d), "{d:?}");
                    let cuda = k::cuda::flash::FlashDims {
                        batch,
                        seq,
                        heads,
                        head_dim,
                        causal: false,
                    };
                    assert!(cuda.scratch_f32_elems() <= planned);
                }
            }
        }
    }
}
