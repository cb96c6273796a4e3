//! Batch norm and layer norm: forwards against f64 references (Keras semantics: biased
//! variance, momentum 0.99), backwards against central differences for x, gamma and beta
//! (tolerance `GRAD_ATOL`/`GRAD_RTOL`), in-place variants bit-identical, determinism.
mod pointwise_util;

use memwise_kernels::norm::*;
use pointwise_util::*;

struct Bn {
    y: Vec<f32>,
    x_hat: Vec<f32>,
    mean: Vec<f32>,
    inv_std: Vec<f32>,
    rm: Vec<f32>,
    rv: Vec<f32>,
}

fn bn_train(d: NormDims, x: &[f32], gamma: &[f32], beta: &[f32]) -> Bn {
    let (m, c) = (d.len(), d.channels);
    let mut o = Bn {
        y: vec![f32::NAN; m],
        x_hat: vec![f32::NAN; m],
        mean: vec![f32::NAN; 2 * c],
        inv_std: vec![f32::NAN; c],
        rm: vec![0.0; c], // Keras initialisers: moving_mean 0, moving_variance 1
        rv: vec![1.0; c],
    };
    batch_norm_train_forward(
        d,
        BatchNormConfig::KERAS,
        x,
        Affine { gamma, beta },
        &mut o.y,
        BatchNormSaved {
            x_hat: &mut o.x_hat,
            mean: &mut o.mean,
            inv_std: &mut o.inv_std,
        },
        Some(RunningStats {
            mean: &mut o.rm,
            var: &mut o.rv,
        }),
    )
    .unwrap();
    o
}

fn random_bn_case(rng: &mut Rng) -> (NormDims, Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = NormDims {
        rows: rng.pick(SIZES) * rng.pick(&[2, 3, 5]),
        channels: rng.pick(&[1, 2, 3, 5, 7, 33]),
    };
    let x = rng.vec(d.len(), -2.0, 3.0);
    let gamma = rng.vec(d.channels, 0.5, 1.5);
    let beta = rng.vec(d.channels, -0.5, 0.5);
    (d, x, gamma, beta)
}

#[test]
fn batch_norm_train_forward_matches_keras_reference() {
    let mut rng = Rng::new(30);
    for _ in 0..6 {
        let (d, x, gamma, beta) = random_bn_case(&mut rng);
        let (m, c) = (d.rows, d.channels);
        if m < 2 {
            continue;
        }
        let o = bn_train(d, &x, &gamma, &beta);
        let eps = 1e-3f64;
        let (mut y, mut xh) = (vec![0f64; m * c], vec![0f64; m * c]);
        for ch in 0..c {
            let col: Vec<f64> = (0..m).map(|r| x[r * c + ch] as f64).collect();
            let mu = col.iter().sum::<f64>() / m as f64;
            let var = col.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / m as f64; // biased
            let inv = 1.0 / (var + eps).sqrt();
            assert!((o.mean[ch] as f64 - mu).abs() < 1e-6);
            assert!((o.inv_std[ch] as f64 - inv).abs() < 1e-5 * inv);
            // Keras: moving = moving·0.99 + batch·0.01, from (0, 1).
            assert!((o.rm[ch] as f64 - 0.01 * mu).abs() < 1e-7);
            assert!((o.rv[ch] as f64 - (0.99 + 0.01 * var)).abs() < 1e-6);
            for r in 0..m {
                xh[r * c + ch] = (col[r] - mu) * inv;
                y[r * c + ch] = gamma[ch] as f64 * xh[r * c + ch] + beta[ch] as f64;
            }
        }
        assert_close("bn y", &o.y, &y, 1e-5, 1e-5);
        assert_close("bn x_hat", &o.x_hat, &xh, 1e-5, 1e-5);
    }
}

#[test]
fn batch_norm_backward_matches_finite_differences() {
    let mut rng = Rng::new(31);
    for _ in 0..6 {
        let (d, x, gamma, beta) = random_bn_case(&mut rng);
        if d.rows < 2 {
            continue;
        }
        let r = rng.vec(d.len(), -1.0, 1.0);
        let o = bn_train(d, &x, &gamma, &beta);
        let mut dx = vec![f32::NAN; d.len()];
        // Parameter gradients accumulate: start from 1.0 and expect 1.0 + gradient.
        let mut dgamma = vec![1.0f32; d.channels];
        let mut dbeta = vec![1.0f32; d.channels];
        batch_norm_backward(
            d,
            &o.x_hat,
            &o.inv_std,
            &gamma,
            &r,
            &mut dx,
            AffineGrads {
                dgamma: &mut dgamma,
                dbeta: &mut dbeta,
            },
        )
        .unwrap();
        let num_x = numeric_grad(&x, |xp| dot(&bn_train(d, xp, &gamma, &beta).y, &r));
        assert_grad("bn dx", &dx, &num_x, GRAD_ATOL, GRAD_RTOL);
        let num_g = numeric_grad(&gamma, |gp| dot(&bn_train(d, &x, gp, &beta).y, &r));
        let num_b = numeric_grad(&beta, |bp| dot(&bn_train(d, &x, &gamma, bp).y, &r));
        let dg: Vec<f32> = dgamma.iter().map(|v| v - 1.0).collect();
        let db: Vec<f32> = dbeta.iter().map(|v| v - 1.0).collect();
        assert_grad("bn dgamma", &dg, &num_g, GRAD_ATOL, GRAD_RTOL);
        assert_grad("bn dbeta", &db, &num_b, GRAD_ATOL, GRAD_RTOL);

        // In place (dx over dy) gives the same bits.
        let mut ip = r.clone();
        let (mut g2, mut b2) = (vec![1.0f32; d.channels], vec![1.0f32; d.channels]);
        batch_norm_backward_inplace(
            d,
            &o.x_hat,
            &o.inv_std,
            &gamma,
            &mut ip,
            AffineGrads {
                dgamma: &mut g2,
                dbeta: &mut b2,
            },
        )
        .unwrap();
        assert_eq!(bits(&ip), bits(&dx));
        assert_eq!(bits(&g2), bits(&dgamma));
        assert_eq!(bits(&b2), bits(&dbeta));

        // Rebuilding x̂ from the input and the hi/lo mean gives the same bits too.
        let mut rebuilt = vec![f32::NAN; d.len()];
        let (mut g3, mut b3) = (vec![1.0f32; d.channels], vec![1.0f32; d.channels]);
        batch_norm_backward_rebuild(
            d,
            &x,
            &o.mean,
            &o.inv_std,
            &gamma,
            &r,
            &mut rebuilt,
            AffineGrads {
                dgamma: &mut g3,
                dbeta: &mut b3,
            },
        )
        .unwrap();
        assert_eq!(bits(&rebuilt), bits(&dx));
        assert_eq!(bits(&g3), bits(&dgamma));
        assert_eq!(bits(&b3), bits(&dbeta));
    }
}

/// The rebuilt x̂ is the kept one bit for bit in 16-bit storage and with a large offset
/// (|mean| ≫ σ, where only the hi/lo mean reproduces the forward's rounding), and a short
/// mean is refused.
#[test]
fn batch_norm_backward_rebuild_matches_the_kept_x_hat_in_half_precision() {
    use half::f16;
    let d = NormDims {
        rows: 37,
        channels: 5,
    };
    let mut rng = Rng::new(38);
    let x: Vec<f16> = rng
        .vec(d.len(), -1.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| f16::from_f32(v + 300.0 * (i % 5) as f32))
        .collect();
    let (gamma, beta) = (rng.vec(5, 0.5, 1.5), rng.vec(5, -0.5, 0.5));
    let dy: Vec<f16> = rng
        .vec(d.len(), -1.0, 1.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let (mut y, mut xh) = (vec![f16::ZERO; d.len()], vec![f16::ZERO; d.len()]);
    let (mut mean, mut inv) = (vec![0f32; 10], vec![0f32; 5]);
    batch_norm_train_forward(
        d,
        BatchNormConfig::KERAS,
        &x,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        &mut y,
        BatchNormSaved {
            x_hat: &mut xh,
            mean: &mut mean,
            inv_std: &mut inv,
        },
        None,
    )
    .unwrap();
    let backward = |rebuild: bool, mean: &[f32]| {
        let mut dx = vec![f16::ZERO; d.len()];
        let (mut dg, mut db) = (vec![0f32; 5], vec![0f32; 5]);
        let grads = AffineGrads {
            dgamma: &mut dg,
            dbeta: &mut db,
        };
        let r = if rebuild {
            batch_norm_backward_rebuild(d, &x, mean, &inv, &gamma, &dy, &mut dx, grads)
        } else {
            batch_norm_backward(d, &xh, &inv, &gamma, &dy, &mut dx, grads)
        };
        r.map(|()| (dx, dg, db))
    };
    let (kept, rebuilt) = (
        backward(false, &mean).unwrap(),
        backward(true, &mean).unwrap(),
    );
    assert_eq!(kept, rebuilt);
    let err = backward(true, &mean[..5]).unwrap_err().to_string();
    assert!(err.contains("mean"), "{err}");
}

/// The layer-norm backward that recomputes each row's mean and rebuilds x̂ from the input gives
/// the kept-x̂ backward's bits, in f32 and in f16 with |mean| ≫ σ (where a mean computed any
/// other way would round x̂ differently); a short mean scratch is refused.
#[test]
fn layer_norm_backward_rebuild_matches_the_kept_x_hat() {
    fn case<T: memwise_kernels::Element + std::fmt::Debug + PartialEq>(offset: f32) {
        let d = NormDims {
            rows: 23,
            channels: 70,
        };
        let mut rng = Rng::new(41);
        let x: Vec<T> = rng
            .vec(d.len(), -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| T::from_f32(v + offset * (i / 70 % 3) as f32))
            .collect();
        let (gamma, beta) = (rng.vec(70, 0.5, 1.5), rng.vec(70, -0.5, 0.5));
        let dy: Vec<T> = rng
            .vec(d.len(), -1.0, 1.0)
            .into_iter()
            .map(T::from_f32)
            .collect();
        let (mut y, mut xh) = (
            vec![T::from_f32(0.0); d.len()],
            vec![T::from_f32(0.0); d.len()],
        );
        let mut rstd = vec![0f32; d.rows];
        let affine = Affine {
            gamma: &gamma,
            beta: &beta,
        };
        layer_norm_forward(d, 1e-5, &x, affine, &mut y, &mut xh, &mut rstd).unwrap();
        let backward = |rebuild: bool, mean_len: usize| {
            let mut dx = vec![T::from_f32(0.0); d.len()];
            let (mut dg, mut db) = (vec![0f32; 70], vec![0f32; 70]);
            let mut mean = vec![f32::NAN; mean_len];
            let grads = AffineGrads {
                dgamma: &mut dg,
                dbeta: &mut db,
            };
            let r = if rebuild {
                layer_norm_backward_rebuild(d, &x, &rstd, &gamma, &dy, &mut dx, &mut mean, grads)
            } else {
                layer_norm_backward(d, &xh, &rstd, &gamma, &dy, &mut dx, grads)
            };
            r.map(|()| (dx, dg, db))
        };
        let (kept, rebuilt) = (backward(false, 0).unwrap(), backward(true, d.rows).unwrap());
        assert_eq!(kept, rebuilt);
        let err = backward(true, d.rows - 1).unwrap_err().to_string();
        assert!(err.contains("mean"), "{err}");
    }
    case::<f32>(0.0);
    case::<f32>(1000.0);
    case::<half::f16>(300.0);
}

#[test]
fn batch_norm_inplace_forward_and_inference() {
    let mut rng = Rng::new(32);
    let (d, x, gamma, beta) = random_bn_case(&mut rng);
    let o = bn_train(d, &x, &gamma, &beta);
    let mut xy = x.clone();
    let (mut xh, mut mean, mut inv) = (
        vec![0f32; d.len()],
        vec![0f32; 2 * d.channels],
        vec![0f32; d.channels],
    );
    let (mut rm, mut rv) = (vec![0f32; d.channels], vec![1f32; d.channels]);
    batch_norm_train_forward_inplace(
        d,
        BatchNormConfig::default(),
        &mut xy,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        BatchNormSaved {
            x_hat: &mut xh,
            mean: &mut mean,
            inv_std: &mut inv,
        },
        Some(RunningStats {
            mean: &mut rm,
            var: &mut rv,
        }),
    )
    .unwrap();
    assert_eq!(bits(&xy), bits(&o.y));
    assert_eq!(bits(&xh), bits(&o.x_hat));
    assert_eq!(bits(&rv), bits(&o.rv));

    // Inference from running stats.
    let rmean = rng.vec(d.channels, -1.0, 1.0);
    let rvar = rng.vec(d.channels, 0.5, 2.0);
    let mut y = vec![0f32; d.len()];
    batch_norm_infer_forward(
        d,
        1e-3,
        &x,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        &rmean,
        &rvar,
        &mut y,
    )
    .unwrap();
    let c = d.channels;
    let want: Vec<f64> = (0..d.len())
        .map(|i| {
            let ch = i % c;
            gamma[ch] as f64 * (x[i] as f64 - rmean[ch] as f64) / (rvar[ch] as f64 + 1e-3).sqrt()
                + beta[ch] as f64
        })
        .collect();
    assert_close("bn infer", &y, &want, 1e-5, 1e-5);
    let mut ip = x.clone();
    batch_norm_infer_forward_inplace(
        d,
        1e-3,
        &mut ip,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        &rmean,
        &rvar,
    )
    .unwrap();
    assert_eq!(bits(&ip), bits(&y));
}

#[test]
fn batch_norm_large_is_accurate_and_deterministic() {
    // 60 000 rows × 3 channels with a large offset: two-pass f64 statistics stay exact where
    // a one-pass f32 E[x²] − E[x]² would lose most digits; runs on the parallel path.
    let mut rng = Rng::new(33);
    let d = NormDims {
        rows: 60_000,
        channels: 3,
    };
    let x: Vec<f32> = rng
        .vec(d.len(), -1.0, 1.0)
        .iter()
        .map(|v| v + 1000.0)
        .collect();
    let (gamma, beta) = (vec![1.0f32; 3], vec![0.0f32; 3]);
    let a = bn_train(d, &x, &gamma, &beta);
    let b = bn_train(d, &x, &gamma, &beta);
    assert_eq!(bits(&a.y), bits(&b.y));
    assert_eq!(bits(&a.inv_std), bits(&b.inv_std));
    for ch in 0..3 {
        let col: Vec<f64> = (0..d.rows).map(|r| x[r * 3 + ch] as f64).collect();
        let mu = col.iter().sum::<f64>() / d.rows as f64;
        let var = col.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / d.rows as f64;
        assert!((a.inv_std[ch] as f64 * (var + 1e-3).sqrt() - 1.0).abs() < 1e-6);
    }
    let dy = rng.vec(d.len(), -1.0, 1.0);
    let mut dx1 = vec![0f32; d.len()];
    let mut dx2 = vec![0f32; d.len()];
    for dx in [&mut dx1, &mut dx2] {
        let (mut g, mut bb) = (vec![0f32; 3], vec![0f32; 3]);
        batch_norm_backward(
            d,
            &a.x_hat,
            &a.inv_std,
            &gamma,
            &dy,
            dx,
            AffineGrads {
                dgamma: &mut g,
                dbeta: &mut bb,
            },
        )
        .unwrap();
    }
    assert_eq!(bits(&dx1), bits(&dx2));
    // Σ dx over a channel is 0 for batch norm (the mean is subtracted).
    for ch in 0..3 {
        let s: f64 = (0..d.rows).map(|r| dx1[r * 3 + ch] as f64).sum();
        assert!(s.abs() < 1e-4, "{s}");
    }
}

#[test]
fn batch_norm_errors() {
    let d = NormDims {
        rows: 4,
        channels: 2,
    };
    let x = [0f32; 8];
    let (g, b) = ([1f32; 2], [0f32; 2]);
    let mut y = [0f32; 8];
    let (mut xh, mut mean, mut inv, mut rm, mut rv) =
        ([0f32; 8], [0f32; 4], [0f32; 2], [0f32; 2], [0f32; 1]);
    let e = batch_norm_train_forward(
        d,
        BatchNormConfig::KERAS,
        &x,
        Affine {
            gamma: &g,
            beta: &b,
        },
        &mut y,
        BatchNormSaved {
            x_hat: &mut xh,
            mean: &mut mean,
            inv_std: &mut inv,
        },
        Some(RunningStats {
            mean: &mut rm,
            var: &mut rv,
        }),
    )
    .unwrap_err();
    assert!(e.to_string().contains("running var"), "{e}");
    // Nothing was written on error.
    assert_eq!(y, [0f32; 8]);
    let mut dx = [0f32; 7];
    let (mut dg, mut db) = ([0f32; 2], [0f32; 2]);
    assert!(batch_norm_backward(
        d,
        &xh,
        &inv,
        &g,
        &y,
        &mut dx,
        AffineGrads {
            dgamma: &mut dg,
            dbeta: &mut db
        }
    )
    .is_err());
    assert!(batch_norm_infer_forward(
        d,
        1e-3,
        &x,
        Affine {
            gamma: &g[..1],
            beta: &b
        },
        &rm,
        &rm,
        &mut y
    )
    .is_err());
}

// ---------------------------------------------------------------------------------------------

fn ln(d: NormDims, x: &[f32], gamma: &[f32], beta: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut y = vec![f32::NAN; d.len()];
    let mut xh = vec![f32::NAN; d.len()];
    let mut rstd = vec![f32::NAN; d.rows];
    layer_norm_forward(
        d,
        LAYER_NORM_EPSILON,
        x,
        Affine { gamma, beta },
        &mut y,
        &mut xh,
        &mut rstd,
    )
    .unwrap();
    (y, xh, rstd)
}

#[test]
fn layer_norm_forward_matches_reference() {
    let mut rng = Rng::new(34);
    for _ in 0..6 {
        let d = NormDims {
            rows: rng.pick(SIZES),
            channels: rng.pick(&[2, 3, 7, 13, 64, 129]),
        };
        let x = rng.vec(d.len(), -3.0, 2.0);
        let gamma = rng.vec(d.channels, 0.5, 1.5);
        let beta = rng.vec(d.channels, -0.5, 0.5);
        let (y, xh, rstd) = ln(d, &x, &gamma, &beta);
        let c = d.channels;
        let mut want = vec![0f64; d.len()];
        for r in 0..d.rows {
            let row = &x[r * c..(r + 1) * c];
            let mu = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + 1e-3).sqrt();
            assert!((rstd[r] as f64 - rs).abs() < 1e-5 * rs);
            for ch in 0..c {
                want[r * c + ch] = gamma[ch] as f64 * (row[ch] as f64 - mu) * rs + beta[ch] as f64;
            }
        }
        assert_close("ln y", &y, &want, 1e-5, 1e-5);
        let mut ip = x.clone();
        let (mut xh2, mut rs2) = (vec![0f32; d.len()], vec![0f32; d.rows]);
        layer_norm_forward_inplace(
            d,
            LAYER_NORM_EPSILON,
            &mut ip,
            Affine {
                gamma: &gamma,
                beta: &beta,
            },
            &mut xh2,
            &mut rs2,
        )
        .unwrap();
        assert_eq!(bits(&ip), bits(&y));
        assert_eq!(bits(&xh2), bits(&xh));
    }
}

#[test]
fn layer_norm_backward_matches_finite_differences() {
    let mut rng = Rng::new(35);
    for _ in 0..6 {
        let d = NormDims {
            rows: rng.pick(SIZES),
            channels: rng.pick(&[2, 3, 5, 7, 13, 40]),
        };
        let x = rng.vec(d.len(), -2.0, 2.0);
        let gamma = rng.vec(d.channels, 0.5, 1.5);
        let beta = rng.vec(d.channels, -0.5, 0.5);
        let r = rng.vec(d.len(), -1.0, 1.0);
        let (_, xh, rstd) = ln(d, &x, &gamma, &beta);
        let mut dx = vec![f32::NAN; d.len()];
        let (mut dg, mut db) = (vec![0.5f32; d.channels], vec![0.5f32; d.channels]);
        layer_norm_backward(
            d,
            &xh,
            &rstd,
            &gamma,
            &r,
            &mut dx,
            AffineGrads {
                dgamma: &mut dg,
                dbeta: &mut db,
            },
        )
        .unwrap();
        let num_x = numeric_grad(&x, |xp| dot(&ln(d, xp, &gamma, &beta).0, &r));
        assert_grad("ln dx", &dx, &num_x, GRAD_ATOL, GRAD_RTOL);
        let num_g = numeric_grad(&gamma, |gp| dot(&ln(d, &x, gp, &beta).0, &r));
        let num_b = numeric_grad(&beta, |bp| dot(&ln(d, &x, &gamma, bp).0, &r));
        let dg0: Vec<f32> = dg.iter().map(|v| v - 0.5).collect();
        let db0: Vec<f32> = db.iter().map(|v| v - 0.5).collect();
        assert_grad("ln dgamma", &dg0, &num_g, GRAD_ATOL, GRAD_RTOL);
        assert_grad("ln dbeta", &db0, &num_b, GRAD_ATOL, GRAD_RTOL);
        let mut ip = r.clone();
        let (mut dg2, mut db2) = (vec![0.5f32; d.channels], vec![0.5f32; d.channels]);
        layer_norm_backward_inplace(
            d,
            &xh,
            &rstd,
            &gamma,
            &mut ip,
            AffineGrads {
                dgamma: &mut dg2,
                dbeta: &mut db2,
            },
        )
        .unwrap();
        assert_eq!(bits(&ip), bits(&dx));
        assert_eq!(bits(&dg2), bits(&dg));
    }
}

#[test]
fn layer_norm_half_precision_and_errors() {
    use half::bf16;
    let mut rng = Rng::new(36);
    let d = NormDims {
        rows: 3,
        channels: 17,
    };
    let x = rng.vec(d.len(), -2.0, 2.0);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let (g, b) = (vec![1f32; 17], vec![0f32; 17]);
    let mut y = vec![bf16::ZERO; d.len()];
    let mut xh = vec![bf16::ZERO; d.len()];
    let mut rs = vec![0f32; 3];
    layer_norm_forward(
        d,
        LAYER_NORM_EPSILON,
        &xb,
        Affine {
            gamma: &g,
            beta: &b,
        },
        &mut y,
        &mut xh,
        &mut rs,
    )
    .unwrap();
    let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    let (y32, _, _) = ln(d, &xr, &g, &b);
    for i in 0..d.len() {
        assert_eq!(y[i], bf16::from_f32(y32[i]));
    }
    assert!(layer_norm_forward(
        d,
        1e-3,
        &xb[1..],
        Affine {
            gamma: &g,
            beta: &b
        },
        &mut y,
        &mut xh,
        &mut rs
    )
    .is_err());
    assert!(layer_norm_forward(
        d,
        1e-3,
        &xb,
        Affine {
            gamma: &g,
            beta: &b
        },
        &mut y,
        &mut xh,
        &mut rs[..2]
    )
    .is_err());
    let (mut dg, mut db) = (vec![0f32; 16], vec![0f32; 17]);
    let mut dx = vec![bf16::ZERO; d.len()];
    assert!(layer_norm_backward(
        d,
        &xh,
        &rs,
        &g,
        &y,
        &mut dx,
        AffineGrads {
            dgamma: &mut dg,
            dbeta: &mut db
        }
    )
    .is_err());
}

#[test]
fn batch_norm_recompute_without_running_update() {
    // A checkpointed segment recomputes the forward: same outputs, running stats untouched.
    let mut rng = Rng::new(37);
    let (d, x, gamma, beta) = random_bn_case(&mut rng);
    let o = bn_train(d, &x, &gamma, &beta);
    let mut y = vec![0f32; d.len()];
    let mut xh = vec![0f32; d.len()];
    let (mut mean, mut inv) = (vec![0f32; 2 * d.channels], vec![0f32; d.channels]);
    batch_norm_train_forward(
        d,
        BatchNormConfig::KERAS,
        &x,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        &mut y,
        BatchNormSaved {
            x_hat: &mut xh,
            mean: &mut mean,
            inv_std: &mut inv,
        },
        None,
    )
    .unwrap();
    assert_eq!(bits(&y), bits(&o.y));
    assert_eq!(bits(&xh), bits(&o.x_hat));
    assert_eq!(bits(&inv), bits(&o.inv_std));
}

/// f64 reference of group norm (RMS norm when uncentred, without a shift): the definition,
/// per sample and group, with no shared code with the kernel.
fn group_norm_ref(
    d: GroupNormDims,
    eps: f64,
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
) -> Vec<f64> {
    let (c, cg) = (d.channels, d.channels / d.groups);
    let mut y = vec![0f64; d.len()];
    for n in 0..d.samples {
        for g in 0..d.groups {
            let idx: Vec<usize> = (0..d.spatial)
                .flat_map(|s| (0..cg).map(move |j| (n * d.spatial + s) * c + g * cg + j))
                .collect();
            let len = idx.len() as f64;
            let mean = if d.center {
                idx.iter().map(|&i| x[i] as f64).sum::<f64>() / len
            } else {
                0.0
            };
            let var = idx
                .iter()
                .map(|&i| (x[i] as f64 - mean).powi(2))
                .sum::<f64>()
                / len;
            for &i in &idx {
                let ch = i % c;
                let shift = beta.map_or(0.0, |b| b[ch] as f64);
                y[i] = (x[i] as f64 - mean) / (var + eps).sqrt() * gamma[ch] as f64 + shift;
            }
        }
    }
    y
}

fn group_norm_y(
    d: GroupNormDims,
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut y, mut xh, mut rs) = (
        vec![0f32; d.len()],
        vec![0f32; d.len()],
        vec![0f32; d.stats()],
    );
    group_norm_forward(d, 1e-3, x, gamma, beta, &mut y, &mut xh, &mut rs).unwrap();
    (y, xh, rs)
}

/// Group norm over images in several groups and RMS norm over rows: forward against the f64
/// definition, `dx`, `dgamma` and `dbeta` against central differences, the parameter
/// gradients accumulated.
#[test]
fn group_and_rms_norm_match_the_definition_and_finite_differences() {
    let mut rng = Rng::new(37);
    for (samples, spatial, channels, groups, center) in [
        (2usize, 6usize, 8usize, 4usize, true),
        (3, 5, 6, 1, true),
        (2, 4, 5, 5, true),
        (1, 1, 12, 3, true),
        (7, 1, 13, 1, false),
        (3, 1, 40, 1, false),
    ] {
        let d = GroupNormDims {
            samples,
            spatial,
            channels,
            groups,
            center,
        };
        let what = format!("{d:?}");
        let x = rng.vec(d.len(), -2.0, 2.0);
        let gamma = rng.vec(channels, 0.5, 1.5);
        let beta_v = rng.vec(channels, -0.5, 0.5);
        let beta = center.then_some(&beta_v[..]);
        let (y, xh, rstd) = group_norm_y(d, &x, &gamma, beta);
        assert_close(
            &what,
            &y,
            &group_norm_ref(d, 1e-3, &x, &gamma, beta),
            1e-5,
            1e-5,
        );

        let r = rng.vec(d.len(), -1.0, 1.0);
        let mut dx = vec![f32::NAN; d.len()];
        let (mut dg, mut db) = (vec![0.5f32; channels], vec![0.5f32; channels]);
        let dbeta = center.then_some(&mut db[..]);
        group_norm_backward(d, &xh, &rstd, &gamma, &r, &mut dx, &mut dg, dbeta).unwrap();
        let num_x = numeric_grad(&x, |xp| dot(&group_norm_y(d, xp, &gamma, beta).0, &r));
        assert_grad(&format!("{what} dx"), &dx, &num_x, GRAD_ATOL, GRAD_RTOL);
        let num_g = numeric_grad(&gamma, |gp| dot(&group_norm_y(d, &x, gp, beta).0, &r));
        let dg0: Vec<f32> = dg.iter().map(|v| v - 0.5).collect();
        assert_grad(
            &format!("{what} dgamma"),
            &dg0,
            &num_g,
            GRAD_ATOL,
            GRAD_RTOL,
        );
        if center {
            let num_b = numeric_grad(&beta_v, |bp| {
                dot(&group_norm_y(d, &x, &gamma, Some(bp)).0, &r)
            });
            let db0: Vec<f32> = db.iter().map(|v| v - 0.5).collect();
            assert_grad(&format!("{what} dbeta"), &db0, &num_b, GRAD_ATOL, GRAD_RTOL);
        } else {
            assert!(
                db.iter().all(|&v| v == 0.5),
                "{what}: dbeta written without a shift"
            );
        }
    }
}

#[test]
fn group_norm_refuses_groups_that_do_not_divide_the_channels() {
    let d = GroupNormDims {
        samples: 1,
        spatial: 2,
        channels: 6,
        groups: 4,
        center: true,
    };
    let (x, g) = (vec![1f32; 12], vec![1f32; 6]);
    let (mut y, mut h, mut r) = (vec![0f32; 12], vec![0f32; 12], vec![0f32; 4]);
    let e = group_norm_forward(d, 1e-3, &x, &g, None, &mut y, &mut h, &mut r).unwrap_err();
    assert!(
        e.to_string()
            .contains("6 channels do not split into 4 groups"),
        "{e}"
    );
    assert!(y.iter().all(|&v| v == 0.0), "an error writes nothing");
}
