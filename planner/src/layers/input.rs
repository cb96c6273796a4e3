//! `input`: a model input, written by the runtime before the step; u8 inputs are scaled
//! into the compute dtype by an op of their own.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "input",
    handle: "Input",
    doc: "A model input (u8 pixels, i32 labels or ids, or floats).",
    inputs: Inputs::None,
    options: &[
        OptionDef::required(
            "shape",
            OptionType::Shape,
            "shape = [784]",
            "without the batch dimension (`[]`: one value per sample)",
        )
        .at(0),
        OptionDef::new(
            "dtype",
            OptionType::DType,
            OptValue::DType(DType::F32),
            "how it is stored: `f32`, `u8`, `i32`, `f16` or `bf16`",
        ),
        OptionDef::new(
            "scale",
            OptionType::Float,
            OptValue::Float(1.0),
            "u8 inputs are multiplied by it (`1.0 / 255.0`)",
        ),
    ],
    params: &[],
    build: |o| LayerKind::Input {
        shape: o.shape("shape"),
        dtype: o.dtype("dtype"),
        scale: o.float("scale"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Input {
        shape,
        dtype,
        scale,
    } = kind
    else {
        unreachable!("input lowers inputs")
    };
    if shape.contains(&0) {
        return Err(cx.err(format!(
            "input shape {} has a zero dimension",
            fmt_shape(shape)
        )));
    }
    let mut full = vec![cx.batch()];
    full.extend_from_slice(shape);
    let raw = cx.model_input(full.clone(), *dtype);
    if *dtype != DType::U8 {
        return Ok(Value {
            tensor: raw,
            shape: full,
        });
    }
    let elems = prod(&full);
    let out = cx.tensor("scaled", full.clone(), cx.dtype);
    cx.push(
        Op::InputCast {
            elems,
            scale: *scale,
        },
        vec![raw],
        vec![out],
        vec![],
    );
    Ok(Value {
        tensor: out,
        shape: full,
    })
}
