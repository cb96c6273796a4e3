//! A transformer block's activation memory against Korthikanti et al. 2022 ("Reducing
//! Activation Recomputation in Large Transformer Models"): with 16-bit activations and 1-byte
//! dropout masks a layer keeps `s·b·h·(34 + 5·a·s/h)` bytes (eq. 2), `s·b·h·34` with
//! selective recomputation of the attention core (eq. 6: the softmax output, its dropout mask
//! and dropped copy are recomputed), and `2·s·b·h` when the whole layer is checkpointed. The
//! planner's memory-efficient attention (`Op::FlashAttention`) is that selective
//! recomputation: it keeps one f32 log-sum-exp per query row and head instead of the
//! `5·a·s²·b` bytes. It goes one term further: the GeLU output (`8·s·b·h`) is remade from
//! the GeLU input, which is kept anyway, so a layer keeps `26·s·b·h` plus those statistics.

use memwise_plan::*;

const S: usize = 64; // sequence: long enough for the memory-efficient attention
/// A sequence so short that the materialising attention needs fewer bytes (its `s²` terms
/// are smaller than the memory-efficient kernels' tiles): the plan keeps eq. 2.
const SHORT: usize = 16;
const B: usize = 2; // batch
const H: usize = 64; // hidden
const A: usize = 4; // heads

/// `blocks` pre-LN GPT blocks in float16, each optionally one checkpoint segment.
fn gpt(blocks: usize, checkpoint: bool) -> ModelSpec {
    gpt_of(S, blocks, checkpoint)
}

fn gpt_of(seq: usize, blocks: usize, checkpoint: bool) -> ModelSpec {
    let mut m = ModelSpec::new("Gpt", B);
    m.precision = Precision::MixedFloat16;
    m.input("x", &[seq, H], DType::F16, 1.0);
    m.input("target", &[seq, H], DType::F16, 1.0);
    let mut prev = "x".to_string();
    for k in 0..blocks {
        let n = |s: &str| format!("b{k}_{s}");
        m.add(&n("ln1"), LayerKind::layer_norm(), &[&prev]);
        m.add(
            &n("attn"),
            LayerKind::Attention {
                heads: A,
                causal: true,
                dropout: 0.1,
            },
            &[],
        );
        m.add(&n("drop1"), LayerKind::Dropout { rate: 0.1 }, &[]);
        m.add(&n("res1"), LayerKind::add(), &[&n("drop1"), &prev]);
        m.add(&n("ln2"), LayerKind::layer_norm(), &[]);
        m.add(&n("mlp1"), LayerKind::dense(4 * H, Activation::Gelu), &[]);
        m.add(&n("mlp2"), LayerKind::dense(H, Activation::Linear), &[]);
        m.add(&n("drop2"), LayerKind::Dropout { rate: 0.1 }, &[]);
        m.add(&n("res2"), LayerKind::add(), &[&n("drop2"), &n("res1")]);
        if checkpoint {
            let names: Vec<String> = [
                "ln1", "attn", "drop1", "res1", "ln2", "mlp1", "mlp2", "drop2", "res2",
            ]
            .iter()
            .map(|s| n(s))
            .collect();
            let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
            m.checkpoint(&refs, k as u32);
        }
        prev = n("res2");
    }
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&[&prev, "target"]));
    m
}

/// Bytes of forward tensors of `layers` still alive when the forward pass ends (at the
/// first loss step): what the layer keeps for its backward.
fn kept_at_loss(plan: &StaticPlan, prefix: &str) -> Vec<(String, u64)> {
    let loss = plan
        .steps
        .iter()
        .position(|s| s.phase == Phase::Loss)
        .unwrap() as u32;
    plan.tensors
        .iter()
        .filter(|t| t.layer.starts_with(prefix) && matches!(t.role, Role::Activation | Role::Input))
        .filter(|t| t.first < loss && t.last >= loss)
        .map(|t| (t.name.to_string(), t.bytes))
        .collect()
}

#[test]
fn transformer_layer_keeps_exactly_the_formula_plus_layer_norm_statistics() {
    // Eq. 6 at the longer sequence (the memory-efficient attention), eq. 2 at the short one.
    for (seq, flash) in [(S, true), (SHORT, false)] {
        let plan = plan(&gpt_of(seq, 3, false)).expect("plans");
        // The middle block: neither the model input nor the loss input sits inside it.
        let kept = kept_at_loss(&plan, "b1_");
        let (s, b, h, a) = (seq as u64, B as u64, H as u64, A as u64);
        let sbh = s * b * h;
        // Term by term, as the paper lists them (bytes):
        let mut expect: Vec<(&str, u64)> = vec![
            ("b1_ln1.x_hat", 2 * sbh), // LayerNorm 1 input (we keep the normalised input)
            ("b1_ln1.out", 2 * sbh),   // QKV projection input
            ("b1_attn.qkv", 6 * sbh),  // Q, K (for QKᵀ) and V (for attention over values)
            ("b1_attn.ctx", 2 * sbh),  // output projection input
            ("b1_drop1.mask", sbh),    // dropout mask
            ("b1_ln2.x_hat", 2 * sbh), // LayerNorm 2 input
            ("b1_ln2.out", 2 * sbh),   // MLP first linear input
            ("b1_mlp1.linear", 8 * sbh), // GeLU input
            ("b1_mlp1.out", 8 * sbh),  // MLP second linear input
            ("b1_drop2.mask", sbh),    // dropout mask
        ];
        // What the paper leaves out by its own statement ("small buffers like LayerNorm mean
        // and variance"): one f32 reciprocal standard deviation per row per LayerNorm.
        let mut stats = vec![("b1_ln1.rstd", 4 * s * b), ("b1_ln2.rstd", 4 * s * b)];
        let formula = if flash {
            // Eq. 6: the attention core's 5·a·s²·b recomputed; one f32 log-sum-exp per row
            // and head instead.
            stats.push(("b1_attn.lse", 4 * a * s * b));
            sbh * 34
        } else {
            expect.extend([
                ("b1_attn.probs", 2 * a * s * s * b),         // softmax output
                ("b1_attn.probs_mask", a * s * s * b),        // attention dropout mask
                ("b1_attn.probs_dropped", 2 * a * s * s * b), // its output (over values)
            ]);
            sbh * 34 + 5 * a * s * s * b
        };
        let expected_sum: u64 = expect.iter().map(|e| e.1).sum();
        assert_eq!(
            expected_sum, formula,
            "the term list is the paper's formula"
        );
        // One term memwise does not keep: the GeLU output, the second linear's input, is
        // remade from the GeLU input (kept for the GeLU's own backward) just before that
        // linear's backward — 8·s·b·h fewer bytes than the paper's selective recomputation.
        expect.retain(|(n, _)| *n != "b1_mlp1.out");
        let remade = plan
            .steps
            .iter()
            .find(|st| st.phase == Phase::Recompute && st.layer == "b1_mlp1")
            .expect("the GeLU output is remade");
        assert_eq!(remade.op.name(), "gelu", "s = {seq}");
        assert_eq!(plan.checkpoint_recompute_flops(), 0, "s = {seq}");
        // Tensors sit at 256-byte offsets: a short sequence's `1/σ` rows (128 bytes) take 256.
        let mut want: Vec<(String, u64)> = expect
            .iter()
            .chain(&stats)
            .map(|(n, b)| (n.to_string(), b.div_ceil(256) * 256))
            .collect();
        want.sort();
        let mut got = kept.clone();
        got.sort();
        assert_eq!(
            got, want,
            "s = {seq}: every kept tensor accounted for, nothing more"
        );
        let uses_flash = plan
            .steps
            .iter()
            .any(|st| matches!(st.op, Op::FlashAttention { .. }));
        assert_eq!(uses_flash, flash, "s = {seq}");
    }
}

#[test]
fn checkpointed_transformer_layer_keeps_only_its_input() {
    let plan = plan(&gpt(3, true)).expect("plans");
    let (s, b, h) = (S as u64, B as u64, H as u64);
    // Block 1 keeps nothing of its own; its input is block 0's output, and block 1's
    // output is what block 2 keeps: 2·s·b·h per layer.
    let kept = kept_at_loss(&plan, "b1_");
    assert_eq!(kept, vec![("b1_res2.out".to_string(), 2 * s * b * h)]);
    let kept0 = kept_at_loss(&plan, "b0_");
    assert_eq!(kept0, vec![("b0_res2.out".to_string(), 2 * s * b * h)]);
    // And the checkpointed plan's peak is lower.
    let plain = memwise_plan::plan(&gpt(3, false)).unwrap();
    assert!(plan.memory.activations_peak < plain.memory.activations_peak);
    assert!(plan.steps.iter().any(|s| s.phase == Phase::Recompute));
}
