//! `batch_norm`: batch normalisation over the last axis — batch statistics (and running
//! ones updated) in training, the running statistics in inference.
use super::common::{epsilon, BIAS, SCALE};
use super::prelude::*;

/// Scale γ and shift β, and the running statistics.
const PARAMS: &[ParamDef] = &[
    SCALE,
    BIAS,
    ParamDef::statistic("running_mean", Init::Zeros),
    ParamDef::statistic("running_var", Init::Ones),
];

/// Momentum 0.99 and epsilon 1e-3 as Keras's `BatchNormalization`.
pub(super) static DEF: LayerDef = LayerDef {
    name: "batch_norm",
    handle: "BatchNorm",
    doc: "Batch normalisation.",
    inputs: Inputs::One,
    options: &[
        OptionDef::new(
            "momentum",
            OptionType::Rate,
            OptValue::Float(0.99),
            "how much of the running statistics each step keeps",
        ),
        epsilon(1e-3, "added to the variance"),
    ],
    params: PARAMS,
    build: |o| LayerKind::BatchNorm {
        momentum: o.float("momentum"),
        epsilon: o.float("epsilon"),
    },
};

impl LayerKind {
    /// Keras defaults: momentum 0.99, epsilon 1e-3.
    pub fn batch_norm() -> Self {
        DEF.with_defaults()
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::BatchNorm { momentum, epsilon } = *kind else {
        unreachable!("batch_norm lowers batch_norm layers")
    };
    let (v, _) = cx.input(0);
    let x = cx.cast(&v)?;
    let c = *x.shape.last().unwrap_or(&1);
    let rows = prod(&x.shape) / c.max(1);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let ps: Vec<usize> = PARAMS.iter().map(|p| cx.param(p, vec![c])).collect();
    if !cx.training() {
        let op = Op::BatchNormInference {
            rows,
            channels: c,
            epsilon,
        };
        cx.push(op, vec![x.tensor], vec![y], ps);
        return Ok(Value {
            tensor: y,
            shape: x.shape,
        });
    }
    let xh = cx.tensor("x_hat", x.shape.clone(), cx.dtype);
    // The mean as an f32 hi/lo pair: a backward that rebuilds x̂ subtracts both, as the
    // forward did.
    let mean = cx.tensor("mean", vec![2, c], DType::F32);
    let inv = cx.tensor("inv_std", vec![c], DType::F32);
    cx.push(
        Op::BatchNorm {
            rows,
            channels: c,
            momentum,
            epsilon,
            // The step graph decides, once it knows what the other ops keep.
            rebuild_x_hat: false,
        },
        vec![x.tensor],
        vec![y, xh, mean, inv],
        ps,
    );
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
