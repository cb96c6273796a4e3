//! `rms_norm`: root-mean-square normalisation over the last axis, with a learned scale and no
//! shift (Keras's `RMSNormalization`, PyTorch's `nn.RMSNorm`, LLaMA's pre-norm).
use super::common::{epsilon, last_axis_norm, SCALE};
use super::prelude::*;

/// Epsilon 1e-6 as Keras's `RMSNormalization` (PyTorch's `nn.RMSNorm` uses the dtype's machine
/// epsilon unless told; LLaMA uses 1e-5 or 1e-6).
pub(super) static DEF: LayerDef = LayerDef {
    name: "rms_norm",
    handle: "RmsNorm",
    doc: "Root-mean-square normalisation over the last axis.",
    inputs: Inputs::One,
    options: &[epsilon(1e-6, "added to the mean square")],
    // γ, initialised to ones: the layer starts as the plain normalisation.
    params: &[SCALE],
    build: |o| LayerKind::RmsNorm {
        epsilon: o.float("epsilon"),
    },
};

impl LayerKind {
    /// Keras default epsilon 1e-6.
    pub fn rms_norm() -> Self {
        DEF.with_defaults()
    }
}

/// `y = x / sqrt(mean(x²) + ε) · γ` per row of the last axis: the group-norm op with one
/// group per row, no centring and no shift.
pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::RmsNorm { epsilon } = *kind else {
        unreachable!("rms_norm lowers rms_norm layers")
    };
    last_axis_norm(cx, &[SCALE], |rows, channels| Op::GroupNorm {
        samples: rows,
        spatial: 1,
        channels,
        groups: 1,
        epsilon,
        center: false,
    })
}
