//! The depthwise convolution's forward and backward on the convnet example's shapes (NHWC,
//! 3×3, stride 1, `same`, multiplier 1, f32), median milliseconds of 30 runs after a warm-up.
//! Run with `cargo run --release -p memwise-kernels --example depthwise_bench`.
use memwise_kernels::conv::{
    depthwise_conv2d_backward, depthwise_conv2d_forward, DepthwiseConv2dDims, Padding,
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
        let d = DepthwiseConv2dDims {
            n: 64,
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
        let (x, w) = (values(d.x_len(), 1), values(d.w_len(), 2));
        let mut y = vec![0f32; d.y_len()];
        let forward = median_ms(|| depthwise_conv2d_forward(d, &x, &w, None, &mut y).unwrap());
        let dy = values(d.y_len(), 3);
        let (mut dx, mut dw) = (vec![0f32; d.x_len()], vec![0f32; d.w_len()]);
        let backward = median_ms(|| {
            depthwise_conv2d_backward(d, &x, &w, &dy, Some(&mut dx), &mut dw, None).unwrap()
        });
        let dw_only =
            median_ms(|| depthwise_conv2d_backward(d, &x, &w, &dy, None, &mut dw, None).unwrap());
        println!(
            "depthwise [64, {hw}, {hw}, {c}] 3x3/1 same: forward {forward:.3} ms, backward {backward:.3} ms (dw alone {dw_only:.3})"
        );
        fwd_all += forward;
        bwd_all += backward;
    }
    println!("the convnet's six: forward {fwd_all:.2} ms, backward {bwd_all:.2} ms");
}
