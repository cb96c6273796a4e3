//! `rms_norm`: root-mean-square normalisation over the last axis, with a learned scale and no
//! shift (Keras's `RMSNormalization`, PyTorch's `nn.RMSNorm`, LLaMA's pre-norm).
use super::common::{last_axis_norm, LastAxisNorm, SCALE};
use super::prelude::*;

/// Keras's `RMSNormalization` default (PyTorch's `nn.RMSNorm` uses the dtype's machine
/// epsilon unless told; LLaMA uses 1e-5 or 1e-6).
const EPSILON: f32 = 1e-6;

pub(super) static DEF: LayerDef = LayerDef {
    name: "rms_norm",
    handle: "RmsNorm",
    doc: "Root-mean-square normalisation over the last axis.",
    inputs: Inputs::One,
    options: &[OptionDef::new(
        "epsilon",
        OptionType::Float,
        OptValue::Float(EPSILON),
        "added to the mean square",
    )],
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
    let LastAxisNorm {
        x,
        features: f,
        rows,
        y,
        x_hat: xh,
        rstd,
    } = last_axis_norm(cx)?;
    let gamma = cx.param(&SCALE, vec![f]);
    cx.push(
        Op::GroupNorm {
            samples: rows,
            spatial: 1,
            channels: f,
            groups: 1,
            epsilon,
            center: false,
        },
        vec![x.tensor],
        vec![y, xh, rstd],
        vec![gamma],
    );
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
