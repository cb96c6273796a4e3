//! `gemm` module: matmul / matmul_mixed / strided batched against a naive f64 product,
//! half storage within tolerance, BLAS beta semantics, and refusal of short slices.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::gemm::*;
use memwise_kernels::Element;

/// op(a)·op(b)·alpha + beta·c in f64, from the values as stored.
#[allow(clippy::too_many_arguments)]
fn naive(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    at: bool,
    b: &[f32],
    bt: bool,
    c: &[f32],
    alpha: f32,
    beta: f32,
) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for l in 0..k {
                let av = if at { a[l * m + i] } else { a[i * k + l] };
                let bv = if bt { b[j * k + l] } else { b[l * n + j] };
                s += av as f64 * bv as f64;
            }
            let old = if beta != 0.0 {
                beta as f64 * c[i * n + j] as f64
            } else {
                0.0
            };
            out[i * n + j] = alpha as f64 * s + old;
        }
    }
    out
}

/// Shapes with odd and prime sizes, plus ones that cross the 256 conversion blocks.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (7, 13, 5),
    (13, 7, 1),
    (31, 17, 29),
    (3, 1, 11),
    (260, 5, 7),
    (5, 259, 3),
    (6, 4, 300),
    (300, 70, 9),
];

fn check_matmul<T: Element>(atol: f64, rtol: f64, seed: u64) {
    let mut rng = Rng::new(seed);
    for &(m, n, k) in SHAPES {
        for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
            for (alpha, beta) in [(1.0, 0.0), (-0.75, 0.5)] {
                let a = rounded::<T>(&rng.vec(m * k));
                let b = rounded::<T>(&rng.vec(k * n));
                let c0 = rounded::<T>(&rng.vec(m * n));
                let want = naive(m, n, k, &a, at, &b, bt, &c0, alpha, beta);
                let mut c = to_t::<T>(&c0);
                let mut ws = vec![0f32; matmul_ws_len::<T>(m, n, k)];
                matmul(
                    m,
                    n,
                    k,
                    &to_t::<T>(&a),
                    at,
                    &to_t::<T>(&b),
                    bt,
                    &mut c,
                    alpha,
                    beta,
                    &mut ws,
                )
                .unwrap();
                let what = format!(
                    "{} m{m} n{n} k{k} at{at} bt{bt} alpha{alpha} beta{beta}",
                    T::NAME
                );
                assert_close(&what, &to_f32(&c), &want, atol, rtol);
            }
        }
    }
}

#[test]
fn matmul_f32_matches_naive_for_every_transpose() {
    check_matmul::<f32>(1e-5, 1e-5, 1);
}

/// Half storage: inputs are the half-rounded values, the product is accumulated in f32, and
/// the only loss is the final rounding to T (≤ ½ ulp: 2⁻¹¹ for f16, 2⁻⁸ for bf16) plus f32
/// accumulation noise. A kernel that accumulated in half would miss these bounds at k = 300.
#[test]
fn matmul_half_storage_rounds_only_once() {
    check_matmul::<f16>(1e-4, 1.0 / 1024.0, 2);
    check_matmul::<bf16>(1e-4, 1.0 / 128.0, 3);
}

#[test]
fn matmul_half_crossing_every_block_boundary() {
    // 270 × 300 × 520: two row blocks, two column blocks, three depth blocks.
    let (m, n, k) = (270, 300, 520);
    let mut rng = Rng::new(4);
    let a = rounded::<bf16>(&rng.vec(m * k));
    let b = rounded::<bf16>(&rng.vec(k * n));
    let want = naive(m, n, k, &a, false, &b, false, &[], 1.0, 0.0);
    let mut c = vec![bf16::ZERO; m * n];
    let mut ws = vec![0f32; matmul_ws_len::<bf16>(m, n, k)];
    assert_eq!(ws.len(), 3 * 256 * 256);
    let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    matmul(
        m,
        n,
        k,
        &to_t::<bf16>(&a),
        false,
        &to_t::<bf16>(&bt),
        true,
        &mut c,
        1.0,
        0.0,
        &mut ws,
    )
    .unwrap();
    assert_close("bf16 blocks", &to_f32(&c), &want, 1e-4, 1.0 / 128.0);
}

#[test]
fn matmul_beta_zero_never_reads_c() {
    let (m, n, k) = (5, 7, 3);
    let mut rng = Rng::new(5);
    let (a, b) = (rng.vec(m * k), rng.vec(k * n));
    let want = naive(m, n, k, &a, false, &b, false, &[], 2.0, 0.0);
    let mut c = vec![f32::NAN; m * n];
    matmul(m, n, k, &a, false, &b, false, &mut c, 2.0, 0.0, &mut []).unwrap();
    assert_close("f32", &c, &want, 1e-5, 1e-5);
    let mut c = vec![f16::NAN; m * n];
    let mut ws = vec![0f32; matmul_ws_len::<f16>(m, n, k)];
    matmul(
        m,
        n,
        k,
        &to_t::<f16>(&a),
        false,
        &to_t::<f16>(&b),
        false,
        &mut c,
        2.0,
        0.0,
        &mut ws,
    )
    .unwrap();
    assert!(to_f32(&c).iter().all(|v| v.is_finite()));
}

#[test]
fn matmul_k_zero_scales_c() {
    let mut c = vec![1.0f32, 2.0, 3.0, 4.0];
    matmul::<f32>(2, 2, 0, &[], false, &[], false, &mut c, 1.0, 0.5, &mut []).unwrap();
    assert_eq!(c, [0.5, 1.0, 1.5, 2.0]);
    let mut c = vec![bf16::ONE; 4];
    matmul::<bf16>(2, 2, 0, &[], false, &[], false, &mut c, 1.0, 0.0, &mut []).unwrap();
    assert_eq!(to_f32(&c), [0.0; 4]);
}

#[test]
fn matmul_mixed_accumulates_half_product_into_f32() {
    let (m, n, k) = (13, 11, 270);
    let mut rng = Rng::new(6);
    let a = rounded::<f16>(&rng.vec(k * m));
    let b = rounded::<f16>(&rng.vec(k * n));
    let c0 = rng.vec(m * n);
    let want = naive(m, n, k, &a, true, &b, false, &c0, 1.0, 1.0);
    let mut c = c0.clone();
    let mut ws = vec![0f32; matmul_mixed_ws_len::<f16, f16, f32>(m, n, k)];
    assert_eq!(ws.len(), 13 * 256 + 256 * 11);
    matmul_mixed(
        m,
        n,
        k,
        &to_t::<f16>(&a),
        true,
        &to_t::<f16>(&b),
        false,
        &mut c,
        1.0,
        1.0,
        &mut ws,
    )
    .unwrap();
    assert_close("f32 += f16ᵀ·f16", &c, &want, 1e-4, 1e-5);
}

fn check_batched<T: Element>(lanes: usize, atol: f64, rtol: f64) {
    let (batch, m, n, k) = (5, 7, 3, 11);
    let mut rng = Rng::new(7);
    let a = rounded::<T>(&rng.vec(batch * m * k));
    let b = rounded::<T>(&rng.vec(k * n)); // shared by every item: stride_b = 0
    let stride_c = m * n + 2; // gaps between items stay untouched
    let c0 = rounded::<T>(&rng.vec(batch * stride_c));
    let mut c = to_t::<T>(&c0);
    let mut ws = vec![0f32; lanes * matmul_strided_batched_ws_len::<T>(m, n, k)];
    matmul_strided_batched(
        batch,
        m,
        n,
        k,
        &to_t::<T>(&a),
        true,
        m * k,
        &to_t::<T>(&b),
        false,
        0,
        &mut c,
        stride_c,
        1.5,
        0.25,
        &mut ws,
    )
    .unwrap();
    let c = to_f32(&c);
    for i in 0..batch {
        let want = naive(
            m,
            n,
            k,
            &a[i * m * k..],
            true,
            &b,
            false,
            &c0[i * stride_c..],
            1.5,
            0.25,
        );
        assert_close(
            &format!("{} item {i}", T::NAME),
            &c[i * stride_c..i * stride_c + m * n],
            &want,
            atol,
            rtol,
        );
        if i + 1 < batch {
            assert_eq!(
                &c[i * stride_c + m * n..(i + 1) * stride_c],
                &c0[i * stride_c + m * n..(i + 1) * stride_c]
            );
        }
    }
}

#[test]
fn strided_batched_matches_per_item_products() {
    check_batched::<f32>(0, 1e-5, 1e-5);
    check_batched::<bf16>(1, 1e-4, 1.0 / 128.0);
    check_batched::<f16>(3, 1e-4, 1.0 / 1024.0);
}

#[test]
fn short_slices_are_refused_and_nothing_is_written() {
    let (m, n, k) = (4, 5, 6);
    let a = vec![1f32; m * k];
    let b = vec![1f32; k * n];
    let mut c = vec![7f32; m * n];
    assert!(matmul(
        m,
        n,
        k,
        &a[1..],
        false,
        &b,
        false,
        &mut c,
        1.0,
        0.0,
        &mut []
    )
    .is_err());
    assert!(matmul(m, n, k, &a, false, &b[1..], true, &mut c, 1.0, 0.0, &mut []).is_err());
    assert!(matmul(
        m,
        n,
        k,
        &a,
        false,
        &b,
        false,
        &mut c[1..],
        1.0,
        0.0,
        &mut []
    )
    .is_err());
    assert!(c.iter().all(|&v| v == 7.0));
    let (ah, bh) = (to_t::<f16>(&a), to_t::<f16>(&b));
    let mut ch = vec![f16::ZERO; m * n];
    let mut ws = vec![0f32; matmul_ws_len::<f16>(m, n, k) - 1];
    let err = matmul(m, n, k, &ah, false, &bh, false, &mut ch, 1.0, 0.0, &mut ws).unwrap_err();
    assert!(err.0.contains("ws"), "{err}");
    // overlapping batch items
    let mut c = vec![0f32; 2 * m * n];
    assert!(matmul_strided_batched(
        2,
        m,
        n,
        k,
        &a,
        false,
        0,
        &b,
        false,
        0,
        &mut c,
        m * n - 1,
        1.0,
        0.0,
        &mut []
    )
    .is_err());
    assert!(matmul_strided_batched(
        2,
        m,
        n,
        k,
        &a,
        false,
        1,
        &b,
        false,
        0,
        &mut c,
        m * n,
        1.0,
        0.0,
        &mut []
    )
    .is_err());
}
