//! Every step's tensors and parameters by name: the one place that says what a plan step's
//! positional `reads`, `writes` and `params` hold for each op and phase. Executors read
//! `LayerNormForward::of(step)?.x_hat`, never `writes[1]`; [`StepIo::of`] decodes any step.
//!
//! The positions are the plan contract (`memwise.plan/1` lists them as they are): forward
//! and recompute steps read the op's inputs and write its outputs; backward steps read what
//! the op saved for backward (in the order given here), then the output gradients, and write
//! one gradient per input (`NONE` for an input that takes none); loss steps read prediction
//! and target and write the value, then one gradient per prediction-side input. Every
//! forward, recompute, loss and backward step's `writes` end with two more slots, the op's
//! workspace and its f32 scratch ([`crate::Op::workspace_elems`],
//! [`crate::Op::scratch_f32_elems`]), each `NONE` when unused. Update steps have no tensors.
//! Absent slots hold [`NONE`]; a field documented "or NONE" may be absent.

use crate::op::Op;
use crate::plan::{Phase, PlanStep, NONE};

/// A tensor id of the plan (`NONE` where the field's doc allows it).
pub type TensorId = u32;
/// A parameter id of the plan (`NONE` where absent, e.g. no bias).
pub type ParamId = u32;

/// A step whose lists do not have the shape its op and phase require.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoError(pub String);

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IoError {}

/// The positional lists of one step, read with bounds checks.
struct Lists<'a> {
    step: &'a PlanStep,
}

impl Lists<'_> {
    fn err(&self, what: &str) -> IoError {
        let s = self.step;
        IoError(format!(
            "step {} ({} {} of layer `{}`): {what} (reads {:?}, writes {:?}, params {:?})",
            s.index,
            s.phase.name(),
            s.op.name(),
            s.layer,
            &s.reads[..],
            &s.writes[..],
            &s.params[..]
        ))
    }

    /// `reads` has exactly `n` entries.
    fn reads(&self, n: usize) -> Result<&[u32], IoError> {
        let r = &self.step.reads[..];
        (r.len() == n)
            .then_some(r)
            .ok_or_else(|| self.err(&format!("expected {n} reads")))
    }

    /// `writes` has exactly `n` entries before its workspace and scratch slots.
    fn writes(&self, n: usize) -> Result<(&[u32], TensorId, TensorId), IoError> {
        let w = &self.step.writes[..];
        if w.len() != n + 2 {
            return Err(self.err(&format!("expected {n} writes and the two trailing slots")));
        }
        Ok((&w[..n], w[n], w[n + 1]))
    }

    /// Parameter `k`, or `NONE` past the list's end.
    fn param(&self, k: usize) -> ParamId {
        self.step.params.get(k).copied().unwrap_or(NONE)
    }

    /// Parameter `k`, required.
    fn need_param(&self, k: usize) -> Result<ParamId, IoError> {
        self.step
            .params
            .get(k)
            .copied()
            .filter(|&p| p != NONE)
            .ok_or_else(|| self.err(&format!("parameter {k} is missing")))
    }
}

/// One input, one output: casts, pools, inference batch norm, activations (forward).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnaryForward {
    pub x: TensorId,
    pub y: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// The backward of an op whose gradient needs only `dy`: casts, average pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnaryBackward {
    pub dy: TensorId,
    pub dx: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Dense, conv2d, depthwise and transposed conv: `y = x ⊛ weight + bias`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearForward {
    pub x: TensorId,
    pub y: TensorId,
    pub weight: ParamId,
    /// Or NONE without bias.
    pub bias: ParamId,
    /// The im2col / col2im columns, or NONE.
    pub ws: TensorId,
    /// The f32 panels of a 16-bit GEMM, or NONE.
    pub scratch: TensorId,
}

/// The backward of [`LinearForward`]: the weight gradient reads the saved `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearBackward {
    /// Or NONE when no parameter of the layer is trained (then only `dx` is computed).
    pub x: TensorId,
    pub dy: TensorId,
    /// Or NONE when the input takes no gradient.
    pub dx: TensorId,
    pub weight: ParamId,
    /// Or NONE without bias.
    pub bias: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Max pooling keeps the window's arg-max (u8) for its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPoolForward {
    pub x: TensorId,
    pub y: TensorId,
    pub argmax: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// One saved tensor and `dy` → `dx`: max pool (arg-max), dropout (mask), activations (their
/// output or input, per [`crate::Activation::backward_reads_output`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedBackward {
    pub saved: TensorId,
    pub dy: TensorId,
    pub dx: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Training-mode batch norm: normalised input and per-channel statistics for backward; the
/// running statistics (persistent) move in the forward phase only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormForward {
    pub x: TensorId,
    pub y: TensorId,
    pub x_hat: TensorId,
    pub mean: TensorId,
    pub inv_std: TensorId,
    pub gamma: ParamId,
    pub beta: ParamId,
    pub running_mean: ParamId,
    pub running_var: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Batch norm (training) or layer norm backward: `x̂`, `1/σ` and `dy` → `dx`, `dγ`, `dβ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormBackward {
    pub x_hat: TensorId,
    pub inv_std: TensorId,
    pub dy: TensorId,
    pub dx: TensorId,
    pub gamma: ParamId,
    pub beta: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Inference-mode batch norm from the running statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormInferenceForward {
    pub x: TensorId,
    pub y: TensorId,
    pub gamma: ParamId,
    pub beta: ParamId,
    pub running_mean: ParamId,
    pub running_var: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Layer norm: normalised input and per-row `1/σ` for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerNormForward {
    pub x: TensorId,
    pub y: TensorId,
    pub x_hat: TensorId,
    pub rstd: TensorId,
    pub gamma: ParamId,
    pub beta: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Dropout keeps its u8 mask (and recompute regenerates it from the counter-based RNG).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutForward {
    pub x: TensorId,
    pub y: TensorId,
    pub mask: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// A sum of `xs` (two or more).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddForward {
    pub xs: Vec<TensorId>,
    pub y: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Concatenation of two inputs along the last axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConcatForward {
    pub a: TensorId,
    pub b: TensorId,
    pub y: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// [`ConcatForward`]'s backward: `dy` split into the two inputs' gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConcatBackward {
    pub dy: TensorId,
    /// Or NONE.
    pub da: TensorId,
    /// Or NONE.
    pub db: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Rows of the table gathered by token id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingForward {
    pub ids: TensorId,
    pub y: TensorId,
    pub table: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// The table's gradient scattered from `dy` (ids take no gradient: no `dx`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingBackward {
    pub ids: TensorId,
    pub dy: TensorId,
    pub table: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Scaled dot-product attention over a packed `qkv`: probabilities, with dropout its mask and
/// the dropped probabilities, and the context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionForward {
    pub qkv: TensorId,
    pub probs: TensorId,
    /// Or NONE without dropout.
    pub mask: TensorId,
    /// Or NONE without dropout.
    pub probs_dropped: TensorId,
    pub ctx: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// [`AttentionForward`]'s backward; `ws` holds the `[batch, heads, seq, seq]` score gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBackward {
    pub qkv: TensorId,
    pub probs: TensorId,
    /// Or NONE without dropout.
    pub mask: TensorId,
    /// Or NONE without dropout.
    pub probs_dropped: TensorId,
    pub dctx: TensorId,
    pub dqkv: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// The VAE's sampling `z = mean + exp(log_var / 2)·ε`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleNormalForward {
    pub mean: TensorId,
    pub log_var: TensorId,
    pub z: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// [`SampleNormalForward`]'s backward (ε regenerated from the RNG).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleNormalBackward {
    pub log_var: TensorId,
    pub dz: TensorId,
    /// Or NONE.
    pub dmean: TensorId,
    /// Or NONE.
    pub dlog_var: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// Gradient accumulation `g = a + b` (backward phase).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccumulateIo {
    pub a: TensorId,
    pub b: TensorId,
    pub g: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// A loss on a prediction and a target (labels, targets): its value and the gradient it
/// starts (of the prediction, or of the fused softmax's or sigmoid's input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossIo {
    pub prediction: TensorId,
    pub target: TensorId,
    pub value: TensorId,
    /// Or NONE in an inference plan.
    pub grad: TensorId,
    /// The softmax probabilities of a from-logits loss, or NONE.
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// The VAE's KL divergence: value and both inputs' gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KlIo {
    pub mean: TensorId,
    pub log_var: TensorId,
    pub value: TensorId,
    /// Or NONE.
    pub dmean: TensorId,
    /// Or NONE.
    pub dlog_var: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// A decoded step: its op's tensors and parameters by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepIo {
    Unary(UnaryForward),
    UnaryBackward(UnaryBackward),
    Linear(LinearForward),
    LinearBackward(LinearBackward),
    MaxPool(MaxPoolForward),
    SavedBackward(SavedBackward),
    BatchNorm(BatchNormForward),
    BatchNormInference(BatchNormInferenceForward),
    LayerNorm(LayerNormForward),
    NormBackward(NormBackward),
    GroupNorm(GroupNormForward),
    GroupNormBackward(GroupNormBackward),
    PositionalEmbedding(PositionalEmbeddingForward),
    PositionalEmbeddingBackward(PositionalEmbeddingBackward),
    Dropout(DropoutForward),
    Add(AddForward),
    Concat(ConcatForward),
    ConcatBackward(ConcatBackward),
    Embedding(EmbeddingForward),
    EmbeddingBackward(EmbeddingBackward),
    Attention(AttentionForward),
    AttentionBackward(AttentionBackward),
    SampleNormal(SampleNormalForward),
    SampleNormalBackward(SampleNormalBackward),
    Accumulate(AccumulateIo),
    Loss(LossIo),
    Kl(KlIo),
    /// Update-phase steps (check finite, optimizer update): no tensors.
    None,
}

impl UnaryForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(UnaryForward {
            x: r[0],
            y: w[0],
            ws,
            scratch,
        })
    }
}

impl UnaryBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(UnaryBackward {
            dy: r[0],
            dx: w[0],
            ws,
            scratch,
        })
    }
}

impl LinearForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(LinearForward {
            x: r[0],
            y: w[0],
            weight: l.need_param(0)?,
            bias: l.param(1),
            ws,
            scratch,
        })
    }
}

impl LinearBackward {
    /// Reads `[x, dy]`, or `[dy]` when nothing of the layer is trained.
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let (x, dy) = match step.reads[..] {
            [x, dy] => (x, dy),
            [dy] => (NONE, dy),
            _ => return Err(l.err("expected reads [x, dy] or [dy]")),
        };
        let (w, ws, scratch) = l.writes(1)?;
        Ok(LinearBackward {
            x,
            dy,
            dx: w[0],
            weight: l.need_param(0)?,
            bias: l.param(1),
            ws,
            scratch,
        })
    }
}

impl MaxPoolForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(2)?;
        Ok(MaxPoolForward {
            x: r[0],
            y: w[0],
            argmax: w[1],
            ws,
            scratch,
        })
    }
}

impl SavedBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(SavedBackward {
            saved: r[0],
            dy: r[1],
            dx: w[0],
            ws,
            scratch,
        })
    }
}

impl BatchNormForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(4)?;
        Ok(BatchNormForward {
            x: r[0],
            y: w[0],
            x_hat: w[1],
            mean: w[2],
            inv_std: w[3],
            gamma: l.need_param(0)?,
            beta: l.need_param(1)?,
            running_mean: l.need_param(2)?,
            running_var: l.need_param(3)?,
            ws,
            scratch,
        })
    }
}

impl BatchNormInferenceForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(BatchNormInferenceForward {
            x: r[0],
            y: w[0],
            gamma: l.need_param(0)?,
            beta: l.need_param(1)?,
            running_mean: l.need_param(2)?,
            running_var: l.need_param(3)?,
            ws,
            scratch,
        })
    }
}

impl LayerNormForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(3)?;
        Ok(LayerNormForward {
            x: r[0],
            y: w[0],
            x_hat: w[1],
            rstd: w[2],
            gamma: l.need_param(0)?,
            beta: l.need_param(1)?,
            ws,
            scratch,
        })
    }
}

impl NormBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(3)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(NormBackward {
            x_hat: r[0],
            inv_std: r[1],
            dy: r[2],
            dx: w[0],
            gamma: l.need_param(0)?,
            beta: l.need_param(1)?,
            ws,
            scratch,
        })
    }
}

impl DropoutForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(2)?;
        Ok(DropoutForward {
            x: r[0],
            y: w[0],
            mask: w[1],
            ws,
            scratch,
        })
    }
}

impl AddForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        if step.reads.len() < 2 {
            return Err(l.err("an add reads two or more tensors"));
        }
        let (w, ws, scratch) = l.writes(1)?;
        Ok(AddForward {
            xs: step.reads.to_vec(),
            y: w[0],
            ws,
            scratch,
        })
    }
}

impl ConcatForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(ConcatForward {
            a: r[0],
            b: r[1],
            y: w[0],
            ws,
            scratch,
        })
    }
}

impl ConcatBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(2)?;
        Ok(ConcatBackward {
            dy: r[0],
            da: w[0],
            db: w[1],
            ws,
            scratch,
        })
    }
}

impl EmbeddingForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(EmbeddingForward {
            ids: r[0],
            y: w[0],
            table: l.need_param(0)?,
            ws,
            scratch,
        })
    }
}

impl EmbeddingBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (_, ws, scratch) = l.writes(0)?;
        Ok(EmbeddingBackward {
            ids: r[0],
            dy: r[1],
            table: l.need_param(0)?,
            ws,
            scratch,
        })
    }
}

impl AttentionForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (probs, mask, probs_dropped, ctx, ws, scratch) = match step.writes.len() {
            4 => {
                let (w, ws, sc) = l.writes(2)?;
                (w[0], NONE, NONE, w[1], ws, sc)
            }
            _ => {
                let (w, ws, sc) = l.writes(4)?;
                (w[0], w[1], w[2], w[3], ws, sc)
            }
        };
        Ok(AttentionForward {
            qkv: r[0],
            probs,
            mask,
            probs_dropped,
            ctx,
            ws,
            scratch,
        })
    }
}

impl AttentionBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let (qkv, probs, mask, probs_dropped, dctx) = match step.reads[..] {
            [qkv, probs, dctx] => (qkv, probs, NONE, NONE, dctx),
            [qkv, probs, mask, dropped, dctx] => (qkv, probs, mask, dropped, dctx),
            _ => return Err(l.err("expected reads [qkv, probs, (mask, probs_dropped,) dctx]")),
        };
        let (w, ws, scratch) = l.writes(1)?;
        Ok(AttentionBackward {
            qkv,
            probs,
            mask,
            probs_dropped,
            dctx,
            dqkv: w[0],
            ws,
            scratch,
        })
    }
}

impl SampleNormalForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(SampleNormalForward {
            mean: r[0],
            log_var: r[1],
            z: w[0],
            ws,
            scratch,
        })
    }
}

impl SampleNormalBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(2)?;
        Ok(SampleNormalBackward {
            log_var: r[0],
            dz: r[1],
            dmean: w[0],
            dlog_var: w[1],
            ws,
            scratch,
        })
    }
}

impl AccumulateIo {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(AccumulateIo {
            a: r[0],
            b: r[1],
            g: w[0],
            ws,
            scratch,
        })
    }
}

impl LossIo {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(2)?;
        Ok(LossIo {
            prediction: r[0],
            target: r[1],
            value: w[0],
            grad: w[1],
            ws,
            scratch,
        })
    }
}

impl KlIo {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(2)?;
        let (w, ws, scratch) = l.writes(3)?;
        Ok(KlIo {
            mean: r[0],
            log_var: r[1],
            value: w[0],
            dmean: w[1],
            dlog_var: w[2],
            ws,
            scratch,
        })
    }
}

impl StepIo {
    /// Decodes any step by its op and phase. An op that has no step in this phase (an add's
    /// backward, an input cast's) is an error, as is any list of the wrong shape.
    pub fn of(step: &PlanStep) -> Result<StepIo, IoError> {
        let backward = step.phase == Phase::Backward;
        let none = || {
            Err(Lists { step }.err(&format!(
                "{} has no {} step",
                step.op.name(),
                step.phase.name()
            )))
        };
        Ok(match (step.op, backward) {
            (Op::CheckFinite | Op::Update, _) => StepIo::None,
            (
                Op::InputCast { .. }
                | Op::Cast { .. }
                | Op::AvgPool2d { .. }
                | Op::GlobalAvgPool { .. }
                | Op::Activation { .. },
                false,
            ) => StepIo::Unary(UnaryForward::of(step)?),
            (Op::Cast { .. } | Op::AvgPool2d { .. } | Op::GlobalAvgPool { .. }, true) => {
                StepIo::UnaryBackward(UnaryBackward::of(step)?)
            }
            (
                Op::Dense { .. }
                | Op::Conv2d { .. }
                | Op::DepthwiseConv2d { .. }
                | Op::Conv2dTranspose { .. },
                false,
            ) => StepIo::Linear(LinearForward::of(step)?),
            (
                Op::Dense { .. }
                | Op::Conv2d { .. }
                | Op::DepthwiseConv2d { .. }
                | Op::Conv2dTranspose { .. },
                true,
            ) => StepIo::LinearBackward(LinearBackward::of(step)?),
            (Op::MaxPool2d { .. }, false) => StepIo::MaxPool(MaxPoolForward::of(step)?),
            (Op::MaxPool2d { .. } | Op::Dropout { .. } | Op::Activation { .. }, true) => {
                StepIo::SavedBackward(SavedBackward::of(step)?)
            }
            (Op::BatchNorm { .. }, false) => StepIo::BatchNorm(BatchNormForward::of(step)?),
            (Op::BatchNormInference { .. }, false) => {
                StepIo::BatchNormInference(BatchNormInferenceForward::of(step)?)
            }
            (Op::LayerNorm { .. }, false) => StepIo::LayerNorm(LayerNormForward::of(step)?),
            (Op::BatchNorm { .. } | Op::LayerNorm { .. }, true) => {
                StepIo::NormBackward(NormBackward::of(step)?)
            }
            (Op::GroupNorm { .. }, false) => StepIo::GroupNorm(GroupNormForward::of(step)?),
            (Op::GroupNorm { .. }, true) => StepIo::GroupNormBackward(GroupNormBackward::of(step)?),
            (Op::Dropout { .. }, false) => StepIo::Dropout(DropoutForward::of(step)?),
            (Op::Add { .. }, false) => StepIo::Add(AddForward::of(step)?),
            (Op::Concat { .. }, false) => StepIo::Concat(ConcatForward::of(step)?),
            (Op::Concat { .. }, true) => StepIo::ConcatBackward(ConcatBackward::of(step)?),
            (Op::Embedding { .. }, false) => StepIo::Embedding(EmbeddingForward::of(step)?),
            (Op::Embedding { .. }, true) => StepIo::EmbeddingBackward(EmbeddingBackward::of(step)?),
            (Op::PositionalEmbedding { .. }, false) => {
                StepIo::PositionalEmbedding(PositionalEmbeddingForward::of(step)?)
            }
            (Op::PositionalEmbedding { .. }, true) => {
                StepIo::PositionalEmbeddingBackward(PositionalEmbeddingBackward::of(step)?)
            }
            (Op::Attention { .. }, false) => StepIo::Attention(AttentionForward::of(step)?),
            (Op::Attention { .. }, true) => StepIo::AttentionBackward(AttentionBackward::of(step)?),
            (Op::SampleNormal { .. }, false) => {
                StepIo::SampleNormal(SampleNormalForward::of(step)?)
            }
            (Op::SampleNormal { .. }, true) => {
                StepIo::SampleNormalBackward(SampleNormalBackward::of(step)?)
            }
            (Op::Accumulate { .. }, true) => StepIo::Accumulate(AccumulateIo::of(step)?),
            (
                Op::SoftmaxCrossEntropy { .. }
                | Op::SoftmaxCrossEntropyFromLogits { .. }
                | Op::SigmoidBinaryCrossentropy { .. }
                | Op::BinaryCrossentropyFromLogits { .. }
                | Op::BinaryCrossentropy { .. }
                | Op::MeanSquaredError { .. },
                false,
            ) => StepIo::Loss(LossIo::of(step)?),
            (Op::KlNormal { .. }, false) => StepIo::Kl(KlIo::of(step)?),
            (
                Op::InputCast { .. }
                | Op::BatchNormInference { .. }
                | Op::Add { .. }
                | Op::Accumulate { .. }
                | Op::SoftmaxCrossEntropy { .. }
                | Op::SoftmaxCrossEntropyFromLogits { .. }
                | Op::SigmoidBinaryCrossentropy { .. }
                | Op::BinaryCrossentropyFromLogits { .. }
                | Op::BinaryCrossentropy { .. }
                | Op::MeanSquaredError { .. }
                | Op::KlNormal { .. },
                _,
            ) => return none(),
        })
    }
}

/// Group norm and RMS norm ([`Op::GroupNorm`]): normalised input and per-(sample, group)
/// `1/σ` for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupNormForward {
    pub x: TensorId,
    pub y: TensorId,
    pub x_hat: TensorId,
    pub rstd: TensorId,
    pub gamma: ParamId,
    /// Or NONE: RMS norm has no shift.
    pub beta: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// [`GroupNormForward`]'s backward: `x̂`, `1/σ` and `dy` → `dx`, `dγ` (and `dβ`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupNormBackward {
    pub x_hat: TensorId,
    pub rstd: TensorId,
    pub dy: TensorId,
    pub dx: TensorId,
    pub gamma: ParamId,
    /// Or NONE: RMS norm has no shift.
    pub beta: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

impl GroupNormForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(3)?;
        Ok(GroupNormForward {
            x: r[0],
            y: w[0],
            x_hat: w[1],
            rstd: w[2],
            gamma: l.need_param(0)?,
            beta: l.param(1),
            ws,
            scratch,
        })
    }
}

impl GroupNormBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(3)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(GroupNormBackward {
            x_hat: r[0],
            rstd: r[1],
            dy: r[2],
            dx: w[0],
            gamma: l.need_param(0)?,
            beta: l.param(1),
            ws,
            scratch,
        })
    }
}

/// The positional embedding ([`Op::PositionalEmbedding`]): its table added to `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PositionalEmbeddingForward {
    pub x: TensorId,
    /// May be `x` (in place).
    pub y: TensorId,
    pub table: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

/// [`PositionalEmbeddingForward`]'s backward: `dx = dy`, the table's gradient summed from `dy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PositionalEmbeddingBackward {
    pub dy: TensorId,
    /// May be `dy` (in place).
    pub dx: TensorId,
    pub table: ParamId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

impl PositionalEmbeddingForward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(PositionalEmbeddingForward {
            x: r[0],
            y: w[0],
            table: l.need_param(0)?,
            ws,
            scratch,
        })
    }
}

impl PositionalEmbeddingBackward {
    pub fn of(step: &PlanStep) -> Result<Self, IoError> {
        let l = Lists { step };
        let r = l.reads(1)?;
        let (w, ws, scratch) = l.writes(1)?;
        Ok(PositionalEmbeddingBackward {
            dy: r[0],
            dx: w[0],
            table: l.need_param(0)?,
            ws,
            scratch,
        })
    }
}
