//! What a plan's steps cost to run, the two inputs of a roofline: the FLOPs each step does and
//! the bytes it moves when it reads each operand and writes each result once from memory (no
//! reuse across steps through the caches — how any op-by-op executor, memwise's or an eager
//! framework's, runs a step).
//!
//! FLOPs: a forward, recompute or loss step counts [`Op::forward_flops`](crate::op::Op::forward_flops), a backward step
//! [`Op::backward_flops`](crate::op::Op::backward_flops) (a GEMM-shaped op one product per gradient it writes, the input
//! gradient when the plan asks for it), an update one FLOP per optimizer state slot and per
//! parameter element it updates (one replica's shard under ZeRO stage 1), plus two; a ZeRO
//! all-gather none.
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
        match s.phase {
            Phase::Forward | Phase::Recompute | Phase::Loss => s.op.forward_flops(),
            Phase::Backward => s.op.backward_flops(writes_input_grad(s)),
            Phase::Update if matches!(s.op, Op::AllGatherParams { .. }) => 0,
            Phase::Update => {
                let per_elem = self.optimizer.state_slots() + 2;
                self.step_params(s)
                    .map(|p| per_elem.saturating_mul(self.updated_elems(s, p)))
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
                // the 16-bit copy written; a ZeRO gather writes the whole weights and their
                // 16-bit copy.
                Phase::Update if matches!(s.op, Op::AllGatherParams { .. }) => {
                    f32_bytes + p.half_copy.map_or(0, |_| weights)
                }
                Phase::Update => {
                    let part = |b: u64| b / p.elems().max(1) as u64 * self.updated_elems(s, p);
                    part(3 * f32_bytes + 2 * slots * f32_bytes + p.half_copy.map_or(0, |_| weights))
                }
            }
        });
        params.fold(tensors, u64::saturating_add)
    }

    /// The elements of `p` update step `s` changes: under ZeRO stage 1 one replica's shard.
    fn updated_elems(&self, s: &PlanStep, p: &PlanParam) -> u64 {
        match s.op {
            Op::Update => self.state_elems(p) as u64,
            _ => p.elems() as u64,
        }
    }

    fn step_params<'a>(&'a self, s: &'a PlanStep) -> impl Iterator<Item = &'a PlanParam> + 'a {
        s.params
            .iter()
            .filter(|&&p| p != NONE)
            .map(|&p| &self.params[p as usize])
    }
}

/// Whether a backward step writes its input's gradient (by the contract of [`Op`](crate::op::Op), its first
/// write; `NONE` when nothing upstream needs it).
fn writes_input_grad(s: &PlanStep) -> bool {
    s.writes.first().is_some_and(|&t| t != NONE)
}
