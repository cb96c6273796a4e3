//! Allocation audit of the GEMM-based kernels. This crate's code allocates nothing per call;
//! the `gemm` crate, however, heap-allocates inside every call (its packing buffers plus a few
//! small bookkeeping blocks, all freed before it returns — a handful per call in gemm 0.19,
//! measured below: at most 3 on the development machine, 5 on the CI machine, as the count
//! depends on the CPU's features and thread count). So: kernels with no GEMM must allocate nothing, and a GEMM-based
//! kernel no more than the `gemm` crate's own per-call count times the calls it makes.
//!
//! A counting global allocator watches every thread while `WATCH` is set; this file holds a
//! single test so nothing else runs in the process meanwhile. Every kernel runs once before
//! counting so that rayon's pool and the `gemm` crate's per-thread slabs already exist.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::bf16;
use memwise_kernels::attention::*;
use memwise_kernels::conv::*;
use memwise_kernels::dense::*;
use memwise_kernels::embedding::*;
use memwise_kernels::gemm::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

struct Counting;
static WATCH: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCH.load(SeqCst) {
            COUNT.fetch_add(1, SeqCst);
            LARGEST.fetch_max(layout.size(), SeqCst);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// (allocations, largest allocation in bytes) made by `f` on any thread, after a warm-up call.
fn allocations(mut f: impl FnMut()) -> (usize, usize) {
    f();
    COUNT.store(0, SeqCst);
    LARGEST.store(0, SeqCst);
    WATCH.store(true, SeqCst);
    f();
    WATCH.store(false, SeqCst);
    (COUNT.load(SeqCst), LARGEST.load(SeqCst))
}

/// The most allocations one raw `gemm::gemm` call makes over a spread of shapes, threaded or not.
fn raw_gemm_allocations_per_call() -> usize {
    let mut most = 0;
    for (m, n, k) in [
        (7, 5, 3),
        (9, 9, 4),
        (64, 100, 200),
        (200, 100, 64),
        (300, 200, 400),
        (1, 50, 60),
    ] {
        let (a, b, mut c) = (vec![1f32; m * k], vec![1f32; k * n], vec![0f32; m * n]);
        for par in [gemm::Parallelism::None, gemm::Parallelism::Rayon(0)] {
            for (a_rs, a_cs) in [(k as isize, 1), (1, m as isize)] {
                // SAFETY: the strides describe [m, k] / [k, m] buffers of m·k elements.
                let (count, _) = allocations(|| unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        a_cs,
                        a_rs,
                        b.as_ptr(),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    )
                });
                most = most.max(count);
            }
        }
    }
    most
}

#[test]
fn gemm_kernels_allocate_only_inside_the_gemm_crate() {
    let mut rng = Rng::new(71);
    let per_call = raw_gemm_allocations_per_call();
    eprintln!("raw gemm::gemm: at most {per_call} allocations per call");
    // A handful, whatever the shape: a count that grew with the sizes would be a leak or a
    // per-element allocation, which the workspace accounting does not cover.
    assert!(
        per_call <= 8,
        "gemm crate now allocates {per_call} times per call: more than the handful documented"
    );
    let report = |what: &str, (n, b): (usize, usize), gemm_calls: usize| {
        eprintln!("{what:<40} {n:>3} allocations, largest {b:>8} bytes ({gemm_calls} gemm calls)");
        assert!(
            n <= per_call * gemm_calls,
            "{what}: {n} allocations for {gemm_calls} gemm calls"
        );
    };

    // No GEMM at all: nothing may allocate.
    let d = DepthwiseConv2dDims {
        n: 4,
        h: 13,
        w: 11,
        c: 8,
        multiplier: 2,
        kh: 3,
        kw: 3,
        sh: 2,
        sw: 2,
        padding: Padding::Same,
    };
    let (x, w, dy) = (rng.vec(d.x_len()), rng.vec(d.w_len()), rng.vec(d.y_len()));
    let (mut y, mut dx, mut dw, mut db) = (
        vec![0f32; d.y_len()],
        vec![0f32; d.x_len()],
        vec![0f32; d.w_len()],
        vec![0f32; d.c_out()],
    );
    report(
        "depthwise fwd + bwd",
        allocations(|| {
            depthwise_conv2d_forward(d, &x, &w, None, &mut y).unwrap();
            depthwise_conv2d_backward(d, &x, &w, &dy, Some(&mut dx), &mut dw, Some(&mut db))
                .unwrap();
        }),
        0,
    );
    let e = EmbeddingDims {
        tokens: 300,
        vocab: 50,
        dim: 70,
    };
    let ids: Vec<i32> = (0..300).map(|i| i * 7 % 50).collect();
    let (tab, g) = (rng.vec(50 * 70), rng.vec(300 * 70));
    let (mut out, mut dtab) = (vec![bf16::ZERO; 300 * 70], vec![0f32; 50 * 70]);
    report(
        "embedding fwd + bwd",
        allocations(|| {
            embedding_forward(e, &ids, &tab, &mut out).unwrap();
            embedding_backward(e, &ids, &g, &mut dtab).unwrap();
        }),
        0,
    );

    // Dense: three GEMMs (y, dx, dw); bf16 runs blocks, here one block per GEMM.
    let dd = DenseDims {
        batch: 64,
        in_features: 200,
        out_features: 100,
    };
    let (x, w, gy) = (
        rng.vec(dd.x_len()),
        rng.vec(dd.w_len()),
        rng.vec(dd.y_len()),
    );
    let (mut y, mut dx, mut dw, mut db) = (
        vec![0f32; dd.y_len()],
        vec![0f32; dd.x_len()],
        vec![0f32; dd.w_len()],
        vec![0f32; 100],
    );
    report(
        "dense f32 fwd + bwd",
        allocations(|| {
            dense_forward(dd, &x, &w, None, &mut y, &mut []).unwrap();
            dense_backward(
                dd,
                &x,
                &w,
                &gy,
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &mut [],
            )
            .unwrap();
        }),
        3,
    );
    let (xh, wh, gh) = (to_t::<bf16>(&x), to_t::<bf16>(&w), to_t::<bf16>(&gy));
    let (mut yh, mut dxh) = (vec![bf16::ZERO; dd.y_len()], vec![bf16::ZERO; dd.x_len()]);
    let mut ws = vec![0f32; dense_ws_len::<bf16>(dd)];
    report(
        "dense bf16 fwd + bwd",
        allocations(|| {
            dense_forward(dd, &xh, &wh, None, &mut yh, &mut ws).unwrap();
            dense_backward(
                dd,
                &xh,
                &wh,
                &gh,
                Some(&mut dxh),
                &mut dw,
                Some(&mut db),
                &mut ws,
            )
            .unwrap();
        }),
        3,
    );

    // Conv2d, 3 chunks: per chunk one GEMM forward, two backward.
    let c = Conv2dDims {
        n: 5,
        h: 12,
        w: 10,
        c_in: 6,
        c_out: 16,
        kh: 3,
        kw: 3,
        sh: 1,
        sw: 1,
        padding: Padding::Same,
    };
    let (x, w, gy) = (rng.vec(c.x_len()), rng.vec(c.w_len()), rng.vec(c.y_len()));
    let (mut y, mut dx, mut dw) = (
        vec![0f32; c.y_len()],
        vec![0f32; c.x_len()],
        vec![0f32; c.w_len()],
    );
    let mut col = vec![0f32; conv2d_col_len(c, 2)];
    report(
        "conv2d f32 fwd + bwd, 3 chunks",
        allocations(|| {
            conv2d_forward(c, &x, &w, None, &mut y, &mut col, 2, &mut []).unwrap();
            conv2d_backward(
                c,
                &x,
                &w,
                &gy,
                Some(&mut dx),
                &mut dw,
                None,
                &mut col,
                2,
                &mut [],
            )
            .unwrap();
        }),
        9,
    );
    let t = ConvTranspose2dDims {
        n: 5,
        h: 6,
        w: 5,
        c_in: 6,
        c_out: 16,
        kh: 3,
        kw: 3,
        sh: 2,
        sw: 2,
        padding: Padding::Same,
    };
    let (x, w, gy) = (rng.vec(t.x_len()), rng.vec(t.w_len()), rng.vec(t.y_len()));
    let (mut y, mut dx, mut dw) = (
        vec![0f32; t.y_len()],
        vec![0f32; t.x_len()],
        vec![0f32; t.w_len()],
    );
    let mut col = vec![0f32; conv2d_transpose_col_len(t, 2)];
    report(
        "conv2d_transpose f32 fwd + bwd, 3 chunks",
        allocations(|| {
            conv2d_transpose_forward(t, &x, &w, None, &mut y, &mut col, 2, &mut []).unwrap();
            conv2d_transpose_backward(
                t,
                &x,
                &w,
                &gy,
                Some(&mut dx),
                &mut dw,
                None,
                &mut col,
                2,
                &mut [],
            )
            .unwrap();
        }),
        9,
    );

    // Attention: per (batch, head) pair, 2 GEMMs in each of the four kernels.
    let a = AttentionDims {
        batch: 2,
        seq: 9,
        hidden: 12,
        heads: 3,
    };
    let qkv = rng.vec(a.qkv_len());
    let (mut sc, mut ctx, mut dq, mut dp) = (
        vec![0f32; a.scores_len()],
        vec![0f32; a.ctx_len()],
        vec![0f32; a.qkv_len()],
        vec![0f32; a.scores_len()],
    );
    let probs = rng.vec(a.scores_len());
    report(
        "attention 4 kernels",
        allocations(|| {
            scores_forward(a, &qkv, &mut sc, 0.5, true, &mut []).unwrap();
            context_forward(a, &probs, &qkv, &mut ctx, &mut []).unwrap();
            scores_backward(a, &probs, &qkv, &mut dq, 0.5, &mut []).unwrap();
            context_backward(a, &ctx, &probs, &qkv, &mut dp, &mut dq, &mut []).unwrap();
        }),
        6 * 6,
    );

    // One big f32 product: the gemm crate's packing buffer, for the record.
    let (m, n, k) = (300, 200, 400);
    let (ma, mb) = (rng.vec(m * k), rng.vec(k * n));
    let mut mc = vec![0f32; m * n];
    report(
        "matmul f32 300×200×400",
        allocations(|| {
            matmul(m, n, k, &ma, false, &mb, false, &mut mc, 1.0, 0.0, &mut []).unwrap()
        }),
        1,
    );
}
