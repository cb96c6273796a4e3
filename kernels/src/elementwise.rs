//! Elementwise data movement: u8 → float input casts, dtype casts, n-ary add, gradient
//! accumulation, last-axis concat, the finite check and the scaling that loss scaling needs.
//!
//! Length rule for this module and the other pointwise modules (`activation`, `random`): a
//! kernel without dims requires its slices to have *equal* lengths (the executor cuts views of
//! exactly the planned element count, so a mismatch is a planning bug worth an `Err`). Kernels
//! with dims (`concat_last`, pools, norms, losses) follow [`crate::check_len`]: a slice may be
//! longer than the dims need and only its prefix is touched.
//!
//! In-place capable (output may be the input buffer, via the `*_inplace` variants):
//! [`scale_inplace`], [`add_n_inplace`] (output over the first input), [`accumulate`]
//! (by definition). Casts change the element size, so they cannot run in place.
//!
//! This file also holds the crate-private loop helpers (`map*`, `rows*`, `reduce_rows`) that
//! every non-GEMM kernel uses, so the rayon policy lives in one place.

use rayon::prelude::*;

use crate::{check_len_with, Element, KResult, KernelError};

/// Below this many elements of work a loop stays on the calling thread: a rayon fork/join
/// costs a few microseconds, more than a 32 Ki-element pointwise pass does.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// Elements of work per rayon task once a loop does go parallel.
pub(crate) const PAR_CHUNK: usize = 1 << 13;
/// Most partial sums a deterministic reduction keeps (on the stack). The split depends only on
/// the shape, never on the thread count, so a reduction gives the same bits on every machine.
pub(crate) const MAX_PARTS: usize = 64;

/// How a backward kernel stores a gradient that several consumers contribute to.
///
/// The crate-wide rule is: activation gradients are overwritten, parameter gradients are
/// accumulated. Kernels whose input typically also receives another gradient (the VAE's
/// `z_mean`/`z_log_var` get one from the KL loss and one from the sampling layer) take this
/// flag, so the planner can sum into one buffer instead of planning a second one and an add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `dx = g` (the default for activation gradients).
    Overwrite,
    /// `dx += g`.
    Accumulate,
}

impl GradWrite {
    #[inline(always)]
    pub(crate) fn store<T: Element>(self, dst: &mut T, g: f32) {
        *dst = match self {
            GradWrite::Overwrite => T::from_f32(g),
            GradWrite::Accumulate => T::from_f32(dst.to_f32() + g),
        };
    }
}

// ---------------------------------------------------------------------------------------------
// crate-private loop helpers
// ---------------------------------------------------------------------------------------------

/// [`check_len`] that formats its message only on failure: the happy path of a kernel must
/// not allocate, and a `format!` in the argument would run on every call.
#[inline]
pub(crate) fn need(op: &str, what: &str, len: usize, need: usize) -> KResult {
    if len >= need {
        Ok(())
    } else {
        check_len_with(|| format!("{op}: {what}"), len, need)
    }
}

/// [`need`] for the `k`-th of several operands (`what[k]`).
#[inline]
pub(crate) fn need_at(op: &str, what: &str, k: usize, len: usize, need: usize) -> KResult {
    if len >= need {
        Ok(())
    } else {
        check_len_with(|| format!("{op}: {what}[{k}]"), len, need)
    }
}

/// `Err` unless two slices that a pointwise kernel pairs up have the same length.
pub(crate) fn same_len(op: &str, a: &str, a_len: usize, b: &str, b_len: usize) -> KResult {
    if a_len == b_len {
        Ok(())
    } else {
        Err(KernelError(format!(
            "{op}: {a} has {a_len} elements but {b} has {b_len}; pointwise operands must match"
        )))
    }
}

/// The sum of eight interleaved partial sums, in the one fixed order every lane-wise
/// reduction uses (pairs four apart, then pairs of pairs): the result depends on the data
/// alone.
#[inline(always)]
pub(crate) fn add_lanes<T: Copy + std::ops::Add<Output = T>>(a: [T; 8]) -> T {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// `Σ f(x)` over a row in eight interleaved sums added in [`add_lanes`]'s fixed order: eight
/// independent chains of additions instead of one, whose latency bounded a row's reductions;
/// the order depends on the row alone, so the result does too.
#[inline(always)]
pub(crate) fn sum_in_lanes<T, A>(xr: &[T], f: impl Fn(f32) -> A) -> A
where
    T: Element,
    A: Copy + Default + std::ops::Add<Output = A> + std::iter::Sum,
{
    let mut acc = [A::default(); 8];
    let chunks = xr.chunks_exact(8);
    let tail: A = chunks.remainder().iter().map(|v| f(v.to_f32())).sum();
    for c in chunks {
        for (s, v) in acc.iter_mut().zip(c) {
            *s = *s + f(v.to_f32());
        }
    }
    add_lanes(acc) + tail
}

/// `y[i] = f(x[i])`, in f32, parallel in chunks when large.
pub(crate) fn map1<S: Element, D: Element>(x: &[S], y: &mut [D], f: impl Fn(f32) -> f32 + Sync) {
    map1_with(x, y, f)
}

/// [`map1`] of any [`Unary`] (a [`Unary::WIDE`] one runs 16 lanes wide on AVX-512, 8 on AVX2).
pub(crate) fn map1_with<S: Element, D: Element, U: Unary>(x: &[S], y: &mut [D], f: U) {
    zip_chunks(x, y, |x, y| map1_chunk(x, y, &f));
}

/// A function of one f32, applied element by element.
pub(crate) trait Unary: Sync {
    /// Whether its loops may run compiled for AVX-512 or AVX2 ([`wide_loop`]): only for an `apply`
    /// that is `#[inline(always)]`. A closure's body is not inlined into such a loop, which
    /// then calls it per element and runs slower than the plain loop.
    const WIDE: bool = false;
    /// `f(x)`; `FMA`: the loop runs compiled with fused multiply-add, which the function may
    /// use (see [`wide_loop`]).
    fn apply<const FMA: bool>(&self, x: f32) -> f32;
}

/// A function of two f32 (a saved value and an incoming gradient), element by element.
pub(crate) trait Binary: Sync {
    /// As [`Unary::WIDE`].
    const WIDE: bool = false;
    /// As [`Unary::apply`].
    fn apply<const FMA: bool>(&self, a: f32, b: f32) -> f32;
}

impl<F: Fn(f32) -> f32 + Sync> Unary for F {
    #[inline(always)]
    fn apply<const FMA: bool>(&self, x: f32) -> f32 {
        self(x)
    }
}

impl<F: Fn(f32, f32) -> f32 + Sync> Binary for F {
    #[inline(always)]
    fn apply<const FMA: bool>(&self, a: f32, b: f32) -> f32 {
        self(a, b)
    }
}

/// Declares a loop function that runs compiled for AVX-512 or AVX2 where the CPU has it and
/// `$wide` holds: the crate is built for baseline x86-64, whose 4-lane SSE2 halves the speed
/// of a loop that vectorises. The body is compiled three times, twice inside a
/// `target_feature` function where an `#[inline(always)]` element function is inlined and
/// the loop vectorised 16 or 8 lanes wide. Rust never fuses a multiply and an add on its own,
/// and each lane computes what the scalar code would, so the results are the same bits every
/// way — unless the loop names a `fused` constant: that is `true` in the wide copies (both
/// compiled with `fma`, which every AVX-512 CPU and every AVX2 CPU sold has) and `false` in
/// the baseline one, for element functions that take their polynomials in fused
/// multiply-adds there ([`Unary::apply`]); their bits then depend on the CPU, by an ulp.
/// `avx512 if $expr` (after `wide if`) leaves the AVX-512 copy out where the expression is
/// false: such a CPU then runs the AVX2 one.
macro_rules! wide_loop {
    ($(#[$m:meta])* fn $name:ident<$($g:ident: $b:path),*>($($a:ident: $t:ty),*)
     wide if $wide:expr, $(avx512 if $w512:expr,)? $(fused $fma:ident,)? $body:block) => {
        $(#[$m])*
        #[inline(always)]
        fn $name<$($g: $b),*>($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            if $wide $(&& $w512)? && std::is_x86_feature_detected!("avx512f") {
                #[target_feature(enable = "avx512f,fma")]
                unsafe fn avx512<$($g: $b),*>($($a: $t),*) {
                    $(const $fma: bool = true;)?
                    $body
                }
                // SAFETY: the CPU has the features `avx512` is compiled with (AVX-512F
                // implies FMA).
                return unsafe { avx512($($a),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if $wide
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<$($g: $b),*>($($a: $t),*) {
                    $(const $fma: bool = true;)?
                    $body
                }
                // SAFETY: the CPU has the features `avx2` is compiled with.
                return unsafe { avx2($($a),*) };
            }
            $(const $fma: bool = false;)?
            $body
        }
    };
}
pub(crate) use wide_loop;

wide_loop! {
    /// One chunk of [`map1_with`].
    fn map1_chunk<S: Element, D: Element, U: Unary>(x: &[S], y: &mut [D], f: &U)
    wide if U::WIDE, fused FMA, {
        for (yo, xi) in y.iter_mut().zip(x) {
            *yo = D::from_f32(f.apply::<FMA>(xi.to_f32()));
        }
    }
}

wide_loop! {
    /// One chunk of [`map1_inplace_with`].
    fn map1_inplace_chunk<T: Element, U: Unary>(x: &mut [T], f: &U)
    wide if U::WIDE, fused FMA, {
        for v in x.iter_mut() {
            *v = T::from_f32(f.apply::<FMA>(v.to_f32()));
        }
    }
}

wide_loop! {
    /// One chunk of [`map2_with`].
    fn map2_chunk<A: Element, B: Element, D: Element, F: Binary>(
        a: &[A], b: &[B], y: &mut [D], f: &F
    ) wide if F::WIDE, fused FMA, {
        for ((yo, ai), bi) in y.iter_mut().zip(a).zip(b) {
            *yo = D::from_f32(f.apply::<FMA>(ai.to_f32(), bi.to_f32()));
        }
    }
}

wide_loop! {
    /// One chunk of [`map2_inplace_with`].
    fn map2_inplace_chunk<A: Element, T: Element, F: Binary>(a: &[A], y: &mut [T], f: &F)
    wide if F::WIDE, fused FMA, {
        for (yo, ai) in y.iter_mut().zip(a) {
            *yo = T::from_f32(f.apply::<FMA>(ai.to_f32(), yo.to_f32()));
        }
    }
}

/// Runs `body` on matching chunks of `x` and `y`: in parallel chunks of [`PAR_CHUNK`] when `y`
/// is large, else once over both whole.
pub(crate) fn zip_chunks<S: Sync, D: Send>(
    x: &[S],
    y: &mut [D],
    body: impl Fn(&[S], &mut [D]) + Sync,
) {
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(PAR_CHUNK)
            .zip(x.par_chunks(PAR_CHUNK))
            .for_each(|(y, x)| body(x, y));
    } else {
        body(x, y);
    }
}

/// `x[i] = f(x[i])` in place.
pub(crate) fn map1_inplace<T: Element>(x: &mut [T], f: impl Fn(f32) -> f32 + Sync) {
    map1_inplace_with(x, f)
}

/// [`map1_inplace`] of any [`Unary`].
pub(crate) fn map1_inplace_with<T: Element, U: Unary>(x: &mut [T], f: U) {
    let body = |x: &mut [T]| map1_inplace_chunk(x, &f);
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(PAR_CHUNK).for_each(body);
    } else {
        body(x);
    }
}

/// `y[i] = f(a[i], b[i])`, for any [`Binary`].
pub(crate) fn map2_with<A: Element, B: Element, D: Element, F: Binary>(
    a: &[A],
    b: &[B],
    y: &mut [D],
    f: F,
) {
    zip3_chunks(a, b, y, |a, b, y| map2_chunk(a, b, y, &f));
}

/// [`zip_chunks`] over two inputs `a` and `b` and the output `y`.
pub(crate) fn zip3_chunks<A: Sync, B: Sync, D: Send>(
    a: &[A],
    b: &[B],
    y: &mut [D],
    body: impl Fn(&[A], &[B], &mut [D]) + Sync,
) {
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks(PAR_CHUNK))
            .zip(b.par_chunks(PAR_CHUNK))
            .for_each(|((y, a), b)| body(a, b, y));
    } else {
        body(a, b, y);
    }
}

/// `y[i] = f(a[i], y[i])`: the second operand is read from, and replaced by, the output.
pub(crate) fn map2_inplace<A: Element, T: Element>(
    a: &[A],
    y: &mut [T],
    f: impl Fn(f32, f32) -> f32 + Sync,
) {
    map2_inplace_with(a, y, f)
}

/// [`map2_inplace`] of any [`Binary`].
pub(crate) fn map2_inplace_with<A: Element, T: Element, F: Binary>(a: &[A], y: &mut [T], f: F) {
    zip_chunks(a, y, |a, y| map2_inplace_chunk(a, y, &f));
}

/// Rows per rayon task so that each task does about [`PAR_CHUNK`] elements of work.
fn min_rows(work_per_row: usize) -> usize {
    (PAR_CHUNK / work_per_row.max(1)).max(1)
}

/// Calls `f(row_index, row)` for every `row_len`-element row of `out` (whose length must be a
/// multiple of `row_len`); parallel when the total work is large.
pub(crate) fn rows<D: Send>(
    out: &mut [D],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [D]) + Sync + Send,
) {
    if row_len == 0 || out.is_empty() {
        return;
    }
    let n = out.len() / row_len;
    if n > 1 && n.saturating_mul(work_per_row) >= PAR_MIN {
        out.par_chunks_mut(row_len)
            .with_min_len(min_rows(work_per_row))
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    } else {
        out.chunks_mut(row_len)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    }
}

/// [`rows`] over two outputs cut into the same number of rows.
pub(crate) fn rows2<A: Send, B: Send>(
    a: &mut [A],
    a_row: usize,
    b: &mut [B],
    b_row: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
) {
    if a_row == 0 || b_row == 0 || a.is_empty() {
        return;
    }
    let n = a.len() / a_row;
    if n > 1 && n.saturating_mul(work_per_row) >= PAR_MIN {
        a.par_chunks_mut(a_row)
            .zip(b.par_chunks_mut(b_row))
            .with_min_len(min_rows(work_per_row))
            .enumerate()
            .for_each(|(i, (ra, rb))| f(i, ra, rb));
    } else {
        a.chunks_mut(a_row)
            .zip(b.chunks_mut(b_row))
            .enumerate()
            .for_each(|(i, (ra, rb))| f(i, ra, rb));
    }
}

/// [`rows`] over three outputs cut into the same number of rows.
pub(crate) fn rows3<A: Send, B: Send, C: Send>(
    a: (&mut [A], usize),
    b: (&mut [B], usize),
    c: (&mut [C], usize),
    work_per_row: usize,
    f: impl Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync + Send,
) {
    let ((a, ar), (b, br), (c, cr)) = (a, b, c);
    if ar == 0 || br == 0 || cr == 0 || a.is_empty() {
        return;
    }
    let n = a.len() / ar;
    if n > 1 && n.saturating_mul(work_per_row) >= PAR_MIN {
        a.par_chunks_mut(ar)
            .zip(b.par_chunks_mut(br))
            .zip(c.par_chunks_mut(cr))
            .with_min_len(min_rows(work_per_row))
            .enumerate()
            .for_each(|(i, ((ra, rb), rc))| f(i, ra, rb, rc));
    } else {
        a.chunks_mut(ar)
            .zip(b.chunks_mut(br))
            .zip(c.chunks_mut(cr))
            .enumerate()
            .for_each(|(i, ((ra, rb), rc))| f(i, ra, rb, rc));
    }
}

/// Deterministic parallel reduction over `n_rows` rows: the rows are cut into at most
/// [`MAX_PARTS`] contiguous parts (a function of `n_rows` only), `part(first, end)` reduces
/// one part, and the partials are combined left to right. Same bits with 1 thread or 64.
pub(crate) fn reduce_rows<R: Copy + Send + Sync + Default>(
    n_rows: usize,
    work_per_row: usize,
    part: impl Fn(usize, usize) -> R + Sync + Send,
    combine: impl Fn(R, R) -> R,
) -> R {
    if n_rows == 0 {
        return R::default();
    }
    let n_parts = n_rows.min(MAX_PARTS);
    let per = n_rows.div_ceil(n_parts);
    let n_parts = n_rows.div_ceil(per);
    let mut partials = [R::default(); MAX_PARTS];
    let run = |(k, slot): (usize, &mut R)| {
        let first = k * per;
        *slot = part(first, (first + per).min(n_rows));
    };
    if n_parts > 1 && n_rows.saturating_mul(work_per_row) >= PAR_MIN {
        partials[..n_parts].par_iter_mut().enumerate().for_each(run);
    } else {
        partials[..n_parts].iter_mut().enumerate().for_each(run);
    }
    let mut acc = partials[0];
    for p in &partials[1..n_parts] {
        acc = combine(acc, *p);
    }
    acc
}

/// [`reduce_rows`] that also writes: `out` is cut into the same parts (`row_len` elements per
/// row) and `part(first_row, out_part)` fills its part and returns its partial.
pub(crate) fn reduce_rows_mut<D: Send, R: Copy + Send + Sync + Default>(
    out: &mut [D],
    row_len: usize,
    work_per_row: usize,
    part: impl Fn(usize, &mut [D]) -> R + Sync + Send,
    combine: impl Fn(R, R) -> R,
) -> R {
    if row_len == 0 || out.is_empty() {
        return R::default();
    }
    let n_rows = out.len() / row_len;
    let n_parts = n_rows.min(MAX_PARTS);
    let per = n_rows.div_ceil(n_parts);
    let mut partials = [R::default(); MAX_PARTS];
    let par = n_rows > per && n_rows.saturating_mul(work_per_row) >= PAR_MIN;
    let run = |(k, (chunk, slot)): (usize, (&mut [D], &mut R))| {
        *slot = part(k * per, chunk);
    };
    if par {
        out.par_chunks_mut(per * row_len)
            .zip(partials.par_iter_mut())
            .enumerate()
            .for_each(run);
    } else {
        out.chunks_mut(per * row_len)
            .zip(partials.iter_mut())
            .enumerate()
            .for_each(run);
    }
    let used = n_rows.div_ceil(per);
    let mut acc = partials[0];
    for p in &partials[1..used] {
        acc = combine(acc, *p);
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// public kernels
// ---------------------------------------------------------------------------------------------

/// Input rescaling of u8 data (pixels): `y = x · scale + offset`, e.g. `scale = 1/255`, like
/// Keras `Rescaling(scale, offset)`. Inputs carry no gradient, so there is no backward.
pub fn cast_u8<T: Element>(x: &[u8], y: &mut [T], scale: f32, offset: f32) -> KResult {
    same_len("cast_u8", "x", x.len(), "y", y.len())?;
    zip_chunks(x, y, |x, y| {
        for (yo, &xi) in y.iter_mut().zip(x) {
            *yo = T::from_f32(xi as f32 * scale + offset);
        }
    });
    Ok(())
}

/// Converts between storage types (f32 ↔ f16 ↔ bf16), round-to-nearest-even. Also a plain
/// copy when `S == D`.
pub fn cast<S: Element, D: Element>(x: &[S], y: &mut [D]) -> KResult {
    same_len("cast", "x", x.len(), "y", y.len())?;
    map1(x, y, |v| v);
    Ok(())
}

/// Backward of [`cast`]: the gradient is cast back to the source type (`dx = dy`, overwritten).
pub fn cast_backward<S: Element, D: Element>(dy: &[D], dx: &mut [S]) -> KResult {
    same_len("cast_backward", "dy", dy.len(), "dx", dx.len())?;
    map1(dy, dx, |v| v);
    Ok(())
}

/// `y = Σ inputs[k]`, summed in f32 in input order (one rounding to `T` per element).
///
/// Backward: every input's gradient equals `dy`; the planner aliases it or uses [`cast`] to
/// copy, so there is no separate kernel.
pub fn add_n<T: Element>(inputs: &[&[T]], y: &mut [T]) -> KResult {
    if inputs.is_empty() {
        return Err(KernelError("add_n: needs at least one input".into()));
    }
    for (k, x) in inputs.iter().enumerate() {
        if x.len() != y.len() {
            same_len("add_n", &format!("inputs[{k}]"), x.len(), "y", y.len())?;
        }
    }
    sum_into(inputs, y, false);
    Ok(())
}

/// In-place n-ary add: `acc = acc + Σ others[k]` (the output takes the first input's buffer).
pub fn add_n_inplace<T: Element>(acc: &mut [T], others: &[&[T]]) -> KResult {
    for (k, x) in others.iter().enumerate() {
        if x.len() != acc.len() {
            same_len(
                "add_n_inplace",
                &format!("others[{k}]"),
                x.len(),
                "acc",
                acc.len(),
            )?;
        }
    }
    sum_into(others, acc, true);
    Ok(())
}

/// Sums `inputs` (plus `y`'s own values when `keep`) into `y`, through an f32 stack buffer so a
/// half-precision output is rounded once, not once per input.
fn sum_into<T: Element>(inputs: &[&[T]], y: &mut [T], keep: bool) {
    const BLOCK: usize = 256;
    let body = |base: usize, y: &mut [T]| {
        let mut acc = [0f32; BLOCK];
        for (b, yb) in y.chunks_mut(BLOCK).enumerate() {
            let start = base + b * BLOCK;
            let acc = &mut acc[..yb.len()];
            if keep {
                for (a, v) in acc.iter_mut().zip(yb.iter()) {
                    *a = v.to_f32();
                }
            } else {
                acc.fill(0.0);
            }
            for x in inputs {
                for (a, v) in acc.iter_mut().zip(&x[start..start + yb.len()]) {
                    *a += v.to_f32();
                }
            }
            for (o, a) in yb.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(*a);
            }
        }
    };
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(PAR_CHUNK)
            .enumerate()
            .for_each(|(k, y)| body(k * PAR_CHUNK, y));
    } else {
        body(0, y);
    }
}

/// Gradient accumulation `dst += src` (e.g. a parameter's f32 gradient += a micro-batch
/// contribution, or a residual branch's gradient into the trunk's). Types may differ.
pub fn accumulate<D: Element, S: Element>(dst: &mut [D], src: &[S]) -> KResult {
    same_len("accumulate", "src", src.len(), "dst", dst.len())?;
    map2_inplace(src, dst, |s, d| d + s);
    Ok(())
}

fn concat_check(op: &str, n_parts: usize, widths: &[usize]) -> Result<usize, KernelError> {
    if n_parts != widths.len() {
        return Err(KernelError(format!(
            "{op}: {n_parts} tensors but {} widths",
            widths.len()
        )));
    }
    // Saturating: absurd dims then fail the length checks instead of overflowing.
    Ok(widths.iter().fold(0usize, |a, &w| a.saturating_add(w)))
}

/// Concatenation along the last axis: `inputs[k]` is `[rows, widths[k]]`, `y` is
/// `[rows, Σ widths]`. Pure copy (no dtype change).
pub fn concat_last<T: Element>(
    inputs: &[&[T]],
    widths: &[usize],
    rows: usize,
    y: &mut [T],
) -> KResult {
    let total = concat_check("concat_last", inputs.len(), widths)?;
    for (k, (x, &w)) in inputs.iter().zip(widths).enumerate() {
        need_at("concat_last", "inputs", k, x.len(), rows.saturating_mul(w))?;
    }
    need("concat_last", "y", y.len(), rows.saturating_mul(total))?;
    rows_par(&mut y[..rows * total], total, |r, yr| {
        let mut at = 0;
        for (x, &w) in inputs.iter().zip(widths) {
            yr[at..at + w].copy_from_slice(&x[r * w..(r + 1) * w]);
            at += w;
        }
    });
    Ok(())
}

/// Backward of [`concat_last`]: splits `dy` (`[rows, Σ widths]`) into the inputs' gradients
/// (each overwritten).
pub fn concat_last_backward<T: Element>(
    dy: &[T],
    widths: &[usize],
    rows: usize,
    dxs: &mut [&mut [T]],
) -> KResult {
    let total = concat_check("concat_last_backward", dxs.len(), widths)?;
    need(
        "concat_last_backward",
        "dy",
        dy.len(),
        rows.saturating_mul(total),
    )?;
    for (k, (dx, &w)) in dxs.iter().zip(widths).enumerate() {
        need_at(
            "concat_last_backward",
            "dxs",
            k,
            dx.len(),
            rows.saturating_mul(w),
        )?;
    }
    let mut at = 0;
    for (dx, &w) in dxs.iter_mut().zip(widths) {
        rows_par(&mut dx[..rows * w], w, |r, dr| {
            dr.copy_from_slice(&dy[r * total + at..r * total + at + w]);
        });
        at += w;
    }
    Ok(())
}

fn rows_par<T: Element>(out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    rows(out, row_len, row_len, f);
}

/// `true` when no element is NaN or ±inf: the loss scaler's overflow check on gradients.
pub fn all_finite<T: Element>(x: &[T]) -> bool {
    let ok = |c: &[T]| c.iter().all(|v| v.to_f32().is_finite());
    if x.len() >= PAR_MIN {
        x.par_chunks(PAR_CHUNK).all(ok)
    } else {
        ok(x)
    }
}

/// `x *= s` in place (unscaling gradients by `1 / loss_scale`, or any rescale).
pub fn scale_inplace<T: Element>(x: &mut [T], s: f32) {
    map1_inplace(x, |v| v * s);
}

/// `y = x · s`, out of place.
pub fn scale<S: Element, D: Element>(x: &[S], y: &mut [D], s: f32) -> KResult {
    same_len("scale", "x", x.len(), "y", y.len())?;
    map1(x, y, |v| v * s);
    Ok(())
}
