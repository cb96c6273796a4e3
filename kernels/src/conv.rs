//! 2-D convolutions, forward and backward: conv2d and conv2d_transpose by chunked im2col + GEMM,
//! depthwise conv2d directly.
//!
//! Layouts (Keras): activations NHWC; conv2d weight `[kh, kw, c_in, c_out]`; depthwise weight
//! `[kh, kw, c, multiplier]` (output channel `ci·multiplier + mi`); conv2d_transpose weight
//! `[kh, kw, c_out, c_in]`. Padding follows TensorFlow: see [`window_axis`].
//!
//! **Scratch.** im2col turns `chunk` samples at a time into a `col` matrix of
//! `chunk·out_h·out_w` rows by `kh·kw·c_in` columns (storage `T`), which the caller cuts out of
//! the arena: its length is [`conv2d_col_len`] / [`conv2d_transpose_col_len`], and `chunk`
//! (`1 ≤ chunk`, values above `n` act as `n`) trades that memory against GEMM size. 1×1
//! stride-1 convolutions need no im2col at all (their col length is `0`). Half storage also
//! needs an `f32` GEMM workspace `ws` ([`conv2d_ws_len`], [`conv2d_transpose_ws_len`]; empty
//! for f32). Results agree for every `chunk` to f32 rounding: each output element is the same
//! dot product, but the `gemm` crate may block the depth differently (or use a GEMV) for
//! another row count, and `dw` is summed chunk by chunk.
//!
//! Gradient rules: parameter gradients (`dw`, `db`, f32 master copies) are **accumulated**;
//! activation gradients (`dx`) are **overwritten**.

use crate::dense::add_column_sums;
use crate::elementwise::wide_loop;
use crate::gemm::{
    add_f32, check_part, gemm_core, load_f32, matmul_mixed_ws_len, store_f32, Mat, MatMut,
};
use crate::gemm_heap::{gemm_core_heap_bytes, pieces, Strides};
use crate::{Element, KResult, KernelError};
use gemm::Parallelism;
use rayon::prelude::*;

/// Keras / TensorFlow padding, and the one rule of a window's output size and padding
/// ([`window_axis`]), shared with the planner.
pub use memwise_geometry::{window_axis, Padding};

#[allow(clippy::too_many_arguments)]
fn check_window(
    what: &str,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    padding: Padding,
) -> KResult {
    if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
        return Err(KernelError(format!(
            "{what}: kernel {kh}×{kw} and strides {sh}×{sw} must be ≥ 1"
        )));
    }
    if h == 0 || w == 0 {
        return Err(KernelError(format!(
            "{what}: spatial size {h}×{w} must be ≥ 1"
        )));
    }
    if padding == Padding::Valid && (h < kh || w < kw) {
        return Err(KernelError(format!(
            "{what}: valid padding needs input {h}×{w} ≥ kernel {kh}×{kw}"
        )));
    }
    Ok(())
}

fn check_chunk(what: &str, chunk: usize) -> KResult {
    if chunk == 0 {
        Err(KernelError(format!("{what}: chunk must be ≥ 1")))
    } else {
        Ok(())
    }
}

/// The methods every convolution's dims derive from their fields alike: the output size and
/// padding of both spatial axes by the axis rule `$axis` ([`window_axis`] or the transposed
/// one), and the lengths of `x`, `y` and the weight, from the dims' input channels `$c_in`,
/// output channels `$c_out` and weight elements per tap `$per_tap` (written over `$d`).
macro_rules! window_dims_methods {
    ($axis:ident, |$d:ident| $c_in:expr, $c_out:expr, $per_tap:expr) => {
        /// Output rows.
        pub fn out_h(&self) -> usize {
            $axis(self.h, self.kh, self.sh, self.padding).0
        }
        /// Output columns.
        pub fn out_w(&self) -> usize {
            $axis(self.w, self.kw, self.sw, self.padding).0
        }
        /// Zero rows added above the input (a transposed convolution: rows cropped from the
        /// top of its full, valid output, `max(kh-sh, 0)/2` for same).
        pub fn pad_top(&self) -> usize {
            $axis(self.h, self.kh, self.sh, self.padding).1
        }
        /// Zero columns added left of the input (transposed: columns cropped on the left).
        pub fn pad_left(&self) -> usize {
            $axis(self.w, self.kw, self.sw, self.padding).1
        }
        /// Elements of `x` and `dx`.
        pub fn x_len(&self) -> usize {
            let $d = self;
            $d.n * $d.h * $d.w * $c_in
        }
        /// Elements of `y` and `dy`.
        pub fn y_len(&self) -> usize {
            let $d = self;
            $d.n * $d.out_h() * $d.out_w() * $c_out
        }
        /// Elements of the weight and its gradient.
        pub fn w_len(&self) -> usize {
            let $d = self;
            $d.kh * $d.kw * $per_tap
        }
        /// The lengths the kernels check their buffers against.
        fn lens(&self) -> Lens {
            let $d = self;
            Lens {
                x: $d.x_len(),
                w: $d.w_len(),
                y: $d.y_len(),
                bias: $c_out,
            }
        }
    };
}

/// The buffer lengths of one convolution call (the bias has one element per output channel).
#[derive(Clone, Copy, Debug)]
struct Lens {
    x: usize,
    w: usize,
    y: usize,
    bias: usize,
}

impl Lens {
    /// Checks a forward call's `x`, `w`, `y` and optional `bias`.
    fn check_forward<T>(
        self,
        what: &str,
        x: &[T],
        w: &[T],
        bias: Option<&[f32]>,
        y: &[T],
    ) -> KResult {
        check_part(what, "x", x.len(), self.x)?;
        check_part(what, "w", w.len(), self.w)?;
        check_part(what, "y", y.len(), self.y)?;
        match bias {
            Some(b) => check_part(what, "bias", b.len(), self.bias),
            None => Ok(()),
        }
    }

    /// Checks a backward call's `x`, `w`, `dy`, `dw` and the optional `dx` and `db`.
    #[allow(clippy::too_many_arguments)]
    fn check_backward<T>(
        self,
        what: &str,
        x: &[T],
        w: &[T],
        dy: &[T],
        dw: &[f32],
        dx: Option<&[T]>,
        db: Option<&[f32]>,
    ) -> KResult {
        check_part(what, "x", x.len(), self.x)?;
        check_part(what, "w", w.len(), self.w)?;
        check_part(what, "dy", dy.len(), self.y)?;
        check_part(what, "dw", dw.len(), self.w)?;
        if let Some(dx) = dx {
            check_part(what, "dx", dx.len(), self.x)?;
        }
        match db {
            Some(db) => check_part(what, "db", db.len(), self.bias),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// conv2d

/// Shape of a conv2d call: `x[n, h, w, c_in] ⋆ W[kh, kw, c_in, c_out] → y[n, out_h, out_w, c_out]`
/// — the planner's window shape itself, so a plan's step hands its dims over as they are.
pub type Conv2dDims = memwise_geometry::Window2d;

/// What the conv2d kernels derive from [`Conv2dDims`] beyond its geometry.
trait Conv2dCall {
    /// The lengths the kernels check their buffers against.
    fn lens(&self) -> Lens;
    /// im2col of `x` under the windows of `y`, against the `[K, c_out]` weight.
    fn col_gemm(&self) -> ColGemm;
}

impl Conv2dCall for Conv2dDims {
    fn lens(&self) -> Lens {
        Lens {
            x: self.x_len(),
            w: self.w_len(),
            y: self.y_len(),
            bias: self.c_out,
        }
    }
    fn col_gemm(&self) -> ColGemm {
        ColGemm {
            g: Geom::new(
                [self.h, self.w, self.c_in],
                [self.out_h(), self.out_w()],
                [self.kh, self.kw, self.sh, self.sw],
                [self.pad_top(), self.pad_left()],
            ),
            n: self.n,
            cols: self.c_out,
            pointwise: self.is_pointwise(),
        }
    }
}

/// Elements (storage `T`) of the im2col scratch for `chunk` samples:
/// `min(chunk, n)·out_h·out_w·kh·kw·c_in`, and `0` for a 1×1 stride-1 convolution.
pub fn conv2d_col_len(d: Conv2dDims, chunk: usize) -> usize {
    d.col_gemm().col_len(chunk)
}

/// `f32` GEMM workspace for [`conv2d_forward`] and [`conv2d_backward`] with half storage
/// (`0` for f32): with `r = min(chunk, n)·out_h·out_w` GEMM rows and `K = kh·kw·c_in`
/// (`r = n·h·w`, `K = c_in` when pointwise), the largest of
/// `ws<T,T,T>(r, c_out, K)`, `ws<T,T,f32>(K, c_out, r)`, `ws<T,T,T>(r, K, c_out)`
/// ([`matmul_mixed_ws_len`]) — at most `3·256²`.
pub fn conv2d_ws_len<T: Element>(d: Conv2dDims, chunk: usize) -> usize {
    d.col_gemm().ws_len::<T>(chunk)
}

/// The largest `f(cn)` over the distinct sample counts `cn` of the chunks that `n` samples are
/// processed in, `chunk` at a time (`0` for `chunk == 0`, which the kernels refuse).
fn max_over_chunks(n: usize, chunk: usize, f: impl Fn(usize) -> usize) -> usize {
    if chunk == 0 {
        return 0;
    }
    pieces(n, chunk).map(|(cn, _)| f(cn)).max().unwrap_or(0)
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_forward`] with this `chunk`
/// ([`crate::gemm_heap`]): the largest of its per-chunk GEMMs `col·W` (one GEMM over all pixels
/// when pointwise), which run one after another. With or without bias alike.
pub fn conv2d_forward_heap_bytes<T: Element>(d: Conv2dDims, chunk: usize) -> usize {
    let g = d.col_gemm();
    g.max_over_gemms(chunk, |rows| g.col_w_heap_bytes::<T>(rows))
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_backward`] with this `chunk`, with
/// `dx` computed or not: the largest of its GEMMs `dw += colᵀ·dy` and (with `dx`) `dy·Wᵀ`, per
/// chunk (over all pixels when pointwise), which run one after another.
pub fn conv2d_backward_heap_bytes<T: Element>(d: Conv2dDims, chunk: usize, dx: bool) -> usize {
    let g = d.col_gemm();
    g.max_over_gemms(chunk, |rows| {
        let dw = g.dw_heap_bytes::<T>(rows);
        dw.max(if dx { g.a_wt_heap_bytes::<T>(rows) } else { 0 })
    })
}

/// Forward: `y = conv2d(x, W) (+ bias)`, `y` overwritten.
///
/// `x[n,h,w,c_in]`, `w[kh,kw,c_in,c_out]`, `bias[c_out]` (f32), `y[n,out_h,out_w,c_out]`;
/// `col`: [`conv2d_col_len`]`(d, chunk)` elements of scratch; `ws`: [`conv2d_ws_len`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_forward<T: Element>(
    d: Conv2dDims,
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    y: &mut [T],
    col: &mut [T],
    chunk: usize,
    ws: &mut [f32],
) -> KResult {
    let what = "conv2d_forward";
    let g = d.col_gemm();
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    g.check_scratch(what, chunk, col, ws)?;
    d.lens().check_forward(what, x, w, bias, y)?;
    g.im2col_gemms(what, x, w, None, Some(y), bias, col, chunk, ws)
}

/// Backward of [`conv2d_forward`] given `dy[n,out_h,out_w,c_out]`:
///
/// - `dw += im2col(x)ᵀ·dy` — f32 `[kh,kw,c_in,c_out]`, **accumulated**.
/// - `db += Σ dy` over n, out_h, out_w — f32 `[c_out]`, **accumulated**; `None` without bias.
/// - `dx = col2im(dy·Wᵀ)` — **overwritten**; `None` when the input needs no gradient.
///
/// The same `col` scratch holds first `im2col(x)` (for `dw`), then `dy·Wᵀ` (for `dx`), chunk
/// by chunk. `col`: [`conv2d_col_len`]; `ws`: [`conv2d_ws_len`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward<T: Element>(
    d: Conv2dDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    col: &mut [T],
    chunk: usize,
    ws: &mut [f32],
) -> KResult {
    let what = "conv2d_backward";
    let g = d.col_gemm();
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    g.check_scratch(what, chunk, col, ws)?;
    d.lens()
        .check_backward(what, x, w, dy, dw, dx.as_deref(), db.as_deref())?;
    g.im2col_gemms(what, x, w, Some((dw, dy)), None, None, col, chunk, ws)?;
    if let Some(dx) = dx {
        g.gemm_col2im(what, dy, w, dx, None, col, chunk, ws)?;
    }
    if let Some(db) = db {
        add_column_sums(dy, d.n * d.out_h() * d.out_w(), d.c_out, db);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// conv2d_transpose

/// Shape of a conv2d_transpose call:
/// `x[n, h, w, c_in] → y[n, out_h, out_w, c_out]` with weight `[kh, kw, c_out, c_in]`.
/// Keras output size: `in·stride + max(k − stride, 0)` (valid) or `in·stride` (same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTranspose2dDims {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c_in: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub padding: Padding,
}

/// `(out, crop_before)` of one spatial axis of a transposed convolution: Keras's output size
/// ([`memwise_geometry::transpose_out_len`], the planner's: a valid kernel shorter than its
/// stride still gives `in·stride` outputs, the last `stride − k` of each step reached by no
/// tap).
fn transpose_axis(input: usize, k: usize, s: usize, padding: Padding) -> (usize, usize) {
    let out = memwise_geometry::transpose_out_len(input, k, s, padding);
    // The transposed conv is the input-gradient of a conv from `out` to `input`: its padding.
    (out, ((input.max(1) - 1) * s + k).saturating_sub(out) / 2)
}

impl ConvTranspose2dDims {
    window_dims_methods!(transpose_axis, |d| d.c_in, d.c_out, d.c_out * d.c_in);
    /// 1×1 kernel, stride 1: `y = x·Wᵀ`, no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1
    }
    /// The equivalent conv2d running from `y`'s shape to `x`'s: im2col of `y` under the
    /// windows of `x`, against the `[K, c_in]` weight.
    fn col_gemm(&self) -> ColGemm {
        ColGemm {
            g: Geom::new(
                [self.out_h(), self.out_w(), self.c_out],
                [self.h, self.w],
                [self.kh, self.kw, self.sh, self.sw],
                [self.pad_top(), self.pad_left()],
            ),
            n: self.n,
            cols: self.c_in,
            pointwise: self.is_pointwise(),
        }
    }
}

/// Elements (storage `T`) of the conv2d_transpose col scratch for `chunk` samples:
/// `min(chunk, n)·h·w·kh·kw·c_out` (one row per *input* pixel), `0` when pointwise.
pub fn conv2d_transpose_col_len(d: ConvTranspose2dDims, chunk: usize) -> usize {
    d.col_gemm().col_len(chunk)
}

/// `f32` GEMM workspace for conv2d_transpose with half storage (`0` for f32): with
/// `r = min(chunk, n)·h·w` and `K = kh·kw·c_out` (`r = n·h·w`, `K = c_out` when pointwise),
/// the largest of `ws<T,T,T>(r, K, c_in)`, `ws<T,T,f32>(K, c_in, r)`, `ws<T,T,T>(r, c_in, K)`.
pub fn conv2d_transpose_ws_len<T: Element>(d: ConvTranspose2dDims, chunk: usize) -> usize {
    d.col_gemm().ws_len::<T>(chunk)
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_transpose_forward`] with this
/// `chunk` ([`crate::gemm_heap`]): the largest of its per-chunk GEMMs `x·Wᵀ` (one GEMM over all
/// pixels when pointwise). With or without bias alike.
pub fn conv2d_transpose_forward_heap_bytes<T: Element>(
    d: ConvTranspose2dDims,
    chunk: usize,
) -> usize {
    let g = d.col_gemm();
    g.max_over_gemms(chunk, |rows| g.a_wt_heap_bytes::<T>(rows))
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_transpose_backward`] with this
/// `chunk`, with `dx` computed or not: the largest of its GEMMs `dw += colᵀ·x` and (with `dx`)
/// `col·W`, per chunk (over all pixels when pointwise).
pub fn conv2d_transpose_backward_heap_bytes<T: Element>(
    d: ConvTranspose2dDims,
    chunk: usize,
    dx: bool,
) -> usize {
    let g = d.col_gemm();
    g.max_over_gemms(chunk, |rows| {
        let dw = g.dw_heap_bytes::<T>(rows);
        dw.max(if dx { g.col_w_heap_bytes::<T>(rows) } else { 0 })
    })
}

fn check_transpose(what: &str, d: &ConvTranspose2dDims) -> KResult {
    if d.kh == 0 || d.kw == 0 || d.sh == 0 || d.sw == 0 || d.h == 0 || d.w == 0 {
        return Err(KernelError(format!(
            "{what}: kernel {}×{}, strides {}×{} and input {}×{} must all be ≥ 1",
            d.kh, d.kw, d.sh, d.sw, d.h, d.w
        )));
    }
    Ok(())
}

/// Forward: `y = conv2d_transpose(x, W) (+ bias)`, `y` overwritten: per chunk
/// `col = x·Wᵀ` (one row of `kh·kw·c_out` per input pixel), then `y = col2im(col)`.
///
/// `x[n,h,w,c_in]`, `w[kh,kw,c_out,c_in]`, `bias[c_out]` (f32), `y[n,out_h,out_w,c_out]`;
/// `col`: [`conv2d_transpose_col_len`]; `ws`: [`conv2d_transpose_ws_len`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_transpose_forward<T: Element>(
    d: ConvTranspose2dDims,
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    y: &mut [T],
    col: &mut [T],
    chunk: usize,
    ws: &mut [f32],
) -> KResult {
    let what = "conv2d_transpose_forward";
    check_transpose(what, &d)?;
    let g = d.col_gemm();
    g.check_scratch(what, chunk, col, ws)?;
    d.lens().check_forward(what, x, w, bias, y)?;
    g.gemm_col2im(what, x, w, y, bias, col, chunk, ws)
}

/// Backward of [`conv2d_transpose_forward`] given `dy[n,out_h,out_w,c_out]`; per chunk
/// `col = im2col(dy)`, then:
///
/// - `dw += colᵀ·x` — f32 `[kh,kw,c_out,c_in]`, **accumulated**.
/// - `db += Σ dy` over n, out_h, out_w — f32 `[c_out]`, **accumulated**; `None` without bias.
/// - `dx = col·W` — **overwritten**; `None` when the input needs no gradient.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_transpose_backward<T: Element>(
    d: ConvTranspose2dDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    col: &mut [T],
    chunk: usize,
    ws: &mut [f32],
) -> KResult {
    let what = "conv2d_transpose_backward";
    check_transpose(what, &d)?;
    let g = d.col_gemm();
    g.check_scratch(what, chunk, col, ws)?;
    d.lens()
        .check_backward(what, x, w, dy, dw, dx.as_deref(), db.as_deref())?;
    g.im2col_gemms(what, dy, w, Some((dw, x)), dx, None, col, chunk, ws)?;
    if let Some(db) = db {
        add_column_sums(dy, d.n * d.out_h() * d.out_w(), d.c_out, db);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// What conv2d and conv2d_transpose share: chunked im2col / col2im around a GEMM

/// One im2col convolution as GEMMs: per sample, `g.oh·g.ow` rows (conv2d: its output pixels;
/// conv2d_transpose: its input pixels) of `K = kh·kw·c` columns (`c` the channels of the image
/// im2col reads and col2im writes: conv2d's input, conv2d_transpose's output), against a
/// `[K, cols]` weight. Rows go `chunk` samples at a time through the `col` scratch, or all at
/// once straight from the image when the convolution is pointwise.
#[derive(Clone, Copy, Debug)]
struct ColGemm {
    g: Geom,
    n: usize,
    /// The weight's columns: the channels of the other side (conv2d's output).
    cols: usize,
    pointwise: bool,
}

impl ColGemm {
    /// GEMM rows per sample.
    fn pixels(&self) -> usize {
        self.g.oh * self.g.ow
    }

    /// Samples per GEMM: `chunk` (at most `n`), all `n` when pointwise.
    fn samples(&self, chunk: usize) -> usize {
        if self.pointwise {
            self.n
        } else {
            chunk.min(self.n)
        }
    }

    /// Elements of the `col` scratch: `min(chunk, n)·pixels·K`, `0` when pointwise.
    fn col_len(&self, chunk: usize) -> usize {
        if self.pointwise {
            0
        } else {
            self.samples(chunk) * self.pixels() * self.g.k()
        }
    }

    /// `f32` workspace of the three GEMM shapes below ([`matmul_mixed_ws_len`]).
    fn ws_len<T: Element>(&self, chunk: usize) -> usize {
        let (r, k, c) = (self.samples(chunk) * self.pixels(), self.g.k(), self.cols);
        matmul_mixed_ws_len::<T, T, T>(r, c, k)
            .max(matmul_mixed_ws_len::<T, T, f32>(k, c, r))
            .max(matmul_mixed_ws_len::<T, T, T>(r, k, c))
    }

    /// Refuses a zero `chunk` and `col` / `ws` scratch shorter than this call needs.
    fn check_scratch<T: Element>(
        &self,
        what: &str,
        chunk: usize,
        col: &[T],
        ws: &[f32],
    ) -> KResult {
        check_chunk(what, chunk)?;
        check_part(what, "col", col.len(), self.col_len(chunk))?;
        check_part(what, "ws", ws.len(), self.ws_len::<T>(chunk))
    }

    /// The largest `f(rows)` over the GEMMs of one call: one over all `n·pixels` rows when
    /// pointwise, else one per distinct chunk size.
    fn max_over_gemms(&self, chunk: usize, f: impl Fn(usize) -> usize) -> usize {
        let p = self.pixels();
        if self.pointwise {
            return f(self.n * p);
        }
        max_over_chunks(self.n, chunk, |cn| f(cn * p))
    }

    /// Heap bytes of `out[rows, cols] = col·W` (`col` `[rows, K]`).
    fn col_w_heap_bytes<T: Element>(&self, rows: usize) -> usize {
        let (k, c) = (self.g.k(), self.cols);
        let (a, b) = (Strides::row_major(k), Strides::row_major(c));
        gemm_core_heap_bytes::<T, T, T>(rows, c, k, a, b, 0.0, b, false, Parallelism::Rayon(0))
    }

    /// Heap bytes of `col[rows, K] = a·Wᵀ` (`a` `[rows, cols]`).
    fn a_wt_heap_bytes<T: Element>(&self, rows: usize) -> usize {
        let (k, c) = (self.g.k(), self.cols);
        let (a, wt, out) = (
            Strides::row_major(c),
            Strides::dense(c, k, true),
            Strides::row_major(k),
        );
        gemm_core_heap_bytes::<T, T, T>(rows, k, c, a, wt, 0.0, out, false, Parallelism::Rayon(0))
    }

    /// Heap bytes of `dw[K, cols] += colᵀ·a` (f32 `dw`).
    fn dw_heap_bytes<T: Element>(&self, rows: usize) -> usize {
        let (k, c) = (self.g.k(), self.cols);
        let (colt, a) = (Strides::dense(k, rows, true), Strides::row_major(c));
        gemm_core_heap_bytes::<T, T, f32>(k, c, rows, colt, a, 1.0, a, false, Parallelism::Rayon(0))
    }

    /// Per chunk of samples: `col = im2col(src)` (`src` itself when pointwise), then with
    /// `dw = Some((dw, a))` `dw += colᵀ·a` (**accumulated**), and with `out` `out = col·W
    /// (+ bias)` (**overwritten**). `a` and `out` are `[n·pixels, cols]`.
    #[allow(clippy::too_many_arguments)]
    fn im2col_gemms<T: Element>(
        &self,
        what: &str,
        src: &[T],
        w: &[T],
        dw: Option<(&mut [f32], &[T])>,
        out: Option<&mut [T]>,
        bias: Option<&[f32]>,
        col: &mut [T],
        chunk: usize,
        ws: &mut [f32],
    ) -> KResult {
        let (k, c, p, par) = (self.g.k(), self.cols, self.pixels(), Parallelism::Rayon(0));
        let wv = Mat::dense(what, w, 0, k, c, false)?;
        let dw = match dw {
            Some((dw, a)) => Some((MatMut::row_major(what, dw, 0, k, c, c)?, a)),
            None => None,
        };
        let out = match out {
            Some(out) => Some(MatMut::row_major(what, out, 0, self.n * p, c, c)?),
            None => None,
        };
        let step = self.samples(chunk).max(1);
        for n0 in (0..self.n).step_by(step) {
            let cn = step.min(self.n - n0);
            let rows = cn * p;
            let colm: &[T] = if self.pointwise {
                src
            } else {
                im2col(&self.g, src, n0, cn, col);
                col
            };
            if let Some((dwv, a)) = &dw {
                let colt = Mat::dense(what, colm, 0, k, rows, true)?;
                let av = Mat::dense(what, a, n0 * p * c, rows, c, false)?;
                // SAFETY: views checked; dw is a unique borrow distinct from col and a.
                unsafe { gemm_core(k, c, rows, 1.0, colt, av, 1.0, *dwv, None, ws, par) };
            }
            if let Some(out) = out {
                let colv = Mat::dense(what, colm, 0, rows, k, false)?;
                let dst = out.offset(n0 * p * c);
                // SAFETY: views checked; out is a unique borrow distinct from col and w.
                unsafe { gemm_core(rows, c, k, 1.0, colv, wv, 0.0, dst, bias, ws, par) };
            }
        }
        Ok(())
    }

    /// Per chunk of samples: `col = a·Wᵀ`, then `dst = col2im(col) (+ bias)`, **overwritten**
    /// (pointwise: `dst = a·Wᵀ (+ bias)` directly). `a` is `[n·pixels, cols]`, `dst` the image.
    #[allow(clippy::too_many_arguments)]
    fn gemm_col2im<T: Element>(
        &self,
        what: &str,
        a: &[T],
        w: &[T],
        dst: &mut [T],
        bias: Option<&[f32]>,
        col: &mut [T],
        chunk: usize,
        ws: &mut [f32],
    ) -> KResult {
        let (k, c, p, par) = (self.g.k(), self.cols, self.pixels(), Parallelism::Rayon(0));
        // Wᵀ: a [cols, K] view of the [K, cols] weight.
        let wt = Mat::dense(what, w, 0, c, k, true)?;
        if self.pointwise {
            let rows = self.n * p;
            let av = Mat::dense(what, a, 0, rows, c, false)?;
            let dv = MatMut::row_major(what, dst, 0, rows, k, k)?;
            // SAFETY: views checked; dst unique.
            unsafe { gemm_core(rows, k, c, 1.0, av, wt, 0.0, dv, bias, ws, par) };
            return Ok(());
        }
        let img = self.g.h * self.g.w * self.g.c;
        for n0 in (0..self.n).step_by(chunk) {
            let cn = chunk.min(self.n - n0);
            let rows = cn * p;
            let av = Mat::dense(what, a, n0 * p * c, rows, c, false)?;
            let colm = MatMut::row_major(what, col, 0, rows, k, k)?;
            // SAFETY: views checked; col unique.
            unsafe { gemm_core(rows, k, c, 1.0, av, wt, 0.0, colm, None, ws, par) };
            col2im(&self.g, col, cn, &mut dst[n0 * img..(n0 + cn) * img], bias);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// depthwise conv2d

/// Shape of a depthwise conv2d call: `x[n, h, w, c] → y[n, out_h, out_w, c·multiplier]`, weight
/// `[kh, kw, c, multiplier]`; output channel `ci·multiplier + mi` (TensorFlow's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DepthwiseConv2dDims {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub multiplier: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub padding: Padding,
}

impl DepthwiseConv2dDims {
    window_dims_methods!(window_axis, |d| d.c, d.c_out(), d.c * d.multiplier);
    /// Output channels `c·multiplier`.
    pub fn c_out(&self) -> usize {
        self.c * self.multiplier
    }
}

/// Output channels handled per stack accumulator in the direct loops (no heap scratch).
const CH_BLOCK: usize = 256;

/// Forward: `y[n,oy,ox,ci·m+mi] = Σ_{ki,kj} x[n, oy·sh+ki-pt, ox·sw+kj-pl, ci]·w[ki,kj,ci,mi]
/// (+ bias)`, `y` overwritten. Computed directly (no im2col, no scratch), parallel over
/// output rows.
pub fn depthwise_conv2d_forward<T: Element>(
    d: DepthwiseConv2dDims,
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    y: &mut [T],
) -> KResult {
    let what = "depthwise_conv2d_forward";
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    if d.multiplier == 0 {
        return Err(KernelError(format!("{what}: multiplier must be ≥ 1")));
    }
    d.lens().check_forward(what, x, w, bias, y)?;
    let (oh, ow, co, m, c) = (d.out_h(), d.out_w(), d.c_out(), d.multiplier, d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    if co == 0 || oh == 0 || ow == 0 {
        return Ok(());
    }
    let f32_rows = m == 1 && d.sh == 1 && d.sw == 1;
    if let (Some(y), Some(x), Some(w), true) = (f32_view_mut(y), f32_view(x), f32_view(w), f32_rows)
    {
        y[..d.y_len()]
            .par_chunks_mut(ow * co)
            .enumerate()
            .for_each(|(r, yrow)| depthwise_forward_row(&d, x, w, bias, r, yrow));
        return Ok(());
    }
    y[..d.y_len()]
        .par_chunks_mut(ow * co)
        .enumerate()
        .for_each(|(r, yrow)| {
            let (s, oy) = (r / oh, r % oh);
            let mut acc = [0f32; CH_BLOCK];
            let mut xs = [0f32; CH_BLOCK];
            let mut wk = [0f32; CH_BLOCK];
            for ox in 0..ow {
                for o0 in (0..co).step_by(CH_BLOCK) {
                    let ob = CH_BLOCK.min(co - o0);
                    let acc = &mut acc[..ob];
                    match bias {
                        Some(b) => acc.copy_from_slice(&b[o0..o0 + ob]),
                        None => acc.fill(0.0),
                    }
                    for ki in 0..d.kh {
                        let iy = (oy * d.sh + ki) as isize - pt;
                        if iy < 0 || iy >= d.h as isize {
                            continue;
                        }
                        for kj in 0..d.kw {
                            let ix = (ox * d.sw + kj) as isize - pl;
                            if ix < 0 || ix >= d.w as isize {
                                continue;
                            }
                            let px = ((s * d.h + iy as usize) * d.w + ix as usize) * c;
                            let wt = ((ki * d.kw + kj) * co) + o0;
                            if m == 1 {
                                let (xp, wp) = (&x[px + o0..px + o0 + ob], &w[wt..wt + ob]);
                                fma_into(acc, xp, wp, &mut xs, &mut wk);
                                continue;
                            }
                            gather_channels(&x[px..px + c], m, o0, &mut xs[..ob]);
                            load_f32(&w[wt..wt + ob], &mut wk[..ob]);
                            for ((a, xv), wv) in acc.iter_mut().zip(&xs[..ob]).zip(&wk[..ob]) {
                                *a += xv * wv;
                            }
                        }
                    }
                    store_f32(acc, &mut yrow[ox * co + o0..ox * co + o0 + ob]);
                }
            }
        });
    Ok(())
}

/// `out[q] = xpix[(o0 + q) / m]`: the input channel feeding output channel `o0 + q`.
#[inline]
fn gather_channels<T: Element>(xpix: &[T], m: usize, o0: usize, out: &mut [f32]) {
    if m == 1 {
        load_f32(&xpix[o0..o0 + out.len()], out);
    } else {
        for (q, v) in out.iter_mut().enumerate() {
            *v = xpix[(o0 + q) / m].to_f32();
        }
    }
}

/// `acc[q] += a[q]·b[q]` in f32: straight from the slices for f32 storage (the loop then
/// vectorises with no copies), through the bulk conversions into `ta`, `tb` for 16-bit.
#[inline]
fn fma_into<T: Element>(acc: &mut [f32], a: &[T], b: &[T], ta: &mut [f32], tb: &mut [f32]) {
    if let (Some(a), Some(b)) = (f32_view(a), f32_view(b)) {
        for ((s, x), y) in acc.iter_mut().zip(a).zip(b) {
            *s += x * y;
        }
        return;
    }
    let (ta, tb) = (&mut ta[..acc.len()], &mut tb[..acc.len()]);
    load_f32(a, ta);
    load_f32(b, tb);
    for ((s, x), y) in acc.iter_mut().zip(ta.iter()).zip(tb.iter()) {
        *s += x * y;
    }
}

/// `s` as f32 when `T` is f32.
#[inline]
fn f32_view<T: Element>(s: &[T]) -> Option<&[f32]> {
    // SAFETY: T is f32 (checked), so the slice's layout is that of `[f32]`.
    crate::gemm::is_f32::<T>().then(|| unsafe { &*(s as *const [T] as *const [f32]) })
}

/// Backward of [`depthwise_conv2d_forward`] given `dy[n,out_h,out_w,c·m]`:
///
/// - `dx` — **overwritten** (gathered per input pixel, so no zeroing pass and no write
///   conflicts); `None` when the input needs no gradient.
/// - `dw += Σ x·dy` — f32 `[kh,kw,c,m]`, **accumulated**.
/// - `db += Σ dy` — f32 `[c·m]`, **accumulated**; `None` without bias.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_conv2d_backward<T: Element>(
    d: DepthwiseConv2dDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> KResult {
    depthwise_conv2d_backward_ws(d, x, w, dy, dx, dw, db, &mut [])
}

/// [`depthwise_conv2d_backward`] with a workspace (the plan's scratch of the step): when it
/// holds at least two parts of `kh·kw·c·m` (+ `c·m` with a bias) f32 partial sums, the weight
/// and bias gradients of an f32, multiplier-1 convolution are summed in one pass over the
/// output rows, split into as many parts as the workspace holds (fixed by the plan, not by the
/// thread count): each part adds every tap of each row while the row is in cache, and the
/// parts are added in order. Otherwise (or with no workspace) each tap walks the rows on its
/// own.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_conv2d_backward_ws<T: Element>(
    d: DepthwiseConv2dDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    mut dx: Option<&mut [T]>,
    dw: &mut [f32],
    mut db: Option<&mut [f32]>,
    ws: &mut [f32],
) -> KResult {
    let what = "depthwise_conv2d_backward";
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    if d.multiplier == 0 {
        return Err(KernelError(format!("{what}: multiplier must be ≥ 1")));
    }
    d.lens()
        .check_backward(what, x, w, dy, dw, dx.as_deref(), db.as_deref())?;
    let (oh, ow, co, m, c) = (d.out_h(), d.out_w(), d.c_out(), d.multiplier, d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    if co == 0 {
        return Ok(());
    }

    let by_rows = match (f32_view(x), f32_view(dy)) {
        (Some(x), Some(dy)) if m == 1 => {
            // dx in the same tasks, row part by row part, when its rows are the output's
            // (stride 1, `same`): the part's dy rows are then read from the cache, not memory.
            let same_rows = d.sh == 1 && d.sw == 1 && d.h == oh && d.w == ow;
            let fused = match (dx.as_deref_mut().and_then(f32_view_mut), f32_view(w)) {
                (Some(dx), Some(w)) if same_rows => Some((w, &mut dx[..d.x_len()])),
                _ => None,
            };
            let with_dx = fused.is_some();
            let parts = DepthwiseParts {
                d: &d,
                x,
                dy,
                dx: fused,
            };
            depthwise_param_grads_by_rows(parts, dw, db.as_deref_mut(), ws).then_some(with_dx)
        }
        _ => None,
    };
    if let Some(dx_done) = by_rows {
        if !dx_done {
            depthwise_dx(&d, w, dy, dx.as_deref_mut());
        }
        return Ok(());
    }

    // dw: one task per (tap, block of output channels); each sums over every output pixel.
    dw[..d.w_len()]
        .par_chunks_mut(co)
        .enumerate()
        .for_each(|(tap, dwt)| {
            let (ki, kj) = (tap / d.kw, tap % d.kw);
            dwt.par_chunks_mut(CH_BLOCK)
                .enumerate()
                .for_each(|(blk, dwb)| {
                    let o0 = blk * CH_BLOCK;
                    let ob = dwb.len();
                    let mut acc = [0f32; CH_BLOCK];
                    let mut xs = [0f32; CH_BLOCK];
                    let mut gs = [0f32; CH_BLOCK];
                    for s in 0..d.n {
                        for oy in 0..oh {
                            let iy = (oy * d.sh + ki) as isize - pt;
                            if iy < 0 || iy >= d.h as isize {
                                continue;
                            }
                            for ox in 0..ow {
                                let ix = (ox * d.sw + kj) as isize - pl;
                                if ix < 0 || ix >= d.w as isize {
                                    continue;
                                }
                                let px = ((s * d.h + iy as usize) * d.w + ix as usize) * c;
                                let g0 = ((s * oh + oy) * ow + ox) * co + o0;
                                let gy = &dy[g0..g0 + ob];
                                if m == 1 {
                                    let xp = &x[px + o0..px + o0 + ob];
                                    fma_into(&mut acc[..ob], xp, gy, &mut xs, &mut gs);
                                    continue;
                                }
                                gather_channels(&x[px..px + c], m, o0, &mut xs[..ob]);
                                load_f32(gy, &mut gs[..ob]);
                                for ((a, xv), gv) in
                                    acc[..ob].iter_mut().zip(&xs[..ob]).zip(&gs[..ob])
                                {
                                    *a += xv * gv;
                                }
                            }
                        }
                    }
                    for (g, a) in dwb.iter_mut().zip(&acc[..ob]) {
                        *g += a;
                    }
                });
        });

    depthwise_dx(&d, w, dy, dx);
    if let Some(db) = db {
        add_column_sums(dy, d.n * oh * ow, co, db);
    }
    Ok(())
}

/// What [`depthwise_param_grads_by_rows`] reads: an f32 multiplier-1 depthwise convolution's
/// input and output gradient, and — when its input rows are its output rows — the weights
/// and `dx` (all of it), to write `dx` in the same row parts.
struct DepthwiseParts<'a> {
    d: &'a DepthwiseConv2dDims,
    x: &'a [f32],
    dy: &'a [f32],
    dx: Option<(&'a [f32], &'a mut [f32])>,
}

/// The weight gradient (and the bias gradient, when `db` is given) of an f32 multiplier-1
/// depthwise convolution in parts of the output rows, each part's f32 partial sums in `ws`
/// (`[parts, kh·kw·c (+ c)]`), added in part order; with `dx`, each part also writes its
/// rows of the input gradient. `false` (nothing written) when `ws` holds fewer than two parts.
fn depthwise_param_grads_by_rows(
    io: DepthwiseParts<'_>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    ws: &mut [f32],
) -> bool {
    let d = io.d;
    let (c, taps) = (d.c, d.kh * d.kw);
    let part_len = taps * c + if db.is_some() { c } else { 0 };
    let rows = d.n * d.out_h();
    let parts = (ws.len() / part_len.max(1)).min(rows);
    if parts < 2 {
        return false;
    }
    let (w, dx) = match io.dx {
        Some((w, dx)) => (w, Some(dx)),
        None => (&[][..], None),
    };
    let ws = &mut ws[..parts * part_len];
    let cut = RowParts {
        rows,
        parts,
        part_len,
        row_len: d.w * c,
    };
    let part = |p: usize, acc: &mut [f32], dx: Option<&mut [f32]>| {
        let range = cut.first_row(p)..cut.first_row(p + 1);
        depthwise_part_sums(d, io.x, io.dy, range.clone(), acc);
        if let Some(dx) = dx {
            for (r, dxrow) in range.zip(dx.chunks_exact_mut(cut.row_len)) {
                depthwise_dx_row(d, w, io.dy, r, dxrow);
            }
        }
    };
    match dx {
        Some(dx) => cut.each(0..parts, ws, dx, &part),
        None => ws
            .par_chunks_mut(part_len)
            .enumerate()
            .for_each(|(p, acc)| part(p, acc, None)),
    }
    let sums = |i: usize| (0..parts).map(|p| ws[p * part_len + i]).sum::<f32>();
    for (i, g) in dw[..taps * c].iter_mut().enumerate() {
        *g += sums(i);
    }
    if let Some(db) = db {
        for (j, g) in db[..c].iter_mut().enumerate() {
            *g += sums(taps * c + j);
        }
    }
    true
}

/// How [`depthwise_param_grads_by_rows`] cuts its rows: `parts` parts of `rows` rows (part
/// `p` has rows `rows·p/parts..rows·(p+1)/parts`), `part_len` partial sums each, `row_len`
/// elements in a row of `dx`.
#[derive(Clone, Copy)]
struct RowParts {
    rows: usize,
    parts: usize,
    part_len: usize,
    row_len: usize,
}

impl RowParts {
    fn first_row(&self, p: usize) -> usize {
        self.rows * p / self.parts
    }

    /// Runs `part(p, its partial sums, its rows of dx)` for the parts `ps`, in parallel,
    /// halving the range each time: `ws` and `dx` are the range's own, so every part writes
    /// only its slices.
    fn each(
        self,
        ps: std::ops::Range<usize>,
        ws: &mut [f32],
        dx: &mut [f32],
        part: &(impl Fn(usize, &mut [f32], Option<&mut [f32]>) + Sync),
    ) {
        if ps.len() == 1 {
            return part(ps.start, ws, Some(dx));
        }
        let mid = ps.start + ps.len() / 2;
        let (ws_lo, ws_hi) = ws.split_at_mut((mid - ps.start) * self.part_len);
        let dx_rows = self.first_row(mid) - self.first_row(ps.start);
        let (dx_lo, dx_hi) = dx.split_at_mut(dx_rows * self.row_len);
        rayon::join(
            || self.each(ps.start..mid, ws_lo, dx_lo, part),
            || self.each(mid..ps.end, ws_hi, dx_hi, part),
        );
    }
}

/// One row part's weight (and bias) sums of [`depthwise_param_grads_by_rows`] into `acc`
/// (zeroed first): the 3×3 registers path when it applies, else tap by tap over each pixel.
fn depthwise_part_sums(
    d: &DepthwiseConv2dDims,
    x: &[f32],
    dy: &[f32],
    rows: std::ops::Range<usize>,
    acc: &mut [f32],
) {
    let c = d.c;
    acc.fill(0.0);
    if d.kh == 3 && d.kw == 3 && c.is_multiple_of(8) {
        for c0 in (0..c).step_by(depthwise_lanes(c)) {
            depthwise_part_3x3(d, x, dy, rows.clone(), c0, acc);
        }
        return;
    }
    depthwise_part_sums_by_pixel(d, x, dy, rows, acc);
}

/// [`depthwise_part_sums`] for any window: pixel by pixel, every tap of each pixel in turn,
/// into `acc` (`[taps·c (+ c)]`). The 3×3 registers path adds in the same order per sum.
fn depthwise_part_sums_by_pixel(
    d: &DepthwiseConv2dDims,
    x: &[f32],
    dy: &[f32],
    rows: std::ops::Range<usize>,
    acc: &mut [f32],
) {
    let (oh, ow, c, taps) = (d.out_h(), d.out_w(), d.c, d.kh * d.kw);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    let (acc_w, acc_b) = acc.split_at_mut(taps * c);
    for r in rows {
        let (s, oy) = (r / oh, r % oh);
        for ox in 0..ow {
            let g = &dy[((s * oh + oy) * ow + ox) * c..][..c];
            for (b, gv) in acc_b.iter_mut().zip(g) {
                *b += gv;
            }
            for tap in 0..taps {
                let (ki, kj) = (tap / d.kw, tap % d.kw);
                let iy = (oy * d.sh + ki) as isize - pt;
                let ix = (ox * d.sw + kj) as isize - pl;
                if iy < 0 || iy >= d.h as isize || ix < 0 || ix >= d.w as isize {
                    continue;
                }
                let xp = &x[((s * d.h + iy as usize) * d.w + ix as usize) * c..][..c];
                let a = &mut acc_w[tap * c..(tap + 1) * c];
                for ((a, xv), gv) in a.iter_mut().zip(xp).zip(g) {
                    *a += xv * gv;
                }
            }
        }
    }
}

wide_loop! {
    /// One part's sums of a 3×3 depthwise kernel for the channels from `c0` (16 of them, a
    /// cache line of each pixel, when `c` is a multiple of 16, else 8): a kernel row's three
    /// taps' accumulators stay in registers along each image row (multiply, then add, in the
    /// order of [`depthwise_part_sums_by_pixel`]'s loop, so neither the path nor the lane
    /// count changes a bit) and all are added into `acc` (`[9·c (+ c)]`, as there) at the end.
    fn depthwise_part_3x3<>(
        d: &DepthwiseConv2dDims,
        x: &[f32],
        dy: &[f32],
        rows: std::ops::Range<usize>,
        c0: usize,
        acc: &mut [f32]
    ) wide if true, {
        if depthwise_lanes(d.c) == 16 {
            depthwise_part_3x3_body::<16>(d, x, dy, rows, c0, acc)
        } else {
            depthwise_part_3x3_body::<8>(d, x, dy, rows, c0, acc)
        }
    }
}

/// Channels per call of [`depthwise_part_3x3`] for `c` channels (a multiple of 8): 16 (a
/// 64-byte cache line of each pixel per pass; a kernel row's 3 taps in 6 AVX2 registers, or 3
/// AVX-512 ones) when `c` is a multiple of 16, else 8.
fn depthwise_lanes(c: usize) -> usize {
    if c.is_multiple_of(16) {
        16
    } else {
        8
    }
}

#[inline(always)]
fn depthwise_part_3x3_body<const L: usize>(
    d: &DepthwiseConv2dDims,
    x: &[f32],
    dy: &[f32],
    rows: std::ops::Range<usize>,
    c0: usize,
    acc: &mut [f32],
) {
    let (oh, ow, c, sw) = (d.out_h(), d.out_w(), d.c, d.sw);
    let (pt, pl) = (d.pad_top(), d.pad_left());
    let mut taps = [[0f32; L]; 9];
    let mut bias = [0f32; L];
    // The output pixels whose tap kj is in the image (output pixel ox reads input pixel
    // ox·sw + kj − pl), and those whose three taps all are.
    let ranges: [std::ops::Range<usize>; 3] = std::array::from_fn(|kj| {
        let lo = pl.saturating_sub(kj).div_ceil(sw);
        lo..(d.w + pl).saturating_sub(kj).div_ceil(sw).clamp(lo, ow)
    });
    let inner_lo = ranges.iter().map(|r| r.start).max().unwrap_or(0);
    let inner_hi = ranges
        .iter()
        .map(|r| r.end)
        .min()
        .unwrap_or(0)
        .max(inner_lo);
    for r in rows {
        let (s, oy) = (r / oh, r % oh);
        let dy_row = &dy[(s * oh + oy) * ow * c..][..ow * c];
        for g in dy_row.chunks_exact(c) {
            let g = &g[c0..c0 + L];
            for q in 0..L {
                bias[q] += g[q];
            }
        }
        for ki in 0..3 {
            let Some(iy) = (oy * d.sh + ki).checked_sub(pt).filter(|&iy| iy < d.h) else {
                continue;
            };
            let x_row = &x[(s * d.h + iy) * d.w * c..][..d.w * c];
            let mut row_taps: [[f32; L]; 3] = std::array::from_fn(|kj| taps[ki * 3 + kj]);
            for (kj, px) in ranges.iter().enumerate() {
                let t = &mut row_taps[kj];
                edge_tap(
                    t,
                    (x_row, dy_row),
                    (kj, sw, pl, c, c0),
                    px.start..inner_lo.min(px.end),
                );
            }
            // The three taps together where all are in the image, walking the rows by
            // iterators (no index to check per pixel): three independent sums, so the loop
            // is not bound by one chain of additions.
            let n = inner_hi - inner_lo;
            if n > 0 {
                let first = inner_lo * sw - pl;
                let pixels = dy_row[inner_lo * c..inner_hi * c].chunks_exact(c).zip(
                    x_row[first * c..]
                        .chunks(sw * c)
                        .zip(x_row[(first + 1) * c..].chunks(sw * c))
                        .zip(x_row[(first + 2) * c..].chunks(sw * c)),
                );
                let [t0, t1, t2] = &mut row_taps;
                for (g, ((x0, x1), x2)) in pixels {
                    let (g, x0, x1, x2) = (
                        &g[c0..c0 + L],
                        &x0[c0..c0 + L],
                        &x1[c0..c0 + L],
                        &x2[c0..c0 + L],
                    );
                    for q in 0..L {
                        t0[q] += x0[q] * g[q];
                        t1[q] += x1[q] * g[q];
                        t2[q] += x2[q] * g[q];
                    }
                }
            }
            for (kj, px) in ranges.iter().enumerate() {
                let t = &mut row_taps[kj];
                edge_tap(
                    t,
                    (x_row, dy_row),
                    (kj, sw, pl, c, c0),
                    inner_hi.max(px.start)..px.end,
                );
            }
            taps[ki * 3..ki * 3 + 3].copy_from_slice(&row_taps);
        }
    }
    for (tap, t) in taps.iter().enumerate() {
        for (a, v) in acc[tap * c + c0..tap * c + c0 + L].iter_mut().zip(t) {
            *a += v;
        }
    }
    if acc.len() > 9 * c {
        for (a, v) in acc[9 * c + c0..9 * c + c0 + L].iter_mut().zip(&bias) {
            *a += v;
        }
    }
}

/// One tap `kj` of [`depthwise_part_3x3_body`]'s kernel row over the output pixels `px`, each
/// at its own index (the image's edges): `t += x_row[ox·sw + kj − pl] · dy_row[ox]` over the
/// `L` channels from `c0`. A function, not a closure, so that it is inlined into the wide
/// build (a closure called there is compiled for the baseline CPU).
#[inline(always)]
fn edge_tap<const L: usize>(
    t: &mut [f32; L],
    (x_row, dy_row): (&[f32], &[f32]),
    (kj, sw, pl, c, c0): (usize, usize, usize, usize, usize),
    px: std::ops::Range<usize>,
) {
    for ox in px {
        let xv = &x_row[(ox * sw + kj - pl) * c + c0..][..L];
        let g = &dy_row[ox * c + c0..][..L];
        for q in 0..L {
            t[q] += xv[q] * g[q];
        }
    }
}

/// A depthwise convolution's input gradient, overwritten (nothing when `dx` is `None`): each
/// input pixel gathers from the output pixels whose window covers it.
fn depthwise_dx<T: Element>(d: &DepthwiseConv2dDims, w: &[T], dy: &[T], dx: Option<&mut [T]>) {
    let (oh, ow, co, m, c) = (d.out_h(), d.out_w(), d.c_out(), d.multiplier, d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    let mut dx = dx;
    let f32_rows = m == 1 && d.sh == 1 && d.sw == 1;
    if let (Some(dx), Some(w), Some(dy), true) = (
        dx.as_deref_mut().and_then(f32_view_mut),
        f32_view(w),
        f32_view(dy),
        f32_rows,
    ) {
        dx[..d.x_len()]
            .par_chunks_mut(d.w * c)
            .enumerate()
            .for_each(|(r, dxrow)| depthwise_dx_row(d, w, dy, r, dxrow));
    } else if let Some(dx) = dx {
        dx[..d.x_len()]
            .par_chunks_mut(d.w * c)
            .enumerate()
            .for_each(|(r, dxrow)| {
                let (s, iy) = (r / d.h, r % d.h);
                let mut acc = [0f32; CH_BLOCK];
                let (mut ts, mut tw) = ([0f32; CH_BLOCK], [0f32; CH_BLOCK]);
                for ix in 0..d.w {
                    for c0 in (0..c).step_by(CH_BLOCK) {
                        let cb = CH_BLOCK.min(c - c0);
                        let acc = &mut acc[..cb];
                        acc.fill(0.0);
                        for ki in 0..d.kh {
                            let Some(oy) = window_origin(iy, ki, pt, d.sh, oh) else {
                                continue;
                            };
                            for kj in 0..d.kw {
                                let Some(ox) = window_origin(ix, kj, pl, d.sw, ow) else {
                                    continue;
                                };
                                let g = ((s * oh + oy) * ow + ox) * co;
                                let wt = (ki * d.kw + kj) * co;
                                if m == 1 {
                                    let (gy, wk) =
                                        (&dy[g + c0..g + c0 + cb], &w[wt + c0..wt + c0 + cb]);
                                    fma_into(acc, gy, wk, &mut ts, &mut tw);
                                } else {
                                    for (q, a) in acc.iter_mut().enumerate() {
                                        let o = (c0 + q) * m;
                                        for mi in 0..m {
                                            *a += dy[g + o + mi].to_f32() * w[wt + o + mi].to_f32();
                                        }
                                    }
                                }
                            }
                        }
                        store_f32(acc, &mut dxrow[ix * c + c0..ix * c + c0 + cb]);
                    }
                }
            });
    }
}

/// One output row `r` (sample and row) of a stride-1, multiplier-1, f32 depthwise
/// convolution, accumulated in place tap by tap: for tap `(ki, kj)` the input pixels it reads
/// are one contiguous run of input row `oy + ki − pad_top`. Each element starts from its bias
/// (or 0) and adds its taps in `(ki, kj)` order, as the per-pixel path does.
fn depthwise_forward_row(
    d: &DepthwiseConv2dDims,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    r: usize,
    yrow: &mut [f32],
) {
    let (oh, c) = (d.out_h(), d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    let (s, oy) = (r / oh, r % oh);
    match bias {
        Some(b) => yrow
            .chunks_exact_mut(c)
            .for_each(|p| p.copy_from_slice(&b[..c])),
        None => yrow.fill(0.0),
    }
    for ki in 0..d.kh {
        let iy = (oy + ki) as isize - pt;
        if iy < 0 || iy >= d.h as isize {
            continue;
        }
        let x_row = &x[(s * d.h + iy as usize) * d.w * c..(s * d.h + iy as usize + 1) * d.w * c];
        for kj in 0..d.kw {
            // Output pixel ox reads input pixel ox + kj − pl.
            let wt = &w[(ki * d.kw + kj) * c..(ki * d.kw + kj + 1) * c];
            add_tap(yrow, x_row, wt, kj as isize - pl, c);
        }
    }
}

/// One input row `r` (sample and row) of a stride-1, multiplier-1, f32 depthwise
/// convolution's `dx`, accumulated in place tap by tap: for tap `(ki, kj)` the `dy` pixels it
/// reaches are one contiguous run of output row `iy + pad_top − ki`. Each element sums its
/// taps in `(ki, kj)` order from 0, as the per-pixel path (16-bit storage, strides,
/// multipliers) does.
fn depthwise_dx_row(d: &DepthwiseConv2dDims, w: &[f32], dy: &[f32], r: usize, dxrow: &mut [f32]) {
    let (oh, ow, c) = (d.out_h(), d.out_w(), d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    let (s, iy) = (r / d.h, r % d.h);
    dxrow.fill(0.0);
    for ki in 0..d.kh {
        let oy = iy as isize + pt - ki as isize;
        if oy < 0 || oy >= oh as isize {
            continue;
        }
        let dy_row = &dy[(s * oh + oy as usize) * ow * c..(s * oh + oy as usize + 1) * ow * c];
        for kj in 0..d.kw {
            // Input pixel ix receives from output pixel ix + pl − kj.
            let wt = &w[(ki * d.kw + kj) * c..(ki * d.kw + kj + 1) * c];
            add_tap(dxrow, dy_row, wt, pl - kj as isize, c);
        }
    }
}

wide_loop! {
    /// One tap of a stride-1 depthwise convolution along a row of `c`-channel pixels:
    /// `dst[p] += src[p + shift] · wt` (per channel) for every pixel `p` of `dst_row` whose
    /// `p + shift` is a pixel of `src_row` — a contiguous run of both. The forward adds an
    /// input row into an output row, the input gradient an output gradient row into an input
    /// row. Compiled wide (AVX-512 or AVX2 where the CPU has them): a multiply, then an add, as
    /// in the narrow build, so the bits do not depend on the CPU.
    fn add_tap<>(dst_row: &mut [f32], src_row: &[f32], wt: &[f32], shift: isize, c: usize)
    wide if true, {
        add_tap_body(dst_row, src_row, wt, shift, c)
    }
}

#[inline(always)]
fn add_tap_body(dst_row: &mut [f32], src_row: &[f32], wt: &[f32], shift: isize, c: usize) {
    let (n_dst, n_src) = ((dst_row.len() / c) as isize, (src_row.len() / c) as isize);
    let lo = (-shift).clamp(0, n_dst);
    let hi = (n_src - shift).clamp(lo, n_dst);
    if lo == hi {
        return;
    }
    let (lo, hi, from) = (lo as usize, hi as usize, (lo + shift) as usize);
    let src = &src_row[from * c..(from + hi - lo) * c];
    for (a, v) in dst_row[lo * c..hi * c]
        .chunks_exact_mut(c)
        .zip(src.chunks_exact(c))
    {
        for ((a, v), wv) in a.iter_mut().zip(v).zip(wt) {
            *a += v * wv;
        }
    }
}

/// `s` as f32 when `T` is f32, writable.
#[inline]
fn f32_view_mut<T: Element>(s: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: T is f32 (checked), so the slice's layout is that of `[f32]`.
    crate::gemm::is_f32::<T>().then(|| unsafe { &mut *(s as *mut [T] as *mut [f32]) })
}

/// The output coordinate whose window puts tap `k` on input coordinate `i`, if any:
/// `o` with `o·stride + k - pad = i` and `0 ≤ o < out`.
#[inline]
fn window_origin(i: usize, k: usize, pad: isize, stride: usize, out: usize) -> Option<usize> {
    let t = i as isize + pad - k as isize;
    if stride == 1 {
        // The common case, without a division.
        return (t >= 0 && (t as usize) < out).then_some(t as usize);
    }
    if t < 0 || t % stride as isize != 0 {
        return None;
    }
    let o = (t / stride as isize) as usize;
    (o < out).then_some(o)
}

// ---------------------------------------------------------------------------------------------
// im2col / col2im

/// The geometry shared by im2col and col2im: an image `[h, w, c]` and a grid of `oh×ow`
/// windows of `kh×kw` taps, stride `sh×sw`, padded by `pt` rows / `pl` columns before.
#[derive(Clone, Copy, Debug)]
struct Geom {
    h: usize,
    w: usize,
    c: usize,
    oh: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    pt: usize,
    pl: usize,
}

impl Geom {
    /// `image` `[h, w, c]` under a grid of `windows` `[oh, ow]` of the kernel and strides
    /// `[kh, kw, sh, sw]`, padded by `[pt, pl]`.
    fn new(image: [usize; 3], windows: [usize; 2], kernel: [usize; 4], pad: [usize; 2]) -> Geom {
        let ([h, w, c], [oh, ow], [kh, kw, sh, sw], [pt, pl]) = (image, windows, kernel, pad);
        Geom {
            h,
            w,
            c,
            oh,
            ow,
            kh,
            kw,
            sh,
            sw,
            pt,
            pl,
        }
    }

    /// Columns of col: one per (tap, channel), ordered like the weight's `[kh, kw, c]`.
    fn k(&self) -> usize {
        self.kh * self.kw * self.c
    }
}

/// Windows `o` in `0..out` whose tap `k` lands on a coordinate `o·stride + k − pad` inside
/// `a..b`, as the range `lo..hi` (empty when none do).
#[inline]
fn windows_hitting(
    k: usize,
    pad: usize,
    stride: usize,
    a: usize,
    b: usize,
    out: usize,
) -> (usize, usize) {
    let hi = (b + pad).saturating_sub(k).div_ceil(stride).min(out);
    let lo = (a + pad).saturating_sub(k).div_ceil(stride);
    (lo.min(hi), hi)
}

/// Elements of im2col / col2im work handed to one rayon task at least (a task is one row of
/// windows or one image row; small rows are grouped so scheduling costs stay negligible).
const TASK_ELEMS: usize = 16 * 1024;

/// Lowers samples `n0..n0+cn` of `img` (`[n, h, w, c]`) into `col[(s,oy,ox), (ki,kj,ci)]`;
/// taps that fall in the padding get 0. One task per row of windows `(s, oy)`: for each tap,
/// the range of windows whose tap is inside the image is computed once, so the inner loop is
/// a plain strided copy of `c` channels (a single element when `c == 1`).
fn im2col<T: Element>(g: &Geom, img: &[T], n0: usize, cn: usize, col: &mut [T]) {
    let (k, c) = (g.k(), g.c);
    let row_len = g.ow * k;
    if row_len == 0 {
        return;
    }
    let zero = T::from_f32(0.0);
    col[..cn * g.oh * row_len]
        .par_chunks_mut(row_len)
        .with_min_len((TASK_ELEMS / row_len).max(1))
        .enumerate()
        .for_each(|(r, rows)| {
            let (s, oy) = (n0 + r / g.oh, r % g.oh);
            for ki in 0..g.kh {
                let iy = (oy * g.sh + ki) as isize - g.pt as isize;
                let inside = iy >= 0 && (iy as usize) < g.h;
                for kj in 0..g.kw {
                    let t0 = (ki * g.kw + kj) * c;
                    let (lo, hi) = if inside {
                        windows_hitting(kj, g.pl, g.sw, 0, g.w, g.ow)
                    } else {
                        (0, 0)
                    };
                    for ox in (0..lo).chain(hi..g.ow) {
                        rows[ox * k + t0..ox * k + t0 + c].fill(zero);
                    }
                    if lo == hi {
                        continue;
                    }
                    // Pixel `ix = ox·sw + kj − pl` of image row `iy`: `ox ≥ lo` keeps it ≥ 0.
                    let src_row = (s * g.h + iy as usize) * g.w + kj;
                    if c == 1 {
                        for ox in lo..hi {
                            rows[ox * k + t0] = img[src_row + ox * g.sw - g.pl];
                        }
                    } else {
                        for ox in lo..hi {
                            let src = (src_row + ox * g.sw - g.pl) * c;
                            rows[ox * k + t0..ox * k + t0 + c].copy_from_slice(&img[src..src + c]);
                        }
                    }
                }
            }
        });
}

/// f32 accumulators of one [`col2im`] task (16 KiB of stack): an image row is summed in
/// segments of `COL2IM_ACC / channels` pixels.
const COL2IM_ACC: usize = 4096;

/// The adjoint of [`im2col`] for `cn` samples: `img[s,iy,ix,ci] = Σ col[(s,oy,ox),(ki,kj,ci)]`
/// over the windows covering `(iy, ix)` (+ `bias[ci]`), **overwriting** `img` (`cn` samples).
/// Written as a gather — one task per image row, summed in f32 on the stack, taps in `(ki, kj)`
/// order for every pixel — so there are no write conflicts, no zeroing pass, and only one
/// rounding to `T`. Per tap, the windows that reach the row segment are found once and walked
/// as a strided loop (a single add per window when `c == 1`).
fn col2im<T: Element>(g: &Geom, col: &[T], cn: usize, img: &mut [T], bias: Option<&[f32]>) {
    let (k, c) = (g.k(), g.c);
    let row_len = g.w * c;
    if row_len == 0 {
        return;
    }
    img[..cn * g.h * row_len]
        .par_chunks_mut(row_len)
        .with_min_len((TASK_ELEMS / row_len).max(1))
        .enumerate()
        .for_each(|(r, irow)| {
            let (s, iy) = (r / g.h, r % g.h);
            let mut acc = [0f32; COL2IM_ACC];
            for c0 in (0..c).step_by(COL2IM_ACC) {
                let cb = COL2IM_ACC.min(c - c0);
                let seg = COL2IM_ACC / cb;
                for x0 in (0..g.w).step_by(seg) {
                    let xn = seg.min(g.w - x0);
                    let acc = &mut acc[..xn * cb];
                    match bias {
                        Some(b) => acc
                            .chunks_exact_mut(cb)
                            .for_each(|a| a.copy_from_slice(&b[c0..c0 + cb])),
                        None => acc.fill(0.0),
                    }
                    for ki in 0..g.kh {
                        let Some(oy) = window_origin(iy, ki, g.pt as isize, g.sh, g.oh) else {
                            continue;
                        };
                        let wrow = (s * g.oh + oy) * g.ow;
                        for kj in 0..g.kw {
                            let (lo, hi) = windows_hitting(kj, g.pl, g.sw, x0, x0 + xn, g.ow);
                            if lo >= hi {
                                // No window puts this kernel column on the segment (a kernel
                                // wider than the image): `at` below would be negative.
                                continue;
                            }
                            let t0 = (ki * g.kw + kj) * c + c0;
                            // Pixel `ix = ox·sw + kj − pl`, at `ix − x0` in the segment.
                            let at = kj + lo * g.sw - g.pl - x0;
                            if cb == 1 {
                                for (q, ox) in (lo..hi).enumerate() {
                                    acc[at + q * g.sw] += col[(wrow + ox) * k + t0].to_f32();
                                }
                            } else {
                                for (q, ox) in (lo..hi).enumerate() {
                                    let (src, dst) = ((wrow + ox) * k + t0, (at + q * g.sw) * cb);
                                    add_f32(&col[src..src + cb], &mut acc[dst..dst + cb]);
                                }
                            }
                        }
                    }
                    if cb == c {
                        store_f32(acc, &mut irow[x0 * c..(x0 + xn) * c]);
                    } else {
                        for (p, a) in acc.chunks_exact(cb).enumerate() {
                            let dst = (x0 + p) * c + c0;
                            store_f32(a, &mut irow[dst..dst + cb]);
                        }
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 3×3 weight-gradient registers path gives the same bits 8 and 16 channels at a time
    /// (the lane count is chosen by the CPU, so the result must not depend on it).
    #[test]
    fn depthwise_3x3_sums_do_not_depend_on_the_lane_count() {
        for (c, padding) in [(32, Padding::Same), (48, Padding::Valid)] {
            let d = DepthwiseConv2dDims {
                n: 2,
                h: 5,
                w: 6,
                c,
                multiplier: 1,
                kh: 3,
                kw: 3,
                sh: 1,
                sw: 1,
                padding,
            };
            let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 997.0 - 0.5;
            let x: Vec<f32> = (0..d.x_len()).map(value).collect();
            let dy: Vec<f32> = (0..d.y_len()).map(|i| value(i + 7)).collect();
            let rows = 0..d.n * d.out_h();
            let sums = |lanes: usize| {
                let mut acc = vec![0f32; 10 * c];
                for c0 in (0..c).step_by(lanes) {
                    let acc = &mut acc[..];
                    match lanes {
                        8 => depthwise_part_3x3_body::<8>(&d, &x, &dy, rows.clone(), c0, acc),
                        _ => depthwise_part_3x3_body::<16>(&d, &x, &dy, rows.clone(), c0, acc),
                    }
                }
                acc.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let eight = sums(8);
            assert!(
                eight.iter().any(|&b| b != 0),
                "{d:?}: the sums are all zero"
            );
            assert_eq!(eight, sums(16), "{d:?}");
        }
    }

    /// The 3×3 registers path (taps by kernel row, edges apart) adds each sum in the order
    /// of the pixel-by-pixel loop, so the two give the same bits, for strides 1 and 2.
    #[test]
    fn depthwise_3x3_sums_are_the_pixel_by_pixel_sums() {
        for (stride, padding) in [(1, Padding::Same), (2, Padding::Same), (2, Padding::Valid)] {
            let c = 16;
            let d = DepthwiseConv2dDims {
                n: 2,
                h: 7,
                w: 9,
                c,
                multiplier: 1,
                kh: 3,
                kw: 3,
                sh: stride,
                sw: stride,
                padding,
            };
            let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 997.0 - 0.5;
            let x: Vec<f32> = (0..d.x_len()).map(value).collect();
            let dy: Vec<f32> = (0..d.y_len()).map(|i| value(i + 3)).collect();
            let rows = 0..d.n * d.out_h();
            let mut by_pixel = vec![0f32; 10 * c];
            depthwise_part_sums_by_pixel(&d, &x, &dy, rows.clone(), &mut by_pixel);
            let mut by_rows = vec![0f32; 10 * c];
            for c0 in (0..c).step_by(8) {
                depthwise_part_3x3_body::<8>(&d, &x, &dy, rows.clone(), c0, &mut by_rows);
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&by_rows), bits(&by_pixel), "{d:?}");
        }
    }
}
