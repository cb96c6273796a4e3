//! `flatten`: a view of its input as `[batch, features]`; no op, no bytes.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "flatten",
    handle: "Flatten",
    doc: "A flattening view.",
    inputs: Inputs::One,
    options: &[],
    params: &[],
    build: |_| LayerKind::Flatten,
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, _: &LayerKind) -> Result<Value, PlanError> {
    let (v, _) = cx.input(0);
    let rest: usize = prod(&v.shape[1..]);
    Ok(Value {
        tensor: v.tensor,
        shape: vec![v.shape[0], rest],
    })
}
