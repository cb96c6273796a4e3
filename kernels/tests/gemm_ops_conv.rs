//! `conv` module: conv2d, depthwise conv2d and conv2d_transpose — forward against naive f64
//! loops (with TensorFlow's padding rule recomputed here independently), backward against
//! central finite differences, chunked vs whole-batch equality, half storage, short slices.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::conv::*;
use memwise_kernels::Element;

/// (out, pad_before) by TensorFlow's rule, written independently of the kernel's.
fn tf_axis(input: usize, k: usize, s: usize, same: bool) -> (usize, usize) {
    let out = if same {
        input.div_ceil(s)
    } else {
        (input - k) / s + 1
    };
    let total = ((out - 1) * s + k) as isize - input as isize;
    (out, total.max(0) as usize / 2)
}

/// (n, h, w, c_in, c_out, kh, kw, sh, sw, same): odd and prime sizes, 5×3 kernels, stride 2
/// with same padding on odd sizes, 1×1 (pointwise and strided), kernel = input, kernel > input,
/// even kernels with an odd pad split.
type Cfg = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
);
const CONFIGS: &[Cfg] = &[
    (3, 7, 6, 3, 4, 3, 3, 1, 1, true),
    (2, 13, 7, 2, 5, 5, 3, 2, 2, true),
    (2, 13, 7, 2, 3, 5, 3, 2, 1, false),
    (5, 5, 5, 3, 2, 1, 1, 1, 1, true),
    (3, 7, 5, 4, 3, 1, 1, 2, 2, false),
    (2, 4, 3, 2, 3, 4, 3, 1, 1, false),
    (1, 3, 2, 1, 2, 5, 5, 1, 1, true),
    (2, 9, 11, 3, 2, 2, 4, 3, 2, true),
];

fn pad(same: bool) -> Padding {
    if same {
        Padding::Same
    } else {
        Padding::Valid
    }
}

fn conv_dims(&(n, h, w, c_in, c_out, kh, kw, sh, sw, same): &Cfg) -> Conv2dDims {
    Conv2dDims {
        n,
        h,
        w,
        c_in,
        c_out,
        kh,
        kw,
        sh,
        sw,
        padding: pad(same),
    }
}

fn naive_conv(d: Conv2dDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let same = d.padding == Padding::Same;
    let (oh, pt) = tf_axis(d.h, d.kh, d.sh, same);
    let (ow, pl) = tf_axis(d.w, d.kw, d.sw, same);
    assert_eq!(
        (oh, ow, pt, pl),
        (d.out_h(), d.out_w(), d.pad_top(), d.pad_left())
    );
    let mut y = vec![0f64; d.n * oh * ow * d.c_out];
    for s in 0..d.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..d.c_out {
                    let mut acc = b.map_or(0.0, |b| b[co] as f64);
                    for ki in 0..d.kh {
                        for kj in 0..d.kw {
                            let iy = (oy * d.sh + ki) as isize - pt as isize;
                            let ix = (ox * d.sw + kj) as isize - pl as isize;
                            if iy < 0 || ix < 0 || iy >= d.h as isize || ix >= d.w as isize {
                                continue;
                            }
                            for ci in 0..d.c_in {
                                let xv =
                                    x[((s * d.h + iy as usize) * d.w + ix as usize) * d.c_in + ci];
                                acc += xv as f64
                                    * w[((ki * d.kw + kj) * d.c_in + ci) * d.c_out + co] as f64;
                            }
                        }
                    }
                    y[((s * oh + oy) * ow + ox) * d.c_out + co] = acc;
                }
            }
        }
    }
    y
}

fn conv_fwd<T: Element>(
    d: Conv2dDims,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    chunk: usize,
) -> Vec<f32> {
    let mut y = vec![T::from_f32(f32::NAN); d.y_len()];
    let mut col = vec![T::from_f32(0.0); conv2d_col_len(d, chunk)];
    let mut ws = vec![0f32; conv2d_ws_len::<T>(d, chunk)];
    conv2d_forward(
        d,
        &to_t::<T>(x),
        &to_t::<T>(w),
        b,
        &mut y,
        &mut col,
        chunk,
        &mut ws,
    )
    .unwrap();
    to_f32(&y)
}

/// (dx, dw, db) with dw / db starting from zero.
fn conv_bwd<T: Element>(
    d: Conv2dDims,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    chunk: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![T::from_f32(f32::NAN); d.x_len()];
    let (mut dw, mut db) = (vec![0f32; d.w_len()], vec![0f32; d.c_out]);
    let mut col = vec![T::from_f32(0.0); conv2d_col_len(d, chunk)];
    let mut ws = vec![0f32; conv2d_ws_len::<T>(d, chunk)];
    conv2d_backward(
        d,
        &to_t::<T>(x),
        &to_t::<T>(w),
        &to_t::<T>(dy),
        Some(&mut dx),
        &mut dw,
        Some(&mut db),
        &mut col,
        chunk,
        &mut ws,
    )
    .unwrap();
    (to_f32(&dx), dw, db)
}

#[test]
fn conv2d_forward_matches_naive() {
    let mut rng = Rng::new(21);
    for cfg in CONFIGS {
        let d = conv_dims(cfg);
        let (x, w, b) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.c_out));
        for chunk in [1, 2, d.n] {
            assert_close(
                &format!("{d:?} chunk {chunk}"),
                &conv_fwd::<f32>(d, &x, &w, Some(&b), chunk),
                &naive_conv(d, &x, &w, Some(&b)),
                1e-5,
                1e-5,
            );
        }
        assert_close(
            "no bias",
            &conv_fwd::<f32>(d, &x, &w, None, 2),
            &naive_conv(d, &x, &w, None),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn conv2d_backward_matches_finite_differences() {
    let mut rng = Rng::new(22);
    for cfg in CONFIGS {
        let d = conv_dims(cfg);
        let (x, w, b, r) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.c_out),
            rng.vec(d.y_len()),
        );
        let chunk = 2;
        let (dx, dw, db) = conv_bwd::<f32>(d, &x, &w, &r, chunk);
        let what = format!("{d:?}");
        check_grad(&format!("{what} dx"), &x, &dx, &mut rng, 30, &mut |p| {
            dot(&conv_fwd::<f32>(d, p, &w, Some(&b), chunk), &r)
        });
        check_grad(&format!("{what} dw"), &w, &dw, &mut rng, 30, &mut |p| {
            dot(&conv_fwd::<f32>(d, &x, p, Some(&b), chunk), &r)
        });
        check_grad(&format!("{what} db"), &b, &db, &mut rng, 30, &mut |p| {
            dot(&conv_fwd::<f32>(d, &x, &w, Some(p), chunk), &r)
        });
    }
}

#[test]
fn conv2d_backward_accumulates_parameter_grads_and_skips_dx() {
    let d = conv_dims(&CONFIGS[1]);
    let mut rng = Rng::new(23);
    let (x, w, r) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.y_len()));
    let (_, dw1, db1) = conv_bwd::<f32>(d, &x, &w, &r, 1);
    let (mut dw, mut db) = (dw1.clone(), db1.clone());
    let mut col = vec![0f32; conv2d_col_len(d, 1)];
    conv2d_backward(
        d,
        &x,
        &w,
        &r,
        None,
        &mut dw,
        Some(&mut db),
        &mut col,
        1,
        &mut [],
    )
    .unwrap();
    let twice = |v: &[f32]| v.iter().map(|&a| 2.0 * a as f64).collect::<Vec<_>>();
    assert_close("dw", &dw, &twice(&dw1), 1e-6, 1e-6);
    assert_close("db", &db, &twice(&db1), 1e-6, 1e-6);
}

/// Any `chunk` gives the whole-batch result to f32 rounding (a few ulps): y, dx and db are the
/// same dot products, though the gemm crate may pick another depth blocking or a GEMV for a
/// different row count; dw additionally sums chunk by chunk.
const CHUNK_TOL: f64 = 1e-6;

#[test]
fn conv2d_chunked_equals_whole_batch() {
    let mut rng = Rng::new(24);
    for cfg in CONFIGS {
        let mut d = conv_dims(cfg);
        d.n = 5;
        let (x, w, b, r) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.c_out),
            rng.vec(d.y_len()),
        );
        let y5 = conv_fwd::<f32>(d, &x, &w, Some(&b), 5);
        let (dx5, dw5, db5) = conv_bwd::<f32>(d, &x, &w, &r, 5);
        for chunk in [1, 2, 3, 4, 9] {
            assert!(
                rel_err(&conv_fwd::<f32>(d, &x, &w, Some(&b), chunk), &y5) <= CHUNK_TOL,
                "{d:?} y chunk {chunk}"
            );
            let (dx, dw, db) = conv_bwd::<f32>(d, &x, &w, &r, chunk);
            assert!(rel_err(&dx, &dx5) <= CHUNK_TOL, "{d:?} dx chunk {chunk}");
            assert_eq!(db, db5, "{d:?} db chunk {chunk}"); // not chunked at all
            assert!(rel_err(&dw, &dw5) <= CHUNK_TOL, "{d:?} dw chunk {chunk}");
        }
    }
}

#[test]
fn conv2d_col_len_is_chunked_and_zero_for_pointwise() {
    let d = Conv2dDims {
        n: 32,
        h: 56,
        w: 56,
        c_in: 64,
        c_out: 64,
        kh: 3,
        kw: 3,
        sh: 1,
        sw: 1,
        padding: Padding::Same,
    };
    assert_eq!(conv2d_col_len(d, 4), 4 * 56 * 56 * 9 * 64);
    assert_eq!(conv2d_col_len(d, 100), 32 * 56 * 56 * 9 * 64);
    assert_eq!(conv2d_col_len(Conv2dDims { kh: 1, kw: 1, ..d }, 4), 0);
    assert_eq!(conv2d_ws_len::<f32>(d, 4), 0);
    // max over the three GEMMs of mb·kb + kb·nb + mb·nb with blocks capped at 256
    assert_eq!(conv2d_ws_len::<f16>(d, 4), 256 * 256 + 2 * 256 * 64);
}

fn check_conv_half<T: Element>(tol: f64) {
    let mut rng = Rng::new(25);
    for cfg in CONFIGS {
        let d = conv_dims(cfg);
        let x = rounded::<T>(&rng.vec(d.x_len()));
        let w = rounded::<T>(&rng.vec(d.w_len()));
        let r = rounded::<T>(&rng.vec(d.y_len()));
        let b = rng.vec(d.c_out);
        let what = format!("{} {d:?}", T::NAME);
        assert!(
            rel_err(
                &conv_fwd::<T>(d, &x, &w, Some(&b), 2),
                &conv_fwd::<f32>(d, &x, &w, Some(&b), 2)
            ) <= tol,
            "{what} y"
        );
        let (dx, dw, db) = conv_bwd::<T>(d, &x, &w, &r, 2);
        let (dx32, dw32, db32) = conv_bwd::<f32>(d, &x, &w, &r, 2);
        assert!(rel_err(&dx, &dx32) <= 2.0 * tol, "{what} dx"); // dy·Wᵀ is stored in T, then summed
        assert!(rel_err(&dw, &dw32) <= 1e-5, "{what} dw");
        assert!(rel_err(&db, &db32) <= 1e-5, "{what} db");
    }
}

/// Half storage vs f32 on the same rounded values: within a few units of T's rounding
/// (2⁻¹¹ f16, 2⁻⁸ bf16) relative to the tensor's scale; dw/db (f32) to f32 accuracy.
#[test]
fn conv2d_half_storage_within_tolerance_of_f32() {
    check_conv_half::<f16>(1e-3);
    check_conv_half::<bf16>(8e-3);
}

#[test]
fn conv2d_refuses_bad_arguments_without_writing() {
    let d = conv_dims(&CONFIGS[0]);
    let (x, w) = (vec![1f32; d.x_len()], vec![1f32; d.w_len()]);
    let mut y = vec![5f32; d.y_len()];
    let mut col = vec![0f32; conv2d_col_len(d, 2)];
    assert!(conv2d_forward(d, &x[1..], &w, None, &mut y, &mut col, 2, &mut []).is_err());
    assert!(conv2d_forward(d, &x, &w[1..], None, &mut y, &mut col, 2, &mut []).is_err());
    assert!(conv2d_forward(d, &x, &w, Some(&[0.0; 3]), &mut y, &mut col, 2, &mut []).is_err());
    assert!(conv2d_forward(d, &x, &w, None, &mut y[1..], &mut col, 2, &mut []).is_err());
    assert!(conv2d_forward(d, &x, &w, None, &mut y, &mut col[1..], 2, &mut []).is_err());
    assert!(
        conv2d_forward(d, &x, &w, None, &mut y, &mut col, 3, &mut []).is_err(),
        "col too short for chunk 3"
    );
    assert!(
        conv2d_forward(d, &x, &w, None, &mut y, &mut col, 0, &mut []).is_err(),
        "chunk 0"
    );
    assert!(y.iter().all(|&v| v == 5.0));
    let (mut dx, mut dw, mut db) = (
        vec![0f32; d.x_len()],
        vec![0f32; d.w_len()],
        vec![0f32; d.c_out],
    );
    assert!(conv2d_backward(
        d,
        &x,
        &w,
        &y[1..],
        Some(&mut dx),
        &mut dw,
        None,
        &mut col,
        2,
        &mut []
    )
    .is_err());
    assert!(conv2d_backward(
        d,
        &x,
        &w,
        &y,
        Some(&mut dx[1..]),
        &mut dw,
        None,
        &mut col,
        2,
        &mut []
    )
    .is_err());
    assert!(conv2d_backward(
        d,
        &x,
        &w,
        &y,
        None,
        &mut dw[1..],
        None,
        &mut col,
        2,
        &mut []
    )
    .is_err());
    assert!(conv2d_backward(
        d,
        &x,
        &w,
        &y,
        None,
        &mut dw,
        Some(&mut db[1..]),
        &mut col,
        2,
        &mut []
    )
    .is_err());
    assert!(dw.iter().all(|&v| v == 0.0));
    let valid_too_small = Conv2dDims {
        h: 2,
        padding: Padding::Valid,
        ..d
    };
    let err =
        conv2d_forward(valid_too_small, &x, &w, None, &mut y, &mut col, 2, &mut []).unwrap_err();
    assert!(err.0.contains("valid"), "{err}");
    let (xh, wh) = (to_t::<f16>(&x), to_t::<f16>(&w));
    let (mut yh, mut colh) = (
        vec![f16::ZERO; d.y_len()],
        vec![f16::ZERO; conv2d_col_len(d, 2)],
    );
    let mut ws = vec![0f32; conv2d_ws_len::<f16>(d, 2) - 1];
    assert!(conv2d_forward(d, &xh, &wh, None, &mut yh, &mut colh, 2, &mut ws).is_err());
}

// ---------------------------------------------------------------------------------------------
// depthwise

/// (n, h, w, c, multiplier, kh, kw, sh, sw, same)
const DW_CONFIGS: &[Cfg] = &[
    (2, 7, 6, 3, 1, 3, 3, 1, 1, true),
    (3, 13, 7, 2, 3, 5, 3, 2, 2, true),
    (2, 9, 5, 5, 2, 3, 2, 2, 1, false),
    (1, 4, 4, 3, 1, 1, 1, 1, 1, false),
    (2, 3, 5, 2, 2, 4, 4, 3, 3, true),
    // Stride 1, multiplier 1 (f32 takes the row-at-a-time loops): an even kernel under same
    // padding (more padding after than before), more channels than a block, and valid.
    (2, 6, 7, 70, 1, 4, 2, 1, 1, true),
    (2, 5, 6, 4, 1, 2, 3, 1, 1, false),
];

fn dw_dims(&(n, h, w, c, multiplier, kh, kw, sh, sw, same): &Cfg) -> DepthwiseConv2dDims {
    DepthwiseConv2dDims {
        n,
        h,
        w,
        c,
        multiplier,
        kh,
        kw,
        sh,
        sw,
        padding: pad(same),
    }
}

fn naive_depthwise(d: DepthwiseConv2dDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let same = d.padding == Padding::Same;
    let (oh, pt) = tf_axis(d.h, d.kh, d.sh, same);
    let (ow, pl) = tf_axis(d.w, d.kw, d.sw, same);
    assert_eq!((oh, ow), (d.out_h(), d.out_w()));
    let (c, m) = (d.c, d.multiplier);
    let mut y = vec![0f64; d.n * oh * ow * c * m];
    for s in 0..d.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ci in 0..c {
                    for mi in 0..m {
                        let mut acc = b.map_or(0.0, |b| b[ci * m + mi] as f64);
                        for ki in 0..d.kh {
                            for kj in 0..d.kw {
                                let iy = (oy * d.sh + ki) as isize - pt as isize;
                                let ix = (ox * d.sw + kj) as isize - pl as isize;
                                if iy < 0 || ix < 0 || iy >= d.h as isize || ix >= d.w as isize {
                                    continue;
                                }
                                let xv = x[((s * d.h + iy as usize) * d.w + ix as usize) * c + ci];
                                acc += xv as f64 * w[((ki * d.kw + kj) * c + ci) * m + mi] as f64;
                            }
                        }
                        y[((s * oh + oy) * ow + ox) * c * m + ci * m + mi] = acc;
                    }
                }
            }
        }
    }
    y
}

fn dw_fwd<T: Element>(d: DepthwiseConv2dDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![T::from_f32(f32::NAN); d.y_len()];
    depthwise_conv2d_forward(d, &to_t::<T>(x), &to_t::<T>(w), b, &mut y).unwrap();
    to_f32(&y)
}

fn dw_bwd<T: Element>(
    d: DepthwiseConv2dDims,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![T::from_f32(f32::NAN); d.x_len()];
    let (mut dw, mut db) = (vec![0f32; d.w_len()], vec![0f32; d.c_out()]);
    depthwise_conv2d_backward(
        d,
        &to_t::<T>(x),
        &to_t::<T>(w),
        &to_t::<T>(dy),
        Some(&mut dx),
        &mut dw,
        Some(&mut db),
    )
    .unwrap();
    (to_f32(&dx), dw, db)
}

#[test]
fn depthwise_forward_matches_naive() {
    let mut rng = Rng::new(31);
    for cfg in DW_CONFIGS {
        let d = dw_dims(cfg);
        let (x, w, b) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.c_out()));
        assert_close(
            &format!("{d:?}"),
            &dw_fwd::<f32>(d, &x, &w, Some(&b)),
            &naive_depthwise(d, &x, &w, Some(&b)),
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("{d:?} no bias"),
            &dw_fwd::<f32>(d, &x, &w, None),
            &naive_depthwise(d, &x, &w, None),
            1e-5,
            1e-5,
        );
    }
}

/// The f64 reference of a depthwise convolution's weight and bias gradients.
fn naive_depthwise_param_grads(
    d: DepthwiseConv2dDims,
    x: &[f32],
    dy: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow, c, m) = (d.out_h(), d.out_w(), d.c, d.multiplier);
    let (pt, pl) = (d.pad_top() as isize, d.pad_left() as isize);
    let (mut dw, mut db) = (vec![0f64; d.w_len()], vec![0f64; d.c_out()]);
    for s in 0..d.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for o in 0..c * m {
                    let g = dy[((s * oh + oy) * ow + ox) * c * m + o] as f64;
                    db[o] += g;
                    for ki in 0..d.kh {
                        for kj in 0..d.kw {
                            let iy = (oy * d.sh + ki) as isize - pt;
                            let ix = (ox * d.sw + kj) as isize - pl;
                            if iy < 0 || ix < 0 || iy >= d.h as isize || ix >= d.w as isize {
                                continue;
                            }
                            let xi = ((s * d.h + iy as usize) * d.w + ix as usize) * c + o / m;
                            dw[(ki * d.kw + kj) * c * m + o] += x[xi] as f64 * g;
                        }
                    }
                }
            }
        }
    }
    (dw, db)
}

/// With a workspace of row parts (the plan's scratch), an f32 multiplier-1 depthwise backward
/// sums its weight and bias gradients part by part — the 3×3, 8-channel registers path and
/// the general one — and matches the f64 reference and the path without a workspace; the
/// input gradient is the same bits; the result does not depend on the thread count.
#[test]
fn depthwise_backward_in_row_parts_matches_the_reference() {
    let mut rng = Rng::new(33);
    let configs: &[Cfg] = &[
        (3, 9, 7, 16, 1, 3, 3, 1, 1, true),
        (2, 11, 8, 24, 1, 3, 3, 2, 2, true),
        (2, 6, 7, 70, 1, 4, 2, 1, 1, true),
        (2, 8, 5, 12, 1, 3, 3, 1, 1, false),
    ];
    for cfg in configs {
        let d = dw_dims(cfg);
        let (x, w, dy) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.y_len()));
        let (want_dw, want_db) = naive_depthwise_param_grads(d, &x, &dy);
        let (want_dx, _, _) = dw_bwd::<f32>(d, &x, &w, &dy);
        for (parts, bias) in [(2, true), (5, true), (3, false)] {
            let part = d.w_len() + if bias { d.c_out() } else { 0 };
            let mut ws = vec![f32::NAN; parts * part + 3];
            let run = |ws: &mut [f32]| {
                let mut dx = vec![f32::NAN; d.x_len()];
                let (mut dw, mut db) = (vec![0f32; d.w_len()], vec![0f32; d.c_out()]);
                let db_arg = if bias { Some(&mut db[..]) } else { None };
                depthwise_conv2d_backward_ws(d, &x, &w, &dy, Some(&mut dx), &mut dw, db_arg, ws)
                    .unwrap();
                (dx, dw, db)
            };
            let (dx, dw, db) = run(&mut ws);
            let what = format!("{d:?} in {parts} parts");
            assert_close(&format!("{what} dw"), &dw, &want_dw, 1e-5, 1e-5);
            if bias {
                assert_close(&format!("{what} db"), &db, &want_db, 1e-5, 1e-5);
            } else {
                assert!(
                    db.iter().all(|&v| v == 0.0),
                    "{what}: db written without a bias"
                );
            }
            let same_bits =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same_bits(&dx, &want_dx),
                "{what}: dx differs from the path without parts"
            );
            let one_thread = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let (dx1, dw1, db1) = one_thread.install(|| run(&mut ws));
            assert!(
                same_bits(&dw, &dw1) && same_bits(&db, &db1) && same_bits(&dx, &dx1),
                "{what}: depends on the threads"
            );
        }
    }
}

#[test]
fn depthwise_backward_matches_finite_differences() {
    let mut rng = Rng::new(32);
    for cfg in DW_CONFIGS {
        let d = dw_dims(cfg);
        let (x, w, b, r) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.c_out()),
            rng.vec(d.y_len()),
        );
        let (dx, dw, db) = dw_bwd::<f32>(d, &x, &w, &r);
        let what = format!("{d:?}");
        check_grad(&format!("{what} dx"), &x, &dx, &mut rng, 30, &mut |p| {
            dot(&dw_fwd::<f32>(d, p, &w, Some(&b)), &r)
        });
        check_grad(&format!("{what} dw"), &w, &dw, &mut rng, 30, &mut |p| {
            dot(&dw_fwd::<f32>(d, &x, p, Some(&b)), &r)
        });
        check_grad(&format!("{what} db"), &b, &db, &mut rng, 30, &mut |p| {
            dot(&dw_fwd::<f32>(d, &x, &w, Some(p)), &r)
        });
        // parameter grads accumulate
        let (mut dw2, mut db2) = (dw.clone(), db.clone());
        depthwise_conv2d_backward(d, &x, &w, &r, None, &mut dw2, Some(&mut db2)).unwrap();
        assert_close(
            "dw twice",
            &dw2,
            &dw.iter().map(|&v| 2.0 * v as f64).collect::<Vec<_>>(),
            1e-6,
            1e-6,
        );
    }
}

#[test]
fn depthwise_half_storage_within_tolerance_of_f32() {
    let mut rng = Rng::new(33);
    for cfg in DW_CONFIGS {
        let d = dw_dims(cfg);
        for (name, tol) in [("f16", 1e-3), ("bf16", 8e-3)] {
            let round = |v: &[f32]| {
                if name == "f16" {
                    rounded::<f16>(v)
                } else {
                    rounded::<bf16>(v)
                }
            };
            let (x, w, r) = (
                round(&rng.vec(d.x_len())),
                round(&rng.vec(d.w_len())),
                round(&rng.vec(d.y_len())),
            );
            let y32 = dw_fwd::<f32>(d, &x, &w, None);
            let (dx32, dw32, _) = dw_bwd::<f32>(d, &x, &w, &r);
            let (y, (dx, dw, _)) = if name == "f16" {
                (dw_fwd::<f16>(d, &x, &w, None), dw_bwd::<f16>(d, &x, &w, &r))
            } else {
                (
                    dw_fwd::<bf16>(d, &x, &w, None),
                    dw_bwd::<bf16>(d, &x, &w, &r),
                )
            };
            assert!(rel_err(&y, &y32) <= tol, "{name} {d:?} y");
            assert!(rel_err(&dx, &dx32) <= tol, "{name} {d:?} dx");
            assert!(rel_err(&dw, &dw32) <= 1e-5, "{name} {d:?} dw");
        }
    }
}

#[test]
fn depthwise_refuses_short_slices() {
    let d = dw_dims(&DW_CONFIGS[1]);
    let (x, w) = (vec![1f32; d.x_len()], vec![1f32; d.w_len()]);
    let mut y = vec![5f32; d.y_len()];
    assert!(depthwise_conv2d_forward(d, &x[1..], &w, None, &mut y).is_err());
    assert!(depthwise_conv2d_forward(d, &x, &w[1..], None, &mut y).is_err());
    assert!(depthwise_conv2d_forward(d, &x, &w, None, &mut y[1..]).is_err());
    assert!(depthwise_conv2d_forward(d, &x, &w, Some(&[0.0]), &mut y).is_err());
    assert!(depthwise_conv2d_forward(
        DepthwiseConv2dDims { multiplier: 0, ..d },
        &x,
        &w,
        None,
        &mut y
    )
    .is_err());
    assert!(y.iter().all(|&v| v == 5.0));
    let mut dw = vec![0f32; d.w_len()];
    assert!(depthwise_conv2d_backward(d, &x, &w, &y[1..], None, &mut dw, None).is_err());
    assert!(depthwise_conv2d_backward(d, &x, &w, &y, None, &mut dw[1..], None).is_err());
    let mut dx = vec![0f32; d.x_len() - 1];
    assert!(depthwise_conv2d_backward(d, &x, &w, &y, Some(&mut dx), &mut dw, None).is_err());
    assert!(dw.iter().all(|&v| v == 0.0));
}

// ---------------------------------------------------------------------------------------------
// conv2d_transpose

fn tr_dims(&(n, h, w, c_in, c_out, kh, kw, sh, sw, same): &Cfg) -> ConvTranspose2dDims {
    ConvTranspose2dDims {
        n,
        h,
        w,
        c_in,
        c_out,
        kh,
        kw,
        sh,
        sw,
        padding: pad(same),
    }
}

/// (n, h, w, c_in, c_out, kh, kw, sh, sw, same): includes kernel < stride with same padding
/// and with valid padding (output rows no window reaches) and pointwise.
const TR_CONFIGS: &[Cfg] = &[
    (3, 4, 5, 3, 2, 3, 3, 2, 2, true),
    (2, 5, 3, 2, 3, 5, 3, 2, 1, false),
    (2, 3, 3, 4, 3, 3, 3, 1, 1, true),
    (3, 4, 3, 3, 2, 1, 1, 1, 1, true),
    (2, 3, 4, 2, 3, 2, 3, 3, 2, true),
    (1, 2, 3, 2, 2, 4, 2, 3, 2, false),
    (2, 3, 4, 2, 3, 1, 2, 2, 3, false),
];

/// Keras conv2d_transpose by scatter (keras `deconv_output_length`): the taps land on
/// `(in-1)·s + k` rows, the output has `in·s + max(k - s, 0)` (valid: the taps' rows, plus the
/// rows no tap reaches when k < s) or `in·s` (same), cropped by `max(taps - out, 0) / 2`
/// before.
fn naive_transpose(d: ConvTranspose2dDims, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let same = d.padding == Padding::Same;
    let out = |i: usize, k: usize, s: usize| {
        if same {
            i * s
        } else {
            i * s + k.saturating_sub(s)
        }
    };
    let (oh, ow) = (out(d.h, d.kh, d.sh), out(d.w, d.kw, d.sw));
    assert_eq!((oh, ow), (d.out_h(), d.out_w()));
    let pt = (((d.h - 1) * d.sh + d.kh) as isize - oh as isize).max(0) / 2;
    let pl = (((d.w - 1) * d.sw + d.kw) as isize - ow as isize).max(0) / 2;
    let mut y = vec![0f64; d.n * oh * ow * d.c_out];
    for s in 0..d.n {
        for p in 0..oh * ow {
            for co in 0..d.c_out {
                y[(s * oh * ow + p) * d.c_out + co] = b.map_or(0.0, |b| b[co] as f64);
            }
        }
        for iy in 0..d.h {
            for ix in 0..d.w {
                for ki in 0..d.kh {
                    for kj in 0..d.kw {
                        let oy = (iy * d.sh + ki) as isize - pt;
                        let ox = (ix * d.sw + kj) as isize - pl;
                        if oy < 0 || ox < 0 || oy >= oh as isize || ox >= ow as isize {
                            continue;
                        }
                        for co in 0..d.c_out {
                            let mut acc = 0f64;
                            for ci in 0..d.c_in {
                                acc += x[((s * d.h + iy) * d.w + ix) * d.c_in + ci] as f64
                                    * w[((ki * d.kw + kj) * d.c_out + co) * d.c_in + ci] as f64;
                            }
                            y[((s * oh + oy as usize) * ow + ox as usize) * d.c_out + co] += acc;
                        }
                    }
                }
            }
        }
    }
    y
}

fn tr_fwd<T: Element>(
    d: ConvTranspose2dDims,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    chunk: usize,
) -> Vec<f32> {
    let mut y = vec![T::from_f32(f32::NAN); d.y_len()];
    let mut col = vec![T::from_f32(0.0); conv2d_transpose_col_len(d, chunk)];
    let mut ws = vec![0f32; conv2d_transpose_ws_len::<T>(d, chunk)];
    conv2d_transpose_forward(
        d,
        &to_t::<T>(x),
        &to_t::<T>(w),
        b,
        &mut y,
        &mut col,
        chunk,
        &mut ws,
    )
    .unwrap();
    to_f32(&y)
}

fn tr_bwd<T: Element>(
    d: ConvTranspose2dDims,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    chunk: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![T::from_f32(f32::NAN); d.x_len()];
    let (mut dw, mut db) = (vec![0f32; d.w_len()], vec![0f32; d.c_out]);
    let mut col = vec![T::from_f32(0.0); conv2d_transpose_col_len(d, chunk)];
    let mut ws = vec![0f32; conv2d_transpose_ws_len::<T>(d, chunk)];
    conv2d_transpose_backward(
        d,
        &to_t::<T>(x),
        &to_t::<T>(w),
        &to_t::<T>(dy),
        Some(&mut dx),
        &mut dw,
        Some(&mut db),
        &mut col,
        chunk,
        &mut ws,
    )
    .unwrap();
    (to_f32(&dx), dw, db)
}

#[test]
fn conv2d_transpose_forward_matches_naive() {
    let mut rng = Rng::new(41);
    for cfg in TR_CONFIGS {
        let d = tr_dims(cfg);
        let (x, w, b) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.c_out));
        for chunk in [1, 2, d.n] {
            assert_close(
                &format!("{d:?} chunk {chunk}"),
                &tr_fwd::<f32>(d, &x, &w, Some(&b), chunk),
                &naive_transpose(d, &x, &w, Some(&b)),
                1e-5,
                1e-5,
            );
        }
    }
}

#[test]
fn conv2d_transpose_backward_matches_finite_differences() {
    let mut rng = Rng::new(42);
    for cfg in TR_CONFIGS {
        let d = tr_dims(cfg);
        let (x, w, b, r) = (
            rng.vec(d.x_len()),
            rng.vec(d.w_len()),
            rng.vec(d.c_out),
            rng.vec(d.y_len()),
        );
        let chunk = 2;
        let (dx, dw, db) = tr_bwd::<f32>(d, &x, &w, &r, chunk);
        let what = format!("{d:?}");
        check_grad(&format!("{what} dx"), &x, &dx, &mut rng, 30, &mut |p| {
            dot(&tr_fwd::<f32>(d, p, &w, Some(&b), chunk), &r)
        });
        check_grad(&format!("{what} dw"), &w, &dw, &mut rng, 30, &mut |p| {
            dot(&tr_fwd::<f32>(d, &x, p, Some(&b), chunk), &r)
        });
        check_grad(&format!("{what} db"), &b, &db, &mut rng, 30, &mut |p| {
            dot(&tr_fwd::<f32>(d, &x, &w, Some(p), chunk), &r)
        });
    }
}

#[test]
fn conv2d_transpose_chunked_equals_whole_batch_and_half_within_tolerance() {
    let mut rng = Rng::new(43);
    for cfg in TR_CONFIGS {
        let mut d = tr_dims(cfg);
        d.n = 5;
        let (x, w, b, r) = (
            rounded::<bf16>(&rng.vec(d.x_len())),
            rounded::<bf16>(&rng.vec(d.w_len())),
            rng.vec(d.c_out),
            rounded::<bf16>(&rng.vec(d.y_len())),
        );
        let y5 = tr_fwd::<f32>(d, &x, &w, Some(&b), 5);
        let (dx5, dw5, db5) = tr_bwd::<f32>(d, &x, &w, &r, 5);
        for chunk in [1, 2, 3, 7] {
            assert!(
                rel_err(&tr_fwd::<f32>(d, &x, &w, Some(&b), chunk), &y5) <= CHUNK_TOL,
                "{d:?} y chunk {chunk}"
            );
            let (dx, dw, db) = tr_bwd::<f32>(d, &x, &w, &r, chunk);
            assert!(rel_err(&dx, &dx5) <= CHUNK_TOL, "{d:?} dx chunk {chunk}");
            assert_eq!(db, db5);
            assert!(rel_err(&dw, &dw5) <= CHUNK_TOL, "{d:?} dw chunk {chunk}");
        }
        assert!(
            rel_err(&tr_fwd::<bf16>(d, &x, &w, Some(&b), 2), &y5) <= 1.6e-2,
            "bf16 {d:?} y"
        );
        let (dx, dw, db) = tr_bwd::<bf16>(d, &x, &w, &r, 2);
        assert!(rel_err(&dx, &dx5) <= 8e-3, "bf16 {d:?} dx");
        assert!(
            rel_err(&dw, &dw5) <= 1e-5 && rel_err(&db, &db5) <= 1e-5,
            "bf16 {d:?} dw db"
        );
        let (dxh, _, _) = tr_bwd::<f16>(d, &x, &w, &r, 3);
        assert!(rel_err(&dxh, &dx5) <= 1e-3, "f16 {d:?} dx");
    }
}

#[test]
fn conv2d_transpose_refuses_short_slices() {
    let d = tr_dims(&TR_CONFIGS[0]);
    let (x, w) = (vec![1f32; d.x_len()], vec![1f32; d.w_len()]);
    let mut y = vec![5f32; d.y_len()];
    let mut col = vec![0f32; conv2d_transpose_col_len(d, 1)];
    assert_eq!(col.len(), 4 * 5 * 9 * 2);
    assert!(conv2d_transpose_forward(d, &x[1..], &w, None, &mut y, &mut col, 1, &mut []).is_err());
    assert!(conv2d_transpose_forward(d, &x, &w[1..], None, &mut y, &mut col, 1, &mut []).is_err());
    assert!(conv2d_transpose_forward(d, &x, &w, None, &mut y[1..], &mut col, 1, &mut []).is_err());
    assert!(conv2d_transpose_forward(d, &x, &w, None, &mut y, &mut col[1..], 1, &mut []).is_err());
    assert!(conv2d_transpose_forward(d, &x, &w, None, &mut y, &mut col, 2, &mut []).is_err());
    assert!(y.iter().all(|&v| v == 5.0));
    let mut dw = vec![0f32; d.w_len()];
    assert!(conv2d_transpose_backward(
        d,
        &x,
        &w,
        &y[1..],
        None,
        &mut dw,
        None,
        &mut col,
        1,
        &mut []
    )
    .is_err());
    assert!(conv2d_transpose_backward(
        d,
        &x,
        &w,
        &y,
        None,
        &mut dw[1..],
        None,
        &mut col,
        1,
        &mut []
    )
    .is_err());
    assert!(dw.iter().all(|&v| v == 0.0));
}
