//! The memory-efficient attention (`flash_attention`) against the materialising one
//! (`attention`: scores, softmax, dropout, context; its backward is checked against finite
//! differences in `gemm_ops_attention.rs`): the same outputs and gradients to 1e-5 relative in
//! f32 on random shapes, with and without the causal mask and dropout; the log-sum-exp against
//! an f64 reference; half storage within rounding of f32; bad arguments refused.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::activation::{softmax_backward_inplace, softmax_inplace};
use memwise_kernels::attention::*;
use memwise_kernels::flash_attention::*;
use memwise_kernels::random::{dropout_backward_inplace, dropout_forward, RngKey};
use memwise_kernels::Element;

const KEY: RngKey = RngKey {
    seed: 7,
    layer: 3,
    step: 11,
    first_block: 0,
};

struct Outputs {
    ctx: Vec<f32>,
    dqkv: Vec<f32>,
}

/// The materialising attention's forward and backward, in f32.
fn materialised(d: AttentionDims, qkv: &[f32], dctx: &[f32], causal: bool, rate: f32) -> Outputs {
    let scale = 1.0 / (d.head_dim() as f32).sqrt();
    let rows = d.batch * d.heads * d.seq;
    let mut probs = vec![0f32; d.scores_len()];
    scores_forward::<f32>(d, qkv, &mut probs, scale, causal, &mut []).unwrap();
    softmax_inplace::<f32>(&mut probs, rows, d.seq).unwrap();
    let (mut dropped, mut mask) = (vec![0f32; probs.len()], vec![0u8; probs.len()]);
    let used = if rate > 0.0 {
        dropout_forward::<f32>(KEY, rate, &probs, &mut dropped, &mut mask).unwrap();
        &dropped
    } else {
        &probs
    };
    let mut ctx = vec![0f32; d.ctx_len()];
    context_forward::<f32>(d, used, qkv, &mut ctx, &mut []).unwrap();
    let (mut dp, mut dqkv) = (vec![0f32; d.scores_len()], vec![f32::NAN; d.qkv_len()]);
    context_backward::<f32>(d, dctx, used, qkv, &mut dp, &mut dqkv, &mut []).unwrap();
    if rate > 0.0 {
        dropout_backward_inplace::<f32>(rate, &mask, &mut dp).unwrap();
    }
    softmax_backward_inplace::<f32, f32>(&probs, &mut dp, rows, d.seq).unwrap();
    scores_backward::<f32>(d, &dp, qkv, &mut dqkv, scale, &mut []).unwrap();
    Outputs { ctx, dqkv }
}

/// The flash kernels in storage `T`, results back in f32, with the log-sum-exp.
fn flash<T: Element>(
    d: AttentionDims,
    qkv: &[f32],
    dctx: &[f32],
    causal: bool,
    rate: f32,
    ws_len: usize,
) -> (Outputs, Vec<f32>) {
    let scale = 1.0 / (d.head_dim() as f32).sqrt();
    let dropout = (rate > 0.0).then_some(FlashDropout { key: KEY, rate });
    let (qkv, dctx) = (to_t::<T>(qkv), to_t::<T>(dctx));
    let mut ws = vec![f32::NAN; ws_len];
    let mut ctx = vec![T::from_f32(f32::NAN); d.ctx_len()];
    let mut lse = vec![f32::NAN; d.batch * d.heads * d.seq];
    flash_attention_forward::<T>(d, &qkv, &mut ctx, &mut lse, scale, causal, dropout, &mut ws)
        .unwrap();
    let mut dqkv = vec![T::from_f32(f32::NAN); d.qkv_len()];
    ws.fill(f32::NAN);
    flash_attention_backward::<T>(
        d, &qkv, &ctx, &lse, &dctx, &mut dqkv, scale, causal, dropout, &mut ws,
    )
    .unwrap();
    let out = Outputs {
        ctx: to_f32(&ctx),
        dqkv: to_f32(&dqkv),
    };
    (out, lse)
}

/// Max |a − b| over max |b|.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let diff = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        assert!(x.is_finite(), "a non-finite result: {x}");
        m.max((x as f64 - y as f64).abs())
    });
    diff / scale.max(1e-30)
}

fn dims(batch: usize, seq: usize, heads: usize, head_dim: usize) -> AttentionDims {
    AttentionDims {
        batch,
        seq,
        hidden: heads * head_dim,
        heads,
    }
}

#[test]
fn flash_matches_the_materialising_attention_on_random_shapes() {
    let mut rng = Rng::new(2024);
    // Sequences below, at and across the 64-row tile; head sizes with and without a tail.
    let shapes = [
        (1, 1, 1, 4),
        (2, 7, 3, 8),
        (1, 64, 2, 16),
        (2, 65, 1, 12),
        (1, 130, 2, 64),
        (3, 33, 4, 5),
        // Several key tiles, the last one partial.
        (1, 600, 1, 8),
    ];
    for &(b, s, heads, hd) in &shapes {
        let d = dims(b, s, heads, hd);
        let qkv: Vec<f32> = rng.vec(d.qkv_len()).iter().map(|x| 2.0 * x).collect();
        let dctx = rng.vec(d.ctx_len());
        for causal in [false, true] {
            for rate in [0.0, 0.25] {
                let want = materialised(d, &qkv, &dctx, causal, rate);
                // One lane, and all of them: the result must not depend on the lanes.
                for lanes in [1, FLASH_LANES] {
                    let lane = forward_lane_len(s, hd).max(backward_lane_len(s, hd));
                    let ws = b * heads * s + lanes * lane;
                    let (got, _) = flash::<f32>(d, &qkv, &dctx, causal, rate, ws);
                    let what = format!("b{b} s{s} h{heads} d{hd} causal {causal} rate {rate}");
                    let (ec, eg) = (rel(&got.ctx, &want.ctx), rel(&got.dqkv, &want.dqkv));
                    assert!(ec <= 1e-5, "{what}: ctx differs by {ec:e}");
                    assert!(eg <= 1e-5, "{what}: dqkv differs by {eg:e}");
                }
            }
        }
    }
}

#[test]
fn the_log_sum_exp_matches_an_f64_reference() {
    let mut rng = Rng::new(5);
    let d = dims(2, 70, 2, 8);
    let qkv: Vec<f32> = rng.vec(d.qkv_len()).iter().map(|x| 3.0 * x).collect();
    let dctx = rng.vec(d.ctx_len());
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    let scale = 1.0 / (hd as f64).sqrt();
    for causal in [false, true] {
        let (_, lse) = flash::<f32>(d, &qkv, &dctx, causal, 0.0, flash_scratch_len(d));
        for (pair, row) in lse.chunks(s).enumerate() {
            let (b, head) = (pair / d.heads, pair % d.heads);
            for (i, &got) in row.iter().enumerate() {
                let q = |c: usize| qkv[(b * s + i) * 3 * h + head * hd + c] as f64;
                let k = |j: usize, c: usize| qkv[(b * s + j) * 3 * h + h + head * hd + c] as f64;
                let jn = if causal { i + 1 } else { s };
                let sc: Vec<f64> = (0..jn)
                    .map(|j| scale * (0..hd).map(|c| q(c) * k(j, c)).sum::<f64>())
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let want = m + sc.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{got} {want}"
                );
            }
        }
    }
}

#[test]
fn half_storage_is_within_rounding_of_f32() {
    let mut rng = Rng::new(9);
    let d = dims(2, 40, 2, 16);
    let qkv = rng.vec(d.qkv_len());
    let dctx = rng.vec(d.ctx_len());
    let ws = flash_scratch_len(d);
    for causal in [false, true] {
        let (want, _) = flash::<f32>(
            d,
            &rounded::<f16>(&qkv),
            &rounded::<f16>(&dctx),
            causal,
            0.1,
            ws,
        );
        let (got, _) = flash::<f16>(d, &qkv, &dctx, causal, 0.1, ws);
        assert!(rel(&got.ctx, &want.ctx) < 4e-3 && rel(&got.dqkv, &want.dqkv) < 4e-3);
        let (want, _) = flash::<f32>(
            d,
            &rounded::<bf16>(&qkv),
            &rounded::<bf16>(&dctx),
            causal,
            0.1,
            ws,
        );
        let (got, _) = flash::<bf16>(d, &qkv, &dctx, causal, 0.1, ws);
        assert!(rel(&got.ctx, &want.ctx) < 3e-2 && rel(&got.dqkv, &want.dqkv) < 3e-2);
    }
}

#[test]
fn flash_refuses_bad_arguments_and_writes_nothing() {
    let d = dims(1, 8, 2, 4);
    let qkv = vec![0.5f32; d.qkv_len()];
    let mut ctx = vec![9f32; d.ctx_len()];
    let mut lse = vec![9f32; 16];
    let mut ws = vec![0f32; flash_scratch_len(d)];
    let mut run = |d: AttentionDims, lse: &mut [f32], ws: &mut [f32], rate: f32| {
        let dropout = (rate != 0.0).then_some(FlashDropout { key: KEY, rate });
        flash_attention_forward::<f32>(d, &qkv, &mut ctx, lse, 0.5, false, dropout, ws)
            .unwrap_err()
            .0
    };
    let bad_heads = AttentionDims { heads: 3, ..d };
    assert!(run(bad_heads, &mut lse.clone(), &mut ws.clone(), 0.0).contains("multiple of heads"));
    assert!(run(d, &mut lse[..15], &mut ws.clone(), 0.0).contains("lse"));
    assert!(run(d, &mut lse.clone(), &mut ws[..16], 0.0).contains("scratch"));
    assert!(run(d, &mut lse.clone(), &mut ws.clone(), 1.0).contains("dropout rate"));
    assert!(
        ctx.iter().all(|&x| x == 9.0),
        "a refused call wrote its output"
    );
}

#[test]
fn the_planned_scratch_holds_dr_and_the_lanes() {
    // 6 pairs, 2 query tiles each: 8 forward lanes (12 units), 6 backward lanes (6 pairs).
    let d = dims(2, 100, 3, 16);
    let (fwd, bwd) = (forward_lane_len(100, 16), backward_lane_len(100, 16));
    let (tq, tk) = tiles(100);
    assert_eq!((tq, tk), (FLASH_TILE_Q.min(100), FLASH_TILE_K.min(100)));
    assert_eq!(fwd, 2 * tq * 16 + 2 * tk * 16 + tq * tk + 2 * tq + tk);
    assert_eq!(bwd, 100 * 16 + 4 * tk * 16 + 2 * tq * 16 + 2 * tq * tk + tk);
    assert_eq!(
        flash_scratch_len(d),
        2 * 3 * 100 + (FLASH_LANES * fwd).max(6 * bwd)
    );
    assert_eq!(tiles(1024), (FLASH_TILE_Q, FLASH_TILE_K));
    // A sequence shorter than a tile: tiles of the sequence's length, one lane per unit.
    let small = dims(1, 10, 1, 16);
    let (fwd, bwd) = (forward_lane_len(10, 16), backward_lane_len(10, 16));
    assert_eq!(fwd, 4 * 10 * 16 + 100 + 30);
    assert_eq!(flash_scratch_len(small), 10 + fwd.max(bwd));
}
