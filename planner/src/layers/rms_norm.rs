//! `rms_norm`: root-mean-square normalisation over the last axis, with a learned scale and no
//! shift (Keras's `RMSNormalization`, PyTorch's `nn.RMSNorm`, LLaMA's pre-norm).
use super::common::SCALE;
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
    let (v, _) = cx.input(0);
    let x = cx.cast(&v)?;
    let f = *x.shape.last().unwrap_or(&1);
    let rows = prod(&x.shape) / f.max(1);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let xh = cx.tensor("x_hat", x.shape.clone(), cx.dtype);
    let rstd = cx.tensor("rstd", vec![rows], DType::F32);
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
