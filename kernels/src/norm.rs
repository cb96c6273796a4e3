//! Normalisation layers: batch norm over NHWC (training with batch statistics and running-stat
//! update, inference from running stats, backward), layer norm over the last axis, and group
//! norm with its one-group uncentred case, RMS norm ([`GroupNormDims`], at the end).
//!
//! Both see their input as a `[rows, channels]` matrix ([`NormDims`]): batch norm reduces over
//! `rows = n·h·w` per channel, layer norm over `channels` per row.
//!
//! Saved for backward: batch norm keeps `x_hat` (storage type `T`) and `inv_std` (f32 `[c]`),
//! or, where the input is kept for another op anyway, the input and its hi/lo `mean`, from
//! which [`batch_norm_backward_rebuild`] rebuilds `x_hat`; layer norm keeps `x_hat` (`T`) and
//! `rstd` (f32 `[rows]`), or the input and `rstd`, from which
//! [`layer_norm_backward_rebuild`] recomputes each row's mean and rebuilds `x_hat`. Neither needs `x` in its forward's output, so the forwards
//! have `*_inplace` variants that write `y` over `x`, and the backwards have `*_inplace`
//! variants that write `dx` over `dy`. `dx` is overwritten; `dgamma`/`dbeta` (f32 master
//! gradients) are ACCUMULATED (`+=`).
//!
//! Statistics are accumulated in f64 over a fixed split of the rows (see
//! `elementwise::reduce_rows`), so results do not depend on the thread count.
//!
//! Keras semantics: `y = gamma · (x − mean) / sqrt(var + epsilon) + beta` with the *biased*
//! (population, divide by N) batch variance, which is what Keras 3 `BatchNormalization` uses
//! both to normalise and to update `moving_variance` (`ops.moments`). PyTorch, and tf.keras
//! 2.x's fused kernel, store the unbiased (N − 1) variance in the running stat instead; we
//! follow Keras 3. Running update: `running = running · momentum + batch · (1 − momentum)`,
//! defaults `momentum = 0.99`, `epsilon = 1e-3`. Layer norm's Keras default epsilon is 1e-3.

// Channel loops index several parallel arrays (x, x_hat, gamma, beta, sums) by one channel
// number; iterator zips of five slices read worse than the index.
#![allow(clippy::needless_range_loop)]

use crate::elementwise::{
    add_lanes, need, reduce_rows, rows, rows3, sum_in_lanes, wide_loop, PAR_MIN,
};
use crate::gemm::is_f32;
use crate::{Element, KResult, KernelError};
use rayon::prelude::*;

/// A normalisation input seen as `[rows, channels]` (row-major; NHWC flattens to
/// `rows = n·h·w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormDims {
    pub rows: usize,
    pub channels: usize,
}

impl NormDims {
    /// `rows · channels`, saturating (absurd dims then fail every length check).
    pub fn len(&self) -> usize {
        self.rows.saturating_mul(self.channels)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Batch-norm hyper-parameters; [`BatchNormConfig::KERAS`] holds Keras's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNormConfig {
    pub epsilon: f32,
    pub momentum: f32,
}

impl BatchNormConfig {
    /// Keras `BatchNormalization()` defaults: epsilon 1e-3, momentum 0.99.
    pub const KERAS: BatchNormConfig = BatchNormConfig {
        epsilon: 1e-3,
        momentum: 0.99,
    };
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        Self::KERAS
    }
}

/// Keras `LayerNormalization()` default epsilon.
pub const LAYER_NORM_EPSILON: f32 = 1e-3;

/// The learned scale and shift, f32 `[channels]` (Keras keeps them f32 under mixed precision).
#[derive(Debug, Clone, Copy)]
pub struct Affine<'a> {
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
}

/// Parameter gradients, f32 `[channels]`, ACCUMULATED (`+=`).
#[derive(Debug)]
pub struct AffineGrads<'a> {
    pub dgamma: &'a mut [f32],
    pub dbeta: &'a mut [f32],
}

/// What batch-norm training forward saves for backward.
#[derive(Debug)]
pub struct BatchNormSaved<'a, T> {
    /// `(x − mean) · inv_std`, `[rows, channels]`.
    pub x_hat: &'a mut [T],
    /// Batch mean as an f32 hi/lo pair, `[2, channels]` (hi then lo): what
    /// [`batch_norm_backward_rebuild`] rebuilds `x_hat` with.
    pub mean: &'a mut [f32],
    /// `1 / sqrt(var + epsilon)`, `[channels]`.
    pub inv_std: &'a mut [f32],
}

/// Moving statistics, f32 `[channels]`.
#[derive(Debug)]
pub struct RunningStats<'a> {
    pub mean: &'a mut [f32],
    pub var: &'a mut [f32],
}

fn check_affine(op: &str, c: usize, a: &Affine) -> KResult {
    need(op, "gamma", a.gamma.len(), c)?;
    need(op, "beta", a.beta.len(), c)
}

fn check_grads(op: &str, c: usize, g: &AffineGrads) -> KResult {
    need(op, "dgamma", g.dgamma.len(), c)?;
    need(op, "dbeta", g.dbeta.len(), c)
}

/// Per-channel f64 sums over all rows of `x`'s channel block `[c0, c0 + cb)` (`cb ≤
/// ROW_CB`): of `x`, or with `mean`, of `(x − mean)²`. Deterministic split (see
/// `reduce_rows`); each part adds its rows in order ([`add_moment_rows`]).
fn channel_moment<T: Element>(
    d: NormDims,
    c0: usize,
    cb: usize,
    x: &[T],
    mean: Option<&[f64; ROW_CB]>,
) -> [f64; ROW_CB] {
    let c = d.channels;
    let mean = mean.map(|m| &m[..cb]);
    reduce_rows(
        d.rows,
        cb,
        |first, end| {
            let mut s = Moments([0f64; ROW_CB]);
            add_moment_rows(x, first..end, c, c0, mean, &mut s.0[..cb]);
            s
        },
        |mut a, b| {
            a.0.iter_mut().zip(b.0).for_each(|(a, b)| *a += b);
            a
        },
    )
    .0
}

/// One part's per-channel sums of [`channel_moment`].
#[derive(Clone, Copy)]
struct Moments([f64; ROW_CB]);

impl Default for Moments {
    fn default() -> Self {
        Moments([0.0; ROW_CB])
    }
}

wide_loop! {
    /// [`channel_moment`]'s terms of rows `rows`, channels `c0..c0 + acc.len()` of `c`-channel
    /// rows, added row after row: `x`, or `(x − mean)²` in f64. Compiled for AVX2 (a fifth
    /// faster on the convnet's batch norms on an AMD EPYC with AVX2 alone), not for AVX-512:
    /// a wide build measured slower on the AMD EPYC with AVX-512 (docs/BENCHMARKS.md). Each
    /// lane adds what the scalar loop adds, so the bits are the same on any CPU.
    fn add_moment_rows<T: Element>(
        x: &[T],
        rows: std::ops::Range<usize>,
        c: usize,
        c0: usize,
        mean: Option<&[f64]>,
        acc: &mut [f64]
    ) wide if true, avx512 if false, {
        let n = acc.len();
        for r in rows {
            let row = &x[r * c + c0..][..n];
            match mean {
                None => {
                    for (a, v) in acc.iter_mut().zip(row) {
                        *a += v.to_f32() as f64;
                    }
                }
                Some(mu) => {
                    for ((a, v), m) in acc.iter_mut().zip(row).zip(&mu[..n]) {
                        let t = v.to_f32() as f64 - m;
                        *a += t * t;
                    }
                }
            }
        }
    }
}

/// Channels per pass over the rows of a `[rows, channels]` norm (its statistics, its affine
/// gradients, batch norm's passes), with f64 accumulators on the stack: the layout puts a
/// row's channels side by side, so a block as wide as the whole row (up to this many) reads
/// every row once, where narrower blocks would re-read each row once per block.
const ROW_CB: usize = 128;

/// One part's `[Σ dy, Σ dy·x̂]` per channel of a block ([`add_affine_grads`]).
#[derive(Clone, Copy)]
struct RowBlockSums([[f64; ROW_CB]; 2]);

impl Default for RowBlockSums {
    fn default() -> Self {
        RowBlockSums([[0.0; ROW_CB]; 2])
    }
}

/// The affine gradients of a norm over the last axis of `[rows, channels]`, accumulated:
/// `dbeta[ch] += Σ_rows dy`, `dgamma[ch] += Σ_rows dy·x̂`, summed in f64 over the fixed
/// split of [`reduce_rows`] (so independent of the thread count). `hat_row(r)` is row `r`
/// of x̂.
fn add_affine_grads<T: Element, H: HatRow>(
    d: NormDims,
    dy: &[T],
    hat_row: impl Fn(usize) -> H + Sync + Send,
    dgamma: &mut [f32],
    mut dbeta: Option<&mut [f32]>,
) {
    let c = d.channels;
    for c0 in (0..c).step_by(ROW_CB) {
        let cb = ROW_CB.min(c - c0);
        let s = affine_sums(d, dy, &hat_row, c0, cb);
        for j in 0..cb {
            if let Some(b) = dbeta.as_deref_mut() {
                b[c0 + j] += s[0][j] as f32;
            }
            dgamma[c0 + j] += s[1][j] as f32;
        }
    }
}

/// `[Σ dy, Σ dy·x̂]` over the rows of channels `c0..c0 + cb` (`cb ≤ ROW_CB`), in f64 over the
/// fixed split of [`reduce_rows`]: each part adds its rows in order, the parts are added left
/// to right.
fn affine_sums<T: Element, H: HatRow>(
    d: NormDims,
    dy: &[T],
    hat_row: impl Fn(usize) -> H + Sync + Send,
    c0: usize,
    cb: usize,
) -> [[f64; ROW_CB]; 2] {
    let c = d.channels;
    reduce_rows(
        d.rows,
        cb,
        |first, end| {
            let mut s = RowBlockSums::default();
            let [sum, sum_hat] = &mut s.0;
            let (sum, sum_hat) = (&mut sum[..cb], &mut sum_hat[..cb]);
            add_affine_rows(dy, &hat_row, first..end, c, c0, sum, sum_hat);
            s
        },
        |mut a, b| {
            for k in 0..2 {
                for j in 0..ROW_CB {
                    a.0[k][j] += b.0[k][j];
                }
            }
            a
        },
    )
    .0
}

wide_loop! {
    /// The terms of [`affine_sums`] of rows `rows`, channels `c0..c0 + sum.len()` of
    /// `c`-channel rows: `sum += dy`, `sum_hat += dy·x̂` in f64, row after row. Many rows per
    /// call, so short rows (a batch norm's few channels) do not pay a call each.
    fn add_affine_rows<T: Element, H: HatRow, F: Fn(usize) -> H>(
        dy: &[T],
        hat_row: &F,
        rows: std::ops::Range<usize>,
        c: usize,
        c0: usize,
        sum: &mut [f64],
        sum_hat: &mut [f64]
    ) wide if is_f32::<T>(), {
        let n = sum.len();
        let sum_hat = &mut sum_hat[..n];
        for r in rows {
            let (dyr, hat) = (&dy[r * c + c0..][..n], hat_row(r).narrow(c0, n));
            for j in 0..n {
                let gv = dyr[j].to_f32() as f64;
                sum[j] += gv;
                sum_hat[j] += gv * hat.at(j) as f64;
            }
        }
    }
}

/// One row of x̂ as a norm's backward reads it — kept from the forward ([`SavedHatRow`]) or
/// rebuilt from the input ([`RebuiltHatRow`]) — a type of its own whose reads are
/// `#[inline(always)]`, so that the loops over it vectorise ([`wide_loop`]).
trait HatRow: Copy + Send + Sync {
    /// x̂ of channel `ch` of the row.
    fn at(self, ch: usize) -> f32;
    /// Channels `c0..c0 + n` of the row, as a row of their own.
    fn narrow(self, c0: usize, n: usize) -> Self;
    /// x̂ of channels `base..base + 8`.
    #[inline(always)]
    fn lanes(self, base: usize) -> [f32; 8] {
        let row = self.narrow(base, 8);
        std::array::from_fn(|j| row.at(j))
    }
}

/// A row of the x̂ the forward saved.
#[derive(Clone, Copy)]
struct SavedHatRow<'a, T>(&'a [T]);

impl<T: Element> HatRow for SavedHatRow<'_, T> {
    #[inline(always)]
    fn at(self, ch: usize) -> f32 {
        self.0[ch].to_f32()
    }
    #[inline(always)]
    fn narrow(self, c0: usize, n: usize) -> Self {
        SavedHatRow(&self.0[c0..c0 + n])
    }
}

/// A row of x̂ rebuilt from the input as the forward made it: `(x − mean)·rstd` rounded to `T`.
#[derive(Clone, Copy)]
struct RebuiltHatRow<'a, T> {
    x: &'a [T],
    mean: f32,
    rstd: f32,
}

impl<T: Element> HatRow for RebuiltHatRow<'_, T> {
    #[inline(always)]
    fn at(self, ch: usize) -> f32 {
        T::from_f32((self.x[ch].to_f32() - self.mean) * self.rstd).to_f32()
    }
    #[inline(always)]
    fn narrow(self, c0: usize, n: usize) -> Self {
        RebuiltHatRow {
            x: &self.x[c0..c0 + n],
            ..self
        }
    }
}

/// Eight consecutive elements of `s` from `base`, in f32.
#[inline(always)]
fn load8<T: Element>(s: &[T], base: usize) -> [f32; 8] {
    let s = &s[base..base + 8];
    std::array::from_fn(|j| s[j].to_f32())
}

// ---------------------------------------------------------------------------------------------
// batch norm
// ---------------------------------------------------------------------------------------------

/// Training forward, one block of channels at a time: statistics (two f64 passes), then
/// that block's `x_hat` and `y`. `src` is `None` when `y` holds `x` (in place): a block's
/// channels are only overwritten after its own statistics are taken.
///
/// The mean is applied as an f32 hi/lo pair (`x − hi − lo`): when |mean| ≫ std (inputs with a
/// large offset), subtracting a single rounded f32 mean would leave every `x_hat` shifted by
/// up to half an ulp of the mean times `inv_std`, and the batch's `x_hat` would not sum to 0.
#[allow(clippy::too_many_arguments)]
fn bn_train_core<T: Element>(
    d: NormDims,
    cfg: BatchNormConfig,
    src: Option<&[T]>,
    y: &mut [T],
    affine: &Affine,
    saved: BatchNormSaved<T>,
    mut running: Option<RunningStats>,
) {
    let c = d.channels;
    let m = d.rows as f64;
    for c0 in (0..c).step_by(ROW_CB) {
        let cb = ROW_CB.min(c - c0);
        let mut stats = BnStats {
            hi: [0.0; ROW_CB],
            lo: [0.0; ROW_CB],
            inv: [0.0; ROW_CB],
            gamma: &affine.gamma[c0..c0 + cb],
            beta: &affine.beta[c0..c0 + cb],
        };
        {
            let x: &[T] = match src {
                Some(x) => x,
                None => y,
            };
            let s = channel_moment(d, c0, cb, x, None);
            let mu: [f64; ROW_CB] = std::array::from_fn(|j| s[j] / m);
            // Second pass around the mean: no cancellation, unlike E[x²] − E[x]².
            let v = channel_moment(d, c0, cb, x, Some(&mu));
            for j in 0..cb {
                let ch = c0 + j;
                let var = v[j] / m;
                stats.hi[j] = mu[j] as f32;
                stats.lo[j] = (mu[j] - stats.hi[j] as f64) as f32;
                stats.inv[j] = (1.0 / (var + cfg.epsilon as f64).sqrt()) as f32;
                saved.mean[ch] = stats.hi[j];
                saved.mean[c + ch] = stats.lo[j];
                saved.inv_std[ch] = stats.inv[j];
                let k = cfg.momentum;
                if let Some(run) = running.as_mut() {
                    run.mean[ch] = run.mean[ch] * k + mu[j] as f32 * (1.0 - k);
                    run.var[ch] = run.var[ch] * k + var as f32 * (1.0 - k);
                }
            }
        }
        let group = BN_TASK_ELEMS.div_ceil(c);
        let (ys, hats) = (&mut y[..d.len()], &mut saved.x_hat[..d.len()]);
        let task = |(k, (ys, hats)): (usize, (&mut [T], &mut [T]))| {
            bn_normalise_rows(src, k * group, ys, hats, c, c0, &stats);
        };
        if d.len() >= PAR_MIN {
            let tasks = ys
                .par_chunks_mut(group * c)
                .zip(hats.par_chunks_mut(group * c));
            tasks.enumerate().for_each(task);
        } else {
            let tasks = ys.chunks_mut(group * c).zip(hats.chunks_mut(group * c));
            tasks.enumerate().for_each(task);
        }
    }
}

/// A channel block's statistics and affine parameters for [`bn_normalise_rows`]: the mean as
/// an f32 hi/lo pair, `1/σ`, `γ` and `β` (the last two as long as the block).
struct BnStats<'a> {
    hi: [f32; ROW_CB],
    lo: [f32; ROW_CB],
    inv: [f32; ROW_CB],
    gamma: &'a [f32],
    beta: &'a [f32],
}

wide_loop! {
    /// [`bn_train_core`]'s last pass over the `c`-channel rows in `ys`, `hats` (row `first`
    /// onwards), channels `c0..c0 + stats.gamma.len()`: `x̂ = (x − hi − lo)·inv` and
    /// `y = γ·x̂ + β`, each rounded to `T`; `x` from `src` or, in place, `ys`.
    fn bn_normalise_rows<T: Element>(
        src: Option<&[T]>,
        first: usize,
        ys: &mut [T],
        hats: &mut [T],
        c: usize,
        c0: usize,
        stats: &BnStats<'_>
    ) wide if is_f32::<T>(), {
        let n = stats.gamma.len();
        let (hi, lo, inv) = (&stats.hi[..n], &stats.lo[..n], &stats.inv[..n]);
        let (g, b) = (&stats.gamma[..n], &stats.beta[..n]);
        let rows = ys.chunks_exact_mut(c).zip(hats.chunks_exact_mut(c));
        for (i, (yr, hr)) in rows.enumerate() {
            let (yb, hb) = (&mut yr[c0..c0 + n], &mut hr[c0..c0 + n]);
            let normalise = |xv: T, j: usize| {
                let v = (xv.to_f32() - hi[j] - lo[j]) * inv[j];
                (T::from_f32(v), T::from_f32(g[j] * v + b[j]))
            };
            match src {
                Some(x) => {
                    let xb = &x[(first + i) * c + c0..][..n];
                    for j in 0..n {
                        (hb[j], yb[j]) = normalise(xb[j], j);
                    }
                }
                None => {
                    for j in 0..n {
                        (hb[j], yb[j]) = normalise(yb[j], j);
                    }
                }
            }
        }
    }
}

fn bn_train_check<T>(
    op: &str,
    d: NormDims,
    x_len: usize,
    y_len: usize,
    affine: &Affine,
    saved: &BatchNormSaved<T>,
    running: &Option<RunningStats>,
) -> KResult {
    let c = d.channels;
    need(op, "x", x_len, d.len())?;
    need(op, "y", y_len, d.len())?;
    need(op, "x_hat", saved.x_hat.len(), d.len())?;
    need(op, "mean", saved.mean.len(), 2 * c)?;
    need(op, "inv_std", saved.inv_std.len(), c)?;
    if let Some(run) = running {
        need(op, "running mean", run.mean.len(), c)?;
        need(op, "running var", run.var.len(), c)?;
    }
    check_affine(op, c, affine)?;
    if d.rows == 0 {
        return Err(KernelError(format!(
            "{op}: batch statistics over 0 rows are undefined"
        )));
    }
    Ok(())
}

/// Batch-norm training forward: normalises with this batch's per-channel statistics, writes
/// `y` and the saved tensors, and updates `running` (Keras rule, biased variance).
///
/// Pass `running: None` when the planner *recomputes* this forward (a `#[checkpoint]`
/// segment): the batch statistics are the same, but the moving averages must be updated
/// once per step, not once per evaluation.
pub fn batch_norm_train_forward<T: Element>(
    d: NormDims,
    cfg: BatchNormConfig,
    x: &[T],
    affine: Affine,
    y: &mut [T],
    saved: BatchNormSaved<T>,
    running: Option<RunningStats>,
) -> KResult {
    let op = "batch_norm_train_forward";
    bn_train_check(op, d, x.len(), y.len(), &affine, &saved, &running)?;
    bn_train_core(d, cfg, Some(x), y, &affine, saved, running);
    Ok(())
}

/// [`batch_norm_train_forward`] writing `y` over `x`.
pub fn batch_norm_train_forward_inplace<T: Element>(
    d: NormDims,
    cfg: BatchNormConfig,
    x_y: &mut [T],
    affine: Affine,
    saved: BatchNormSaved<T>,
    running: Option<RunningStats>,
) -> KResult {
    let op = "batch_norm_train_forward_inplace";
    bn_train_check(op, d, x_y.len(), x_y.len(), &affine, &saved, &running)?;
    bn_train_core(d, cfg, None, x_y, &affine, saved, running);
    Ok(())
}

fn bn_infer_rows<T: Element>(
    d: NormDims,
    epsilon: f32,
    src: Option<&[T]>,
    y: &mut [T],
    affine: &Affine,
    running_mean: &[f32],
    running_var: &[f32],
) {
    let c = d.channels;
    rows(&mut y[..d.len()], c, c, |r, yr| {
        for ch in 0..c {
            let xv = match src {
                Some(x) => x[r * c + ch],
                None => yr[ch],
            }
            .to_f32();
            let inv = 1.0 / (running_var[ch] + epsilon).sqrt();
            yr[ch] =
                T::from_f32(affine.gamma[ch] * (xv - running_mean[ch]) * inv + affine.beta[ch]);
        }
    });
}

fn bn_infer_check(
    op: &str,
    d: NormDims,
    x_len: usize,
    y_len: usize,
    affine: &Affine,
    rm: &[f32],
    rv: &[f32],
) -> KResult {
    need(op, "x", x_len, d.len())?;
    need(op, "y", y_len, d.len())?;
    need(op, "running mean", rm.len(), d.channels)?;
    need(op, "running var", rv.len(), d.channels)?;
    check_affine(op, d.channels, affine)
}

/// Batch-norm inference forward from the running statistics (nothing saved, nothing updated).
pub fn batch_norm_infer_forward<T: Element>(
    d: NormDims,
    epsilon: f32,
    x: &[T],
    affine: Affine,
    running_mean: &[f32],
    running_var: &[f32],
    y: &mut [T],
) -> KResult {
    let op = "batch_norm_infer_forward";
    bn_infer_check(op, d, x.len(), y.len(), &affine, running_mean, running_var)?;
    bn_infer_rows(d, epsilon, Some(x), y, &affine, running_mean, running_var);
    Ok(())
}

/// [`batch_norm_infer_forward`] writing `y` over `x`.
pub fn batch_norm_infer_forward_inplace<T: Element>(
    d: NormDims,
    epsilon: f32,
    x_y: &mut [T],
    affine: Affine,
    running_mean: &[f32],
    running_var: &[f32],
) -> KResult {
    let op = "batch_norm_infer_forward_inplace";
    bn_infer_check(
        op,
        d,
        x_y.len(),
        x_y.len(),
        &affine,
        running_mean,
        running_var,
    )?;
    bn_infer_rows(d, epsilon, None, x_y, &affine, running_mean, running_var);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bn_backward_check<T>(
    op: &str,
    d: NormDims,
    x_hat: &[T],
    inv_std: &[f32],
    gamma: &[f32],
    dy_len: usize,
    dx_len: usize,
    grads: &AffineGrads,
) -> KResult {
    need(op, "x_hat", x_hat.len(), d.len())?;
    need(op, "dy", dy_len, d.len())?;
    need(op, "dx", dx_len, d.len())?;
    need(op, "inv_std", inv_std.len(), d.channels)?;
    need(op, "gamma", gamma.len(), d.channels)?;
    check_grads(op, d.channels, grads)?;
    if d.rows == 0 {
        return Err(KernelError(format!("{op}: 0 rows")));
    }
    Ok(())
}

/// Batch-norm backward (training mode). Reads `x_hat`, `inv_std` and `gamma`;
/// `dx = gamma·inv_std/m · (m·dy − Σdy − x_hat·Σ(dy·x_hat))` (overwritten),
/// `dgamma += Σ dy·x_hat`, `dbeta += Σ dy` (accumulated).
///
/// Works one block of channels at a time (sums, then that block's `dx`), so the per-channel
/// sums live on the stack and the in-place variant never reads a `dy` it already overwrote.
pub fn batch_norm_backward<T: Element>(
    d: NormDims,
    x_hat: &[T],
    inv_std: &[f32],
    gamma: &[f32],
    dy: &[T],
    dx: &mut [T],
    grads: AffineGrads,
) -> KResult {
    let op = "batch_norm_backward";
    bn_backward_check(op, d, x_hat, inv_std, gamma, dy.len(), dx.len(), &grads)?;
    let c = d.channels;
    let hat_row = |r: usize| SavedHatRow(&x_hat[r * c..(r + 1) * c]);
    bn_backward_core(d, hat_row, inv_std, gamma, Some(dy), dx, grads);
    Ok(())
}

/// [`batch_norm_backward`] rebuilding `x_hat` from the input `x` and the forward's `mean`
/// (f32 `[2, channels]`, hi then lo) and `inv_std`, exactly as the forward computed it
/// (`(x − hi − lo)·inv_std`, rounded to `T`): the same gradients, without keeping `x_hat`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward_rebuild<T: Element>(
    d: NormDims,
    x: &[T],
    mean: &[f32],
    inv_std: &[f32],
    gamma: &[f32],
    dy: &[T],
    dx: &mut [T],
    grads: AffineGrads,
) -> KResult {
    let op = "batch_norm_backward_rebuild";
    bn_backward_check(op, d, x, inv_std, gamma, dy.len(), dx.len(), &grads)?;
    need(op, "mean", mean.len(), 2 * d.channels)?;
    let (hi, lo) = mean.split_at(d.channels);
    let c = d.channels;
    let hat_row = |r: usize| BnRebuiltHatRow {
        x: &x[r * c..(r + 1) * c],
        hi,
        lo,
        inv_std,
    };
    bn_backward_core(d, hat_row, inv_std, gamma, Some(dy), dx, grads);
    Ok(())
}

/// [`batch_norm_backward`] writing `dx` over `dy`.
pub fn batch_norm_backward_inplace<T: Element>(
    d: NormDims,
    x_hat: &[T],
    inv_std: &[f32],
    gamma: &[f32],
    dy_dx: &mut [T],
    grads: AffineGrads,
) -> KResult {
    let op = "batch_norm_backward_inplace";
    bn_backward_check(
        op,
        d,
        x_hat,
        inv_std,
        gamma,
        dy_dx.len(),
        dy_dx.len(),
        &grads,
    )?;
    let c = d.channels;
    let hat_row = |r: usize| SavedHatRow(&x_hat[r * c..(r + 1) * c]);
    bn_backward_core(d, hat_row, inv_std, gamma, None, dy_dx, grads);
    Ok(())
}

/// A row of the x̂ a batch norm's forward made, rebuilt from its input and per-channel
/// statistics exactly as the forward computed it: `(x − hi − lo)·inv_std` rounded to `T`.
#[derive(Clone, Copy)]
struct BnRebuiltHatRow<'a, T> {
    x: &'a [T],
    hi: &'a [f32],
    lo: &'a [f32],
    inv_std: &'a [f32],
}

impl<T: Element> HatRow for BnRebuiltHatRow<'_, T> {
    #[inline(always)]
    fn at(self, ch: usize) -> f32 {
        T::from_f32((self.x[ch].to_f32() - self.hi[ch] - self.lo[ch]) * self.inv_std[ch]).to_f32()
    }
    #[inline(always)]
    fn narrow(self, c0: usize, n: usize) -> Self {
        BnRebuiltHatRow {
            x: &self.x[c0..c0 + n],
            hi: &self.hi[c0..c0 + n],
            lo: &self.lo[c0..c0 + n],
            inv_std: &self.inv_std[c0..c0 + n],
        }
    }
}

/// The batch-norm backward, [`ROW_CB`] channels at a time (a whole row for up to that many,
/// so each pass reads every row once): `Σdy` and `Σdy·x̂` ([`affine_sums`]: f64, the
/// deterministic row split), then `dx`. `dy` is `None` when `dx` holds it (in place): a
/// block's channels are overwritten only after its sums are taken.
fn bn_backward_core<T: Element, H: HatRow>(
    d: NormDims,
    hat_row: impl Fn(usize) -> H + Sync + Send,
    inv_std: &[f32],
    gamma: &[f32],
    dy: Option<&[T]>,
    dx: &mut [T],
    grads: AffineGrads,
) {
    let c = d.channels;
    if c == 0 || d.rows == 0 {
        return;
    }
    let inv_m = 1.0 / d.rows as f32;
    for c0 in (0..c).step_by(ROW_CB) {
        let cb = ROW_CB.min(c - c0);
        let g: &[T] = match dy {
            Some(g) => g,
            None => dx,
        };
        let s = affine_sums(d, g, &hat_row, c0, cb);
        let per_channel = |f: &dyn Fn(usize) -> f32| -> [f32; ROW_CB] {
            std::array::from_fn(|j| if j < cb { f(j) } else { 0.0 })
        };
        let sums = BnSums {
            dy: per_channel(&|j| s[0][j] as f32),
            dy_hat: per_channel(&|j| s[1][j] as f32),
            coef: per_channel(&|j| gamma[c0 + j] * inv_std[c0 + j]),
            inv_m,
        };
        for j in 0..cb {
            grads.dbeta[c0 + j] += sums.dy[j];
            grads.dgamma[c0 + j] += sums.dy_hat[j];
        }
        let group = BN_TASK_ELEMS.div_ceil(c);
        let task = |(k, dxs): (usize, &mut [T])| {
            bn_backward_rows(&hat_row, k * group, dy, &sums, dxs, c, c0, cb);
        };
        if d.len() >= PAR_MIN {
            dx[..d.len()]
                .par_chunks_mut(group * c)
                .enumerate()
                .for_each(task);
        } else {
            dx[..d.len()]
                .chunks_mut(group * c)
                .enumerate()
                .for_each(task);
        }
    }
}

/// A channel block's figures for [`bn_backward_rows`]: `Σdy`, `Σdy·x̂` (rounded to f32),
/// `gamma·inv_std`, and `1/rows`.
struct BnSums {
    dy: [f32; ROW_CB],
    dy_hat: [f32; ROW_CB],
    coef: [f32; ROW_CB],
    inv_m: f32,
}

/// Elements (rows × channels) of one task of [`bn_backward_core`]'s `dx` pass.
const BN_TASK_ELEMS: usize = 1 << 13;

wide_loop! {
    /// [`bn_backward_core`]'s `dx` for channels `c0..c0 + cb` of the `c`-channel rows in `dxs`
    /// (row `first` onwards): `dx = gamma·inv_std·(dy − (Σdy + x̂·Σdy·x̂)/rows)`, `dy` from
    /// `dy` or, in place, `dxs`.
    #[allow(clippy::too_many_arguments)]
    fn bn_backward_rows<T: Element, H: HatRow, F: Fn(usize) -> H>(
        hat_row: &F,
        first: usize,
        dy: Option<&[T]>,
        sums: &BnSums,
        dxs: &mut [T],
        c: usize,
        c0: usize,
        cb: usize
    ) wide if is_f32::<T>(), {
        let (sdy, sdyh, coef) = (&sums.dy[..cb], &sums.dy_hat[..cb], &sums.coef[..cb]);
        for (i, dxr) in dxs.chunks_exact_mut(c).enumerate() {
            let r = first + i;
            let (hat, dxr) = (hat_row(r).narrow(c0, cb), &mut dxr[c0..c0 + cb]);
            let dx_of = |g: f32, j: usize| {
                T::from_f32(coef[j] * (g - (sdy[j] + hat.at(j) * sdyh[j]) * sums.inv_m))
            };
            match dy {
                Some(dy) => {
                    let dyr = &dy[r * c + c0..][..cb];
                    for j in 0..cb {
                        dxr[j] = dx_of(dyr[j].to_f32(), j);
                    }
                }
                None => {
                    for j in 0..cb {
                        dxr[j] = dx_of(dxr[j].to_f32(), j);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// layer norm
// ---------------------------------------------------------------------------------------------

/// A row's mean in f64: the forward's, and the one a rebuilding backward recomputes (the same
/// sum in the same order, so the same bits).
#[inline]
fn row_mean<T: Element>(xr: &[T]) -> f64 {
    sum_in_lanes(xr, |v| v as f64) / xr.len() as f64
}

/// Per-row mean and rstd in f64, two passes.
#[inline]
fn row_stats<T: Element>(xr: &[T], epsilon: f32) -> (f32, f32) {
    let mean = row_mean(xr);
    let var = sum_in_lanes(xr, |v| {
        let t = v as f64 - mean;
        t * t
    }) / xr.len() as f64;
    (mean as f32, (1.0 / (var + epsilon as f64).sqrt()) as f32)
}

fn ln_forward_check<T>(
    op: &str,
    d: NormDims,
    x_len: usize,
    y_len: usize,
    affine: &Affine,
    x_hat: &[T],
    rstd: &[f32],
) -> KResult {
    need(op, "x", x_len, d.len())?;
    need(op, "y", y_len, d.len())?;
    need(op, "x_hat", x_hat.len(), d.len())?;
    need(op, "rstd", rstd.len(), d.rows)?;
    check_affine(op, d.channels, affine)?;
    if d.channels == 0 {
        return Err(KernelError(format!("{op}: 0 features per row")));
    }
    Ok(())
}

fn ln_forward_core<T: Element>(
    d: NormDims,
    epsilon: f32,
    src: Option<&[T]>,
    y: &mut [T],
    affine: &Affine,
    x_hat: &mut [T],
    rstd: &mut [f32],
) {
    let c = d.channels;
    rows3(
        (&mut y[..d.len()], c),
        (&mut x_hat[..d.len()], c),
        (&mut rstd[..d.rows], 1),
        3 * c,
        |r, yr, hr, sr| {
            let xr: &[T] = match src {
                Some(x) => &x[r * c..(r + 1) * c],
                None => yr,
            };
            let (mean, rs) = row_stats(xr, epsilon);
            sr[0] = rs;
            for ch in 0..c {
                let xv = match src {
                    Some(x) => x[r * c + ch],
                    None => yr[ch],
                }
                .to_f32();
                let h = (xv - mean) * rs;
                hr[ch] = T::from_f32(h);
                yr[ch] = T::from_f32(affine.gamma[ch] * h + affine.beta[ch]);
            }
        },
    );
}

/// Layer-norm forward over the last axis: per row, `x_hat = (x − mean)·rstd`,
/// `rstd = 1/sqrt(var + epsilon)` (biased variance, as Keras), `y = gamma·x_hat + beta`.
/// Saves `x_hat` (`T`, `[rows, channels]`) and `rstd` (f32 `[rows]`).
pub fn layer_norm_forward<T: Element>(
    d: NormDims,
    epsilon: f32,
    x: &[T],
    affine: Affine,
    y: &mut [T],
    x_hat: &mut [T],
    rstd: &mut [f32],
) -> KResult {
    let op = "layer_norm_forward";
    ln_forward_check(op, d, x.len(), y.len(), &affine, x_hat, rstd)?;
    ln_forward_core(d, epsilon, Some(x), y, &affine, x_hat, rstd);
    Ok(())
}

/// [`layer_norm_forward`] writing `y` over `x`.
pub fn layer_norm_forward_inplace<T: Element>(
    d: NormDims,
    epsilon: f32,
    x_y: &mut [T],
    affine: Affine,
    x_hat: &mut [T],
    rstd: &mut [f32],
) -> KResult {
    let op = "layer_norm_forward_inplace";
    ln_forward_check(op, d, x_y.len(), x_y.len(), &affine, x_hat, rstd)?;
    ln_forward_core(d, epsilon, None, x_y, &affine, x_hat, rstd);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn ln_backward_check<T>(
    op: &str,
    d: NormDims,
    x_hat: &[T],
    rstd: &[f32],
    gamma: &[f32],
    dy_len: usize,
    dx_len: usize,
    grads: &AffineGrads,
) -> KResult {
    need(op, "x_hat", x_hat.len(), d.len())?;
    need(op, "rstd", rstd.len(), d.rows)?;
    need(op, "dy", dy_len, d.len())?;
    need(op, "dx", dx_len, d.len())?;
    need(op, "gamma", gamma.len(), d.channels)?;
    check_grads(op, d.channels, grads)
}

fn ln_backward_core<T: Element, H: HatRow>(
    d: NormDims,
    hat_row: impl Fn(usize) -> H + Sync + Send,
    rstd: &[f32],
    gamma: &[f32],
    dy: Option<&[T]>,
    dx: &mut [T],
    grads: AffineGrads,
) {
    let c = d.channels;
    if c == 0 || d.rows == 0 {
        return;
    }
    // Parameter gradients first: they read dy, which the in-place dx pass then overwrites.
    {
        let g: &[T] = match dy {
            Some(g) => g,
            None => dx,
        };
        let dbeta = Some(&mut grads.dbeta[..]);
        add_affine_grads(d, g, &hat_row, grads.dgamma, dbeta);
    }
    let gamma = &gamma[..c];
    rows(&mut dx[..d.len()], c, 3 * c, |r, dxr| {
        let dyr = dy.map(|g| &g[r * c..(r + 1) * c]);
        ln_backward_row(hat_row(r), rstd[r], gamma, dyr, dxr);
    });
}

wide_loop! {
    /// One row of [`ln_backward_core`]: with `g = dy·gamma` (`dyr`, or `dxr` itself when it is
    /// `None`), `dxr = rstd·(g − mean(g) − x̂·mean(g·x̂))`. The means are eight interleaved
    /// sums (as `sum_in_lanes`: independent chains of additions) added by [`add_lanes`].
    fn ln_backward_row<T: Element, H: HatRow>(
        hat: H,
        rs: f32,
        gamma: &[f32],
        dyr: Option<&[T]>,
        dxr: &mut [T]
    ) wide if is_f32::<T>(), {
        let c = dxr.len();
        let (gamma, hat) = (&gamma[..c], hat.narrow(0, c));
        let (mut s1, mut s2) = ([0f32; 8], [0f32; 8]);
        let src: &[T] = match dyr {
            Some(g) => &g[..c],
            None => dxr,
        };
        let full = c - c % 8;
        for base in (0..full / 8).map(|k| 8 * k) {
            let (g, gm, h) = (load8(src, base), load8(gamma, base), hat.lanes(base));
            for j in 0..8 {
                let g = g[j] * gm[j];
                s1[j] += g;
                s2[j] += g * h[j];
            }
        }
        for ch in full..c {
            let g = src[ch].to_f32() * gamma[ch];
            s1[ch - full] += g;
            s2[ch - full] += g * hat.at(ch);
        }
        let inv_c = 1.0 / c as f32;
        let (m1, m2) = (add_lanes(s1) * inv_c, add_lanes(s2) * inv_c);
        let dx_of = |g: f32, ch: usize| T::from_f32(rs * (g - m1 - hat.at(ch) * m2));
        match dyr {
            Some(dyr) => {
                let dyr = &dyr[..c];
                for ch in 0..c {
                    dxr[ch] = dx_of(dyr[ch].to_f32() * gamma[ch], ch);
                }
            }
            None => {
                for ch in 0..c {
                    dxr[ch] = dx_of(dxr[ch].to_f32() * gamma[ch], ch);
                }
            }
        }
    }
}

/// Layer-norm backward. Reads `x_hat`, `rstd`, `gamma`; with `g = dy·gamma`,
/// `dx = rstd · (g − mean(g) − x_hat · mean(g·x_hat))` per row (overwritten),
/// `dgamma += Σ_rows dy·x_hat`, `dbeta += Σ_rows dy` (accumulated).
pub fn layer_norm_backward<T: Element>(
    d: NormDims,
    x_hat: &[T],
    rstd: &[f32],
    gamma: &[f32],
    dy: &[T],
    dx: &mut [T],
    grads: AffineGrads,
) -> KResult {
    let op = "layer_norm_backward";
    ln_backward_check(op, d, x_hat, rstd, gamma, dy.len(), dx.len(), &grads)?;
    let c = d.channels;
    let hat_row = |r: usize| SavedHatRow(&x_hat[r * c..(r + 1) * c]);
    ln_backward_core(d, hat_row, rstd, gamma, Some(dy), dx, grads);
    Ok(())
}

/// [`layer_norm_backward`] rebuilding `x_hat` from the input `x`: each row's mean is
/// recomputed into `mean` (f32 scratch, `[rows]`) exactly as the forward computed it, then
/// `x_hat = (x − mean)·rstd` rounded to `T` — the forward's bits, so the same gradients,
/// without keeping `x_hat`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_rebuild<T: Element>(
    d: NormDims,
    x: &[T],
    rstd: &[f32],
    gamma: &[f32],
    dy: &[T],
    dx: &mut [T],
    mean: &mut [f32],
    grads: AffineGrads,
) -> KResult {
    let op = "layer_norm_backward_rebuild";
    ln_backward_check(op, d, x, rstd, gamma, dy.len(), dx.len(), &grads)?;
    need(op, "mean", mean.len(), d.rows)?;
    let c = d.channels;
    if c == 0 {
        return Err(KernelError(format!("{op}: 0 features per row")));
    }
    rows(&mut mean[..d.rows], 1, c, |r, m| {
        m[0] = row_mean(&x[r * c..(r + 1) * c]) as f32;
    });
    let mean = &*mean;
    let hat_row = |r: usize| RebuiltHatRow {
        x: &x[r * c..(r + 1) * c],
        mean: mean[r],
        rstd: rstd[r],
    };
    ln_backward_core(d, hat_row, rstd, gamma, Some(dy), dx, grads);
    Ok(())
}

/// [`layer_norm_backward`] writing `dx` over `dy`.
pub fn layer_norm_backward_inplace<T: Element>(
    d: NormDims,
    x_hat: &[T],
    rstd: &[f32],
    gamma: &[f32],
    dy_dx: &mut [T],
    grads: AffineGrads,
) -> KResult {
    let op = "layer_norm_backward_inplace";
    ln_backward_check(op, d, x_hat, rstd, gamma, dy_dx.len(), dy_dx.len(), &grads)?;
    let c = d.channels;
    let hat_row = |r: usize| SavedHatRow(&x_hat[r * c..(r + 1) * c]);
    ln_backward_core(d, hat_row, rstd, gamma, None, dy_dx, grads);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// group norm and RMS norm
// ---------------------------------------------------------------------------------------------

/// A group-norm (or RMS-norm) input: `samples` samples of `[spatial, channels]` (NHWC flattens
/// to `spatial = h·w`), each normalised over each of its `groups` groups of
/// `channels / groups` consecutive channels — Keras's `GroupNormalization`. RMS norm is its
/// one-group, uncentred case over the last axis of every row (`samples` rows, `spatial` 1):
/// one kernel pair serves both, since the two differ only in the mean and the shift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupNormDims {
    pub samples: usize,
    pub spatial: usize,
    pub channels: usize,
    pub groups: usize,
    /// Subtract the group's mean (group norm), or not (RMS norm: `x / sqrt(mean(x²) + ε)`).
    pub center: bool,
}

impl GroupNormDims {
    /// Elements of `x`, saturating (absurd dims then fail every length check).
    pub fn len(&self) -> usize {
        self.samples
            .saturating_mul(self.spatial)
            .saturating_mul(self.channels)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries of `rstd`: one per (sample, group).
    pub fn stats(&self) -> usize {
        self.samples.saturating_mul(self.groups)
    }

    fn sample_len(&self) -> usize {
        self.spatial.saturating_mul(self.channels)
    }

    /// The flat indices (within one sample) of group `g`'s elements, in memory order.
    fn group(&self, g: usize) -> impl Iterator<Item = usize> + Clone {
        let (c, cg) = (self.channels, self.channels / self.groups);
        (0..self.spatial).flat_map(move |s| (s * c + g * cg)..(s * c + (g + 1) * cg))
    }
}

fn gn_check(d: GroupNormDims, op: &str) -> KResult {
    if d.groups == 0 || d.channels == 0 || !d.channels.is_multiple_of(d.groups) {
        return Err(KernelError(format!(
            "{op}: {} channels do not split into {} groups",
            d.channels, d.groups
        )));
    }
    Ok(())
}

/// Group-norm forward (RMS norm when `!d.center` and no `beta`): per sample and group,
/// `x_hat = (x − mean)·rstd` with `rstd = 1/sqrt(var + epsilon)` (biased variance, statistics
/// in f64, as layer norm) — or `x_hat = x·rstd`, `rstd = 1/sqrt(mean(x²) + epsilon)` uncentred —
/// then `y = gamma·x_hat + beta` per channel. Saves `x_hat` (`T`) and `rstd` (f32
/// `[samples·groups]`).
#[allow(clippy::too_many_arguments)]
pub fn group_norm_forward<T: Element>(
    d: GroupNormDims,
    epsilon: f32,
    x: &[T],
    gamma: &[f32],
    beta: Option<&[f32]>,
    y: &mut [T],
    x_hat: &mut [T],
    rstd: &mut [f32],
) -> KResult {
    let op = "group_norm_forward";
    gn_check(d, op)?;
    need(op, "x", x.len(), d.len())?;
    need(op, "y", y.len(), d.len())?;
    need(op, "x_hat", x_hat.len(), d.len())?;
    need(op, "rstd", rstd.len(), d.stats())?;
    need(op, "gamma", gamma.len(), d.channels)?;
    if let Some(b) = beta {
        need(op, "beta", b.len(), d.channels)?;
    }
    let (sl, c) = (d.sample_len(), d.channels);
    rows3(
        (&mut y[..d.len()], sl),
        (&mut x_hat[..d.len()], sl),
        (&mut rstd[..d.stats()], d.groups),
        3 * sl,
        |n, yr, hr, sr| {
            let xs = &x[n * sl..(n + 1) * sl];
            for (g, rs_out) in sr.iter_mut().enumerate() {
                let len = d.spatial.saturating_mul(c / d.groups) as f64;
                let mean = if d.center {
                    d.group(g).map(|i| xs[i].to_f32() as f64).sum::<f64>() / len
                } else {
                    0.0
                };
                let var = d
                    .group(g)
                    .map(|i| {
                        let t = xs[i].to_f32() as f64 - mean;
                        t * t
                    })
                    .sum::<f64>()
                    / len;
                let (m, rs) = (mean as f32, (1.0 / (var + epsilon as f64).sqrt()) as f32);
                *rs_out = rs;
                for i in d.group(g) {
                    let ch = i % c;
                    let h = (xs[i].to_f32() - m) * rs;
                    hr[i] = T::from_f32(h);
                    let shift = beta.map_or(0.0, |b| b[ch]);
                    yr[i] = T::from_f32(gamma[ch] * h + shift);
                }
            }
        },
    );
    Ok(())
}

/// Group-norm (and RMS-norm) backward. Reads `x_hat`, `rstd`, `gamma`; with `g = dy·gamma`,
/// per sample and group `dx = rstd · (g − mean(g) − x_hat · mean(g·x_hat))` (without the
/// `mean(g)` term when uncentred, whose mean was never subtracted), overwritten;
/// `dgamma += Σ dy·x_hat` and `dbeta += Σ dy` over samples and positions (accumulated;
/// `dbeta` absent without a shift). Sums in f64.
#[allow(clippy::too_many_arguments)]
pub fn group_norm_backward<T: Element>(
    d: GroupNormDims,
    x_hat: &[T],
    rstd: &[f32],
    gamma: &[f32],
    dy: &[T],
    dx: &mut [T],
    dgamma: &mut [f32],
    dbeta: Option<&mut [f32]>,
) -> KResult {
    let op = "group_norm_backward";
    gn_check(d, op)?;
    need(op, "x_hat", x_hat.len(), d.len())?;
    need(op, "rstd", rstd.len(), d.stats())?;
    need(op, "dy", dy.len(), d.len())?;
    need(op, "dx", dx.len(), d.len())?;
    need(op, "gamma", gamma.len(), d.channels)?;
    need(op, "dgamma", dgamma.len(), d.channels)?;
    if let Some(b) = &dbeta {
        need(op, "dbeta", b.len(), d.channels)?;
    }
    let c = d.channels;
    // The affine parameters' gradients are per-channel sums over every (sample, position)
    // row: the layer-norm reduction over `[samples·spatial, channels]`.
    let rows_dims = NormDims {
        rows: d.samples.saturating_mul(d.spatial),
        channels: c,
    };
    let hat_row = |r: usize| SavedHatRow(&x_hat[r * c..(r + 1) * c]);
    add_affine_grads(rows_dims, dy, hat_row, dgamma, dbeta);
    let sl = d.sample_len();
    rows(&mut dx[..d.len()], sl, 4 * sl, |n, dxr| {
        let (hs, gs) = (&x_hat[n * sl..(n + 1) * sl], &dy[n * sl..(n + 1) * sl]);
        let g = |i: usize| gs[i].to_f32() * gamma[i % c];
        for gi in 0..d.groups {
            let len = d.spatial.saturating_mul(c / d.groups) as f64;
            let (mut s1, mut s2) = (0f64, 0f64);
            for i in d.group(gi) {
                s1 += g(i) as f64;
                s2 += (g(i) * hs[i].to_f32()) as f64;
            }
            let m1 = if d.center { (s1 / len) as f32 } else { 0.0 };
            let m2 = (s2 / len) as f32;
            let rs = rstd[n * d.groups + gi];
            for i in d.group(gi) {
                dxr[i] = T::from_f32(rs * (g(i) - m1 - hs[i].to_f32() * m2));
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The moments' loop, compiled wide where the CPU allows, adds per channel what a scalar
    /// loop in f64 adds, row after row: the same bits, with and without the mean.
    #[test]
    fn moment_rows_are_the_scalar_sums() {
        let (rows, c, c0, n) = (37, 40, 3, 29);
        let x: Vec<f32> = (0..rows * c)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 97.0 - 5.0)
            .collect();
        let mean: Vec<f64> = (0..n).map(|j| j as f64 * 0.1 - 1.0).collect();
        for mu in [None, Some(&mean[..])] {
            let mut wide = vec![0f64; n];
            add_moment_rows(&x, 0..rows, c, c0, mu, &mut wide);
            let mut scalar = vec![0f64; n];
            for r in 0..rows {
                for (j, s) in scalar.iter_mut().enumerate() {
                    let v = x[r * c + c0 + j] as f64;
                    *s += match mu {
                        None => v,
                        Some(m) => (v - m[j]) * (v - m[j]),
                    };
                }
            }
            let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&wide), bits(&scalar), "mean given: {}", mu.is_some());
        }
    }
}
