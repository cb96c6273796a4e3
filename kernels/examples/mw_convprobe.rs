//! TEMPORARY probe (bench work): the VAE's convolutions at batch 128, timed one by one.
use memwise_kernels::conv::*;
use std::time::Instant;

fn med(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
fn rnd(n: usize, s: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(s)) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect()
}
const CAP: usize = 8 << 20;

fn main() {
    let n: usize = std::env::args().nth(1).map_or(128, |s| s.parse().unwrap());
    let reps: usize = std::env::args().nth(2).map_or(10, |s| s.parse().unwrap());
    let convs = [
        ("enc_conv1", 28, 1, 32, 2, false),
        ("enc_conv2", 14, 32, 64, 2, true),
    ];
    let mut total = (0.0, 0.0);
    for (name, h, ci, co, s, need_dx) in convs {
        let d = Conv2dDims {
            n,
            h,
            w: h,
            c_in: ci,
            c_out: co,
            kh: 3,
            kw: 3,
            sh: s,
            sw: s,
            padding: Padding::Same,
        };
        let chunk = (CAP / (d.out_h() * d.out_w() * 9 * ci * 4)).clamp(1, n);
        let (x, w) = (rnd(d.x_len(), 1), rnd(d.w_len(), 2));
        let mut y = vec![0f32; d.y_len()];
        let mut col = vec![0f32; conv2d_col_len(d, chunk)];
        let b = vec![0.1f32; co];
        let (mut tf, mut tb) = (vec![], vec![]);
        let mut dx = vec![0f32; d.x_len()];
        let mut dw = vec![0f32; d.w_len()];
        let mut db = vec![0f32; co];
        for _ in 0..reps {
            let t = Instant::now();
            conv2d_forward(d, &x, &w, Some(&b), &mut y, &mut col, chunk, &mut []).unwrap();
            tf.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            conv2d_backward(
                d,
                &x,
                &w,
                &y,
                if need_dx { Some(&mut dx) } else { None },
                &mut dw,
                Some(&mut db),
                &mut col,
                chunk,
                &mut [],
            )
            .unwrap();
            tb.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let (f, bk) = (med(tf), med(tb));
        total.0 += f;
        total.1 += bk;
        println!("{name:12} conv2d   chunk {chunk:4}  fwd {f:7.2} ms  bwd {bk:7.2} ms");
    }
    let convts = [
        ("dec_deconv1", 7, 64, 64, 2),
        ("dec_deconv2", 14, 64, 32, 2),
        ("decoded", 28, 32, 1, 1),
    ];
    for (name, h, ci, co, s) in convts {
        let d = ConvTranspose2dDims {
            n,
            h,
            w: h,
            c_in: ci,
            c_out: co,
            kh: 3,
            kw: 3,
            sh: s,
            sw: s,
            padding: Padding::Same,
        };
        let chunk = (CAP / (h * h * 9 * co * 4)).clamp(1, n);
        let (x, w) = (rnd(d.x_len(), 1), rnd(d.w_len(), 2));
        let mut y = vec![0f32; d.y_len()];
        let mut col = vec![0f32; conv2d_transpose_col_len(d, chunk)];
        let b = vec![0.1f32; co];
        let (mut tf, mut tb) = (vec![], vec![]);
        let mut dx = vec![0f32; d.x_len()];
        let mut dw = vec![0f32; d.w_len()];
        let mut db = vec![0f32; co];
        for _ in 0..reps {
            let t = Instant::now();
            conv2d_transpose_forward(d, &x, &w, Some(&b), &mut y, &mut col, chunk, &mut [])
                .unwrap();
            tf.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            conv2d_transpose_backward(
                d,
                &x,
                &w,
                &y,
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &mut col,
                chunk,
                &mut [],
            )
            .unwrap();
            tb.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let (f, bk) = (med(tf), med(tb));
        total.0 += f;
        total.1 += bk;
        println!("{name:12} conv2d_T chunk {chunk:4}  fwd {f:7.2} ms  bwd {bk:7.2} ms");
    }
    println!(
        "total fwd {:.2} ms bwd {:.2} ms; checksum {}",
        total.0, total.1, 0
    );
}
