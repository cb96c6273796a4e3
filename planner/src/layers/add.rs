//! `add`: the element-wise sum of two or more fields of one shape, then its activation.
use super::common::ACTIVATION;
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "add",
    handle: "Add",
    doc: "An element-wise sum of fields.",
    inputs: Inputs::Fields {
        min: 2,
        max: None,
        doc: "the fields to sum",
        what: "two or more fields",
        example: "#[add(block1, stem)]",
    },
    options: &[ACTIVATION],
    params: &[],
    build: |o| LayerKind::Add {
        activation: o.activation("activation"),
    },
};

impl LayerKind {
    pub fn add() -> Self {
        DEF.with_defaults()
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Add { activation } = *kind else {
        unreachable!("add lowers add layers")
    };
    let ins = cx.inputs();
    let (v0, f0) = &ins[0];
    for (v, f) in &ins[1..] {
        if v.shape != v0.shape {
            return Err(cx
                .err(format!(
                    "cannot add `{f0}` {} and `{f}` {}: shapes differ",
                    user_shape(&v0.shape),
                    user_shape(&v.shape)
                ))
                .related(&[f0, f]));
        }
    }
    let mut ts = Vec::new();
    for (v, _) in &ins {
        ts.push(cx.cast(v)?.tensor);
    }
    let shape = v0.shape.clone();
    let elems = prod(&shape);
    let name = if activation == Activation::Linear {
        "out"
    } else {
        "sum"
    };
    let y = cx.tensor(name, shape.clone(), cx.dtype);
    let arity = ts.len();
    cx.push(Op::Add { elems, arity }, ts, vec![y], vec![]);
    Ok(cx.activation(Value { tensor: y, shape }, activation))
}
