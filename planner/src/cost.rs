//! What a plan's steps cost to run, the two inputs of a roofline: the FLOPs each step does and
//! the bytes it moves when it reads each operand and writes each result once from memory (no
//! reuse across steps through the caches — how any op-by-op executor, memwise's or an eager
//! framework's, runs a step).
//!
//! FLOPs: a forward, recompute or loss step counts [`Op::forward_flops`]. A backward step of a
//! GEMM-shaped op (dense, the convolutions, the attention projections' products) does one
//! GEMM of the forward's size per gradient it writes: the weight gradient, and the input
//! gradient when the plan asks for it. Materialised attention's backward is two such
//! products per forward product; flash attention's recomputes the scores as well (half its
//! products again). Any other backward counts what its forward does. An update counts one
//! FLOP per optimizer state slot and per parameter element, plus two.
//!
//! Bytes: every tensor a step reads or writes, once; the weights a step reads (its 16-bit copy
//! when a half-precision GEMM has one); in the backward, the f32 gradients it accumulates into
//! (read and written); in an update, the f32 master and its gradient, each state slot read
//! and written, and the 16-bit copy written.

use crate::op::Op;
use crate::plan::{Phase, PlanParam, PlanStep, StaticPlan};
use crate::NONE;

/// FLOPs and bytes moved, of one step or summed over a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCost {
    pub flops: u64,
    pub bytes: u64,
}

impl std::ops::Add for StepCost {
    type Output = StepCost;
    fn add(self, o: StepCost) -> StepCost {
        StepCost {
            flops: self.flops.saturating_add(o.flops),
            bytes: self.bytes.saturating_add(o.bytes),
        }
    }
}

impl StaticPlan {
    /// The cost of one step of this plan (see the module docs for what counts).
    pub fn step_cost(&self, s: &PlanStep) -> StepCost {
        StepCost {
            flops: self.step_flops(s),
            bytes: self.step_bytes(s),
        }
    }

    /// The cost of every step: one training step (or one inference pass for an inference
    /// plan).
    pub fn cost(&self) -> StepCost {
        self.steps
            .iter()
            .fold(StepCost::default(), |a, s| a + self.step_cost(s))
    }

    fn step_flops(&self, s: &PlanStep) -> u64 {
        let forward = s.op.forward_flops();
        match s.phase {
            Phase::Forward | Phase::Recompute | Phase::Loss => forward,
            Phase::Backward => backward_flops(&s.op, forward, writes_input_grad(s)),
            Phase::Update => {
                let per_elem = self.optimizer.state_slots() + 2;
                self.step_params(s)
                    .map(|p| per_elem.saturating_mul(p.elems() as u64))
                    .fold(0u64, u64::saturating_add)
            }
        }
    }

    fn step_bytes(&self, s: &PlanStep) -> u64 {
        let tensors = s
            .reads
            .iter()
            .chain(s.writes.iter())
            .filter(|&&t| t != NONE)
            .map(|&t| self.tensor(t).bytes)
            .fold(0u64, u64::saturating_add);
        let slots = self.optimizer.state_slots();
        let params = self.step_params(s).map(|p| {
            let f32_bytes = 4 * p.elems() as u64;
            let weights = p
                .half_copy
                .map_or(f32_bytes, |d| d.size() * p.elems() as u64);
            match s.phase {
                Phase::Forward | Phase::Recompute | Phase::Loss => weights,
                Phase::Backward if p.trainable => weights + 2 * f32_bytes,
                Phase::Backward => weights,
                // Master read and written, gradient read, each slot read and written, and
                // the 16-bit copy written.
                Phase::Update => {
                    3 * f32_bytes + 2 * slots * f32_bytes + p.half_copy.map_or(0, |_| weights)
                }
            }
        });
        params.fold(tensors, u64::saturating_add)
    }

    fn step_params<'a>(&'a self, s: &'a PlanStep) -> impl Iterator<Item = &'a PlanParam> + 'a {
        s.params
            .iter()
            .filter(|&&p| p != NONE)
            .map(|&p| &self.params[p as usize])
    }
}

/// Whether a backward step writes its input's gradient (by the contract of [`Op`], its first
/// write; `NONE` when nothing upstream needs it).
fn writes_input_grad(s: &PlanStep) -> bool {
    s.writes.first().is_some_and(|&t| t != NONE)
}

fn backward_flops(op: &Op, forward: u64, input_grad: bool) -> u64 {
    match op {
        Op::Dense { .. }
        | Op::Conv2d { .. }
        | Op::Conv2dTranspose { .. }
        | Op::DepthwiseConv2d { .. } => forward.saturating_mul(1 + input_grad as u64),
        Op::Attention { .. } => forward.saturating_mul(2),
        Op::FlashAttention { .. } => forward.saturating_mul(2).saturating_add(forward / 2),
        // Exhaustive, so a new GEMM-shaped op is priced here on purpose.
        Op::InputCast { .. }
        | Op::Cast { .. }
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::GlobalAvgPool { .. }
        | Op::BatchNorm { .. }
        | Op::BatchNormInference { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Dropout { .. }
        | Op::Activation { .. }
        | Op::Add { .. }
        | Op::Concat { .. }
        | Op::Embedding { .. }
        | Op::PositionalEmbedding { .. }
        | Op::SampleNormal { .. }
        | Op::Accumulate { .. }
        | Op::SoftmaxCrossEntropy { .. }
        | Op::SoftmaxCrossEntropyFromLogits { .. }
        | Op::SigmoidBinaryCrossentropy { .. }
        | Op::BinaryCrossentropyFromLogits { .. }
        | Op::BinaryCrossentropy { .. }
        | Op::MeanSquaredError { .. }
        | Op::KlNormal { .. }
        | Op::CheckFinite
        | Op::Update => forward,
    }
}
