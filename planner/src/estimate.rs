//! `MemoryReport` and the assembled `StaticPlan`: the persistent region's layout (f32
//! parameters, their 16-bit copies, gradients, optimizer state), the arena's breakdown at
//! its peak step, and one row per layer.

use std::borrow::Cow;

use crate::arena::ArenaPlan;
use crate::data_parallel::{shard_elems, Sharding};
use crate::graph::Graph;
use crate::liveness::{align_up, Lifetimes};
use crate::op::Op;
use crate::plan::{
    LayerMemory, MemoryReport, Phase, PlanParam, PlanStep, PlanTensor, Role, StaticPlan, NONE,
    NO_OFFSET,
};
use crate::schedule::Schedule;
use crate::spec::ModelSpec;

/// Bytes of the persistent region, split as the report shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Persistent {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
}

/// Lays out the persistent region: all f32 values, then 16-bit copies, then gradients
/// (those of `grad_order` first, in its order: a data-parallel plan's buckets, each then one
/// contiguous range its sum covers at once, as DDP's bucket views; the rest in parameter
/// order), then optimizer state (each parameter's slots contiguous, `align(elems·4)` apart; under
/// ZeRO stage 1 each slot holds one replica's shard, `align(⌈elems/N⌉·4)` apart).
/// `updated[i]`: parameter `i` has a gradient and an update (else it is stored frozen).
pub fn layout_params(
    spec: &ModelSpec,
    graph: &Graph,
    updated: &[bool],
    grad_order: &[u32],
    alignment: u64,
) -> (Vec<PlanParam>, Persistent) {
    let slots = spec.optimizer.state_slots();
    let f32_bytes = |e: usize| align_up(e as u64 * 4, alignment);
    let mut out: Vec<PlanParam> = graph
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| PlanParam {
            id: i as u32,
            name: Cow::Owned(p.name.clone()),
            layer: Cow::Owned(graph.layers[p.layer].name.clone()),
            shape: Cow::Owned(p.shape.clone()),
            trainable: updated[i],
            offset: NO_OFFSET,
            half_copy: p.half_copy,
            half_offset: NO_OFFSET,
            grad_offset: NO_OFFSET,
            state_offset: NO_OFFSET,
        })
        .collect();
    let mut at = 0u64;
    for (i, p) in graph.params.iter().enumerate() {
        out[i].offset = at;
        at += f32_bytes(p.elems());
    }
    for (i, p) in graph.params.iter().enumerate() {
        if let Some(h) = p.half_copy {
            out[i].half_offset = at;
            at += align_up(p.elems() as u64 * h.size(), alignment);
        }
    }
    let params = at;
    let rest = (0..graph.params.len() as u32).filter(|p| !grad_order.contains(p));
    for i in grad_order.iter().copied().chain(rest).map(|p| p as usize) {
        if updated[i] && out[i].grad_offset == NO_OFFSET {
            out[i].grad_offset = at;
            at += f32_bytes(graph.params[i].elems());
        }
    }
    let grads = at - params;
    let state_elems = |e: usize| match spec.sharding {
        Sharding::Replicated => e,
        Sharding::OptimizerState | Sharding::Gradients => shard_elems(e, spec.replicas),
    };
    for (i, p) in graph.params.iter().enumerate() {
        if updated[i] && slots > 0 {
            out[i].state_offset = at;
            at += slots * f32_bytes(state_elems(p.elems()));
        }
    }
    let optimizer = at - params - grads;
    (
        out,
        Persistent {
            params,
            grads,
            optimizer,
        },
    )
}

/// Builds the `StaticPlan` from the pipeline's stages.
pub fn assemble(
    spec: &ModelSpec,
    graph: &Graph,
    schedule: &Schedule,
    life: &Lifetimes,
    arena: &ArenaPlan,
) -> StaticPlan {
    let layer_name = |l: Option<usize>| -> Cow<'static, str> {
        match l {
            Some(i) => Cow::Owned(graph.layers[i].name.clone()),
            None => Cow::Borrowed("model"),
        }
    };
    let tensors: Vec<PlanTensor> = schedule
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| PlanTensor {
            id: i as u32,
            name: Cow::Owned(t.name.clone()),
            layer: if t.layer.is_none() {
                Cow::Borrowed("loss")
            } else {
                layer_name(t.layer)
            },
            role: t.role,
            dtype: t.dtype,
            shape: Cow::Owned(t.shape.clone()),
            bytes: arena.requests[life.buffer_of[i]]
                .bytes
                .min(align_up(t.raw_bytes(), arena.alignment)),
            offset: arena.offset(life.buffer_of[i]),
            first: life.first[i],
            last: life.last[i],
            in_place_of: life.in_place_of[i],
        })
        .collect();
    let steps: Vec<PlanStep> = schedule
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| PlanStep {
            index: i as u32,
            phase: s.phase,
            layer: if s.layer.is_none() && s.phase == Phase::Loss {
                Cow::Borrowed("loss")
            } else {
                layer_name(s.layer)
            },
            op: s.op,
            reads: Cow::Owned(s.reads.clone()),
            writes: Cow::Owned(s.writes.clone()),
            params: Cow::Owned(s.params.clone()),
            micro_batch: 0,
        })
        .collect();
    // A data-parallel plan's gradients in the order its sums take them.
    let bucketed: Vec<u32> = schedule
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::AllReduceGradients { .. }))
        .flat_map(|s| s.params.iter().copied())
        .collect();
    let (params, persistent) =
        layout_params(spec, graph, &schedule.updated, &bucketed, arena.alignment);
    let arena_bytes = arena.packing.arena_bytes;

    let mut plan = StaticPlan {
        model: Cow::Owned(spec.name.clone()),
        batch: spec.batch,
        replicas: spec.replicas.max(1),
        sharding: spec.sharding,
        alignment: arena.alignment,
        precision: spec.precision,
        optimizer: spec.optimizer,
        training: schedule.training,
        loss_scaling: schedule.loss_scaling,
        arena_bytes,
        lower_bound_bytes: 0,
        persistent_bytes: persistent.params + persistent.grads + persistent.optimizer,
        params_count: graph.param_count(),
        trainable_count: graph
            .params
            .iter()
            .enumerate()
            .filter(|(i, _)| schedule.updated[*i])
            .map(|(_, p)| p.elems() as u64)
            .sum(),
        memory: MemoryReport {
            params: persistent.params,
            grads: persistent.grads,
            optimizer: persistent.optimizer,
            activations_peak: 0,
            workspace_peak: 0,
            inputs: 0,
            total: persistent.params + persistent.grads + persistent.optimizer + arena_bytes,
            arena: arena_bytes,
            lower_bound: 0,
            peak_step: 0,
            layers: Cow::Owned(Vec::new()),
        },
        tensors: Cow::Owned(tensors),
        steps: Cow::Owned(steps),
        params: Cow::Owned(params),
        inputs: Cow::Owned(graph.inputs.iter().map(|&t| t as u32).collect()),
        losses: Cow::Owned(schedule.losses.clone()),
        prediction: schedule.prediction,
        stage: 0,
        stages: 1,
        micro_batches: 1,
    };
    let (lb, peak) = crate::arena::live_peak(&plan);
    plan.lower_bound_bytes = lb;
    plan.memory.lower_bound = lb;
    plan.memory.peak_step = peak;
    // Breakdown at the peak: each live buffer counted once, by the role of its member
    // that is live there (the newest one at a hand-over).
    let mut seen = std::collections::HashSet::new();
    let mut members: Vec<usize> = (0..plan.tensors.len())
        .filter(|&i| plan.tensors[i].first <= peak && peak <= plan.tensors[i].last)
        .collect();
    members.sort_by_key(|&i| std::cmp::Reverse(plan.tensors[i].first));
    let (mut act, mut ws, mut inp) = (0u64, 0u64, 0u64);
    for i in members {
        let b = life.buffer_of[i];
        if !seen.insert(b) {
            continue;
        }
        let bytes = arena.requests[b].bytes;
        match plan.tensors[i].role {
            Role::Workspace => ws += bytes,
            Role::Input => inp += bytes,
            _ => act += bytes,
        }
    }
    plan.memory.activations_peak = act;
    plan.memory.workspace_peak = ws;
    plan.memory.inputs = inp;
    plan.memory.layers = Cow::Owned(layer_rows(spec, graph, &plan));
    plan
}

/// The layer's backward (or a recompute step just before it, outside any checkpoint) remakes
/// what its forward did not keep: the memory-efficient attention's probabilities, a batch or
/// layer norm's x̂ from its kept input, a u8 input's float copy, a GELU or SiLU output from its kept input.
fn rebuilds_in_backward(graph: &Graph, plan: &StaticPlan, l: &crate::graph::GLayer) -> bool {
    let rebuilding_op = graph.ops[l.ops.clone()].iter().any(|o| {
        matches!(
            o.op,
            Op::FlashAttention { .. }
                | Op::BatchNorm {
                    rebuild_x_hat: true,
                    ..
                }
                | Op::LayerNorm {
                    rebuild_x_hat: true,
                    ..
                }
        )
    });
    let redone = l.checkpoint.is_none()
        && plan
            .steps
            .iter()
            .any(|s| s.phase == Phase::Recompute && s.layer == l.name.as_str());
    rebuilding_op || redone
}

fn layer_rows(spec: &ModelSpec, graph: &Graph, plan: &StaticPlan) -> Vec<LayerMemory> {
    let slots = spec.optimizer.state_slots();
    let read_in_backward: Vec<bool> = {
        let mut v = vec![false; plan.tensors.len()];
        // A recompute step's reads are kept for the backward too: a checkpoint segment's
        // input, a u8 model input whose cast is redone.
        let for_backward =
            |s: &&crate::plan::PlanStep| matches!(s.phase, Phase::Backward | Phase::Recompute);
        for s in plan.steps.iter().filter(for_backward) {
            for &r in s.reads.iter().filter(|&&r| r != NONE) {
                v[r as usize] = true;
            }
        }
        v
    };
    graph
        .layers
        .iter()
        .enumerate()
        .map(|(li, l)| {
            let mine = |t: &&PlanTensor| t.layer == l.name.as_str();
            let saved_bytes = plan
                .tensors
                .iter()
                .filter(mine)
                .filter(|t| {
                    matches!(t.role, Role::Activation | Role::Input)
                        && read_in_backward[t.id as usize]
                })
                .map(|t| t.bytes)
                .sum();
            let recomputed_bytes = plan
                .tensors
                .iter()
                .filter(mine)
                .filter(|t| t.role == Role::Recomputed)
                .map(|t| t.bytes)
                .sum();
            let in_place = plan
                .tensors
                .iter()
                .filter(mine)
                .any(|t| t.in_place_of != NONE && t.role == Role::Activation);
            let mut params = 0u64;
            let mut persistent = 0u64;
            for (pi, p) in graph
                .params
                .iter()
                .enumerate()
                .filter(|(_, p)| p.layer == li)
            {
                let e = p.elems() as u64;
                params += e;
                persistent += e * 4 + p.half_copy.map_or(0, |h| e * h.size());
                if plan.params[pi].trainable {
                    persistent += e * 4 * (1 + slots);
                }
            }
            LayerMemory {
                name: Cow::Owned(l.name.clone()),
                kind: Cow::Borrowed(l.kind),
                output_shape: Cow::Owned(l.output.shape.clone()),
                dtype: l.dtype,
                params,
                persistent_bytes: persistent,
                saved_bytes,
                recomputed_bytes,
                checkpointed: l.checkpoint.is_some(),
                recomputes_output: l.recompute_output
                    && l.checkpoint.is_none()
                    && plan.steps.iter().any(|s| {
                        s.phase == Phase::Recompute
                            && s.layer == l.name.as_str()
                            && s.op.recomputes_output_by_choice()
                    }),
                in_place,
                recomputes_in_backward: rebuilds_in_backward(graph, plan, l),
                forward_flops: graph.ops[l.ops.clone()]
                    .iter()
                    .map(|o| o.op.forward_flops())
                    .sum(),
            }
        })
        .collect()
}
