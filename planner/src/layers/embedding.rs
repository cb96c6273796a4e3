//! `embedding`: token ids (i32) → rows of a learned table, `[seq]` → `[seq, dim]`.
use super::prelude::*;

/// Keras's `Embedding` initialiser: uniform in ±0.05.
const WEIGHT: ParamDef = ParamDef::trainable("weight", Init::Uniform(0.05));

const EXAMPLE: &str = "#[embedding(input_dim = 50257, output_dim = 768)]";

pub(super) static DEF: LayerDef = LayerDef {
    name: "embedding",
    handle: "Embedding",
    doc: "A token-id embedding table.",
    inputs: Inputs::One,
    options: &[
        OptionDef::required(
            "input_dim",
            OptionType::Positive,
            EXAMPLE,
            "the vocabulary size",
        )
        .alias(&["vocab"])
        .at(0),
        OptionDef::required(
            "output_dim",
            OptionType::Positive,
            EXAMPLE,
            "the vector size",
        )
        .alias(&["dim"])
        .at(1),
    ],
    params: &[WEIGHT],
    build: |o| LayerKind::Embedding {
        vocab: o.positive("input_dim"),
        dim: o.positive("output_dim"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Embedding { vocab, dim } = *kind else {
        unreachable!("embedding lowers embedding layers")
    };
    let (v, from) = cx.input(0);
    let ids = cx.dtype_of(v.tensor);
    if ids != DType::I32 {
        return Err(cx
            .err(format!(
                "`embedding` reads token ids (an i32 input), but `{from}` holds {} values",
                ids.name()
            ))
            .related(&[from]));
    }
    let tokens: usize = prod(&v.shape);
    let mut shape = v.shape.clone();
    shape.push(dim);
    let y = cx.tensor("out", shape.clone(), cx.dtype);
    let w = cx.param(&WEIGHT, vec![vocab, dim]);
    cx.push(
        Op::Embedding { tokens, vocab, dim },
        vec![v.tensor],
        vec![y],
        vec![w],
    );
    Ok(Value { tensor: y, shape })
}
