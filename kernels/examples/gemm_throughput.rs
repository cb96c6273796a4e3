//! GFLOP/s of memwise-kernels' `matmul` and conv2d next to a raw `gemm` crate call of the same
//! shape. Run with `cargo run --release -p memwise-kernels --example gemm_throughput`.
use half::{bf16, f16};
use memwise_kernels::conv::{
    conv2d_backward, conv2d_col_len, conv2d_forward, conv2d_ws_len, Conv2dDims, Padding,
};
use memwise_kernels::gemm::{matmul, matmul_mixed, matmul_mixed_ws_len, matmul_ws_len};
use memwise_kernels::Element;
use std::time::Instant;

/// Median seconds of `reps` runs after one warm-up run.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[reps / 2]
}

fn data<T: Element>(n: usize, seed: u32) -> Vec<T> {
    (0..n)
        .map(|i| {
            T::from_f32(
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32
                    - 0.5,
            )
        })
        .collect()
}

/// Raw `gemm` crate call: row-major c[m×n] = op(a)·op(b) (note the crate's alpha/beta order).
#[allow(clippy::too_many_arguments)]
fn raw<T: 'static + Copy>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    at: bool,
    b: &[T],
    bt: bool,
    c: &mut [T],
    zero: T,
    one: T,
) {
    let (a_rs, a_cs) = if at { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if bt { (1, k as isize) } else { (n as isize, 1) };
    unsafe {
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
            b_cs,
            b_rs,
            zero,
            one,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

fn row(name: &str, flops: f64, ours: f64, raw: Option<f64>) {
    let g = |t: f64| flops / t / 1e9;
    match raw {
        Some(r) => println!(
            "{name:<46} {:>8.1} GFLOP/s  ({:>7.2} ms)   raw gemm {:>8.1} GFLOP/s",
            g(ours),
            ours * 1e3,
            g(r)
        ),
        None => println!(
            "{name:<46} {:>8.1} GFLOP/s  ({:>7.2} ms)",
            g(ours),
            ours * 1e3
        ),
    }
}

/// Median seconds of `f` and of `g`, run alternately so both see the same machine load (the
/// machine is shared).
fn time_pair(reps: usize, mut f: impl FnMut(), mut g: impl FnMut()) -> (f64, f64) {
    f();
    g();
    let (mut tf, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let s = Instant::now();
        f();
        tf.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        g();
        tg.push(s.elapsed().as_secs_f64());
    }
    tf.sort_by(|a, b| a.partial_cmp(b).unwrap());
    tg.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (tf[reps / 2], tg[reps / 2])
}

fn bench_matmul(name: &str, (m, n, k): (usize, usize, usize), at: bool, bt: bool, reps: usize) {
    let (a, b) = (data::<f32>(m * k, 1), data::<f32>(k * n, 2));
    let (mut c, mut c2) = (vec![0f32; m * n], vec![0f32; m * n]);
    let (ours, r) = time_pair(
        reps,
        || matmul(m, n, k, &a, at, &b, bt, &mut c, 1.0, 0.0, &mut []).unwrap(),
        || raw(m, n, k, &a, at, &b, bt, &mut c2, 0.0, 1.0),
    );
    row(name, 2.0 * (m * n * k) as f64, ours, Some(r));
}

fn bench_half<T: Element>(s: usize, reps: usize) -> f64 {
    let (a, b) = (data::<T>(s * s, 1), data::<T>(s * s, 2));
    let mut c = vec![T::from_f32(0.0); s * s];
    let mut ws = vec![0f32; matmul_ws_len::<T>(s, s, s)];
    time(reps, || {
        matmul(s, s, s, &a, false, &b, false, &mut c, 1.0, 0.0, &mut ws).unwrap()
    })
}

fn main() {
    println!("threads: {}", rayon::current_num_threads());
    square_matmuls(1024);
    dense_layer();
    gpt_dense_layers();
    conv_layer();
}

/// The GPT example's dense layers at its 2048 tokens (batch 32 × 64): the attention's `qkv`
/// (128 → 384) and `out` (128 → 128) projections, the MLP's `fc` (128 → 512) and `proj`
/// (512 → 128) and the logits (128 → 256), each GEMM of a step.
fn gpt_dense_layers() {
    let tokens = 2048;
    let layers = [
        ("qkv", 128, 384),
        ("out", 128, 128),
        ("fc", 128, 512),
        ("proj", 512, 128),
        ("logits", 128, 256),
    ];
    for (name, i, o) in layers {
        let shape = format!("{tokens}×{i}→{o}");
        bench_matmul(
            &format!("gpt {name:<6} fwd  y = x·W    {shape}"),
            (tokens, o, i),
            false,
            false,
            21,
        );
        bench_matmul(
            &format!("gpt {name:<6} bwd  dx = dy·Wᵀ {shape}"),
            (tokens, i, o),
            false,
            true,
            21,
        );
        bench_matmul(
            &format!("gpt {name:<6} bwd  dW = xᵀ·dy {shape}"),
            (i, o, tokens),
            true,
            false,
            21,
        );
    }
}

/// Square GEMMs of side `s` in every storage type.
fn square_matmuls(s: usize) {
    bench_matmul("matmul f32 1024³", (s, s, s), false, false, 7);
    let f = 2.0 * (s * s * s) as f64;
    let (a, b) = (data::<f16>(s * s, 1), data::<f16>(s * s, 2));
    let (mut c, mut c2) = (vec![f16::ZERO; s * s], vec![f16::ZERO; s * s]);
    let mut ws = vec![0f32; matmul_ws_len::<f16>(s, s, s)];
    let (t16, r16) = time_pair(
        5,
        || matmul(s, s, s, &a, false, &b, false, &mut c, 1.0, 0.0, &mut ws).unwrap(),
        || raw(s, s, s, &a, false, &b, false, &mut c2, f16::ZERO, f16::ONE),
    );
    row(
        "matmul f16 storage 1024³ (f32 accumulate)",
        f,
        t16,
        Some(r16),
    );
    row(
        "matmul bf16 storage 1024³ (f32 accumulate)",
        f,
        bench_half::<bf16>(s, 5),
        None,
    );
}

/// The MNIST MLP's hidden layer: x[128, 784] · W[784, 512], forward and both backward GEMMs.
fn dense_layer() {
    let (bs, i, o) = (128, 784, 512);
    bench_matmul(
        "dense fwd  y = x·W       128×784 · 784×512",
        (bs, o, i),
        false,
        false,
        21,
    );
    bench_matmul(
        "dense bwd  dx = dy·Wᵀ    128×512 · 512×784",
        (bs, i, o),
        false,
        true,
        21,
    );
    bench_matmul(
        "dense bwd  dW = xᵀ·dy    784×128 · 128×512",
        (i, o, bs),
        true,
        false,
        21,
    );
    {
        let (x, dy) = (data::<bf16>(bs * i, 1), data::<bf16>(bs * o, 2));
        let mut dw = vec![0f32; i * o];
        let mut ws = vec![0f32; matmul_mixed_ws_len::<bf16, bf16, f32>(i, o, bs)];
        let t = time(21, || {
            matmul_mixed(i, o, bs, &x, true, &dy, false, &mut dw, 1.0, 1.0, &mut ws).unwrap()
        });
        row(
            "dense bwd  dW(f32) += xᵀ·dy (bf16 storage)",
            2.0 * (i * o * bs) as f64,
            t,
            None,
        );
    }
}

/// A ResNet stage-1 convolution: n=32, 56×56×64 → 64, 3×3 same, at several chunk sizes,
/// against the bare GEMM it lowers to.
fn conv_layer() {
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
    let (p, kd) = (56 * 56, 9 * 64);
    let flops = 2.0 * (d.n * p * kd * d.c_out) as f64;
    let (x, w, dy) = (
        data::<f32>(d.x_len(), 1),
        data::<f32>(d.w_len(), 2),
        data::<f32>(d.y_len(), 3),
    );
    let mut y = vec![0f32; d.y_len()];
    for chunk in [32, 8, 1] {
        let mut col = vec![0f32; conv2d_col_len(d, chunk)];
        let t = time(3, || {
            conv2d_forward(d, &x, &w, None, &mut y, &mut col, chunk, &mut []).unwrap()
        });
        row(
            &format!(
                "conv2d fwd 32×56×56×64→64 3×3, chunk {chunk:>2} ({:>3} MB col)",
                (col.len() * 4) >> 20
            ),
            flops,
            t,
            None,
        );
    }
    {
        let chunk = 8;
        let mut col = vec![0f32; conv2d_col_len(d, chunk)];
        let (mut dx, mut dw) = (vec![0f32; d.x_len()], vec![0f32; d.w_len()]);
        let t = time(3, || {
            conv2d_backward(
                d,
                &x,
                &w,
                &dy,
                Some(&mut dx),
                &mut dw,
                None,
                &mut col,
                chunk,
                &mut [],
            )
            .unwrap()
        });
        row(
            "conv2d bwd (dW + dx), chunk  8  [2 GEMMs]",
            2.0 * flops,
            t,
            None,
        );
        let mut colh = vec![bf16::ZERO; conv2d_col_len(d, chunk)];
        let mut ws = vec![0f32; conv2d_ws_len::<bf16>(d, chunk)];
        let (xh, wh) = (data::<bf16>(d.x_len(), 1), data::<bf16>(d.w_len(), 2));
        let mut yh = vec![bf16::ZERO; d.y_len()];
        let t = time(3, || {
            conv2d_forward(d, &xh, &wh, None, &mut yh, &mut colh, chunk, &mut ws).unwrap()
        });
        row("conv2d fwd bf16 storage, chunk  8", flops, t, None);
    }
    // The same GEMM as the conv's, raw: col[n·56·56, 576] · W[576, 64].
    let m = d.n * p;
    let col = data::<f32>(m * kd, 4);
    let mut y2 = vec![0f32; d.y_len()];
    let (ours, r) = time_pair(
        3,
        || {
            matmul(
                m,
                d.c_out,
                kd,
                &col,
                false,
                &w,
                false,
                &mut y,
                1.0,
                0.0,
                &mut [],
            )
            .unwrap()
        },
        || raw(m, d.c_out, kd, &col, false, &w, false, &mut y2, 0.0, 1.0),
    );
    row(
        "conv GEMM only: matmul 100352×576 · 576×64",
        flops,
        ours,
        Some(r),
    );
}
