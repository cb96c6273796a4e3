//! Row-major matrix multiply over the `gemm` crate: the one GEMM that dense, conv and attention call.
//!
//! Convention (BLAS, **not** the `gemm` crate's): `c = alpha·op(a)·op(b) + beta·c`, where
//! `op(x)` is `x` or `xᵀ`. When `beta == 0`, `c` is never read (NaN or garbage in `c` does not
//! leak into the result). The `gemm` crate itself computes `dst = alpha·dst + beta·lhs·rhs`;
//! the swap happens in exactly one place (the private `sgemm_raw`).
//!
//! Storage: `gemm` 0.19 multiplies `f32`, `f64` and `half::f16` but not `bf16` (it panics), and
//! its `f16` path writes its destination back to `f16` after every depth block (`kc`), so a long
//! reduction would be rounded several times. To keep one rule for every kernel — *accumulate in
//! `f32`* — every operand that is not `f32` is converted, one bounded block at a time, into a
//! caller-provided `f32` workspace `ws`, and the block product runs in the `f32` GEMM. When all
//! three operands are `f32` no workspace is needed and the `gemm` crate is called directly on the
//! caller's slices. Workspace lengths come from [`matmul_ws_len`] / [`matmul_mixed_ws_len`]:
//! at most `3 · 256 · 256` floats (768 KiB), whatever the matrix sizes.
//!
//! Threads: the `gemm` crate splits one product over rayon's pool. Batched products whose items
//! are too small for that instead run items in parallel, each single-threaded.
//!
//! Allocation: these functions allocate nothing themselves. The `gemm` crate does: 1 to 3 heap
//! blocks inside every call (its packing buffers, sized by its cache blocking, and a few bytes of
//! bookkeeping), all freed before the call returns, plus a slab per thread kept for good.
//! [`crate::gemm_heap`] models both exactly (the `*_heap_bytes` functions here and beside each
//! kernel's `*_ws_len`); `tests/gemm_heap.rs` measures them.

use crate::gemm_heap::{gemm_core_heap_bytes, Strides};
use crate::{check_len, check_len_with, Element, KResult, KernelError};
use gemm::Parallelism;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use std::any::TypeId;

/// Rows of `op(a)` / `c` converted to `f32` at a time when an operand is not `f32`.
pub const BLOCK_M: usize = 256;
/// Columns of `op(b)` / `c` converted to `f32` at a time when an operand is not `f32`.
pub const BLOCK_N: usize = 256;
/// Depth (shared dimension) converted to `f32` at a time when an operand is not `f32`.
pub const BLOCK_K: usize = 256;

/// True when `T` is `f32` (then no conversion, hence no workspace, is needed for it).
#[inline]
pub fn is_f32<T: Element>() -> bool {
    TypeId::of::<T>() == TypeId::of::<f32>()
}

/// `f32` workspace elements [`matmul_mixed`] needs for an `m×n×k` product with operand
/// storage `A`, `B`, `C`:
///
/// `(A≠f32 ? mb·kb : 0) + (B≠f32 ? kb·nb : 0) + (C≠f32 ? mb·nb : 0)` with
/// `mb = min(m, 256)`, `nb = min(n, 256)`, `kb = min(k, 256)`; `0` when all are `f32` or any
/// dimension is `0`.
pub fn matmul_mixed_ws_len<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
) -> usize {
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    let (mb, nb, kb) = (m.min(BLOCK_M), n.min(BLOCK_N), k.min(BLOCK_K));
    let mut len = 0;
    if !is_f32::<A>() {
        len += mb * kb;
    }
    if !is_f32::<B>() {
        len += kb * nb;
    }
    if !is_f32::<C>() {
        len += mb * nb;
    }
    len
}

/// `f32` workspace elements [`matmul`] needs: [`matmul_mixed_ws_len::<T, T, T>`]
/// (`0` for `f32`, at most `3·256²` for `f16`/`bf16`).
pub fn matmul_ws_len<T: Element>(m: usize, n: usize, k: usize) -> usize {
    matmul_mixed_ws_len::<T, T, T>(m, n, k)
}

/// `c[m×n] = alpha·op(a)·op(b) + beta·c`, all row-major and contiguous.
///
/// `a` holds `[m, k]` (or `[k, m]` when `a_trans`), `b` holds `[k, n]` (or `[n, k]` when
/// `b_trans`). BLAS convention: `beta == 0` means `c` is overwritten without being read.
/// Products accumulate in `f32`; `ws` is the `f32` workspace of [`matmul_ws_len`] (empty for
/// `f32`). Errors (and writes nothing) when a slice is shorter than its dims.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Element>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_trans: bool,
    b: &[T],
    b_trans: bool,
    c: &mut [T],
    alpha: f32,
    beta: f32,
    ws: &mut [f32],
) -> KResult {
    matmul_mixed(m, n, k, a, a_trans, b, b_trans, c, alpha, beta, ws)
}

/// [`matmul`] with a storage type per operand, e.g. `f32 += f16ᵀ·f16` for a master weight
/// gradient. `ws` has [`matmul_mixed_ws_len::<A, B, C>`] elements.
#[allow(clippy::too_many_arguments)]
pub fn matmul_mixed<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
    a: &[A],
    a_trans: bool,
    b: &[B],
    b_trans: bool,
    c: &mut [C],
    alpha: f32,
    beta: f32,
    ws: &mut [f32],
) -> KResult {
    let av = Mat::dense("matmul a", a, 0, m, k, a_trans)?;
    let bv = Mat::dense("matmul b", b, 0, k, n, b_trans)?;
    let cv = MatMut::row_major("matmul c", c, 0, m, n, n)?;
    check_len(
        "matmul ws",
        ws.len(),
        matmul_mixed_ws_len::<A, B, C>(m, n, k),
    )?;
    // SAFETY: the views were bounds-checked above, and `c` is a unique borrow distinct from
    // `a` and `b`.
    unsafe {
        gemm_core(
            m,
            n,
            k,
            alpha,
            av,
            bv,
            beta,
            cv,
            None,
            ws,
            Parallelism::Rayon(0),
        )
    };
    Ok(())
}

/// Peak heap bytes the `gemm` crate holds during one [`matmul`] call
/// ([`matmul_mixed_heap_bytes::<T, T, T>`]).
pub fn matmul_heap_bytes<T: Element>(
    m: usize,
    n: usize,
    k: usize,
    a_trans: bool,
    b_trans: bool,
) -> usize {
    matmul_mixed_heap_bytes::<T, T, T>(m, n, k, a_trans, b_trans)
}

/// Peak heap bytes the `gemm` crate holds during one [`matmul_mixed`] call: its one
/// `gemm_core` on rayon ([`crate::gemm_heap::gemm_core_heap_bytes`]). The same for every
/// `alpha` and `beta` (gemm 0.19 allocates alike whether or not it reads `c`).
pub fn matmul_mixed_heap_bytes<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
    a_trans: bool,
    b_trans: bool,
) -> usize {
    dense_heap_bytes::<A, B, C>(m, n, k, a_trans, b_trans, Parallelism::Rayon(0))
}

/// Heap bytes of one `gemm_core` of a dense, possibly transposed `a` and `b` into a row-major
/// `c` under `par` (what every matmul here runs).
fn dense_heap_bytes<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
    a_trans: bool,
    b_trans: bool,
    par: Parallelism,
) -> usize {
    let (a, b) = (Strides::dense(m, k, a_trans), Strides::dense(k, n, b_trans));
    gemm_core_heap_bytes::<A, B, C>(m, n, k, a, b, 0.0, Strides::row_major(n), false, par)
}

/// `f32` workspace elements [`matmul_strided_batched`] needs for one item at a time; a
/// workspace `L` times as long lets `L` items run in parallel. `0` for `f32`.
pub fn matmul_strided_batched_ws_len<T: Element>(m: usize, n: usize, k: usize) -> usize {
    matmul_ws_len::<T>(m, n, k)
}

/// `batch` independent products `c_i = alpha·op(a_i)·op(b_i) + beta·c_i`, where item `i`
/// starts at `i·stride_a` in `a`, `i·stride_b` in `b`, `i·stride_c` in `c` (each item laid out
/// as in [`matmul`]). `stride_a`/`stride_b` may be `0` (one operand shared by every item);
/// `stride_c` must be at least `m·n` so items never write the same element.
///
/// Small items run in parallel (one thread each); large ones one after another, each split
/// over all threads. `ws`: at least [`matmul_strided_batched_ws_len`] (empty for `f32`).
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided_batched<T: Element>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_trans: bool,
    stride_a: usize,
    b: &[T],
    b_trans: bool,
    stride_b: usize,
    c: &mut [T],
    stride_c: usize,
    alpha: f32,
    beta: f32,
    ws: &mut [f32],
) -> KResult {
    if batch == 0 {
        return Ok(());
    }
    if batch > 1 && m * n > 0 && stride_c < m * n {
        return Err(KernelError(format!(
            "matmul_strided_batched: stride_c {stride_c} < m·n = {} would make items overlap",
            m * n
        )));
    }
    let last = batch - 1;
    let a0 = Mat::dense(
        "matmul_strided_batched a",
        a,
        last * stride_a,
        m,
        k,
        a_trans,
    )?;
    let b0 = Mat::dense(
        "matmul_strided_batched b",
        b,
        last * stride_b,
        k,
        n,
        b_trans,
    )?;
    let c0 = MatMut::row_major("matmul_strided_batched c", c, last * stride_c, m, n, n)?;
    let per = matmul_strided_batched_ws_len::<T>(m, n, k);
    check_len("matmul_strided_batched ws", ws.len(), per)?;
    // The views above were checked at the LAST item's offset; rebase them to item 0.
    let a0 = Mat {
        ptr: a.as_ptr(),
        ..a0
    };
    let b0 = Mat {
        ptr: b.as_ptr(),
        ..b0
    };
    let c0 = MatMut {
        ptr: c.as_mut_ptr(),
        ..c0
    };
    let item = |i: usize, w: &mut [f32], par: Parallelism| {
        // SAFETY: item i lies inside the checked span (i ≤ last); distinct items write disjoint
        // ranges of c because stride_c ≥ m·n.
        unsafe {
            gemm_core(
                m,
                n,
                k,
                alpha,
                a0.offset(i * stride_a),
                b0.offset(i * stride_b),
                beta,
                c0.offset(i * stride_c),
                None,
                w,
                par,
            )
        }
    };
    if batch > 1 && m * n * k < gemm::get_threading_threshold() {
        for_each_lane(batch, per, ws, |i, w| item(i, w, Parallelism::None));
    } else {
        for i in 0..batch {
            item(i, &mut ws[..per], Parallelism::Rayon(0));
        }
    }
    Ok(())
}

/// Peak heap bytes the `gemm` crate holds during one [`matmul_strided_batched`] call given a
/// workspace of `ws_len` elements: items one after another, each threaded, when they are large
/// (then one item's heap); small items in parallel lanes, each single-threaded — then as many
/// item GEMMs as can run at once ([`lanes_at_once`]) are counted live together. Independent of
/// the strides, `alpha` and `beta`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided_batched_heap_bytes<T: Element>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a_trans: bool,
    b_trans: bool,
    ws_len: usize,
) -> usize {
    let item = |par| dense_heap_bytes::<T, T, T>(m, n, k, a_trans, b_trans, par);
    if batch == 0 {
        0
    } else if batch > 1 && m * n * k < gemm::get_threading_threshold() {
        let per = matmul_strided_batched_ws_len::<T>(m, n, k);
        lanes_at_once(batch, per, ws_len) * item(Parallelism::None)
    } else {
        item(Parallelism::Rayon(0))
    }
}

// ---------------------------------------------------------------------------------------------
// Internal machinery shared by dense, conv and attention.

/// [`check_len`] for argument `part` of kernel `what`; the message is built only on failure,
/// so the success path allocates nothing.
pub(crate) fn check_part(what: &str, part: &str, have: usize, need: usize) -> KResult {
    if have < need {
        check_len_with(|| format!("{what} {part}"), have, need)
    } else {
        Ok(())
    }
}

/// A read-only strided matrix view: element `(i, j)` at `ptr + i·rs + j·cs`.
pub(crate) struct Mat<T> {
    pub ptr: *const T,
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix view: element `(i, j)` at `ptr + i·rs + j·cs`.
pub(crate) struct MatMut<T> {
    pub ptr: *mut T,
    pub rs: usize,
    pub cs: usize,
}

impl<T> Mat<T> {
    /// The row-major view at `ptr` whose rows are `rs` elements apart.
    pub(crate) fn rows(ptr: *const T, rs: usize) -> Self {
        Mat { ptr, rs, cs: 1 }
    }
}

impl<T> MatMut<T> {
    /// The writable row-major view at `ptr` whose rows are `rs` elements apart.
    pub(crate) fn rows(ptr: *mut T, rs: usize) -> Self {
        MatMut { ptr, rs, cs: 1 }
    }
}

// Manual impls: derive would require `T: Copy`, and raw pointers are Copy for any T.
impl<T> Clone for Mat<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Mat<T> {}
impl<T> Clone for MatMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for MatMut<T> {}
// SAFETY: views are only built from checked slices; parallel users write disjoint elements.
unsafe impl<T: Sync> Send for Mat<T> {}
unsafe impl<T: Sync> Sync for Mat<T> {}
unsafe impl<T: Send> Send for MatMut<T> {}
unsafe impl<T: Send> Sync for MatMut<T> {}

/// Elements a `rows×cols` view at `off` with strides `rs`, `cs` reaches: `off + last + 1`.
fn span(off: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        off + (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

impl<T> Mat<T> {
    /// A checked `rows×cols` view of `s` starting at `off`.
    pub fn new(
        what: &str,
        s: &[T],
        off: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Result<Self, KernelError> {
        check_len(what, s.len(), span(off, rows, cols, rs, cs))?;
        // wrapping_add: an empty view may start at the very end of the slice.
        Ok(Mat {
            ptr: s.as_ptr().wrapping_add(off),
            rs,
            cs,
        })
    }

    /// op(x) of a contiguous row-major matrix: `[rows, cols]`, or `[cols, rows]` read
    /// transposed when `trans`.
    pub fn dense(
        what: &str,
        s: &[T],
        off: usize,
        rows: usize,
        cols: usize,
        trans: bool,
    ) -> Result<Self, KernelError> {
        if trans {
            Self::new(what, s, off, rows, cols, 1, rows)
        } else {
            Self::new(what, s, off, rows, cols, cols, 1)
        }
    }

    /// The same view moved by `d` elements (caller keeps it in bounds).
    pub fn offset(self, d: usize) -> Self {
        Mat {
            ptr: self.ptr.wrapping_add(d),
            ..self
        }
    }

    /// The view starting at element `(i, j)`.
    pub fn sub(self, i: usize, j: usize) -> Self {
        self.offset(i * self.rs + j * self.cs)
    }

    /// The transposed view (no data moves).
    pub fn t(self) -> Self {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

impl<T> MatMut<T> {
    /// A checked writable `rows×cols` view of `s` at `off` with row stride `ld` (columns
    /// contiguous). `ld ≥ cols` is required so rows never overlap.
    pub fn row_major(
        what: &str,
        s: &mut [T],
        off: usize,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<Self, KernelError> {
        if rows > 1 && ld < cols {
            return Err(KernelError(format!(
                "{what}: row stride {ld} < {cols} columns"
            )));
        }
        check_len(what, s.len(), span(off, rows, cols, ld, 1))?;
        Ok(MatMut {
            ptr: s.as_mut_ptr().wrapping_add(off),
            rs: ld,
            cs: 1,
        })
    }

    pub fn offset(self, d: usize) -> Self {
        MatMut {
            ptr: self.ptr.wrapping_add(d),
            ..self
        }
    }

    pub fn sub(self, i: usize, j: usize) -> Self {
        self.offset(i * self.rs + j * self.cs)
    }
}

/// The only call into the `gemm` crate. `c = alpha·a·b + dst_scale·c`; `dst_scale == None`
/// means `c` is written without being read. Translates to the crate's argument order
/// (column stride before row stride) and its swapped alpha/beta.
///
/// # Safety
/// Every view must be valid for its `m×k`, `k×n`, `m×n` extent and `c` must not overlap `a`/`b`.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_raw(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat<f32>,
    b: Mat<f32>,
    dst_scale: Option<f32>,
    c: MatMut<f32>,
    par: Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        c.ptr,
        c.cs as isize,
        c.rs as isize,
        dst_scale.is_some(),
        a.ptr,
        a.cs as isize,
        a.rs as isize,
        b.ptr,
        b.cs as isize,
        b.rs as isize,
        dst_scale.unwrap_or(0.0),
        alpha,
        false,
        false,
        false,
        par,
    );
}

/// At most this many depth parts ([`depth_parts`]).
const MAX_DEPTH_PARTS: usize = 8;

/// The parts the depth `k` of an f32 product is cut into: more than one when the output is
/// small against the depth (a weight gradient summed over every pixel or token of a batch).
/// The gemm crate threads over blocks of the output only, so a 32×64 gradient over 36,864
/// pixels ran on one core, at a fifth of the machine. A function of the shape alone, so the
/// order of the sums does not depend on the thread count. Returns `(parts, depth per part)`.
pub(crate) fn depth_parts(m: usize, n: usize, k: usize) -> (usize, usize) {
    let side = m.max(n).max(1);
    let parts = if k < 1024 {
        1
    } else {
        (k / (2 * side)).clamp(1, MAX_DEPTH_PARTS)
    };
    let per = k.div_ceil(parts);
    (k.div_ceil(per.max(1)), per)
}

/// [`sgemm_raw`], the depth cut into [`depth_parts`]: part 0 goes into `c` (with
/// `dst_scale`), each later part into a buffer of its own (in parallel under `par`, each
/// single-threaded), and the buffers are then added into `c` in part order.
///
/// # Safety
/// As [`sgemm_raw`].
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_depth_split(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat<f32>,
    b: Mat<f32>,
    dst_scale: Option<f32>,
    c: MatMut<f32>,
    par: Parallelism,
) {
    let (parts, per) = depth_parts(m, n, k);
    if parts == 1 {
        return sgemm_raw(m, n, k, alpha, a, b, dst_scale, c, par);
    }
    let mut partial = vec![0f32; (parts - 1) * m * n];
    let part = |p: usize, out: MatMut<f32>, scale: Option<f32>| {
        let k0 = p * per;
        let kb = per.min(k - k0);
        // SAFETY: the caller's views cover depth k; part p reads columns / rows k0..k0 + kb.
        unsafe {
            sgemm_raw(
                m,
                n,
                kb,
                alpha,
                a.sub(0, k0),
                b.sub(k0, 0),
                scale,
                out,
                Parallelism::None,
            )
        }
    };
    let buffer = |chunk: &mut [f32]| MatMut {
        ptr: chunk.as_mut_ptr(),
        rs: n,
        cs: 1,
    };
    if matches!(par, Parallelism::Rayon(_)) {
        rayon::join(
            || part(0, c, dst_scale),
            || {
                partial
                    .par_chunks_mut(m * n)
                    .enumerate()
                    .for_each(|(p, chunk)| part(p + 1, buffer(chunk), None))
            },
        );
    } else {
        part(0, c, dst_scale);
        for (p, chunk) in partial.chunks_mut(m * n).enumerate() {
            part(p + 1, buffer(chunk), None);
        }
    }
    let partial = &partial;
    // SAFETY: c is valid for m×n and each row is touched by one task.
    for_rows(m, n, par, |i| unsafe {
        let row = c.sub(i, 0);
        for j in 0..n {
            let out = row.ptr.add(j * row.cs);
            for q in 0..parts - 1 {
                *out += partial[(q * m + i) * n + j];
            }
        }
    });
}

/// `c = alpha·a·b + beta·c (+ bias[j] on every row)`, any storage, `f32` accumulation.
///
/// `beta == 0` never reads `c`. `bias` (length ≥ n) is added in `f32` before the single
/// rounding to `C`. `ws` must hold [`matmul_mixed_ws_len::<A, B, C>(m, n, k)`] elements.
///
/// # Safety
/// The views must be valid for their extents (build them with the checked constructors) and
/// `c` must not overlap `a` or `b`; concurrent callers must use disjoint `c`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_core<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat<A>,
    b: Mat<B>,
    beta: f32,
    c: MatMut<C>,
    bias: Option<&[f32]>,
    ws: &mut [f32],
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    let mut beta = beta;
    // With no product to add, or with an f32 destination, fold beta and the bias into c first:
    // then the product is added with dst_scale = 1 and the bias is added exactly once, in f32.
    if k == 0 || (is_f32::<C>() && bias.is_some()) {
        // SAFETY: c is valid for m×n and each row is touched by one task.
        for_rows(m, n, par, |i| unsafe {
            let row = c.sub(i, 0);
            match bias {
                // The usual case, a fresh f32 row with a bias: a copy (same values as below).
                Some(b) if beta == 0.0 && row.cs == 1 && is_f32::<C>() => {
                    std::ptr::copy_nonoverlapping(b.as_ptr(), row.ptr as *mut f32, n)
                }
                _ => {
                    for j in 0..n {
                        let p = row.ptr.add(j * row.cs);
                        let old = if beta != 0.0 {
                            beta * (*p).to_f32()
                        } else {
                            0.0
                        };
                        *p = C::from_f32(old + bias.map_or(0.0, |b| b[j]));
                    }
                }
            }
        });
        if k == 0 {
            return;
        }
        beta = 1.0;
    }
    if is_f32::<A>() && is_f32::<B>() && is_f32::<C>() {
        // SAFETY: A, B, C are f32 (TypeId checked), so the casts are identities.
        sgemm_depth_split(
            m,
            n,
            k,
            alpha,
            Mat {
                ptr: a.ptr as *const f32,
                rs: a.rs,
                cs: a.cs,
            },
            Mat {
                ptr: b.ptr as *const f32,
                rs: b.rs,
                cs: b.cs,
            },
            (beta != 0.0).then_some(beta),
            MatMut {
                ptr: c.ptr as *mut f32,
                rs: c.rs,
                cs: c.cs,
            },
            par,
        );
        return;
    }

    // Blocked path: convert each non-f32 block to f32 in ws, multiply blocks in f32.
    let (mbm, nbm, kbm) = (m.min(BLOCK_M), n.min(BLOCK_N), k.min(BLOCK_K));
    let (pa, rest) = ws.split_at_mut(if is_f32::<A>() { 0 } else { mbm * kbm });
    let (pb, rest) = rest.split_at_mut(if is_f32::<B>() { 0 } else { kbm * nbm });
    let pc = &mut rest[..if is_f32::<C>() { 0 } else { mbm * nbm }];
    for i0 in (0..m).step_by(BLOCK_M) {
        let mb = BLOCK_M.min(m - i0);
        for j0 in (0..n).step_by(BLOCK_N) {
            let nb = BLOCK_N.min(n - j0);
            // Where the f32 product accumulates: straight into c when c is f32, else into pc.
            let (dst, first_scale) = if is_f32::<C>() {
                let d = c.sub(i0, j0);
                (
                    MatMut {
                        ptr: d.ptr as *mut f32,
                        rs: d.rs,
                        cs: d.cs,
                    },
                    (beta != 0.0).then_some(beta),
                )
            } else {
                (
                    MatMut {
                        ptr: pc.as_mut_ptr(),
                        rs: nb,
                        cs: 1,
                    },
                    None,
                )
            };
            for l0 in (0..k).step_by(BLOCK_K) {
                let kb = BLOCK_K.min(k - l0);
                let ap = f32_block(a.sub(i0, l0), mb, kb, pa, par);
                let bp = f32_block(b.sub(l0, j0), kb, nb, pb, par);
                let scale = if l0 == 0 { first_scale } else { Some(1.0) };
                sgemm_raw(mb, nb, kb, alpha, ap, bp, scale, dst, par);
            }
            if !is_f32::<C>() {
                // Epilogue: the single rounding of the f32 accumulator to C.
                let acc_all = MatMut {
                    ptr: pc.as_mut_ptr(),
                    rs: nb,
                    cs: 1,
                };
                // SAFETY: row i of the accumulator and of c's block belong to one task.
                for_rows(mb, nb, par, |i| unsafe {
                    let acc = std::slice::from_raw_parts_mut(acc_all.sub(i, 0).ptr, nb);
                    let crow = c.sub(i0 + i, j0);
                    if beta != 0.0 {
                        for (j, v) in acc.iter_mut().enumerate() {
                            *v += beta * (*crow.ptr.add(j * crow.cs)).to_f32();
                        }
                    }
                    if let Some(bias) = bias {
                        for (v, bj) in acc.iter_mut().zip(&bias[j0..j0 + nb]) {
                            *v += bj;
                        }
                    }
                    if crow.cs == 1 {
                        store_f32(acc, std::slice::from_raw_parts_mut(crow.ptr, nb));
                    } else {
                        for (j, v) in acc.iter().enumerate() {
                            *crow.ptr.add(j * crow.cs) = C::from_f32(*v);
                        }
                    }
                });
            }
        }
    }
}

/// An f32 view of the `rows×cols` block at `src`: the block itself when `S` is f32, else a copy
/// converted into `buf`, laid out along the source's contiguous direction so both the reads and
/// the writes of the conversion are sequential.
///
/// # Safety
/// `src` must be valid for `rows×cols`; `buf` must hold `rows·cols` when `S` is not f32.
unsafe fn f32_block<S: Element>(
    src: Mat<S>,
    rows: usize,
    cols: usize,
    buf: &mut [f32],
    par: Parallelism,
) -> Mat<f32> {
    if is_f32::<S>() {
        return Mat {
            ptr: src.ptr as *const f32,
            rs: src.rs,
            cs: src.cs,
        };
    }
    let buf = &mut buf[..rows * cols];
    // Runs of `len` contiguous source elements, `stride` apart, into consecutive runs of buf.
    // Threaded for big blocks: the conversion is otherwise a serial stretch between the
    // threaded block products.
    let mut convert = |len: usize, stride: usize| {
        let run = |(r, dst): (usize, &mut [f32])| {
            // SAFETY: the caller guarantees src is valid for rows×cols.
            load_f32(
                unsafe { std::slice::from_raw_parts(src.offset(r * stride).ptr, len) },
                dst,
            )
        };
        if matches!(par, Parallelism::Rayon(_)) && rows * cols >= PAR_CONVERT_MIN {
            buf.par_chunks_exact_mut(len).enumerate().for_each(run);
        } else {
            buf.chunks_exact_mut(len).enumerate().for_each(run);
        }
    };
    if src.cs == 1 {
        convert(cols, src.rs);
        Mat {
            ptr: buf.as_ptr(),
            rs: cols,
            cs: 1,
        }
    } else if src.rs == 1 {
        convert(rows, src.cs);
        Mat {
            ptr: buf.as_ptr(),
            rs: 1,
            cs: rows,
        }
    } else {
        for (i, row) in buf.chunks_exact_mut(cols).enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = (*src.ptr.add(i * src.rs + j * src.cs)).to_f32();
            }
        }
        Mat {
            ptr: buf.as_ptr(),
            rs: cols,
            cs: 1,
        }
    }
}

/// Runs `f(i)` for every row `i` of an `rows×cols` matrix: on rayon's pool when `par` allows
/// and the matrix is big enough to pay for it, else in order.
fn for_rows<F: Fn(usize) + Send + Sync>(rows: usize, cols: usize, par: Parallelism, f: F) {
    if matches!(par, Parallelism::Rayon(_)) && rows > 1 && rows * cols >= PAR_CONVERT_MIN {
        (0..rows)
            .into_par_iter()
            .with_min_len((PAR_CONVERT_MIN / 4 / cols).max(1))
            .for_each(f);
    } else {
        (0..rows).for_each(f);
    }
}

/// Blocks at least this large are converted to f32 on several threads.
const PAR_CONVERT_MIN: usize = 16 * 1024;

/// Runs `f(item, lane_ws)` for every item in `0..count` on rayon's pool. With `per_lane == 0`
/// (f32: no workspace) every item may run concurrently; otherwise `ws` is cut into
/// `ws.len() / per_lane` lanes (≥ 1, the caller has checked) and each lane runs its items in
/// turn, so the workspace bounds the parallelism and nothing is allocated.
pub(crate) fn for_each_lane<F>(count: usize, per_lane: usize, ws: &mut [f32], f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if per_lane == 0 {
        (0..count).into_par_iter().for_each(|i| f(i, &mut []));
        return;
    }
    let lanes = (ws.len() / per_lane).clamp(1, count.max(1));
    ws[..lanes * per_lane]
        .par_chunks_mut(per_lane)
        .enumerate()
        .for_each(|(lane, w)| {
            for i in (lane..count).step_by(lanes) {
                f(i, w);
            }
        });
}

/// How many of [`for_each_lane`]'s items can be running at one moment, with `ws_len` elements
/// of workspace: its lanes (every item when `per_lane == 0`, else `ws_len / per_lane` clamped
/// to `1..=count`), at most one per thread of the current rayon pool (an item runs to its end
/// on one thread: its GEMMs are single-threaded and never wait on rayon).
pub(crate) fn lanes_at_once(count: usize, per_lane: usize, ws_len: usize) -> usize {
    let lanes = ws_len
        .checked_div(per_lane)
        .map_or(count, |lanes| lanes.clamp(1, count.max(1)));
    lanes.min(rayon::current_num_threads())
}

// ---------------------------------------------------------------------------------------------
// Slice conversions shared by the GEMM-based kernels: SIMD via `half`'s slice routines.

/// `s` itself when `T` is `f32`.
#[inline(always)]
pub(crate) fn as_f32<T: Element>(s: &[T]) -> Option<&[f32]> {
    // SAFETY: T is exactly f32 (TypeId), so the slice is reinterpreted as itself.
    is_f32::<T>().then(|| unsafe { &*(s as *const [T] as *const [f32]) })
}

/// `dst[i] = src[i] as f32` (equal lengths).
#[inline]
pub(crate) fn load_f32<T: Element>(src: &[T], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    let id = TypeId::of::<T>();
    // SAFETY (all three casts): T is exactly the type named by the TypeId test.
    if id == TypeId::of::<f32>() {
        dst.copy_from_slice(unsafe { &*(src as *const [T] as *const [f32]) });
    } else if id == TypeId::of::<f16>() {
        unsafe { &*(src as *const [T] as *const [f16]) }.convert_to_f32_slice(dst);
    } else if id == TypeId::of::<bf16>() {
        unsafe { &*(src as *const [T] as *const [bf16]) }.convert_to_f32_slice(dst);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

/// `dst[i] = T::from_f32(src[i])` (equal lengths), round-to-nearest-even.
#[inline]
pub(crate) fn store_f32<T: Element>(src: &[f32], dst: &mut [T]) {
    debug_assert_eq!(src.len(), dst.len());
    let id = TypeId::of::<T>();
    // SAFETY (all three casts): T is exactly the type named by the TypeId test.
    if id == TypeId::of::<f32>() {
        unsafe { &mut *(dst as *mut [T] as *mut [f32]) }.copy_from_slice(src);
    } else if id == TypeId::of::<f16>() {
        unsafe { &mut *(dst as *mut [T] as *mut [f16]) }.convert_from_f32_slice(src);
    } else if id == TypeId::of::<bf16>() {
        unsafe { &mut *(dst as *mut [T] as *mut [bf16]) }.convert_from_f32_slice(src);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f32(*s);
        }
    }
}

/// Stack chunk for [`add_f32`]'s conversions (keeps the hot loops allocation-free).
const CONVERT_CHUNK: usize = 64;

/// `acc[i] += src[i] as f32` (equal lengths); f32 adds directly, halves convert in stack chunks.
#[inline]
pub(crate) fn add_f32<T: Element>(src: &[T], acc: &mut [f32]) {
    debug_assert_eq!(src.len(), acc.len());
    if is_f32::<T>() {
        // SAFETY: T is f32.
        let src = unsafe { &*(src as *const [T] as *const [f32]) };
        for (a, s) in acc.iter_mut().zip(src) {
            *a += s;
        }
        return;
    }
    let mut tmp = [0f32; CONVERT_CHUNK];
    for (s, a) in src.chunks(CONVERT_CHUNK).zip(acc.chunks_mut(CONVERT_CHUNK)) {
        let t = &mut tmp[..s.len()];
        load_f32(s, t);
        for (a, t) in a.iter_mut().zip(t.iter()) {
            *a += t;
        }
    }
}
