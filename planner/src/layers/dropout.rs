//! `dropout`: in training, zeroes each value with probability `rate` and scales the rest
//! by `1 / (1 - rate)` (the mask kept for the backward pass); nothing in inference.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "dropout",
    handle: "Dropout",
    doc: "Dropout.",
    inputs: Inputs::One,
    options: &[OptionDef::required(
        "rate",
        OptionType::Rate,
        "#[dropout(0.5)]",
        "the fraction of values dropped, in [0, 1)",
    )
    .at(0)],
    params: &[],
    build: |o| LayerKind::Dropout {
        rate: o.float("rate"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Dropout { rate } = *kind else {
        unreachable!("dropout lowers dropout layers")
    };
    if !(0.0..1.0).contains(&rate) {
        return Err(cx.err(format!("dropout rate must be in [0, 1), got {rate}")));
    }
    let (v, _) = cx.input(0);
    if rate == 0.0 || !cx.training() {
        return Ok(v);
    }
    let x = cx.cast(&v)?;
    let elems = prod(&x.shape);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let mask = cx.tensor("mask", x.shape.clone(), DType::U8);
    cx.push(
        Op::Dropout {
            elems,
            rate,
            key: cx.key(),
        },
        vec![x.tensor],
        vec![y, mask],
        vec![],
    );
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
