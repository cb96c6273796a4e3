//! 2-D convolutions, forward and backward: conv2d and conv2d_transpose by chunked im2col + GEMM,
//! depthwise conv2d directly.
//!
//! Layouts (Keras): activations NHWC; conv2d weight `[kh, kw, c_in, c_out]`; depthwise weight
//! `[kh, kw, c, multiplier]` (output channel `ci·multiplier + mi`); conv2d_transpose weight
//! `[kh, kw, c_out, c_in]`. Padding follows TensorFlow: see [`conv_axis`].
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
use crate::gemm::{
    add_f32, check_part, gemm_core, load_f32, matmul_mixed_ws_len, store_f32, Mat, MatMut,
};
use crate::gemm_heap::{gemm_core_heap_bytes, pieces, Strides};
use crate::{check_len, Element, KResult, KernelError};
use gemm::Parallelism;
use rayon::prelude::*;

/// Keras / TensorFlow padding mode of one convolution or pooling window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Padding {
    /// No padding: `out = (in - k) / stride + 1`.
    Valid,
    /// Zero padding so that `out = ceil(in / stride)`.
    Same,
}

/// `(out, pad_before)` of one spatial axis of a forward convolution, TensorFlow's rule:
/// `out = ceil(in/stride)` (same) or `(in-k)/stride + 1` (valid, `0` when `in < k`);
/// `pad_total = max((out-1)·stride + k - in, 0)`, `pad_before = pad_total / 2` (the odd one
/// goes after).
pub fn conv_axis(input: usize, k: usize, stride: usize, padding: Padding) -> (usize, usize) {
    let out = match padding {
        Padding::Same => input.div_ceil(stride),
        Padding::Valid if input >= k => (input - k) / stride + 1,
        Padding::Valid => 0,
    };
    if out == 0 {
        return (0, 0);
    }
    let pad_total = ((out - 1) * stride + k).saturating_sub(input);
    (out, pad_total / 2)
}

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

// ---------------------------------------------------------------------------------------------
// conv2d

/// Shape of a conv2d call: `x[n, h, w, c_in] ⋆ W[kh, kw, c_in, c_out] → y[n, out_h, out_w, c_out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dDims {
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

impl Conv2dDims {
    pub fn out_h(&self) -> usize {
        conv_axis(self.h, self.kh, self.sh, self.padding).0
    }
    pub fn out_w(&self) -> usize {
        conv_axis(self.w, self.kw, self.sw, self.padding).0
    }
    /// Zero rows added above the input.
    pub fn pad_top(&self) -> usize {
        conv_axis(self.h, self.kh, self.sh, self.padding).1
    }
    /// Zero columns added left of the input.
    pub fn pad_left(&self) -> usize {
        conv_axis(self.w, self.kw, self.sw, self.padding).1
    }
    pub fn x_len(&self) -> usize {
        self.n * self.h * self.w * self.c_in
    }
    pub fn y_len(&self) -> usize {
        self.n * self.out_h() * self.out_w() * self.c_out
    }
    pub fn w_len(&self) -> usize {
        self.kh * self.kw * self.c_in * self.c_out
    }
    /// 1×1 kernel, stride 1: the convolution is a plain GEMM over pixels, no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1
    }
    fn geom(&self) -> Geom {
        Geom {
            h: self.h,
            w: self.w,
            c: self.c_in,
            oh: self.out_h(),
            ow: self.out_w(),
            kh: self.kh,
            kw: self.kw,
            sh: self.sh,
            sw: self.sw,
            pt: self.pad_top(),
            pl: self.pad_left(),
        }
    }
}

/// Elements (storage `T`) of the im2col scratch for `chunk` samples:
/// `min(chunk, n)·out_h·out_w·kh·kw·c_in`, and `0` for a 1×1 stride-1 convolution.
pub fn conv2d_col_len(d: Conv2dDims, chunk: usize) -> usize {
    if d.is_pointwise() {
        0
    } else {
        chunk.min(d.n) * d.out_h() * d.out_w() * d.kh * d.kw * d.c_in
    }
}

/// `f32` GEMM workspace for [`conv2d_forward`] and [`conv2d_backward`] with half storage
/// (`0` for f32): with `r = min(chunk, n)·out_h·out_w` GEMM rows and `K = kh·kw·c_in`
/// (`r = n·h·w`, `K = c_in` when pointwise), the largest of
/// `ws<T,T,T>(r, c_out, K)`, `ws<T,T,f32>(K, c_out, r)`, `ws<T,T,T>(r, K, c_out)`
/// ([`matmul_mixed_ws_len`]) — at most `3·256²`.
pub fn conv2d_ws_len<T: Element>(d: Conv2dDims, chunk: usize) -> usize {
    let (r, k) = if d.is_pointwise() {
        (d.n * d.h * d.w, d.c_in)
    } else {
        (chunk.min(d.n) * d.out_h() * d.out_w(), d.kh * d.kw * d.c_in)
    };
    matmul_mixed_ws_len::<T, T, T>(r, d.c_out, k)
        .max(matmul_mixed_ws_len::<T, T, f32>(k, d.c_out, r))
        .max(matmul_mixed_ws_len::<T, T, T>(r, k, d.c_out))
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
    let par = Parallelism::Rayon(0);
    let kdim = d.kh * d.kw * d.c_in;
    let (w, y) = (Strides::row_major(d.c_out), Strides::row_major(d.c_out));
    let gemm = |rows: usize| {
        let x = Strides::row_major(kdim);
        gemm_core_heap_bytes::<T, T, T>(rows, d.c_out, kdim, x, w, 0.0, y, false, par)
    };
    if d.is_pointwise() {
        return gemm(d.n * d.h * d.w);
    }
    max_over_chunks(d.n, chunk, |cn| gemm(cn * d.out_h() * d.out_w()))
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_backward`] with this `chunk`, with
/// `dx` computed or not: the largest of its GEMMs `dw += colᵀ·dy` and (with `dx`) `dy·Wᵀ`, per
/// chunk (over all pixels when pointwise), which run one after another.
pub fn conv2d_backward_heap_bytes<T: Element>(d: Conv2dDims, chunk: usize, dx: bool) -> usize {
    let par = Parallelism::Rayon(0);
    let kdim = d.kh * d.kw * d.c_in;
    let dy = Strides::row_major(d.c_out);
    let wt = Strides::dense(d.c_out, kdim, true);
    let gemms = |rows: usize| {
        let colt = Strides::dense(kdim, rows, true);
        let dw_out = Strides::row_major(d.c_out);
        let dw = gemm_core_heap_bytes::<T, T, f32>(
            kdim, d.c_out, rows, colt, dy, 1.0, dw_out, false, par,
        );
        let dx_out = Strides::row_major(kdim);
        let dx = if dx {
            gemm_core_heap_bytes::<T, T, T>(rows, kdim, d.c_out, dy, wt, 0.0, dx_out, false, par)
        } else {
            0
        };
        dw.max(dx)
    };
    if d.is_pointwise() {
        return gemms(d.n * d.h * d.w);
    }
    max_over_chunks(d.n, chunk, |cn| gemms(cn * d.out_h() * d.out_w()))
}

fn check_conv2d<T: Element>(
    what: &str,
    d: &Conv2dDims,
    chunk: usize,
    col: &[T],
    ws: &[f32],
) -> KResult {
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    check_chunk(what, chunk)?;
    check_part(what, "col", col.len(), conv2d_col_len(*d, chunk))?;
    check_part(what, "ws", ws.len(), conv2d_ws_len::<T>(*d, chunk))
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
    check_conv2d(what, &d, chunk, col, ws)?;
    check_len("conv2d_forward x", x.len(), d.x_len())?;
    check_len("conv2d_forward w", w.len(), d.w_len())?;
    check_len("conv2d_forward y", y.len(), d.y_len())?;
    if let Some(b) = bias {
        check_len("conv2d_forward bias", b.len(), d.c_out)?;
    }
    let g = d.geom();
    let par = Parallelism::Rayon(0);
    let kdim = g.k();
    let wv = Mat::dense(what, w, 0, kdim, d.c_out, false)?;
    if d.is_pointwise() {
        let rows = d.n * d.h * d.w;
        let xv = Mat::dense(what, x, 0, rows, d.c_in, false)?;
        let yv = MatMut::row_major(what, y, 0, rows, d.c_out, d.c_out)?;
        // SAFETY: views checked; y unique.
        unsafe { gemm_core(rows, d.c_out, d.c_in, 1.0, xv, wv, 0.0, yv, bias, ws, par) };
        return Ok(());
    }
    let p = g.oh * g.ow;
    for n0 in (0..d.n).step_by(chunk) {
        let cn = chunk.min(d.n - n0);
        im2col(&g, x, n0, cn, col);
        let colv = Mat::dense(what, col, 0, cn * p, kdim, false)?;
        let yv = MatMut::row_major(what, y, n0 * p * d.c_out, cn * p, d.c_out, d.c_out)?;
        // SAFETY: views checked; col and y are distinct unique borrows.
        unsafe { gemm_core(cn * p, d.c_out, kdim, 1.0, colv, wv, 0.0, yv, bias, ws, par) };
    }
    Ok(())
}

/// Backward of [`conv2d_forward`] given `dy[n,out_h,out_w,c_out]`:
///
/// - `dw += im2col(x)ᵀ·dy` — f32 `[kh,kw,c_in,c_out]`, **accumulated**.
/// - `db += Σ dy` over n, out_h, out_w — f32 `[c_out]`, **accumulated**; `None` without bias.
/// - `dx = col2im(dy·Wᵀ)` — **overwritten**; `None` when the input needs no gradient.
///
/// Per chunk the same `col` scratch holds first `im2col(x)` (for `dw`), then `dy·Wᵀ` (for
/// `dx`). `col`: [`conv2d_col_len`]; `ws`: [`conv2d_ws_len`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward<T: Element>(
    d: Conv2dDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    mut dx: Option<&mut [T]>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    col: &mut [T],
    chunk: usize,
    ws: &mut [f32],
) -> KResult {
    let what = "conv2d_backward";
    check_conv2d(what, &d, chunk, col, ws)?;
    check_len("conv2d_backward x", x.len(), d.x_len())?;
    check_len("conv2d_backward w", w.len(), d.w_len())?;
    check_len("conv2d_backward dy", dy.len(), d.y_len())?;
    check_len("conv2d_backward dw", dw.len(), d.w_len())?;
    if let Some(dx) = &dx {
        check_len("conv2d_backward dx", dx.len(), d.x_len())?;
    }
    if let Some(db) = &db {
        check_len("conv2d_backward db", db.len(), d.c_out)?;
    }
    let g = d.geom();
    let par = Parallelism::Rayon(0);
    let kdim = g.k();
    let p = g.oh * g.ow;
    // Wᵀ as a [c_out, K] view of the [K, c_out] weight.
    let wt = Mat::dense(what, w, 0, d.c_out, kdim, true)?;
    let dwv = MatMut::row_major(what, dw, 0, kdim, d.c_out, d.c_out)?;
    if d.is_pointwise() {
        let rows = d.n * d.h * d.w;
        let xt = Mat::dense(what, x, 0, d.c_in, rows, true)?;
        let dyv = Mat::dense(what, dy, 0, rows, d.c_out, false)?;
        // SAFETY: views checked; dw and dx are unique borrows distinct from the inputs.
        unsafe {
            gemm_core(d.c_in, d.c_out, rows, 1.0, xt, dyv, 1.0, dwv, None, ws, par);
            if let Some(dx) = dx {
                let dxv = MatMut::row_major(what, dx, 0, rows, d.c_in, d.c_in)?;
                gemm_core(rows, d.c_in, d.c_out, 1.0, dyv, wt, 0.0, dxv, None, ws, par);
            }
        }
    } else {
        for n0 in (0..d.n).step_by(chunk) {
            let cn = chunk.min(d.n - n0);
            let rows = cn * p;
            let dyv = Mat::dense(what, dy, n0 * p * d.c_out, rows, d.c_out, false)?;
            im2col(&g, x, n0, cn, col);
            let colt = Mat::dense(what, col, 0, kdim, rows, true)?;
            // SAFETY: views checked; dw unique, col only read here.
            unsafe { gemm_core(kdim, d.c_out, rows, 1.0, colt, dyv, 1.0, dwv, None, ws, par) };
            if let Some(dx) = dx.as_deref_mut() {
                let colm = MatMut::row_major(what, col, 0, rows, kdim, kdim)?;
                // SAFETY: views checked; col is now the unique destination.
                unsafe { gemm_core(rows, kdim, d.c_out, 1.0, dyv, wt, 0.0, colm, None, ws, par) };
                let img = g.h * g.w * g.c;
                col2im(&g, col, cn, &mut dx[n0 * img..(n0 + cn) * img], None);
            }
        }
    }
    if let Some(db) = db {
        add_column_sums(dy, d.n * p, d.c_out, db);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// conv2d_transpose

/// Shape of a conv2d_transpose call:
/// `x[n, h, w, c_in] → y[n, out_h, out_w, c_out]` with weight `[kh, kw, c_out, c_in]`.
/// Keras output size: `(in-1)·stride + k` (valid) or `in·stride` (same).
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

fn transpose_axis(input: usize, k: usize, s: usize, padding: Padding) -> (usize, usize) {
    let out = match padding {
        Padding::Valid => (input.max(1) - 1) * s + k,
        Padding::Same => input * s,
    };
    // The transposed conv is the input-gradient of a conv from `out` to `input`: its padding.
    (out, ((input.max(1) - 1) * s + k).saturating_sub(out) / 2)
}

impl ConvTranspose2dDims {
    pub fn out_h(&self) -> usize {
        transpose_axis(self.h, self.kh, self.sh, self.padding).0
    }
    pub fn out_w(&self) -> usize {
        transpose_axis(self.w, self.kw, self.sw, self.padding).0
    }
    /// Rows cropped from the top of the full (valid) transposed output: `max(kh-sh, 0)/2` for same.
    pub fn pad_top(&self) -> usize {
        transpose_axis(self.h, self.kh, self.sh, self.padding).1
    }
    pub fn pad_left(&self) -> usize {
        transpose_axis(self.w, self.kw, self.sw, self.padding).1
    }
    pub fn x_len(&self) -> usize {
        self.n * self.h * self.w * self.c_in
    }
    pub fn y_len(&self) -> usize {
        self.n * self.out_h() * self.out_w() * self.c_out
    }
    pub fn w_len(&self) -> usize {
        self.kh * self.kw * self.c_out * self.c_in
    }
    /// 1×1 kernel, stride 1: `y = x·Wᵀ`, no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1
    }
    /// The geometry of the equivalent conv2d running from `y`'s shape to `x`'s.
    fn geom(&self) -> Geom {
        Geom {
            h: self.out_h(),
            w: self.out_w(),
            c: self.c_out,
            oh: self.h,
            ow: self.w,
            kh: self.kh,
            kw: self.kw,
            sh: self.sh,
            sw: self.sw,
            pt: self.pad_top(),
            pl: self.pad_left(),
        }
    }
}

/// Elements (storage `T`) of the conv2d_transpose col scratch for `chunk` samples:
/// `min(chunk, n)·h·w·kh·kw·c_out` (one row per *input* pixel), `0` when pointwise.
pub fn conv2d_transpose_col_len(d: ConvTranspose2dDims, chunk: usize) -> usize {
    if d.is_pointwise() {
        0
    } else {
        chunk.min(d.n) * d.h * d.w * d.kh * d.kw * d.c_out
    }
}

/// `f32` GEMM workspace for conv2d_transpose with half storage (`0` for f32): with
/// `r = min(chunk, n)·h·w` and `K = kh·kw·c_out` (`r = n·h·w`, `K = c_out` when pointwise),
/// the largest of `ws<T,T,T>(r, K, c_in)`, `ws<T,T,f32>(K, c_in, r)`, `ws<T,T,T>(r, c_in, K)`.
pub fn conv2d_transpose_ws_len<T: Element>(d: ConvTranspose2dDims, chunk: usize) -> usize {
    let (r, k) = if d.is_pointwise() {
        (d.n * d.h * d.w, d.c_out)
    } else {
        (chunk.min(d.n) * d.h * d.w, d.kh * d.kw * d.c_out)
    };
    matmul_mixed_ws_len::<T, T, T>(r, k, d.c_in)
        .max(matmul_mixed_ws_len::<T, T, f32>(k, d.c_in, r))
        .max(matmul_mixed_ws_len::<T, T, T>(r, d.c_in, k))
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_transpose_forward`] with this
/// `chunk` ([`crate::gemm_heap`]): the largest of its per-chunk GEMMs `x·Wᵀ` (one GEMM over all
/// pixels when pointwise). With or without bias alike.
pub fn conv2d_transpose_forward_heap_bytes<T: Element>(
    d: ConvTranspose2dDims,
    chunk: usize,
) -> usize {
    let par = Parallelism::Rayon(0);
    let kdim = d.kh * d.kw * d.c_out;
    let (x, wt) = (
        Strides::row_major(d.c_in),
        Strides::dense(d.c_in, kdim, true),
    );
    // Pointwise, the product is y[rows, c_out] (kdim == c_out); else col[rows, kdim].
    let gemm = |rows: usize| {
        let out = Strides::row_major(kdim);
        gemm_core_heap_bytes::<T, T, T>(rows, kdim, d.c_in, x, wt, 0.0, out, false, par)
    };
    if d.is_pointwise() {
        return gemm(d.n * d.h * d.w);
    }
    max_over_chunks(d.n, chunk, |cn| gemm(cn * d.h * d.w))
}

/// Peak heap bytes the `gemm` crate holds during one [`conv2d_transpose_backward`] with this
/// `chunk`, with `dx` computed or not: the largest of its GEMMs `dw += colᵀ·x` and (with `dx`)
/// `col·W`, per chunk (over all pixels when pointwise).
pub fn conv2d_transpose_backward_heap_bytes<T: Element>(
    d: ConvTranspose2dDims,
    chunk: usize,
    dx: bool,
) -> usize {
    let par = Parallelism::Rayon(0);
    let kdim = d.kh * d.kw * d.c_out;
    let (x, w, out) = (
        Strides::row_major(d.c_in),
        Strides::row_major(d.c_in),
        Strides::row_major(d.c_in),
    );
    let gemms = |rows: usize| {
        let (colt, col) = (Strides::dense(kdim, rows, true), Strides::row_major(kdim));
        let dw =
            gemm_core_heap_bytes::<T, T, f32>(kdim, d.c_in, rows, colt, x, 1.0, out, false, par);
        let dx = if dx {
            gemm_core_heap_bytes::<T, T, T>(rows, d.c_in, kdim, col, w, 0.0, out, false, par)
        } else {
            0
        };
        dw.max(dx)
    };
    if d.is_pointwise() {
        return gemms(d.n * d.h * d.w);
    }
    max_over_chunks(d.n, chunk, |cn| gemms(cn * d.h * d.w))
}

fn check_transpose<T: Element>(
    what: &str,
    d: &ConvTranspose2dDims,
    chunk: usize,
    col: &[T],
    ws: &[f32],
) -> KResult {
    if d.kh == 0 || d.kw == 0 || d.sh == 0 || d.sw == 0 || d.h == 0 || d.w == 0 {
        return Err(KernelError(format!(
            "{what}: kernel {}×{}, strides {}×{} and input {}×{} must all be ≥ 1",
            d.kh, d.kw, d.sh, d.sw, d.h, d.w
        )));
    }
    check_chunk(what, chunk)?;
    check_part(what, "col", col.len(), conv2d_transpose_col_len(*d, chunk))?;
    check_part(
        what,
        "ws",
        ws.len(),
        conv2d_transpose_ws_len::<T>(*d, chunk),
    )
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
    check_transpose(what, &d, chunk, col, ws)?;
    check_len("conv2d_transpose_forward x", x.len(), d.x_len())?;
    check_len("conv2d_transpose_forward w", w.len(), d.w_len())?;
    check_len("conv2d_transpose_forward y", y.len(), d.y_len())?;
    if let Some(b) = bias {
        check_len("conv2d_transpose_forward bias", b.len(), d.c_out)?;
    }
    let g = d.geom();
    let par = Parallelism::Rayon(0);
    let kdim = g.k();
    // Wᵀ: a [c_in, K] view of the [K, c_in] weight.
    let wt = Mat::dense(what, w, 0, d.c_in, kdim, true)?;
    let p = d.h * d.w;
    if d.is_pointwise() {
        let rows = d.n * p;
        let xv = Mat::dense(what, x, 0, rows, d.c_in, false)?;
        let yv = MatMut::row_major(what, y, 0, rows, d.c_out, d.c_out)?;
        // SAFETY: views checked; y unique.
        unsafe { gemm_core(rows, d.c_out, d.c_in, 1.0, xv, wt, 0.0, yv, bias, ws, par) };
        return Ok(());
    }
    let img = g.h * g.w * g.c;
    for n0 in (0..d.n).step_by(chunk) {
        let cn = chunk.min(d.n - n0);
        let rows = cn * p;
        let xv = Mat::dense(what, x, n0 * p * d.c_in, rows, d.c_in, false)?;
        let colm = MatMut::row_major(what, col, 0, rows, kdim, kdim)?;
        // SAFETY: views checked; col unique.
        unsafe { gemm_core(rows, kdim, d.c_in, 1.0, xv, wt, 0.0, colm, None, ws, par) };
        col2im(&g, col, cn, &mut y[n0 * img..(n0 + cn) * img], bias);
    }
    Ok(())
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
    check_transpose(what, &d, chunk, col, ws)?;
    check_len("conv2d_transpose_backward x", x.len(), d.x_len())?;
    check_len("conv2d_transpose_backward w", w.len(), d.w_len())?;
    check_len("conv2d_transpose_backward dy", dy.len(), d.y_len())?;
    check_len("conv2d_transpose_backward dw", dw.len(), d.w_len())?;
    if let Some(dx) = &dx {
        check_len("conv2d_transpose_backward dx", dx.len(), d.x_len())?;
    }
    if let Some(db) = &db {
        check_len("conv2d_transpose_backward db", db.len(), d.c_out)?;
    }
    let g = d.geom();
    let par = Parallelism::Rayon(0);
    let kdim = g.k();
    let p = d.h * d.w;
    let wv = Mat::dense(what, w, 0, kdim, d.c_in, false)?;
    let dwv = MatMut::row_major(what, dw, 0, kdim, d.c_in, d.c_in)?;
    let dxv = match dx {
        Some(dx) => Some(MatMut::row_major(what, dx, 0, d.n * p, d.c_in, d.c_in)?),
        None => None,
    };
    if d.is_pointwise() {
        let rows = d.n * p;
        let dyt = Mat::dense(what, dy, 0, d.c_out, rows, true)?;
        let dyv = Mat::dense(what, dy, 0, rows, d.c_out, false)?;
        let xv = Mat::dense(what, x, 0, rows, d.c_in, false)?;
        // SAFETY: views checked; dw and dx unique.
        unsafe {
            gemm_core(d.c_out, d.c_in, rows, 1.0, dyt, xv, 1.0, dwv, None, ws, par);
            if let Some(dxv) = dxv {
                gemm_core(rows, d.c_in, d.c_out, 1.0, dyv, wv, 0.0, dxv, None, ws, par);
            }
        }
    } else {
        for n0 in (0..d.n).step_by(chunk) {
            let cn = chunk.min(d.n - n0);
            let rows = cn * p;
            im2col(&g, dy, n0, cn, col);
            let colv = Mat::dense(what, col, 0, rows, kdim, false)?;
            let colt = Mat::dense(what, col, 0, kdim, rows, true)?;
            let xv = Mat::dense(what, x, n0 * p * d.c_in, rows, d.c_in, false)?;
            // SAFETY: views checked; dw / dx unique and distinct from col, x, w.
            unsafe {
                gemm_core(kdim, d.c_in, rows, 1.0, colt, xv, 1.0, dwv, None, ws, par);
                if let Some(dxv) = dxv {
                    let dst = dxv.offset(n0 * p * d.c_in);
                    gemm_core(rows, d.c_in, kdim, 1.0, colv, wv, 0.0, dst, None, ws, par);
                }
            }
        }
    }
    if let Some(db) = db {
        add_column_sums(dy, d.n * d.out_h() * d.out_w(), d.c_out, db);
    }
    Ok(())
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
    pub fn out_h(&self) -> usize {
        conv_axis(self.h, self.kh, self.sh, self.padding).0
    }
    pub fn out_w(&self) -> usize {
        conv_axis(self.w, self.kw, self.sw, self.padding).0
    }
    pub fn pad_top(&self) -> usize {
        conv_axis(self.h, self.kh, self.sh, self.padding).1
    }
    pub fn pad_left(&self) -> usize {
        conv_axis(self.w, self.kw, self.sw, self.padding).1
    }
    /// Output channels `c·multiplier`.
    pub fn c_out(&self) -> usize {
        self.c * self.multiplier
    }
    pub fn x_len(&self) -> usize {
        self.n * self.h * self.w * self.c
    }
    pub fn y_len(&self) -> usize {
        self.n * self.out_h() * self.out_w() * self.c_out()
    }
    pub fn w_len(&self) -> usize {
        self.kh * self.kw * self.c * self.multiplier
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
    check_len("depthwise_conv2d_forward x", x.len(), d.x_len())?;
    check_len("depthwise_conv2d_forward w", w.len(), d.w_len())?;
    check_len("depthwise_conv2d_forward y", y.len(), d.y_len())?;
    if let Some(b) = bias {
        check_len("depthwise_conv2d_forward bias", b.len(), d.c_out())?;
    }
    let (oh, ow, co, m, c) = (d.out_h(), d.out_w(), d.c_out(), d.multiplier, d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    if co == 0 || oh == 0 || ow == 0 {
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
                            gather_channels(&x[px..px + c], m, o0, &mut xs[..ob]);
                            let wt = ((ki * d.kw + kj) * co) + o0;
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
    let what = "depthwise_conv2d_backward";
    check_window(what, d.h, d.w, d.kh, d.kw, d.sh, d.sw, d.padding)?;
    if d.multiplier == 0 {
        return Err(KernelError(format!("{what}: multiplier must be ≥ 1")));
    }
    check_len("depthwise_conv2d_backward x", x.len(), d.x_len())?;
    check_len("depthwise_conv2d_backward w", w.len(), d.w_len())?;
    check_len("depthwise_conv2d_backward dy", dy.len(), d.y_len())?;
    check_len("depthwise_conv2d_backward dw", dw.len(), d.w_len())?;
    if let Some(dx) = &dx {
        check_len("depthwise_conv2d_backward dx", dx.len(), d.x_len())?;
    }
    if let Some(db) = &db {
        check_len("depthwise_conv2d_backward db", db.len(), d.c_out())?;
    }
    let (oh, ow, co, m, c) = (d.out_h(), d.out_w(), d.c_out(), d.multiplier, d.c);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    if co == 0 {
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
                                gather_channels(&x[px..px + c], m, o0, &mut xs[..ob]);
                                let g0 = ((s * oh + oy) * ow + ox) * co + o0;
                                load_f32(&dy[g0..g0 + ob], &mut gs[..ob]);
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

    // dx: each input pixel gathers from the output pixels whose window covers it.
    if let Some(dx) = dx {
        dx[..d.x_len()]
            .par_chunks_mut(d.w * c)
            .enumerate()
            .for_each(|(r, dxrow)| {
                let (s, iy) = (r / d.h, r % d.h);
                let mut acc = [0f32; CH_BLOCK];
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
                                    let mut gs = [0f32; CH_BLOCK];
                                    let mut wk = [0f32; CH_BLOCK];
                                    load_f32(&dy[g + c0..g + c0 + cb], &mut gs[..cb]);
                                    load_f32(&w[wt + c0..wt + c0 + cb], &mut wk[..cb]);
                                    for ((a, gv), wv) in
                                        acc.iter_mut().zip(&gs[..cb]).zip(&wk[..cb])
                                    {
                                        *a += gv * wv;
                                    }
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

    if let Some(db) = db {
        add_column_sums(dy, d.n * oh * ow, co, db);
    }
    Ok(())
}

/// The output coordinate whose window puts tap `k` on input coordinate `i`, if any:
/// `o` with `o·stride + k - pad = i` and `0 ≤ o < out`.
#[inline]
fn window_origin(i: usize, k: usize, pad: isize, stride: usize, out: usize) -> Option<usize> {
    let t = i as isize + pad - k as isize;
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
