//! Helpers shared by the `pointwise_*` test targets: a seeded RNG, central finite differences
//! and closeness assertions. (A directory module, so Cargo does not build it as a test target.)
#![allow(dead_code)]

/// SplitMix64: tiny, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Values in [lo, hi) whose magnitude is at least `gap` (keeps away from kinks at 0).
    pub fn vec_away_from_zero(&mut self, n: usize, lo: f32, hi: f32, gap: f32) -> Vec<f32> {
        (0..n)
            .map(|_| loop {
                let v = self.uniform(lo, hi);
                if v.abs() >= gap {
                    break v;
                }
            })
            .collect()
    }

    /// `n` distinct values spaced by `step` (shuffled): no two within a finite-difference
    /// step of each other, so a max never changes under perturbation.
    pub fn distinct(&mut self, n: usize, step: f32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * step).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }

    pub fn pick(&mut self, options: &[usize]) -> usize {
        options[(self.next_u64() % options.len() as u64) as usize]
    }
}

/// Sizes the random-shape tests draw from: odd, prime, and 1.
pub const SIZES: &[usize] = &[1, 2, 3, 5, 7, 11, 13];

/// Σ y·r accumulated in f64: the scalar objective whose gradient w.r.t. y is r.
pub fn dot(y: &[f32], r: &[f32]) -> f64 {
    y.iter().zip(r).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// Finite-difference step used on f32 inputs.
pub const EPS: f32 = 1e-3;

/// Default gradient tolerance for f32 kernels against central differences with `EPS`:
/// the objective is computed from f32 outputs, so each difference carries about
/// `sqrt(k)·2^-24·|y|/(2·EPS)` of rounding noise for k changed outputs (≈1e-4 here) plus the
/// O(EPS²) truncation term; 2e-3 absolute + 1% relative covers both with margin while still
/// catching any wrong term (which shows up at O(0.1)).
pub const GRAD_ATOL: f64 = 2e-3;
pub const GRAD_RTOL: f64 = 1e-2;

/// Central differences `(L(x + ε e_i) − L(x − ε e_i)) / 2ε` for every i.
pub fn numeric_grad(x: &[f32], mut objective: impl FnMut(&[f32]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xp[i];
            xp[i] = orig + EPS;
            let lp = objective(&xp);
            xp[i] = orig - EPS;
            let lm = objective(&xp);
            xp[i] = orig;
            // Divide by the step actually taken in f32, not the nominal one.
            let h = (orig + EPS) as f64 - (orig - EPS) as f64;
            (lp - lm) / h
        })
        .collect()
}

/// Asserts |analytic − numeric| ≤ atol + rtol·|numeric| everywhere, naming the worst index.
pub fn assert_grad(what: &str, analytic: &[f32], numeric: &[f64], atol: f64, rtol: f64) {
    assert_eq!(analytic.len(), numeric.len(), "{what}: length");
    let mut worst = (0usize, f64::NEG_INFINITY);
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        let excess = (*a as f64 - n).abs() - (atol + rtol * n.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    if worst.1 > 0.0 {
        let i = worst.0;
        panic!(
            "{what}: gradient mismatch at {i}: analytic {} vs numeric {} (atol {atol}, rtol {rtol})",
            analytic[i], numeric[i]
        );
    }
}

/// Asserts |got − want| ≤ atol + rtol·|want| elementwise.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w} (atol {atol}, rtol {rtol})"
        );
    }
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
