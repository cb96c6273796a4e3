//! `depthwise_conv2d`: each input channel convolved on its own into `depth_multiplier`
//! output channels, then the activation.
use super::common::{
    square_conv,
    depthwise_window, kernel_size, weighted, Weighted, ACTIVATION, BIAS, DEPTH_MULTIPLIER, PADDING, STRIDES,
    USE_BIAS, WEIGHT,
};
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "depthwise_conv2d",
    handle: "DepthwiseConv2d",
    doc: "A depthwise 2-D convolution.",
    inputs: Inputs::One,
    options: &[
        kernel_size(0),
        STRIDES,
        PADDING,
        DEPTH_MULTIPLIER,
        ACTIVATION,
        USE_BIAS,
    ],
    params: &[WEIGHT, BIAS],
    build: |o| LayerKind::DepthwiseConv2d {
        kernel: o.pair("kernel_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
        multiplier: o.positive("depth_multiplier"),
        activation: o.activation("activation"),
        use_bias: o.boolean("use_bias"),
    },
};

impl LayerKind {
    /// Square-kernel depthwise conv2d (multiplier 1) with bias.
    pub fn depthwise_conv2d(
        kernel: usize,
        stride: usize,
        padding: Padding,
        activation: Activation,
    ) -> Self {
        DEF.build_with(&square_conv(None, kernel, stride, padding, activation))
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::DepthwiseConv2d {
        kernel,
        strides,
        padding,
        multiplier,
        activation,
        use_bias,
    } = *kind
    else {
        unreachable!("depthwise_conv2d lowers depthwise_conv2d layers")
    };
    let (d, x) = depthwise_window(cx, kernel, strides, padding, multiplier)?;
    Ok(weighted(
        cx,
        Weighted {
            input: x.tensor,
            op: Op::DepthwiseConv2d {
                dims: d,
                bias: use_bias,
            },
            pre: "conv",
            shape: vec![d.n, d.out_h(), d.out_w(), d.c_out],
            weight: (&WEIGHT, vec![d.kh, d.kw, d.c_in, multiplier]),
            bias: use_bias.then_some(d.c_out),
            activation,
        },
    ))
}
