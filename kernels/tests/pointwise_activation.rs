//! Activations: forwards against f64 references, backwards against central differences
//! (tolerance `GRAD_ATOL`/`GRAD_RTOL` from pointwise_util), in-place variants bit-identical.
mod pointwise_util;

use half::{bf16, f16};
use memwise_kernels::activation::*;
use pointwise_util::*;

type Fwd = fn(&[f32], &mut [f32]) -> memwise_kernels::KResult;
type Bwd = fn(&[f32], &[f32], &mut [f32]) -> memwise_kernels::KResult;

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn gelu64(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

struct Case {
    name: &'static str,
    fwd: Fwd,
    fwd_ip: fn(&mut [f32]),
    bwd: Bwd,
    bwd_ip: fn(&[f32], &mut [f32]) -> memwise_kernels::KResult,
    reference: fn(f64) -> f64,
    /// Backward reads the output (true) or the input (false).
    from_output: bool,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "relu",
            fwd: relu_forward,
            fwd_ip: relu_inplace,
            bwd: relu_backward,
            bwd_ip: relu_backward_inplace,
            reference: |x| x.max(0.0),
            from_output: true,
        },
        Case {
            name: "sigmoid",
            fwd: sigmoid_forward,
            fwd_ip: sigmoid_inplace,
            bwd: sigmoid_backward,
            bwd_ip: sigmoid_backward_inplace,
            reference: sigmoid64,
            from_output: true,
        },
        Case {
            name: "tanh",
            fwd: tanh_forward,
            fwd_ip: tanh_inplace,
            bwd: tanh_backward,
            bwd_ip: tanh_backward_inplace,
            reference: f64::tanh,
            from_output: true,
        },
        Case {
            name: "gelu",
            fwd: gelu_forward,
            fwd_ip: gelu_inplace,
            bwd: gelu_backward,
            bwd_ip: gelu_backward_inplace,
            reference: gelu64,
            from_output: false,
        },
        Case {
            name: "silu",
            fwd: silu_forward,
            fwd_ip: silu_inplace,
            bwd: silu_backward,
            bwd_ip: silu_backward_inplace,
            reference: |x| x * sigmoid64(x),
            from_output: false,
        },
    ]
}

#[test]
fn pointwise_forwards_match_f64_reference() {
    let mut rng = Rng::new(10);
    for c in cases() {
        // Includes large magnitudes (saturation, exp overflow paths) and the parallel path.
        let mut x = rng.vec(40_000, -8.0, 8.0);
        x.extend([-100.0, -30.0, 0.0, 30.0, 100.0]);
        let mut y = vec![0f32; x.len()];
        (c.fwd)(&x, &mut y).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| (c.reference)(v as f64)).collect();
        assert_close(c.name, &y, &want, 2e-7, 2e-6);
        let mut ip = x.clone();
        (c.fwd_ip)(&mut ip);
        assert_eq!(bits(&ip), bits(&y), "{} in place", c.name);
    }
}

#[test]
fn pointwise_backwards_match_finite_differences() {
    let mut rng = Rng::new(11);
    for c in cases() {
        for trial in 0..4 {
            let n = rng.pick(SIZES) * rng.pick(SIZES) + trial;
            // Keep away from relu's kink so ±EPS never crosses it.
            let x = rng.vec_away_from_zero(n, -4.0, 4.0, 0.05);
            let r = rng.vec(n, -1.0, 1.0);
            let mut y = vec![0f32; n];
            (c.fwd)(&x, &mut y).unwrap();
            let saved = if c.from_output { &y } else { &x };
            let mut dx = vec![f32::NAN; n];
            (c.bwd)(saved, &r, &mut dx).unwrap();
            let num = numeric_grad(&x, |xp| {
                let mut yp = vec![0f32; n];
                (c.fwd)(xp, &mut yp).unwrap();
                dot(&yp, &r)
            });
            assert_grad(c.name, &dx, &num, GRAD_ATOL, GRAD_RTOL);
            let mut ip = r.clone();
            (c.bwd_ip)(saved, &mut ip).unwrap();
            assert_eq!(bits(&ip), bits(&dx), "{} backward in place", c.name);
        }
    }
}

#[test]
fn activation_enum_dispatches_and_reports_saved_tensor() {
    let mut rng = Rng::new(12);
    let x = rng.vec_away_from_zero(31, -3.0, 3.0, 0.05);
    let dy = rng.vec(31, -1.0, 1.0);
    for (act, c) in [
        Activation::Relu,
        Activation::Sigmoid,
        Activation::Tanh,
        Activation::Gelu,
        Activation::Silu,
    ]
    .into_iter()
    .zip(cases())
    {
        let mut y1 = vec![0f32; 31];
        let mut y2 = vec![0f32; 31];
        act.forward(&x, &mut y1).unwrap();
        (c.fwd)(&x, &mut y2).unwrap();
        assert_eq!(y1, y2);
        assert_eq!(act.saved() == Saved::Output, c.from_output);
        assert_eq!(act.inplace_safe_for_training(), c.from_output);
        let saved = if c.from_output { &y1 } else { &x };
        let mut d1 = vec![0f32; 31];
        let mut d2 = vec![0f32; 31];
        act.backward(saved, &dy, &mut d1).unwrap();
        (c.bwd)(saved, &dy, &mut d2).unwrap();
        assert_eq!(d1, d2);
        let mut d3 = dy.clone();
        act.backward_inplace(saved, &mut d3).unwrap();
        assert_eq!(d3, d1);
    }
    let mut y = vec![0f32; 31];
    Activation::Linear.forward(&x, &mut y).unwrap();
    assert_eq!(y, x);
    assert_eq!(Activation::Linear.saved(), Saved::Nothing);
}

#[test]
fn half_precision_storage_computes_in_f32() {
    let mut rng = Rng::new(13);
    let x32 = rng.vec(257, -4.0, 4.0);
    let xh: Vec<f16> = x32.iter().map(|&v| f16::from_f32(v)).collect();
    let xb: Vec<bf16> = x32.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut yh = vec![f16::ZERO; 257];
    let mut yb = vec![bf16::ZERO; 257];
    gelu_forward(&xh, &mut yh).unwrap();
    gelu_forward(&xb, &mut yb).unwrap();
    for i in 0..257 {
        // Exactly the f32 result of the stored input, rounded once.
        let mut o = [0f32];
        gelu_forward(&[xh[i].to_f32()], &mut o).unwrap();
        assert_eq!(yh[i], f16::from_f32(o[0]));
        gelu_forward(&[xb[i].to_f32()], &mut o).unwrap();
        assert_eq!(yb[i], bf16::from_f32(o[0]));
    }
}

#[test]
fn pointwise_length_mismatch_is_an_error() {
    let x = [1f32; 4];
    let mut y = [0f32; 5];
    assert!(relu_forward(&x, &mut y).is_err());
    assert!(gelu_backward(&x, &x, &mut y).is_err());
    assert!(sigmoid_backward(&x[..3], &x, &mut y[..4]).is_err());
    assert!(tanh_backward_inplace(&x[..3], &mut y[..4]).is_err());
    let msg = silu_forward(&x, &mut y).unwrap_err().to_string();
    assert!(
        msg.contains("silu_forward") && msg.contains('4') && msg.contains('5'),
        "{msg}"
    );
}

fn softmax_ref(x: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        out.extend(row.iter().map(|&v| (v as f64 - m).exp() / s));
    }
    out
}

#[test]
fn softmax_forward_matches_reference_and_is_stable() {
    let mut rng = Rng::new(14);
    for trial in 0..5 {
        let rows = rng.pick(SIZES);
        let cols = rng.pick(SIZES) * 3 + trial;
        // Large logits: a naive exp would overflow.
        let x = rng.vec(rows * cols, -50.0, 90.0);
        let mut y = vec![0f32; rows * cols];
        softmax_forward(&x, &mut y, rows, cols).unwrap();
        assert_close("softmax", &y, &softmax_ref(&x, rows, cols), 1e-7, 1e-5);
        let mut ip = x.clone();
        softmax_inplace(&mut ip, rows, cols).unwrap();
        assert_eq!(bits(&ip), bits(&y));
    }
    // Parallel path: many rows.
    let (rows, cols) = (4001, 17);
    let x = rng.vec(rows * cols, -5.0, 5.0);
    let mut y = vec![0f32; rows * cols];
    softmax_forward(&x, &mut y, rows, cols).unwrap();
    assert_close("softmax big", &y, &softmax_ref(&x, rows, cols), 1e-7, 1e-5);
}

#[test]
fn softmax_mixed_types_and_masked_rows() {
    let mut rng = Rng::new(15);
    let (rows, cols) = (3, 10);
    let x32 = rng.vec(rows * cols, -4.0, 4.0);
    let xh: Vec<f16> = x32.iter().map(|&v| f16::from_f32(v)).collect();
    let mut p = vec![0f32; rows * cols];
    softmax_forward(&xh, &mut p, rows, cols).unwrap();
    let xr: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    assert_close(
        "f16→f32 softmax",
        &p,
        &softmax_ref(&xr, rows, cols),
        1e-7,
        1e-5,
    );

    // A fully masked row (all −inf) gives zeros, not NaN; a partly masked row ignores −inf.
    let mut x = vec![0f32; 2 * 4];
    x[..4].fill(f32::NEG_INFINITY);
    x[4] = f32::NEG_INFINITY;
    let mut y = vec![0f32; 8];
    softmax_forward(&x, &mut y, 2, 4).unwrap();
    assert_eq!(&y[..4], &[0.0; 4]);
    assert_eq!(y[4], 0.0);
    assert!((y[5] - 1.0 / 3.0).abs() < 1e-7);
    // NaN propagates.
    x[6] = f32::NAN;
    softmax_forward(&x, &mut y, 2, 4).unwrap();
    assert!(y[4..].iter().any(|v| v.is_nan()));
}

#[test]
fn softmax_backward_matches_finite_differences() {
    let mut rng = Rng::new(16);
    for trial in 0..5 {
        let rows = rng.pick(SIZES);
        let cols = rng.pick(SIZES) + trial;
        let x = rng.vec(rows * cols, -3.0, 3.0);
        let r = rng.vec(rows * cols, -1.0, 1.0);
        let mut y = vec![0f32; rows * cols];
        softmax_forward(&x, &mut y, rows, cols).unwrap();
        let mut dx = vec![f32::NAN; rows * cols];
        softmax_backward(&y, &r, &mut dx, rows, cols).unwrap();
        let num = numeric_grad(&x, |xp| {
            let mut yp = vec![0f32; rows * cols];
            softmax_forward(xp, &mut yp, rows, cols).unwrap();
            dot(&yp, &r)
        });
        assert_grad("softmax", &dx, &num, GRAD_ATOL, GRAD_RTOL);
        let mut ip = r.clone();
        softmax_backward_inplace(&y, &mut ip, rows, cols).unwrap();
        assert_eq!(bits(&ip), bits(&dx));
        // Mixed types: f32 probs, f16 gradient in and out.
        let rh: Vec<f16> = r.iter().map(|&v| f16::from_f32(v)).collect();
        let mut dh = vec![f16::ZERO; rows * cols];
        softmax_backward(&y, &rh, &mut dh, rows, cols).unwrap();
        for i in 0..dh.len() {
            assert!((dh[i].to_f32() - dx[i]).abs() <= 2e-3 + 2e-3 * dx[i].abs());
        }
    }
    let mut y = [0f32; 6];
    assert!(softmax_forward(&[0f32; 5], &mut y, 2, 3).is_err());
    assert!(softmax_backward(&[0f32; 6], &[0f32; 6], &mut y[..5], 2, 3).is_err());
}

/// The activations with a parameter, at their defaults and at other values (0 included, the
/// boundary the planner allows), through the enum the executors run: forward against an f64
/// reference, backward (from the output, as the planner saves it) against central
/// differences, in-place forms bit-identical.
#[test]
fn parameterised_activations_match_references_and_finite_differences() {
    let mut rng = Rng::new(14);
    type Reference = fn(f64, f64) -> f64;
    let cases: [(&str, Reference); 2] = [
        ("leaky_relu", |x, a| if x > 0.0 { x } else { a * x }),
        ("elu", |x, a| if x > 0.0 { x } else { a * x.exp_m1() }),
    ];
    for (name, reference) in cases {
        for alpha in [0.0f32, 0.01, 0.3, 1.0, 1.7] {
            let act = Activation::from_name(name, alpha).unwrap();
            assert_eq!((act.name(), act.param()), (name, alpha));
            assert_eq!(act.saved(), Saved::Output);
            let what = format!("{name}(alpha = {alpha})");
            let mut x = rng.vec(20_000, -8.0, 8.0);
            x.extend([-100.0, -30.0, -1e-30, 0.0, 1e-30, 30.0]);
            let mut y = vec![0f32; x.len()];
            act.forward(&x, &mut y).unwrap();
            let want: Vec<f64> = x
                .iter()
                .map(|&v| reference(v as f64, alpha as f64))
                .collect();
            assert_close(&what, &y, &want, 2e-7, 2e-6);
            let mut ip = x.clone();
            act.forward_inplace(&mut ip);
            assert_eq!(bits(&ip), bits(&y), "{what} in place");

            let n = 257;
            // Away from the kink at 0, where the one-sided slopes differ.
            let x = rng.vec_away_from_zero(n, -4.0, 4.0, 0.05);
            let r = rng.vec(n, -1.0, 1.0);
            let mut y = vec![0f32; n];
            act.forward(&x, &mut y).unwrap();
            let mut dx = vec![f32::NAN; n];
            act.backward(&y, &r, &mut dx).unwrap();
            let num = numeric_grad(&x, |xp| {
                let mut yp = vec![0f32; n];
                act.forward(xp, &mut yp).unwrap();
                dot(&yp, &r)
            });
            assert_grad(&what, &dx, &num, GRAD_ATOL, GRAD_RTOL);
            let mut g = r.clone();
            act.backward_inplace(&y, &mut g).unwrap();
            assert_eq!(bits(&g), bits(&dx), "{what} backward in place");
        }
    }
}

/// Every activation computes the same bits whether an element is in a vectorised loop's lanes
/// (16 wide on AVX-512, 8 on AVX2, where the CPU has them) or alone (the loop's scalar
/// remainder): the wide loops reorder nothing, and where they fuse a multiply with an add
/// (GELU's polynomials, `elementwise::wide_loop`) their remainder fuses it too.
#[test]
fn wide_loops_compute_each_element_as_the_scalar_code_does() {
    let n = 4099;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.7919).sin() * 9.0 - 0.5 + (i % 7) as f32 * 1e-3)
        .collect();
    let dy: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.31).cos()).collect();
    for &name in Activation::NAMES {
        let Some(act) = Activation::from_name(name, 0.25) else {
            continue;
        };
        let mut y = vec![0f32; n];
        act.forward(&x, &mut y).unwrap();
        let mut dx = vec![0f32; n];
        let saved = if act.saved() == Saved::Output { &y } else { &x };
        act.backward(saved, &dy, &mut dx).unwrap();
        for i in 0..n {
            let (mut one, mut d_one) = ([0f32], [0f32]);
            act.forward(&x[i..i + 1], &mut one).unwrap();
            act.backward(&saved[i..i + 1], &dy[i..i + 1], &mut d_one)
                .unwrap();
            assert_eq!(
                y[i].to_bits(),
                one[0].to_bits(),
                "{name} forward at x = {}",
                x[i]
            );
            assert_eq!(
                dx[i].to_bits(),
                d_one[0].to_bits(),
                "{name} backward at x = {}",
                x[i]
            );
        }
    }
}
