//! `global_avg_pool`: the mean over height and width, `[h, w, c]` → `[c]`.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "global_avg_pool",
    handle: "GlobalAvgPool",
    doc: "Global average pooling over height and width.",
    inputs: Inputs::One,
    options: &[],
    params: &[],
    build: |_| LayerKind::GlobalAvgPool,
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, _: &LayerKind) -> Result<Value, PlanError> {
    let (v, from) = cx.input(0);
    let (n, h, w, c) = cx.rank4(&v, from)?;
    let x = cx.cast(&v)?;
    let y = cx.tensor("out", vec![n, c], cx.dtype);
    cx.push(
        Op::GlobalAvgPool { n, hw: h * w, c },
        vec![x.tensor],
        vec![y],
        vec![],
    );
    Ok(Value {
        tensor: y,
        shape: vec![n, c],
    })
}
