//! `conv2d`: a 2-D convolution over NHWC images (im2col in chunks, then a GEMM), then its
//! activation.
use super::common::{weighted, Weighted, BIAS, CONV_OPTIONS, WEIGHT};
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "conv2d",
    handle: "Conv2d",
    doc: "A 2-D convolution.",
    inputs: Inputs::One,
    options: CONV_OPTIONS,
    params: &[WEIGHT, BIAS],
    build: |o| LayerKind::Conv2d {
        filters: o.positive("filters"),
        kernel: o.pair("kernel_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
        activation: o.activation("activation"),
        use_bias: o.boolean("use_bias"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Conv2d {
        filters,
        kernel,
        strides,
        padding,
        activation,
        use_bias,
    } = *kind
    else {
        unreachable!("conv2d lowers conv2d layers")
    };
    let (v, from) = cx.input(0);
    let d = cx.window(&v, from, filters, kernel, strides, padding, "kernel")?;
    if filters == 0 {
        return Err(cx.err("conv2d filters must be at least 1"));
    }
    let x = cx.cast(&v)?;
    let per_sample = prod(&[d.out_h(), d.out_w(), d.kh, d.kw, d.c_in]);
    let chunk = cx.conv_chunk(d.n, per_sample);
    Ok(weighted(
        cx,
        Weighted {
            input: x.tensor,
            op: Op::Conv2d {
                dims: d,
                bias: use_bias,
                chunk,
            },
            pre: "conv",
            shape: vec![d.n, d.out_h(), d.out_w(), filters],
            weight: (&WEIGHT, vec![d.kh, d.kw, d.c_in, filters]),
            bias: use_bias.then_some(filters),
            activation,
        },
    ))
}
