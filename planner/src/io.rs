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

    /// `reads` as exactly `N` ids.
    fn read_ids<const N: usize>(&self) -> Result<[TensorId; N], IoError> {
        let r = self.reads(N)?;
        Ok(r.try_into().expect("reads() checked the length"))
    }

    /// `writes` as exactly `N` ids, then its workspace and scratch slots.
    fn write_ids<const N: usize>(&self) -> Result<([TensorId; N], TensorId, TensorId), IoError> {
        let (w, ws, scratch) = self.writes(N)?;
        Ok((
            w.try_into().expect("writes() checked the length"),
            ws,
            scratch,
        ))
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

/// Declares an I/O struct: `$ty` with the given fields, then the two slots every step's
/// `writes` end with.
macro_rules! io_struct {
    ($(#[$doc:meta])* $ty:ident { $($(#[$fdoc:meta])* $f:ident: $fty:ty,)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $ty {
            $($(#[$fdoc])* pub $f: $fty,)*
            /// The op's workspace ([`crate::Op::workspace_elems`]), or NONE.
            pub ws: TensorId,
            /// The op's f32 scratch ([`crate::Op::scratch_f32_elems`]), or NONE.
            pub scratch: TensorId,
        }
    };
}

/// Declares the I/O structs whose lists have a fixed shape, each from its positional
/// contract, and their `of`: the fields `reads` and `writes` hold, in list order (`writes`
/// before its two trailing slots), and the parameters by list index, required (`need`) or
/// `NONE` when absent (`opt`). Wrong lists get the errors of [`Lists`].
macro_rules! positional_io {
    ($(
        $(#[$doc:meta])*
        $ty:ident: reads [$($(#[$rdoc:meta])* $r:ident),* $(,)?],
            writes [$($(#[$wdoc:meta])* $w:ident),* $(,)?]
            $(, params [$($(#[$pdoc:meta])* $p:ident = $kind:ident($k:literal)),* $(,)?])?;
    )*) => {$(
        io_struct! {
            $(#[$doc])*
            $ty {
                $($(#[$rdoc])* $r: TensorId,)*
                $($(#[$wdoc])* $w: TensorId,)*
                $($($(#[$pdoc])* $p: ParamId,)*)?
            }
        }

        impl $ty {
            /// Decodes `step`'s lists by the contract above.
            pub fn of(step: &PlanStep) -> Result<Self, IoError> {
                let l = Lists { step };
                let [$($r),*] = l.read_ids()?;
                let ([$($w),*], ws, scratch) = l.write_ids()?;
                Ok($ty {
                    $($r,)*
                    $($w,)*
                    $($($p: positional_io!(@param l, $kind, $k),)*)?
                    ws,
                    scratch,
                })
            }
        }
    )*};
    (@param $l:ident, need, $k:literal) => {
        $l.need_param($k)?
    };
    (@param $l:ident, opt, $k:literal) => {
        $l.param($k)
    };
}

positional_io! {
    /// One input, one output: casts, pools, inference batch norm, activations (forward).
    UnaryForward: reads [x], writes [y];
    /// The backward of an op whose gradient needs only `dy`: casts, average pools.
    UnaryBackward: reads [dy], writes [dx];
    /// Dense, conv2d, depthwise and transposed conv: `y = x ⊛ weight + bias`. `ws` holds the
    /// im2col / col2im columns, `scratch` the f32 panels of a 16-bit GEMM.
    LinearForward: reads [x], writes [y], params [
        weight = need(0),
        /// Or NONE without bias.
        bias = opt(1),
    ];
    /// Max pooling keeps the window's arg-max (u8) for its backward.
    MaxPoolForward: reads [x], writes [y, argmax];
    /// One saved tensor and `dy` → `dx`: max pool (arg-max), dropout (mask), activations (their
    /// output or input, per [`crate::Activation::backward_reads_output`]).
    SavedBackward: reads [saved, dy], writes [dx];
    /// Training-mode batch norm: normalised input and per-channel statistics for backward; the
    /// running statistics (persistent) move in the forward phase only.
    BatchNormForward: reads [x], writes [y, x_hat, mean, inv_std],
        params [gamma = need(0), beta = need(1), running_mean = need(2), running_var = need(3)];
    /// Batch norm (training) or layer norm backward: `x̂`, `1/σ` and `dy` → `dx`, `dγ`, `dβ`.
    NormBackward: reads [x_hat, inv_std, dy], writes [dx],
        params [gamma = need(0), beta = need(1)];
    /// Batch-norm backward that rebuilds `x̂ = (x − mean)·1/σ` from the input another op
    /// keeps ([`Op::BatchNorm`]'s `rebuild_x_hat`): `x`, the hi/lo mean, `1/σ` and `dy` →
    /// `dx`, `dγ`, `dβ`.
    BatchNormRebuildBackward: reads [x, mean, inv_std, dy], writes [dx],
        params [gamma = need(0), beta = need(1)];
    /// Layer-norm backward that rebuilds `x̂` from the input another op keeps
    /// ([`Op::LayerNorm`]'s `rebuild_x_hat`): `x`, `1/σ` and `dy` → `dx`, `dγ`, `dβ`; each row's
    /// mean is recomputed into the step's scratch.
    LayerNormRebuildBackward: reads [x, rstd, dy], writes [dx],
        params [gamma = need(0), beta = need(1)];
    /// Inference-mode batch norm from the running statistics.
    BatchNormInferenceForward: reads [x], writes [y],
        params [gamma = need(0), beta = need(1), running_mean = need(2), running_var = need(3)];
    /// Layer norm: normalised input and per-row `1/σ` for backward.
    LayerNormForward: reads [x], writes [y, x_hat, rstd],
        params [gamma = need(0), beta = need(1)];
    /// Dropout keeps its u8 mask (and recompute regenerates it from the counter-based RNG).
    DropoutForward: reads [x], writes [y, mask];
    /// Concatenation of two inputs along the last axis.
    ConcatForward: reads [a, b], writes [y];
    /// [`ConcatForward`]'s backward: `dy` split into the two inputs' gradients.
    ConcatBackward: reads [dy], writes [
        /// Or NONE.
        da,
        /// Or NONE.
        db,
    ];
    /// Rows of the table gathered by token id.
    EmbeddingForward: reads [ids], writes [y], params [table = need(0)];
    /// The table's gradient scattered from `dy` (ids take no gradient: no `dx`).
    EmbeddingBackward: reads [ids, dy], writes [], params [table = need(0)];
    /// The VAE's sampling `z = mean + exp(log_var / 2)·ε`.
    SampleNormalForward: reads [mean, log_var], writes [z];
    /// [`SampleNormalForward`]'s backward (ε regenerated from the RNG).
    SampleNormalBackward: reads [log_var, dz], writes [
        /// Or NONE.
        dmean,
        /// Or NONE.
        dlog_var,
    ];
    /// Gradient accumulation `g = a + b` (backward phase).
    AccumulateIo: reads [a, b], writes [g];
    /// A loss on a prediction and a target (labels, targets): its value and the gradient it
    /// starts (of the prediction, or of the fused softmax's or sigmoid's input). `ws` holds the
    /// softmax probabilities of a from-logits loss.
    LossIo: reads [prediction, target], writes [
        value,
        /// Or NONE in an inference plan.
        grad,
    ];
    /// The VAE's KL divergence: value and both inputs' gradients.
    KlIo: reads [mean, log_var], writes [
        value,
        /// Or NONE.
        dmean,
        /// Or NONE.
        dlog_var,
    ];
}

// The structs whose lists vary in shape, decoded by hand below.

io_struct! {
    /// The backward of [`LinearForward`]: the weight gradient reads the saved `x`.
    LinearBackward {
        /// Or NONE when no parameter of the layer is trained (then only `dx` is computed).
        x: TensorId,
        dy: TensorId,
        /// Or NONE when the input takes no gradient.
        dx: TensorId,
        weight: ParamId,
        /// Or NONE without bias.
        bias: ParamId,
    }
}

/// A sum of `xs` (two or more).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddForward {
    pub xs: Vec<TensorId>,
    pub y: TensorId,
    pub ws: TensorId,
    pub scratch: TensorId,
}

io_struct! {
    /// Scaled dot-product attention over a packed `qkv`: probabilities, with dropout its mask
    /// and the dropped probabilities (both NONE without dropout), and the context.
    AttentionForward {
        qkv: TensorId,
        probs: TensorId,
        mask: TensorId,
        probs_dropped: TensorId,
        ctx: TensorId,
    }
}

io_struct! {
    /// [`AttentionForward`]'s backward (`mask` and `probs_dropped` NONE without dropout); `ws`
    /// holds the `[batch, heads, seq, seq]` score gradients.
    AttentionBackward {
        qkv: TensorId,
        probs: TensorId,
        mask: TensorId,
        probs_dropped: TensorId,
        dctx: TensorId,
        dqkv: TensorId,
    }
}

positional_io! {
    /// Memory-efficient attention: the log-sum-exp per query row (f32) and the context.
    FlashAttentionForward: reads [qkv], writes [lse, ctx];
    /// [`FlashAttentionForward`]'s backward: recomputes the probabilities from `qkv` and `lse`.
    FlashAttentionBackward: reads [qkv, lse, ctx, dctx], writes [dqkv];
    /// A pipeline stage's send of an activation or a gradient to another stage.
    SendIo: reads [x], writes [];
    /// A pipeline stage's receive of what another stage sends it.
    RecvIo: reads [], writes [x];
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
    BatchNormRebuildBackward(BatchNormRebuildBackward),
    LayerNormRebuildBackward(LayerNormRebuildBackward),
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
    FlashAttention(FlashAttentionForward),
    FlashAttentionBackward(FlashAttentionBackward),
    SampleNormal(SampleNormalForward),
    SampleNormalBackward(SampleNormalBackward),
    Accumulate(AccumulateIo),
    Loss(LossIo),
    Kl(KlIo),
    Send(SendIo),
    Recv(RecvIo),
    /// Update-phase steps (check finite, optimizer update): no tensors.
    None,
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

/// The pattern of every loss of a prediction and a target — the ops whose loss steps decode
/// as [`LossIo`] — for the matches over [`Op`] that treat them alike (a new loss is added here
/// once; the matches stay exhaustive).
#[macro_export]
macro_rules! loss_ops {
    () => {
        $crate::Op::SoftmaxCrossEntropy { .. }
            | $crate::Op::SoftmaxCrossEntropyFromLogits { .. }
            | $crate::Op::SigmoidBinaryCrossentropy { .. }
            | $crate::Op::BinaryCrossentropyFromLogits { .. }
            | $crate::Op::BinaryCrossentropy { .. }
            | $crate::Op::MeanSquaredError { .. }
    };
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
            (
                Op::CheckFinite
                | Op::AllReduceGradients { .. }
                | Op::Update
                | Op::AllGatherParams { .. },
                _,
            ) => StepIo::None,
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
                backward,
            ) => {
                if backward {
                    StepIo::LinearBackward(LinearBackward::of(step)?)
                } else {
                    StepIo::Linear(LinearForward::of(step)?)
                }
            }
            (Op::MaxPool2d { .. }, false) => StepIo::MaxPool(MaxPoolForward::of(step)?),
            (Op::MaxPool2d { .. } | Op::Dropout { .. } | Op::Activation { .. }, true) => {
                StepIo::SavedBackward(SavedBackward::of(step)?)
            }
            (Op::BatchNorm { .. }, false) => StepIo::BatchNorm(BatchNormForward::of(step)?),
            (Op::BatchNormInference { .. }, false) => {
                StepIo::BatchNormInference(BatchNormInferenceForward::of(step)?)
            }
            (Op::LayerNorm { .. }, false) => StepIo::LayerNorm(LayerNormForward::of(step)?),
            (
                Op::BatchNorm {
                    rebuild_x_hat: true,
                    ..
                },
                true,
            ) => StepIo::BatchNormRebuildBackward(BatchNormRebuildBackward::of(step)?),
            (
                Op::LayerNorm {
                    rebuild_x_hat: true,
                    ..
                },
                true,
            ) => StepIo::LayerNormRebuildBackward(LayerNormRebuildBackward::of(step)?),
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
            (Op::FlashAttention { .. }, false) => {
                StepIo::FlashAttention(FlashAttentionForward::of(step)?)
            }
            (Op::FlashAttention { .. }, true) => {
                StepIo::FlashAttentionBackward(FlashAttentionBackward::of(step)?)
            }
            (Op::SampleNormal { .. }, false) => {
                StepIo::SampleNormal(SampleNormalForward::of(step)?)
            }
            (Op::SampleNormal { .. }, true) => {
                StepIo::SampleNormalBackward(SampleNormalBackward::of(step)?)
            }
            (Op::Accumulate { .. }, true) => StepIo::Accumulate(AccumulateIo::of(step)?),
            (loss_ops!(), false) => StepIo::Loss(LossIo::of(step)?),
            (Op::KlNormal { .. }, false) => StepIo::Kl(KlIo::of(step)?),
            (Op::SendTensor { .. }, _) => StepIo::Send(SendIo::of(step)?),
            (Op::RecvTensor { .. }, _) => StepIo::Recv(RecvIo::of(step)?),
            (
                Op::InputCast { .. }
                | Op::BatchNormInference { .. }
                | Op::Add { .. }
                | Op::Accumulate { .. }
                | loss_ops!()
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
