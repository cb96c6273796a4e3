//! `concat`: two or more fields joined along the last axis, one pair at a time.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "concat",
    handle: "Concat",
    doc: "A concatenation of fields along the last axis.",
    inputs: Inputs::Fields {
        min: 2,
        max: None,
        doc: "the fields to join",
        what: "two or more fields",
        example: "#[add(block1, stem)]",
    },
    options: &[OptionDef::new(
        "axis",
        OptionType::LastAxis,
        OptValue::Int(-1),
        "the last (the only one supported)",
    )],
    params: &[],
    build: |_| LayerKind::Concat,
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, _: &LayerKind) -> Result<Value, PlanError> {
    let ins = cx.inputs();
    let (v0, f0) = ins[0].clone();
    let mut acc = cx.cast(&v0)?;
    let rank = v0.shape.len();
    for (k, (v, f)) in ins[1..].iter().enumerate() {
        if v.shape.len() != rank || v.shape[..rank - 1] != v0.shape[..rank - 1] {
            return Err(cx
                .err(format!(
                    "cannot concatenate `{f0}` {} and `{f}` {}: all axes but the last must match",
                    user_shape(&v0.shape),
                    user_shape(&v.shape)
                ))
                .related(&[f0, f]));
        }
        let x = cx.cast(v)?;
        let a = *acc.shape.last().unwrap_or(&1);
        let b = *x.shape.last().unwrap_or(&1);
        let rows = prod(&acc.shape) / a.max(1);
        let mut shape = acc.shape.clone();
        *shape.last_mut().expect("rank >= 1") = a + b;
        let name = if k + 2 == ins.len() {
            "out".to_string()
        } else {
            format!("part{k}")
        };
        let y = cx.tensor(&name, shape.clone(), cx.dtype);
        cx.push(
            Op::Concat { rows, a, b },
            vec![acc.tensor, x.tensor],
            vec![y],
            vec![],
        );
        acc = Value { tensor: y, shape };
    }
    Ok(acc)
}
