//! `attention`: multi-head self-attention over `[seq, hidden]` — a fused QKV projection,
//! scaled dot-product attention (optionally causal, with dropout on the probabilities),
//! and an output projection.
use super::prelude::*;
use crate::op::{flash_attention_scratch_elems, AttentionSettings, FLASH_MAX_HEAD_DIM};

const QKV_WEIGHT: ParamDef = ParamDef::trainable("qkv.weight", Init::GlorotUniform).gemm();
const QKV_BIAS: ParamDef = ParamDef::trainable("qkv.bias", Init::Zeros);
const OUT_WEIGHT: ParamDef = ParamDef::trainable("out.weight", Init::GlorotUniform).gemm();
const OUT_BIAS: ParamDef = ParamDef::trainable("out.bias", Init::Zeros);

pub(super) static DEF: LayerDef = LayerDef {
    name: "attention",
    handle: "Attention",
    doc: "Multi-head self-attention.",
    inputs: Inputs::One,
    options: &[
        OptionDef::required(
            "num_heads",
            OptionType::Positive,
            "#[attention(num_heads = 12, causal = true)]",
            "attention heads, a divisor of the hidden size",
        )
        .alias(&["heads"])
        .at(0),
        OptionDef::new(
            "causal",
            OptionType::Bool,
            OptValue::Bool(false),
            "each position attends only to itself and earlier ones",
        )
        .alias(&["use_causal_mask"]),
        OptionDef::new(
            "dropout",
            OptionType::Rate,
            OptValue::Float(0.0),
            "dropout on the attention probabilities",
        ),
    ],
    params: &[QKV_WEIGHT, QKV_BIAS, OUT_WEIGHT, OUT_BIAS],
    build: |o| LayerKind::Attention {
        heads: o.positive("num_heads"),
        causal: o.boolean("causal"),
        dropout: o.float("dropout"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Attention {
        heads,
        causal,
        dropout,
    } = *kind
    else {
        unreachable!("attention lowers attention layers")
    };
    let (v, from) = cx.input(0);
    if v.shape.len() != 3 {
        return Err(cx
            .err(format!(
                "`attention` expects a [sequence, hidden] input, but `{from}` gives {}",
                user_shape(&v.shape)
            ))
            .related(&[from]));
    }
    let (b, s, h) = (v.shape[0], v.shape[1], v.shape[2]);
    if heads == 0 || h % heads != 0 {
        return Err(cx.err(format!(
            "hidden size {h} is not divisible by heads = {heads}"
        )));
    }
    if !(0.0..1.0).contains(&dropout) {
        return Err(cx.err(format!(
            "attention dropout must be in [0, 1), got {dropout}"
        )));
    }
    let dt = cx.dtype;
    let x = cx.cast(&v)?;
    let qkv = cx.tensor("qkv", vec![b, s, 3 * h], dt);
    let wq = cx.param(&QKV_WEIGHT, vec![h, 3 * h]);
    let bq = cx.param(&QKV_BIAS, vec![3 * h]);
    let projection = |units| Op::Dense {
        rows: b * s,
        in_features: h,
        units,
        bias: true,
    };
    cx.push(projection(3 * h), vec![x.tensor], vec![qkv], vec![wq, bq]);
    let ctx_shape = vec![b, s, h];
    let layers = cx
        .spec()
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Attention { .. }))
        .count();
    let mut settings = AttentionSettings {
        flash: false,
        batch: b,
        seq: s,
        heads,
        head_dim: h / heads,
        causal,
        dropout,
        key: cx.key(),
    };
    settings.flash = flash_keeps_less(&settings, dt, layers);
    let mut outs = if settings.flash {
        vec![cx.tensor("lse", vec![b, heads, s], DType::F32)]
    } else {
        let mut outs = vec![cx.tensor("probs", vec![b, heads, s, s], dt)];
        if dropout > 0.0 {
            outs.push(cx.tensor("probs_mask", vec![b, heads, s, s], DType::U8));
            outs.push(cx.tensor("probs_dropped", vec![b, heads, s, s], dt));
        }
        outs
    };
    let ctx = cx.tensor("ctx", ctx_shape.clone(), dt);
    outs.push(ctx);
    cx.push(settings.op(), vec![qkv], outs, vec![]);
    let y = cx.tensor("out", ctx_shape.clone(), dt);
    let wo = cx.param(&OUT_WEIGHT, vec![h, h]);
    let bo = cx.param(&OUT_BIAS, vec![h]);
    cx.push(projection(h), vec![ctx], vec![y], vec![wo, bo]);
    Ok(Value {
        tensor: y,
        shape: ctx_shape,
    })
}

/// Whether the memory-efficient attention ([`Op::FlashAttention`]) needs fewer bytes than the
/// materialising one ([`Op::Attention`]) for this shape in a model of `layers` attention
/// layers: what each keeps for the backward (the log-sum-exp against the probabilities, with
/// dropout their mask and dropped copy), which adds up over the layers until the backward,
/// plus its workspace and scratch (the materialising backward's `[b, heads, s, s]` score
/// gradients), which one layer at a time uses. Both keep `qkv` and the context. Heads wider
/// than [`FLASH_MAX_HEAD_DIM`] stay materialised.
fn flash_keeps_less(a: &AttentionSettings, dt: DType, layers: usize) -> bool {
    let (b, s, heads, hd) = (a.batch, a.seq, a.heads, a.head_dim);
    if hd > FLASH_MAX_HEAD_DIM {
        return false;
    }
    let scores = (b * heads * s * s) as u64;
    let kept = scores * dt.size() + if a.dropout > 0.0 { scores * (1 + dt.size()) } else { 0 };
    let materialised = AttentionSettings { flash: false, ..*a }.op();
    let mat_ws = materialised.workspace_elems(true) as u64 * dt.size()
        + 4 * materialised.scratch_f32_elems(dt) as u64;
    let flash_ws = 4 * flash_attention_scratch_elems(b, s, heads, hd) as u64;
    let n = layers.max(1) as u64;
    n * 4 * (b * heads * s) as u64 + flash_ws < n * kept + mat_ws
}
