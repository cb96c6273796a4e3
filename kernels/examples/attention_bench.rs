//! One attention step (forward and backward) on the CPU, memory-efficient against
//! materialising, at one shape: the fastest of `--reps` runs of each, in milliseconds, and the
//! bytes each keeps for its backward beside `qkv` (the memory-efficient one: the output and the
//! log-sum-exp; the materialising one: the probabilities). `bench/attention.py` runs this beside PyTorch's
//! `scaled_dot_product_attention` (docs/BENCHMARKS.md, "Attention at sequence 1024").
//!
//! `cargo run --release -p memwise-kernels --example attention_bench -- [batch seq heads head_dim causal reps]`
//! (default `2 1024 12 64 1 5`); prints one JSON object.

use std::time::Instant;

use memwise_kernels::activation::{softmax_backward_inplace, softmax_inplace};
use memwise_kernels::attention::*;
use memwise_kernels::flash_attention::*;

fn arg(args: &[String], i: usize, default: usize) -> usize {
    args.get(i)
        .map(|a| a.parse().expect("arguments are whole numbers"))
        .unwrap_or(default)
}

/// Fastest of `reps` runs of `f`, in ms.
fn fastest(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: first touches, rayon's threads
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (b, s, heads, hd) = (
        arg(&args, 0, 2),
        arg(&args, 1, 1024),
        arg(&args, 2, 12),
        arg(&args, 3, 64),
    );
    let (causal, reps) = (arg(&args, 4, 1) != 0, arg(&args, 5, 5));
    let d = AttentionDims {
        batch: b,
        seq: s,
        hidden: heads * hd,
        heads,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut x = 0x2545_f491u32;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x as f32 / u32::MAX as f32) * 2.0 - 1.0
    };
    let qkv: Vec<f32> = (0..d.qkv_len()).map(|_| rnd()).collect();
    let dctx: Vec<f32> = (0..d.ctx_len()).map(|_| rnd()).collect();
    let (mut ctx, mut dqkv) = (vec![0f32; d.ctx_len()], vec![0f32; d.qkv_len()]);
    let mut lse = vec![0f32; b * heads * s];
    let mut ws = vec![0f32; flash_scratch_len(d)];

    let flash_fwd = fastest(reps, || {
        flash_attention_forward(d, &qkv, &mut ctx, &mut lse, scale, causal, None, &mut ws).unwrap()
    });
    let flash_bwd = fastest(reps, || {
        flash_attention_backward(
            d, &qkv, &ctx, &lse, &dctx, &mut dqkv, scale, causal, None, &mut ws,
        )
        .unwrap()
    });

    let rows = b * heads * s;
    let (mut probs, mut dp) = (vec![0f32; d.scores_len()], vec![0f32; d.scores_len()]);
    let mat_fwd = fastest(reps, || {
        scores_forward(d, &qkv, &mut probs, scale, causal, &mut []).unwrap();
        softmax_inplace(&mut probs, rows, s).unwrap();
        context_forward(d, &probs, &qkv, &mut ctx, &mut []).unwrap();
    });
    let mat_bwd = fastest(reps, || {
        context_backward(d, &dctx, &probs, &qkv, &mut dp, &mut dqkv, &mut []).unwrap();
        softmax_backward_inplace::<f32, f32>(&probs, &mut dp, rows, s).unwrap();
        scores_backward(d, &dp, &qkv, &mut dqkv, scale, &mut []).unwrap();
    });
    println!(
        "{{\"batch\": {b}, \"seq\": {s}, \"heads\": {heads}, \"head_dim\": {hd}, \"causal\": {causal}, \
         \"threads\": {}, \"flash_fwd_ms\": {flash_fwd:.3}, \"flash_bwd_ms\": {flash_bwd:.3}, \
         \"materialised_fwd_ms\": {mat_fwd:.3}, \"materialised_bwd_ms\": {mat_bwd:.3}, \
         \"flash_kept_bytes\": {}, \"materialised_kept_bytes\": {}}}",
        rayon::current_num_threads(),
        4 * (lse.len() + ctx.len()),
        4 * probs.len(),
    );
}
