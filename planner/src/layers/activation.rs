//! `activation`: an activation as a layer of its own (`#[activation(relu)]`).
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "activation",
    handle: "Activation",
    doc: "A standalone activation.",
    inputs: Inputs::One,
    options: &[OptionDef::required(
        "activation",
        OptionType::Activation,
        "#[activation(relu)]",
        "the activation",
    )
    .at(0)],
    params: &[],
    build: |o| LayerKind::Activation(o.activation("activation")),
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Activation(act) = *kind else {
        unreachable!("activation lowers activation layers")
    };
    let (v, _) = cx.input(0);
    let x = cx.cast(&v)?;
    if act == Activation::Linear {
        return Ok(x);
    }
    let y = cx.activation(x, act);
    // The activation layer's only op: name its output `out`.
    cx.rename(y.tensor, "out");
    Ok(y)
}
