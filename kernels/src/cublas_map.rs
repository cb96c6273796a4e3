//! Every GEMM the ops issue, and its mapping onto column-major cuBLAS arguments.
//!
//! The CPU kernels multiply row-major matrices; cuBLAS is column-major. A row-major matrix `X`
//! stored with row stride `ld` *is* the column-major matrix `Xᵀ` with leading dimension `ld`,
//! so the row-major product `C = op(A)·op(B)` is computed as the column-major
//! `Cᵀ = op(B)ᵀ·op(A)ᵀ`: cuBLAS's first operand is `B`, its second `A`, `m` and `n` swap, and
//! each operand keeps its own transpose flag and leading dimension ([`to_cublas`]).
//!
//! The ops' GEMMs are listed here as pure functions of their dims ([`dense_forward`],
//! [`conv2d_forward_chunk`], [`attention_scores`] …), operands named by role ([`Operand`]) at
//! element offsets, so the device executor only resolves roles to addresses. The tests check
//! every one against the CPU kernels through [`reference_gemm`], a literal column-major GEMM.
//! Nothing here is feature-gated: it is always built and tested.

use crate::attention::AttentionDims;
use crate::conv::{Conv2dDims, ConvTranspose2dDims};
use crate::dense::DenseDims;
use crate::Element;

/// The buffer a GEMM operand lives in, by its role in the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// The op's input `x`.
    X,
    /// The weight (its storage-type copy).
    W,
    /// The output `y`.
    Y,
    /// The output's gradient `dy`.
    Dy,
    /// The input's gradient `dx`.
    Dx,
    /// The f32 weight gradient (accumulated: `beta = 1`).
    Dw,
    /// The im2col workspace.
    Col,
    /// Attention's packed `qkv` and its gradient.
    Qkv,
    Dqkv,
    /// Attention probabilities (or their dropped-out copy) and their gradient.
    Probs,
    Dprobs,
    /// Attention context and its gradient.
    Ctx,
    Dctx,
}

/// One row-major matrix operand: `buf` from element `offset`, rows `ld` elements apart; read
/// transposed when `trans` (then the stored matrix is `op(X)ᵀ`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatRef {
    pub buf: Operand,
    pub offset: usize,
    pub ld: usize,
    pub trans: bool,
}

impl MatRef {
    pub fn new(buf: Operand, offset: usize, ld: usize) -> MatRef {
        MatRef {
            buf,
            offset,
            ld,
            trans: false,
        }
    }
    pub fn t(self) -> MatRef {
        MatRef {
            trans: !self.trans,
            ..self
        }
    }
}

/// A row-major GEMM as an op issues it: for each item `i < batch`,
/// `C_i[m×n] = alpha·op(A_i)[m×k]·op(B_i)[k×n] + beta·C_i`, item `i`'s operands `i·stride_*`
/// elements after item 0's. `beta == 0` means `C` is not read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowGemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: MatRef,
    pub b: MatRef,
    pub c: MatRef,
    pub alpha: f32,
    pub beta: f32,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

impl RowGemm {
    /// A single (unbatched) GEMM.
    pub fn single(
        m: usize,
        n: usize,
        k: usize,
        a: MatRef,
        b: MatRef,
        c: MatRef,
        beta: f32,
    ) -> RowGemm {
        RowGemm {
            m,
            n,
            k,
            a,
            b,
            c,
            alpha: 1.0,
            beta,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        }
    }
}

/// Where a mapped GEMM's buffers are: the device addresses of the buffers `g.a.0`, `g.b.0`,
/// `g.c.0` of a [`CublasGemm`] `g` (its element offsets are added by whoever launches it), and
/// their element types (f16/bf16 operands with an f32 result is the master-gradient case).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmBuffers {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub types: [crate::cuda::launch::Float; 3],
}

/// The column-major call: `C_cm[m×n] = alpha·op(A_cm)·op(B_cm) + beta·C_cm` per item, as
/// `cublasGemmStridedBatchedEx` (or `cublasGemmEx` when `batch == 1`) takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CublasGemm {
    /// `CUBLAS_OP_T` for the first operand (else `CUBLAS_OP_N`).
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub beta: f32,
    /// First operand: buffer and element offset, leading dimension, batch stride.
    pub a: (Operand, usize),
    pub lda: usize,
    pub stride_a: usize,
    pub b: (Operand, usize),
    pub ldb: usize,
    pub stride_b: usize,
    pub c: (Operand, usize),
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

/// Maps a row-major GEMM onto cuBLAS: `Cᵀ = op(B)ᵀ·op(A)ᵀ` — operands swapped, `m` and `n`
/// swapped, transposes and leading dimensions kept per operand.
pub fn to_cublas(g: &RowGemm) -> CublasGemm {
    CublasGemm {
        transa: g.b.trans,
        transb: g.a.trans,
        m: g.n,
        n: g.m,
        k: g.k,
        alpha: g.alpha,
        beta: g.beta,
        a: (g.b.buf, g.b.offset),
        lda: g.b.ld,
        stride_a: g.stride_b,
        b: (g.a.buf, g.a.offset),
        ldb: g.a.ld,
        stride_b: g.stride_a,
        c: (g.c.buf, g.c.offset),
        ldc: g.c.ld,
        stride_c: g.stride_c,
        batch: g.batch,
    }
}

impl CublasGemm {
    /// cuBLAS's argument rules: leading dimensions at least the stored rows (column-major),
    /// and nothing negative or zero where cuBLAS rejects it.
    pub fn validate(&self) -> Result<(), String> {
        let rows_a = if self.transa { self.k } else { self.m };
        let rows_b = if self.transb { self.n } else { self.k };
        if self.lda < rows_a.max(1) {
            return Err(format!("lda {} < {rows_a}", self.lda));
        }
        if self.ldb < rows_b.max(1) {
            return Err(format!("ldb {} < {rows_b}", self.ldb));
        }
        if self.ldc < self.m.max(1) {
            return Err(format!("ldc {} < {}", self.ldc, self.m));
        }
        for (what, v) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("batch", self.batch),
        ] {
            if v > i32::MAX as usize {
                return Err(format!("{what} = {v} exceeds cuBLAS's int range"));
            }
        }
        Ok(())
    }

    /// Elements of each buffer the call touches, `(operand, one past the last element)`.
    pub fn extents(&self) -> [(Operand, usize); 3] {
        let span = |rows: usize, cols: usize, ld: usize, off: usize, stride: usize| {
            if rows == 0 || cols == 0 || self.batch == 0 {
                off
            } else {
                off + (self.batch - 1) * stride + (cols - 1) * ld + rows
            }
        };
        let (ra, ca) = if self.transa {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (rb, cb) = if self.transb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [
            (self.a.0, span(ra, ca, self.lda, self.a.1, self.stride_a)),
            (self.b.0, span(rb, cb, self.ldb, self.b.1, self.stride_b)),
            (
                self.c.0,
                span(self.m, self.n, self.ldc, self.c.1, self.stride_c),
            ),
        ]
    }
}

/// A literal column-major GEMM (the cuBLAS contract) over whole buffers, accumulating in f32
/// and rounding each `C` element once — the reference the mapping is tested against, and what
/// the host emulation runs in place of cuBLAS. `a`, `b`, `c` are the buffers `g.a.0`, `g.b.0`,
/// `g.c.0`.
pub fn reference_gemm<A: Element, B: Element, C: Element>(
    g: &CublasGemm,
    a: &[A],
    b: &[B],
    c: &mut [C],
) {
    for item in 0..g.batch {
        let (a0, b0, c0) = (
            g.a.1 + item * g.stride_a,
            g.b.1 + item * g.stride_b,
            g.c.1 + item * g.stride_c,
        );
        for j in 0..g.n {
            for r in 0..g.m {
                let mut acc = 0f32;
                for l in 0..g.k {
                    let av = if g.transa {
                        a[a0 + l + r * g.lda]
                    } else {
                        a[a0 + r + l * g.lda]
                    };
                    let bv = if g.transb {
                        b[b0 + j + l * g.ldb]
                    } else {
                        b[b0 + l + j * g.ldb]
                    };
                    acc += av.to_f32() * bv.to_f32();
                }
                let ci = c0 + r + j * g.ldc;
                let prev = if g.beta == 0.0 {
                    0.0
                } else {
                    g.beta * c[ci].to_f32()
                };
                c[ci] = C::from_f32(g.alpha * acc + prev);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The GEMMs of each op
// ---------------------------------------------------------------------------------------------

use Operand::*;

/// Dense forward: `Y[b×o] = X[b×i]·W[i×o]` (the bias is added by `mw_bias_add`).
pub fn dense_forward(d: DenseDims) -> RowGemm {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    let (x, w, y) = (
        MatRef::new(X, 0, i),
        MatRef::new(W, 0, o),
        MatRef::new(Y, 0, o),
    );
    RowGemm::single(b, o, i, x, w, y, 0.0)
}

/// Dense backward: `Dw[i×o] += Xᵀ·Dy`, then (when the input takes a gradient) `Dx = Dy·Wᵀ`.
/// The bias gradient is `mw_column_sums` of `Dy`.
pub fn dense_backward(d: DenseDims, dx: bool) -> Vec<RowGemm> {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    let (x, w) = (MatRef::new(X, 0, i), MatRef::new(W, 0, o));
    let (dy, dw, dxm) = (
        MatRef::new(Dy, 0, o),
        MatRef::new(Dw, 0, o),
        MatRef::new(Dx, 0, i),
    );
    let dx = dx.then(|| RowGemm::single(b, i, o, dy, w.t(), dxm, 0.0));
    [Some(RowGemm::single(i, o, b, x.t(), dy, dw, 1.0)), dx]
        .into_iter()
        .flatten()
        .collect()
}

/// The sample chunks `(n0, cn)` of a chunked convolution: `chunk` samples at a time.
pub fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |n0| (n0, chunk.min(n - n0)))
}

/// A 1×1 stride-1 convolution is a dense layer over its `n·h·w` pixels (same weight layout,
/// `[ci, co]`).
fn pointwise_dense(d: &Conv2dDims) -> DenseDims {
    DenseDims {
        batch: d.n * d.h * d.w,
        in_features: d.c_in,
        out_features: d.c_out,
    }
}

/// Conv2d forward of a 1×1 stride-1 convolution (no im2col): `Y[nhw×co] = X[nhw×ci]·W[ci×co]`.
pub fn conv2d_forward_pointwise(d: &Conv2dDims) -> RowGemm {
    dense_forward(pointwise_dense(d))
}

/// Conv2d forward of chunk `(n0, cn)` after `mw_im2col` filled `Col`:
/// `Y[n0·p.., cn·p × co] = Col[cn·p × K]·W[K × co]`.
pub fn conv2d_forward_chunk(d: &Conv2dDims, n0: usize, cn: usize) -> RowGemm {
    let (p, k, co) = (d.out_h() * d.out_w(), d.kh * d.kw * d.c_in, d.c_out);
    let (col, w) = (MatRef::new(Col, 0, k), MatRef::new(W, 0, co));
    RowGemm::single(cn * p, co, k, col, w, MatRef::new(Y, n0 * p * co, co), 0.0)
}

/// Conv2d backward of a pointwise convolution: `Dw += Xᵀ·Dy`, `Dx = Dy·Wᵀ`.
pub fn conv2d_backward_pointwise(d: &Conv2dDims, dx: bool) -> Vec<RowGemm> {
    dense_backward(pointwise_dense(d), dx)
}

/// Conv2d backward of chunk `(n0, cn)`, after `mw_im2col` of `x` into `Col`: first
/// `Dw[K×co] += Colᵀ·Dy_chunk`; then (for `dx`) `Col = Dy_chunk·Wᵀ`, which `mw_col2im` folds
/// into `Dx`.
pub fn conv2d_backward_chunk(d: &Conv2dDims, n0: usize, cn: usize) -> (RowGemm, RowGemm) {
    let (p, k, co) = (d.out_h() * d.out_w(), d.kh * d.kw * d.c_in, d.c_out);
    let (col, w, dw) = (
        MatRef::new(Col, 0, k),
        MatRef::new(W, 0, co),
        MatRef::new(Dw, 0, co),
    );
    let dy = MatRef::new(Dy, n0 * p * co, co);
    (
        RowGemm::single(k, co, cn * p, col.t(), dy, dw, 1.0),
        RowGemm::single(cn * p, k, co, dy, w.t(), col, 0.0),
    )
}

/// Conv2d_transpose forward of a pointwise convolution: `Y[nhw×co] = X[nhw×ci]·Wᵀ`
/// (weight `[co, ci]`).
pub fn conv2d_transpose_forward_pointwise(d: &ConvTranspose2dDims) -> RowGemm {
    let (rows, ci, co) = (d.n * d.h * d.w, d.c_in, d.c_out);
    let (x, w, y) = (
        MatRef::new(X, 0, ci),
        MatRef::new(W, 0, ci),
        MatRef::new(Y, 0, co),
    );
    RowGemm::single(rows, co, ci, x, w.t(), y, 0.0)
}

/// Conv2d_transpose forward of chunk `(n0, cn)`: `Col[cn·hw × K] = X_chunk·Wᵀ` (weight
/// `[K, ci]`), which `mw_col2im` (with the bias) folds into `Y`.
pub fn conv2d_transpose_forward_chunk(d: &ConvTranspose2dDims, n0: usize, cn: usize) -> RowGemm {
    let (p, k, ci) = (d.h * d.w, d.kh * d.kw * d.c_out, d.c_in);
    let (x, w) = (MatRef::new(X, n0 * p * ci, ci), MatRef::new(W, 0, ci));
    RowGemm::single(cn * p, k, ci, x, w.t(), MatRef::new(Col, 0, k), 0.0)
}

/// Conv2d_transpose backward of a pointwise convolution: `Dw[co×ci] += Dyᵀ·X`, `Dx = Dy·W`.
pub fn conv2d_transpose_backward_pointwise(d: &ConvTranspose2dDims, dx: bool) -> Vec<RowGemm> {
    let (rows, ci, co) = (d.n * d.h * d.w, d.c_in, d.c_out);
    let (x, w, dy) = (
        MatRef::new(X, 0, ci),
        MatRef::new(W, 0, ci),
        MatRef::new(Dy, 0, co),
    );
    let (dw, dxm) = (MatRef::new(Dw, 0, ci), MatRef::new(Dx, 0, ci));
    let dx = dx.then(|| RowGemm::single(rows, ci, co, dy, w, dxm, 0.0));
    [Some(RowGemm::single(co, ci, rows, dy.t(), x, dw, 1.0)), dx]
        .into_iter()
        .flatten()
        .collect()
}

/// Conv2d_transpose backward of chunk `(n0, cn)`, after `mw_im2col` of `dy` into `Col`:
/// `Dw[K×ci] += Colᵀ·X_chunk` and (for `dx`) `Dx_chunk = Col·W`.
pub fn conv2d_transpose_backward_chunk(
    d: &ConvTranspose2dDims,
    n0: usize,
    cn: usize,
    dx: bool,
) -> Vec<RowGemm> {
    let (p, k, ci) = (d.h * d.w, d.kh * d.kw * d.c_out, d.c_in);
    let (col, w, dw) = (
        MatRef::new(Col, 0, k),
        MatRef::new(W, 0, ci),
        MatRef::new(Dw, 0, ci),
    );
    let (x, dxm) = (
        MatRef::new(X, n0 * p * ci, ci),
        MatRef::new(Dx, n0 * p * ci, ci),
    );
    let dx = dx.then(|| RowGemm::single(cn * p, ci, k, col, w, dxm, 0.0));
    [
        Some(RowGemm::single(k, ci, cn * p, col.t(), x, dw, 1.0)),
        dx,
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The (batch item, head) pairs of attention as strided batches: the pair `(b, head)` has its
/// q columns at `b·s·3h + head·d`, which is no single stride over all pairs, so the GEMMs
/// loop over the smaller of `batch` and `heads` and batch over the other. Returns
/// `(outer count, inner batch, outer step of qkv / ctx / scores, inner step of the same)`.
fn attention_split(d: &AttentionDims) -> (usize, usize, [usize; 3], [usize; 3]) {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    let per_b = [s * 3 * h, s * h, d.heads * s * s];
    let per_head = [hd, hd, s * s];
    if d.batch <= d.heads {
        (d.batch, d.heads, per_b, per_head)
    } else {
        (d.heads, d.batch, per_head, per_b)
    }
}

/// The strided batches of one attention GEMM, `f(q0, c0, s0)` being the item at qkv / ctx /
/// scores offsets `q0`, `c0`, `s0` (unbatched, as [`RowGemm::single`] builds it), scaled by
/// `alpha`.
fn attention_gemms(
    d: &AttentionDims,
    alpha: f32,
    f: impl Fn(usize, usize, usize) -> RowGemm,
) -> Vec<RowGemm> {
    let (outer, inner, o_step, i_step) = attention_split(d);
    (0..outer)
        .map(|o| {
            let mut g = f(o * o_step[0], o * o_step[1], o * o_step[2]);
            g.alpha = alpha;
            g.batch = inner;
            // Batch strides by the operands' roles: qkv-like, ctx-like, scores-like.
            let stride = |m: &MatRef| match m.buf {
                Qkv | Dqkv => i_step[0],
                Ctx | Dctx => i_step[1],
                _ => i_step[2],
            };
            g.stride_a = stride(&g.a);
            g.stride_b = stride(&g.b);
            g.stride_c = stride(&g.c);
            g
        })
        .collect()
}

/// Attention scores: `S_bh[s×s] = scale·Q_bh·K_bhᵀ` into `Probs` (the softmax then runs in place).
pub fn attention_scores(d: &AttentionDims, scale: f32) -> Vec<RowGemm> {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    attention_gemms(d, scale, |q0, _c0, s0| {
        let q = MatRef::new(Qkv, q0, 3 * h);
        let k = MatRef::new(Qkv, q0 + h, 3 * h);
        RowGemm::single(s, s, hd, q, k.t(), MatRef::new(Probs, s0, s), 0.0)
    })
}

/// Attention context: `Ctx[b, :, head] = P_bh[s×s]·V_bh[s×hd]`.
pub fn attention_context(d: &AttentionDims) -> Vec<RowGemm> {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    attention_gemms(d, 1.0, |q0, c0, s0| {
        let v = MatRef::new(Qkv, q0 + 2 * h, 3 * h);
        RowGemm::single(
            s,
            hd,
            s,
            MatRef::new(Probs, s0, s),
            v,
            MatRef::new(Ctx, c0, h),
            0.0,
        )
    })
}

/// Backward of the context: `Dprobs_bh = Dctx_bh·V_bhᵀ`, then `Dv_bh = P_bhᵀ·Dctx_bh` (the v
/// columns of `Dqkv`). Returns both lists in that order.
pub fn attention_context_backward(d: &AttentionDims) -> (Vec<RowGemm>, Vec<RowGemm>) {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    let dp = attention_gemms(d, 1.0, |q0, c0, s0| {
        let v = MatRef::new(Qkv, q0 + 2 * h, 3 * h);
        let (dctx, dprobs) = (MatRef::new(Dctx, c0, h), MatRef::new(Dprobs, s0, s));
        RowGemm::single(s, s, hd, dctx, v.t(), dprobs, 0.0)
    });
    let dv = attention_gemms(d, 1.0, |q0, c0, s0| {
        let (probs, dctx) = (MatRef::new(Probs, s0, s), MatRef::new(Dctx, c0, h));
        RowGemm::single(
            s,
            hd,
            s,
            probs.t(),
            dctx,
            MatRef::new(Dqkv, q0 + 2 * h, 3 * h),
            0.0,
        )
    });
    (dp, dv)
}

/// Backward of the scores, from the softmax's input gradient in `Dprobs`:
/// `Dq_bh = scale·dS·K_bh`, `Dk_bh = scale·dSᵀ·Q_bh` (the q and k columns of `Dqkv`).
pub fn attention_scores_backward(d: &AttentionDims, scale: f32) -> Vec<RowGemm> {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    // Dq from K into the q columns, then Dk from Q into the k columns.
    let head_grad = |ds_t: bool, from: usize, to: usize| {
        attention_gemms(d, scale, move |q0, _c0, s0| {
            let ds = MatRef::new(Dprobs, s0, s);
            let ds = if ds_t { ds.t() } else { ds };
            let (src, dst) = (
                MatRef::new(Qkv, q0 + from, 3 * h),
                MatRef::new(Dqkv, q0 + to, 3 * h),
            );
            RowGemm::single(s, hd, s, ds, src, dst, 0.0)
        })
    };
    let dq = head_grad(false, h, 0);
    let dk = head_grad(true, 0, h);
    dq.into_iter().chain(dk).collect()
}

/// Whether a GEMM's shape suits the tensor cores with 16-bit operands: `m`, `n` and `k` (and
/// the leading dimensions) multiples of 8. For the summary's notes.
pub fn tensor_core_friendly(g: &CublasGemm) -> bool {
    [g.m, g.n, g.k, g.lda, g.ldb, g.ldc]
        .iter()
        .all(|v| v % 8 == 0)
}
