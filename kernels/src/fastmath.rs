//! Branch-free f32 elementary functions whose loops vectorise: the exponential of the
//! softmaxes and the normal distribution function of GELU. `libm`'s scalar `expf` and
//! `erff` branch per element, which keeps every loop that calls them one lane wide.
//!
//! Each is a fixed sequence of f32 operations (no fused multiply-add unless the caller asks
//! for it with `FMA`), so a result does not depend on the vector width the loop was compiled
//! for: the same bits on a baseline x86-64 build and in an AVX2 clone of the loop.

/// `e^x` in f32 to about 1 ulp (a relative 2e-7), branch-free so that a loop of it
/// vectorises: `2^n · e^f` with `n = round(x·log2 e)`, `f = x − n·ln 2` (ln 2 in two parts)
/// and a degree-7 polynomial for `e^f`. Below −87.3 it gives 0 (where `exp` leaves the
/// normal range), above 88.72 infinity, NaN stays NaN; the inputs here are `s − max ≤ 0`.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`fast_exp`], its polynomial in fused multiply-adds when `FMA` (for the loops compiled with
/// the `fma` feature, where `mul_add` is one instruction; elsewhere it is a library call).
#[inline(always)]
pub(crate) fn exp_with<const FMA: bool>(x: f32) -> f32 {
    let (n, xc) = exp_exponent(x);
    exp_from::<FMA>(x, n, (xc - n * LN2_HI) - n * LN2_LO)
}

/// `e^(hi + lo)` for a `hi` whose reduction by `n·ln 2` is exact (`hi − n·ln 2` has at
/// most 24 significant bits: a `hi` of at most 12, such as half the square of a 12-bit
/// number) and a small `lo` (`|lo| < 2`), without the rounding of `hi + lo`: for `hi` near
/// −80 that rounding alone is a relative error of 4e-6 in the result.
#[inline(always)]
fn exp_split<const FMA: bool>(hi: f32, lo: f32) -> f32 {
    // n from the rounded sum (any n near it keeps the reduced argument small); the clamped
    // sum only matters where the result is 0 or infinite anyway.
    let x = hi + lo;
    let (n, _) = exp_exponent(x);
    exp_from::<FMA>(x, n, ((hi - n * LN2_HI) - n * LN2_LO) + lo)
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 in two parts (Cody and Waite): n·LN2_HI is exact for the n here.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `n = round(x·log2 e)` of `x` clamped to the normal range, and that clamped `x`.
#[inline(always)]
fn exp_exponent(x: f32) -> (f32, f32) {
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // Comparisons, not `clamp`/`max` (whose NaN rules keep the loop from vectorising).
    let xc = if x < -87.3 { -87.3 } else { x };
    let xc = if xc > 88.3 { 88.3 } else { xc };
    ((xc * LOG2E + ROUND) - ROUND, xc)
}

/// `2^n · e^f` for the reduced argument `|f| ≤ ln2/2` (a little more with a split's `lo`),
/// with `x`'s special cases: 0 below −87.3, infinity above 88.72, NaN for NaN.
#[inline(always)]
fn exp_from<const FMA: bool>(x: f32, n: f32, f: f32) -> f32 {
    // e^f: Taylor to degree 7 (the next term is below 4e-9).
    let mut p: f32 = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = if FMA { p.mul_add(f, c) } else { p * f + c };
    }
    // SAFETY: the clamp keeps n in −126..=128, well inside i32 (a plain conversion, where
    // `as` would add saturation checks that stop the loop vectorising).
    let ni = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    let y = p * scale;
    let y = if x < -87.3 { 0.0 } else { y };
    let y = if x > 88.72 { f32::INFINITY } else { y };
    // NaN (the only value unequal to itself) stays NaN.
    #[allow(clippy::eq_op)]
    if x != x {
        x
    } else {
        y
    }
}

/// The standard normal distribution function `Φ(x) = ½·erfc(−x/√2)`, to a relative 1e-6
/// (for `x < 0`, where it is `½·erfc(|x|/√2)`, also in the far tail) and an absolute 2e-7
/// (for `x ≥ 0`, where it is `1 − ½·erfc(x/√2)`). `erfc` is Numerical Recipes' Chebyshev
/// fit `t·e^(−z² + P(t))`, `t = 1/(1 + z/2)`, whose fractional error is below 1.2e-7 for
/// every `z ≥ 0`; its exponential takes `z²` in two parts, so that its rounding does not
/// cost the tail its precision. NaN stays NaN.
#[inline(always)]
pub fn normal_cdf(x: f32) -> f32 {
    normal_cdf_with::<false>(x)
}

/// `a·b + c`, one fused multiply-add when `FMA`.
#[inline(always)]
fn mul_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// [`normal_cdf`], its polynomials in fused multiply-adds when `FMA` (as [`exp_with`]): a
/// quarter fewer operations, to the same documented error (`kernels/tests/fastmath.rs`). The
/// pointwise loops compiled with `fma` take it (`elementwise::wide_loop`); elsewhere
/// `mul_add` is a library call.
#[inline(always)]
pub fn normal_cdf_with<const FMA: bool>(x: f32) -> f32 {
    const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let a = if x < 0.0 { -x } else { x };
    // Φ is 0 or 1 in f32 well before |x| = 20; the cap keeps infinities out of the split.
    let a = if a > 20.0 { 20.0 } else { a };
    let t = 1.0 / (1.0 + 0.5 * (a * FRAC_1_SQRT_2));
    // P(t) by Estrin's scheme (pairs, then powers t², t⁴, t⁸): a dependency chain of 5
    // multiply-adds instead of Horner's 9, which bounds this function's speed in a loop.
    const C: [f32; 10] = [
        -1.265_512_2,
        1.000_023_7,
        0.374_091_96,
        0.096_784_18,
        -0.186_288_06,
        0.278_868_07,
        -1.135_204,
        1.488_515_9,
        -0.822_152_23,
        0.170_872_77,
    ];
    let (t2, pair) = (t * t, |k: usize| mul_add::<FMA>(C[k + 1], t, C[k]));
    let t4 = t2 * t2;
    let low = mul_add::<FMA>(pair(2), t2, pair(0));
    let high = mul_add::<FMA>(pair(6), t2, pair(4));
    let p = mul_add::<FMA>(pair(8), t4 * t4, mul_add::<FMA>(high, t4, low));
    // z² = a²/2, split: the top 12 bits of `a` square exactly, the rest is small.
    let a_hi = f32::from_bits(a.to_bits() & 0xffff_f000);
    let hi = -0.5 * (a_hi * a_hi);
    let lo = p - 0.5 * ((a - a_hi) * (a + a_hi));
    let half_erfc = 0.5 * t * exp_split::<FMA>(hi, lo);
    if x < 0.0 {
        half_erfc
    } else {
        1.0 - half_erfc
    }
}

/// `1/√(2π)`, the standard normal density at 0.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// GELU, `x·Φ(x)` (the exact, erf form).
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    gelu_with::<false>(x)
}

/// [`gelu`], in fused multiply-adds when `FMA`.
#[inline(always)]
pub fn gelu_with<const FMA: bool>(x: f32) -> f32 {
    x * normal_cdf_with::<FMA>(x)
}

/// GELU's derivative, `Φ(x) + x·φ(x)` with `φ(x) = e^(−x²/2)/√(2π)`.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    gelu_grad_with::<false>(x)
}

/// [`gelu_grad`], in fused multiply-adds when `FMA`.
#[inline(always)]
pub fn gelu_grad_with<const FMA: bool>(x: f32) -> f32 {
    let density = INV_SQRT_2PI * exp_with::<FMA>(-0.5 * x * x);
    mul_add::<FMA>(x, density, normal_cdf_with::<FMA>(x))
}
