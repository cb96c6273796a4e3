//! `sample_normal`: the VAE's reparameterisation, `mean + exp(log_var / 2) · ε` with
//! `ε ~ N(0, 1)`.
use super::prelude::*;

pub(super) static DEF: LayerDef = LayerDef {
    name: "sample_normal",
    handle: "SampleNormal",
    doc: "The VAE's reparameterised sample.",
    inputs: Inputs::Fields {
        min: 2,
        max: Some(2),
        doc: "`mean`, `log_var`",
        what: "exactly two fields, `(mean, log_var)`",
        example: "#[sample_normal(z_mean, z_log_var)]",
    },
    options: &[],
    params: &[],
    build: |_| LayerKind::SampleNormal,
};

pub(super) fn lower(cx: &mut LayerCx<'_, '_>, _: &LayerKind) -> Result<Value, PlanError> {
    let (m, fm) = cx.input(0);
    let (lv, fl) = cx.input(1);
    if m.shape != lv.shape {
        return Err(cx
            .err(format!(
                "`sample_normal` needs mean and log-variance of one shape, but `{fm}` is {} and `{fl}` is {}",
                user_shape(&m.shape),
                user_shape(&lv.shape)
            ))
            .related(&[fm, fl]));
    }
    let m = cx.cast(&m)?;
    let lv = cx.cast(&lv)?;
    let elems = prod(&m.shape);
    let z = cx.tensor("out", m.shape.clone(), cx.dtype);
    cx.push(
        Op::SampleNormal {
            elems,
            key: cx.key(),
        },
        vec![m.tensor, lv.tensor],
        vec![z],
        vec![],
    );
    Ok(Value {
        tensor: z,
        shape: m.shape,
    })
}
