//! Batch norm's training forward and backward on the convnet example's shapes (NHWC rows ×
//! channels, f32), median milliseconds of 30 runs after a warm-up. Run with
//! `cargo run --release -p memwise-kernels --example norm_bench`.
use memwise_kernels::norm::{
    batch_norm_backward, batch_norm_train_forward, Affine, AffineGrads, BatchNormConfig,
    BatchNormSaved, NormDims, RunningStats,
};
use std::time::Instant;

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

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                / (1u32 << 24) as f32
                - 0.5
        })
        .collect()
}

fn main() {
    let (mut fwd_all, mut bwd_all) = (0.0, 0.0);
    for (hw, c) in [(24, 32), (24, 32), (12, 32), (12, 64), (6, 64), (6, 128)] {
        let d = NormDims {
            rows: 64 * hw * hw,
            channels: c,
        };
        let (x, gamma, beta) = (values(d.rows * c, 1), values(c, 2), values(c, 3));
        let (mut y, mut x_hat) = (vec![0f32; d.rows * c], vec![0f32; d.rows * c]);
        let (mut mean, mut inv_std, mut rm, mut rv) = (
            vec![0f32; 2 * c],
            vec![0f32; c],
            vec![0f32; c],
            vec![1f32; c],
        );
        let forward = median_ms(|| {
            batch_norm_train_forward(
                d,
                BatchNormConfig::KERAS,
                &x,
                Affine {
                    gamma: &gamma,
                    beta: &beta,
                },
                &mut y,
                BatchNormSaved {
                    x_hat: &mut x_hat,
                    mean: &mut mean,
                    inv_std: &mut inv_std,
                },
                Some(RunningStats {
                    mean: &mut rm,
                    var: &mut rv,
                }),
            )
            .unwrap()
        });
        let dy = values(d.rows * c, 4);
        let (mut dx, mut dgamma, mut dbeta) =
            (vec![0f32; d.rows * c], vec![0f32; c], vec![0f32; c]);
        let backward = median_ms(|| {
            let grads = AffineGrads {
                dgamma: &mut dgamma,
                dbeta: &mut dbeta,
            };
            batch_norm_backward(d, &x_hat, &inv_std, &gamma, &dy, &mut dx, grads).unwrap()
        });
        println!(
            "batch norm [{} rows, {c}]: forward {forward:.3} ms, backward {backward:.3} ms",
            d.rows
        );
        fwd_all += forward;
        bwd_all += backward;
    }
    println!("the convnet's six: forward {fwd_all:.2} ms, backward {bwd_all:.2} ms");
}
