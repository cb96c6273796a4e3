//! `StepGraph`: the training step's gradient rules — for every forward op, exactly which
//! forward tensors its backward reads (these saved tensors ARE the activation memory),
//! which output gradients it consumes and which input gradients it produces.

use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{Graph, TensorId};
use crate::op::Op;
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
}

impl StepGraph {
    /// Derives the backward rules of `graph`.
    pub fn build(graph: &Graph, spec: &ModelSpec) -> Result<StepGraph, PlanError> {
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
            let (saved, grad_outputs, in_place_bwd, in_place_fwd): (
                Vec<TensorId>,
                Vec<TensorId>,
                bool,
                Option<usize>,
            ) = match op.op {
                Op::InputCast { .. } => (vec![], vec![], false, None),
                Op::Cast { .. } => (vec![], vec![op.outputs[0]], false, None),
                Op::Dense { .. }
                | Op::Conv2d { .. }
                | Op::DepthwiseConv2d { .. }
                | Op::Conv2dTranspose { .. } => {
                    // dW = xᵀ·dy needs x; dx = dy·Wᵀ needs only the (persistent) weights.
                    let saved = if param_grads {
                        vec![op.inputs[0]]
                    } else {
                        vec![]
                    };
                    (saved, vec![op.outputs[0]], false, None)
                }
                Op::MaxPool2d { .. } => (vec![op.outputs[1]], vec![op.outputs[0]], false, None),
                Op::AvgPool2d { .. } | Op::GlobalAvgPool { .. } => {
                    (vec![], vec![op.outputs[0]], false, None)
                }
                Op::BatchNorm { .. } => (
                    vec![op.outputs[1], op.outputs[3]],
                    vec![op.outputs[0]],
                    false,
                    None,
                ),
                Op::LayerNorm { .. } => (
                    vec![op.outputs[1], op.outputs[2]],
                    vec![op.outputs[0]],
                    false,
                    None,
                ),
                Op::Dropout { .. } => (vec![op.outputs[1]], vec![op.outputs[0]], true, Some(0)),
                Op::Activation { act, .. } => {
                    let s = if act.backward_reads_output() {
                        op.outputs[0]
                    } else {
                        op.inputs[0]
                    };
                    let fwd = (act.backward_reads_output() && same_dtype(x, y)).then_some(0);
                    (vec![s], vec![op.outputs[0]], same_dtype(x, y), fwd)
                }
                Op::Add { .. } => (vec![], vec![op.outputs[0]], false, Some(0)),
                Op::Concat { .. } => (vec![], vec![op.outputs[0]], false, None),
                Op::Embedding { .. } => (vec![op.inputs[0]], vec![op.outputs[0]], false, None),
                Op::Attention { dropout, .. } => {
                    let mut s = vec![op.inputs[0], op.outputs[0]];
                    if dropout > 0.0 {
                        s.push(op.outputs[1]);
                        s.push(op.outputs[2]);
                    }
                    (s, vec![*op.outputs.last().expect("ctx")], false, None)
                }
                Op::SampleNormal { .. } => (vec![op.inputs[1]], vec![op.outputs[0]], false, None),
                other => {
                    return Err(PlanError::internal(format!(
                        "{} is not a forward op",
                        other.name()
                    )))
                }
            };
            forward_in_place.push(in_place_fwd);
            backward.push(needed.then_some(BackwardRule {
                saved,
                grad_outputs,
                grad_inputs,
                param_grads,
                in_place: in_place_bwd,
            }));
        }
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
        }
    }
}

/// The outputs of an op that carry gradients (not masks, indices or statistics).
pub fn primary_outputs<'a>(op: &Op, outputs: &'a [TensorId]) -> &'a [TensorId] {
    match op {
        Op::Attention { .. } => &outputs[outputs.len() - 1..],
        _ => &outputs[..1.min(outputs.len())],
    }
}
