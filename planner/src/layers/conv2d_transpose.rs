//! `conv2d_transpose`: the transposed 2-D convolution (a GEMM then col2im, in chunks), with
//! Keras's output size, then its activation.
use super::common::{weighted, Weighted, BIAS, CONV_OPTIONS, WEIGHT};
use super::prelude::*;
use crate::op::transpose_out_len;

pub(super) static DEF: LayerDef = LayerDef {
    name: "conv2d_transpose",
    handle: "Conv2dTranspose",
    doc: "A transposed 2-D convolution.",
    inputs: Inputs::One,
    options: CONV_OPTIONS,
    params: &[WEIGHT, BIAS],
    build: |o| LayerKind::Conv2dTranspose {
        filters: o.positive("filters"),
        kernel: o.pair("kernel_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
        activation: o.activation("activation"),
        use_bias: o.boolean("use_bias"),
    },
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::Conv2dTranspose {
        filters,
        kernel,
        strides,
        padding,
        activation,
        use_bias,
    } = *kind
    else {
        unreachable!("conv2d_transpose lowers conv2d_transpose layers")
    };
    let (v, from) = cx.input(0);
    // Any kernel fits a transposed convolution's input: check it as `same` would.
    let d = cx.window(&v, from, filters, kernel, strides, Padding::Same, "kernel")?;
    let d = Window2d { padding, ..d };
    let x = cx.cast(&v)?;
    let (oh, ow) = (
        transpose_out_len(d.h, d.kh, d.sh, padding),
        transpose_out_len(d.w, d.kw, d.sw, padding),
    );
    let chunk = cx.conv_chunk(d.n, prod(&[d.h, d.w, d.kh, d.kw, filters]));
    Ok(weighted(
        cx,
        Weighted {
            input: x.tensor,
            op: Op::Conv2dTranspose {
                dims: d,
                bias: use_bias,
                chunk,
            },
            pre: "conv",
            shape: vec![d.n, oh, ow, filters],
            weight: (&WEIGHT, vec![d.kh, d.kw, filters, d.c_in]),
            bias: use_bias.then_some(filters),
            activation,
        },
    ))
}
