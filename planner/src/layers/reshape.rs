//! `reshape`: a view of its input with another shape of as many values; no op, no bytes.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "reshape",
    handle: "Reshape",
    doc: "A reshaping view.",
    inputs: Inputs::One,
    options: &[OptionDef::required(
        "target_shape",
        OptionType::Shape,
        "#[reshape([7, 7, 64])]",
        "the new shape, without the batch dimension",
    )
    .alias(&["shape"])
    .at(0)],
    params: &[],
    build: |o| LayerKind::Reshape {
        shape: o.shape("target_shape"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Reshape { shape } = kind else {
        unreachable!("reshape lowers reshape layers")
    };
    let (v, from) = cx.input(0);
    let have: usize = prod(&v.shape[1..]);
    let want: usize = prod(shape);
    if have != want {
        return Err(cx
            .err(format!(
                "cannot reshape {} from `{from}` ({have} values per sample) to {} ({want} values)",
                user_shape(&v.shape),
                fmt_shape(shape)
            ))
            .related(&[from]));
    }
    let mut full = vec![v.shape[0]];
    full.extend_from_slice(shape);
    Ok(Value {
        tensor: v.tensor,
        shape: full,
    })
}
