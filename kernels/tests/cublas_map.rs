//! The mapping of the ops' row-major GEMMs onto column-major cuBLAS arguments
//! (`cublas_map`), checked by running every mapped call on a literal column-major reference
//! GEMM and comparing with the CPU kernels: dense, conv2d and conv2d_transpose (pointwise and
//! chunked im2col), and attention's four strided-batched stages, with both ways of splitting
//! (batch, head) pairs. Every call also passes cuBLAS's argument rules and stays inside its
//! buffers.

use half::f16;
use memwise_kernels as k;
use memwise_kernels::cublas_map::{self as cm, CublasGemm, MatRef, Operand, RowGemm};
use memwise_kernels::Element;

struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Maps `g`, checks cuBLAS's rules and the buffer bounds, and runs it on the reference.
/// `a`, `b`, `c` are the buffers of the row-major roles `g.a`, `g.b`, `g.c`.
fn run<T: Element, C: Element>(g: &RowGemm, a: &[T], b: &[T], c: &mut [C]) -> CublasGemm {
    let cg = cm::to_cublas(g);
    cg.validate().unwrap_or_else(|e| panic!("{g:?}: {e}"));
    let lens = [(cg.a.0, b.len()), (cg.b.0, a.len()), (cg.c.0, c.len())];
    for ((op, end), (op2, len)) in cg.extents().iter().zip(lens) {
        assert_eq!(*op, op2);
        assert!(*end <= len, "{op:?} reaches element {end} of {len}");
    }
    cm::reference_gemm(&cg, b, a, c);
    cg
}

#[test]
fn the_mapping_swaps_operands_and_dimensions() {
    // Row-major C[2×3] = A[2×4]·B[4×3] is column-major Cᵀ[3×2] = Bᵀ·Aᵀ.
    let g = RowGemm::single(
        2,
        3,
        4,
        MatRef::new(Operand::X, 0, 4),
        MatRef::new(Operand::W, 0, 3),
        MatRef::new(Operand::Y, 0, 3),
        0.0,
    );
    let c = cm::to_cublas(&g);
    assert_eq!((c.m, c.n, c.k), (3, 2, 4));
    assert_eq!((c.a.0, c.b.0, c.c.0), (Operand::W, Operand::X, Operand::Y));
    assert_eq!((c.lda, c.ldb, c.ldc), (3, 4, 3));
    assert!(!c.transa && !c.transb);
    // A transposed operand keeps its flag and its own leading dimension.
    let g = RowGemm::single(
        2,
        3,
        4,
        MatRef::new(Operand::X, 0, 2).t(),
        MatRef::new(Operand::W, 0, 4).t(),
        MatRef::new(Operand::Y, 0, 3),
        1.0,
    );
    let c = cm::to_cublas(&g);
    assert!(c.transa && c.transb);
    assert_eq!((c.lda, c.ldb), (4, 2));
    assert_eq!(c.beta, 1.0);
    // A matrix whose leading dimension is too small is refused.
    let bad = RowGemm::single(
        2,
        3,
        4,
        MatRef::new(Operand::X, 0, 3),
        MatRef::new(Operand::W, 0, 3),
        MatRef::new(Operand::Y, 0, 3),
        0.0,
    );
    assert!(cm::to_cublas(&bad).validate().is_err());
}

#[test]
fn dense_gemms_match_the_cpu_kernels() {
    let mut r = Rng(1);
    for (batch, i, o) in [(5, 7, 3), (1, 1, 1), (33, 16, 9)] {
        let d = k::dense::DenseDims {
            batch,
            in_features: i,
            out_features: o,
        };
        let (x, w, dy) = (r.vec(batch * i), r.vec(i * o), r.vec(batch * o));
        let mut want = vec![0f32; batch * o];
        k::dense::dense_forward(d, &x, &w, None, &mut want, &mut []).unwrap();
        let mut y = vec![0f32; batch * o];
        run(&cm::dense_forward(d), &x, &w, &mut y);
        close("dense y", &y, &want, 1e-5);

        let dw0 = r.vec(i * o);
        let (mut wdx, mut wdw) = (vec![0f32; batch * i], dw0.clone());
        k::dense::dense_backward(d, &x, &w, &dy, Some(&mut wdx), &mut wdw, None, &mut []).unwrap();
        let (mut dx, mut dw) = (vec![0f32; batch * i], dw0.clone());
        let gs = cm::dense_backward(d, true);
        assert_eq!(gs.len(), 2);
        run(&gs[0], &x, &dy, &mut dw);
        run(&gs[1], &dy, &w, &mut dx);
        close("dense dw", &dw, &wdw, 1e-5);
        close("dense dx", &dx, &wdx, 1e-5);
        assert_eq!(cm::dense_backward(d, false).len(), 1);
    }
}

/// Half operands, f32 weight gradient: the `gemm_ex` case (f16 in, f32 out, f32 compute).
#[test]
fn mixed_precision_weight_gradient() {
    let mut r = Rng(2);
    let (batch, i, o) = (9, 6, 4);
    let d = k::dense::DenseDims {
        batch,
        in_features: i,
        out_features: o,
    };
    let x: Vec<f16> = r.vec(batch * i).iter().map(|&v| f16::from_f32(v)).collect();
    let w: Vec<f16> = r.vec(i * o).iter().map(|&v| f16::from_f32(v)).collect();
    let dy: Vec<f16> = r.vec(batch * o).iter().map(|&v| f16::from_f32(v)).collect();
    let mut ws = vec![0f32; k::dense::dense_ws_len::<f16>(d)];
    let mut wdw = vec![0f32; i * o];
    k::dense::dense_backward(d, &x, &w, &dy, None, &mut wdw, None, &mut ws).unwrap();
    let mut dw = vec![0f32; i * o];
    run(&cm::dense_backward(d, false)[0], &x, &dy, &mut dw);
    close("f16 dense dw", &dw, &wdw, 1e-5);
}

// Plain reference im2col / col2im (the CUDA kernels are checked in cuda_emulation.rs).
fn im2col(g: &k::cuda::MwGeom, img: &[f32], n0: usize, cn: usize, col: &mut [f32]) {
    let (kk, p) = (g.k(), (g.oh * g.ow) as usize);
    for r in 0..cn * p {
        let (s, q) = (n0 + r / p, r % p);
        let (oy, ox) = ((q / g.ow as usize) as i32, (q % g.ow as usize) as i32);
        for e in 0..kk {
            let (ci, tap) = ((e % g.c as usize) as i32, (e / g.c as usize) as i32);
            let (iy, ix) = (oy * g.sh + tap / g.kw - g.pt, ox * g.sw + tap % g.kw - g.pl);
            col[r * kk + e] = if iy < 0 || iy >= g.h || ix < 0 || ix >= g.w {
                0.0
            } else {
                img[((s * g.h as usize + iy as usize) * g.w as usize + ix as usize) * g.c as usize
                    + ci as usize]
            };
        }
    }
}

fn col2im(g: &k::cuda::MwGeom, col: &[f32], cn: usize, img: &mut [f32]) {
    let (kk, p) = (g.k(), (g.oh * g.ow) as usize);
    img.iter_mut().for_each(|v| *v = 0.0);
    for r in 0..cn * p {
        let (s, q) = (r / p, r % p);
        let (oy, ox) = ((q / g.ow as usize) as i32, (q % g.ow as usize) as i32);
        for e in 0..kk {
            let (ci, tap) = ((e % g.c as usize) as i32, (e / g.c as usize) as i32);
            let (iy, ix) = (oy * g.sh + tap / g.kw - g.pt, ox * g.sw + tap % g.kw - g.pl);
            if iy >= 0 && iy < g.h && ix >= 0 && ix < g.w {
                img[((s * g.h as usize + iy as usize) * g.w as usize + ix as usize)
                    * g.c as usize
                    + ci as usize] += col[r * kk + e];
            }
        }
    }
}

#[test]
fn conv2d_gemms_match_the_cpu_kernels() {
    use k::conv::{Conv2dDims, Padding};
    let mut r = Rng(3);
    for (n, h, w, c_in, c_out, kh, kw, sh, sw, padding) in [
        (3, 6, 5, 3, 4, 3, 3, 1, 1, Padding::Same),
        (2, 7, 7, 2, 5, 2, 3, 2, 2, Padding::Valid),
        (2, 4, 4, 3, 2, 1, 1, 1, 1, Padding::Same),
    ] {
        let d = Conv2dDims {
            n,
            h,
            w,
            c_in,
            c_out,
            kh,
            kw,
            sh,
            sw,
            padding,
        };
        let g = k::cuda::MwGeom::conv2d(&d);
        let (x, wt, dy) = (r.vec(d.x_len()), r.vec(d.w_len()), r.vec(d.y_len()));
        for chunk in [1, 2, 5] {
            let mut col_cpu = vec![0f32; k::conv::conv2d_col_len(d, chunk)];
            let (mut wy, mut wdx, mut wdw) = (
                vec![0f32; d.y_len()],
                vec![0f32; d.x_len()],
                vec![0f32; d.w_len()],
            );
            k::conv::conv2d_forward(d, &x, &wt, None, &mut wy, &mut col_cpu, chunk, &mut [])
                .unwrap();
            k::conv::conv2d_backward(
                d,
                &x,
                &wt,
                &dy,
                Some(&mut wdx),
                &mut wdw,
                None,
                &mut col_cpu,
                chunk,
                &mut [],
            )
            .unwrap();
            let (mut y, mut dx, mut dw) = (
                vec![0f32; d.y_len()],
                vec![0f32; d.x_len()],
                vec![0f32; d.w_len()],
            );
            if d.is_pointwise() {
                run(&cm::conv2d_forward_pointwise(&d), &x, &wt, &mut y);
                let gs = cm::conv2d_backward_pointwise(&d, true);
                run(&gs[0], &x, &dy, &mut dw);
                run(&gs[1], &dy, &wt, &mut dx);
            } else {
                let p = d.out_h() * d.out_w();
                let mut col = vec![0f32; chunk.min(n) * p * g.k()];
                let img = h * w * c_in;
                for (n0, cn) in cm::chunks(n, chunk) {
                    im2col(&g, &x, n0, cn, &mut col);
                    run(&cm::conv2d_forward_chunk(&d, n0, cn), &col, &wt, &mut y);
                    let (gw, gx) = cm::conv2d_backward_chunk(&d, n0, cn);
                    run(&gw, &col, &dy, &mut dw);
                    run(&gx, &dy, &wt, &mut col);
                    col2im(&g, &col, cn, &mut dx[n0 * img..(n0 + cn) * img]);
                }
            }
            close("conv2d y", &y, &wy, 1e-5);
            close("conv2d dx", &dx, &wdx, 1e-5);
            close("conv2d dw", &dw, &wdw, 1e-4);
        }
    }
}

#[test]
fn conv2d_transpose_gemms_match_the_cpu_kernels() {
    use k::conv::{ConvTranspose2dDims, Padding};
    let mut r = Rng(4);
    for (n, h, w, c_in, c_out, kh, kw, sh, sw, padding) in [
        (2, 3, 4, 3, 2, 3, 3, 2, 2, Padding::Same),
        (3, 2, 3, 2, 4, 2, 2, 1, 2, Padding::Valid),
        (2, 3, 3, 4, 3, 1, 1, 1, 1, Padding::Same),
    ] {
        let d = ConvTranspose2dDims {
            n,
            h,
            w,
            c_in,
            c_out,
            kh,
            kw,
            sh,
            sw,
            padding,
        };
        let g = k::cuda::MwGeom::conv2d_transpose(&d);
        let (x, wt, dy) = (r.vec(d.x_len()), r.vec(d.w_len()), r.vec(d.y_len()));
        for chunk in [1, 2] {
            let mut col_cpu = vec![0f32; k::conv::conv2d_transpose_col_len(d, chunk)];
            let (mut wy, mut wdx, mut wdw) = (
                vec![0f32; d.y_len()],
                vec![0f32; d.x_len()],
                vec![0f32; d.w_len()],
            );
            k::conv::conv2d_transpose_forward(
                d,
                &x,
                &wt,
                None,
                &mut wy,
                &mut col_cpu,
                chunk,
                &mut [],
            )
            .unwrap();
            k::conv::conv2d_transpose_backward(
                d,
                &x,
                &wt,
                &dy,
                Some(&mut wdx),
                &mut wdw,
                None,
                &mut col_cpu,
                chunk,
                &mut [],
            )
            .unwrap();
            let (mut y, mut dx, mut dw) = (
                vec![0f32; d.y_len()],
                vec![0f32; d.x_len()],
                vec![0f32; d.w_len()],
            );
            if d.is_pointwise() {
                run(&cm::conv2d_transpose_forward_pointwise(&d), &x, &wt, &mut y);
                let gs = cm::conv2d_transpose_backward_pointwise(&d, true);
                run(&gs[0], &dy, &x, &mut dw);
                run(&gs[1], &dy, &wt, &mut dx);
            } else {
                let mut col = vec![0f32; chunk.min(n) * h * w * g.k()];
                let img_out = d.out_h() * d.out_w() * c_out;
                for (n0, cn) in cm::chunks(n, chunk) {
                    run(
                        &cm::conv2d_transpose_forward_chunk(&d, n0, cn),
                        &x,
                        &wt,
                        &mut col,
                    );
                    col2im(&g, &col, cn, &mut y[n0 * img_out..(n0 + cn) * img_out]);
                    im2col(&g, &dy, n0, cn, &mut col);
                    let gs = cm::conv2d_transpose_backward_chunk(&d, n0, cn, true);
                    run(&gs[0], &col, &x, &mut dw);
                    run(&gs[1], &col, &wt, &mut dx);
                }
            }
            close("conv2d_transpose y", &y, &wy, 1e-5);
            close("conv2d_transpose dx", &dx, &wdx, 1e-5);
            close("conv2d_transpose dw", &dw, &wdw, 1e-4);
        }
    }
}

#[test]
fn attention_gemms_match_the_cpu_kernels() {
    use k::attention::{self as at, AttentionDims};
    let mut r = Rng(5);
    // batch < heads (loop over batch items, batch the heads) and batch > heads (the reverse).
    for (batch, seq, heads, hd) in [(2, 5, 3, 4), (4, 3, 2, 2), (1, 7, 1, 8)] {
        let d = AttentionDims {
            batch,
            seq,
            hidden: heads * hd,
            heads,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let qkv = r.vec(d.qkv_len());
        let mut wp = vec![0f32; d.scores_len()];
        at::scores_forward(d, &qkv, &mut wp, scale, false, &mut []).unwrap();
        let mut probs = vec![0f32; d.scores_len()];
        let gs = cm::attention_scores(&d, scale);
        assert_eq!(gs.len(), batch.min(heads));
        for g in &gs {
            run(g, &qkv, &qkv, &mut probs);
        }
        close("scores", &probs, &wp, 1e-5);

        k::activation::softmax_inplace(&mut probs, batch * heads * seq, seq).unwrap();
        let mut wctx = vec![0f32; d.ctx_len()];
        at::context_forward(d, &probs, &qkv, &mut wctx, &mut []).unwrap();
        let mut ctx = vec![0f32; d.ctx_len()];
        for g in &cm::attention_context(&d) {
            run(g, &probs, &qkv, &mut ctx);
        }
        close("context", &ctx, &wctx, 1e-5);

        let dctx = r.vec(d.ctx_len());
        let (mut wdp, mut wdqkv) = (vec![0f32; d.scores_len()], vec![0f32; d.qkv_len()]);
        at::context_backward(d, &dctx, &probs, &qkv, &mut wdp, &mut wdqkv, &mut []).unwrap();
        at::scores_backward(d, &wdp, &qkv, &mut wdqkv, scale, &mut []).unwrap();
        let (mut dp, mut dqkv) = (vec![0f32; d.scores_len()], vec![f32::NAN; d.qkv_len()]);
        let (gdp, gdv) = cm::attention_context_backward(&d);
        for g in &gdp {
            run(g, &dctx, &qkv, &mut dp);
        }
        for g in &gdv {
            run(g, &probs, &dctx, &mut dqkv);
        }
        close("dprobs", &dp, &wdp, 1e-5);
        for g in &cm::attention_scores_backward(&d, scale) {
            run(g, &dp, &qkv, &mut dqkv);
        }
        // Together the three stages overwrite every element of dqkv (it started as NaN).
        close("dqkv", &dqkv, &wdqkv, 1e-5);
    }
}

#[test]
fn tensor_core_notes() {
    let d = k::dense::DenseDims {
        batch: 128,
        in_features: 784,
        out_features: 512,
    };
    assert!(cm::tensor_core_friendly(&cm::to_cublas(
        &cm::dense_forward(d)
    )));
    let d = k::dense::DenseDims {
        batch: 128,
        in_features: 512,
        out_features: 10,
    };
    assert!(!cm::tensor_core_friendly(&cm::to_cublas(
        &cm::dense_forward(d)
    )));
}
