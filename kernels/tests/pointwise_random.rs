//! Philox4x32-10 against Random123's known answers, stream layout, uniform/normal statistics,
//! dropout reproducibility and rate, sample_normal forward/backward.
mod pointwise_util;

use half::f16;
use memwise_kernels::elementwise::GradWrite;
use memwise_kernels::random::*;
use pointwise_util::*;

#[test]
fn philox4x32_10_known_answers() {
    // Random123 kat_vectors, "philox4x32 10": counter[4] key[2] → output[4].
    assert_eq!(
        philox4x32_10([0, 0, 0, 0], [0, 0]),
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    );
    assert_eq!(
        philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    );
    assert_eq!(
        philox4x32_10(
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0]
        ),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}

#[test]
fn stream_layout_is_as_documented() {
    let k = RngKey {
        seed: 0x0123_4567_89ab_cdef,
        layer: 7,
        step: 0x1_0000_0002,
        first_block: 0,
    };
    let key = [0x89ab_cdef, 0x0123_4567];
    for i in [0u64, 1, 2, 3, 4, 5, 1023, 40_001] {
        let w = philox4x32_10([(i / 4) as u32, 2, 1, 7], key)[(i % 4) as usize];
        assert_eq!(k.uniform_at(i), unit_f32(w), "element {i}");
    }
    // Scalar API: counter goes to words 0 and 1, key split lo/hi.
    let w = philox4x32_10([5, 0, 0, 0], [9, 0])[0];
    assert_eq!(uniform(9, 5), unit_f32(w));
    let w = philox4x32_10([5, 0, 0, 0], [9, 0]);
    assert_eq!(normal(9, 5), box_muller(w[0], w[1]).0);
    // Every part of the key changes the stream.
    let base = k.block(0);
    assert_ne!(
        RngKey {
            seed: k.seed + 1,
            ..k
        }
        .block(0),
        base
    );
    assert_ne!(RngKey { layer: 8, ..k }.block(0), base);
    assert_ne!(
        RngKey {
            step: k.step + 1,
            first_block: 0,
            ..k
        }
        .block(0),
        base
    );
    assert_ne!(k.block(1), base);
}

#[test]
fn uniform_and_normal_statistics() {
    let k = RngKey {
        seed: 42,
        layer: 1,
        step: 3,
        first_block: 0,
    };
    let n = 200_000u64;
    let (mut s, mut s2, mut lo, mut hi) = (0f64, 0f64, 1f32, 0f32);
    for i in 0..n {
        let u = k.uniform_at(i);
        assert!((0.0..1.0).contains(&u));
        s += u as f64;
        s2 += (u as f64).powi(2);
        lo = lo.min(u);
        hi = hi.max(u);
    }
    let mean = s / n as f64;
    let var = s2 / n as f64 - mean * mean;
    // σ of the mean is sqrt(1/12/n) ≈ 6.5e-4: allow 5σ.
    assert!((mean - 0.5).abs() < 3.3e-3, "{mean}");
    assert!((var - 1.0 / 12.0).abs() < 2e-3, "{var}");
    assert!(lo < 1e-4 && hi > 1.0 - 1e-4);
    assert_eq!(unit_f32(u32::MAX), 1.0 - 1.0 / 16_777_216.0);
    assert_eq!(unit_f32(0), 0.0);

    let (mut s, mut s2, mut s4) = (0f64, 0f64, 0f64);
    for i in 0..n {
        let z = k.normal_at(i) as f64;
        assert!(z.is_finite());
        s += z;
        s2 += z * z;
        s4 += z.powi(4);
    }
    let mean = s / n as f64;
    let var = s2 / n as f64 - mean * mean;
    assert!(mean.abs() < 0.012, "{mean}"); // σ ≈ 2.2e-3
    assert!((var - 1.0).abs() < 0.02, "{var}");
    assert!((s4 / n as f64 - 3.0).abs() < 0.1, "kurtosis"); // a normal's 4th moment is 3
                                                            // Box–Muller's extreme: u1 = 2^-24 gives r = sqrt(2·24·ln 2) ≈ 5.77, finite.
    let (a, _) = box_muller(0, 0);
    assert!(a.is_finite() && a > 5.7);
}

#[test]
fn dropout_mask_is_reproducible_and_keeps_one_minus_rate() {
    let k = RngKey {
        seed: 1234,
        layer: 3,
        step: 17,
        first_block: 0,
    };
    let n = 100_003;
    let rate = 0.3;
    let x: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
    let mut y = vec![0f32; n];
    let mut m1 = vec![9u8; n];
    dropout_forward(k, rate, &x, &mut y, &mut m1).unwrap();
    // Same key: same mask, whichever entry point (forward, mask-only, element API).
    let mut m2 = vec![0u8; n];
    dropout_mask(k, rate, &mut m2).unwrap();
    assert_eq!(m1, m2);
    for i in (0..n).step_by(97) {
        assert_eq!(m1[i], (k.uniform_at(i as u64) >= rate) as u8, "element {i}");
    }
    // Another step or layer: a different mask.
    dropout_mask(RngKey { step: 18, ..k }, rate, &mut m2).unwrap();
    assert_ne!(m1, m2);
    dropout_mask(RngKey { layer: 4, ..k }, rate, &mut m2).unwrap();
    assert_ne!(m1, m2);
    // Kept fraction: σ = sqrt(0.21/n) ≈ 1.45e-3; allow 5σ.
    let kept = m1.iter().map(|&v| v as usize).sum::<usize>() as f64 / n as f64;
    assert!((kept - 0.7).abs() < 7.5e-3, "{kept}");
    assert!(m1.iter().all(|&v| v <= 1));
    // y = x · mask · (1 / (1 − rate)), the scale rounded to f32 once (as tf.nn.dropout).
    let scale = 1.0f32 / (1.0 - rate);
    for i in 0..n {
        let want = if m1[i] == 1 { x[i] * scale } else { 0.0 };
        assert_eq!(y[i], want);
    }
    let mut ip = x.clone();
    let mut m3 = vec![0u8; n];
    dropout_forward_inplace(k, rate, &mut ip, &mut m3).unwrap();
    assert_eq!(bits(&ip), bits(&y));
    assert_eq!(m3, m1);
    // rate 0 keeps everything and is the identity.
    dropout_forward(k, 0.0, &x, &mut y, &mut m2).unwrap();
    assert!(m2.iter().all(|&v| v == 1));
    assert_eq!(y, x);
}

#[test]
fn dropout_backward_matches_finite_differences_and_errors() {
    let mut rng = Rng::new(40);
    let k = RngKey {
        seed: 9,
        layer: 0,
        step: 0,
        first_block: 0,
    };
    for trial in 0..3 {
        let n = rng.pick(SIZES) * rng.pick(SIZES) + trial;
        let x = rng.vec(n, -1.0, 1.0);
        let r = rng.vec(n, -1.0, 1.0);
        let mut mask = vec![0u8; n];
        let mut y = vec![0f32; n];
        dropout_forward(k, 0.5, &x, &mut y, &mut mask).unwrap();
        let mut dx = vec![f32::NAN; n];
        dropout_backward(0.5, &mask, &r, &mut dx).unwrap();
        let num = numeric_grad(&x, |xp| {
            let (mut yp, mut m) = (vec![0f32; n], vec![0u8; n]);
            dropout_forward(k, 0.5, xp, &mut yp, &mut m).unwrap();
            dot(&yp, &r)
        });
        assert_grad("dropout", &dx, &num, GRAD_ATOL, GRAD_RTOL);
        let mut ip = r.clone();
        dropout_backward_inplace(0.5, &mask, &mut ip).unwrap();
        assert_eq!(bits(&ip), bits(&dx));
    }
    let mut m = [0u8; 4];
    let mut y = [0f32; 4];
    for bad in [1.0, -0.1, 1.5, f32::NAN] {
        assert!(
            dropout_forward(k, bad, &[0f32; 4], &mut y, &mut m).is_err(),
            "{bad}"
        );
    }
    assert!(dropout_forward(k, 0.5, &[0f32; 4], &mut y, &mut m[..3]).is_err());
    assert!(dropout_backward(0.5, &m[..3], &[0f32; 4], &mut y).is_err());
    // Half precision: mask identical, values rounded once.
    let xh = vec![f16::from_f32(0.7); 4];
    let mut yh = vec![f16::ZERO; 4];
    let mut mh = [0u8; 4];
    dropout_forward(k, 0.25, &xh, &mut yh, &mut mh).unwrap();
    dropout_mask(k, 0.25, &mut m).unwrap();
    assert_eq!(mh, m);
    for i in 0..4 {
        let want = if m[i] == 1 {
            f16::from_f32(xh[i].to_f32() * (1.0 / 0.75))
        } else {
            f16::ZERO
        };
        assert_eq!(yh[i], want);
    }
}

#[test]
fn sample_normal_forward_and_backward() {
    let mut rng = Rng::new(41);
    let k = RngKey {
        seed: 77,
        layer: 5,
        step: 2,
        first_block: 0,
    };
    for trial in 0..3 {
        let n = rng.pick(SIZES) * 2 + trial;
        let mean = rng.vec(n, -1.0, 1.0);
        let logvar = rng.vec(n, -2.0, 1.0);
        let mut z = vec![0f32; n];
        sample_normal_forward(k, &mean, &logvar, &mut z).unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| mean[i] as f64 + (0.5 * logvar[i] as f64).exp() * k.normal_at(i as u64) as f64)
            .collect();
        assert_close("z", &z, &want, 1e-6, 1e-6);

        let r = rng.vec(n, -1.0, 1.0);
        let (mut dm, mut dl) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        sample_normal_backward(k, &logvar, &r, &mut dm, &mut dl, GradWrite::Overwrite).unwrap();
        let fwd = |m: &[f32], l: &[f32]| {
            let mut zz = vec![0f32; n];
            sample_normal_forward(k, m, l, &mut zz).unwrap();
            dot(&zz, &r)
        };
        let num_m = numeric_grad(&mean, |mp| fwd(mp, &logvar));
        let num_l = numeric_grad(&logvar, |lp| fwd(&mean, lp));
        assert_grad("dmean", &dm, &num_m, GRAD_ATOL, GRAD_RTOL);
        assert_grad("dlogvar", &dl, &num_l, GRAD_ATOL, GRAD_RTOL);

        // Accumulate mode adds to what the KL loss already wrote.
        let (mut am, mut al) = (vec![1.0f32; n], vec![-1.0f32; n]);
        sample_normal_backward(k, &logvar, &r, &mut am, &mut al, GradWrite::Accumulate).unwrap();
        for i in 0..n {
            assert_eq!(am[i], 1.0 + dm[i]);
            assert_eq!(al[i], -1.0 + dl[i]);
        }
    }
    // Large tensor (parallel chunks) agrees with the per-element API.
    let n = 70_001;
    let mean = vec![0f32; n];
    let logvar = vec![0f32; n];
    let mut z = vec![0f32; n];
    sample_normal_forward(k, &mean, &logvar, &mut z).unwrap();
    for i in (0..n).step_by(101) {
        assert_eq!(z[i], k.normal_at(i as u64));
    }
    assert!(sample_normal_forward(k, &mean[1..], &logvar, &mut z).is_err());
    let mut d1 = vec![0f32; n];
    let mut d2 = vec![0f32; n - 1];
    assert!(
        sample_normal_backward(k, &logvar, &z, &mut d1, &mut d2, GradWrite::Overwrite).is_err()
    );
}
