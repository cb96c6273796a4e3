//! `group_norm`: group normalisation of channels-last tensors (Keras's `GroupNormalization`,
//! PyTorch's `nn.GroupNorm`): per sample, over each group of consecutive channels and every
//! position, with a learned per-channel scale and shift.
use super::common::{epsilon, BIAS, SCALE};
use super::prelude::*;

/// Scale γ (ones) and shift β (zeros), per channel.
const PARAMS: &[ParamDef] = &[SCALE, BIAS];

/// 32 groups and epsilon 1e-3 as Keras's `GroupNormalization` (PyTorch's
/// `nn.GroupNorm` has no default group count and epsilon 1e-5; say `epsilon = 1e-5`).
pub(super) static DEF: LayerDef = LayerDef {
    name: "group_norm",
    handle: "GroupNorm",
    doc: "Group normalisation over the channels (last axis) in groups.",
    inputs: Inputs::One,
    options: &[
        OptionDef::new(
            "groups",
            OptionType::Positive,
            OptValue::Usize(32),
            "channel groups; must divide the channels",
        )
        .at(0),
        epsilon(1e-3, "added to the variance"),
    ],
    params: PARAMS,
    build: |o| LayerKind::GroupNorm {
        groups: o.positive("groups"),
        epsilon: o.float("epsilon"),
    },
};

impl LayerKind {
    /// Keras defaults: 32 groups, epsilon 1e-3.
    pub fn group_norm() -> Self {
        DEF.with_defaults()
    }
}

/// Statistics per sample and group over `[positions, channels / groups]`: the input seen as
/// `[batch, positions, channels]`, whatever its rank (an image's positions are `h·w`; a
/// vector's, one).
pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::GroupNorm { groups, epsilon } = *kind else {
        unreachable!("group_norm lowers group_norm layers")
    };
    let (v, from) = cx.input(0);
    let c = *v.shape.last().unwrap_or(&1);
    if v.shape.len() < 2 || !c.is_multiple_of(groups) {
        return Err(cx
            .err(format!(
                "`group_norm` splits the last axis of its input into {groups} groups, but \
                 `{from}` is {} with {c} channels: `groups` must divide the channels \
                 (Keras's default is 32)",
                user_shape(&v.shape)
            ))
            .related(&[from]));
    }
    let x = cx.cast(&v)?;
    let samples = x.shape[0];
    let spatial = prod(&x.shape[1..x.shape.len() - 1]);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let xh = cx.tensor("x_hat", x.shape.clone(), cx.dtype);
    let rstd = cx.tensor("rstd", vec![samples, groups], DType::F32);
    let ps: Vec<usize> = PARAMS.iter().map(|p| cx.param(p, vec![c])).collect();
    cx.push(
        Op::GroupNorm {
            samples,
            spatial,
            channels: c,
            groups,
            epsilon,
            center: true,
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
