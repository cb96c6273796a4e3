//! Shared helpers of the `gemm_ops_*` tests: a seeded RNG, finite differences, comparisons.
#![allow(dead_code)]

use memwise_kernels::Element;

/// xorshift64* — small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Up to `max` distinct-ish indices into a tensor of `len` (all of them when small).
    pub fn indices(&mut self, len: usize, max: usize) -> Vec<usize> {
        if len <= max {
            (0..len).collect()
        } else {
            (0..max).map(|_| self.below(len)).collect()
        }
    }
}

/// Σ y·r accumulated in f64 — the scalar objective whose gradient w.r.t. y is r.
pub fn dot(y: &[f32], r: &[f32]) -> f64 {
    assert_eq!(y.len(), r.len());
    y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Central finite difference of `f` at `x` along coordinate `i`.
pub fn central_diff(x: &[f32], i: usize, eps: f32, f: &mut dyn FnMut(&[f32]) -> f64) -> f64 {
    let mut xp = x.to_vec();
    xp[i] = x[i] + eps;
    let fp = f(&xp);
    xp[i] = x[i] - eps;
    let fm = f(&xp);
    (fp - fm) / (2.0 * (eps as f64))
}

/// FD step used by every gradient test (inputs are O(1)).
pub const EPS: f32 = 1e-2;
/// Gradient tolerance: |fd − analytic| ≤ FD_ATOL + FD_RTOL·|analytic|. All ops under test are
/// linear in each single coordinate, so the central difference has no truncation error and
/// what remains is f32 rounding of the forward, amplified by 1/(2·EPS).
pub const FD_ATOL: f64 = 2e-3;
pub const FD_RTOL: f64 = 2e-3;

/// Checks `analytic[i]` against the central difference of `f` at sampled coordinates of `x`.
pub fn check_grad(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    rng: &mut Rng,
    samples: usize,
    f: &mut dyn FnMut(&[f32]) -> f64,
) {
    assert!(
        analytic.len() >= x.len(),
        "{what}: gradient shorter than input"
    );
    for i in rng.indices(x.len(), samples) {
        let fd = central_diff(x, i, EPS, f);
        let an = analytic[i] as f64;
        assert!(
            (fd - an).abs() <= FD_ATOL + FD_RTOL * an.abs(),
            "{what}[{i}]: finite difference {fd} vs analytic {an}"
        );
    }
}

/// Elementwise |a − b| ≤ atol + rtol·|b|.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

pub fn to_t<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

pub fn to_f32<T: Element>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The values after a round trip through storage `T` (what a half kernel actually sees).
pub fn rounded<T: Element>(v: &[f32]) -> Vec<f32> {
    to_f32(&to_t::<T>(v))
}

/// Max |a − b| / (1 + max|b|) over two tensors: the relative error a half-storage kernel is
/// judged by against its f32 twin.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    diff / (1.0 + scale)
}
