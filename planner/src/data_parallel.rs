//! What each replica of data-parallel training holds of the model states — the parameters'
//! f32 values, their 16-bit compute copies, the gradients and the optimizer state — with the
//! gradients all-reduced in place, with the optimizer state and the f32 masters sharded
//! (ZeRO stage 1, Megatron's distributed optimizer), or with the gradients sharded too
//! (ZeRO stage 2). The accounting of issue 15's per-replica `MEMORY`, from a plan's own
//! persistent layout; the activations are the plan's at the per-replica batch.

use crate::liveness::align_up;
use crate::plan::StaticPlan;

/// Which model states are split across the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Sharding {
    /// Every replica holds everything; the gradients are all-reduced in place.
    #[default]
    Replicated,
    /// The optimizer state and the f32 masters of parameters with a compute copy (ZeRO
    /// stage 1; Megatron's distributed optimizer): each replica updates its 1/N and the
    /// compute copies are all-gathered.
    OptimizerState,
    /// The gradients too (ZeRO stage 2): each reduce-scatters a parameter's gradient as soon
    /// as its backward step wrote it, keeping its 1/N.
    Gradients,
}

impl Sharding {
    /// The ZeRO stage: 0 (nothing sharded), 1 or 2.
    pub const fn zero_stage(self) -> u8 {
        match self {
            Sharding::Replicated => 0,
            Sharding::OptimizerState => 1,
            Sharding::Gradients => 2,
        }
    }

    /// The sharding of ZeRO stage `stage` (0, 1 or 2).
    pub const fn from_zero_stage(stage: u8) -> Option<Sharding> {
        match stage {
            0 => Some(Sharding::Replicated),
            1 => Some(Sharding::OptimizerState),
            2 => Some(Sharding::Gradients),
            _ => None,
        }
    }
}

/// The elements each of `replicas` keeps of a sharded tensor of `elems`: `⌈elems / N⌉`, the
/// last replicas' shards padded (or empty) when `N` does not divide `elems`.
pub const fn shard_elems(elems: usize, replicas: usize) -> usize {
    elems.div_ceil(if replicas == 0 { 1 } else { replicas })
}

/// The elements of a sharded tensor of `elems` that replica `rank` of `replicas` owns:
/// `rank·⌈elems/N⌉ ..` up to `elems` (empty for the ranks past the end).
pub fn shard_range(elems: usize, rank: usize, replicas: usize) -> std::ops::Range<usize> {
    let k = shard_elems(elems, replicas);
    let start = (rank * k).min(elems);
    start..(start + k).min(elems)
}

/// Bytes per element of one parameter's states, as a plan lays them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementBytes {
    /// The 16-bit copy the GEMMs read under mixed precision (0 when the f32 value is read).
    pub compute_copy: u64,
    /// The f32 value: the master when there is a compute copy, else the weight itself.
    pub master: u64,
    /// The gradient (0 for a frozen parameter).
    pub grad: u64,
    /// The optimizer's f32 state values (Adam's two; 0 for a frozen parameter), each laid
    /// out as a tensor of its own.
    pub optimizer_slots: u64,
}

/// One replica's model states, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ReplicaStates {
    pub compute_copies: u64,
    pub masters: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// Under [`Sharding::Gradients`], the largest whole gradient, written by its backward
    /// step before its reduce-scatter keeps 1/N of it (0 otherwise).
    pub gradient_bucket: u64,
    /// Of the above, what rounds each shard up to `⌈elems / N⌉` elements.
    pub shard_padding: u64,
}

impl ReplicaStates {
    pub fn total(&self) -> u64 {
        self.compute_copies + self.masters + self.grads + self.optimizer + self.gradient_bucket
    }
}

/// Each parameter of `plan` as `(elements, bytes per element)`, in its persistent layout.
pub fn plan_params(plan: &StaticPlan) -> Vec<(u64, ElementBytes)> {
    let slots = plan.optimizer.state_slots();
    plan.params
        .iter()
        .map(|p| {
            let trained = p.trainable as u64;
            let bytes = ElementBytes {
                compute_copy: p.half_copy.map_or(0, |d| d.size()),
                master: 4,
                grad: 4 * trained,
                optimizer_slots: slots * trained,
            };
            (p.elems() as u64, bytes)
        })
        .collect()
}

/// One replica's share of `params` among `replicas` under `sharding`, each tensor's bytes
/// rounded up to `alignment` as the plan lays them out. A sharded tensor keeps
/// `⌈elems / replicas⌉` elements on every replica.
pub fn replica_states(
    params: &[(u64, ElementBytes)],
    replicas: u64,
    sharding: Sharding,
    alignment: u64,
) -> ReplicaStates {
    let n = replicas.max(1);
    let mut s = ReplicaStates::default();
    let mut add = |total: &mut u64, elems: u64, bytes: u64, sharded: bool| {
        if bytes == 0 {
            return;
        }
        let kept = if sharded { elems.div_ceil(n) } else { elems };
        *total += align_up(kept * bytes, alignment);
        if sharded {
            s.shard_padding += (kept * n - elems) * bytes / n;
        }
    };
    let opt_sharded = sharding != Sharding::Replicated;
    let grad_sharded = sharding == Sharding::Gradients;
    let (mut copies, mut masters, mut grads, mut optimizer) = (0, 0, 0, 0);
    for &(e, b) in params {
        add(&mut copies, e, b.compute_copy, false);
        // A master with a compute copy is read by the update alone; without one it is the
        // weight every forward reads, so every replica holds it whole.
        add(&mut masters, e, b.master, opt_sharded && b.compute_copy > 0);
        add(&mut grads, e, b.grad, grad_sharded);
        for _ in 0..b.optimizer_slots {
            add(&mut optimizer, e, 4, opt_sharded);
        }
    }
    s.compute_copies = copies;
    s.masters = masters;
    s.grads = grads;
    s.optimizer = optimizer;
    if grad_sharded {
        s.gradient_bucket = params
            .iter()
            .map(|&(e, b)| align_up(e * b.grad, alignment))
            .max()
            .unwrap_or(0);
    }
    s
}
