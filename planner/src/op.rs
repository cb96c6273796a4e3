//! `Op`: what one step computes, with every dimension its kernel needs. Shared by the
//! planner (which emits steps) and the runtime (which dispatches them to kernels).
//!
//! A step is `(phase, op)`: the same `Op` runs its forward kernel in the forward and
//! recompute phases and its backward kernel in the backward phase. The `reads`/`writes` of a
//! step are positional; the order for each op is documented on its variant as
//! `fwd: reads → writes; bwd: reads → writes`, where `dX` is the gradient of `X`. A `NONE`
//! entry means "not needed" (an input that takes no gradient).
//!
//! Every forward, recompute, loss and backward step's `writes` end with two more slots,
//! `[…, ws, scratch]`: the op's workspace in its compute dtype ([`Op::workspace_elems`]:
//! im2col columns, attention score gradients) and the f32 scratch of half-precision GEMMs
//! ([`Op::scratch_f32_elems`]), each `NONE` when the op needs none. Update steps have no
//! tensors.

use crate::plan::{RustWriter, ToRust};
use crate::spec::{Activation, Reduction};

pub use memwise_geometry::{out_len, transpose_out_len, Window2d};

/// Declares the ops, each once: the [`Op`] enum (a variant, its fields and its docs) and its
/// name in the plan JSON, from which [`Op::name`] and `Op`'s `ToRust` writer (what the macro
/// emits for `const PLAN`) are generated. A name may read the variant's fields
/// (`act.name()`).
macro_rules! ops {
    ($($(#[$doc:meta])* $v:ident $({ $($f:ident : $t:ty),* $(,)? })? = $name:expr;)*) => {
        /// The operation a step performs.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Op {
            $($(#[$doc])* $v $({ $($f: $t),* })?,)*
        }

        impl Op {
            /// Name used in the plan JSON.
            // Each arm binds every field of its variant; a name reads at most one of them.
            #[allow(unused_variables)]
            pub fn name(&self) -> &'static str {
                match self {
                    $(Op::$v $({ $($f),* })? => $name,)*
                }
            }
        }

        crate::plan::enum_to_rust!(Op, "Op", [$($v $({ $($f),* })?),*]);
    };
}

ops! {
    /// Stored input (u8 / float) → compute dtype, times `scale`. fwd: `[x] → [y]`; no bwd.
    InputCast { elems: usize, scale: f32 } = "input_cast";
    /// Between float dtypes. fwd `[x] → [y]`; bwd `[dy] → [dx]`.
    Cast { elems: usize } = "cast";
    /// `y = x·W + b` over `rows` rows. fwd `[x] → [y]`; bwd `[x, dy] → [dx]`.
    Dense {
        rows: usize,
        in_features: usize,
        units: usize,
        bias: bool,
    } = "dense";
    /// im2col + GEMM, `chunk` samples lowered at a time. fwd `[x] → [y]`;
    /// bwd `[x, dy] → [dx]`; the im2col columns are the `ws` slot.
    Conv2d {
        dims: Window2d,
        bias: bool,
        chunk: usize,
    } = "conv2d";
    /// Direct depthwise conv, `c_out = c_in · multiplier`. fwd `[x] → [y]`; bwd `[x, dy] → [dx]`.
    DepthwiseConv2d { dims: Window2d, bias: bool } = "depthwise_conv2d";
    /// Transposed conv (col2im of x·Wᵀ), chunked. fwd `[x] → [y]`; bwd `[x, dy] → [dx]`.
    Conv2dTranspose {
        dims: Window2d,
        bias: bool,
        chunk: usize,
    } = "conv2d_transpose";
    /// fwd `[x] → [y, argmax(u8)]`; bwd `[argmax, dy] → [dx]`.
    MaxPool2d { dims: Window2d } = "max_pool2d";
    /// fwd `[x] → [y]`; bwd `[dy] → [dx]`.
    AvgPool2d { dims: Window2d } = "avg_pool2d";
    /// `[n, hw, c] → [n, c]`. fwd `[x] → [y]`; bwd `[dy] → [dx]`.
    GlobalAvgPool { n: usize, hw: usize, c: usize } = "global_avg_pool";
    /// Training-mode batch norm over `rows × channels`. fwd `[x] → [y, x_hat, mean, inv_std]`
    /// (`mean` f32 `[2, channels]`: the batch mean as an f32 hi/lo pair; the running
    /// statistics, persistent, move in the forward phase only); bwd `[x_hat, inv_std, dy] →
    /// [dx]`, or with `rebuild_x_hat` `[x, mean, inv_std, dy] → [dx]`: another op keeps the
    /// input for its backward anyway, so x̂ is rebuilt from it instead of kept.
    BatchNorm {
        rows: usize,
        channels: usize,
        momentum: f32,
        epsilon: f32,
        rebuild_x_hat: bool,
    } = "batch_norm";
    /// Inference-mode batch norm from the running statistics. fwd `[x] → [y]`; no bwd.
    BatchNormInference {
        rows: usize,
        channels: usize,
        epsilon: f32,
    } = "batch_norm_inference";
    /// fwd `[x] → [y, x_hat, rstd]`; bwd `[x_hat, rstd, dy] → [dx]`, or with `rebuild_x_hat`
    /// `[x, rstd, dy] → [dx]`: another op keeps the input for its backward anyway, so the
    /// backward recomputes each row's mean (into the op's f32 scratch, one per row) and
    /// rebuilds x̂ from the input instead of keeping it.
    LayerNorm {
        rows: usize,
        features: usize,
        epsilon: f32,
        rebuild_x_hat: bool,
    } = "layer_norm";
    /// Group normalisation of `[samples, spatial, channels]` per sample over each of `groups`
    /// groups of consecutive channels, with per-channel γ and β; `center: false` is RMS norm
    /// (one group per row of the last axis, `spatial` 1, no mean subtracted, no β), so the two
    /// layers share one op, one walk arm and one kernel pair. fwd `[x] → [y, x_hat, rstd]`
    /// (`rstd` f32 `[samples·groups]`); bwd `[x_hat, rstd, dy] → [dx]`.
    GroupNorm {
        samples: usize,
        spatial: usize,
        channels: usize,
        groups: usize,
        epsilon: f32,
        center: bool,
    } = if *center { "group_norm" } else { "rms_norm" };
    /// Counter-based mask keyed by `key` (the layer) and the step counter, so recompute
    /// reproduces it. fwd `[x] → [y, mask(u8)]`; bwd `[mask, dy] → [dx]`.
    Dropout { elems: usize, rate: f32, key: u32 } = "dropout";
    /// Element-wise activation; softmax is over the last axis of width `cols`.
    /// fwd `[x] → [y]`; bwd `[y or x, dy] → [dx]` (see [`Activation::backward_reads_output`]).
    Activation {
        act: Activation,
        elems: usize,
        cols: usize,
    } = act.name();
    /// Sum of `arity` inputs. fwd `[x1, …] → [y]`; no bwd step (the gradient is shared).
    Add { elems: usize, arity: usize } = "add";
    /// Concatenation of two inputs along the last axis (`rows` rows of widths `a` and `b`).
    /// fwd `[x1, x2] → [y]`; bwd `[dy] → [dx1, dx2]`.
    Concat { rows: usize, a: usize, b: usize } = "concat";
    /// Gather rows of the table. fwd `[ids] → [y]`; bwd `[ids, dy] → []` (table grad only).
    Embedding {
        tokens: usize,
        vocab: usize,
        dim: usize,
    } = "embedding";
    /// A learned table `[seq, dim]` added to every sample of `x [batch, seq, dim]` (GPT-2's
    /// position embedding `wpe`). fwd `[x] → [y]` (y may be x); bwd `[dy] → [dx]` (dx may be dy),
    /// the table's gradient the column sums of `dy`.
    PositionalEmbedding {
        batch: usize,
        seq: usize,
        dim: usize,
    } = "positional_embedding";
    /// Scaled dot-product self-attention over a packed `qkv [batch, seq, 3·heads·head_dim]`.
    /// With dropout: fwd `[qkv] → [probs, mask, probs_dropped, ctx]`, bwd
    /// `[qkv, probs, mask, probs_dropped, dctx] → [dqkv]`; without: fwd
    /// `[qkv] → [probs, ctx]`, bwd `[qkv, probs, dctx] → [dqkv]`.
    /// The backward's `ws` holds `[batch, heads, seq, seq]` score gradients.
    Attention {
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        causal: bool,
        dropout: f32,
        key: u32,
    } = "attention";
    /// The same function as [`Op::Attention`], memory-efficient (FlashAttention): it keeps
    /// one f32 log-sum-exp per query row instead of the `[seq, seq]` probabilities, and its
    /// backward recomputes the scores tile by tile (the dropout mask from the counter-based
    /// stream, element `((b·heads + head)·seq + i)·seq + j` as the materialised mask's).
    /// fwd `[qkv] → [lse, ctx]` (`lse [batch, heads, seq]` f32), bwd
    /// `[qkv, lse, ctx, dctx] → [dqkv]`. The f32 scratch ([`flash_attention_scratch_elems`])
    /// holds `dctx·ctx` per row and the kernels' tile lanes.
    FlashAttention {
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        causal: bool,
        dropout: f32,
        key: u32,
    } = "flash_attention";
    /// `z = mean + exp(log_var/2)·ε`, ε keyed like dropout. fwd `[mean, log_var] → [z]`;
    /// bwd `[log_var, dz] → [dmean, dlog_var]`.
    SampleNormal { elems: usize, key: u32 } = "sample_normal";
    /// Gradient accumulation `g = a + b` (bwd phase only): `[a, b] → [g]`.
    Accumulate { elems: usize } = "accumulate";
    /// Softmax output + integer labels → loss, and the gradient of the softmax's INPUT.
    /// loss `[probs, labels] → [loss, dlogits]`.
    SoftmaxCrossEntropy {
        rows: usize,
        classes: usize,
        weight: f32,
    } = "softmax_cross_entropy";
    /// Same from logits (no softmax layer before it). loss `[logits, labels] → [loss, dlogits]`.
    SoftmaxCrossEntropyFromLogits {
        rows: usize,
        classes: usize,
        weight: f32,
    } = "softmax_cross_entropy_from_logits";
    /// Sigmoid output + targets → loss, gradient of the sigmoid's INPUT.
    /// loss `[probs, target] → [loss, dlogits]`.
    SigmoidBinaryCrossentropy {
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    } = "sigmoid_binary_crossentropy";
    /// BCE on a linear output read as logits, with the sigmoid fused and numerically stable
    /// (`max(x, 0) − x·t + ln(1 + e^(−|x|))`, gradient `σ(x) − t`; PyTorch's
    /// `BCEWithLogitsLoss`, Keras's `from_logits=True`). loss `[logits, target] → [loss, dlogits]`.
    BinaryCrossentropyFromLogits {
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    } = "binary_crossentropy_from_logits";
    /// BCE on probabilities. loss `[probs, target] → [loss, dprobs]`.
    BinaryCrossentropy {
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    } = "binary_crossentropy";
    /// loss `[pred, target] → [loss, dpred]`.
    MeanSquaredError {
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    } = "mse";
    /// loss `[mean, log_var] → [loss, dmean, dlog_var]`.
    KlNormal {
        rows: usize,
        features: usize,
        reduction: Reduction,
        weight: f32,
    } = "kl_normal";
    /// Mixed precision: are all parameter gradients finite? (update phase, no tensors).
    CheckFinite = "check_finite";
    /// Data parallel: sums the step's parameters' gradients (`bytes` of them) over the
    /// replicas, in place, once the backward steps before it have written them; `last`: the
    /// step's final sum, which also settles the replicas' non-finite flag (backward phase,
    /// no tensors).
    AllReduceGradients { bytes: u64, last: bool } = "all_reduce_gradients";
    /// Optimizer update of one layer's trainable parameters (update phase, no tensors). With
    /// the optimizer state sharded ([`crate::data_parallel::Sharding::OptimizerState`]) each
    /// replica updates its own shard of every parameter.
    Update = "update";
    /// ZeRO stage 1: after the update of its parameters (`bytes` of f32 values), each
    /// replica's updated shard is copied to every other replica, so all hold the whole
    /// updated weights again (update phase, no tensors).
    AllGatherParams { bytes: u64 } = "all_gather_params";
    /// Model parallel: sends the tensor (`bytes` of it) to pipeline stage `stage`, once the
    /// step that writes it has run: an activation in the forward phase, a gradient in the
    /// backward phase ([`crate::stage`]). `[x] → []`.
    SendTensor { bytes: u64, stage: u32 } = "send";
    /// Model parallel: receives the tensor (`bytes`) that pipeline stage `stage` sends it, in
    /// the order that stage sends them. `[] → [x]`.
    RecvTensor { bytes: u64, stage: u32 } = "recv";
}

/// An attention step's settings, whichever kernel it runs: [`Op::attention`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSettings {
    /// The flash kernels (`Op::FlashAttention`) rather than materialised probabilities.
    pub flash: bool,
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub dropout: f32,
    pub key: u32,
}

impl AttentionSettings {
    /// The op these settings describe: [`Op::FlashAttention`] or [`Op::Attention`].
    pub fn op(self) -> Op {
        let AttentionSettings {
            flash,
            batch,
            seq,
            heads,
            head_dim,
            causal,
            dropout,
            key,
        } = self;
        if flash {
            Op::FlashAttention {
                batch,
                seq,
                heads,
                head_dim,
                causal,
                dropout,
                key,
            }
        } else {
            Op::Attention {
                batch,
                seq,
                heads,
                head_dim,
                causal,
                dropout,
                key,
            }
        }
    }
}

impl Op {
    /// The settings of an attention op, materialised or flash; `None` for any other op.
    pub fn attention(&self) -> Option<AttentionSettings> {
        let (flash, batch, seq, heads, head_dim, causal, dropout, key) = match *self {
            Op::Attention {
                batch,
                seq,
                heads,
                head_dim,
                causal,
                dropout,
                key,
            } => (false, batch, seq, heads, head_dim, causal, dropout, key),
            Op::FlashAttention {
                batch,
                seq,
                heads,
                head_dim,
                causal,
                dropout,
                key,
            } => (true, batch, seq, heads, head_dim, causal, dropout, key),
            _ => return None,
        };
        Some(AttentionSettings {
            flash,
            batch,
            seq,
            heads,
            head_dim,
            causal,
            dropout,
            key,
        })
    }
}

impl Op {
    /// An op whose output a layer may recompute by choice (`LayerSpec::recompute_output`):
    /// the norms that can rebuild x̂ from their kept input.
    pub fn recomputes_output_by_choice(&self) -> bool {
        matches!(self, Op::LayerNorm { .. } | Op::BatchNorm { .. })
    }

    /// Forward multiply-adds ×2 (FLOPs) of one execution, the cost model used to price
    /// recomputation. Element-wise ops count one FLOP per element. Capped at
    /// [`MAX_OP_FLOPS`], so sums over the ops of any model stay inside `u64`.
    pub fn forward_flops(&self) -> u64 {
        self.flops_saturating().0.min(MAX_OP_FLOPS)
    }

    /// FLOPs of the op's backward step: a GEMM-shaped op (dense, the convolutions) does one
    /// product of the forward's size per gradient it writes — the weight gradient, and the
    /// input gradient when `input_grad`; materialised attention two per forward product,
    /// flash attention also recomputes the scores (half its products again); anything else
    /// what its forward does. Capped like [`Op::forward_flops`].
    pub fn backward_flops(&self, input_grad: bool) -> u64 {
        let (f, backward) = self.flops_saturating();
        let f = f.min(MAX_OP_FLOPS);
        match backward {
            Backward::Products => f.saturating_mul(1 + input_grad as u64),
            Backward::Attention => f.saturating_mul(2),
            Backward::Flash => f.saturating_mul(2).saturating_add(f / 2),
            Backward::AsForward => f,
        }
    }

    /// The forward FLOPs and the shape of the backward's work, from one exhaustive match.
    fn flops_saturating(&self) -> (u64, Backward) {
        let u = |x: usize| U(x as u64);
        let s = |x: usize, y: usize| x.saturating_mul(y);
        let (r, backward): (U, Backward) = match *self {
            Op::Dense {
                rows,
                in_features,
                units,
                ..
            } => (2 * u(rows) * u(in_features) * u(units), Backward::Products),
            Op::Conv2d { dims: d, .. } => (
                2 * u(d.n)
                    * u(d.out_h())
                    * u(d.out_w())
                    * u(d.kh)
                    * u(d.kw)
                    * u(d.c_in)
                    * u(d.c_out),
                Backward::Products,
            ),
            Op::Conv2dTranspose { dims: d, .. } => (
                2 * u(d.n) * u(d.h) * u(d.w) * u(d.kh) * u(d.kw) * u(d.c_out) * u(d.c_in),
                Backward::Products,
            ),
            Op::DepthwiseConv2d { dims: d, .. } => (
                2 * u(d.n) * u(d.out_h()) * u(d.out_w()) * u(d.kh) * u(d.kw) * u(d.c_out),
                Backward::Products,
            ),
            Op::MaxPool2d { dims: d } | Op::AvgPool2d { dims: d } => (
                u(d.n) * u(d.out_h()) * u(d.out_w()) * u(d.kh) * u(d.kw) * u(d.c_out),
                Backward::AsForward,
            ),
            Op::Attention { .. } | Op::FlashAttention { .. } => {
                let a = self.attention().expect("an attention op");
                let (b, h, sq, d) = (u(a.batch), u(a.heads), u(a.seq), u(a.head_dim));
                let flops = 4 * b * h * sq * sq * d + 5 * b * h * sq * sq;
                let backward = if a.flash {
                    Backward::Flash
                } else {
                    Backward::Attention
                };
                (flops, backward)
            }
            Op::InputCast { elems, .. }
            | Op::Cast { elems }
            | Op::Dropout { elems, .. }
            | Op::Activation { elems, .. }
            | Op::Add { elems, .. }
            | Op::SampleNormal { elems, .. }
            | Op::Accumulate { elems } => (u(elems), Backward::AsForward),
            Op::GlobalAvgPool { n, hw, c } => (u(n) * u(hw) * u(c), Backward::AsForward),
            Op::BatchNorm { rows, channels, .. } => {
                (8 * u(rows) * u(channels), Backward::AsForward)
            }
            Op::LayerNorm { rows, features, .. } => {
                (8 * u(rows) * u(features), Backward::AsForward)
            }
            Op::GroupNorm {
                samples,
                spatial,
                channels,
                ..
            } => (
                8 * u(samples) * u(spatial) * u(channels),
                Backward::AsForward,
            ),
            Op::BatchNormInference { rows, channels, .. } => {
                (2 * u(rows) * u(channels), Backward::AsForward)
            }
            Op::Concat { rows, a, b } => (u(rows) * u(a.saturating_add(b)), Backward::AsForward),
            Op::Embedding { tokens, dim, .. } => (u(s(tokens, dim)), Backward::AsForward),
            Op::PositionalEmbedding { batch, seq, dim } => {
                (u(batch) * u(s(seq, dim)), Backward::AsForward)
            }
            Op::SoftmaxCrossEntropy { rows, classes, .. }
            | Op::SoftmaxCrossEntropyFromLogits { rows, classes, .. } => {
                (4 * u(s(rows, classes)), Backward::AsForward)
            }
            Op::SigmoidBinaryCrossentropy { rows, features, .. }
            | Op::BinaryCrossentropyFromLogits { rows, features, .. }
            | Op::BinaryCrossentropy { rows, features, .. }
            | Op::MeanSquaredError { rows, features, .. }
            | Op::KlNormal { rows, features, .. } => {
                (4 * u(s(rows, features)), Backward::AsForward)
            }
            Op::CheckFinite
            | Op::AllReduceGradients { .. }
            | Op::Update
            | Op::AllGatherParams { .. }
            | Op::SendTensor { .. }
            | Op::RecvTensor { .. } => (U(0), Backward::AsForward),
        };
        (r.0, backward)
    }
}

/// The shape of an op's backward work against its forward's ([`Op::backward_flops`]).
#[derive(Clone, Copy)]
enum Backward {
    /// One product of the forward's size per gradient written.
    Products,
    /// Two products per forward product (materialised attention).
    Attention,
    /// Flash attention: two products per forward product, plus the scores again.
    Flash,
    /// The forward's FLOPs again.
    AsForward,
}

/// A FLOP count whose `*` and `+` saturate instead of overflowing.
#[derive(Clone, Copy)]
struct U(u64);

impl std::ops::Mul for U {
    type Output = U;
    fn mul(self, o: U) -> U {
        U(self.0.saturating_mul(o.0))
    }
}

impl std::ops::Mul<U> for u64 {
    type Output = U;
    fn mul(self, o: U) -> U {
        U(self.saturating_mul(o.0))
    }
}

impl std::ops::Add for U {
    type Output = U;
    fn add(self, o: U) -> U {
        U(self.0.saturating_add(o.0))
    }
}

/// The most FLOPs [`Op::forward_flops`] reports for one op (2^52, about 4.5·10^15: more than
/// any layer of a real model at its largest batch), so that sums over a model's ops cannot
/// overflow.
pub const MAX_OP_FLOPS: u64 = 1 << 52;

/// Bytes of im2col scratch a convolution may use per chunk of samples; the planner lowers
/// `chunk = max(1, WORKSPACE_CAP / per-sample bytes)` samples at a time so the workspace stays
/// bounded whatever the batch.
pub const IM2COL_CAP_BYTES: u64 = 8 << 20;

impl Op {
    /// Elements of workspace (in the op's compute dtype) the forward (`backward = false`) or
    /// backward kernel needs; 0 for none.
    pub fn workspace_elems(&self, backward: bool) -> usize {
        match *self {
            Op::Conv2d { dims: d, chunk, .. } => conv2d_col_elems(&d, chunk),
            Op::Conv2dTranspose { dims: d, chunk, .. } => {
                if d.kh == 1 && d.kw == 1 && d.sh == 1 && d.sw == 1 {
                    0
                } else {
                    sat_prod(&[chunk.min(d.n), d.h, d.w, d.kh, d.kw, d.c_out])
                }
            }
            Op::Attention {
                batch, seq, heads, ..
            } if backward => sat_prod(&[batch, heads, seq, seq]),
            // The probabilities, computed from the logits at the loss step.
            Op::SoftmaxCrossEntropyFromLogits { rows, classes, .. } => rows.saturating_mul(classes),
            _ => 0,
        }
    }
}

/// The product of `dims`, saturating at `usize::MAX` (sizes are checked against the graph's
/// `MAX_ELEMS` after they are computed).
const fn sat_prod(dims: &[usize]) -> usize {
    let mut p = 1usize;
    let mut i = 0;
    while i < dims.len() {
        p = p.saturating_mul(dims[i]);
        i += 1;
    }
    p
}

/// im2col elements of a conv2d lowered `chunk` samples at a time; 0 for a 1×1 stride-1
/// convolution, which is a plain GEMM over the input.
pub const fn conv2d_col_elems(d: &Window2d, chunk: usize) -> usize {
    if d.kh == 1 && d.kw == 1 && d.sh == 1 && d.sw == 1 {
        0
    } else {
        let c = if chunk < d.n { chunk } else { d.n };
        sat_prod(&[c, d.out_h(), d.out_w(), d.kh, d.kw, d.c_in])
    }
}

/// Block sizes of the kernels' half-precision GEMM: operands that are not f32 are converted
/// to f32 one `GEMM_BLOCK × GEMM_BLOCK` panel at a time into a small f32 scratch.
pub const GEMM_BLOCK: usize = 256;
/// Attention runs at most this many (batch, head) pairs at once, each with its own scratch.
pub const ATTENTION_LANES: usize = 8;

/// Query rows per tile of the memory-efficient attention kernels (fewer when the sequence is
/// shorter).
pub const FLASH_TILE_Q: usize = 64;
/// Key rows per tile of the memory-efficient attention kernels (fewer when the sequence is
/// shorter).
pub const FLASH_TILE_K: usize = 64;
/// Lanes of tile scratch the memory-efficient attention provisions on the CPU.
pub const FLASH_LANES: usize = 8;
/// The largest head size the memory-efficient attention's CUDA kernels take (their tiles sit
/// in shared memory); the planner lowers larger heads to [`Op::Attention`].
pub const FLASH_MAX_HEAD_DIM: usize = 128;

/// f32 scratch of [`Op::FlashAttention`] (forward and backward): `dctx·ctx` per query row
/// (`batch·heads·seq`), then the larger of the forward's lanes and the backward's. With
/// `tq = min(seq, FLASH_TILE_Q)` query and `tk = min(seq, FLASH_TILE_K)` key rows per tile: a
/// forward lane per (pair, query tile), at most [`FLASH_LANES`], holds the q tile and the
/// output accumulator (`tq·head_dim` each), the k and v tiles (`tk·head_dim`), the score tile
/// (`tq·tk`), two row vectors and a row of dropout multipliers; a backward lane per pair, at
/// most [`FLASH_LANES`], holds the pair's `seq·head_dim` dq, four `tk·head_dim` and two
/// `tq·head_dim` tiles, two `tq·tk` tiles and a row of multipliers. The kernels'
/// `flash_scratch_len` is this function; a runtime test holds them equal.
pub const fn flash_attention_scratch_elems(
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
) -> usize {
    let s = if seq == 0 { 1 } else { seq };
    let (tq, tk, d) = (min(s, FLASH_TILE_Q), min(s, FLASH_TILE_K), head_dim);
    let pairs = batch.saturating_mul(heads);
    let units = pairs.saturating_mul(seq.div_ceil(tq));
    let fwd_lane = 2 * tq * d + 2 * tk * d + tq * tk + 2 * tq + tk;
    let fwd = min(units, FLASH_LANES).saturating_mul(fwd_lane);
    let bwd_lane = sat_prod(&[seq, d]).saturating_add(4 * tk * d + 2 * tq * d + 2 * tq * tk + tk);
    let bwd = min(pairs, FLASH_LANES).saturating_mul(bwd_lane);
    sat_prod(&[pairs, seq]).saturating_add(if fwd > bwd { fwd } else { bwd })
}

/// f32 scratch elements of an `m×n×k` GEMM whose operands `a`, `b` and result `c` are
/// (`true`) or are not (`false`) 16-bit.
pub const fn gemm_scratch_elems(m: usize, n: usize, k: usize, a: bool, b: bool, c: bool) -> usize {
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    let (mb, nb, kb) = (min(m, GEMM_BLOCK), min(n, GEMM_BLOCK), min(k, GEMM_BLOCK));
    // Each block is at most GEMM_BLOCK²: no overflow.
    (a as usize) * mb * kb + (b as usize) * kb * nb + (c as usize) * mb * nb
}

const fn min(a: usize, b: usize) -> usize {
    if a < b {
        a
    } else {
        b
    }
}

const fn max3(a: usize, b: usize, c: usize) -> usize {
    let m = if a > b { a } else { b };
    if m > c {
        m
    } else {
        c
    }
}

/// Blocks a GPU reduction should start: twice the streaming multiprocessors of the largest GPU
/// memwise plans for (an H200 has 132), so that none idles.
pub const COLUMN_PART_BLOCKS: usize = 2 * 132;
/// Columns a channel-strip block sums (a warp's width).
pub const STRIP_COLUMNS: usize = 32;
/// Fewest rows a part of a split column reduction gets: two per row lane of a strip block.
pub const MIN_PART_ROWS: usize = 64;
/// Elements one block may sum alone (128 KiB of f32): above this, a reduction on fewer blocks
/// than [`COLUMN_PART_BLOCKS`] is split, its time then being the data over the whole GPU's
/// bandwidth plus a second launch instead of the data over a few SMs' share of it.
pub const PART_MIN_ELEMS: usize = 1 << 15;

/// Row parts a column reduction over a row-major `[rows, cols]` matrix is split into on a
/// GPU, when its channel strips (`⌈cols/32⌉ × ys` blocks, `ys` independent reductions of the
/// same columns, e.g. a depthwise kernel's taps) are few and each would sum over
/// [`PART_MIN_ELEMS`] elements: each part sums its rows into f64 partial sums in the op's
/// scratch, and a second, fixed-order pass adds the parts, so the result does not depend on
/// scheduling. 1 means one pass and no partial sums. The planner sizes the scratch with it
/// ([`column_parts_scratch_f32`]); the CUDA glue launches with it.
pub const fn column_parts(rows: usize, cols: usize, ys: usize) -> usize {
    let strips = cols
        .div_ceil(STRIP_COLUMNS)
        .saturating_mul(if ys == 0 { 1 } else { ys });
    let per_strip = sat_prod(&[rows, cols, ys]) / if strips == 0 { 1 } else { strips };
    if per_strip <= PART_MIN_ELEMS || strips >= COLUMN_PART_BLOCKS {
        return 1;
    }
    let parts = min(COLUMN_PART_BLOCKS.div_ceil(strips), rows / MIN_PART_ROWS);
    if parts < 1 {
        1
    } else {
        parts
    }
}

/// Blocks the value of a loss over `elems` elements (`units` rows or elements, the most blocks
/// that can share it) is reduced on: one per [`LOSS_PART_ELEMS`], at most
/// [`COLUMN_PART_BLOCKS`]. Split, each block leaves its partial sums (value, correct
/// predictions, first bad label) in the loss step's scratch, and one thread adds them in order.
pub const fn loss_value_parts(elems: usize, units: usize) -> usize {
    let parts = min(min(elems / LOSS_PART_ELEMS, COLUMN_PART_BLOCKS), units);
    if parts < 1 {
        1
    } else {
        parts
    }
}

/// Elements a block of a split loss value takes (16 KiB of f32).
pub const LOSS_PART_ELEMS: usize = 1 << 12;

/// f64 values a split loss value keeps per block: its sum, its correct predictions and its
/// first out-of-range label (+1, 0 for none).
pub const LOSS_PART_VALUES: usize = 3;

/// f32 elements of a split loss value's partial sums ([`loss_value_parts`]), 0 unsplit.
pub const fn loss_parts_scratch_f32(elems: usize, units: usize) -> usize {
    let parts = loss_value_parts(elems, units);
    if parts == 1 {
        0
    } else {
        2 * LOSS_PART_VALUES * parts
    }
}

/// f32 elements of the f64 partial sums of a split column reduction ([`column_parts`]):
/// `sums` values per (part, y, column), 0 when it is not split.
pub const fn column_parts_scratch_f32(rows: usize, cols: usize, ys: usize, sums: usize) -> usize {
    let parts = column_parts(rows, cols, ys);
    if parts == 1 {
        return 0;
    }
    2 * sat_prod(&[parts, ys, cols, sums])
}

impl Op {
    /// f32 scratch elements the op's kernels need when it computes in `dtype` (the
    /// half-precision GEMM panels; 0 in f32). Forward and backward use the same amount.
    pub fn scratch_f32_elems(&self, dtype: crate::DType) -> usize {
        let reduction = self.column_reduction_scratch_f32();
        let h = dtype.is_half();
        let kernels = match *self {
            Op::Dense {
                rows: b,
                in_features: i,
                units: o,
                ..
            } => max3(
                gemm_scratch_elems(b, o, i, h, h, h),
                gemm_scratch_elems(b, i, o, h, h, h),
                gemm_scratch_elems(i, o, b, h, h, false),
            ),
            Op::Conv2d { dims: d, chunk, .. } => {
                let (r, k) = if d.kh == 1 && d.kw == 1 && d.sh == 1 && d.sw == 1 {
                    (sat_prod(&[d.n, d.h, d.w]), d.c_in)
                } else {
                    (
                        sat_prod(&[min(chunk, d.n), d.out_h(), d.out_w()]),
                        sat_prod(&[d.kh, d.kw, d.c_in]),
                    )
                };
                max3(
                    gemm_scratch_elems(r, d.c_out, k, h, h, h),
                    gemm_scratch_elems(k, d.c_out, r, h, h, false),
                    gemm_scratch_elems(r, k, d.c_out, h, h, h),
                )
            }
            Op::Conv2dTranspose { dims: d, chunk, .. } => {
                let (r, k) = if d.kh == 1 && d.kw == 1 && d.sh == 1 && d.sw == 1 {
                    (sat_prod(&[d.n, d.h, d.w]), d.c_out)
                } else {
                    (
                        sat_prod(&[min(chunk, d.n), d.h, d.w]),
                        sat_prod(&[d.kh, d.kw, d.c_out]),
                    )
                };
                max3(
                    gemm_scratch_elems(r, k, d.c_in, h, h, h),
                    gemm_scratch_elems(k, d.c_in, r, h, h, false),
                    gemm_scratch_elems(r, d.c_in, k, h, h, h),
                )
            }
            // The row means a rebuilding backward recomputes (the forward leaves it unused:
            // one scratch size serves both passes).
            Op::LayerNorm {
                rows,
                rebuild_x_hat: true,
                ..
            } => rows,
            Op::Attention {
                batch,
                seq,
                heads,
                head_dim,
                ..
            } => {
                let lane = max3(
                    gemm_scratch_elems(seq, seq, head_dim, h, h, h),
                    gemm_scratch_elems(seq, head_dim, seq, h, h, h),
                    0,
                );
                lane * min(batch.saturating_mul(heads), ATTENTION_LANES)
            }
            Op::FlashAttention {
                batch,
                seq,
                heads,
                head_dim,
                ..
            } => flash_attention_scratch_elems(batch, seq, heads, head_dim),
            _ => 0,
        };
        // The row means of a rebuilding layer norm come first, the partial sums after them
        // (on an 8-byte boundary).
        match *self {
            Op::LayerNorm {
                rebuild_x_hat: true,
                ..
            } if reduction > 0 => kernels.next_multiple_of(2) + reduction,
            _ => kernels.max(reduction),
        }
    }

    /// f32 elements of the partial sums of the op's split reductions: its column reductions
    /// ([`column_parts`]: bias, table and depthwise weight gradients, the norms' per-channel
    /// statistics and affine gradients) and a loss's value ([`loss_value_parts`]). 0 for an op
    /// without one, or whose reductions are not split.
    pub fn column_reduction_scratch_f32(&self) -> usize {
        let parts = column_parts_scratch_f32;
        match *self {
            Op::Dense {
                rows,
                units,
                bias: true,
                ..
            } => parts(rows, units, 1, 1),
            Op::Conv2d {
                dims: d,
                bias: true,
                ..
            } => parts(d.n * d.out_h() * d.out_w(), d.c_out, 1, 1),
            Op::Conv2dTranspose {
                dims: d,
                bias: true,
                ..
            } => parts(
                d.n * d.transpose_out_h() * d.transpose_out_w(),
                d.c_out,
                1,
                1,
            ),
            Op::DepthwiseConv2d { dims: d, bias } => {
                let positions = d.n * d.out_h() * d.out_w();
                let weight = parts(positions, d.c_out, d.kh * d.kw, 1);
                let bias = if bias {
                    parts(positions, d.c_out, 1, 1)
                } else {
                    0
                };
                weight.max(bias)
            }
            Op::PositionalEmbedding { batch, seq, dim } => parts(batch, seq * dim, 1, 1),
            Op::BatchNorm { rows, channels, .. } => parts(rows, channels, 1, 2),
            Op::LayerNorm { rows, features, .. } => parts(rows, features, 1, 2),
            Op::GroupNorm {
                samples,
                spatial,
                channels,
                ..
            } => parts(samples * spatial, channels, 1, 2),
            Op::SoftmaxCrossEntropy { rows, classes, .. }
            | Op::SoftmaxCrossEntropyFromLogits { rows, classes, .. } => {
                loss_parts_scratch_f32(sat_prod(&[rows, classes]), rows)
            }
            Op::SigmoidBinaryCrossentropy { rows, features, .. }
            | Op::BinaryCrossentropyFromLogits { rows, features, .. }
            | Op::BinaryCrossentropy { rows, features, .. }
            | Op::MeanSquaredError { rows, features, .. }
            | Op::KlNormal { rows, features, .. } => {
                let n = sat_prod(&[rows, features]);
                loss_parts_scratch_f32(n, n)
            }
            _ => 0,
        }
    }
}
