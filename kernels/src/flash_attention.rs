//! Memory-efficient attention (FlashAttention-style): the forward keeps the output and one
//! log-sum-exp per query row, never the `[seq, seq]` probabilities; the backward recomputes
//! them tile by tile from `q`, `k` and the log-sum-exp.
//!
//! Layout as [`crate::attention`]: `qkv [b, s, 3h]` (q, k, v in column blocks of `h`, head `i`
//! at columns `i·d..(i+1)·d` of each), `ctx [b, s, h]`; `lse [b, heads, s]` is f32 whatever the
//! storage type. For pair (batch item, head) and query row `i`:
//!
//! - `s_ij = scale · q_i·k_j` over `j < s` (`j ≤ i` when causal);
//! - `lse_i = m_i + ln Σ_j exp(s_ij − m_i)` with `m_i = max_j s_ij`, `p_ij = exp(s_ij − lse_i)`;
//! - with dropout rate `r`: element `e = ((b·heads + head)·s + i)·s + j` of the layer's random
//!   stream is kept when its uniform is `≥ r` (exactly [`crate::random::dropout_mask`]'s rule
//!   over the materialised `[b, heads, s, s]` probabilities), `pd_ij = kept · p_ij / (1 − r)`;
//! - `ctx_i = Σ_j pd_ij · v_j`.
//!
//! The backward, with `Dr_i = dctx_i·ctx_i`: `dp_ij = kept · (dctx_i·v_j) / (1 − r)`,
//! `ds_ij = p_ij (dp_ij − Dr_i)`, `dq_i = scale Σ_j ds_ij k_j`, `dk_j = scale Σ_i ds_ij q_i`,
//! `dv_j = Σ_i pd_ij dctx_i`; it overwrites all of `dqkv`.
//!
//! The CUDA kernels (`kernels/cuda/attention.cu`) follow the same contract. On the CPU the
//! forward runs (pair, query tile) units in parallel, the backward whole pairs (each lane
//! holds its pair's `dq` in f32); both convert tiles to f32 in a lane of the f32 scratch, whose
//! first `b·heads·s` floats hold `Dr`. The tile products are single-threaded f32 GEMMs of the
//! `gemm` crate ([`flash_forward_heap_bytes`] and [`flash_backward_heap_bytes`] give the heap
//! they hold).

use crate::attention::AttentionDims;
use crate::gemm::{for_each_lane, gemm_core, lanes_at_once, load_f32, Mat, MatMut};
use crate::gemm_heap::{gemm_core_heap_bytes, Strides};
use crate::random::{unit_f32, RngKey};
use crate::{check_len, Element, KResult, KernelError};
use gemm::Parallelism;
use rayon::prelude::*;

/// Query rows per tile (fewer for a shorter sequence: [`tiles`]). The forward's unit of
/// parallel work is one query tile of one (batch, head) pair.
pub const FLASH_TILE_Q: usize = 64;
/// Key rows per tile. Wider key tiles (128, 256), for longer tile GEMMs, measured no faster at
/// GPT-2's shape on this machine, and cost scratch.
pub const FLASH_TILE_K: usize = 64;

/// The query and key tile rows for a sequence of `seq`: [`FLASH_TILE_Q`] and
/// [`FLASH_TILE_K`], or the whole sequence when shorter.
pub const fn tiles(seq: usize) -> (usize, usize) {
    let s = if seq == 0 { 1 } else { seq };
    let q = if s < FLASH_TILE_Q { s } else { FLASH_TILE_Q };
    let k = if s < FLASH_TILE_K { s } else { FLASH_TILE_K };
    (q, k)
}
/// Lanes of scratch the planner provisions: at most this many units run at once.
pub const FLASH_LANES: usize = 8;

/// f32 elements of one forward lane: the q tile and the output accumulator (`tq·head_dim`
/// each), the k and v tiles (`tk·head_dim`), the score tile (`tq·tk`), the row max and sum,
/// the dropout multipliers of a row.
pub const fn forward_lane_len(seq: usize, head_dim: usize) -> usize {
    let (tq, tk) = tiles(seq);
    2 * tq * head_dim + 2 * tk * head_dim + tq * tk + 2 * tq + tk
}

/// f32 elements of one backward lane: the pair's `dq`, the k, v, dk, dv, q and dctx tiles, the
/// probabilities (then their dropped copy) and their gradient, the dropout multipliers.
pub const fn backward_lane_len(seq: usize, head_dim: usize) -> usize {
    let (tq, tk) = tiles(seq);
    seq * head_dim + 4 * tk * head_dim + 2 * tq * head_dim + 2 * tq * tk + tk
}

/// The f32 scratch the kernels here need: `Dr` (`batch·heads·seq`), then the larger of the
/// forward's lanes (one per (pair, query tile), at most [`FLASH_LANES`]) and the backward's
/// (one per pair, at most [`FLASH_LANES`]). More lanes than that are not used; at least one
/// must fit.
pub const fn flash_scratch_len(d: AttentionDims) -> usize {
    let pairs = d.batch * d.heads;
    let hd = d.hidden / if d.heads == 0 { 1 } else { d.heads };
    let fwd = lanes_for(pairs * d.seq.div_ceil(tiles(d.seq).0)) * forward_lane_len(d.seq, hd);
    let bwd = lanes_for(pairs) * backward_lane_len(d.seq, hd);
    pairs * d.seq + if fwd > bwd { fwd } else { bwd }
}

const fn lanes_for(units: usize) -> usize {
    if units < FLASH_LANES {
        units
    } else {
        FLASH_LANES
    }
}

/// Peak heap bytes the `gemm` crate holds during one [`flash_attention_forward`] with
/// `ws_len` elements of scratch: the larger of its two tile GEMMs (`Q·Kᵀ`, `P·V`), times the
/// units that can run at once.
pub fn flash_forward_heap_bytes(d: AttentionDims, ws_len: usize) -> usize {
    let ((tq, tk), hd) = (tiles(d.seq), d.head_dim());
    let (r, c) = (Strides::row_major, |ld| Strides::new(1, ld));
    let scores = tile_heap(tq, tk, hd, r(hd), c(hd), 0.0, r(tk));
    let context = tile_heap(tq, hd, tk, r(tk), r(hd), 1.0, r(hd));
    let units = d.batch * d.heads * d.seq.div_ceil(tq);
    running(d, units, forward_lane_len(d.seq, hd), ws_len) * scores.max(context)
}

/// Peak heap bytes the `gemm` crate holds during one [`flash_attention_backward`]: the largest
/// of its five tile GEMMs, times the pairs that can run at once.
pub fn flash_backward_heap_bytes(d: AttentionDims, ws_len: usize) -> usize {
    let ((tq, tk), hd) = (tiles(d.seq), d.head_dim());
    let (r, c) = (Strides::row_major, |ld| Strides::new(1, ld));
    let peak = [
        tile_heap(tq, tk, hd, r(hd), c(hd), 0.0, r(tk)),
        tile_heap(tk, hd, tq, c(tk), r(hd), 1.0, r(hd)),
        tile_heap(tq, hd, tk, r(tk), r(hd), 1.0, r(hd)),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    running(d, d.batch * d.heads, backward_lane_len(d.seq, hd), ws_len) * peak
}

fn tile_heap(m: usize, n: usize, k: usize, a: Strides, b: Strides, beta: f32, c: Strides) -> usize {
    gemm_core_heap_bytes::<f32, f32, f32>(m, n, k, a, b, beta, c, false, Parallelism::None)
}

/// Units of `count` that run at once on lanes of `lane` elements in a scratch of `ws_len`.
fn running(d: AttentionDims, count: usize, lane: usize, ws_len: usize) -> usize {
    let lanes = ws_len.saturating_sub(d.batch * d.heads * d.seq);
    lanes_at_once(count, lane, lanes)
}

/// The rate and stream of the attention dropout (`None`: no dropout).
#[derive(Clone, Copy, Debug)]
pub struct FlashDropout {
    pub key: RngKey,
    pub rate: f32,
}

/// A pointer the parallel units write through at disjoint rows.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: every unit writes rows no other unit touches; the slice outlives the parallel loop.
unsafe impl<T: Send> Send for Shared<T> {}
unsafe impl<T: Send> Sync for Shared<T> {}

struct Geometry {
    s: usize,
    h: usize,
    hd: usize,
    heads: usize,
    /// Query rows per tile ([`tiles`]).
    t: usize,
    /// Key rows per tile.
    tk: usize,
    scale: f32,
    causal: bool,
}

impl Geometry {
    fn new(d: AttentionDims, scale: f32, causal: bool) -> Self {
        let (t, tk) = tiles(d.seq);
        Geometry {
            s: d.seq,
            h: d.hidden,
            hd: d.head_dim(),
            heads: d.heads,
            t,
            tk,
            scale,
            causal,
        }
    }

    /// Offset of row `i`, part `part` (0 q, 1 k, 2 v) of pair `(b, head)` in `qkv`.
    fn qkv_row(&self, b: usize, head: usize, part: usize, i: usize) -> usize {
        (b * self.s + i) * 3 * self.h + part * self.h + head * self.hd
    }
    /// Offset of row `i` of head `head` of batch item `b` in `ctx`.
    fn ctx_row(&self, b: usize, head: usize, i: usize) -> usize {
        (b * self.s + i) * self.h + head * self.hd
    }
    /// Keys row `i` sees in the tile starting at `k0` of `kn` rows.
    fn visible(&self, i: usize, k0: usize, kn: usize) -> usize {
        if self.causal {
            (i + 1).saturating_sub(k0).min(kn)
        } else {
            kn
        }
    }
}

fn check(
    what: &str,
    d: AttentionDims,
    qkv: usize,
    ctx: usize,
    lse: usize,
    dropout: Option<FlashDropout>,
) -> KResult {
    if d.heads == 0 || d.head_dim() * d.heads != d.hidden {
        return Err(KernelError(format!(
            "{what}: hidden {} is not a multiple of heads {}",
            d.hidden, d.heads
        )));
    }
    check_len(&format!("{what} qkv"), qkv, d.qkv_len())?;
    check_len(&format!("{what} ctx"), ctx, d.ctx_len())?;
    check_len(&format!("{what} lse"), lse, d.batch * d.heads * d.seq)?;
    if let Some(dr) = dropout {
        if !(0.0..1.0).contains(&dr.rate) {
            return Err(KernelError(format!(
                "{what}: dropout rate {} must be in [0, 1)",
                dr.rate
            )));
        }
        if d.scores_len() as u64 > crate::random::MAX_STREAM_ELEMENTS {
            return Err(KernelError(format!(
                "{what}: {} attention probabilities exceed one random stream's 2^34",
                d.scores_len()
            )));
        }
    }
    Ok(())
}

/// The scratch split into `Dr` (`batch·heads·seq`) and the lanes, after checking that it holds
/// `Dr` and at least one lane of `lane` elements.
fn split_scratch<'a>(
    what: &str,
    d: AttentionDims,
    lane: usize,
    ws: &'a mut [f32],
) -> Result<(&'a mut [f32], &'a mut [f32]), KernelError> {
    let dr = d.batch * d.heads * d.seq;
    check_len(&format!("{what} scratch"), ws.len(), dr + lane)?;
    Ok(ws.split_at_mut(dr))
}

/// `e^x` in f32 to about 1 ulp (a relative 2e-7), branch-free so that a loop of it
/// vectorises: `2^n · e^f` with `n = round(x·log2 e)`, `f = x − n·ln 2` (ln 2 in two parts)
/// and a degree-7 polynomial for `e^f`. Below −87.3 it gives 0 (where `exp` leaves the
/// normal range), above 88.72 infinity, NaN stays NaN; the inputs here are `s − max ≤ 0`.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts (Cody and Waite): n·LN2_HI is exact for the n here.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // Comparisons, not `clamp`/`max` (whose NaN rules keep the loop from vectorising).
    let xc = if x < -87.3 { -87.3 } else { x };
    let xc = if xc > 88.3 { 88.3 } else { xc };
    let n = (xc * LOG2E + ROUND) - ROUND;
    let f = (xc - n * LN2_HI) - n * LN2_LO;
    // e^f, |f| ≤ ln2/2: Taylor to degree 7 (the next term is below 4e-9).
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * f + c;
    }
    // SAFETY: the clamp keeps n in −126..=128, well inside i32 (a plain conversion, where
    // `as` would add saturation checks that stop the loop vectorising).
    let ni = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    let y = p * scale;
    let y = if x < -87.3 { 0.0 } else { y };
    let y = if x > 88.72 { f32::INFINITY } else { y };
    // NaN (the only value unequal to itself) stays NaN.
    #[allow(clippy::eq_op)]
    if x != x {
        x
    } else {
        y
    }
}

/// `Σ x` in eight independent sums (vectorises; a fixed order, so the result does not depend
/// on the thread count).
#[inline(always)]
fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `mul[c] = 1/(1−r)` when element `base + c` of the stream is kept, else 0; all ones without
/// dropout.
fn dropout_row(dropout: Option<FlashDropout>, base: u64, mul: &mut [f32]) {
    let Some(FlashDropout { key, rate }) = dropout else {
        mul.fill(1.0);
        return;
    };
    let scale = 1.0 / (1.0 - rate);
    let (mut block, mut words) = (u64::MAX, [0u32; 4]);
    for (c, m) in mul.iter_mut().enumerate() {
        let e = base + c as u64;
        if e / 4 != block {
            block = e / 4;
            words = key.block(block as u32);
        }
        *m = if unit_f32(words[(e % 4) as usize]) >= rate {
            scale
        } else {
            0.0
        };
    }
}

/// Loads `n` rows of `len` elements, `stride` apart from `src[at..]`, into `dst` (row-major).
fn load_rows<T: Element>(
    src: &[T],
    at: usize,
    stride: usize,
    n: usize,
    len: usize,
    dst: &mut [f32],
) {
    for r in 0..n {
        let o = at + r * stride;
        load_f32(&src[o..o + len], &mut dst[r * len..(r + 1) * len]);
    }
}

/// Splits `w` into consecutive slices of the given lengths.
fn split<const N: usize>(mut w: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    lens.map(|n| {
        let (a, b) = std::mem::take(&mut w).split_at_mut(n);
        w = b;
        a
    })
}

/// Forward: writes `ctx` and `lse` (see the module docs). `ws`: [`flash_scratch_len`] f32
/// (at least `Dr` and one lane). Every length is checked before anything is written.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward<T: Element>(
    d: AttentionDims,
    qkv: &[T],
    ctx: &mut [T],
    lse: &mut [f32],
    scale: f32,
    causal: bool,
    dropout: Option<FlashDropout>,
    ws: &mut [f32],
) -> KResult {
    let what = "flash_attention_forward";
    check(what, d, qkv.len(), ctx.len(), lse.len(), dropout)?;
    let lane = forward_lane_len(d.seq, d.head_dim());
    let (_, lanes) = split_scratch(what, d, lane, ws)?;
    let g = Geometry::new(d, scale, causal);
    let tiles = d.seq.div_ceil(g.t);
    let units = d.batch * d.heads * tiles;
    let (ctx_p, lse_p) = (Shared(ctx.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    for_each_lane(units, lane, lanes, |u, w| {
        let (pair, q0) = (u / tiles, (u % tiles) * g.t);
        // SAFETY: unit `u` writes rows q0.. of its pair only.
        unsafe { forward_tile(&g, qkv, ctx_p, lse_p, pair, q0, dropout, w) };
    });
    Ok(())
}

/// One query tile of one pair: the online softmax over the key tiles it sees.
#[allow(clippy::too_many_arguments)]
unsafe fn forward_tile<T: Element>(
    g: &Geometry,
    qkv: &[T],
    ctx: Shared<T>,
    lse: Shared<f32>,
    pair: usize,
    q0: usize,
    dropout: Option<FlashDropout>,
    w: &mut [f32],
) {
    let (t, tk, hd) = (g.t, g.tk, g.hd);
    let (b, head) = (pair / g.heads, pair % g.heads);
    let qn = t.min(g.s - q0);
    let lens = [t * hd, tk * hd, tk * hd, t * tk, t * hd, t, t, tk];
    let [q, k, v, sc, acc, m, l, mul] = split(w, lens);
    load_rows(qkv, g.qkv_row(b, head, 0, q0), 3 * g.h, qn, hd, q);
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kend = if g.causal { q0 + qn } else { g.s };
    for k0 in (0..kend).step_by(tk) {
        let kn = tk.min(kend - k0);
        load_rows(qkv, g.qkv_row(b, head, 1, k0), 3 * g.h, kn, hd, k);
        load_rows(qkv, g.qkv_row(b, head, 2, k0), 3 * g.h, kn, hd, v);
        // S = scale·Q·Kᵀ, then each row becomes its dropped, unnormalised probabilities.
        tile_gemm(
            qn,
            kn,
            hd,
            g.scale,
            rows(q, hd),
            cols(k, hd),
            0.0,
            rows_mut(sc, tk),
        );
        for r in 0..qn {
            let i = q0 + r;
            let jn = g.visible(i, k0, kn);
            let srow = &mut sc[r * tk..r * tk + kn];
            srow[jn..].fill(0.0);
            if jn == 0 {
                continue;
            }
            let mx = srow[..jn].iter().fold(m[r], |a, &x| a.max(x));
            let alpha = fast_exp(m[r] - mx);
            acc[r * hd..(r + 1) * hd]
                .iter_mut()
                .for_each(|a| *a *= alpha);
            dropout_row(
                dropout,
                ((pair * g.s + i) * g.s + k0) as u64,
                &mut mul[..jn],
            );
            let p = &mut srow[..jn];
            p.iter_mut().for_each(|x| *x = fast_exp(*x - mx));
            let sum = sum8(p);
            if dropout.is_some() {
                p.iter_mut().zip(&mul[..jn]).for_each(|(x, mu)| *x *= mu);
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
        }
        // acc += P·V.
        tile_gemm(
            qn,
            hd,
            kn,
            1.0,
            rows(sc, tk),
            rows(v, hd),
            1.0,
            rows_mut(acc, hd),
        );
    }
    for r in 0..qn {
        let i = q0 + r;
        let inv = 1.0 / l[r];
        let out = ctx.0.add(g.ctx_row(b, head, i));
        for (c, a) in acc[r * hd..(r + 1) * hd].iter().enumerate() {
            *out.add(c) = T::from_f32(a * inv);
        }
        *lse.0.add(pair * g.s + i) = m[r] + l[r].ln();
    }
}

/// Backward: overwrites `dqkv` from `qkv`, the forward's `ctx` and `lse`, and `dctx` (see the
/// module docs). `ws` as [`flash_attention_forward`]'s.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward<T: Element>(
    d: AttentionDims,
    qkv: &[T],
    ctx: &[T],
    lse: &[f32],
    dctx: &[T],
    dqkv: &mut [T],
    scale: f32,
    causal: bool,
    dropout: Option<FlashDropout>,
    ws: &mut [f32],
) -> KResult {
    let what = "flash_attention_backward";
    check(what, d, qkv.len(), ctx.len(), lse.len(), dropout)?;
    check_len(&format!("{what} dctx"), dctx.len(), d.ctx_len())?;
    check_len(&format!("{what} dqkv"), dqkv.len(), d.qkv_len())?;
    let lane = backward_lane_len(d.seq, d.head_dim());
    let (dr, lanes) = split_scratch(what, d, lane, ws)?;
    let g = Geometry::new(d, scale, causal);
    let pairs = d.batch * d.heads;
    dr.par_chunks_mut(d.seq).enumerate().for_each(|(pair, dr)| {
        let (b, head) = (pair / g.heads, pair % g.heads);
        for (i, v) in dr.iter_mut().enumerate() {
            let o = g.ctx_row(b, head, i);
            *v = (0..g.hd)
                .map(|c| dctx[o + c].to_f32() * ctx[o + c].to_f32())
                .sum();
        }
    });
    let dr: &[f32] = dr;
    let out = Shared(dqkv.as_mut_ptr());
    for_each_lane(pairs, lane, lanes, |pair, w| {
        // SAFETY: pair `pair` writes its own head's columns of dqkv only.
        unsafe { backward_pair(&g, qkv, lse, dctx, dr, out, pair, dropout, w) };
    });
    Ok(())
}

/// One pair's backward: key tiles outermost (their dk, dv accumulate in the lane), the pair's
/// dq in the lane too, written once at the end. Five tile GEMMs per (key tile, query tile):
/// `S = scale·Q·Kᵀ`, `dPd = dO·Vᵀ`, `dV += Pdᵀ·dO`, `dQ += dS·K`, `dK += dSᵀ·Q`.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_pair<T: Element>(
    g: &Geometry,
    qkv: &[T],
    lse: &[f32],
    dctx: &[T],
    dr: &[f32],
    dqkv: Shared<T>,
    pair: usize,
    dropout: Option<FlashDropout>,
    w: &mut [f32],
) {
    let (t, tk, hd) = (g.t, g.tk, g.hd);
    let (b, head) = (pair / g.heads, pair % g.heads);
    let lens = [
        g.s * hd,
        tk * hd,
        tk * hd,
        tk * hd,
        tk * hd,
        t * hd,
        t * hd,
        t * tk,
        t * tk,
        tk,
    ];
    let [dq, k, v, dk, dv, q, dout, p, ds, mul] = split(w, lens);
    dq.fill(0.0);
    for k0 in (0..g.s).step_by(tk) {
        let kn = tk.min(g.s - k0);
        load_rows(qkv, g.qkv_row(b, head, 1, k0), 3 * g.h, kn, hd, k);
        load_rows(qkv, g.qkv_row(b, head, 2, k0), 3 * g.h, kn, hd, v);
        dk.fill(0.0);
        dv.fill(0.0);
        // Causal: query rows before the tile see none of its keys.
        let first = if g.causal { k0 / t * t } else { 0 };
        for q0 in (first..g.s).step_by(t) {
            let qn = t.min(g.s - q0);
            load_rows(qkv, g.qkv_row(b, head, 0, q0), 3 * g.h, qn, hd, q);
            load_rows(dctx, g.ctx_row(b, head, q0), g.h, qn, hd, dout);
            tile_gemm(
                qn,
                kn,
                hd,
                g.scale,
                rows(q, hd),
                cols(k, hd),
                0.0,
                rows_mut(p, tk),
            );
            tile_gemm(
                qn,
                kn,
                hd,
                1.0,
                rows(dout, hd),
                cols(v, hd),
                0.0,
                rows_mut(ds, tk),
            );
            for r in 0..qn {
                let i = q0 + r;
                let jn = g.visible(i, k0, kn);
                let (li, di) = (lse[pair * g.s + i], dr[pair * g.s + i]);
                dropout_row(
                    dropout,
                    ((pair * g.s + i) * g.s + k0) as u64,
                    &mut mul[..jn],
                );
                let row = r * tk..r * tk + kn;
                // The scores become the dropped probabilities, dO·Vᵀ becomes dS.
                let (pr, dsr) = (&mut p[row.clone()], &mut ds[row]);
                let (pv, dv_) = (&mut pr[..jn], &mut dsr[..jn]);
                for ((pc, dc), mu) in pv.iter_mut().zip(dv_.iter_mut()).zip(&mul[..jn]) {
                    let e = fast_exp(*pc - li);
                    *pc = e * mu;
                    *dc = g.scale * e * (*dc * mu - di);
                }
                pr[jn..].fill(0.0);
                dsr[jn..].fill(0.0);
            }
            tile_gemm(
                kn,
                hd,
                qn,
                1.0,
                cols(p, tk),
                rows(dout, hd),
                1.0,
                rows_mut(dv, hd),
            );
            let dq_rows = rows_mut(&mut dq[q0 * hd..], hd);
            tile_gemm(qn, hd, kn, 1.0, rows(ds, tk), rows(k, hd), 1.0, dq_rows);
            tile_gemm(
                kn,
                hd,
                qn,
                1.0,
                cols(ds, tk),
                rows(q, hd),
                1.0,
                rows_mut(dk, hd),
            );
        }
        store_rows(dk, kn, hd, dqkv, g.qkv_row(b, head, 1, k0), 3 * g.h);
        store_rows(dv, kn, hd, dqkv, g.qkv_row(b, head, 2, k0), 3 * g.h);
    }
    store_rows(dq, g.s, hd, dqkv, g.qkv_row(b, head, 0, 0), 3 * g.h);
}

/// The row-major view of `x` whose rows are `ld` apart.
fn rows(x: &[f32], ld: usize) -> Mat<f32> {
    Mat {
        ptr: x.as_ptr(),
        rs: ld,
        cs: 1,
    }
}

/// The transposed view of the row-major `x` whose rows are `ld` apart.
fn cols(x: &[f32], ld: usize) -> Mat<f32> {
    Mat {
        ptr: x.as_ptr(),
        rs: 1,
        cs: ld,
    }
}

fn rows_mut(x: &mut [f32], ld: usize) -> MatMut<f32> {
    MatMut {
        ptr: x.as_mut_ptr(),
        rs: ld,
        cs: 1,
    }
}

/// `c = alpha·a·b + beta·c` of f32 tiles in a lane, single-threaded (the units run in
/// parallel).
///
/// # Safety
/// The views are valid for `m×k`, `k×n` and `m×n`, and `c` overlaps neither `a` nor `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_gemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat<f32>,
    b: Mat<f32>,
    beta: f32,
    c: MatMut<f32>,
) {
    gemm_core(
        m,
        n,
        k,
        alpha,
        a,
        b,
        beta,
        c,
        None,
        &mut [],
        Parallelism::None,
    )
}

/// Stores `n` rows of `len` f32 from `src` to `dst + at`, rows `stride` apart.
unsafe fn store_rows<T: Element>(
    src: &[f32],
    n: usize,
    len: usize,
    dst: Shared<T>,
    at: usize,
    stride: usize,
) {
    for r in 0..n {
        let o = dst.0.add(at + r * stride);
        for (c, x) in src[r * len..(r + 1) * len].iter().enumerate() {
            *o.add(c) = T::from_f32(*x);
        }
    }
}
