//! Counter-based random numbers (Philox4x32-10) and the layers that draw them: dropout and the
//! VAE's `sample_normal` (reparameterisation). Randomness is a pure function of its key, so a
//! recomputed (checkpointed) forward and a backward regenerate exactly the same numbers, and a
//! CUDA kernel implementing the same integer arithmetic produces the same bits.
//!
//! # Philox4x32-10
//!
//! Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11), as in Random123:
//! a 128-bit counter `[c0, c1, c2, c3]` and a 64-bit key `[k0, k1]`, 10 rounds of
//!
//! ```text
//! (hi0, lo0) = mulhilo32(0xD2511F53, c0)     (hi1, lo1) = mulhilo32(0xCD9E8D57, c2)
//! [c0, c1, c2, c3] = [hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0]
//! ```
//!
//! with the key bumped by the Weyl constants `(0x9E3779B9, 0xBB67AE85)` (wrapping) between
//! rounds. All arithmetic is u32 wrapping multiply / xor / add: identical on any CPU and on
//! CUDA (`__umulhi`). Verified against Random123's published known-answer vectors (tests).
//!
//! # Stream layout (what a CUDA port must reproduce)
//!
//! A [`RngKey`] `{ seed: u64, layer: u32, step: u64 }` and an element index `i` map to
//!
//! ```text
//! key     = [seed as u32, (seed >> 32) as u32]
//! counter = [(i / 4) as u32, step as u32, (step >> 32) as u32, layer]
//! word    = philox4x32_10(counter, key)[i % 4]
//! ```
//!
//! so every (seed, layer, step, element) tuple owns a distinct 32-bit word (element indices up
//! to 2^34 per tensor per step). Words become floats by [`unit_f32`]: the top 24 bits times
//! 2^-24, exact in f32, so uniforms are bit-identical everywhere.
//!
//! Normals use Box–Muller on the word pairs `(0,1)` and `(2,3)` of a block: element `i` with
//! `i % 4 ∈ {0,1}` takes `r·cos θ`/`r·sin θ` from words 0 and 1, `{2,3}` from words 2 and 3,
//! `r = sqrt(−2 ln u1)` with `u1 ∈ (0, 1]` and `θ = 2π u2`. Transcendentals come from the pure
//! Rust `libm` crate so CPU results do not depend on the platform's C library; a CUDA port
//! (`logf`/`sincosf`) matches to a few ulp, not bit for bit, which is fine because a tensor's
//! forward and backward always run on the same device.

use rayon::prelude::*;

use crate::elementwise::{same_len, zip3_chunks, zip_chunks, GradWrite, PAR_CHUNK, PAR_MIN};
use crate::{Element, KResult, KernelError};

/// Philox4x32 round multipliers.
pub const PHILOX_M0: u32 = 0xD251_1F53;
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Philox4x32 key schedule (Weyl) increments.
pub const PHILOX_W0: u32 = 0x9E37_79B9;
pub const PHILOX_W1: u32 = 0xBB67_AE85;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// One Philox4x32-10 block: 4 random words from a 128-bit counter and a 64-bit key.
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(PHILOX_W0);
            k1 = k1.wrapping_add(PHILOX_W1);
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, c0);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// A word to a float in `[0, 1)`: `(w >> 8) · 2^-24`, exact in f32.
#[inline(always)]
pub fn unit_f32(w: u32) -> f32 {
    (w >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// A word to a float in `(0, 1]` (Box–Muller's radius input must not be 0).
#[inline(always)]
fn unit_f32_open0(w: u32) -> f32 {
    ((w >> 8) + 1) as f32 * (1.0 / 16_777_216.0)
}

/// Box–Muller on two words: two independent standard normals.
#[inline]
pub fn box_muller(w1: u32, w2: u32) -> (f32, f32) {
    let r = libm::sqrtf(-2.0 * libm::logf(unit_f32_open0(w1)));
    let theta = 2.0 * std::f32::consts::PI * unit_f32(w2);
    (r * libm::cosf(theta), r * libm::sinf(theta))
}

#[inline(always)]
fn split64(v: u64) -> [u32; 2] {
    [v as u32, (v >> 32) as u32]
}

/// Uniform in `[0, 1)` from a 64-bit key and a 64-bit counter: word 0 of
/// `philox4x32_10([counter lo, counter hi, 0, 0], [key lo, key hi])`.
pub fn uniform(key: u64, counter: u64) -> f32 {
    let [c0, c1] = split64(counter);
    unit_f32(philox4x32_10([c0, c1, 0, 0], split64(key))[0])
}

/// Standard normal from a 64-bit key and counter (Box–Muller on words 0 and 1, cosine branch).
pub fn normal(key: u64, counter: u64) -> f32 {
    let [c0, c1] = split64(counter);
    let w = philox4x32_10([c0, c1, 0, 0], split64(key));
    box_muller(w[0], w[1]).0
}

/// Identity of one random stream: the run's seed, the layer that draws (a planner-assigned
/// id), and the training step. See the module docs for the exact counter layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RngKey {
    pub seed: u64,
    pub layer: u32,
    pub step: u64,
    /// The stream's block 0 is the counter's block `first_block`: a data-parallel replica
    /// `r` whose tensor has `n` elements draws from `r · ⌈n/4⌉` on, so the replicas' streams
    /// are disjoint and, when `n` is a multiple of 4, together the one device's stream of the
    /// whole batch (0 on one device).
    pub first_block: u32,
}

/// Most elements one stream can address (2^32 blocks of 4 words).
pub const MAX_STREAM_ELEMENTS: u64 = 1 << 34;

impl RngKey {
    /// The 4 words of block `block` of this stream.
    #[inline(always)]
    pub fn block(&self, block: u32) -> [u32; 4] {
        let [s0, s1] = split64(self.step);
        philox4x32_10(
            [block.wrapping_add(self.first_block), s0, s1, self.layer],
            split64(self.seed),
        )
    }

    /// Uniform `[0, 1)` for element `i`.
    pub fn uniform_at(&self, i: u64) -> f32 {
        unit_f32(self.block((i / 4) as u32)[(i % 4) as usize])
    }

    /// Standard normal for element `i`.
    pub fn normal_at(&self, i: u64) -> f32 {
        normals_of(self.block((i / 4) as u32))[(i % 4) as usize]
    }

    fn check(&self, op: &str, len: usize) -> KResult {
        if len as u64 > MAX_STREAM_ELEMENTS {
            Err(KernelError(format!(
                "{op}: {len} elements exceed one random stream's 2^34"
            )))
        } else {
            Ok(())
        }
    }

    /// Walks `out` (whose element 0 is stream element `first`, a multiple of 4) block by block:
    /// `f(i, out_block, values)` with `out_block = out[i − first ..][..≤4]` and
    /// `values = map(block words)`. One closure call per block of 4 (not per element) keeps
    /// the per-element work inside one inlined loop; profiling showed per-element closure
    /// calls cost several times the Philox block itself.
    #[inline(always)]
    fn walk<D, V: Copy>(
        &self,
        first: usize,
        out: &mut [D],
        map: impl Fn([u32; 4]) -> [V; 4],
        mut f: impl FnMut(usize, &mut [D], [V; 4]),
    ) {
        let b0 = first / 4;
        for (k, c) in out.chunks_mut(4).enumerate() {
            let b = b0 + k;
            f(4 * b, c, map(self.block(b as u32)));
        }
    }

    /// Calls `f(first, out_part)` over `out` in 4-aligned parallel chunks; `first` is the stream
    /// element index of `out_part[0]` (a multiple of 4).
    fn for_each_block<D: Send>(
        &self,
        out: &mut [D],
        f: impl Fn(&RngKey, usize, &mut [D]) + Sync + Send,
    ) {
        // PAR_CHUNK is a multiple of 4, so every chunk starts on a block boundary.
        const _: () = assert!(PAR_CHUNK.is_multiple_of(4));
        if out.len() >= PAR_MIN {
            out.par_chunks_mut(PAR_CHUNK)
                .enumerate()
                .for_each(|(k, c)| f(self, k * PAR_CHUNK, c));
        } else {
            f(self, 0, out);
        }
    }
}

#[inline]
fn normals_of(w: [u32; 4]) -> [f32; 4] {
    let (a, b) = box_muller(w[0], w[1]);
    let (c, d) = box_muller(w[2], w[3]);
    [a, b, c, d]
}

// ---------------------------------------------------------------------------------------------
// dropout
// ---------------------------------------------------------------------------------------------

fn check_rate(op: &str, rate: f32) -> KResult {
    if (0.0..1.0).contains(&rate) {
        Ok(())
    } else {
        Err(KernelError(format!(
            "{op}: dropout rate {rate} must be in [0, 1)"
        )))
    }
}

/// Fills `mask` (1 keep / 0 drop) for stream `key`: element `i` is kept when its uniform is
/// `>= rate`, so the keep probability is `1 − rate` (to 2^-24). The forward draws the same bits;
/// this rebuilds a mask alone (e.g. a recompute that needs only the mask).
pub fn dropout_mask(key: RngKey, rate: f32, mask: &mut [u8]) -> KResult {
    check_rate("dropout_mask", rate)?;
    key.check("dropout_mask", mask.len())?;
    fill_mask(key, rate, mask);
    Ok(())
}

fn fill_mask(key: RngKey, rate: f32, mask: &mut [u8]) {
    key.for_each_block(mask, |k, first, part| {
        k.walk(
            first,
            part,
            |w| w,
            |_, m4, w| {
                for (m, wi) in m4.iter_mut().zip(w) {
                    *m = (unit_f32(wi) >= rate) as u8;
                }
            },
        );
    });
}

/// Dropout forward (training): writes `mask` and `y = x · mask · scale` with
/// `scale = 1 / (1 − rate)` rounded to f32 once (as `tf.nn.dropout`, which Keras's TF backend
/// calls, and PyTorch do). The mask is a pure function of `(key, index)`; mask and output are
/// produced in one pass.
pub fn dropout_forward<T: Element>(
    key: RngKey,
    rate: f32,
    x: &[T],
    y: &mut [T],
    mask: &mut [u8],
) -> KResult {
    let op = "dropout_forward";
    check_rate(op, rate)?;
    same_len(op, "x", x.len(), "y", y.len())?;
    same_len(op, "x", x.len(), "mask", mask.len())?;
    key.check(op, x.len())?;
    dropout_fused(key, rate, Some(x), y, mask);
    Ok(())
}

/// [`dropout_forward`] writing `y` over `x`.
pub fn dropout_forward_inplace<T: Element>(
    key: RngKey,
    rate: f32,
    x_y: &mut [T],
    mask: &mut [u8],
) -> KResult {
    let op = "dropout_forward_inplace";
    check_rate(op, rate)?;
    same_len(op, "x", x_y.len(), "mask", mask.len())?;
    key.check(op, x_y.len())?;
    dropout_fused(key, rate, None, x_y, mask);
    Ok(())
}

/// Dropout backward from the saved mask: `dx = dy · mask · scale` (overwritten), the same
/// `scale = 1 / (1 − rate)` as the forward.
pub fn dropout_backward<T: Element>(rate: f32, mask: &[u8], dy: &[T], dx: &mut [T]) -> KResult {
    let op = "dropout_backward";
    check_rate(op, rate)?;
    same_len(op, "dy", dy.len(), "dx", dx.len())?;
    same_len(op, "dy", dy.len(), "mask", mask.len())?;
    apply_mask(dy, mask, dx, 1.0 / (1.0 - rate));
    Ok(())
}

/// [`dropout_backward`] writing `dx` over `dy`.
pub fn dropout_backward_inplace<T: Element>(rate: f32, mask: &[u8], dy_dx: &mut [T]) -> KResult {
    let op = "dropout_backward_inplace";
    check_rate(op, rate)?;
    same_len(op, "dy", dy_dx.len(), "mask", mask.len())?;
    apply_mask_inplace(mask, dy_dx, 1.0 / (1.0 - rate));
    Ok(())
}

/// One pass: draws the mask and writes `y = x · mask / (1 − rate)`; `src` is `None` when `y`
/// holds `x`. Chunks start on 4-element block boundaries, so the split does not change a bit.
fn dropout_fused<T: Element>(
    key: RngKey,
    rate: f32,
    src: Option<&[T]>,
    y: &mut [T],
    mask: &mut [u8],
) {
    let scale = 1.0 / (1.0 - rate);
    let body = |first: usize, y: &mut [T], m: &mut [u8]| {
        key.walk(
            first,
            y,
            |w| w,
            |base, y4, w| {
                let m4 = &mut m[base - first..];
                for (j, (yo, wi)) in y4.iter_mut().zip(w).enumerate() {
                    let kept = unit_f32(wi) >= rate;
                    let xv = match src {
                        Some(x) => x[base + j],
                        None => *yo,
                    }
                    .to_f32();
                    m4[j] = kept as u8;
                    // Select rather than branch: the mask is a coin flip per element.
                    *yo = T::from_f32(if kept { xv * scale } else { 0.0 });
                }
            },
        );
    };
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(PAR_CHUNK)
            .zip(mask.par_chunks_mut(PAR_CHUNK))
            .enumerate()
            .for_each(|(k, (y, m))| body(k * PAR_CHUNK, y, m));
    } else {
        body(0, y, mask);
    }
}

/// `dst = src · mask · scale`.
fn apply_mask<T: Element>(src: &[T], mask: &[u8], dst: &mut [T], scale: f32) {
    zip3_chunks(src, mask, dst, |s, m, d| {
        for ((o, v), &mi) in d.iter_mut().zip(s).zip(m) {
            *o = T::from_f32(if mi != 0 { v.to_f32() * scale } else { 0.0 });
        }
    });
}

/// `v = v · mask · scale`.
fn apply_mask_inplace<T: Element>(mask: &[u8], v: &mut [T], scale: f32) {
    zip_chunks(mask, v, |m, v| {
        for (o, &mi) in v.iter_mut().zip(m) {
            *o = T::from_f32(if mi != 0 { o.to_f32() * scale } else { 0.0 });
        }
    });
}

// ---------------------------------------------------------------------------------------------
// sample_normal (VAE reparameterisation)
// ---------------------------------------------------------------------------------------------

/// Fills `eps`-dependent outputs: `f(first, eps4, out_part)` style loop over normals.
fn for_each_normal<D: Send>(
    key: RngKey,
    out: &mut [D],
    f: impl Fn(usize, f32, &mut D) + Sync + Send,
) {
    key.for_each_block(out, |k, first, part| {
        k.walk(first, part, normals_of, |base, o4, eps| {
            for (j, (o, e)) in o4.iter_mut().zip(eps).enumerate() {
                f(base + j, e, o);
            }
        });
    });
}

/// VAE sampling forward: `z = mean + exp(0.5·logvar) · eps`, `eps ~ N(0, 1)` drawn from
/// stream `key` (element `i` of `z` uses [`RngKey::normal_at`]`(i)`). Saves nothing: the
/// backward regenerates `eps` from the same key.
pub fn sample_normal_forward<T: Element>(
    key: RngKey,
    mean: &[T],
    logvar: &[T],
    z: &mut [T],
) -> KResult {
    let op = "sample_normal_forward";
    same_len(op, "mean", mean.len(), "z", z.len())?;
    same_len(op, "logvar", logvar.len(), "z", z.len())?;
    key.check(op, z.len())?;
    for_each_normal(key, z, |i, eps, zo| {
        let lv = logvar[i].to_f32();
        *zo = T::from_f32(mean[i].to_f32() + (0.5 * lv).exp() * eps);
    });
    Ok(())
}

/// VAE sampling backward; reads only `logvar` (and regenerates `eps` from `key`):
/// `dmean = dz`, `dlogvar = dz · 0.5 · exp(0.5·logvar) · eps`. `write` says whether they
/// overwrite or add to the buffers (the KL loss usually wrote its share there first).
pub fn sample_normal_backward<T: Element>(
    key: RngKey,
    logvar: &[T],
    dz: &[T],
    dmean: &mut [T],
    dlogvar: &mut [T],
    write: GradWrite,
) -> KResult {
    let op = "sample_normal_backward";
    same_len(op, "logvar", logvar.len(), "dz", dz.len())?;
    same_len(op, "dmean", dmean.len(), "dz", dz.len())?;
    same_len(op, "dlogvar", dlogvar.len(), "dz", dz.len())?;
    key.check(op, dz.len())?;
    for_each_normal(key, dlogvar, |i, eps, o| {
        let g = dz[i].to_f32();
        write.store(o, g * 0.5 * (0.5 * logvar[i].to_f32()).exp() * eps);
    });
    match write {
        GradWrite::Overwrite => crate::elementwise::map1(dz, dmean, |g| g),
        GradWrite::Accumulate => crate::elementwise::map2_inplace(dz, dmean, |g, d| d + g),
    }
    Ok(())
}
