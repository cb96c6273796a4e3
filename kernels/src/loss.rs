//! Loss functions, each fused with its gradient: sparse categorical cross-entropy (with
//! softmax), binary cross-entropy (with sigmoid, on logits, and plain on probabilities), mean
//! squared error, and the VAE's KL divergence to N(0, 1).
//!
//! Conventions:
//! - Loss values are computed in f32 per element and summed in f64 over a fixed split
//!   (deterministic); predictions and targets may be any [`Element`].
//! - Log arguments are clipped like Keras: `p ∈ [ε, 1 − ε]`, `ε = 1e-7` ([`EPSILON`]).
//! - Every kernel takes `grad_scale`, the dynamic loss scale: the gradients it writes are
//!   multiplied by it (the returned loss value is not). Gradients are OVERWRITTEN.
//! - Each kernel has an `*_eval` twin that only computes the value (evaluate / validation).
//! - Shapes are `[n, features]` row-major; every check happens before anything is written.

use crate::elementwise::{need, reduce_rows, reduce_rows_mut};
use crate::{Element, KernelError};

/// Keras's `backend.epsilon()`: the clip applied to probabilities before a log.
pub const EPSILON: f32 = 1e-7;

/// How element losses become the batch loss (and hence the gradient's denominator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over all `n · features` elements (Keras's default: the loss function averages over
    /// the last axis, then `sum_over_batch_size` averages over the batch).
    Mean,
    /// Sum over the features of each sample, mean over the batch (the Keras VAE example's
    /// `ops.mean(ops.sum(bce, axis=(1, 2)))`).
    SumOverFeaturesMeanOverBatch,
}

impl Reduction {
    fn denom(self, n: usize, features: usize) -> f64 {
        match self {
            Reduction::Mean => (n * features) as f64,
            Reduction::SumOverFeaturesMeanOverBatch => n as f64,
        }
    }
}

/// Value of a classification loss plus the batch's correct-prediction count (for accuracy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassificationLoss {
    /// Mean loss over the batch (unscaled).
    pub loss: f32,
    /// Samples whose arg-max probability (first on ties, like `np.argmax`) equals the label.
    pub correct: usize,
}

fn check_batch(op: &str, n: usize, features: usize) -> Result<(), KernelError> {
    if n == 0 || features == 0 {
        Err(KernelError(format!(
            "{op}: empty batch ({n} samples × {features} features) has no mean"
        )))
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// sparse categorical cross-entropy
// ---------------------------------------------------------------------------------------------

fn scce_core<P: Element, G: Element>(
    op: &str,
    probs: &[P],
    labels: &[i32],
    n: usize,
    classes: usize,
    grad: Option<(f32, &mut [G])>,
) -> Result<ClassificationLoss, KernelError> {
    check_batch(op, n, classes)?;
    need(op, "probs", probs.len(), n.saturating_mul(classes))?;
    need(op, "labels", labels.len(), n)?;
    if let Some((_, g)) = &grad {
        need(op, "dlogits", g.len(), n.saturating_mul(classes))?;
    }
    if let Some((i, &l)) = labels[..n]
        .iter()
        .enumerate()
        .find(|(_, &l)| l < 0 || l as usize >= classes)
    {
        return Err(KernelError(format!(
            "{op}: sample {i} has label {l}, outside 0..{classes} for {classes} classes"
        )));
    }
    // One row: its loss term and whether its arg-max is right.
    let row = |r: usize| -> (f64, usize) {
        let pr = &probs[r * classes..(r + 1) * classes];
        let label = labels[r] as usize;
        let (mut best, mut arg) = (f32::NEG_INFINITY, 0);
        for (k, v) in pr.iter().enumerate() {
            let v = v.to_f32();
            if v > best {
                best = v;
                arg = k;
            }
        }
        let pl = pr[label].to_f32().clamp(EPSILON, 1.0 - EPSILON);
        (-(pl.ln() as f64), (arg == label) as usize)
    };
    let add = |a: (f64, usize), b: (f64, usize)| (a.0 + b.0, a.1 + b.1);
    let (sum, correct) = match grad {
        None => reduce_rows(
            n,
            classes,
            |first, end| (first..end).map(row).fold((0.0, 0), add),
            add,
        ),
        Some((grad_scale, g)) => {
            // d(mean CE ∘ softmax)/dlogits = (p − onehot) / n.
            let coef = grad_scale / n as f32;
            reduce_rows_mut(
                &mut g[..n * classes],
                classes,
                classes,
                |first, part| {
                    let mut acc = (0.0, 0);
                    for (k, gr) in part.chunks_mut(classes).enumerate() {
                        let r = first + k;
                        acc = add(acc, row(r));
                        let pr = &probs[r * classes..(r + 1) * classes];
                        let label = labels[r] as usize;
                        for (j, (o, p)) in gr.iter_mut().zip(pr).enumerate() {
                            let t = if j == label { 1.0 } else { 0.0 };
                            *o = G::from_f32((p.to_f32() - t) * coef);
                        }
                    }
                    acc
                },
                add,
            )
        }
    };
    Ok(ClassificationLoss {
        loss: (sum / n as f64) as f32,
        correct,
    })
}

/// Sparse categorical cross-entropy fused with the softmax that produced `probs`
/// (`[n, classes]`): loss `mean_i −ln clip(p[i, label_i])` and
/// `dlogits = grad_scale · (p − onehot(label)) / n` (the gradient with respect to the softmax
/// *input*, so the softmax backward is skipped). A label outside `0..classes` is an `Err`
/// naming the sample, the label and the class count. Also counts correct predictions.
pub fn sparse_categorical_crossentropy<P: Element, G: Element>(
    probs: &[P],
    labels: &[i32],
    n: usize,
    classes: usize,
    grad_scale: f32,
    dlogits: &mut [G],
) -> Result<ClassificationLoss, KernelError> {
    scce_core(
        "sparse_categorical_crossentropy",
        probs,
        labels,
        n,
        classes,
        Some((grad_scale, dlogits)),
    )
}

/// Value and correct count only (no gradient) of [`sparse_categorical_crossentropy`].
pub fn sparse_categorical_crossentropy_eval<P: Element>(
    probs: &[P],
    labels: &[i32],
    n: usize,
    classes: usize,
) -> Result<ClassificationLoss, KernelError> {
    scce_core::<P, f32>(
        "sparse_categorical_crossentropy_eval",
        probs,
        labels,
        n,
        classes,
        None,
    )
}

// ---------------------------------------------------------------------------------------------
// elementwise losses (BCE, MSE)
// ---------------------------------------------------------------------------------------------

/// Shared driver: `f(pred, target) -> (element loss, d element loss / d input)`; the gradient
/// written is `grad_scale / denom · d`.
#[allow(clippy::too_many_arguments)]
fn elementwise_loss<P: Element, Y: Element, G: Element>(
    op: &str,
    pred: &[P],
    target: &[Y],
    n: usize,
    features: usize,
    reduction: Reduction,
    grad: Option<(f32, &mut [G])>,
    f: impl Fn(f32, f32) -> (f32, f32) + Sync + Send,
) -> Result<f32, KernelError> {
    check_batch(op, n, features)?;
    let len = n.saturating_mul(features);
    need(op, "predictions", pred.len(), len)?;
    need(op, "targets", target.len(), len)?;
    if let Some((_, g)) = &grad {
        need(op, "gradient", g.len(), len)?;
    }
    let denom = reduction.denom(n, features);
    let sum = match grad {
        None => reduce_rows(
            n,
            features,
            |first, end| {
                (first * features..end * features)
                    .map(|i| f(pred[i].to_f32(), target[i].to_f32()).0 as f64)
                    .sum::<f64>()
            },
            |a, b| a + b,
        ),
        Some((grad_scale, g)) => {
            let coef = (grad_scale as f64 / denom) as f32;
            reduce_rows_mut(
                &mut g[..len],
                features,
                features,
                |first, part| {
                    let base = first * features;
                    let mut acc = 0f64;
                    for (k, o) in part.iter_mut().enumerate() {
                        let (l, d) = f(pred[base + k].to_f32(), target[base + k].to_f32());
                        acc += l as f64;
                        *o = G::from_f32(d * coef);
                    }
                    acc
                },
                |a, b| a + b,
            )
        }
    };
    Ok((sum / denom) as f32)
}

/// Keras's BCE on a probability: clip to `[ε, 1 − ε]`, then
/// `−(t·ln(p + ε) + (1 − t)·ln(1 − p + ε))` (the TF backend's exact form).
#[inline]
fn bce_value(p: f32, t: f32) -> f32 {
    let pc = p.clamp(EPSILON, 1.0 - EPSILON);
    -(t * (pc + EPSILON).ln() + (1.0 - t) * (1.0 - pc + EPSILON).ln())
}

/// `(loss, d loss / d p)` of binary cross-entropy on a probability: the Keras clipped value
/// [`bce_value`], and its exact derivative `−t/(p + ε) + (1 − t)/(1 − p + ε)` inside the clip
/// range, 0 outside it (the clip's gradient).
#[inline]
fn bce_rule(p: f32, t: f32) -> (f32, f32) {
    let d = if (EPSILON..=1.0 - EPSILON).contains(&p) {
        -t / (p + EPSILON) + (1.0 - t) / (1.0 - p + EPSILON)
    } else {
        0.0
    };
    (bce_value(p, t), d)
}

/// `(loss, d loss / d logit)` of binary cross-entropy fused with the sigmoid that produced `p`:
/// the Keras clipped value, and `p − t`, the exact gradient with respect to the sigmoid's input.
#[inline]
fn bce_with_sigmoid_rule(p: f32, t: f32) -> (f32, f32) {
    (bce_value(p, t), p - t)
}

/// The binary cross-entropy of a logit `x` against target `t`, computed without forming
/// `σ(x)`: `max(x, 0) − x·t + ln(1 + e^(−|x|))`, finite for every finite `x` (PyTorch's
/// `BCEWithLogitsLoss` and TensorFlow's `sigmoid_cross_entropy_with_logits` use this form).
#[inline]
fn bce_logits_value(x: f32, t: f32) -> f32 {
    x.max(0.0) - x * t + (-x.abs()).exp().ln_1p()
}

/// `σ(x)`, written so that neither branch overflows.
#[inline]
fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `(loss, d loss / d x)` of binary cross-entropy on a logit: the stable value
/// [`bce_logits_value`] and `σ(x) − t`, its exact gradient.
#[inline]
fn bce_logits_rule(x: f32, t: f32) -> (f32, f32) {
    (bce_logits_value(x, t), sigmoid(x) - t)
}

/// `(loss, d loss / d p)` of the squared error: `(p − t)²` and `2(p − t)`.
#[inline]
fn squared_error_rule(p: f32, t: f32) -> (f32, f32) {
    let e = p - t;
    (e * e, 2.0 * e)
}

/// Declares public elementwise losses over [`elementwise_loss`], each from its element rule
/// `(pred, target) -> (loss, d loss / d pred)` and named as its errors name it: a `grad` entry
/// takes `grad_scale` and overwrites its last argument with `grad_scale / denom · d`; a `value`
/// entry (an `*_eval` twin) computes the loss only.
macro_rules! elementwise_losses {
    ($($(#[$doc:meta])* $kind:ident $name:ident = $rule:expr;)*) => {
        $(elementwise_losses!(@$kind $(#[$doc])* $name = $rule);)*
    };
    (@grad $(#[$doc:meta])* $name:ident = $rule:expr) => {
        $(#[$doc])*
        pub fn $name<P: Element, Y: Element, G: Element>(
            pred: &[P],
            targets: &[Y],
            n: usize,
            features: usize,
            reduction: Reduction,
            grad_scale: f32,
            grad: &mut [G],
        ) -> Result<f32, KernelError> {
            let grad = Some((grad_scale, grad));
            elementwise_loss(stringify!($name), pred, targets, n, features, reduction, grad, $rule)
        }
    };
    (@value $(#[$doc:meta])* $name:ident = $rule:expr) => {
        $(#[$doc])*
        pub fn $name<P: Element, Y: Element>(
            pred: &[P],
            targets: &[Y],
            n: usize,
            features: usize,
            reduction: Reduction,
        ) -> Result<f32, KernelError> {
            elementwise_loss::<P, Y, f32>(
                stringify!($name), pred, targets, n, features, reduction, None, $rule,
            )
        }
    };
}

elementwise_losses! {
    /// Binary cross-entropy fused with the sigmoid that produced `p` (post-sigmoid, `[n,
    /// features]`): the Keras clipped BCE value, and `dlogits = grad_scale · (p − t) / denom`
    /// (the exact gradient with respect to the sigmoid's input, so the sigmoid backward is
    /// skipped).
    grad binary_crossentropy_with_sigmoid = bce_with_sigmoid_rule;
    /// Plain binary cross-entropy on probabilities (no fused sigmoid), gradient with respect to
    /// `p`: `dp = grad_scale / denom · (−t/(p + ε) + (1 − t)/(1 − p + ε))` inside the clip range
    /// and 0 outside it (the clip's gradient), exactly differentiating the Keras value.
    grad binary_crossentropy = bce_rule;
    /// Binary cross-entropy on logits (a linear output), the sigmoid fused: the stable value
    /// [`bce_logits_value`] per element and `dlogits = grad_scale · (σ(x) − t) / denom`, its
    /// exact gradient. No clipping: a confident wrong logit costs what it should.
    grad binary_crossentropy_from_logits = bce_logits_rule;
    /// Value only of [`binary_crossentropy_from_logits`].
    value binary_crossentropy_from_logits_eval = bce_logits_rule;
    /// Value only of (either) binary cross-entropy on probabilities.
    value binary_crossentropy_eval = bce_rule;
    /// Mean squared error: element loss `(p − t)²`, `dp = grad_scale · 2(p − t) / denom`.
    grad mean_squared_error = squared_error_rule;
    /// Value only of [`mean_squared_error`].
    value mean_squared_error_eval = squared_error_rule;
}

// ---------------------------------------------------------------------------------------------
// KL divergence of N(mean, exp(logvar)) from N(0, 1)
// ---------------------------------------------------------------------------------------------

fn kl_check(
    op: &str,
    mean: usize,
    logvar: usize,
    n: usize,
    latent: usize,
) -> Result<(), KernelError> {
    check_batch(op, n, latent)?;
    need(op, "mean", mean, n.saturating_mul(latent))?;
    need(op, "logvar", logvar, n.saturating_mul(latent))
}

fn kl_value<T: Element>(mean: &[T], logvar: &[T], n: usize, latent: usize) -> f32 {
    let sum = reduce_rows(
        n,
        latent,
        |first, end| {
            (first * latent..end * latent)
                .map(|i| {
                    let (m, lv) = (mean[i].to_f32(), logvar[i].to_f32());
                    (-0.5 * (1.0 + lv - m * m - lv.exp())) as f64
                })
                .sum::<f64>()
        },
        |a, b| a + b,
    );
    (sum / n as f64) as f32
}

/// KL divergence of the diagonal normal `N(mean, exp(logvar))` from `N(0, 1)`, as in the Keras
/// VAE example: per sample `−0.5 · Σ_j (1 + logvar − mean² − exp(logvar))`, mean over the
/// batch. Gradients (overwritten): `dmean = grad_scale · mean / n`,
/// `dlogvar = grad_scale · 0.5 · (exp(logvar) − 1) / n`. The sampling layer's backward then
/// adds its share with [`crate::elementwise::GradWrite::Accumulate`].
#[allow(clippy::too_many_arguments)]
pub fn kl_divergence_standard_normal<T: Element, G: Element>(
    mean: &[T],
    logvar: &[T],
    n: usize,
    latent: usize,
    grad_scale: f32,
    dmean: &mut [G],
    dlogvar: &mut [G],
) -> Result<f32, KernelError> {
    let op = "kl_divergence_standard_normal";
    kl_check(op, mean.len(), logvar.len(), n, latent)?;
    need(op, "dmean", dmean.len(), n.saturating_mul(latent))?;
    need(op, "dlogvar", dlogvar.len(), n.saturating_mul(latent))?;
    let len = n * latent;
    let coef = grad_scale / n as f32;
    crate::elementwise::map1(&mean[..len], &mut dmean[..len], |m| m * coef);
    crate::elementwise::map1(&logvar[..len], &mut dlogvar[..len], |lv| {
        0.5 * (lv.exp() - 1.0) * coef
    });
    Ok(kl_value(mean, logvar, n, latent))
}

/// Value only of [`kl_divergence_standard_normal`].
pub fn kl_divergence_standard_normal_eval<T: Element>(
    mean: &[T],
    logvar: &[T],
    n: usize,
    latent: usize,
) -> Result<f32, KernelError> {
    kl_check(
        "kl_divergence_standard_normal_eval",
        mean.len(),
        logvar.len(),
        n,
        latent,
    )?;
    Ok(kl_value(mean, logvar, n, latent))
}
