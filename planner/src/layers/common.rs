//! What several layers share: options (Keras's names and defaults, written once), the
//! weight and bias parameters, and the "op with weights, then activation" lowering.

use super::{Init, LayerKind, OptValue, OptionDef, OptionType, ParamDef};
use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{prod, LayerCx, Value};

use crate::op::{Op, Window2d};
use crate::spec::{Activation, Padding};

pub(super) const ACTIVATION: OptionDef = OptionDef::new(
    "activation",
    OptionType::Activation,
    OptValue::Activation(Activation::Linear),
    "applied to the output",
);

/// The `epsilon` of a normalisation layer: its default and what it is added to.
pub(super) const fn epsilon(default: f32, added_to: &'static str) -> OptionDef {
    OptionDef::new(
        "epsilon",
        OptionType::Float,
        OptValue::Float(default),
        added_to,
    )
}

pub(super) const USE_BIAS: OptionDef = OptionDef::new(
    "use_bias",
    OptionType::Bool,
    OptValue::Bool(true),
    "adds a learned bias",
);

pub(super) const FILTERS: OptionDef = OptionDef::required(
    "filters",
    OptionType::Positive,
    "filters = 32",
    "output channels",
)
.at(0);

/// `kernel_size`, positional at `position`.
pub(super) const fn kernel_size(position: usize) -> OptionDef {
    OptionDef::required(
        "kernel_size",
        OptionType::Pair,
        "kernel_size = 3",
        "the window: one number or `[height, width]`",
    )
    .alias(&["kernel"])
    .at(position)
}

pub(super) const STRIDES: OptionDef = OptionDef::new(
    "strides",
    OptionType::Pair,
    OptValue::Pair([1, 1]),
    "the window's step",
)
.alias(&["stride"]);

pub(super) const PADDING: OptionDef = OptionDef::new(
    "padding",
    OptionType::Padding,
    OptValue::Padding(Padding::Valid),
    "`valid` (none) or `same` (output = input / stride, rounded up)",
);

pub(super) const DEPTH_MULTIPLIER: OptionDef = OptionDef::new(
    "depth_multiplier",
    OptionType::Positive,
    OptValue::Usize(1),
    "output channels per input channel",
)
.alias(&["multiplier"]);

/// A kernel: Glorot uniform, with a 16-bit copy in half-precision layers.
pub(super) const WEIGHT: ParamDef = ParamDef::trainable("weight", Init::GlorotUniform).gemm();
/// A bias, or a normalisation's shift β: zeros.
pub(super) const BIAS: ParamDef = ParamDef::trainable("bias", Init::Zeros);
/// A normalisation's scale γ: ones.
pub(super) const SCALE: ParamDef = ParamDef::trainable("weight", Init::Ones);

/// The options of `conv2d` and `conv2d_transpose`, in Keras's order.
pub(super) const CONV_OPTIONS: &[OptionDef] = &[
    FILTERS,
    kernel_size(1),
    STRIDES,
    PADDING,
    ACTIVATION,
    USE_BIAS,
];

/// The window of a depthwise convolution over the layer's input (`multiplier` output
/// channels per input channel), and the input in the layer's dtype.
pub(super) fn depthwise_window(
    cx: &mut LayerCx<'_, '_>,
    kernel: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    multiplier: usize,
) -> Result<(Window2d, Value), PlanError> {
    let (v, from) = cx.input(0);
    let c = v.shape.last().copied().unwrap_or(0);
    let c_out = c.saturating_mul(multiplier);
    let d = cx.window(&v, from, c_out, kernel, strides, padding, "kernel")?;
    let x = cx.cast(&v)?;
    Ok((d, x))
}

/// A layer's main op with its weight and optional bias, then its activation.
pub(super) struct Weighted {
    /// The tensor the op reads.
    pub input: usize,
    pub op: Op,
    /// The output's name when an activation follows (`out` otherwise).
    pub pre: &'static str,
    pub shape: Vec<usize>,
    pub weight: (&'static ParamDef, Vec<usize>),
    /// The bias's length, when there is one.
    pub bias: Option<usize>,
    pub activation: Activation,
}

/// Adds `w`'s output tensor, parameters and op, then its activation.
pub(super) fn weighted(cx: &mut LayerCx<'_, '_>, w: Weighted) -> Value {
    let name = if w.activation == Activation::Linear {
        "out"
    } else {
        w.pre
    };
    let y = cx.tensor(name, w.shape.clone(), cx.dtype);
    let mut params = vec![cx.param(w.weight.0, w.weight.1)];
    if let Some(n) = w.bias {
        params.push(cx.param(&BIAS, vec![n]));
    }
    cx.push(w.op, vec![w.input], vec![y], params);
    cx.activation(
        Value {
            tensor: y,
            shape: w.shape,
        },
        w.activation,
    )
}

/// The options of a square-kernel convolution: `filters` (unless depthwise), kernel and
/// strides on both axes, padding and activation (the others at their defaults).
pub(super) fn square_conv(
    filters: Option<usize>,
    kernel: usize,
    stride: usize,
    padding: Padding,
    activation: Activation,
) -> Vec<(&'static str, OptValue)> {
    let mut given = vec![
        ("kernel_size", OptValue::Pair([kernel; 2])),
        ("strides", OptValue::Pair([stride; 2])),
        ("padding", OptValue::Padding(padding)),
        ("activation", OptValue::Activation(activation)),
    ];
    given.extend(filters.map(|f| ("filters", OptValue::Usize(f))));
    given
}

/// The square-kernel shorthands of the convolution layers with filters (the zoo's and the
/// tests'): each builds its layer from its catalogue entry with a `kernel × kernel` window,
/// equal strides and bias.
macro_rules! square_conv_constructors {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        impl LayerKind {$(
            $(#[$doc])*
            pub fn $name(
                filters: usize,
                kernel: usize,
                stride: usize,
                padding: Padding,
                activation: Activation,
            ) -> Self {
                let options = square_conv(Some(filters), kernel, stride, padding, activation);
                super::$name::DEF.build_with(&options)
            }
        )*}
    };
}

square_conv_constructors! {
    /// Square-kernel conv2d with bias.
    conv2d;
    /// Square-kernel transposed conv2d with bias.
    conv2d_transpose;
    /// Square-kernel separable conv2d (depth multiplier 1) with bias.
    separable_conv2d;
}

/// The options of a square pooling window.
pub(super) fn square_pool(
    pool: usize,
    stride: usize,
    padding: Padding,
) -> [(&'static str, OptValue); 3] {
    [
        ("pool_size", OptValue::Pair([pool; 2])),
        ("strides", OptValue::Pair([stride; 2])),
        ("padding", OptValue::Padding(padding)),
    ]
}

/// Pooling options: Keras's `pool_size = 2` and strides defaulting to the pool size.
pub(super) const POOL_OPTIONS: &[OptionDef] = &[
    OptionDef::new(
        "pool_size",
        OptionType::Pair,
        OptValue::Pair([2, 2]),
        "the window: one number or `[height, width]`",
    )
    .alias(&["pool"])
    .at(0),
    OptionDef::same_as(
        "strides",
        OptionType::Pair,
        "pool_size",
        "the window's step (Keras: the pool size)",
    )
    .alias(&["stride"]),
    PADDING,
];

/// A pooling layer's window, its input in the layer's dtype, and its output `out`.
pub(super) fn pool(
    cx: &mut LayerCx<'_, '_>,
    pool: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> Result<(Window2d, usize, Value), PlanError> {
    let (v, from) = cx.input(0);
    let c = v.shape.last().copied().unwrap_or(0);
    let d = cx.window(&v, from, c, pool, strides, padding, "pool window")?;
    let x = cx.cast(&v)?;
    let shape = vec![d.n, d.out_h(), d.out_w(), c];
    let y = cx.tensor("out", shape.clone(), cx.dtype);
    Ok((d, x.tensor, Value { tensor: y, shape }))
}

/// Lowers a normalisation over the last axis: its input cast to the compute dtype, then the
/// tensors `op` writes — the output, x̂ and the per-row 1/σ (float32), made in that order
/// (the plan's tensor order) —, then `params` (each the axis's width), and the step `op(rows,
/// features)` reading the input.
pub(super) fn last_axis_norm(
    cx: &mut LayerCx<'_, '_>,
    params: &[ParamDef],
    op: impl FnOnce(usize, usize) -> Op,
) -> Result<Value, PlanError> {
    let (v, _) = cx.input(0);
    let x = cx.cast(&v)?;
    let features = *x.shape.last().unwrap_or(&1);
    let rows = prod(&x.shape) / features.max(1);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let x_hat = cx.tensor("x_hat", x.shape.clone(), cx.dtype);
    let rstd = cx.tensor("rstd", vec![rows], DType::F32);
    let ps: Vec<usize> = params.iter().map(|p| cx.param(p, vec![features])).collect();
    cx.push(op(rows, features), vec![x.tensor], vec![y, x_hat, rstd], ps);
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
