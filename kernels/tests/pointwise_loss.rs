//! Losses: values against f64 references (Keras clipping), gradients against central
//! differences of the kernel's own value (through the fused softmax/sigmoid), grad_scale,
//! label errors.
//!
//! Tolerance for gradients here: 5e-4 absolute + 1% relative. The objective is the returned
//! f32 loss (rounded to ~2.4e-7 relative), so a central difference with EPS = 1e-3 carries
//! about 1.2e-4·|loss| of noise; gradients are O(1/n) ≈ 0.01–0.3, so a wrong term still fails.
mod pointwise_util;

use half::f16;
use memwise_kernels::activation::{sigmoid_forward, softmax_forward};
use memwise_kernels::loss::*;
use pointwise_util::*;

const LOSS_ATOL: f64 = 5e-4;

fn softmax(x: &[f32], n: usize, c: usize) -> Vec<f32> {
    let mut p = vec![0f32; n * c];
    softmax_forward(x, &mut p, n, c).unwrap();
    p
}

#[test]
fn sparse_cce_value_accuracy_and_gradient() {
    let mut rng = Rng::new(50);
    for trial in 0..5 {
        let n = rng.pick(SIZES) + 1;
        let c = rng.pick(&[2, 3, 7, 10, 13]) + trial;
        let logits = rng.vec(n * c, -3.0, 3.0);
        let labels: Vec<i32> = (0..n).map(|_| (rng.next_u64() % c as u64) as i32).collect();
        let p = softmax(&logits, n, c);
        let mut g = vec![f32::NAN; n * c];
        let out = sparse_categorical_crossentropy(&p, &labels, n, c, 1.0, &mut g).unwrap();

        let mut want = 0f64;
        let mut correct = 0;
        for i in 0..n {
            let row = &p[i * c..(i + 1) * c];
            let pl = (row[labels[i] as usize] as f64).clamp(1e-7, 1.0 - 1e-7);
            want -= pl.ln();
            let arg = (0..c).fold(0, |a, k| if row[k] > row[a] { k } else { a });
            correct += (arg == labels[i] as usize) as usize;
        }
        want /= n as f64;
        assert!(
            (out.loss as f64 - want).abs() < 1e-6 * want.max(1.0),
            "{} vs {want}",
            out.loss
        );
        assert_eq!(out.correct, correct);
        let ev = sparse_categorical_crossentropy_eval(&p, &labels, n, c).unwrap();
        assert_eq!(ev, out);

        // Gradient w.r.t. the logits, through softmax + loss.
        let num = numeric_grad(&logits, |lp| {
            sparse_categorical_crossentropy_eval(&softmax(lp, n, c), &labels, n, c)
                .unwrap()
                .loss as f64
        });
        assert_grad("scce dlogits", &g, &num, LOSS_ATOL, GRAD_RTOL);

        // grad_scale multiplies the gradient, not the loss (power of two: exact).
        let mut g8 = vec![0f32; n * c];
        let out8 = sparse_categorical_crossentropy(&p, &labels, n, c, 8.0, &mut g8).unwrap();
        assert_eq!(out8.loss, out.loss);
        for i in 0..g.len() {
            assert_eq!(g8[i], 8.0 * g[i]);
        }
        // Half-precision gradient output.
        let mut gh = vec![f16::ZERO; n * c];
        sparse_categorical_crossentropy(&p, &labels, n, c, 1.0, &mut gh).unwrap();
        for i in 0..g.len() {
            assert_eq!(gh[i], f16::from_f32(g[i]));
        }
    }
}

#[test]
fn sparse_cce_rejects_bad_labels_without_writing() {
    let p = vec![0.25f32; 3 * 4];
    let mut g = vec![7f32; 12];
    let e = sparse_categorical_crossentropy(&p, &[0, 4, 1], 3, 4, 1.0, &mut g).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("sample 1") && msg.contains("label 4") && msg.contains("4 classes"),
        "{msg}"
    );
    assert!(g.iter().all(|&v| v == 7.0));
    let e = sparse_categorical_crossentropy_eval(&p, &[0, 1, -1], 3, 4).unwrap_err();
    assert!(
        e.to_string().contains("sample 2") && e.to_string().contains("label -1"),
        "{e}"
    );
    assert!(sparse_categorical_crossentropy(&p, &[0, 1], 3, 4, 1.0, &mut g).is_err());
    assert!(sparse_categorical_crossentropy(&p, &[0, 1, 2], 3, 4, 1.0, &mut g[..11]).is_err());
    assert!(sparse_categorical_crossentropy_eval(&p, &[], 0, 4).is_err());
}

#[test]
fn sparse_cce_clips_zero_probability_and_counts_ties_first() {
    // p[label] = 0 → −ln(1e-7) ≈ 16.118, finite.
    let p = [0.0f32, 1.0, 0.5, 0.5];
    let out = sparse_categorical_crossentropy_eval(&p, &[0, 1], 2, 2).unwrap();
    let want = (-(1e-7f64).ln() + -(0.5f64).ln()) / 2.0;
    assert!((out.loss as f64 - want).abs() < 1e-5, "{}", out.loss);
    // Row 2 is a tie: arg-max picks class 0, label 1 → not correct.
    assert_eq!(out.correct, 0);
}

fn bce_ref(p: f64, t: f64) -> f64 {
    let e = 1e-7;
    let pc = p.clamp(e, 1.0 - e);
    -(t * (pc + e).ln() + (1.0 - t) * (1.0 - pc + e).ln())
}

#[test]
fn binary_crossentropy_with_sigmoid_value_and_gradient() {
    let mut rng = Rng::new(51);
    for reduction in [Reduction::Mean, Reduction::SumOverFeaturesMeanOverBatch] {
        for _ in 0..3 {
            let (n, f) = (rng.pick(SIZES), rng.pick(SIZES) + 1);
            let logits = rng.vec(n * f, -4.0, 4.0);
            let t = rng.vec(n * f, 0.0, 1.0); // soft targets (pixel intensities in the VAE)
            let mut p = vec![0f32; n * f];
            sigmoid_forward(&logits, &mut p).unwrap();
            let mut g = vec![f32::NAN; n * f];
            let loss =
                binary_crossentropy_with_sigmoid(&p, &t, n, f, reduction, 1.0, &mut g).unwrap();
            let denom = match reduction {
                Reduction::Mean => (n * f) as f64,
                Reduction::SumOverFeaturesMeanOverBatch => n as f64,
            };
            let want: f64 = p
                .iter()
                .zip(&t)
                .map(|(&a, &b)| bce_ref(a as f64, b as f64))
                .sum::<f64>()
                / denom;
            assert!(
                (loss as f64 - want).abs() < 1e-5 * want.max(1.0),
                "{loss} vs {want}"
            );
            let num = numeric_grad(&logits, |lp| {
                let mut pp = vec![0f32; n * f];
                sigmoid_forward(lp, &mut pp).unwrap();
                binary_crossentropy_eval(&pp, &t, n, f, reduction).unwrap() as f64
            });
            // The fused gradient (p − t)/denom is the exact derivative of the unclipped value.
            let atol = LOSS_ATOL * (1.0 + want);
            assert_grad("bce+sigmoid dlogits", &g, &num, atol, GRAD_RTOL);
            let mut g4 = vec![0f32; n * f];
            binary_crossentropy_with_sigmoid(&p, &t, n, f, reduction, 4.0, &mut g4).unwrap();
            assert!(g4.iter().zip(&g).all(|(a, b)| *a == 4.0 * b));
        }
    }
}

/// BCE of a logit in f64, unclipped: `ln(1 + e^x) − x·t`.
fn bce_logits_ref(x: f64, t: f64) -> f64 {
    x.max(0.0) - x * t + (-x.abs()).exp().ln_1p()
}

#[test]
fn binary_crossentropy_from_logits_value_gradient_and_extremes() {
    let mut rng = Rng::new(53);
    for reduction in [Reduction::Mean, Reduction::SumOverFeaturesMeanOverBatch] {
        for _ in 0..3 {
            let (n, f) = (rng.pick(SIZES), rng.pick(SIZES) + 1);
            let logits = rng.vec(n * f, -6.0, 6.0);
            let t = rng.vec(n * f, 0.0, 1.0);
            let mut g = vec![f32::NAN; n * f];
            let loss =
                binary_crossentropy_from_logits(&logits, &t, n, f, reduction, 1.0, &mut g).unwrap();
            let denom = match reduction {
                Reduction::Mean => (n * f) as f64,
                Reduction::SumOverFeaturesMeanOverBatch => n as f64,
            };
            let want: f64 = logits
                .iter()
                .zip(&t)
                .map(|(&x, &y)| bce_logits_ref(x as f64, y as f64))
                .sum::<f64>()
                / denom;
            assert!(
                (loss as f64 - want).abs() < 1e-5 * want.max(1.0),
                "{loss} vs {want}"
            );
            let ev = binary_crossentropy_from_logits_eval(&logits, &t, n, f, reduction).unwrap();
            assert_eq!(ev, loss);
            let num = numeric_grad(&logits, |lp| {
                binary_crossentropy_from_logits_eval(lp, &t, n, f, reduction).unwrap() as f64
            });
            assert_grad("bce logits", &g, &num, LOSS_ATOL * (1.0 + want), GRAD_RTOL);
        }
    }
    // Confident logits: exact and finite where σ(x) rounds to 0 or 1 in f32 (a clipped
    // log(σ(x)) would cap the first at 16.1).
    let x = [-100f32, 100.0, 30.0, -30.0, 0.0];
    let t = [1f32, 0.0, 1.0, 1.0, 0.5];
    let mut g = [0f32; 5];
    let loss = binary_crossentropy_from_logits(&x, &t, 1, 5, Reduction::Mean, 1.0, &mut g).unwrap();
    let want: f64 = x
        .iter()
        .zip(&t)
        .map(|(&a, &b)| bce_logits_ref(a as f64, b as f64))
        .sum::<f64>()
        / 5.0;
    assert!((loss as f64 - want).abs() < 1e-5 * want, "{loss} vs {want}");
    assert!(
        want > 40.0,
        "the wrong confident logits cost about 100 + 30"
    );
    let wg: Vec<f32> = [-1.0, 1.0, 0.0, -1.0, 0.0]
        .iter()
        .map(|v| v / 5.0)
        .collect();
    for (a, b) in g.iter().zip(&wg) {
        assert!((a - b).abs() < 1e-6, "{g:?} vs {wg:?}");
    }
}

#[test]
fn binary_crossentropy_on_probabilities_gradient() {
    let mut rng = Rng::new(52);
    for reduction in [Reduction::Mean, Reduction::SumOverFeaturesMeanOverBatch] {
        let (n, f) = (5, 7);
        let p = rng.vec(n * f, 0.05, 0.95);
        let t: Vec<f32> = (0..n * f).map(|i| (i % 2) as f32).collect();
        let mut g = vec![f32::NAN; n * f];
        let loss = binary_crossentropy(&p, &t, n, f, reduction, 1.0, &mut g).unwrap();
        assert_eq!(
            loss,
            binary_crossentropy_eval(&p, &t, n, f, reduction).unwrap()
        );
        let num = numeric_grad(&p, |pp| {
            binary_crossentropy_eval(pp, &t, n, f, reduction).unwrap() as f64
        });
        assert_grad(
            "bce dp",
            &g,
            &num,
            LOSS_ATOL * (1.0 + loss as f64),
            GRAD_RTOL,
        );
    }
    // Outside the clip range the gradient is 0 and the value finite.
    let mut g = [9f32; 2];
    let loss = binary_crossentropy(
        &[0.0f32, 1.0],
        &[1.0f32, 0.0],
        1,
        2,
        Reduction::Mean,
        1.0,
        &mut g,
    )
    .unwrap();
    assert!(loss.is_finite() && loss > 15.0);
    assert_eq!(g, [0.0, 0.0]);
}

#[test]
fn mean_squared_error_both_reductions() {
    let mut rng = Rng::new(53);
    for reduction in [Reduction::Mean, Reduction::SumOverFeaturesMeanOverBatch] {
        let (n, f) = (rng.pick(SIZES), rng.pick(SIZES) + 2);
        let pred = rng.vec(n * f, -2.0, 2.0);
        let t: Vec<f16> = rng
            .vec(n * f, -2.0, 2.0)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let mut g = vec![f32::NAN; n * f];
        let loss = mean_squared_error(&pred, &t, n, f, reduction, 1.0, &mut g).unwrap();
        let denom = if reduction == Reduction::Mean {
            (n * f) as f64
        } else {
            n as f64
        };
        let want: f64 = pred
            .iter()
            .zip(&t)
            .map(|(&a, b)| (a as f64 - b.to_f32() as f64).powi(2))
            .sum::<f64>()
            / denom;
        assert!((loss as f64 - want).abs() < 1e-5 * want.max(1.0));
        assert_eq!(
            loss,
            mean_squared_error_eval(&pred, &t, n, f, reduction).unwrap()
        );
        let num = numeric_grad(&pred, |pp| {
            mean_squared_error_eval(pp, &t, n, f, reduction).unwrap() as f64
        });
        assert_grad("mse", &g, &num, LOSS_ATOL * (1.0 + want), GRAD_RTOL);
    }
    assert!(mean_squared_error(
        &[0f32; 4],
        &[0f32; 3],
        2,
        2,
        Reduction::Mean,
        1.0,
        &mut [0f32; 4]
    )
    .is_err());
    assert!(mean_squared_error_eval(&[0f32; 0], &[0f32; 0], 0, 2, Reduction::Mean).is_err());
}

#[test]
fn kl_divergence_value_and_gradients() {
    let mut rng = Rng::new(54);
    for _ in 0..3 {
        let (n, z) = (rng.pick(SIZES), rng.pick(SIZES) + 1);
        let mean = rng.vec(n * z, -1.5, 1.5);
        let logvar = rng.vec(n * z, -2.0, 1.0);
        let (mut dm, mut dl) = (vec![f32::NAN; n * z], vec![f32::NAN; n * z]);
        let kl =
            kl_divergence_standard_normal(&mean, &logvar, n, z, 1.0, &mut dm, &mut dl).unwrap();
        let want: f64 = (0..n * z)
            .map(|i| {
                let (m, l) = (mean[i] as f64, logvar[i] as f64);
                -0.5 * (1.0 + l - m * m - l.exp())
            })
            .sum::<f64>()
            / n as f64;
        assert!(
            (kl as f64 - want).abs() < 1e-5 * want.max(1.0),
            "{kl} vs {want}"
        );
        assert_eq!(
            kl,
            kl_divergence_standard_normal_eval(&mean, &logvar, n, z).unwrap()
        );
        let num_m = numeric_grad(&mean, |mp| {
            kl_divergence_standard_normal_eval(mp, &logvar, n, z).unwrap() as f64
        });
        let num_l = numeric_grad(&logvar, |lp| {
            kl_divergence_standard_normal_eval(&mean, lp, n, z).unwrap() as f64
        });
        assert_grad("kl dmean", &dm, &num_m, LOSS_ATOL * (1.0 + want), GRAD_RTOL);
        assert_grad(
            "kl dlogvar",
            &dl,
            &num_l,
            LOSS_ATOL * (1.0 + want),
            GRAD_RTOL,
        );
        let (mut dm2, mut dl2) = (vec![0f32; n * z], vec![0f32; n * z]);
        kl_divergence_standard_normal(&mean, &logvar, n, z, 0.5, &mut dm2, &mut dl2).unwrap();
        assert!(dm2.iter().zip(&dm).all(|(a, b)| *a == 0.5 * b));
        assert!(dl2.iter().zip(&dl).all(|(a, b)| *a == 0.5 * b));
    }
    let mut d = [0f32; 4];
    let mut d2 = [0f32; 3];
    assert!(
        kl_divergence_standard_normal(&[0f32; 4], &[0f32; 4], 2, 2, 1.0, &mut d, &mut d2).is_err()
    );
}

#[test]
fn large_batch_loss_is_deterministic_and_accurate() {
    // Enough rows for the parallel split; the split is fixed, so two runs agree bit for bit.
    let mut rng = Rng::new(55);
    let (n, f) = (3000, 37);
    let p = rng.vec(n * f, 0.01, 0.99);
    let t = rng.vec(n * f, 0.0, 1.0);
    let mut g1 = vec![0f32; n * f];
    let mut g2 = vec![0f32; n * f];
    let r = Reduction::SumOverFeaturesMeanOverBatch;
    let l1 = binary_crossentropy_with_sigmoid(&p, &t, n, f, r, 1.0, &mut g1).unwrap();
    let l2 = binary_crossentropy_with_sigmoid(&p, &t, n, f, r, 1.0, &mut g2).unwrap();
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert_eq!(bits(&g1), bits(&g2));
    let want: f64 = p
        .iter()
        .zip(&t)
        .map(|(&a, &b)| bce_ref(a as f64, b as f64))
        .sum::<f64>()
        / n as f64;
    assert!((l1 as f64 - want).abs() < 1e-6 * want, "{l1} vs {want}");
}
