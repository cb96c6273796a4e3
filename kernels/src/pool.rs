//! 2-D pooling over NHWC: max pool (with a u8 argmax saved for backward), average pool
//! (TF/Keras "same" semantics: average over the valid elements only) and global average pool,
//! plus [`Pool2d`], the dims with TF's padding rule.
//!
//! Backward passes are written as *gathers*: each input element sums the contributions of the
//! output windows that cover it, in f32, and is stored once. That writes every `dx` element
//! (so `dx` needs no zeroing by the caller and holds exactly 0 where nothing flows), runs in
//! parallel without write conflicts, and rounds a half-precision `dx` once instead of once per
//! overlapping window. Gradients are overwritten.
//!
//! Nothing here is in-place capable: outputs and inputs have different shapes.

use crate::elementwise::{need, rows, rows2, wide_loop};
use crate::{check_len, Element, KResult, KernelError};

/// Channels handled per pass with an f32 accumulator array on the stack (no heap scratch).
const CH_BLOCK: usize = 64;

/// Keras / TensorFlow padding, shared with the planner and the convolutions.
pub use memwise_geometry::Padding;

/// Output length and padding-before along one axis, by TF's rule
/// ([`memwise_geometry::window_axis`]), refusing a window that has no output: a zero window
/// or stride, a valid window longer than the input, or an empty axis.
pub fn tf_out_and_pad(
    input: usize,
    k: usize,
    s: usize,
    padding: Padding,
) -> Result<(usize, usize), KernelError> {
    if k == 0 || s == 0 {
        return Err(KernelError(format!(
            "pooling window {k} and stride {s} must both be at least 1"
        )));
    }
    match memwise_geometry::window_axis(input, k, s, padding) {
        (0, _) if padding == Padding::Valid => Err(KernelError(format!(
            "valid padding needs input extent {input} >= window {k}"
        ))),
        (0, _) => Err(KernelError("same padding on an empty axis".into())),
        out_and_pad => Ok(out_and_pad),
    }
}

/// Dims of a 2-D pooling over an NHWC tensor `[n, h, w, c]`, with the derived output extent
/// and padding. Build it with [`Pool2d::new`], which validates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2d {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub padding: Padding,
    pub out_h: usize,
    pub out_w: usize,
    pub pad_top: usize,
    pub pad_left: usize,
}

impl Pool2d {
    /// `pool` is `(kh, kw)`, `strides` `(sh, sw)` (Keras defaults strides to the pool size).
    pub fn new(
        n: usize,
        h: usize,
        w: usize,
        c: usize,
        pool: (usize, usize),
        strides: (usize, usize),
        padding: Padding,
    ) -> Result<Self, KernelError> {
        let (out_h, pad_top) = tf_out_and_pad(h, pool.0, strides.0, padding)
            .map_err(|e| KernelError(format!("pool2d height: {e}")))?;
        let (out_w, pad_left) = tf_out_and_pad(w, pool.1, strides.1, padding)
            .map_err(|e| KernelError(format!("pool2d width: {e}")))?;
        Ok(Pool2d {
            n,
            h,
            w,
            c,
            kh: pool.0,
            kw: pool.1,
            sh: strides.0,
            sw: strides.1,
            padding,
            out_h,
            out_w,
            pad_top,
            pad_left,
        })
    }

    /// Elements of the input `[n, h, w, c]` (saturating, like every length here: absurd
    /// dims then fail the length checks instead of overflowing).
    pub fn in_len(&self) -> usize {
        prod(&[self.n, self.h, self.w, self.c])
    }

    /// Elements of the output `[n, out_h, out_w, c]` (and of the max-pool argmax).
    pub fn out_len(&self) -> usize {
        prod(&[self.n, self.out_h, self.out_w, self.c])
    }

    /// Elements in one window (padding included).
    pub fn window_len(&self) -> usize {
        self.kh.saturating_mul(self.kw)
    }

    /// Window of output row `o` along H: `(unclipped start, first valid, end valid)`.
    #[inline]
    fn win_h(&self, o: usize) -> (isize, usize, usize) {
        window(o, self.sh, self.pad_top, self.kh, self.h)
    }

    #[inline]
    fn win_w(&self, o: usize) -> (isize, usize, usize) {
        window(o, self.sw, self.pad_left, self.kw, self.w)
    }

    /// Output rows/cols whose window covers input index `i` along H: `lo..hi`.
    #[inline]
    fn covering_h(&self, i: usize) -> (usize, usize) {
        covering(i, self.sh, self.pad_top, self.kh, self.out_h)
    }

    #[inline]
    fn covering_w(&self, i: usize) -> (usize, usize) {
        covering(i, self.sw, self.pad_left, self.kw, self.out_w)
    }
}

fn prod(parts: &[usize]) -> usize {
    parts.iter().fold(1usize, |a, &b| a.saturating_mul(b))
}

#[inline]
fn window(o: usize, s: usize, pad: usize, k: usize, extent: usize) -> (isize, usize, usize) {
    let start = (o * s) as isize - pad as isize;
    let lo = start.max(0) as usize;
    let hi = ((start + k as isize).max(0) as usize).min(extent);
    (start, lo, hi)
}

#[inline]
fn covering(i: usize, s: usize, pad: usize, k: usize, out: usize) -> (usize, usize) {
    // Output o covers i when o·s − pad ≤ i ≤ o·s − pad + k − 1.
    let top = i + pad; // o·s ≤ top
    let lo = (top + 1).saturating_sub(k).div_ceil(s);
    let hi = (top / s + 1).min(out);
    (lo, hi.max(lo))
}

fn check_io(op: &str, d: &Pool2d, x_len: usize, y_len: usize, x: &str, y: &str) -> KResult {
    // The fields are public: a hand-built Pool2d whose derived fields disagree with the rule
    // would index out of bounds, so recompute them.
    let again = Pool2d::new(d.n, d.h, d.w, d.c, (d.kh, d.kw), (d.sh, d.sw), d.padding)
        .map_err(|e| KernelError(format!("{op}: {e}")))?;
    if again != *d {
        return Err(KernelError(format!(
            "{op}: Pool2d output/padding fields disagree with TF's rule \
             (expected {again:?}); build it with Pool2d::new"
        )));
    }
    need(op, x, x_len, d.in_len())?;
    need(op, y, y_len, d.out_len())
}

/// Max pooling forward: `y` (`[n, out_h, out_w, c]`) and, per output element, the position of
/// the maximum within its window as a u8 `ki·kw + kj` (padding positions count in the
/// numbering but are never chosen). Ties pick the first in row-major window order; a NaN in the
/// window wins (propagates). Needs `kh·kw ≤ 255`.
pub fn max_pool2d_forward<T: Element>(
    d: &Pool2d,
    x: &[T],
    y: &mut [T],
    argmax: &mut [u8],
) -> KResult {
    check_io("max_pool2d_forward", d, x.len(), y.len(), "x", "y")?;
    check_len("max_pool2d_forward: argmax", argmax.len(), d.out_len())?;
    if d.window_len() > 255 {
        return Err(KernelError(format!(
            "max_pool2d_forward: window {}x{} has {} elements; the u8 argmax holds at most 255",
            d.kh,
            d.kw,
            d.window_len()
        )));
    }
    let (row, c) = (d.out_w * d.c, d.c);
    if row == 0 {
        return Ok(());
    }
    let out = d.out_len();
    rows2(
        &mut y[..out],
        row,
        &mut argmax[..out],
        row,
        row.saturating_mul(d.window_len()),
        |r, yr, ar| {
            let (b, oh) = (r / d.out_h, r % d.out_h);
            let img = &x[b * d.h * d.w * c..(b + 1) * d.h * d.w * c];
            max_pool_row(d, img, oh, yr, ar);
        },
    );
    Ok(())
}

wide_loop! {
    /// One output row `oh` of [`max_pool2d_forward`] from its image `img`, 8 channels at a
    /// time (then one at a time for a remainder). Compiled wide (AVX-512 or AVX2 where the CPU
    /// has them); a compare and a select per lane either way, so the bits do not depend on the
    /// CPU.
    fn max_pool_row<T: Element>(d: &Pool2d, img: &[T], oh: usize, yr: &mut [T], ar: &mut [u8])
    wide if true, {
        let c = d.c;
        let whole = c - c % POOL_LANES;
        for ow in 0..d.out_w {
            let o = ow * c;
            for c0 in (0..whole).step_by(POOL_LANES) {
                window_max::<T, POOL_LANES>(d, img, (oh, ow), c0, &mut yr[o + c0..], &mut ar[o + c0..]);
            }
            for c0 in whole..c {
                window_max::<T, 1>(d, img, (oh, ow), c0, &mut yr[o + c0..], &mut ar[o + c0..]);
            }
        }
    }
}

/// Channels [`max_pool_row`] takes at once: one AVX2 register of f32 (and of the u32 taps).
const POOL_LANES: usize = 8;

/// The maximum of output pixel `(oh, ow)`'s window over the `L` channels from `c0`, into
/// `y[..L]`, and its tap into `argmax[..L]`. The running maximum and its tap stay in f32 and
/// u32 lanes of one width, in registers, with selects instead of branches: which element wins
/// is data, and a branch on it is mispredicted about every other time. (Kept in a fixed-size
/// local, not a slice of a stack array: on a slice the compiler turns the select into a masked
/// store, which AMD's cores run several times slower.)
#[inline(always)]
fn window_max<T: Element, const L: usize>(
    d: &Pool2d,
    img: &[T],
    (oh, ow): (usize, usize),
    c0: usize,
    y: &mut [T],
    argmax: &mut [u8],
) {
    let c = d.c;
    let ((hs, ilo, ihi), (ws, jlo, jhi)) = (d.win_h(oh), d.win_w(ow));
    let tap = |i: usize, j: usize| {
        ((i as isize - hs) as usize * d.kw + (j as isize - ws) as usize) as u32
    };
    // Seed with the first valid position (every window has one, see tf_out_and_pad).
    let first = &img[(ilo * d.w + jlo) * c + c0..][..L];
    let mut best: [f32; L] = std::array::from_fn(|q| first[q].to_f32());
    // The tap as an f32 (exact: at most 255), so that both selects are of f32 lanes under
    // one mask; with a u32 tap the compiler leaves the vector unit for every lane.
    let mut at = [tap(ilo, jlo) as f32; L];
    for i in ilo..ihi {
        for j in jlo..jhi {
            if i == ilo && j == jlo {
                continue;
            }
            let (idx, xs) = (tap(i, j) as f32, &img[(i * d.w + j) * c + c0..][..L]);
            for q in 0..L {
                let (v, cur) = (xs[q].to_f32(), best[q]);
                let take = (v > cur) | (v.is_nan() & !cur.is_nan());
                best[q] = if take { v } else { cur };
                at[q] = if take { idx } else { at[q] };
            }
        }
    }
    for q in 0..L {
        y[q] = T::from_f32(best[q]);
        argmax[q] = at[q] as u8;
    }
}

/// Max pooling backward: `dx` (overwritten, fully) gets each `dy` at the argmax position its
/// forward recorded; positions that were no window's max get 0. Reads only `argmax` and `dy`.
pub fn max_pool2d_backward<T: Element>(
    d: &Pool2d,
    argmax: &[u8],
    dy: &[T],
    dx: &mut [T],
) -> KResult {
    check_io("max_pool2d_backward", d, dx.len(), dy.len(), "dx", "dy")?;
    check_len("max_pool2d_backward: argmax", argmax.len(), d.out_len())?;
    pool_backward(d, dx, |r, dxr| max_pool_backward_row(d, argmax, dy, r, dxr));
    Ok(())
}

wide_loop! {
    /// One input row `r` (sample and row) of [`max_pool2d_backward`], compiled wide, as
    /// [`max_pool_row`].
    fn max_pool_backward_row<T: Element>(
        d: &Pool2d,
        argmax: &[u8],
        dy: &[T],
        r: usize,
        dxr: &mut [T]
    ) wide if true, {
        pool_backward_row(d, r, dxr, &MaxGrad { d, argmax, dy })
    }
}

/// What one output window `(oh, ow)` covering input pixel `(ih, iw)` adds to its gradient:
/// into `acc`, the f32 sums of up to [`CH_BLOCK`] channels whose offset in the output (`dy`,
/// `argmax`) is `o`. A trait with an always-inlined method, not a closure, so that it is
/// compiled into a wide row (a closure called there may stay a baseline function).
trait WindowGrad {
    fn add(&self, window: (usize, usize), pixel: (usize, usize), o: usize, acc: &mut [f32]);
}

/// Max pooling's: `dy` where the window's argmax is the pixel's position (a blend by mask,
/// not a branch, as in the forward; −0 adds nothing to any sum, +0 included).
struct MaxGrad<'a, T> {
    d: &'a Pool2d,
    argmax: &'a [u8],
    dy: &'a [T],
}

impl<T: Element> WindowGrad for MaxGrad<'_, T> {
    #[inline(always)]
    fn add(&self, (oh, ow): (usize, usize), (ih, iw): (usize, usize), o: usize, acc: &mut [f32]) {
        let d = self.d;
        let ki = ih + d.pad_top - oh * d.sh;
        let kj = iw + d.pad_left - ow * d.sw;
        let want = (ki * d.kw + kj) as u8;
        let (am, g) = (&self.argmax[o..o + acc.len()], &self.dy[o..o + acc.len()]);
        for ((a, &t), gv) in acc.iter_mut().zip(am).zip(g) {
            let m = ((t == want) as u32).wrapping_neg();
            *a += f32::from_bits((gv.to_f32().to_bits() & m) | ((-0.0f32).to_bits() & !m));
        }
    }
}

/// Average pooling's: `dy` over the window's count of valid elements.
struct AvgGrad<'a, T> {
    d: &'a Pool2d,
    dy: &'a [T],
}

impl<T: Element> WindowGrad for AvgGrad<'_, T> {
    #[inline(always)]
    fn add(&self, (oh, ow): (usize, usize), _: (usize, usize), o: usize, acc: &mut [f32]) {
        let (_, ilo, ihi) = self.d.win_h(oh);
        let (_, jlo, jhi) = self.d.win_w(ow);
        let inv = 1.0 / ((ihi - ilo) * (jhi - jlo)) as f32;
        let cb = acc.len();
        for (a, g) in acc.iter_mut().zip(&self.dy[o..o + cb]) {
            *a += g.to_f32() * inv;
        }
    }
}

/// The scatter both pooling backwards share: `row(r, dx_row)` writes each input row of `dx`
/// (overwritten, fully), in parallel.
fn pool_backward<T: Element>(
    d: &Pool2d,
    dx: &mut [T],
    row: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    let row_len = d.w * d.c;
    let cover = d.kh.div_ceil(d.sh).saturating_mul(d.kw.div_ceil(d.sw));
    let len = d.in_len();
    rows(&mut dx[..len], row_len, row_len.saturating_mul(cover), row);
}

/// One input row `r` (sample and row) of a pooling backward: each `dx[b, ih, iw, c]` is the
/// f32 sum, over the output windows covering input pixel `(ih, iw)`, of what `grad` adds.
#[inline(always)]
fn pool_backward_row<T: Element>(d: &Pool2d, r: usize, dxr: &mut [T], grad: &impl WindowGrad) {
    let c = d.c;
    let (b, ih) = (r / d.h, r % d.h);
    let (oh_lo, oh_hi) = d.covering_h(ih);
    let out_img = b * d.out_h * d.out_w * c;
    for iw in 0..d.w {
        let (ow_lo, ow_hi) = d.covering_w(iw);
        for c0 in (0..c).step_by(CH_BLOCK) {
            let cb = CH_BLOCK.min(c - c0);
            let mut acc = [0f32; CH_BLOCK];
            for oh in oh_lo..oh_hi {
                for ow in ow_lo..ow_hi {
                    let o = out_img + (oh * d.out_w + ow) * c + c0;
                    grad.add((oh, ow), (ih, iw), o, &mut acc[..cb]);
                }
            }
            for (o, a) in dxr[iw * c + c0..iw * c + c0 + cb].iter_mut().zip(&acc) {
                *o = T::from_f32(*a);
            }
        }
    }
}

/// Average pooling forward. With `Same` padding each window averages only its valid (non-pad)
/// elements, as Keras/TF do (`count_include_pad = false`).
pub fn avg_pool2d_forward<T: Element>(d: &Pool2d, x: &[T], y: &mut [T]) -> KResult {
    check_io("avg_pool2d_forward", d, x.len(), y.len(), "x", "y")?;
    let (row, c) = (d.out_w * d.c, d.c);
    let (out, work) = (d.out_len(), row.saturating_mul(d.window_len()));
    rows(&mut y[..out], row, work, |r, yr| {
        let (b, oh) = (r / d.out_h, r % d.out_h);
        let (_, ilo, ihi) = d.win_h(oh);
        let img = &x[b * d.h * d.w * c..(b + 1) * d.h * d.w * c];
        for ow in 0..d.out_w {
            let (_, jlo, jhi) = d.win_w(ow);
            let inv = 1.0 / ((ihi - ilo) * (jhi - jlo)) as f32;
            for c0 in (0..c).step_by(CH_BLOCK) {
                let cb = CH_BLOCK.min(c - c0);
                let mut acc = [0f32; CH_BLOCK];
                for i in ilo..ihi {
                    for j in jlo..jhi {
                        let src = &img[(i * d.w + j) * c + c0..(i * d.w + j) * c + c0 + cb];
                        for (a, v) in acc.iter_mut().zip(src) {
                            *a += v.to_f32();
                        }
                    }
                }
                for (o, a) in yr[ow * c + c0..ow * c + c0 + cb].iter_mut().zip(acc.iter()) {
                    *o = T::from_f32(*a * inv);
                }
            }
        }
    });
    Ok(())
}

/// Average pooling backward: `dx` (overwritten) = Σ over covering windows of `dy / count`,
/// where `count` is that window's number of valid elements. Reads only `dy`.
pub fn avg_pool2d_backward<T: Element>(d: &Pool2d, dy: &[T], dx: &mut [T]) -> KResult {
    check_io("avg_pool2d_backward", d, dx.len(), dy.len(), "dx", "dy")?;
    pool_backward(d, dx, |r, dxr| {
        pool_backward_row(d, r, dxr, &AvgGrad { d, dy })
    });
    Ok(())
}

/// Global average pooling `[n, h, w, c] → [n, c]` (Keras `GlobalAveragePooling2D`), summed in
/// f64 so large feature maps lose nothing.
pub fn global_avg_pool_forward<T: Element>(
    x: &[T],
    y: &mut [T],
    n: usize,
    hw: usize,
    c: usize,
) -> KResult {
    check_len("global_avg_pool_forward: x", x.len(), prod(&[n, hw, c]))?;
    check_len("global_avg_pool_forward: y", y.len(), n.saturating_mul(c))?;
    if hw == 0 {
        return Err(KernelError(
            "global_avg_pool_forward: empty spatial extent (h·w = 0)".into(),
        ));
    }
    let inv = 1.0 / hw as f64;
    rows(&mut y[..n * c], c, hw * c, |b, yr| {
        let img = &x[b * hw * c..(b + 1) * hw * c];
        for c0 in (0..c).step_by(CH_BLOCK) {
            let cb = CH_BLOCK.min(c - c0);
            let mut acc = [0f64; CH_BLOCK];
            for p in 0..hw {
                for (a, v) in acc.iter_mut().zip(&img[p * c + c0..p * c + c0 + cb]) {
                    *a += v.to_f32() as f64;
                }
            }
            for (o, a) in yr[c0..c0 + cb].iter_mut().zip(acc.iter()) {
                *o = T::from_f32((*a * inv) as f32);
            }
        }
    });
    Ok(())
}

/// Global average pooling backward: `dx[b, p, ch] = dy[b, ch] / (h·w)` (overwritten).
pub fn global_avg_pool_backward<T: Element>(
    dy: &[T],
    dx: &mut [T],
    n: usize,
    hw: usize,
    c: usize,
) -> KResult {
    check_len(
        "global_avg_pool_backward: dy",
        dy.len(),
        n.saturating_mul(c),
    )?;
    check_len("global_avg_pool_backward: dx", dx.len(), prod(&[n, hw, c]))?;
    if hw == 0 {
        return Ok(());
    }
    let inv = 1.0 / hw as f32;
    rows(&mut dx[..n * hw * c], c, c, |r, dxr| {
        let b = r / hw;
        for (o, g) in dxr.iter_mut().zip(&dy[b * c..(b + 1) * c]) {
            *o = T::from_f32(g.to_f32() * inv);
        }
    });
    Ok(())
}
