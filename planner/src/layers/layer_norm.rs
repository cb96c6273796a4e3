//! `layer_norm`: layer normalisation over the last axis, with a learned scale and shift.
use super::common::{last_axis_norm, LastAxisNorm, BIAS, SCALE};
use super::prelude::*;

/// Keras's `LayerNormalization` default (PyTorch uses 1e-5; say `epsilon = 1e-5` for
/// parity).
const EPSILON: f32 = 1e-3;

/// Scale γ and shift β.
const PARAMS: &[ParamDef] = &[SCALE, BIAS];

pub(super) static DEF: LayerDef = LayerDef {
    name: "layer_norm",
    handle: "LayerNorm",
    doc: "Layer normalisation.",
    inputs: Inputs::One,
    options: &[OptionDef::new(
        "epsilon",
        OptionType::Float,
        OptValue::Float(EPSILON),
        "added to the variance",
    )],
    params: PARAMS,
    build: |o| LayerKind::LayerNorm {
        epsilon: o.float("epsilon"),
    },
};

impl LayerKind {
    /// Keras default epsilon 1e-3 (PyTorch uses 1e-5; say `epsilon = 1e-5` for parity).
    pub fn layer_norm() -> Self {
        DEF.with_defaults()
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::LayerNorm { epsilon } = *kind else {
        unreachable!("layer_norm lowers layer_norm layers")
    };
    let LastAxisNorm {
        x,
        features: f,
        rows,
        y,
        x_hat: xh,
        rstd,
    } = last_axis_norm(cx)?;
    let ps: Vec<usize> = PARAMS.iter().map(|p| cx.param(p, vec![f])).collect();
    cx.push(
        Op::LayerNorm {
            rows,
            features: f,
            epsilon,
            // Decided with the backward rules (autodiff.rs).
            rebuild_x_hat: false,
        },
        vec![x.tensor],
        vec![y, xh, rstd],
        ps,
    );
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
