//! Elementwise kernels: casts, n-ary add, accumulate, concat, finite check, scaling.
mod pointwise_util;

use half::{bf16, f16};
use memwise_kernels::elementwise::*;
use pointwise_util::*;

#[test]
fn cast_u8_scales_like_rescaling() {
    let x: Vec<u8> = (0..=255).collect();
    let mut y = vec![0f32; 256];
    cast_u8(&x, &mut y, 1.0 / 255.0, 0.0).unwrap();
    let want: Vec<f64> = x.iter().map(|&v| v as f64 / 255.0).collect();
    assert_close("cast_u8", &y, &want, 1e-7, 1e-6);
    assert_eq!(y[0], 0.0);
    assert_eq!(y[255], 1.0);

    // Offset form (Rescaling(1/127.5, offset=-1)) into f16, large enough to go parallel.
    let n = 100_003;
    let x: Vec<u8> = (0..n).map(|i| (i * 7 % 256) as u8).collect();
    let mut y = vec![f16::ZERO; n];
    cast_u8(&x, &mut y, 1.0 / 127.5, -1.0).unwrap();
    for (i, (v, xi)) in y.iter().zip(&x).enumerate() {
        let want = f16::from_f32(*xi as f32 / 127.5 - 1.0);
        assert_eq!(*v, want, "element {i}");
    }
    assert!(cast_u8(&x[..3], &mut y[..4], 1.0, 0.0).is_err());
}

#[test]
fn casts_round_to_nearest_and_backward_casts_back() {
    let mut rng = Rng::new(1);
    let x = rng.vec(1001, -100.0, 100.0);
    let mut h = vec![f16::ZERO; x.len()];
    let mut b = vec![bf16::ZERO; x.len()];
    cast(&x, &mut h).unwrap();
    cast(&x, &mut b).unwrap();
    for i in 0..x.len() {
        assert_eq!(h[i], f16::from_f32(x[i]));
        assert_eq!(b[i], bf16::from_f32(x[i]));
    }
    // f16 → f32 is exact; f16 → bf16 goes through f32.
    let mut back = vec![0f32; x.len()];
    cast_backward(&h, &mut back).unwrap();
    for i in 0..x.len() {
        assert_eq!(back[i], h[i].to_f32());
    }
    let mut hb = vec![bf16::ZERO; x.len()];
    cast(&h, &mut hb).unwrap();
    for i in 0..x.len() {
        assert_eq!(hb[i], bf16::from_f32(h[i].to_f32()));
    }
    // The backward of a cast is the identity on values: Σ y·r has gradient r.
    let r = rng.vec(x.len(), -1.0, 1.0);
    let mut dx = vec![0f32; x.len()];
    cast_backward(&r, &mut dx).unwrap();
    assert_eq!(dx, r);
    assert!(cast(&x, &mut h[..10]).is_err());
    assert!(cast_backward(&h[..3], &mut dx).is_err());
}

#[test]
fn add_n_matches_f64_sum_and_rounds_once() {
    let mut rng = Rng::new(2);
    for &n in &[1usize, 7, 257, 100_003] {
        let ins: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(n, -2.0, 2.0)).collect();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        let mut y = vec![0f32; n];
        add_n(&refs, &mut y).unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| ins.iter().map(|v| v[i] as f64).sum())
            .collect();
        assert_close("add_n", &y, &want, 1e-6, 1e-6);

        // In place over the first input gives the same bits.
        let mut acc = ins[0].clone();
        add_n_inplace(&mut acc, &refs[1..]).unwrap();
        assert_eq!(bits(&acc), bits(&y));
    }
    // f16: one rounding of the f32 sum.
    let a: Vec<f16> = [1.0f32, 1e-3, 2048.0]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let b: Vec<f16> = [1e-3f32, 1e-3, 1.0]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let mut y = vec![f16::ZERO; 3];
    add_n(&[&a, &b, &b], &mut y).unwrap();
    for i in 0..3 {
        let s = a[i].to_f32() + b[i].to_f32() + b[i].to_f32();
        assert_eq!(y[i], f16::from_f32(s));
    }
    assert!(add_n::<f32>(&[], &mut [0.0]).is_err());
    assert!(add_n(&[&[1.0f32, 2.0][..], &[1.0][..]], &mut [0.0, 0.0]).is_err());
    assert!(add_n_inplace(&mut [0f32; 2], &[&[1.0f32][..]]).is_err());
}

#[test]
fn accumulate_adds_across_types() {
    let mut rng = Rng::new(3);
    let n = 40_009;
    let src: Vec<f16> = rng
        .vec(n, -1.0, 1.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let base = rng.vec(n, -1.0, 1.0);
    let mut dst = base.clone();
    accumulate(&mut dst, &src).unwrap();
    for i in 0..n {
        assert_eq!(dst[i], base[i] + src[i].to_f32());
    }
    assert!(accumulate(&mut dst[..5], &src[..6]).is_err());
}

#[test]
fn concat_last_roundtrips_and_backward_splits() {
    let mut rng = Rng::new(4);
    for trial in 0..5 {
        let rows = rng.pick(SIZES) + trial;
        let widths: Vec<usize> = (0..3).map(|_| rng.pick(SIZES)).collect();
        let ins: Vec<Vec<f32>> = widths
            .iter()
            .map(|&w| rng.vec(rows * w, -1.0, 1.0))
            .collect();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        let total: usize = widths.iter().sum();
        let mut y = vec![0f32; rows * total];
        concat_last(&refs, &widths, rows, &mut y).unwrap();
        for r in 0..rows {
            let mut at = 0;
            for (k, &w) in widths.iter().enumerate() {
                assert_eq!(
                    &y[r * total + at..r * total + at + w],
                    &ins[k][r * w..(r + 1) * w]
                );
                at += w;
            }
        }
        // Backward: gradient of Σ y·r w.r.t. each input is the matching slice of r.
        let rr = rng.vec(rows * total, -1.0, 1.0);
        let mut dxs: Vec<Vec<f32>> = widths.iter().map(|&w| vec![f32::NAN; rows * w]).collect();
        {
            let mut views: Vec<&mut [f32]> = dxs.iter_mut().map(|v| v.as_mut_slice()).collect();
            concat_last_backward(&rr, &widths, rows, &mut views).unwrap();
        }
        for k in 0..widths.len() {
            let num = numeric_grad(&ins[k], |xk| {
                let mut refs2 = refs.clone();
                refs2[k] = xk;
                let mut y2 = vec![0f32; rows * total];
                concat_last(&refs2, &widths, rows, &mut y2).unwrap();
                dot(&y2, &rr)
            });
            assert_grad("concat input", &dxs[k], &num, 1e-4, 1e-3);
        }
    }
    // Mismatched widths / short buffers.
    let a = [1f32; 6];
    let mut y = [0f32; 10];
    assert!(concat_last(&[&a[..]], &[2, 1], 3, &mut y).is_err());
    assert!(concat_last(&[&a[..]], &[3], 3, &mut y).is_err());
    let mut d = [0f32; 2];
    assert!(concat_last_backward(&y, &[3], 3, &mut [&mut d[..]]).is_err());
}

#[test]
fn all_finite_sees_nan_and_inf_in_every_type() {
    let mut v = vec![1.0f32; 100_001];
    assert!(all_finite(&v));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        v[100_000] = bad;
        assert!(!all_finite(&v));
        v[100_000] = 1.0;
    }
    let mut h = vec![f16::ONE; 10];
    assert!(all_finite(&h));
    h[3] = f16::INFINITY;
    assert!(!all_finite(&h));
    // 70000 overflows f16 on conversion: the check sees the stored inf.
    h[3] = f16::from_f32(70_000.0);
    assert!(!all_finite(&h));
    let mut b = vec![bf16::ONE; 10];
    assert!(all_finite(&b));
    b[9] = bf16::NAN;
    assert!(!all_finite(&b));
    assert!(all_finite::<f32>(&[]));
}

#[test]
fn scale_in_place_and_out_of_place() {
    let mut rng = Rng::new(5);
    let x = rng.vec(50_001, -10.0, 10.0);
    let mut y = x.clone();
    scale_inplace(&mut y, 1.0 / 1024.0);
    let mut z = vec![0f32; x.len()];
    scale(&x, &mut z, 1.0 / 1024.0).unwrap();
    for i in 0..x.len() {
        assert_eq!(y[i], x[i] / 1024.0); // power of two: exact
        assert_eq!(z[i], y[i]);
    }
    assert!(scale(&x, &mut z[..2], 2.0).is_err());
}
