//! `StepGraph`: the training step's gradient rules — for every forward op, exactly which
//! forward tensors its backward reads (these saved tensors ARE the activation memory),
//! which output gradients it consumes and which input gradients it produces.

use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{GOp, Graph, TensorId};
use crate::io::*;
use crate::op::Op;
use crate::plan::{Phase, PlanStep, NONE};
use crate::spec::{LayerKind, ModelSpec};

/// How one forward op's backward runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardRule {
    /// Forward tensors the backward reads, in the op's documented order.
    pub saved: Vec<TensorId>,
    /// Outputs whose gradients the backward reads (`dy`).
    pub grad_outputs: Vec<TensorId>,
    /// For each input, whether the backward writes its gradient.
    pub grad_inputs: Vec<bool>,
    /// The op has trainable parameters whose gradients the backward accumulates.
    pub param_grads: bool,
    /// The backward may overwrite `dy` with `dx` (element-wise ops).
    pub in_place: bool,
}

/// The training step's structure: forward ops in order, their backward rules, the loss.
#[derive(Clone, Debug, PartialEq)]
pub struct StepGraph {
    /// Per graph tensor: does the loss depend on it through a parameter (needs a gradient)?
    pub requires_grad: Vec<bool>,
    /// Per graph op: its backward, if the op has one and anything needs it.
    pub backward: Vec<Option<BackwardRule>>,
    /// Per graph op: can its forward write its first output over input `k`?
    pub forward_in_place: Vec<Option<usize>>,
    /// Mixed precision with float16 anywhere: dynamic loss scaling is on.
    pub loss_scaling: bool,
    /// False for an inference pass: no gradients, no backward, no update.
    pub training: bool,
    /// Data-parallel replicas whose gradients are summed (1: none).
    pub replicas: usize,
    /// What the replicas split among them (ZeRO).
    pub sharding: crate::data_parallel::Sharding,
}

impl StepGraph {
    /// Derives the backward rules of `graph`, and settles per batch norm whether its
    /// backward rebuilds x̂ from its input (writing the choice into the op, so every later
    /// stage and the executors read it from there).
    pub fn build(graph: &mut Graph, spec: &ModelSpec) -> Result<StepGraph, PlanError> {
        let mut requires_grad = vec![false; graph.tensors.len()];
        for op in &graph.ops {
            let has_trainable = op.params.iter().any(|&p| graph.params[p].trainable);
            let any_in = op.inputs.iter().any(|&t| requires_grad[t]);
            if has_trainable || any_in {
                // Only the primary outputs carry gradients; masks, indices, statistics don't.
                for &o in primary_outputs(&op.op, &op.outputs) {
                    requires_grad[o] = true;
                }
            }
        }
        for l in &graph.losses {
            for &t in &l.grad_of {
                if !requires_grad[t] {
                    let layer = &graph.layers[graph.tensors[t].layer].name;
                    return Err(PlanError::at(
                        layer,
                        format!("the loss `{}` reads `{layer}`, which depends on no trainable parameter: nothing would learn from it", l.op.name()),
                    ));
                }
            }
        }
        let mut backward = Vec::with_capacity(graph.ops.len());
        let mut forward_in_place = Vec::with_capacity(graph.ops.len());
        for op in &graph.ops {
            if let Op::Activation { act, .. } = op.op {
                // Its backward reads `y`: only a parameter that keeps `x`'s sign allows that.
                act.check()
                    .map_err(|e| PlanError::at(&graph.layers[op.layer].name, e))?;
            }
            let mut grad_inputs: Vec<bool> = op.inputs.iter().map(|&t| requires_grad[t]).collect();
            let param_grads = op.params.iter().any(|&p| graph.params[p].trainable);
            let needed = (grad_inputs.iter().any(|&g| g) || param_grads) && !op.fused_into_loss;
            // Only the GEMM-based kernels can skip dx; the others always write every input's
            // gradient, so give them a (short-lived, unread) tensor to write.
            let dx_optional = matches!(
                op.op,
                Op::Dense { .. }
                    | Op::Conv2d { .. }
                    | Op::DepthwiseConv2d { .. }
                    | Op::Conv2dTranspose { .. }
                    | Op::Embedding { .. }
            );
            if needed && !dx_optional {
                for (k, &t) in op.inputs.iter().enumerate() {
                    grad_inputs[k] = graph.tensors[t].dtype.is_float();
                }
            }
            let x = op.inputs.first().copied();
            let y = op.outputs.first().copied();
            let same_dtype = |a: Option<TensorId>, b: Option<TensorId>| match (a, b) {
                (Some(a), Some(b)) => graph.tensors[a].dtype == graph.tensors[b].dtype,
                _ => false,
            };
            let rule = saved_for_backward(op, param_grads, same_dtype(x, y))?;
            let (saved, grad_outputs, in_place_bwd, in_place_fwd) = (
                rule.saved,
                rule.grad_outputs,
                rule.in_place_backward,
                rule.in_place_forward,
            );
            forward_in_place.push(in_place_fwd);
            backward.push(needed.then_some(BackwardRule {
                saved,
                grad_outputs,
                grad_inputs,
                param_grads,
                in_place: in_place_bwd,
            }));
        }
        rebuild_x_hat_from_kept_inputs(graph, &mut backward)?;
        let loss_scaling = graph.tensors.iter().any(|t| t.dtype == DType::F16)
            || spec
                .layers
                .iter()
                .any(|l| l.dtype == Some(DType::F16) && !matches!(l.kind, LayerKind::Input { .. }));
        Ok(StepGraph {
            training: true,
            requires_grad,
            backward,
            forward_in_place,
            loss_scaling,
            replicas: spec.replicas.max(1),
            sharding: spec.sharding,
        })
    }
}

impl StepGraph {
    /// The inference pass of `graph` (built with [`Graph::build_inference`]): forward and loss
    /// values only. Every element-wise op may overwrite its input, since nothing is kept for
    /// a backward pass.
    pub fn inference(graph: &Graph) -> StepGraph {
        let forward_in_place = graph
            .ops
            .iter()
            .map(|op| {
                let same = op
                    .inputs
                    .first()
                    .zip(op.outputs.first())
                    .is_some_and(|(&x, &y)| graph.tensors[x].dtype == graph.tensors[y].dtype);
                match op.op {
                    Op::Activation { .. } | Op::Add { .. } if same => Some(0),
                    _ => None,
                }
            })
            .collect();
        StepGraph {
            requires_grad: vec![false; graph.tensors.len()],
            backward: vec![None; graph.ops.len()],
            forward_in_place,
            loss_scaling: false,
            training: false,
            replicas: 1,
            sharding: crate::data_parallel::Sharding::Replicated,
        }
    }
}

/// A batch or layer norm whose input another op's backward reads anyway (the shortcut
/// convolution of a residual block, a ReLU that keeps its output) keeps that input and its
/// statistics, and its backward rebuilds x̂ — as PyTorch's does — instead of keeping x̂ beside
/// the input: one activation fewer kept for backward, for one subtract and multiply per
/// element (and, for layer norm, one more pass over each row for its mean, which batch norm
/// keeps as a per-channel pair but a per-row mean would cost a tensor per row). Elsewhere
/// keeping x̂ costs the same bytes as keeping the input and saves that arithmetic — except in
/// a layer marked [`crate::spec::LayerSpec::recompute_output`] whose output a later backward
/// keeps: there the input replaces x̂ and the output both, since the schedule remakes the
/// output from the input (`schedule.rs`, `redone_in_backward`).
fn rebuild_x_hat_from_kept_inputs(
    graph: &mut Graph,
    backward: &mut [Option<BackwardRule>],
) -> Result<(), PlanError> {
    for i in 0..graph.ops.len() {
        let op = &graph.ops[i];
        let (Op::BatchNorm { .. } | Op::LayerNorm { .. }, Some(x)) =
            (op.op, op.inputs.first().copied())
        else {
            continue;
        };
        let kept_by_another = |t: TensorId| {
            backward
                .iter()
                .enumerate()
                .any(|(j, r)| j != i && r.as_ref().is_some_and(|r| r.saved.contains(&t)))
        };
        let output_redone = graph.layers[op.layer].recompute_output
            && op.outputs.first().is_some_and(|&y| kept_by_another(y));
        if backward[i].is_none() || !(kept_by_another(x) || output_redone) {
            continue;
        }
        if let Op::BatchNorm { rebuild_x_hat, .. } | Op::LayerNorm { rebuild_x_hat, .. } =
            &mut graph.ops[i].op
        {
            *rebuild_x_hat = true;
        }
        // The norms' rules depend on neither flag.
        let rule = saved_for_backward(&graph.ops[i], true, true)?;
        if let Some(b) = backward[i].as_mut() {
            b.saved = rule.saved;
        }
    }
    Ok(())
}

/// The outputs of an op that carry gradients (not masks, indices or statistics).
pub fn primary_outputs<'a>(op: &Op, outputs: &'a [TensorId]) -> &'a [TensorId] {
    match op {
        Op::Attention { .. } | Op::FlashAttention { .. } => &outputs[outputs.len() - 1..],
        _ => &outputs[..1.min(outputs.len())],
    }
}

/// What one forward op keeps for its backward, by the names of its [`crate::io`] struct.
struct Saved {
    saved: Vec<TensorId>,
    grad_outputs: Vec<TensorId>,
    /// The backward may overwrite `dy` with `dx`.
    in_place_backward: bool,
    /// The forward may write its first output over this input.
    in_place_forward: Option<usize>,
}

/// The forward step `op` becomes, decoded by name ([`crate::io`]): the one statement of
/// where each of its tensors sits, which the planner's graph and the executors share.
fn forward_step(op: &GOp) -> PlanStep {
    let ids = |v: &[TensorId]| v.iter().map(|&t| t as u32).collect::<Vec<u32>>();
    let mut writes = ids(&op.outputs);
    writes.extend([NONE, NONE]);
    PlanStep {
        index: 0,
        phase: Phase::Forward,
        layer: std::borrow::Cow::Borrowed(""),
        op: op.op,
        reads: ids(&op.inputs).into(),
        writes: writes.into(),
        params: op
            .params
            .iter()
            .map(|&p| p as u32)
            .collect::<Vec<u32>>()
            .into(),
        micro_batch: 0,
    }
}

/// The backward rule of one forward op: what it saves (by name), which output gradients it
/// reads, whether its backward and forward may run in place. `same_dtype`: its first input
/// and output share a dtype.
fn saved_for_backward(op: &GOp, param_grads: bool, same_dtype: bool) -> Result<Saved, PlanError> {
    let step = forward_step(op);
    let bad = |e: crate::io::IoError| PlanError::internal(e.0);
    let t = |id: u32| id as TensorId;
    let rule = |saved: Vec<u32>, dy: u32, in_place_backward, in_place_forward| Saved {
        saved: saved.into_iter().map(t).collect(),
        grad_outputs: vec![t(dy)],
        in_place_backward,
        in_place_forward,
    };
    Ok(match op.op {
        Op::InputCast { .. } => Saved {
            saved: vec![],
            grad_outputs: vec![],
            in_place_backward: false,
            in_place_forward: None,
        },
        Op::Cast { .. } | Op::AvgPool2d { .. } | Op::GlobalAvgPool { .. } => {
            rule(vec![], UnaryForward::of(&step).map_err(bad)?.y, false, None)
        }
        Op::Dense { .. }
        | Op::Conv2d { .. }
        | Op::DepthwiseConv2d { .. }
        | Op::Conv2dTranspose { .. } => {
            // dW = xᵀ·dy needs x; dx = dy·Wᵀ needs only the (persistent) weights.
            let io = LinearForward::of(&step).map_err(bad)?;
            let saved = if param_grads { vec![io.x] } else { vec![] };
            rule(saved, io.y, false, None)
        }
        Op::MaxPool2d { .. } => {
            let io = MaxPoolForward::of(&step).map_err(bad)?;
            rule(vec![io.argmax], io.y, false, None)
        }
        Op::BatchNorm { rebuild_x_hat, .. } => {
            let io = BatchNormForward::of(&step).map_err(bad)?;
            let saved = if rebuild_x_hat {
                vec![io.x, io.mean, io.inv_std]
            } else {
                vec![io.x_hat, io.inv_std]
            };
            rule(saved, io.y, false, None)
        }
        Op::LayerNorm { rebuild_x_hat, .. } => {
            let io = LayerNormForward::of(&step).map_err(bad)?;
            let saved = if rebuild_x_hat {
                vec![io.x, io.rstd]
            } else {
                vec![io.x_hat, io.rstd]
            };
            rule(saved, io.y, false, None)
        }
        Op::GroupNorm { .. } => {
            let io = GroupNormForward::of(&step).map_err(bad)?;
            rule(vec![io.x_hat, io.rstd], io.y, false, None)
        }
        Op::Dropout { .. } => {
            let io = DropoutForward::of(&step).map_err(bad)?;
            rule(vec![io.mask], io.y, true, Some(0))
        }
        Op::Activation { act, .. } => {
            let io = UnaryForward::of(&step).map_err(bad)?;
            let reads_output = act.backward_reads_output();
            let saved = if reads_output { io.y } else { io.x };
            let fwd = (reads_output && same_dtype).then_some(0);
            rule(vec![saved], io.y, same_dtype, fwd)
        }
        Op::Add { .. } => rule(
            vec![],
            AddForward::of(&step).map_err(bad)?.y,
            false,
            Some(0),
        ),
        Op::Concat { .. } => rule(
            vec![],
            ConcatForward::of(&step).map_err(bad)?.y,
            false,
            None,
        ),
        Op::Embedding { .. } => {
            let io = EmbeddingForward::of(&step).map_err(bad)?;
            rule(vec![io.ids], io.y, false, None)
        }
        Op::PositionalEmbedding { .. } => {
            // Its backward reads only `dy` (the table's gradient is `dy`'s column sums, `dx`
            // is `dy`): both passes may run in place.
            let io = PositionalEmbeddingForward::of(&step).map_err(bad)?;
            rule(vec![], io.y, same_dtype, same_dtype.then_some(0))
        }
        Op::Attention { dropout, .. } => {
            let io = AttentionForward::of(&step).map_err(bad)?;
            let mut saved = vec![io.qkv, io.probs];
            if dropout > 0.0 {
                saved.extend([io.mask, io.probs_dropped]);
            }
            rule(saved, io.ctx, false, None)
        }
        Op::FlashAttention { .. } => {
            // The output is the out projection's input, kept for its weight gradient anyway;
            // the log-sum-exp is batch·heads·seq f32.
            let io = FlashAttentionForward::of(&step).map_err(bad)?;
            rule(vec![io.qkv, io.lse, io.ctx], io.ctx, false, None)
        }
        Op::SampleNormal { .. } => {
            let io = SampleNormalForward::of(&step).map_err(bad)?;
            rule(vec![io.log_var], io.z, false, None)
        }
        Op::BatchNormInference { .. }
        | Op::Accumulate { .. }
        | crate::loss_ops!()
        | Op::KlNormal { .. }
        | Op::CheckFinite
        | Op::AllReduceGradients { .. }
        | Op::Update
        | Op::AllGatherParams { .. }
        | Op::SendTensor { .. }
        | Op::RecvTensor { .. } => {
            return Err(PlanError::internal(format!(
                "{} is not a forward op of a training graph",
                op.op.name()
            )))
        }
    })
}
