//! `layer_norm`: layer normalisation over the last axis, with a learned scale and shift.
use super::common::{epsilon, last_axis_norm, BIAS, SCALE};
use super::prelude::*;

/// Scale γ and shift β.
const PARAMS: &[ParamDef] = &[SCALE, BIAS];

/// Epsilon 1e-3 as Keras's `LayerNormalization` (PyTorch uses 1e-5; say `epsilon = 1e-5`).
pub(super) static DEF: LayerDef = LayerDef {
    name: "layer_norm",
    handle: "LayerNorm",
    doc: "Layer normalisation.",
    inputs: Inputs::One,
    options: &[epsilon(1e-3, "added to the variance")],
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
    last_axis_norm(cx, PARAMS, |rows, features| Op::LayerNorm {
        rows,
        features,
        epsilon,
        // Decided with the backward rules (autodiff.rs).
        rebuild_x_hat: false,
    })
}
