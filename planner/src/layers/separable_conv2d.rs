//! `separable_conv2d`: a depthwise convolution (no bias) then a 1×1 pointwise one, then
//! the activation.
use super::common::{
    depthwise_window, kernel_size, weighted, Weighted, ACTIVATION, BIAS, DEPTH_MULTIPLIER, FILTERS, PADDING,
    STRIDES, USE_BIAS,
};
use super::prelude::*;

const DEPTHWISE_WEIGHT: ParamDef =
    ParamDef::trainable("depthwise_weight", Init::GlorotUniform).gemm();
const POINTWISE_WEIGHT: ParamDef =
    ParamDef::trainable("pointwise_weight", Init::GlorotUniform).gemm();

pub(super) static DEF: LayerDef = LayerDef {
    name: "separable_conv2d",
    handle: "SeparableConv2d",
    doc: "A depthwise-separable 2-D convolution.",
    inputs: Inputs::One,
    options: &[
        FILTERS,
        kernel_size(1),
        STRIDES,
        PADDING,
        DEPTH_MULTIPLIER,
        ACTIVATION,
        USE_BIAS,
    ],
    params: &[DEPTHWISE_WEIGHT, POINTWISE_WEIGHT, BIAS],
    build: |o| LayerKind::SeparableConv2d {
        filters: o.positive("filters"),
        kernel: o.pair("kernel_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
        multiplier: o.positive("depth_multiplier"),
        activation: o.activation("activation"),
        use_bias: o.boolean("use_bias"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::SeparableConv2d {
        filters,
        kernel,
        strides,
        padding,
        multiplier,
        activation,
        use_bias,
    } = *kind
    else {
        unreachable!("separable_conv2d lowers separable_conv2d layers")
    };
    let (d, x) = depthwise_window(cx, kernel, strides, padding, multiplier)?;
    let mid = vec![d.n, d.out_h(), d.out_w(), d.c_out];
    let t = cx.tensor("depthwise", mid, cx.dtype);
    let dw = cx.param(&DEPTHWISE_WEIGHT, vec![d.kh, d.kw, d.c_in, multiplier]);
    cx.push(
        Op::DepthwiseConv2d {
            dims: d,
            bias: false,
        },
        vec![x.tensor],
        vec![t],
        vec![dw],
    );
    let pointwise = Window2d {
        n: d.n,
        h: d.out_h(),
        w: d.out_w(),
        c_in: d.c_out,
        c_out: filters,
        kh: 1,
        kw: 1,
        sh: 1,
        sw: 1,
        padding: Padding::Valid,
    };
    Ok(weighted(
        cx,
        Weighted {
            input: t,
            op: Op::Conv2d {
                dims: pointwise,
                bias: use_bias,
                chunk: d.n,
            },
            pre: "pointwise",
            shape: vec![d.n, d.out_h(), d.out_w(), filters],
            weight: (&POINTWISE_WEIGHT, vec![1, 1, d.c_out, filters]),
            bias: use_bias.then_some(filters),
            activation,
        },
    ))
}
