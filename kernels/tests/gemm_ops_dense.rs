//! `dense` module: forward against a naive f64 loop, backward against central finite
//! differences, accumulation of parameter gradients, half storage, refusal of short slices.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::dense::*;
use memwise_kernels::Element;

fn naive_forward(d: DenseDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let mut y = vec![0f64; d.y_len()];
    for r in 0..d.batch {
        for o in 0..d.out_features {
            let mut s = b.map_or(0.0, |b| b[o] as f64);
            for i in 0..d.in_features {
                s += x[r * d.in_features + i] as f64 * w[i * d.out_features + o] as f64;
            }
            y[r * d.out_features + o] = s;
        }
    }
    y
}

/// Odd and prime sizes; the last one is big enough (≥ 16K outputs) for the threaded bias pass.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (7, 13, 5),
    (3, 2, 17),
    (13, 31, 7),
    (2, 300, 3),
    (130, 3, 150),
];

fn dims(&(batch, in_features, out_features): &(usize, usize, usize)) -> DenseDims {
    DenseDims {
        batch,
        in_features,
        out_features,
    }
}

fn forward<T: Element>(d: DenseDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![T::from_f32(0.0); d.y_len()];
    let mut ws = vec![0f32; dense_ws_len::<T>(d)];
    dense_forward(d, &to_t::<T>(x), &to_t::<T>(w), b, &mut y, &mut ws).unwrap();
    to_f32(&y)
}

#[test]
fn dense_forward_matches_naive() {
    let mut rng = Rng::new(11);
    for s in SHAPES {
        let d = dims(s);
        let (x, w, b) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.out_features),
        );
        assert_close(
            "with bias",
            &forward::<f32>(d, &x, &w, Some(&b)),
            &naive_forward(d, &x, &w, Some(&b)),
            1e-5,
            1e-5,
        );
        assert_close(
            "no bias",
            &forward::<f32>(d, &x, &w, None),
            &naive_forward(d, &x, &w, None),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn dense_backward_matches_finite_differences() {
    let mut rng = Rng::new(12);
    for s in SHAPES {
        let d = dims(s);
        let (x, w, b, r) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.out_features),
            rng.vec(d.y_len()),
        );
        let mut dx = vec![f32::NAN; d.x_len()]; // overwritten
        let dw0 = rng.vec(d.w_len()); // accumulated onto
        let db0 = rng.vec(d.out_features);
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        dense_backward(
            d,
            &x,
            &w,
            &r,
            Some(&mut dx),
            &mut dw,
            Some(&mut db),
            &mut [],
        )
        .unwrap();
        let dw: Vec<f32> = dw.iter().zip(&dw0).map(|(a, b)| a - b).collect();
        let db: Vec<f32> = db.iter().zip(&db0).map(|(a, b)| a - b).collect();
        check_grad("dx", &x, &dx, &mut rng, 40, &mut |xp| {
            dot(&forward::<f32>(d, xp, &w, Some(&b)), &r)
        });
        check_grad("dw", &w, &dw, &mut rng, 40, &mut |wp| {
            dot(&forward::<f32>(d, &x, wp, Some(&b)), &r)
        });
        check_grad("db", &b, &db, &mut rng, 40, &mut |bp| {
            dot(&forward::<f32>(d, &x, &w, Some(bp)), &r)
        });
        // dx optional, and db optional
        let mut dw2 = vec![0f32; d.w_len()];
        dense_backward(d, &x, &w, &r, None, &mut dw2, None, &mut []).unwrap();
        assert_close(
            "dw without dx",
            &dw2,
            &dw.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            1e-5,
            1e-5,
        );
    }
}

/// Half storage against the f32 kernel on the same (half-rounded) values: the relative error
/// stays within a few units of T's rounding (2⁻¹¹ f16, 2⁻⁸ bf16), because only the stores round.
fn check_half<T: Element>(tol: f64) {
    let mut rng = Rng::new(13);
    for s in SHAPES {
        let d = dims(s);
        let (x, w, b, r) = (
            rounded::<T>(&rng.vec(d.x_len())),
            rounded::<T>(&rng.vec(d.w_len())),
            rng.vec(d.out_features),
            rounded::<T>(&rng.vec(d.y_len())),
        );
        assert!(
            rel_err(
                &forward::<T>(d, &x, &w, Some(&b)),
                &forward::<f32>(d, &x, &w, Some(&b))
            ) <= tol,
            "{} y",
            T::NAME
        );
        let mut ws = vec![0f32; dense_ws_len::<T>(d)];
        let mut dx = vec![T::from_f32(0.0); d.x_len()];
        let (mut dw, mut db) = (vec![0f32; d.w_len()], vec![0f32; d.out_features]);
        dense_backward(
            d,
            &to_t::<T>(&x),
            &to_t::<T>(&w),
            &to_t::<T>(&r),
            Some(&mut dx),
            &mut dw,
            Some(&mut db),
            &mut ws,
        )
        .unwrap();
        let mut dx32 = vec![0f32; d.x_len()];
        let (mut dw32, mut db32) = (vec![0f32; d.w_len()], vec![0f32; d.out_features]);
        dense_backward(
            d,
            &x,
            &w,
            &r,
            Some(&mut dx32),
            &mut dw32,
            Some(&mut db32),
            &mut [],
        )
        .unwrap();
        assert!(rel_err(&to_f32(&dx), &dx32) <= tol, "{} dx", T::NAME);
        // dw and db are f32 sums of exactly representable products: f32-accurate.
        assert!(rel_err(&dw, &dw32) <= 1e-5, "{} dw", T::NAME);
        assert!(rel_err(&db, &db32) <= 1e-5, "{} db", T::NAME);
    }
}

#[test]
fn dense_half_storage_within_tolerance_of_f32() {
    check_half::<f16>(1e-3);
    check_half::<bf16>(8e-3);
}

#[test]
fn dense_short_slices_are_refused() {
    let d = DenseDims {
        batch: 3,
        in_features: 4,
        out_features: 5,
    };
    let (x, w, b) = (vec![1f32; 12], vec![1f32; 20], vec![0f32; 5]);
    let mut y = vec![9f32; 15];
    assert!(dense_forward(d, &x[1..], &w, None, &mut y, &mut []).is_err());
    assert!(dense_forward(d, &x, &w[1..], None, &mut y, &mut []).is_err());
    assert!(dense_forward(d, &x, &w, Some(&b[1..]), &mut y, &mut []).is_err());
    assert!(dense_forward(d, &x, &w, None, &mut y[1..], &mut []).is_err());
    assert!(y.iter().all(|&v| v == 9.0));
    let (mut dx, mut dw, mut db) = (vec![0f32; 12], vec![0f32; 20], vec![0f32; 5]);
    assert!(dense_backward(d, &x, &w, &y[1..], Some(&mut dx), &mut dw, None, &mut []).is_err());
    assert!(dense_backward(d, &x, &w, &y, Some(&mut dx[1..]), &mut dw, None, &mut []).is_err());
    assert!(dense_backward(d, &x, &w, &y, None, &mut dw[1..], None, &mut []).is_err());
    assert!(dense_backward(d, &x, &w, &y, None, &mut dw, Some(&mut db[1..]), &mut []).is_err());
    let xh = to_t::<bf16>(&x);
    let mut yh = vec![bf16::ZERO; 15];
    assert!(
        dense_forward(d, &xh, &to_t::<bf16>(&w), None, &mut yh, &mut []).is_err(),
        "half needs ws"
    );
    assert!(dw.iter().all(|&v| v == 0.0));
}
