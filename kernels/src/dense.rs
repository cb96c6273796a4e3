//! Dense (fully connected) layer forward and backward: `y = x·W + b` with Keras' `W[in, out]`.
//!
//! Storage `T` (f32, f16, bf16) for activations and the working copy of `W`; the bias and the
//! parameter gradients are `f32` (the master copies). Accumulation is always `f32`.

use crate::elementwise::wide_loop;
use crate::gemm::{as_f32, gemm_core, is_f32, load_f32, matmul_mixed_ws_len, Mat, MatMut};
use crate::gemm_heap::{gemm_core_heap_bytes, Strides};
use crate::{check_len, Element, KResult};
use gemm::Parallelism;
use rayon::prelude::*;

/// Shape of one dense layer call: `x[batch, in_features] · W[in_features, out_features]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseDims {
    pub batch: usize,
    pub in_features: usize,
    pub out_features: usize,
}

impl DenseDims {
    /// Elements of `x` / `dx`.
    pub fn x_len(&self) -> usize {
        self.batch * self.in_features
    }
    /// Elements of `y` / `dy`.
    pub fn y_len(&self) -> usize {
        self.batch * self.out_features
    }
    /// Elements of `W` / `dW`.
    pub fn w_len(&self) -> usize {
        self.in_features * self.out_features
    }
}

/// `f32` workspace (elements) that [`dense_forward`] and [`dense_backward`] need: the largest
/// of their GEMMs' [`matmul_mixed_ws_len`] —
/// `max(ws<T,T,T>(batch, out, in), ws<T,T,T>(batch, in, out), ws<T,T,f32>(in, out, batch))`.
/// `0` for `f32`; at most `3·256²` for half storage.
pub fn dense_ws_len<T: Element>(d: DenseDims) -> usize {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    matmul_mixed_ws_len::<T, T, T>(b, o, i)
        .max(matmul_mixed_ws_len::<T, T, T>(b, i, o))
        .max(matmul_mixed_ws_len::<T, T, f32>(i, o, b))
}

/// Peak heap bytes the `gemm` crate holds during one [`dense_forward`] ([`crate::gemm_heap`]):
/// its one GEMM `x·W`. The same with or without a bias (it changes no allocation).
pub fn dense_forward_heap_bytes<T: Element>(d: DenseDims) -> usize {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    gemm_core_heap_bytes::<T, T, T>(
        b,
        o,
        i,
        Strides::dense(b, i, false),
        Strides::dense(i, o, false),
        0.0,
        Strides::row_major(o),
        false,
        Parallelism::Rayon(0),
    )
}

/// Peak heap bytes the `gemm` crate holds during one [`dense_backward`], with `dx` computed or
/// not: the larger of its GEMMs `dw += xᵀ·dy` and (with `dx`) `dx = dy·Wᵀ`, which run one after
/// the other.
pub fn dense_backward_heap_bytes<T: Element>(d: DenseDims, dx: bool) -> usize {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    let par = Parallelism::Rayon(0);
    let dy = Strides::dense(b, o, false);
    let dw = gemm_core_heap_bytes::<T, T, f32>(
        i,
        o,
        b,
        Strides::dense(i, b, true),
        dy,
        1.0,
        Strides::row_major(o),
        false,
        par,
    );
    let dx = if dx {
        let wt = Strides::dense(o, i, true);
        gemm_core_heap_bytes::<T, T, T>(b, i, o, dy, wt, 0.0, Strides::row_major(i), false, par)
    } else {
        0
    };
    dw.max(dx)
}

/// Forward: `y = x·W (+ bias)`; `y` is overwritten.
///
/// `x[batch, in]`, `w[in, out]` (storage `T`), `bias[out]` (f32, added in f32 before the one
/// rounding to `T`), `y[batch, out]`. `ws`: [`dense_ws_len`] (empty for f32).
pub fn dense_forward<T: Element>(
    d: DenseDims,
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    y: &mut [T],
    ws: &mut [f32],
) -> KResult {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    let xv = Mat::dense("dense_forward x", x, 0, b, i, false)?;
    let wv = Mat::dense("dense_forward w", w, 0, i, o, false)?;
    if let Some(bias) = bias {
        check_len("dense_forward bias", bias.len(), o)?;
    }
    let yv = MatMut::row_major("dense_forward y", y, 0, b, o, o)?;
    check_len("dense_forward ws", ws.len(), dense_ws_len::<T>(d))?;
    // SAFETY: views checked above; y is a unique borrow.
    unsafe {
        gemm_core(
            b,
            o,
            i,
            1.0,
            xv,
            wv,
            0.0,
            yv,
            bias,
            ws,
            Parallelism::Rayon(0),
        )
    };
    Ok(())
}

/// Backward of [`dense_forward`] given `dy[batch, out]`:
///
/// - `dx = dy·Wᵀ` — **overwritten**; pass `None` when the input needs no gradient.
/// - `dw += xᵀ·dy` — f32 master gradient `[in, out]`, **accumulated** (the caller zeroes it once
///   per step).
/// - `db += Σ_rows dy` — f32 `[out]`, **accumulated**; `None` when the layer has no bias.
///
/// `ws`: [`dense_ws_len`] (empty for f32). Nothing is written when an argument is refused.
#[allow(clippy::too_many_arguments)]
pub fn dense_backward<T: Element>(
    d: DenseDims,
    x: &[T],
    w: &[T],
    dy: &[T],
    dx: Option<&mut [T]>,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    ws: &mut [f32],
) -> KResult {
    let (b, i, o) = (d.batch, d.in_features, d.out_features);
    let xt = Mat::dense("dense_backward x", x, 0, i, b, true)?;
    let wt = Mat::dense("dense_backward w", w, 0, o, i, true)?;
    let dyv = Mat::dense("dense_backward dy", dy, 0, b, o, false)?;
    let dwv = MatMut::row_major("dense_backward dw", dw, 0, i, o, o)?;
    let dxv = match dx {
        Some(dx) => Some(MatMut::row_major("dense_backward dx", dx, 0, b, i, i)?),
        None => None,
    };
    if let Some(db) = &db {
        check_len("dense_backward db", db.len(), o)?;
    }
    check_len("dense_backward ws", ws.len(), dense_ws_len::<T>(d))?;
    let par = Parallelism::Rayon(0);
    // SAFETY: every view was checked above; dw and dx are unique borrows.
    unsafe {
        gemm_core(i, o, b, 1.0, xt, dyv, 1.0, dwv, None, ws, par);
        if let Some(dxv) = dxv {
            gemm_core(b, i, o, 1.0, dyv, wt, 0.0, dxv, None, ws, par);
        }
    }
    if let Some(db) = db {
        add_column_sums(dy, b, o, db);
    }
    Ok(())
}

/// `sums[j] += Σ_r m[r, j]` over a row-major `[rows, cols]` matrix, accumulated in f64 and
/// rounded once; parallel over column blocks so every thread owns its slice of `sums` (no
/// atomics, deterministic). Lengths are the caller's to check.
///
/// Why f64: bias gradients often cancel (terms of both signs summing to little), and an f32
/// running sum then carries the rounding of its terms, not of its result. Data-parallel
/// replicas each sum their share of the batch; in f64 the replicas' sums agree with one
/// device's whole-batch sum to the result's own rounding, so Adam (which divides by the
/// gradient's magnitude) does not amplify the split into a visible weight difference.
pub(crate) fn add_column_sums<T: Element>(m: &[T], rows: usize, cols: usize, sums: &mut [f32]) {
    const COLS_PER_TASK: usize = 64;
    sums[..cols]
        .par_chunks_mut(COLS_PER_TASK)
        .enumerate()
        .for_each(|(blk, s)| {
            let j0 = blk * COLS_PER_TASK;
            let mut acc = [0f64; COLS_PER_TASK];
            let mut row = [0f32; COLS_PER_TASK];
            let (acc, row) = (&mut acc[..s.len()], &mut row[..s.len()]);
            column_block_sums(m, rows, cols, j0, acc, row);
            for (s, a) in s.iter_mut().zip(acc.iter()) {
                *s = (f64::from(*s) + a) as f32;
            }
        });
}

wide_loop! {
    /// `acc[j] += Σ_r m[r, j0 + j]` in f64, rows in order, for the `acc.len()` columns from
    /// `j0`; a half `m` is converted a row at a time through `row` (as long as `acc`). Wide
    /// for f32: eight f64 lanes per AVX-512 register keep a 64-column block's sums in
    /// registers, where SSE2's two spilled them on every row.
    fn column_block_sums<T: Element>(
        m: &[T],
        rows: usize,
        cols: usize,
        j0: usize,
        acc: &mut [f64],
        row: &mut [f32]
    ) wide if is_f32::<T>(), {
        let n = acc.len();
        for r in 0..rows {
            let src = &m[r * cols + j0..][..n];
            let src: &[f32] = match as_f32(src) {
                Some(src) => src,
                None => {
                    load_f32(src, row);
                    row
                }
            };
            for (a, x) in acc.iter_mut().zip(src) {
                *a += f64::from(*x);
            }
        }
    }
}
