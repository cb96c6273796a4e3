//! `attention` module: scores and context stages against naive f64 loops (causal mask
//! included), backward against central finite differences, the q/k vs v split of `dqkv`,
//! half storage, workspace lanes, refusal of bad arguments.
mod gemm_ops_common;

use gemm_ops_common::*;
use half::{bf16, f16};
use memwise_kernels::attention::*;
use memwise_kernels::Element;

/// (batch, seq, hidden, heads): prime sequence lengths, one head, head_dim 1..3, seq 1.
const SHAPES: &[(usize, usize, usize, usize)] = &[
    (2, 7, 6, 2),
    (1, 13, 5, 1),
    (3, 5, 12, 4),
    (2, 1, 4, 2),
    (2, 11, 3, 3),
];

fn dims(&(batch, seq, hidden, heads): &(usize, usize, usize, usize)) -> AttentionDims {
    AttentionDims {
        batch,
        seq,
        hidden,
        heads,
    }
}

fn naive_scores(d: AttentionDims, qkv: &[f32], scale: f32, causal: bool) -> Vec<f64> {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    let mut out = vec![0f64; d.scores_len()];
    for b in 0..d.batch {
        for hh in 0..d.heads {
            for i in 0..s {
                for j in 0..s {
                    let mut acc = 0f64;
                    for l in 0..hd {
                        acc += qkv[(b * s + i) * 3 * h + hh * hd + l] as f64
                            * qkv[(b * s + j) * 3 * h + h + hh * hd + l] as f64;
                    }
                    out[((b * d.heads + hh) * s + i) * s + j] = if causal && j > i {
                        CAUSAL_MASK as f64
                    } else {
                        acc * scale as f64
                    };
                }
            }
        }
    }
    out
}

fn naive_context(d: AttentionDims, probs: &[f32], qkv: &[f32]) -> Vec<f64> {
    let (s, h, hd) = (d.seq, d.hidden, d.head_dim());
    let mut out = vec![0f64; d.ctx_len()];
    for b in 0..d.batch {
        for hh in 0..d.heads {
            for i in 0..s {
                for l in 0..hd {
                    let mut acc = 0f64;
                    for j in 0..s {
                        acc += probs[((b * d.heads + hh) * s + i) * s + j] as f64
                            * qkv[(b * s + j) * 3 * h + 2 * h + hh * hd + l] as f64;
                    }
                    out[(b * s + i) * h + hh * hd + l] = acc;
                }
            }
        }
    }
    out
}

fn scores<T: Element>(d: AttentionDims, qkv: &[f32], scale: f32, causal: bool) -> Vec<f32> {
    let mut out = vec![T::from_f32(f32::NAN); d.scores_len()];
    let mut ws = vec![0f32; attention_ws_len::<T>(d)];
    scores_forward(d, &to_t::<T>(qkv), &mut out, scale, causal, &mut ws).unwrap();
    to_f32(&out)
}

fn context<T: Element>(d: AttentionDims, probs: &[f32], qkv: &[f32]) -> Vec<f32> {
    let mut out = vec![T::from_f32(f32::NAN); d.ctx_len()];
    let mut ws = vec![0f32; attention_ws_len::<T>(d)];
    context_forward(d, &to_t::<T>(probs), &to_t::<T>(qkv), &mut out, &mut ws).unwrap();
    to_f32(&out)
}

/// Σ scores·r over the positions the mask leaves alone (masked ones are constants).
fn masked_r(d: AttentionDims, r: &[f32], causal: bool) -> Vec<f32> {
    let s = d.seq;
    r.iter()
        .enumerate()
        .map(|(idx, &v)| {
            if causal && (idx % s) > (idx / s) % s {
                0.0
            } else {
                v
            }
        })
        .collect()
}

#[test]
fn scores_and_context_forward_match_naive() {
    let mut rng = Rng::new(51);
    for sh in SHAPES {
        let d = dims(sh);
        let qkv = rng.vec(d.qkv_len());
        let scale = 1.0 / (d.head_dim() as f32).sqrt();
        for causal in [false, true] {
            assert_close(
                &format!("{d:?} causal {causal}"),
                &scores::<f32>(d, &qkv, scale, causal),
                &naive_scores(d, &qkv, scale, causal),
                1e-5,
                1e-5,
            );
        }
        let probs = rng.vec(d.scores_len());
        assert_close(
            &format!("{d:?} ctx"),
            &context::<f32>(d, &probs, &qkv),
            &naive_context(d, &probs, &qkv),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn scores_backward_matches_finite_differences() {
    let mut rng = Rng::new(52);
    for sh in SHAPES {
        let d = dims(sh);
        let h = d.hidden;
        for causal in [false, true] {
            let qkv = rng.vec(d.qkv_len());
            let scale = 0.7;
            let r = masked_r(d, &rng.vec(d.scores_len()), causal);
            let sentinel = 12345.0f32;
            let mut dqkv = vec![sentinel; d.qkv_len()];
            scores_backward(d, &r, &qkv, &mut dqkv, scale, &mut []).unwrap();
            // v columns are context_backward's: untouched here
            for (i, &g) in dqkv.iter().enumerate() {
                if i % (3 * h) >= 2 * h {
                    assert_eq!(g, sentinel, "v column {i} written by scores_backward");
                }
            }
            let qk: Vec<f32> = dqkv
                .iter()
                .enumerate()
                .map(|(i, &g)| if i % (3 * h) >= 2 * h { 0.0 } else { g })
                .collect();
            check_grad(
                &format!("{d:?} causal {causal} dq dk"),
                &qkv,
                &qk,
                &mut rng,
                60,
                &mut |p| {
                    dot(
                        &masked_r(d, &scores::<f32>(d, p, scale, causal), causal),
                        &r,
                    )
                },
            );
        }
    }
}

#[test]
fn context_backward_matches_finite_differences() {
    let mut rng = Rng::new(53);
    for sh in SHAPES {
        let d = dims(sh);
        let h = d.hidden;
        let (qkv, probs, r) = (
            rng.vec(d.qkv_len()),
            rng.vec(d.scores_len()),
            rng.vec(d.ctx_len()),
        );
        let sentinel = -777.0f32;
        let mut dqkv = vec![sentinel; d.qkv_len()];
        let mut dprobs = vec![f32::NAN; d.scores_len()];
        context_backward(d, &r, &probs, &qkv, &mut dprobs, &mut dqkv, &mut []).unwrap();
        for (i, &g) in dqkv.iter().enumerate() {
            if i % (3 * h) < 2 * h {
                assert_eq!(g, sentinel, "q/k column {i} written by context_backward");
            }
        }
        let dv: Vec<f32> = dqkv
            .iter()
            .enumerate()
            .map(|(i, &g)| if i % (3 * h) < 2 * h { 0.0 } else { g })
            .collect();
        check_grad(&format!("{d:?} dv"), &qkv, &dv, &mut rng, 60, &mut |p| {
            dot(&context::<f32>(d, &probs, p), &r)
        });
        check_grad(
            &format!("{d:?} dprobs"),
            &probs,
            &dprobs,
            &mut rng,
            60,
            &mut |p| dot(&context::<f32>(d, p, &qkv), &r),
        );
    }
}

/// Together the two backward kernels overwrite every element of dqkv, in either order.
#[test]
fn scores_and_context_backward_together_overwrite_dqkv() {
    let d = dims(&SHAPES[2]);
    let mut rng = Rng::new(54);
    let (qkv, probs, ds, dc) = (
        rng.vec(d.qkv_len()),
        rng.vec(d.scores_len()),
        rng.vec(d.scores_len()),
        rng.vec(d.ctx_len()),
    );
    let mut dprobs = vec![0f32; d.scores_len()];
    let mut a = vec![f32::NAN; d.qkv_len()];
    scores_backward(d, &ds, &qkv, &mut a, 0.5, &mut []).unwrap();
    context_backward(d, &dc, &probs, &qkv, &mut dprobs, &mut a, &mut []).unwrap();
    let mut b = vec![f32::INFINITY; d.qkv_len()];
    context_backward(d, &dc, &probs, &qkv, &mut dprobs, &mut b, &mut []).unwrap();
    scores_backward(d, &ds, &qkv, &mut b, 0.5, &mut []).unwrap();
    assert!(a.iter().all(|v| v.is_finite()));
    assert_eq!(a, b);
}

fn check_half<T: Element>(tol: f64) {
    let mut rng = Rng::new(55);
    for sh in SHAPES {
        let d = dims(sh);
        let qkv = rounded::<T>(&rng.vec(d.qkv_len()));
        let probs = rounded::<T>(&rng.vec(d.scores_len()));
        let (ds, dc) = (
            rounded::<T>(&rng.vec(d.scores_len())),
            rounded::<T>(&rng.vec(d.ctx_len())),
        );
        let what = format!("{} {d:?}", T::NAME);
        let masked = |v: Vec<f32>| masked_r(d, &v, true);
        assert!(
            rel_err(
                &masked(scores::<T>(d, &qkv, 0.5, true)),
                &masked(scores::<f32>(d, &qkv, 0.5, true))
            ) <= tol,
            "{what} scores"
        );
        let sc = scores::<T>(d, &qkv, 0.5, true);
        for (idx, &v) in sc.iter().enumerate() {
            if idx % d.seq > (idx / d.seq) % d.seq {
                assert!(v <= -6.0e4, "{what}: masked score {v}");
            }
        }
        assert!(
            rel_err(
                &context::<T>(d, &probs, &qkv),
                &context::<f32>(d, &probs, &qkv)
            ) <= tol,
            "{what} ctx"
        );
        let run = |lanes: usize| {
            // attention_ws_len provisions min(pairs, ATTENTION_LANES) lanes; one lane suffices.
            let full = attention_ws_len::<T>(d);
            let one = full / (d.batch * d.heads).min(ATTENTION_LANES);
            let mut ws = vec![0f32; if lanes == 1 { one } else { full }];
            let mut dq = vec![T::from_f32(0.0); d.qkv_len()];
            let mut dp = vec![T::from_f32(0.0); d.scores_len()];
            scores_backward(d, &to_t::<T>(&ds), &to_t::<T>(&qkv), &mut dq, 0.5, &mut ws).unwrap();
            context_backward(
                d,
                &to_t::<T>(&dc),
                &to_t::<T>(&probs),
                &to_t::<T>(&qkv),
                &mut dp,
                &mut dq,
                &mut ws,
            )
            .unwrap();
            (to_f32(&dq), to_f32(&dp))
        };
        let (dq, dp) = run(8);
        assert_eq!(
            (dq.clone(), dp.clone()),
            run(1),
            "{what}: lanes change nothing"
        );
        let mut dq32 = vec![0f32; d.qkv_len()];
        let mut dp32 = vec![0f32; d.scores_len()];
        scores_backward(d, &ds, &qkv, &mut dq32, 0.5, &mut []).unwrap();
        context_backward(d, &dc, &probs, &qkv, &mut dp32, &mut dq32, &mut []).unwrap();
        assert!(rel_err(&dq, &dq32) <= tol, "{what} dqkv");
        assert!(rel_err(&dp, &dp32) <= tol, "{what} dprobs");
    }
}

#[test]
fn attention_half_storage_within_tolerance_of_f32() {
    check_half::<f16>(1e-3);
    check_half::<bf16>(8e-3);
}

#[test]
fn attention_refuses_bad_arguments() {
    let d = dims(&SHAPES[0]);
    let qkv = vec![0f32; d.qkv_len()];
    let mut sc = vec![0f32; d.scores_len()];
    assert!(scores_forward(d, &qkv[1..], &mut sc, 1.0, false, &mut []).is_err());
    assert!(scores_forward(d, &qkv, &mut sc[1..], 1.0, false, &mut []).is_err());
    let bad = AttentionDims { heads: 4, ..d }; // 6 % 4 != 0
    assert!(scores_forward(bad, &qkv, &mut sc, 1.0, false, &mut [])
        .unwrap_err()
        .0
        .contains("multiple"));
    let mut ctx = vec![0f32; d.ctx_len()];
    assert!(context_forward(d, &sc, &qkv, &mut ctx[1..], &mut []).is_err());
    let mut dqkv = vec![0f32; d.qkv_len()];
    assert!(scores_backward(d, &sc[1..], &qkv, &mut dqkv, 1.0, &mut []).is_err());
    assert!(
        context_backward(d, &ctx, &sc, &qkv, &mut sc.clone()[1..], &mut dqkv, &mut []).is_err()
    );
    let qh = to_t::<bf16>(&qkv);
    let mut sh = vec![bf16::ZERO; d.scores_len()];
    assert!(scores_forward(d, &qh, &mut sh, 1.0, false, &mut [])
        .unwrap_err()
        .0
        .contains("ws"));
}
