//! The multi-tensor optimizer's chunk table: for every update step of a plan, the chunks
//! (`MwUpdateChunk`) of its parameters that one launch of `mw_sgd` / `mw_rmsprop` / `mw_adam`
//! updates, a block each, together with each parameter's 16-bit copy.
//!
//! Why a table: an update step over P parameters was 2·P launches (the optimizer kernel and a
//! cast per parameter), each a few microseconds on the host and a graph node on the device,
//! most of them on small tensors (biases, norms' γ and β) that fill a fraction of one SM. The
//! table is built from the plan alone, once, and lives after the step's scalars in the
//! allocation the executor makes up front (`scalars_bytes`): nothing is allocated per step.

use std::collections::BTreeMap;

use memwise_kernels::cuda::launch::{Float, MwUpdateChunk};
use memwise_plan::liveness::align_up;
use memwise_plan::{DType, Op, Optimizer, StaticPlan, NO_OFFSET};

use crate::cpu::Opt;

/// The chunks of every update step, in plan order, and each step's `(first, count)` in them.
pub(crate) struct UpdateTable {
    pub chunks: Vec<MwUpdateChunk>,
    pub steps: BTreeMap<u32, (usize, usize)>,
}

/// The table of `plan`'s update steps with its persistent region at `persistent`, for
/// replica `rank` (under ZeRO stage 1 its shard of each parameter; rank 0's shards are the
/// longest, so its table is the largest). Parameters without a gradient (frozen, or not
/// trained) have no chunks; a step with none is left out.
pub(crate) fn update_table(plan: &StaticPlan, persistent: u64, rank: usize) -> UpdateTable {
    let trained = |pid: &&u32| plan.params[**pid as usize].grad_offset != NO_OFFSET;
    let updates = || plan.steps.iter().filter(|s| matches!(s.op, Op::Update));
    let total: u64 = updates()
        .flat_map(|s| s.params.iter().filter(trained))
        .map(|&pid| plan.params[pid as usize].elems() as u64)
        .sum();
    // From the whole parameters, so every rank splits its shards alike.
    let chunk = MwUpdateChunk::chunk_elems(total);
    let mut table = UpdateTable {
        chunks: Vec::new(),
        steps: BTreeMap::new(),
    };
    for s in updates() {
        let first = table.chunks.len();
        for &pid in s.params.iter().filter(trained) {
            let shard = plan.shard(&plan.params[pid as usize], rank);
            let proto = parameter_chunk(plan, pid, persistent, shard.start as u64);
            table
                .chunks
                .extend(MwUpdateChunk::split(proto, shard.len() as u64, chunk));
        }
        let count = table.chunks.len() - first;
        if count > 0 {
            table.steps.insert(s.index, (first, count));
        }
    }
    table
}

/// Parameter `pid`'s addresses from its element `first` on as a chunk (its range left
/// empty): values, gradient, the optimizer state slots where the kernel of
/// `plan.optimizer` expects them (which hold the shard that starts at `first`), 16-bit copy.
fn parameter_chunk(plan: &StaticPlan, pid: u32, persistent: u64, first: u64) -> MwUpdateChunk {
    let prm = &plan.params[pid as usize];
    let slots = plan.optimizer.state_slots();
    let stride = align_up(plan.state_elems(prm) as u64 * 4, plan.alignment);
    let state = |slot: u64| {
        if slot < slots {
            persistent + prm.state_offset + slot * stride
        } else {
            0
        }
    };
    let half = prm.half_copy.map(|t| match t {
        DType::BF16 => Float::Bf16,
        _ => Float::F16,
    });
    MwUpdateChunk {
        p: persistent + prm.offset + 4 * first,
        g: persistent + prm.grad_offset + 4 * first,
        s: state_pointers(&plan.optimizer, &state),
        half: half.map_or(0, |h| {
            persistent + prm.half_offset + h.size() as u64 * first
        }),
        half_kind: MwUpdateChunk::half_kind(half),
        ..MwUpdateChunk::default()
    }
}

/// The kernels' `s[0..3]` from the optimizer's state slots (optimizer.cu): SGD its momentum
/// (null without); RMSprop v, then its momentum and centred average (each null when off);
/// Adam and AdamW m and v.
fn state_pointers(optimizer: &Optimizer, state: &dyn Fn(u64) -> u64) -> [u64; 3] {
    match Opt::from_plan(optimizer) {
        Opt::Sgd(o) => [if o.momentum != 0.0 { state(0) } else { 0 }, 0, 0],
        Opt::RmsProp(o) => {
            let with_momentum = o.momentum > 0.0;
            [
                state(0),
                if with_momentum { state(1) } else { 0 },
                if o.centered {
                    state(1 + with_momentum as u64)
                } else {
                    0
                },
            ]
        }
        Opt::Adam(_) | Opt::AdamW(_) => [state(0), state(1), 0],
    }
}
