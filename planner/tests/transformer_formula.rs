//! A transformer block's activation memory against Korthikanti et al. 2022 ("Reducing
//! Activation Recomputation in Large Transformer Models"): with 16-bit activations and 1-byte
//! dropout masks a layer keeps `s·b·h·(34 + 5·a·s/h)` bytes (eq. 2), `s·b·h·34` with
//! selective recomputation of the attention core (eq. 6: the softmax output, its dropout mask
//! and dropped copy are recomputed), and `2·s·b·h` when the whole layer is checkpointed. The
//! planner's memory-efficient attention (`Op::FlashAttention`) is that selective
//! recomputation: it keeps one f32 log-sum-exp per query row and head instead of the
//! `5·a·s²·b` bytes. It goes one term further: the GeLU output (`8·s·b·h`) is remade from
//! the GeLU input, which is kept anyway, so a layer keeps `26·s·b·h` plus those statistics.
//! Checked on a small GPT here and on the planner's GPT-2 (the zoo's `gpt2_stack`).

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

/// The layer names of one pre-LN block, in the paper's order of its terms.
struct BlockNames {
    ln1: &'static str,
    attn: &'static str,
    drop1: &'static str,
    ln2: &'static str,
    mlp1: &'static str,
    drop2: &'static str,
}

impl BlockNames {
    /// The middle block of this file's GPT.
    const TEST: BlockNames = BlockNames {
        ln1: "b1_ln1",
        attn: "b1_attn",
        drop1: "b1_drop1",
        ln2: "b1_ln2",
        mlp1: "b1_mlp1",
        drop2: "b1_drop2",
    };
}

/// Eq. 6's terms (bytes, 16-bit activations, 1-byte masks) as the tensors that hold them,
/// term by term as the paper lists them; they sum to `34·s·b·h`.
fn eq6_terms(n: &BlockNames, sbh: u64) -> Vec<(String, u64)> {
    [
        (n.ln1, "x_hat", 2 * sbh), // LayerNorm 1 input (we keep the normalised input)
        (n.ln1, "out", 2 * sbh),   // QKV projection input
        (n.attn, "qkv", 6 * sbh),  // Q, K (for QKᵀ) and V (for attention over values)
        (n.attn, "ctx", 2 * sbh),  // output projection input
        (n.drop1, "mask", sbh),    // dropout mask
        (n.ln2, "x_hat", 2 * sbh), // LayerNorm 2 input
        (n.ln2, "out", 2 * sbh),   // MLP first linear input
        (n.mlp1, "linear", 8 * sbh), // GeLU input
        (n.mlp1, "out", 8 * sbh),  // MLP second linear input
        (n.drop2, "mask", sbh),    // dropout mask
    ]
    .into_iter()
    .map(|(layer, t, bytes)| (format!("{layer}.{t}"), bytes))
    .collect()
}

/// Tensors sit at 256-byte offsets: a short sequence's `1/σ` rows (128 bytes) take 256.
fn aligned(terms: impl Iterator<Item = (String, u64)>) -> Vec<(String, u64)> {
    sorted(terms.map(|(n, b)| (n, b.div_ceil(256) * 256)).collect())
}

fn sorted(mut v: Vec<(String, u64)>) -> Vec<(String, u64)> {
    v.sort();
    v
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
        let mut expect = eq6_terms(&BlockNames::TEST, sbh);
        // What the paper leaves out by its own statement ("small buffers like LayerNorm mean
        // and variance"): one f32 reciprocal standard deviation per row per LayerNorm.
        let mut stats = vec![
            ("b1_ln1.rstd".to_string(), 4 * s * b),
            ("b1_ln2.rstd".to_string(), 4 * s * b),
        ];
        let formula = if flash {
            // Eq. 6: the attention core's 5·a·s²·b recomputed; one f32 log-sum-exp per row
            // and head instead.
            stats.push(("b1_attn.lse".to_string(), 4 * a * s * b));
            sbh * 34
        } else {
            expect.extend([
                ("b1_attn.probs".to_string(), 2 * a * s * s * b), // softmax output
                ("b1_attn.probs_mask".to_string(), a * s * s * b), // attention dropout mask
                ("b1_attn.probs_dropped".to_string(), 2 * a * s * s * b), // over values
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
        expect.retain(|(n, _)| n != "b1_mlp1.out");
        let remade = plan
            .steps
            .iter()
            .find(|st| st.phase == Phase::Recompute && st.layer == "b1_mlp1")
            .expect("the GeLU output is remade");
        assert_eq!(remade.op.name(), "gelu", "s = {seq}");
        assert_eq!(plan.checkpoint_recompute_flops(), 0, "s = {seq}");
        // Tensors sit at 256-byte offsets: a short sequence's `1/σ` rows (128 bytes) take 256.
        assert_eq!(
            sorted(kept),
            aligned(expect.into_iter().chain(stats)),
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

/// Eq. 6 term by term on the planner's GPT-2 (the zoo's `gpt2_stack`: GPT-2 small's blocks,
/// sequence 1024, hidden 768, 12 heads, mixed float16, dropout 0.1), one sample: the attention
/// core is the memory-efficient kernel's, the GeLU output is remade, and what stays is the
/// paper's `34·s·b·h` less the GeLU output, plus the statistics the paper leaves out.
#[test]
fn gpt2_block_keeps_korthikantis_selective_recompute_figure_less_the_gelu_output() {
    let plan = plan(&zoo::gpt2_stack(1, 3)).expect("plans");
    let ((s, b, h, a), names) = (gpt2_dims(), BlockNames::gpt2_middle());
    let sbh = s * b * h;
    let mut expect = eq6_terms(&names, sbh);
    assert_eq!(expect.iter().map(|e| e.1).sum::<u64>(), 34 * sbh);
    expect.retain(|(n, _)| n != "h1_mlp_fc.out");
    let stats = [
        ("h1_ln_1.rstd".to_string(), 4 * s * b),
        ("h1_ln_2.rstd".to_string(), 4 * s * b),
        ("h1_attn.lse".to_string(), 4 * a * s * b),
    ];
    assert_eq!(
        sorted(kept_at_loss(&plan, "h1_")),
        aligned(expect.into_iter().chain(stats)),
        "every kept tensor of the middle block accounted for, nothing more"
    );
    assert_eq!(plan.checkpoint_recompute_flops(), 0);
    // 26·s·b·h plus the statistics: 19.56 MiB of the paper's 25.5 MiB at b = 1.
    let kept: u64 = kept_at_loss(&plan, "h1_").iter().map(|t| t.1).sum();
    assert_eq!(kept, 26 * sbh + 4 * s * b * (2 + a));
}

#[test]
fn recomputing_the_norm_outputs_keeps_their_inputs_instead() {
    // `recompute_output` on the middle block's two layer norms: each keeps its input (the
    // residual stream) and 1/σ instead of x̂ and its output, and remakes the output before the
    // projection's backward — eq. 6's two 2·s·b·h LayerNorm terms and its two projection
    // inputs become the two LayerNorm inputs: 22·s·b·h (less the GeLU output, as above).
    // The previous test's block keeps 26·s·b·h.
    let mut spec = zoo::gpt2_stack(1, 3);
    spec.recompute_output(&["h1_ln_1", "h1_ln_2"]);
    let plan = plan(&spec).expect("plans");
    let ((s, b, h, a), names) = (gpt2_dims(), BlockNames::gpt2_middle());
    let sbh = s * b * h;
    let mut expect = eq6_terms(&names, sbh);
    let dropped = [
        "h1_mlp_fc.out",
        "h1_ln_1.x_hat",
        "h1_ln_1.out",
        "h1_ln_2.x_hat",
        "h1_ln_2.out",
    ];
    expect.retain(|(n, _)| !dropped.contains(&n.as_str()));
    let kept_inputs = [("h1_add_1.out".to_string(), 2 * sbh)];
    // Not even 1/σ: the norms' backwards read the one their forward's second run writes.
    let stats = [("h1_attn.lse".to_string(), 4 * a * s * b)];
    assert_eq!(
        sorted(kept_at_loss(&plan, "h1_")),
        aligned(expect.into_iter().chain(kept_inputs).chain(stats)),
        "the middle block keeps its norms' inputs, not their x̂, outputs and 1/σ"
    );
    // The first norm's input is the previous block's output, kept now for it.
    assert_eq!(
        kept_at_loss(&plan, "h0_add_2"),
        vec![("h0_add_2.out".to_string(), 2 * sbh)]
    );
    // What it costs: the two norms' forwards again, and nothing else counts as chosen.
    let ln = Op::LayerNorm {
        rows: s as usize,
        features: h as usize,
        epsilon: 1e-5,
        rebuild_x_hat: true,
    };
    assert_eq!(plan.checkpoint_recompute_flops(), 2 * ln.forward_flops());
    let flagged: Vec<&str> = (plan.memory.layers.iter())
        .filter(|l| l.recomputes_output)
        .map(|l| l.name.as_ref())
        .collect();
    assert_eq!(flagged, ["h1_ln_1", "h1_ln_2"]);
    let plain = plan_total(&zoo::gpt2_stack(1, 3));
    assert!(
        plan.memory.total < plain,
        "{} !< {plain}",
        plan.memory.total
    );
}

fn plan_total(spec: &ModelSpec) -> u64 {
    plan(spec).expect("plans").memory.total
}

/// `(s, b, h, a)` of the zoo's GPT-2 stack at batch 1.
fn gpt2_dims() -> (u64, u64, u64, u64) {
    (
        zoo::GPT2_SEQ as u64,
        1,
        zoo::GPT2_HIDDEN as u64,
        zoo::GPT2_HEADS as u64,
    )
}

impl BlockNames {
    /// The middle block of the zoo's three-block GPT-2 stack.
    fn gpt2_middle() -> BlockNames {
        BlockNames {
            ln1: "h1_ln_1",
            attn: "h1_attn",
            drop1: "h1_attn_dropout",
            ln2: "h1_ln_2",
            mlp1: "h1_mlp_fc",
            drop2: "h1_mlp_dropout",
        }
    }
}
