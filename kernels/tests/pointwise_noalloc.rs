//! "Kernels never allocate": every kernel of the non-GEMM modules is called on valid
//! arguments while a counting global allocator watches the calling thread. (Only the calling
//! thread is counted: rayon's workers and the test harness run concurrently; the parallel
//! paths are exercised once before counting so the pool already exists.)
mod pointwise_util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use memwise_kernels::activation::*;
use memwise_kernels::elementwise::*;
use memwise_kernels::loss::*;
use memwise_kernels::norm::*;
use memwise_kernels::optimizer::*;
use memwise_kernels::pool::*;
use memwise_kernels::random::*;

struct Counting;

thread_local! {
    static WATCH: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // try_with: the thread-locals may be gone while a thread shuts down.
        let _ = WATCH.try_with(|w| {
            if w.get() {
                let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            }
        });
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns how many allocations it made on this thread.
fn allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    WATCH.with(|w| w.set(true));
    f();
    WATCH.with(|w| w.set(false));
    COUNT.with(|c| c.get())
}

/// Calls every kernel on `n` elements; returns the allocations made on this thread.
fn all_kernels(n: usize) -> usize {
    let x = vec![0.5f32; n];
    let mut y = vec![0f32; n];
    let mut z = vec![0f32; n];
    let mut m = vec![0u8; n];
    let u8s = vec![7u8; n];
    let key = RngKey {
        seed: 1,
        layer: 2,
        step: 3,
        first_block: 0,
    };
    let (rows, cols) = (n / 4, 4);
    let labels = vec![1i32; rows];
    let d = Pool2d::new(1, n / 8, 2, 4, (2, 2), (2, 2), Padding::Same).unwrap();
    let mut am = vec![0u8; d.out_len()];
    let mut py = vec![0f32; d.out_len()];
    let nd = NormDims {
        rows,
        channels: cols,
    };
    let (g, b) = (vec![1f32; cols], vec![0f32; cols]);
    let (mut c1, mut c2, mut c3, mut c4) = (
        vec![0f32; cols],
        vec![0f32; cols],
        vec![0f32; cols],
        vec![1f32; cols],
    );
    let mut bn_mean = vec![0f32; 2 * cols];
    let mut rstd = vec![0f32; rows];
    let mut st = [vec![0f32; n], vec![0f32; n], vec![0f32; n]];
    let mut p = vec![0.1f32; n];

    allocations(|| {
        cast_u8(&u8s, &mut y, 1.0 / 255.0, 0.0).unwrap();
        cast(&x, &mut y).unwrap();
        cast_backward(&x, &mut y).unwrap();
        add_n(&[&x, &x], &mut y).unwrap();
        add_n_inplace(&mut y, &[&x]).unwrap();
        accumulate(&mut y, &x).unwrap();
        concat_last(&[&x[..rows * 2], &x[..rows * 2]], &[2, 2], rows, &mut y).unwrap();
        concat_last_backward(
            &x,
            &[2, 2],
            rows,
            &mut [&mut y[..rows * 2], &mut z[..rows * 2]],
        )
        .unwrap();
        assert!(all_finite(&x));
        scale_inplace(&mut y, 0.5);
        scale(&x, &mut y, 2.0).unwrap();

        for act in [
            Activation::Relu,
            Activation::Sigmoid,
            Activation::Tanh,
            Activation::Gelu,
            Activation::Silu,
        ] {
            act.forward(&x, &mut y).unwrap();
            act.forward_inplace(&mut y);
            act.backward(&x, &x, &mut y).unwrap();
            act.backward_inplace(&x, &mut y).unwrap();
        }
        softmax_forward(&x, &mut y, rows, cols).unwrap();
        softmax_inplace(&mut y, rows, cols).unwrap();
        softmax_backward(&x, &x, &mut y, rows, cols).unwrap();
        softmax_backward_inplace(&x, &mut y, rows, cols).unwrap();

        max_pool2d_forward(&d, &x, &mut py, &mut am).unwrap();
        max_pool2d_backward(&d, &am, &py, &mut y[..d.in_len()]).unwrap();
        avg_pool2d_forward(&d, &x, &mut py).unwrap();
        avg_pool2d_backward(&d, &py, &mut y[..d.in_len()]).unwrap();
        global_avg_pool_forward(&x, &mut y[..cols], 1, rows, cols).unwrap();
        global_avg_pool_backward(&x[..cols], &mut y, 1, rows, cols).unwrap();

        batch_norm_train_forward(
            nd,
            BatchNormConfig::KERAS,
            &x,
            Affine {
                gamma: &g,
                beta: &b,
            },
            &mut y,
            BatchNormSaved {
                x_hat: &mut z,
                mean: &mut bn_mean,
                inv_std: &mut c2,
            },
            Some(RunningStats {
                mean: &mut c3,
                var: &mut c4,
            }),
        )
        .unwrap();
        batch_norm_infer_forward(
            nd,
            1e-3,
            &x,
            Affine {
                gamma: &g,
                beta: &b,
            },
            &c3,
            &c4,
            &mut y,
        )
        .unwrap();
        batch_norm_backward(
            nd,
            &z,
            &c2,
            &g,
            &x,
            &mut y,
            AffineGrads {
                dgamma: &mut c1,
                dbeta: &mut c3,
            },
        )
        .unwrap();
        layer_norm_forward(
            nd,
            1e-3,
            &x,
            Affine {
                gamma: &g,
                beta: &b,
            },
            &mut y,
            &mut z,
            &mut rstd,
        )
        .unwrap();
        layer_norm_backward(
            nd,
            &z,
            &rstd,
            &g,
            &x,
            &mut y,
            AffineGrads {
                dgamma: &mut c1,
                dbeta: &mut c3,
            },
        )
        .unwrap();

        dropout_forward(key, 0.5, &x, &mut y, &mut m).unwrap();
        dropout_backward(0.5, &m, &x, &mut y).unwrap();
        dropout_forward_inplace(key, 0.5, &mut y, &mut m).unwrap();
        sample_normal_forward(key, &x, &x, &mut y).unwrap();
        sample_normal_backward(key, &x, &x, &mut y, &mut z, GradWrite::Accumulate).unwrap();

        sparse_categorical_crossentropy(&x, &labels, rows, cols, 1.0, &mut y).unwrap();
        binary_crossentropy_with_sigmoid(&x, &x, rows, cols, Reduction::Mean, 1.0, &mut y).unwrap();
        binary_crossentropy(&x, &x, rows, cols, Reduction::Mean, 1.0, &mut y).unwrap();
        mean_squared_error(&x, &x, rows, cols, Reduction::Mean, 1.0, &mut y).unwrap();
        kl_divergence_standard_normal(&x, &x, rows, cols, 1.0, &mut y, &mut z).unwrap();

        let [a, bb, cc] = &mut st;
        RmsProp {
            momentum: 0.9,
            centered: true,
            ..RmsProp::KERAS
        }
        .update(1, &mut p, &x, &mut [a, bb, cc], 1.0)
        .unwrap();
        let [a, bb, _] = &mut st;
        AdamW::KERAS
            .update(1, &mut p, &x, &mut [a, bb], 1.0)
            .unwrap();
        Sgd::default().update(1, &mut p, &x, &mut [], 1.0).unwrap();
    })
}

#[test]
fn kernels_do_not_allocate() {
    // Serial paths (small tensors): not a single allocation.
    for _ in 0..3 {
        let count = all_kernels(64);
        assert_eq!(count, 0, "kernels allocated {count} times on small tensors");
    }
    // Parallel paths: the first call builds rayon's global pool (allocates, once). After that
    // the only allocations on the calling thread are rayon's own: its injector queue grows by
    // one block every ~63 jobs handed to the pool from outside (measured: ~1 per round of the
    // ~40 kernels below, which hand over ~60 jobs). A kernel that allocated per call would add
    // at least ~40 per round; allow 2 per round.
    all_kernels(1 << 16);
    let mut total = 0;
    for _ in 0..10 {
        total += all_kernels(1 << 16);
    }
    assert!(
        total <= 2 * 10,
        "{total} allocations in 10 rounds of parallel kernels"
    );
}
