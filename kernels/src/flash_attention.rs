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
use crate::elementwise::add_lanes;
use crate::fastmath::exp_with;
use crate::gemm::{for_each_lane, gemm_core, is_f32, lanes_at_once, load_f32, Mat, MatMut};
use crate::gemm_heap::{gemm_core_heap_bytes, Strides};
use crate::random::{unit_f32, RngKey};
use crate::{check_len_with, Element, KResult, KernelError};
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
/// `ws_len` elements of scratch: the larger of its two tile GEMMs (`Q·Kᵀ`, `P·V`) over the tile
/// sizes that occur, times the units that can run at once.
pub fn flash_forward_heap_bytes(d: AttentionDims, ws_len: usize) -> usize {
    let (tq, hd) = (tiles(d.seq).0, d.head_dim());
    let r = Strides::row_major;
    let peak = tile_sizes(d.seq)
        .map(|(qn, kn, tk)| {
            // S reads K transposed by `load_transposed`, rows `tk` apart.
            let scores = tile_heap(qn, kn, hd, r(hd), r(tk), 0.0, r(tk));
            let context = tile_heap(qn, hd, kn, r(tk), r(hd), 1.0, r(hd));
            scores.max(context)
        })
        .max()
        .unwrap_or(0);
    let units = d.batch * d.heads * d.seq.div_ceil(tq);
    running(d, units, forward_lane_len(d.seq, hd), ws_len) * peak
}

/// Peak heap bytes the `gemm` crate holds during one [`flash_attention_backward`]: the largest
/// of its five tile GEMMs over the tile sizes that occur, times the pairs that can run at
/// once. Exact for half storage; for f32 an upper bound: its `S` reads a transposed K (as
/// `dPd` reads V), where half storage, whose lane has no room for both a converted and a
/// transposed K, reads the converted K transposed in place; both are counted.
pub fn flash_backward_heap_bytes(d: AttentionDims, ws_len: usize) -> usize {
    let hd = d.head_dim();
    let (r, c) = (Strides::row_major, |ld| Strides::new(1, ld));
    let peak = tile_sizes(d.seq)
        .map(|(qn, kn, tk)| {
            [
                tile_heap(qn, kn, hd, r(hd), c(hd), 0.0, r(tk)),
                tile_heap(qn, kn, hd, r(hd), r(tk), 0.0, r(tk)),
                tile_heap(kn, hd, qn, c(tk), r(hd), 1.0, r(hd)),
                tile_heap(qn, hd, kn, r(tk), r(hd), 1.0, r(hd)),
            ]
            .into_iter()
            .max()
            .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    running(d, d.batch * d.heads, backward_lane_len(d.seq, hd), ws_len) * peak
}

/// The (query rows, key rows, key tile) of the tiles a sequence of `seq` is cut into: whole
/// tiles and the last, shorter one of each, in every pairing (the `gemm` crate's packing
/// depends on a size's remainder by its register block, so a short tile may need more).
fn tile_sizes(seq: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let (tq, tk) = tiles(seq);
    let last = |t: usize| match seq % t {
        0 => t,
        r => r,
    };
    let (qs, ks) = ([tq, last(tq)], [tk, last(tk)]);
    qs.into_iter()
        .flat_map(move |qn| ks.into_iter().map(move |kn| (qn, kn, tk)))
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
    check_len_with(|| format!("{what} qkv"), qkv, d.qkv_len())?;
    check_len_with(|| format!("{what} ctx"), ctx, d.ctx_len())?;
    check_len_with(|| format!("{what} lse"), lse, d.batch * d.heads * d.seq)?;
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
    check_len_with(|| format!("{what} scratch"), ws.len(), dr + lane)?;
    Ok(ws.split_at_mut(dr))
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
    add_lanes(acc) + tail
}

/// `max(init, max x)` in eight independent maxima (vectorises; comparisons, not `f32::max`,
/// whose NaN rule keeps the loop scalar; a NaN score is passed over either way).
#[inline(always)]
fn max8(x: &[f32], init: f32) -> f32 {
    let mut acc = [init; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let mut mx = init;
    for &v in acc.iter().chain(tail) {
        mx = if v > mx { v } else { mx };
    }
    mx
}

/// Replaces each `x` by `e^(x − mx)` and returns their sum ([`sum8`]). Two plain loops: the
/// exponentials in one loop vectorise to full-width registers, where folding the sum into the
/// same loop over eight-lane arrays left LLVM with half-width code and spills.
#[inline(always)]
fn exp_sum8<const FMA: bool>(x: &mut [f32], mx: f32) -> f32 {
    x.iter_mut().for_each(|v| *v = exp_with::<FMA>(*v - mx));
    sum8(x)
}

/// `Σ a·b` in f32, in eight independent sums (vectorises for f32 storage).
#[inline(always)]
fn dot8<T: Element>(a: &[T], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = (ca.remainder().iter().zip(cb.remainder()))
        .map(|(x, y)| x.to_f32() * y.to_f32())
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l].to_f32() * y[l].to_f32();
        }
    }
    add_lanes(acc) + tail
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

/// An f32 view of `n` rows of `len` elements, `stride` apart from `src[at..]`: the rows where
/// they lie when `T` is f32 (a copy would cost as much as a tile GEMM's packing), else
/// converted into `buf` (rows `len` apart). The strides have the same unit-stride pattern
/// either way, so the `gemm` crate's heap is the same.
fn tile_rows<T: Element>(
    src: &[T],
    at: usize,
    stride: usize,
    n: usize,
    len: usize,
    buf: &mut [f32],
) -> Tile {
    if is_f32::<T>() && n > 0 {
        let rows = &src[at..at + (n - 1) * stride + len];
        Tile {
            ptr: rows.as_ptr() as *const f32,
            ld: stride,
        }
    } else {
        load_rows(src, at, stride, n, len, buf);
        Tile {
            ptr: buf.as_ptr(),
            ld: len,
        }
    }
}

/// A row-major f32 tile whose rows are `ld` apart, valid while its source is.
#[derive(Clone, Copy)]
struct Tile {
    ptr: *const f32,
    ld: usize,
}

impl Tile {
    fn rows(self) -> Mat<f32> {
        Mat {
            ptr: self.ptr,
            rs: self.ld,
            cs: 1,
        }
    }
    /// The transposed view.
    fn cols(self) -> Mat<f32> {
        Mat {
            ptr: self.ptr,
            rs: 1,
            cs: self.ld,
        }
    }
}

/// Loads `n` rows of `len` elements, `stride` apart from `src[at..]`, transposed into `dst`:
/// element `c` of row `r` at `dst[c·ld + r]`.
fn load_transposed<T: Element>(
    src: &[T],
    at: usize,
    stride: usize,
    n: usize,
    len: usize,
    dst: &mut [f32],
    ld: usize,
) {
    if n == 0 || len == 0 {
        return;
    }
    // Every row of the source and every column run of the destination in bounds, once.
    let (src, dst) = (
        &src[at..at + (n - 1) * stride + len],
        &mut dst[..(len - 1) * ld + n],
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if is_f32::<T>() && std::is_x86_feature_detected!("avx") {
        // SAFETY: T is f32; the CPU has AVX; the blocks lie inside the checked slices.
        done = unsafe { transpose_blocks_avx(src.as_ptr() as *const f32, stride, n, len, dst, ld) };
    }
    // The rest (all of it without AVX or for half storage) eight rows at a time: each
    // column's eight values land in one run of `dst`.
    for r0 in (done..n).step_by(8) {
        let rn = 8.min(n - r0);
        let rows: [&[T]; 8] = std::array::from_fn(|i| {
            let o = (r0 + i.min(rn - 1)) * stride;
            &src[o..o + len]
        });
        for c in 0..len {
            let out = &mut dst[c * ld + r0..c * ld + r0 + rn];
            for (i, d) in out.iter_mut().enumerate() {
                *d = rows[i][c].to_f32();
            }
        }
    }
}

/// The f32 transpose of [`load_transposed`] in 8×8 blocks of AVX registers (unpack, shuffle,
/// swap halves: 24 shuffles per 64 elements, where element by element — ours or the `gemm`
/// crate's packing of a transposed operand — measured a seventh of the forward's time). Does
/// the first `n / 8 · 8` rows (all columns) and returns that count.
///
/// # Safety
/// The CPU has AVX; `src` holds `n` rows of `len`, `stride` apart; `dst` holds `(len − 1)·ld
/// + n` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_blocks_avx(
    src: *const f32,
    stride: usize,
    n: usize,
    len: usize,
    dst: &mut [f32],
    ld: usize,
) -> usize {
    use std::arch::x86_64::*;
    let rows = n / 8 * 8;
    let d = dst.as_mut_ptr();
    for r0 in (0..rows).step_by(8) {
        let mut c0 = 0;
        while c0 + 8 <= len {
            let r: [__m256; 8] =
                std::array::from_fn(|i| _mm256_loadu_ps(src.add((r0 + i) * stride + c0)));
            let t = [
                _mm256_unpacklo_ps(r[0], r[1]),
                _mm256_unpackhi_ps(r[0], r[1]),
                _mm256_unpacklo_ps(r[2], r[3]),
                _mm256_unpackhi_ps(r[2], r[3]),
                _mm256_unpacklo_ps(r[4], r[5]),
                _mm256_unpackhi_ps(r[4], r[5]),
                _mm256_unpacklo_ps(r[6], r[7]),
                _mm256_unpackhi_ps(r[6], r[7]),
            ];
            // u[c]: column c (low lane, rows 0–3 / 4–7 in u[c] / u[c + 4]), column c + 4
            // (high lane).
            let u = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            for c in 0..4 {
                let lo = _mm256_permute2f128_ps::<0x20>(u[c], u[c + 4]);
                let hi = _mm256_permute2f128_ps::<0x31>(u[c], u[c + 4]);
                _mm256_storeu_ps(d.add((c0 + c) * ld + r0), lo);
                _mm256_storeu_ps(d.add((c0 + c + 4) * ld + r0), hi);
            }
            c0 += 8;
        }
        for c in c0..len {
            for i in 0..8 {
                *d.add(c * ld + r0 + i) = *src.add((r0 + i) * stride + c);
            }
        }
    }
    rows
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
    let q = tile_rows(qkv, g.qkv_row(b, head, 0, q0), 3 * g.h, qn, hd, q);
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kend = if g.causal { q0 + qn } else { g.s };
    for k0 in (0..kend).step_by(tk) {
        let kn = tk.min(kend - k0);
        load_transposed(qkv, g.qkv_row(b, head, 1, k0), 3 * g.h, kn, hd, k, tk);
        let vt = tile_rows(qkv, g.qkv_row(b, head, 2, k0), 3 * g.h, kn, hd, v);
        // S = scale·Q·Kᵀ, then each row becomes its dropped, unnormalised probabilities.
        tile_gemm(
            qn,
            kn,
            hd,
            g.scale,
            q.rows(),
            rows(k, tk),
            0.0,
            rows_mut(sc, tk),
        );
        let tile = TileRows {
            pair,
            q0,
            qn,
            k0,
            kn,
        };
        softmax_rows(g, tile, sc, acc, m, l, dropout, mul);
        // acc += P·V.
        tile_gemm(
            qn,
            hd,
            kn,
            1.0,
            rows(sc, tk),
            vt.rows(),
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

/// Which rows and keys a score tile holds: query rows `q0..q0 + qn` of pair `pair` against
/// keys `k0..k0 + kn`.
#[derive(Clone, Copy)]
struct TileRows {
    pair: usize,
    q0: usize,
    qn: usize,
    k0: usize,
    kn: usize,
}

impl TileRows {
    /// Whether the causal mask hides some of the tile's keys from some row (only the tiles
    /// across the diagonal; the others are seen whole or not at all).
    fn masked(&self, g: &Geometry) -> bool {
        g.causal && self.k0 + self.kn > self.q0 + 1
    }
    /// The keys row `r` of the tile sees.
    fn visible(&self, g: &Geometry, r: usize) -> usize {
        g.visible(self.q0 + r, self.k0, self.kn)
    }
    /// The first element of row `r`'s slice of the random stream.
    fn stream(&self, g: &Geometry, r: usize) -> u64 {
        ((self.pair * g.s + self.q0 + r) * g.s + self.k0) as u64
    }
}

/// The forward's row passes over one score tile `sc` (rows `tk` apart): the online softmax's
/// new row maxima `m`, the rescaled accumulator `acc` and sums `l`, and the scores replaced by
/// their (dropped) unnormalised probabilities, zero past the keys a row sees. Compiled with
/// AVX2 and FMA where the CPU has them (the crate is built for baseline x86-64, whose 4-lane
/// SSE2 halves the loops' speed).
#[allow(clippy::too_many_arguments)]
fn softmax_rows(
    g: &Geometry,
    rows: TileRows,
    sc: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled with.
        return unsafe { softmax_rows_v3(g, rows, sc, acc, m, l, dropout, mul) };
    }
    softmax_rows_body::<false>(g, rows, sc, acc, m, l, dropout, mul)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn softmax_rows_v3(
    g: &Geometry,
    rows: TileRows,
    sc: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    softmax_rows_body::<true>(g, rows, sc, acc, m, l, dropout, mul)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax_rows_body<const FMA: bool>(
    g: &Geometry,
    rows: TileRows,
    sc: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    let (tk, hd, kn) = (g.tk, g.hd, rows.kn);
    let masked = rows.masked(g);
    for r in 0..rows.qn {
        let jn = if masked { rows.visible(g, r) } else { kn };
        let srow = &mut sc[r * tk..r * tk + kn];
        srow[jn..].fill(0.0);
        if jn == 0 {
            continue;
        }
        let p = &mut srow[..jn];
        let mx = max8(p, m[r]);
        // The first tile (m = −∞) gives alpha = 0 on a zero accumulator.
        let alpha = exp_with::<FMA>(m[r] - mx);
        if alpha != 1.0 {
            acc[r * hd..(r + 1) * hd]
                .iter_mut()
                .for_each(|a| *a *= alpha);
        }
        let sum = exp_sum8::<FMA>(p, mx);
        if dropout.is_some() {
            dropout_row(dropout, rows.stream(g, r), &mut mul[..jn]);
            p.iter_mut().zip(&mul[..jn]).for_each(|(x, mu)| *x *= mu);
        }
        l[r] = l[r] * alpha + sum;
        m[r] = mx;
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
    check_len_with(|| format!("{what} dctx"), dctx.len(), d.ctx_len())?;
    check_len_with(|| format!("{what} dqkv"), dqkv.len(), d.qkv_len())?;
    let lane = backward_lane_len(d.seq, d.head_dim());
    let (dr, lanes) = split_scratch(what, d, lane, ws)?;
    let g = Geometry::new(d, scale, causal);
    let pairs = d.batch * d.heads;
    dr.par_chunks_mut(d.seq).enumerate().for_each(|(pair, dr)| {
        let (b, head) = (pair / g.heads, pair % g.heads);
        for (i, v) in dr.iter_mut().enumerate() {
            let o = g.ctx_row(b, head, i);
            *v = dot8(&dctx[o..o + g.hd], &ctx[o..o + g.hd]);
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
/// `S = scale·Q·Kᵀ`, `dPd = dO·Vᵀ`, `dV += Pdᵀ·dO`, `dQ += scale·dS·K`, `dK += scale·dSᵀ·Q`.
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
    let rows_of = |part, r0| g.qkv_row(b, head, part, r0);
    for k0 in (0..g.s).step_by(tk) {
        let kn = tk.min(g.s - k0);
        // Kᵀ and Vᵀ (dimension-major, rows `tk` apart) once per key tile for `S` and `dPd`,
        // which the `gemm` crate would otherwise transpose element by element in every call.
        // `dQ` reads K as it lies (f32), or converted where the lane has no room for both.
        load_transposed(qkv, rows_of(2, k0), 3 * g.h, kn, hd, v, tk);
        let vt = Tile {
            ptr: v.as_ptr(),
            ld: tk,
        };
        let (kt, k_t) = if is_f32::<T>() {
            load_transposed(qkv, rows_of(1, k0), 3 * g.h, kn, hd, k, tk);
            let kt = tile_rows(qkv, rows_of(1, k0), 3 * g.h, kn, hd, &mut []);
            (
                kt,
                Tile {
                    ptr: k.as_ptr(),
                    ld: tk,
                }
                .rows(),
            )
        } else {
            let kt = tile_rows(qkv, rows_of(1, k0), 3 * g.h, kn, hd, k);
            (kt, kt.cols())
        };
        dk.fill(0.0);
        dv.fill(0.0);
        // Causal: query rows before the tile see none of its keys.
        let first = if g.causal { k0 / t * t } else { 0 };
        for q0 in (first..g.s).step_by(t) {
            let qn = t.min(g.s - q0);
            let qt = tile_rows(qkv, rows_of(0, q0), 3 * g.h, qn, hd, q);
            let ot = tile_rows(dctx, g.ctx_row(b, head, q0), g.h, qn, hd, dout);
            tile_gemm(qn, kn, hd, g.scale, qt.rows(), k_t, 0.0, rows_mut(p, tk));
            tile_gemm(qn, kn, hd, 1.0, ot.rows(), vt.rows(), 0.0, rows_mut(ds, tk));
            let tile = TileRows {
                pair,
                q0,
                qn,
                k0,
                kn,
            };
            let at = pair * g.s + q0;
            let (li, di) = (&lse[at..at + qn], &dr[at..at + qn]);
            grad_rows(g, tile, p, ds, li, di, dropout, mul);
            tile_gemm(
                kn,
                hd,
                qn,
                1.0,
                cols(p, tk),
                ot.rows(),
                1.0,
                rows_mut(dv, hd),
            );
            let dq_rows = rows_mut(&mut dq[q0 * hd..], hd);
            tile_gemm(qn, hd, kn, g.scale, rows(ds, tk), kt.rows(), 1.0, dq_rows);
            tile_gemm(
                kn,
                hd,
                qn,
                g.scale,
                cols(ds, tk),
                qt.rows(),
                1.0,
                rows_mut(dk, hd),
            );
        }
        store_rows(dk, kn, hd, dqkv, rows_of(1, k0), 3 * g.h);
        store_rows(dv, kn, hd, dqkv, rows_of(2, k0), 3 * g.h);
    }
    store_rows(dq, g.s, hd, dqkv, rows_of(0, 0), 3 * g.h);
}

/// The backward's row passes over one tile: the scores `p` become the dropped probabilities
/// `pd`, `dO·Vᵀ` in `ds` becomes `dS / scale` (the scale is folded into the GEMMs that read
/// it), both zero past the keys a row sees; `lse` and `dr` are the tile rows'. Compiled with
/// AVX2 and FMA where the CPU has them, as [`softmax_rows`].
#[allow(clippy::too_many_arguments)]
fn grad_rows(
    g: &Geometry,
    tile: TileRows,
    p: &mut [f32],
    ds: &mut [f32],
    lse: &[f32],
    dr: &[f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled with.
        return unsafe { grad_rows_v3(g, tile, p, ds, lse, dr, dropout, mul) };
    }
    grad_rows_body::<false>(g, tile, p, ds, lse, dr, dropout, mul)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn grad_rows_v3(
    g: &Geometry,
    tile: TileRows,
    p: &mut [f32],
    ds: &mut [f32],
    lse: &[f32],
    dr: &[f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    grad_rows_body::<true>(g, tile, p, ds, lse, dr, dropout, mul)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn grad_rows_body<const FMA: bool>(
    g: &Geometry,
    tile: TileRows,
    p: &mut [f32],
    ds: &mut [f32],
    lse: &[f32],
    dr: &[f32],
    dropout: Option<FlashDropout>,
    mul: &mut [f32],
) {
    let (tk, kn) = (g.tk, tile.kn);
    let masked = tile.masked(g);
    for r in 0..tile.qn {
        let jn = if masked { tile.visible(g, r) } else { kn };
        let (li, di) = (lse[r], dr[r]);
        let row = r * tk..r * tk + kn;
        let (pr, dsr) = (&mut p[row.clone()], &mut ds[row]);
        let (pv, dv) = (&mut pr[..jn], &mut dsr[..jn]);
        if dropout.is_some() {
            dropout_row(dropout, tile.stream(g, r), &mut mul[..jn]);
            for ((pc, dc), mu) in pv.iter_mut().zip(dv.iter_mut()).zip(&mul[..jn]) {
                let e = exp_with::<FMA>(*pc - li);
                *pc = e * mu;
                *dc = e * (*dc * mu - di);
            }
        } else {
            for (pc, dc) in pv.iter_mut().zip(dv.iter_mut()) {
                let e = exp_with::<FMA>(*pc - li);
                *pc = e;
                *dc = e * (*dc - di);
            }
        }
        pr[jn..].fill(0.0);
        dsr[jn..].fill(0.0);
    }
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
