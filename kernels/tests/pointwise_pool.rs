//! Pooling: TF padding rule, forwards against naive f64 loops, backwards against central
//! differences (tolerance `GRAD_ATOL`/`GRAD_RTOL`), random odd/prime shapes.
mod pointwise_util;

use half::f16;
use memwise_kernels::pool::*;
use pointwise_util::*;

#[test]
fn tf_padding_rule() {
    // same: out = ceil(in/s), pad_total = max((out-1)s + k - in, 0), before = total/2.
    assert_eq!(tf_out_and_pad(5, 2, 2, Padding::Same).unwrap(), (3, 0)); // total 1
    assert_eq!(tf_out_and_pad(7, 3, 2, Padding::Same).unwrap(), (4, 1)); // total 2
    assert_eq!(tf_out_and_pad(6, 3, 1, Padding::Same).unwrap(), (6, 1)); // total 2
    assert_eq!(tf_out_and_pad(6, 4, 1, Padding::Same).unwrap(), (6, 1)); // total 3: 1 before
    assert_eq!(tf_out_and_pad(4, 1, 3, Padding::Same).unwrap(), (2, 0)); // k < s
    assert_eq!(tf_out_and_pad(7, 3, 2, Padding::Valid).unwrap(), (3, 0));
    assert_eq!(tf_out_and_pad(2, 2, 2, Padding::Valid).unwrap(), (1, 0));
    assert!(tf_out_and_pad(2, 3, 1, Padding::Valid).is_err());
    assert!(tf_out_and_pad(5, 0, 1, Padding::Same).is_err());
    assert!(tf_out_and_pad(5, 2, 0, Padding::Valid).is_err());
    let d = Pool2d::new(2, 7, 5, 3, (3, 2), (2, 2), Padding::Same).unwrap();
    assert_eq!((d.out_h, d.out_w, d.pad_top, d.pad_left), (4, 3, 1, 0));
    assert_eq!(d.out_len(), 2 * 4 * 3 * 3);
    assert!(Pool2d::new(1, 2, 5, 1, (3, 3), (1, 1), Padding::Valid).is_err());
}

/// Independent naive pooling: returns (max, argmax index within window, avg over valid).
fn naive(d: &Pool2d, x: &[f32]) -> (Vec<f64>, Vec<u8>, Vec<f64>) {
    let (mut mx, mut am, mut avg) = (vec![], vec![], vec![]);
    // Recompute the padding from the rule rather than trusting d.pad_*.
    let pad = |inp: usize, k: usize, s: usize, out: usize| -> isize {
        match d.padding {
            Padding::Valid => 0,
            Padding::Same => (((out - 1) * s + k) as isize - inp as isize).max(0) / 2,
        }
    };
    let pt = pad(d.h, d.kh, d.sh, d.out_h);
    let pl = pad(d.w, d.kw, d.sw, d.out_w);
    for b in 0..d.n {
        for oh in 0..d.out_h {
            for ow in 0..d.out_w {
                for ch in 0..d.c {
                    let (mut best, mut arg, mut sum, mut cnt) = (f64::NEG_INFINITY, 0u8, 0.0, 0);
                    for ki in 0..d.kh {
                        for kj in 0..d.kw {
                            let ih = (oh * d.sh + ki) as isize - pt;
                            let iw = (ow * d.sw + kj) as isize - pl;
                            if ih < 0 || iw < 0 || ih >= d.h as isize || iw >= d.w as isize {
                                continue;
                            }
                            let v =
                                x[((b * d.h + ih as usize) * d.w + iw as usize) * d.c + ch] as f64;
                            if v > best {
                                best = v;
                                arg = (ki * d.kw + kj) as u8;
                            }
                            sum += v;
                            cnt += 1;
                        }
                    }
                    mx.push(best);
                    am.push(arg);
                    avg.push(sum / cnt as f64);
                }
            }
        }
    }
    (mx, am, avg)
}

fn random_pool(rng: &mut Rng) -> Pool2d {
    loop {
        let padding = if rng.next_u64().is_multiple_of(2) {
            Padding::Same
        } else {
            Padding::Valid
        };
        let (h, w) = (rng.pick(&[1, 3, 5, 7, 8]), rng.pick(&[2, 3, 5, 6, 7]));
        let k = (rng.pick(&[1, 2, 3]), rng.pick(&[1, 2, 3, 4]));
        let s = (rng.pick(&[1, 2, 3]), rng.pick(&[1, 2]));
        let n = rng.pick(&[1, 2, 3]);
        let c = rng.pick(&[1, 2, 3, 5]);
        if let Ok(d) = Pool2d::new(n, h, w, c, k, s, padding) {
            return d;
        }
    }
}

#[test]
fn max_and_avg_forward_match_naive() {
    let mut rng = Rng::new(20);
    for _ in 0..40 {
        let d = random_pool(&mut rng);
        let x = rng.distinct(d.in_len(), 0.01);
        let mut y = vec![0f32; d.out_len()];
        let mut am = vec![0u8; d.out_len()];
        max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
        let (mx, am_ref, avg) = naive(&d, &x);
        assert_close("max", &y, &mx, 0.0, 0.0);
        assert_eq!(am, am_ref, "{d:?}");
        let mut ya = vec![0f32; d.out_len()];
        avg_pool2d_forward(&d, &x, &mut ya).unwrap();
        assert_close("avg", &ya, &avg, 1e-6, 1e-5);
    }
}

#[test]
fn same_avg_pool_divides_by_valid_count() {
    // 1x3x3x1 input of ones except the centre, 3x3 window stride 1 same: corner windows see 4
    // valid elements, so a pool of all-ones is exactly 1 everywhere (padding not counted).
    let d = Pool2d::new(1, 3, 3, 1, (3, 3), (1, 1), Padding::Same).unwrap();
    let x = [1f32; 9];
    let mut y = [0f32; 9];
    avg_pool2d_forward(&d, &x, &mut y).unwrap();
    assert_eq!(y, [1.0; 9]);
    let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
    avg_pool2d_forward(&d, &x, &mut y).unwrap();
    assert_eq!(y[0], (1.0 + 2.0 + 4.0 + 5.0) / 4.0);
}

#[test]
fn max_pool_backward_matches_finite_differences() {
    let mut rng = Rng::new(21);
    for _ in 0..12 {
        let d = random_pool(&mut rng);
        // Distinct values 0.01 apart: ±EPS never changes which element is the max.
        let x = rng.distinct(d.in_len(), 0.01);
        let r = rng.vec(d.out_len(), -1.0, 1.0);
        let mut y = vec![0f32; d.out_len()];
        let mut am = vec![0u8; d.out_len()];
        max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
        let mut dx = vec![f32::NAN; d.in_len()];
        max_pool2d_backward(&d, &am, &r, &mut dx).unwrap();
        let num = numeric_grad(&x, |xp| {
            let mut yp = vec![0f32; d.out_len()];
            let mut a = vec![0u8; d.out_len()];
            max_pool2d_forward(&d, xp, &mut yp, &mut a).unwrap();
            dot(&yp, &r)
        });
        assert_grad("max_pool", &dx, &num, GRAD_ATOL, GRAD_RTOL);
    }
}

#[test]
fn avg_pool_backward_matches_finite_differences() {
    let mut rng = Rng::new(22);
    for _ in 0..12 {
        let d = random_pool(&mut rng);
        let x = rng.vec(d.in_len(), -1.0, 1.0);
        let r = rng.vec(d.out_len(), -1.0, 1.0);
        let mut dx = vec![f32::NAN; d.in_len()];
        avg_pool2d_backward(&d, &r, &mut dx).unwrap();
        let num = numeric_grad(&x, |xp| {
            let mut yp = vec![0f32; d.out_len()];
            avg_pool2d_forward(&d, xp, &mut yp).unwrap();
            dot(&yp, &r)
        });
        assert_grad("avg_pool", &dx, &num, GRAD_ATOL, GRAD_RTOL);
    }
}

#[test]
fn pools_on_many_channels_and_large_batches() {
    // More channels than one accumulator block (64) and enough rows to go parallel.
    let mut rng = Rng::new(23);
    let d = Pool2d::new(4, 9, 11, 70, (3, 3), (2, 2), Padding::Same).unwrap();
    let x = rng.distinct(d.in_len(), 1e-3);
    let mut y = vec![0f32; d.out_len()];
    let mut am = vec![0u8; d.out_len()];
    max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
    let (mx, am_ref, avg) = naive(&d, &x);
    assert_close("max", &y, &mx, 0.0, 0.0);
    assert_eq!(am, am_ref);
    avg_pool2d_forward(&d, &x, &mut y).unwrap();
    assert_close("avg", &y, &avg, 1e-5, 1e-5);
    // Backward: the gradients are linear maps; check them against their adjoint definition
    // <dy, pool(x)> = <pool_backward(dy), x> for the avg pool (exact up to rounding).
    let dy = rng.vec(d.out_len(), -1.0, 1.0);
    let mut dx = vec![0f32; d.in_len()];
    avg_pool2d_backward(&d, &dy, &mut dx).unwrap();
    let lhs = dot(&y, &dy);
    let rhs = dot(&dx, &x);
    assert!(
        (lhs - rhs).abs() < 1e-3 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
    // Max backward against a naive scatter-add at the recorded argmax positions.
    let mut want = vec![0f64; d.in_len()];
    for b in 0..d.n {
        for oh in 0..d.out_h {
            for ow in 0..d.out_w {
                for ch in 0..d.c {
                    let o = ((b * d.out_h + oh) * d.out_w + ow) * d.c + ch;
                    let (ki, kj) = (am[o] as usize / d.kw, am[o] as usize % d.kw);
                    let ih = oh * d.sh + ki - d.pad_top;
                    let iw = ow * d.sw + kj - d.pad_left;
                    want[((b * d.h + ih) * d.w + iw) * d.c + ch] += dy[o] as f64;
                }
            }
        }
    }
    max_pool2d_backward(&d, &am, &dy, &mut dx).unwrap();
    assert_close("max backward", &dx, &want, 1e-6, 1e-6);
}

#[test]
fn max_pool_half_precision_and_nan() {
    let d = Pool2d::new(1, 2, 2, 1, (2, 2), (2, 2), Padding::Valid).unwrap();
    let x: Vec<f16> = [1.0f32, 3.0, 2.0, 3.0]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let mut y = [f16::ZERO];
    let mut am = [9u8];
    max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
    assert_eq!((y[0].to_f32(), am[0]), (3.0, 1)); // first of the tie
    let mut dx = [f16::ONE; 4];
    max_pool2d_backward(&d, &am, &[f16::from_f32(0.5)], &mut dx).unwrap();
    assert_eq!(dx.map(|v| v.to_f32()), [0.0, 0.5, 0.0, 0.0]);
    // A NaN in the window propagates (so the loss scaler's check can see it).
    let x = [1.0f32, f32::NAN, 5.0, 2.0];
    let mut y = [0f32];
    max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
    assert!(y[0].is_nan());
    assert_eq!(am[0], 1);
}

#[test]
fn global_avg_pool_forward_and_backward() {
    let mut rng = Rng::new(24);
    for _ in 0..5 {
        let (n, hw, c) = (
            rng.pick(SIZES),
            rng.pick(SIZES) * rng.pick(SIZES),
            rng.pick(&[1, 3, 67, 130]),
        );
        let x = rng.vec(n * hw * c, -1.0, 1.0);
        let mut y = vec![0f32; n * c];
        global_avg_pool_forward(&x, &mut y, n, hw, c).unwrap();
        let want: Vec<f64> = (0..n * c)
            .map(|i| {
                let (b, ch) = (i / c, i % c);
                (0..hw)
                    .map(|p| x[(b * hw + p) * c + ch] as f64)
                    .sum::<f64>()
                    / hw as f64
            })
            .collect();
        assert_close("gap", &y, &want, 1e-7, 1e-6);
        let r = rng.vec(n * c, -1.0, 1.0);
        let mut dx = vec![f32::NAN; n * hw * c];
        global_avg_pool_backward(&r, &mut dx, n, hw, c).unwrap();
        if x.len() <= 2000 {
            let num = numeric_grad(&x, |xp| {
                let mut yp = vec![0f32; n * c];
                global_avg_pool_forward(xp, &mut yp, n, hw, c).unwrap();
                dot(&yp, &r)
            });
            assert_grad("gap", &dx, &num, GRAD_ATOL, GRAD_RTOL);
        }
    }
    assert!(global_avg_pool_forward(&[0f32; 5], &mut [0f32; 2], 1, 3, 2).is_err());
    assert!(global_avg_pool_forward(&[0f32; 0], &mut [0f32; 2], 1, 0, 2).is_err());
    assert!(global_avg_pool_backward(&[0f32; 1], &mut [0f32; 6], 1, 3, 2).is_err());
}

#[test]
fn pool_errors() {
    let d = Pool2d::new(1, 20, 20, 1, (16, 16), (1, 1), Padding::Valid).unwrap();
    let x = vec![0f32; d.in_len()];
    let mut y = vec![0f32; d.out_len()];
    let mut am = vec![0u8; d.out_len()];
    let e = max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap_err();
    assert!(e.to_string().contains("255"), "{e}");
    let d = Pool2d::new(1, 4, 4, 2, (2, 2), (2, 2), Padding::Valid).unwrap();
    let x = vec![0f32; d.in_len()];
    let mut y = vec![0f32; d.out_len()];
    let mut am = vec![0u8; d.out_len()];
    assert!(max_pool2d_forward(&d, &x[1..], &mut y, &mut am).is_err());
    assert!(max_pool2d_forward(&d, &x, &mut y, &mut am[1..]).is_err());
    assert!(avg_pool2d_forward(&d, &x, &mut y[1..]).is_err());
    let mut dx = vec![0f32; d.in_len()];
    assert!(max_pool2d_backward(&d, &am[1..], &y, &mut dx).is_err());
    assert!(avg_pool2d_backward(&d, &y, &mut dx[1..]).is_err());
}

#[test]
fn inconsistent_or_absurd_dims_are_errors_not_panics() {
    let mut d = Pool2d::new(1, 4, 4, 1, (2, 2), (2, 2), Padding::Valid).unwrap();
    d.out_h = 3; // hand-edited: would read past the input
    let x = [0f32; 16];
    let mut y = [0f32; 12];
    let mut am = [0u8; 12];
    let e = max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap_err();
    assert!(e.to_string().contains("Pool2d::new"), "{e}");
    assert!(avg_pool2d_backward(&d, &y, &mut [0f32; 16]).is_err());
    // Products that would overflow usize saturate and fail the length check.
    assert!(global_avg_pool_forward(&x, &mut y, usize::MAX, 2, 2).is_err());
    let big = Pool2d::new(usize::MAX / 2, 4, 4, 3, (2, 2), (2, 2), Padding::Valid).unwrap();
    assert!(avg_pool2d_forward(&big, &x, &mut y).is_err());
}

/// Max pooling takes 8 channels at a time in vector lanes and the rest one by one: every
/// channel of a 19-channel tensor full of ties and NaNs pools, forward and backward, to the
/// same bits as that channel on its own (the one-lane path).
#[test]
fn max_pool_lanes_pool_each_channel_as_it_pools_alone() {
    let mut rng = Rng::new(21);
    let (n, h, w, c) = (2, 7, 6, 19);
    // Few distinct values, so windows tie often; about one element in 16 a NaN.
    let x: Vec<f32> = (0..n * h * w * c)
        .map(|_| match rng.next_u64() % 16 {
            0 => f32::NAN,
            k => (k % 4) as f32 - 1.5,
        })
        .collect();
    for padding in [Padding::Same, Padding::Valid] {
        let d = Pool2d::new(n, h, w, c, (3, 3), (2, 2), padding).unwrap();
        let (mut y, mut am) = (vec![0f32; d.out_len()], vec![0u8; d.out_len()]);
        max_pool2d_forward(&d, &x, &mut y, &mut am).unwrap();
        let dy = rng.vec(d.out_len(), -1.0, 1.0);
        let mut dx = vec![0f32; d.in_len()];
        max_pool2d_backward(&d, &am, &dy, &mut dx).unwrap();
        let one = Pool2d::new(n, h, w, 1, (3, 3), (2, 2), padding).unwrap();
        for ch in 0..c {
            let pick = |v: &[f32]| v.iter().skip(ch).step_by(c).copied().collect::<Vec<f32>>();
            let (x1, dy1) = (pick(&x), pick(&dy));
            let (mut y1, mut am1) = (vec![0f32; one.out_len()], vec![0u8; one.out_len()]);
            max_pool2d_forward(&one, &x1, &mut y1, &mut am1).unwrap();
            let mut dx1 = vec![0f32; one.in_len()];
            max_pool2d_backward(&one, &am1, &dy1, &mut dx1).unwrap();
            let at = format!("channel {ch}, {padding:?}");
            assert_eq!(bits(&pick(&y)), bits(&y1), "y, {at}");
            let am_ch: Vec<u8> = am.iter().skip(ch).step_by(c).copied().collect();
            assert_eq!(am_ch, am1, "argmax, {at}");
            assert_eq!(bits(&pick(&dx)), bits(&dx1), "dx, {at}");
        }
        assert!(y.iter().any(|v| v.is_nan()), "the data has NaN windows");
    }
}
