//! The convnet example's depthwise convolutions, batch norms and max pools (NHWC, f32, its
//! batch of 64) on their own: median milliseconds of 30 runs after a warm-up, per layer and
//! summed, forward and backward. Inputs are values in no pattern (a multiplicative hash of
//! the index would rise along a row and make max pooling's branches predictable, which a
//! model's activations are not). The kernels the `--roofline` split showed far from the
//! machine (docs/BENCHMARKS.md, "Against the machine"). Run with
//! `cargo run --release -p memwise-kernels --example convnet_kernels`.
use memwise_kernels::conv::{
    depthwise_conv2d_backward_ws, depthwise_conv2d_forward, DepthwiseConv2dDims, Padding,
};
use memwise_kernels::norm::{
    batch_norm_backward, batch_norm_train_forward, Affine, AffineGrads, BatchNormConfig,
    BatchNormSaved, NormDims, RunningStats,
};
use memwise_kernels::pool::{max_pool2d_backward, max_pool2d_forward, Pool2d};
use std::time::Instant;

/// The convnet's separable blocks: (height = width, channels) of each depthwise
/// convolution's and batch norm's input, batch 64.
const LAYERS: [Shape; 6] = [(24, 32), (24, 32), (12, 32), (12, 64), (6, 64), (6, 128)];
/// Its max pools' inputs (3×3, stride 2, same).
const POOLS: [Shape; 3] = [(24, 32), (12, 64), (6, 128)];
const BATCH: usize = 64;

/// (height = width, channels).
type Shape = (usize, usize);
/// Times one layer: forward and backward milliseconds.
type Kernel = fn(usize, usize) -> (f64, f64);

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..30)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

/// `n` values in [-0.5, 0.5) from an xorshift stream.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Forward and backward milliseconds of one depthwise 3×3 stride-1 `same` convolution.
fn depthwise(hw: usize, c: usize) -> (f64, f64) {
    let d = DepthwiseConv2dDims {
        n: BATCH,
        h: hw,
        w: hw,
        c,
        multiplier: 1,
        kh: 3,
        kw: 3,
        sh: 1,
        sw: 1,
        padding: Padding::Same,
    };
    let (x, w, dy) = (
        values(d.x_len(), 1),
        values(d.w_len(), 2),
        values(d.y_len(), 3),
    );
    let mut y = vec![0f32; d.y_len()];
    let forward = median_ms(|| depthwise_conv2d_forward(d, &x, &w, None, &mut y).unwrap());
    let (mut dx, mut dw) = (vec![0f32; d.x_len()], vec![0f32; d.w_len()]);
    // The step's scratch, sized as the plan sizes it (the GPU's split partial sums, which the
    // CPU's weight gradient sums its row parts in).
    let positions = BATCH * hw * hw;
    let mut ws = vec![0f32; memwise_plan::column_parts_scratch_f32(positions, c, 9, 1)];
    let backward = median_ms(|| {
        depthwise_conv2d_backward_ws(d, &x, &w, &dy, Some(&mut dx), &mut dw, None, &mut ws).unwrap()
    });
    (forward, backward)
}

/// Forward and backward milliseconds of one training-mode batch norm.
fn batch_norm(hw: usize, c: usize) -> (f64, f64) {
    let d = NormDims {
        rows: BATCH * hw * hw,
        channels: c,
    };
    let (x, dy) = (values(d.len(), 4), values(d.len(), 5));
    let (gamma, beta) = (values(c, 6), values(c, 7));
    let (mut y, mut x_hat, mut dx) = (
        vec![0f32; d.len()],
        vec![0f32; d.len()],
        vec![0f32; d.len()],
    );
    let (mut mean, mut inv_std) = (vec![0f32; 2 * c], vec![0f32; c]);
    let (mut run_mean, mut run_var) = (vec![0f32; c], vec![1f32; c]);
    let forward = median_ms(|| {
        let saved = BatchNormSaved {
            x_hat: &mut x_hat,
            mean: &mut mean,
            inv_std: &mut inv_std,
        };
        let running = RunningStats {
            mean: &mut run_mean,
            var: &mut run_var,
        };
        let affine = Affine {
            gamma: &gamma,
            beta: &beta,
        };
        let cfg = BatchNormConfig::KERAS;
        batch_norm_train_forward(d, cfg, &x, affine, &mut y, saved, Some(running)).unwrap()
    });
    let (mut dgamma, mut dbeta) = (vec![0f32; c], vec![0f32; c]);
    let backward = median_ms(|| {
        let grads = AffineGrads {
            dgamma: &mut dgamma,
            dbeta: &mut dbeta,
        };
        batch_norm_backward(d, &x_hat, &inv_std, &gamma, &dy, &mut dx, grads).unwrap()
    });
    (forward, backward)
}

/// Forward and backward milliseconds of one 3×3 stride-2 `same` max pool.
fn max_pool(hw: usize, c: usize) -> (f64, f64) {
    let d = Pool2d::new(BATCH, hw, hw, c, (3, 3), (2, 2), Padding::Same).expect("a valid pool");
    let x = values(d.in_len(), 8);
    let (mut y, mut argmax) = (vec![0f32; d.out_len()], vec![0u8; d.out_len()]);
    let forward = median_ms(|| max_pool2d_forward(&d, &x, &mut y, &mut argmax).unwrap());
    let (dy, mut dx) = (values(d.out_len(), 9), vec![0f32; d.in_len()]);
    let backward = median_ms(|| max_pool2d_backward(&d, &argmax, &dy, &mut dx).unwrap());
    (forward, backward)
}

fn main() {
    let kernels: [(&str, &[Shape], Kernel); 3] = [
        ("depthwise 3x3/1", &LAYERS, depthwise),
        ("batch norm", &LAYERS, batch_norm),
        ("max pool 3x3/2", &POOLS, max_pool),
    ];
    for (name, shapes, run) in kernels {
        let (mut forward, mut backward) = (0.0, 0.0);
        for &(hw, c) in shapes {
            let (f, b) = run(hw, c);
            println!("{name} [{BATCH}, {hw}, {hw}, {c}]: forward {f:.3} ms, backward {b:.3} ms");
            (forward, backward) = (forward + f, backward + b);
        }
        println!(
            "{name}, the convnet's {}: forward {forward:.2} ms, backward {backward:.2} ms\n",
            shapes.len()
        );
    }
}
