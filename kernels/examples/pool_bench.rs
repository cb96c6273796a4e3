//! Max pooling's forward and backward on the convnet example's shapes (NHWC, 3×3 windows,
//! stride 2, `same` padding), median milliseconds of 50 runs after a warm-up. Run with
//! `cargo run --release -p memwise-kernels --example pool_bench`.
use memwise_kernels::pool::{max_pool2d_backward, max_pool2d_forward, Padding, Pool2d};
use std::time::Instant;

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..50)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

fn main() {
    for (n, hw, c) in [(64, 24, 32), (64, 12, 64)] {
        let d = Pool2d::new(n, hw, hw, c, (3, 3), (2, 2), Padding::Same).expect("a valid pool");
        // Values in no pattern (a multiplicative hash of the index would rise along a row and
        // make the max's branches predictable, which a model's activations are not).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let x: Vec<f32> = (0..d.in_len())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        let (mut y, mut argmax) = (vec![0f32; d.out_len()], vec![0u8; d.out_len()]);
        let forward = median_ms(|| max_pool2d_forward(&d, &x, &mut y, &mut argmax).unwrap());
        let dy = y.clone();
        let mut dx = vec![0f32; d.in_len()];
        let backward = median_ms(|| max_pool2d_backward(&d, &argmax, &dy, &mut dx).unwrap());
        println!("max pool [{n}, {hw}, {hw}, {c}] 3x3/2 same, f32: forward {forward:.3} ms, backward {backward:.3} ms");
    }
}
