//! `avg_pool2d`: the mean over each window (with `same` padding, over the pixels inside
//! the image).
use super::common::{pool, square_pool, POOL_OPTIONS};
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "avg_pool2d",
    handle: "AvgPool2d",
    doc: "2-D average pooling.",
    inputs: Inputs::One,
    options: POOL_OPTIONS,
    params: &[],
    build: |o| LayerKind::AvgPool2d {
        pool: o.pair("pool_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
    },
};

impl LayerKind {
    /// Square-window avg_pool2d.
    pub fn avg_pool2d(pool: usize, stride: usize, padding: Padding) -> Self {
        DEF.build_with(&square_pool(pool, stride, padding))
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::AvgPool2d {
        pool: window,
        strides,
        padding,
    } = *kind
    else {
        unreachable!("avg_pool2d lowers avg_pool2d layers")
    };
    let (d, x, y) = pool(cx, window, strides, padding)?;
    cx.push(Op::AvgPool2d { dims: d }, vec![x], vec![y.tensor], vec![]);
    Ok(y)
}
