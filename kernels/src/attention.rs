//! Multi-head self-attention's two GEMM stages, forward and backward, over a packed `qkv`.
//!
//! `qkv[b, s, 3h]` holds q in columns `0..h`, k in `h..2h`, v in `2h..3h`; head `i` uses
//! columns `i·d..(i+1)·d` of each (`d = h / heads`). The stages are
//!
//! - scores: `scores[b, i] = scale · q_bi · k_biᵀ` (`[s, s]` per batch item and head);
//! - (softmax over the last axis — written elsewhere);
//! - context: `ctx[b, :, i·d..(i+1)·d] = probs[b, i] · v_bi` (heads merged back into `[b, s, h]`).
//!
//! **Gradient split of `dqkv`.** [`scores_backward`] writes the q and k column ranges of
//! `dqkv`, [`context_backward`] the v range; together they overwrite all of it, in either order.
//!
//! Every (batch item, head) pair is an independent set of small GEMMs: pairs run in parallel,
//! each GEMM single-threaded. Half storage converts blocks to f32 in a per-lane workspace
//! ([`attention_ws_len`]); the number of lanes that fit in `ws` bounds that parallelism.

use crate::gemm::{
    check_part, for_each_lane, gemm_core, lanes_at_once, matmul_mixed_ws_len, Mat, MatMut,
};
use crate::gemm_heap::{gemm_core_heap_bytes, Strides};
use crate::{Element, KResult, KernelError};
use gemm::Parallelism;

/// Value written at masked (future) positions by a causal [`scores_forward`]; rounds to `-inf`
/// in f16 and stays finite in f32/bf16. Softmax maps it to exactly 0.
pub const CAUSAL_MASK: f32 = -1.0e30;

/// Workspace lanes [`attention_ws_len`] provisions for half storage: this many (batch, head)
/// pairs convert and multiply at once.
pub const ATTENTION_LANES: usize = 8;

/// Shape of one attention call: `qkv[batch, seq, 3·hidden]`, `heads` heads of
/// `hidden / heads` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub heads: usize,
}

impl AttentionDims {
    /// Columns per head, `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }
    /// The scores' scale, `1/sqrt(head_dim)` in f32: the one definition both devices use.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim() as f32).sqrt()
    }
    /// Elements of `qkv` / `dqkv`: `batch·seq·3·hidden`.
    pub fn qkv_len(&self) -> usize {
        self.batch * self.seq * 3 * self.hidden
    }
    /// Elements of `scores` / `probs` / their gradients: `batch·heads·seq·seq`.
    pub fn scores_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }
    /// Elements of `ctx` / `dctx`: `batch·seq·hidden`.
    pub fn ctx_len(&self) -> usize {
        self.batch * self.seq * self.hidden
    }
    fn pairs(&self) -> usize {
        self.batch * self.heads
    }
    fn validate(&self, what: &str) -> KResult {
        if self.heads == 0 || self.head_dim() * self.heads != self.hidden {
            return Err(KernelError(format!(
                "{what}: hidden {} is not a multiple of heads {}",
                self.hidden, self.heads
            )));
        }
        Ok(())
    }
}

/// f32 workspace of one (batch, head) pair: the largest GEMM of the four kernels.
fn lane_ws_len<T: Element>(d: AttentionDims) -> usize {
    let (s, hd) = (d.seq, d.head_dim());
    matmul_mixed_ws_len::<T, T, T>(s, s, hd).max(matmul_mixed_ws_len::<T, T, T>(s, hd, s))
}

/// `f32` workspace for every kernel in this module: `min(batch·heads, 8)` lanes of
/// `max(ws<T,T,T>(s, s, d), ws<T,T,T>(s, d, s))` ([`crate::gemm::matmul_mixed_ws_len`]);
/// `0` for f32. Any `ws` holding at least one lane is accepted; more lanes, more parallelism.
pub fn attention_ws_len<T: Element>(d: AttentionDims) -> usize {
    lane_ws_len::<T>(d) * d.pairs().min(ATTENTION_LANES)
}

/// Peak heap bytes the `gemm` crate holds during one call of a kernel here whose GEMMs for one
/// pair peak at `pair_peak(parallelism)`, given `ws_len` elements of workspace — mirroring
/// [`run_pairs`]: pairs one after another with threaded GEMMs (one pair's peak), or pairs in
/// lanes with single-threaded GEMMs, where every lane that can run at once holds its pair's
/// peak at the same moment in the worst case.
fn pairs_heap_bytes<T: Element>(
    d: AttentionDims,
    ws_len: usize,
    pair_peak: impl Fn(Parallelism) -> usize,
) -> usize {
    let (pairs, per) = (d.pairs(), lane_ws_len::<T>(d));
    let lanes = ws_len.checked_div(per).unwrap_or(pairs);
    if pairs >= 2 && lanes >= 2 {
        lanes_at_once(pairs, per, ws_len) * pair_peak(Parallelism::None)
    } else if pairs >= 1 {
        pair_peak(Parallelism::Rayon(0))
    } else {
        0
    }
}

/// The strides of q, k or v of one pair inside `qkv[b, s, 3h]` (`Qkv::part`).
fn part_strides(d: AttentionDims) -> Strides {
    Strides::row_major(3 * d.hidden)
}

/// Peak heap bytes the `gemm` crate holds during one [`scores_forward`] with a workspace of
/// `ws_len` elements ([`crate::gemm_heap`]): the GEMM `q·kᵀ` of each pair, times the pairs
/// running at once ([`attention_ws_len`]'s lanes, bounded by rayon's threads).
pub fn scores_forward_heap_bytes<T: Element>(d: AttentionDims, ws_len: usize) -> usize {
    let (s, hd, qk) = (d.seq, d.head_dim(), part_strides(d));
    pairs_heap_bytes::<T>(d, ws_len, |par| {
        let scores = Strides::row_major(s);
        gemm_core_heap_bytes::<T, T, T>(s, s, hd, qk, qk.t(), 0.0, scores, false, par)
    })
}

/// Peak heap bytes the `gemm` crate holds during one [`scores_backward`]: per pair the larger of
/// `dS·k` and `dSᵀ·q`, times the pairs running at once.
pub fn scores_backward_heap_bytes<T: Element>(d: AttentionDims, ws_len: usize) -> usize {
    let (s, hd, qk) = (d.seq, d.head_dim(), part_strides(d));
    pairs_heap_bytes::<T>(d, ws_len, |par| {
        let ds = Strides::row_major(s);
        let dq = gemm_core_heap_bytes::<T, T, T>(s, hd, s, ds, qk, 0.0, qk, false, par);
        let dk = gemm_core_heap_bytes::<T, T, T>(s, hd, s, ds.t(), qk, 0.0, qk, false, par);
        dq.max(dk)
    })
}

/// Peak heap bytes the `gemm` crate holds during one [`context_forward`]: the GEMM `P·v` of each
/// pair, times the pairs running at once.
pub fn context_forward_heap_bytes<T: Element>(d: AttentionDims, ws_len: usize) -> usize {
    let (s, hd, v) = (d.seq, d.head_dim(), part_strides(d));
    pairs_heap_bytes::<T>(d, ws_len, |par| {
        let (p, ctx) = (Strides::row_major(s), Strides::row_major(d.hidden));
        gemm_core_heap_bytes::<T, T, T>(s, hd, s, p, v, 0.0, ctx, false, par)
    })
}

/// Peak heap bytes the `gemm` crate holds during one [`context_backward`]: per pair the larger of
/// `dctx·vᵀ` and `Pᵀ·dctx`, times the pairs running at once.
pub fn context_backward_heap_bytes<T: Element>(d: AttentionDims, ws_len: usize) -> usize {
    let (s, hd, v) = (d.seq, d.head_dim(), part_strides(d));
    pairs_heap_bytes::<T>(d, ws_len, |par| {
        let (p, dctx) = (Strides::row_major(s), Strides::row_major(d.hidden));
        let dp = gemm_core_heap_bytes::<T, T, T>(s, s, hd, dctx, v.t(), 0.0, p, false, par);
        let dv = gemm_core_heap_bytes::<T, T, T>(s, hd, s, p.t(), dctx, 0.0, v, false, par);
        dp.max(dv)
    })
}

/// Runs `f(pair, lane_ws, parallelism)` for every (batch, head) pair: pairs in parallel when
/// there are several and the workspace allows, else one after another with threaded GEMMs.
fn run_pairs<F>(d: AttentionDims, per: usize, ws: &mut [f32], f: F)
where
    F: Fn(usize, usize, &mut [f32], Parallelism) + Sync,
{
    let pairs = d.pairs();
    let lanes = ws.len().checked_div(per).unwrap_or(pairs); // per == 0: f32, no workspace
    if pairs >= 2 && lanes >= 2 {
        for_each_lane(pairs, per, ws, |p, w| {
            f(p / d.heads, p % d.heads, w, Parallelism::None)
        });
    } else {
        for p in 0..pairs {
            f(
                p / d.heads,
                p % d.heads,
                &mut ws[..per],
                Parallelism::Rayon(0),
            );
        }
    }
}

fn check_ws<T: Element>(what: &str, d: AttentionDims, ws: &[f32]) -> Result<usize, KernelError> {
    let per = lane_ws_len::<T>(d);
    check_part(what, "ws", ws.len(), per)?;
    Ok(per)
}

/// Views of q, k, v of pair (b, head) inside a packed `[b, s, 3h]` tensor.
struct Qkv<T> {
    base: *const T,
    s: usize,
    h: usize,
    hd: usize,
}

impl<T> Clone for Qkv<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Qkv<T> {}
// SAFETY: only reads through the pointer; the slice it came from outlives every use.
unsafe impl<T: Sync> Send for Qkv<T> {}
unsafe impl<T: Sync> Sync for Qkv<T> {}

impl<T> Qkv<T> {
    /// The heads of the packed `qkv` at `base`, of shape `d`.
    fn of(base: *const T, d: AttentionDims) -> Self {
        Qkv {
            base,
            s: d.seq,
            h: d.hidden,
            hd: d.head_dim(),
        }
    }

    /// `part` 0 = q, 1 = k, 2 = v: the `[s, d]` view of head `head` of batch item `b`.
    fn part(&self, b: usize, head: usize, part: usize) -> Mat<T> {
        let off = b * self.s * 3 * self.h + part * self.h + head * self.hd;
        Mat {
            ptr: self.base.wrapping_add(off),
            rs: 3 * self.h,
            cs: 1,
        }
    }
    fn part_mut(&self, b: usize, head: usize, part: usize) -> MatMut<T> {
        let m = self.part(b, head, part);
        MatMut {
            ptr: m.ptr as *mut T,
            rs: m.rs,
            cs: m.cs,
        }
    }
}

/// One head's GEMM `c = alpha·a·b` (overwritten, no bias), on its lane's workspace `w`: the
/// shape of every product here.
///
/// # Safety
/// As [`gemm_core`]: the views are valid for `m×k`, `k×n` and `m×n` and `c` is unique.
#[allow(clippy::too_many_arguments)]
unsafe fn head_gemm<T: Element>(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat<T>,
    b: Mat<T>,
    c: MatMut<T>,
    w: &mut [f32],
    par: Parallelism,
) {
    gemm_core(m, n, k, alpha, a, b, 0.0, c, None, w, par)
}

/// Forward scores: `scores[b, i] = scale · q_bi · k_biᵀ`, `[batch, heads, s, s]`, overwritten.
/// With `causal`, entries `j > i` (keys after the query) are set to [`CAUSAL_MASK`] so the
/// softmax gives them probability 0. `ws`: [`attention_ws_len`] (empty for f32).
pub fn scores_forward<T: Element>(
    d: AttentionDims,
    qkv: &[T],
    scores: &mut [T],
    scale: f32,
    causal: bool,
    ws: &mut [f32],
) -> KResult {
    let what = "attention scores_forward";
    d.validate(what)?;
    check_part(what, "qkv", qkv.len(), d.qkv_len())?;
    check_part(what, "scores", scores.len(), d.scores_len())?;
    let per = check_ws::<T>(what, d, ws)?;
    let (s, hd) = (d.seq, d.head_dim());
    let v = Qkv::of(qkv.as_ptr(), d);
    let out = MatMut::rows(scores.as_mut_ptr(), s);
    let mask = T::from_f32(CAUSAL_MASK);
    run_pairs(d, per, ws, |b, head, w, par| {
        let sc = out.offset((b * d.heads + head) * s * s);
        // SAFETY: lengths checked above; each pair writes its own [s, s] block of scores.
        unsafe {
            head_gemm(
                s,
                s,
                hd,
                scale,
                v.part(b, head, 0),
                v.part(b, head, 1).t(),
                sc,
                w,
                par,
            );
            if causal {
                for i in 0..s {
                    for j in i + 1..s {
                        *sc.ptr.add(i * s + j) = mask;
                    }
                }
            }
        }
    });
    Ok(())
}

/// Backward of [`scores_forward`] given `dscores[batch, heads, s, s]` (the softmax's input
/// gradient): writes (**overwrites**) the q and k column ranges of `dqkv`:
/// `dq_bi = scale · dS · k_bi`, `dk_bi = scale · dSᵀ · q_bi`. The v range is left to
/// [`context_backward`].
///
/// With a causal mask `dscores` must be 0 at the masked positions — which the softmax backward
/// gives exactly, since their probabilities are 0 — so no mask argument is needed here.
pub fn scores_backward<T: Element>(
    d: AttentionDims,
    dscores: &[T],
    qkv: &[T],
    dqkv: &mut [T],
    scale: f32,
    ws: &mut [f32],
) -> KResult {
    let what = "attention scores_backward";
    d.validate(what)?;
    check_part(what, "dscores", dscores.len(), d.scores_len())?;
    check_part(what, "qkv", qkv.len(), d.qkv_len())?;
    check_part(what, "dqkv", dqkv.len(), d.qkv_len())?;
    let per = check_ws::<T>(what, d, ws)?;
    let (s, hd) = (d.seq, d.head_dim());
    let v = Qkv::of(qkv.as_ptr(), d);
    let g = Qkv::of(dqkv.as_mut_ptr() as *const T, d);
    let ds = Mat::rows(dscores.as_ptr(), s);
    run_pairs(d, per, ws, |b, head, w, par| {
        let dsp = ds.offset((b * d.heads + head) * s * s);
        // SAFETY: lengths checked above; each pair writes only its own head's q and k columns
        // of batch item b, which no other pair touches.
        unsafe {
            let (q, k) = (v.part(b, head, 0), v.part(b, head, 1));
            head_gemm(s, hd, s, scale, dsp, k, g.part_mut(b, head, 0), w, par);
            head_gemm(s, hd, s, scale, dsp.t(), q, g.part_mut(b, head, 1), w, par);
        }
    });
    Ok(())
}

/// Forward context: `ctx[b, :, i·d..(i+1)·d] = probs[b, i] · v_bi`, heads merged into
/// `ctx[batch, s, hidden]`, overwritten. `ws`: [`attention_ws_len`] (empty for f32).
pub fn context_forward<T: Element>(
    d: AttentionDims,
    probs: &[T],
    qkv: &[T],
    ctx: &mut [T],
    ws: &mut [f32],
) -> KResult {
    let what = "attention context_forward";
    d.validate(what)?;
    check_part(what, "probs", probs.len(), d.scores_len())?;
    check_part(what, "qkv", qkv.len(), d.qkv_len())?;
    check_part(what, "ctx", ctx.len(), d.ctx_len())?;
    let per = check_ws::<T>(what, d, ws)?;
    let (s, hd, h) = (d.seq, d.head_dim(), d.hidden);
    let v = Qkv::of(qkv.as_ptr(), d);
    let p = Mat::rows(probs.as_ptr(), s);
    let out = MatMut::rows(ctx.as_mut_ptr(), h);
    run_pairs(d, per, ws, |b, head, w, par| {
        let pp = p.offset((b * d.heads + head) * s * s);
        let c = out.offset(b * s * h + head * hd);
        // SAFETY: lengths checked above; each pair writes its own head's columns of item b.
        unsafe { head_gemm(s, hd, s, 1.0, pp, v.part(b, head, 2), c, w, par) };
    });
    Ok(())
}

/// Backward of [`context_forward`] given `dctx[batch, s, hidden]`:
/// `dprobs[b, i] = dctx_bi · v_biᵀ` (**overwritten**, `[batch, heads, s, s]`) and the v column
/// range of `dqkv`, `dv_bi = probs[b, i]ᵀ · dctx_bi` (**overwritten**; q and k ranges are
/// [`scores_backward`]'s).
#[allow(clippy::too_many_arguments)]
pub fn context_backward<T: Element>(
    d: AttentionDims,
    dctx: &[T],
    probs: &[T],
    qkv: &[T],
    dprobs: &mut [T],
    dqkv: &mut [T],
    ws: &mut [f32],
) -> KResult {
    let what = "attention context_backward";
    d.validate(what)?;
    check_part(what, "dctx", dctx.len(), d.ctx_len())?;
    check_part(what, "probs", probs.len(), d.scores_len())?;
    check_part(what, "qkv", qkv.len(), d.qkv_len())?;
    check_part(what, "dprobs", dprobs.len(), d.scores_len())?;
    check_part(what, "dqkv", dqkv.len(), d.qkv_len())?;
    let per = check_ws::<T>(what, d, ws)?;
    let (s, hd, h) = (d.seq, d.head_dim(), d.hidden);
    let v = Qkv::of(qkv.as_ptr(), d);
    let g = Qkv::of(dqkv.as_mut_ptr() as *const T, d);
    let p = Mat::rows(probs.as_ptr(), s);
    let dc = Mat::rows(dctx.as_ptr(), h);
    let dp = MatMut::rows(dprobs.as_mut_ptr(), s);
    run_pairs(d, per, ws, |b, head, w, par| {
        let pair = (b * d.heads + head) * s * s;
        let dcp = dc.offset(b * s * h + head * hd);
        // SAFETY: lengths checked above; each pair writes its own [s, s] block of dprobs and
        // its own head's v columns of item b in dqkv.
        unsafe {
            head_gemm(
                s,
                s,
                hd,
                1.0,
                dcp,
                v.part(b, head, 2).t(),
                dp.offset(pair),
                w,
                par,
            );
            head_gemm(
                s,
                hd,
                s,
                1.0,
                p.offset(pair).t(),
                dcp,
                g.part_mut(b, head, 2),
                w,
                par,
            );
        }
    });
    Ok(())
}
