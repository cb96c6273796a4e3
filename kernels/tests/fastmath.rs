//! The branch-free elementary functions (`memwise_kernels::fastmath`) against f64.

use memwise_kernels::fastmath::{
    fast_exp, gelu, gelu_grad, gelu_grad_with, gelu_with, normal_cdf, normal_cdf_with,
};

/// A function of one f32, by name: the plain form and the one in fused multiply-adds that the
/// loops compiled with FMA run.
type Variants = [(&'static str, fn(f32) -> f32); 2];

#[test]
fn the_fast_exponential_is_within_two_ulps_of_exp() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x <= 88.0 {
        let (got, want) = (fast_exp(x) as f64, (x as f64).exp());
        worst = worst.max((got - want).abs() / want);
        x += 0.0137;
    }
    assert!(worst < 2.5e-7, "worst relative error {worst:e}");
    assert_eq!(fast_exp(0.0), 1.0);
    assert_eq!(fast_exp(-100.0), 0.0);
    assert_eq!(fast_exp(89.0), f32::INFINITY);
    assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
    assert!(fast_exp(f32::NAN).is_nan());
}

/// Φ(x) in f64: ½·erfc(−x/√2), erfc from its continued fraction in the tail and its series
/// near 0 (both to well under f32's precision).
fn normal_cdf64(x: f64) -> f64 {
    let z = -x / std::f64::consts::SQRT_2;
    0.5 * erfc64(z)
}

fn erfc64(z: f64) -> f64 {
    if z < 0.0 {
        return 2.0 - erfc64(-z);
    }
    if z < 3.0 {
        // erf(z) = 2/√π · Σ (−1)^n z^(2n+1) / (n! (2n+1))
        let (mut term, mut sum, mut n) = (z, z, 0.0);
        while term.abs() > 1e-20 * sum.abs() {
            n += 1.0;
            term *= -z * z / n;
            sum += term / (2.0 * n + 1.0);
        }
        return 1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum;
    }
    // Lentz's continued fraction: erfc(z) = e^(−z²)/√π · 1/(z + 1/2/(z + 1/(z + 3/2/(z + …)))).
    let mut f = 0.0;
    for k in (1..200).rev() {
        f = (k as f64 / 2.0) / (z + f);
    }
    (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + f)
}

#[test]
fn the_f64_reference_agrees_with_known_values() {
    // Φ(1) and Φ(−3) to 15 digits (standard tables).
    assert!((normal_cdf64(1.0) - 0.841_344_746_068_543).abs() < 1e-14);
    assert!((normal_cdf64(-3.0) - 0.001_349_898_031_630_09).abs() < 1e-16);
    assert!((normal_cdf64(-8.0) / 6.220_960_574_271_78e-16 - 1.0).abs() < 1e-12);
}

#[test]
fn the_normal_cdf_is_within_its_documented_error() {
    let variants: Variants = [("plain", normal_cdf), ("fused", normal_cdf_with::<true>)];
    for (form, cdf) in variants {
        let (mut worst_rel, mut worst_abs) = (0f64, 0f64);
        let mut x = -12.0f32;
        while x <= 12.0 {
            let (got, want) = (cdf(x) as f64, normal_cdf64(x as f64));
            if x < 0.0 {
                worst_rel = worst_rel.max((got - want).abs() / want);
            } else {
                worst_abs = worst_abs.max((got - want).abs());
            }
            x += 0.000_731;
        }
        eprintln!(
            "Φ ({form}): worst relative error {worst_rel:e} below 0, worst absolute \
             {worst_abs:e} above"
        );
        assert!(
            worst_rel < 1e-6,
            "{form}, x < 0: worst relative error {worst_rel:e}"
        );
        assert!(
            worst_abs < 2e-7,
            "{form}, x ≥ 0: worst absolute error {worst_abs:e}"
        );
        assert_eq!(cdf(-30.0), 0.0);
        assert_eq!(cdf(30.0), 1.0);
        assert_eq!(cdf(f32::INFINITY), 1.0);
        assert_eq!(cdf(f32::NEG_INFINITY), 0.0);
        assert!(cdf(f32::NAN).is_nan());
    }
}

#[test]
fn gelu_and_its_derivative_match_f64() {
    let density = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let forwards: Variants = [("plain", gelu), ("fused", gelu_with::<true>)];
    let derivatives: Variants = [("plain", gelu_grad), ("fused", gelu_grad_with::<true>)];
    for ((form, f), (_, df)) in forwards.into_iter().zip(derivatives) {
        let mut x = -10.0f32;
        while x <= 10.0 {
            let xd = x as f64;
            let (y, want) = (f(x) as f64, xd * normal_cdf64(xd));
            assert!(
                (y - want).abs() <= 1e-6 * want.abs().max(1e-6),
                "{form} gelu({x}) = {y}, want {want}"
            );
            let (g, want) = (df(x) as f64, normal_cdf64(xd) + xd * density(xd));
            assert!(
                (g - want).abs() <= 1e-6,
                "{form} gelu'({x}) = {g}, want {want}"
            );
            x += 0.000_913;
        }
        assert_eq!(f(0.0), 0.0);
        assert!(f(f32::NAN).is_nan() && df(f32::NAN).is_nan());
    }
}
