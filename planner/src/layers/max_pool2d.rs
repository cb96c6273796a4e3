//! `max_pool2d`: the maximum over each window, keeping the argmax (one byte) for the
//! backward pass.
use super::common::{pool, square_pool, POOL_OPTIONS};
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "max_pool2d",
    handle: "MaxPool2d",
    doc: "2-D max pooling.",
    inputs: Inputs::One,
    options: POOL_OPTIONS,
    params: &[],
    build: |o| LayerKind::MaxPool2d {
        pool: o.pair("pool_size"),
        strides: o.pair("strides"),
        padding: o.padding("padding"),
    },
};

impl LayerKind {
    /// Square-window max_pool2d.
    pub fn max_pool2d(pool: usize, stride: usize, padding: Padding) -> Self {
        DEF.build_with(&square_pool(pool, stride, padding))
    }
}

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::MaxPool2d {
        pool: window,
        strides,
        padding,
    } = *kind
    else {
        unreachable!("max_pool2d lowers max_pool2d layers")
    };
    let (d, x, y) = pool(cx, window, strides, padding)?;
    if d.kh.saturating_mul(d.kw) > 255 {
        return Err(cx.err(format!(
            "max_pool2d window {}×{} has more than 255 elements (its argmax is stored in one byte)",
            d.kh, d.kw
        )));
    }
    let arg = cx.tensor("argmax", y.shape.clone(), DType::U8);
    cx.push(Op::MaxPool2d { dims: d }, vec![x], vec![y.tensor, arg], vec![]);
    Ok(y)
}
