//! `dense`: a fully connected layer over the last axis, `x · W + b`, then its activation.
use super::common::{weighted, Weighted, ACTIVATION, BIAS, USE_BIAS, WEIGHT};
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "dense",
    handle: "Dense",
    doc: "A fully connected layer.",
    inputs: Inputs::One,
    options: &[
        OptionDef::required(
            "units",
            OptionType::Positive,
            "#[dense(64)]",
            "output features",
        )
        .at(0),
        ACTIVATION,
        USE_BIAS,
    ],
    params: &[WEIGHT, BIAS],
    build: |o| LayerKind::Dense {
        units: o.positive("units"),
        activation: o.activation("activation"),
        use_bias: o.boolean("use_bias"),
    },
};

impl LayerKind {
    /// Dense layer with bias.
    pub fn dense(units: usize, activation: Activation) -> Self {
        LayerKind::Dense {
            units,
            activation,
            use_bias: true,
        }
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Dense {
        units,
        activation,
        use_bias,
    } = *kind
    else {
        unreachable!("dense lowers dense layers")
    };
    let (v, from) = cx.input(0);
    if v.shape.len() < 2 {
        return Err(cx.err(format!(
            "dense needs features, but `{from}` gives {}",
            user_shape(&v.shape)
        )));
    }
    if units == 0 {
        return Err(cx.err("dense units must be at least 1"));
    }
    let x = cx.cast(&v)?;
    let in_f = *x.shape.last().unwrap_or(&1);
    let rows = prod(&x.shape) / in_f.max(1);
    let mut shape = x.shape.clone();
    *shape.last_mut().expect("rank >= 2") = units;
    Ok(weighted(
        cx,
        Weighted {
            input: x.tensor,
            op: Op::Dense {
                rows,
                in_features: in_f,
                units,
                bias: use_bias,
            },
            pre: "linear",
            shape,
            weight: (&WEIGHT, vec![in_f, units]),
            bias: use_bias.then_some(units),
            activation,
        },
    ))
}
