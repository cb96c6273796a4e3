//! `positional_embedding`: a learned table of one vector per position, `[seq, dim]`, added to
//! every sample's token vectors `[seq, dim]` — GPT-2's `wpe`, Keras-hub's `PositionEmbedding`
//! added to its input.
use super::prelude::*;

/// Keras's initialiser for embedding tables, uniform in ±0.05, as the `embedding` layer's
/// (Keras-hub's `PositionEmbedding` defaults to Glorot uniform, GPT-2 to N(0, 0.02)).
const TABLE: ParamDef = ParamDef::trainable("weight", Init::Uniform(0.05));

pub(super) static DEF: LayerDef = LayerDef {
    name: "positional_embedding",
    handle: "PositionalEmbedding",
    doc: "A learned position table added to token vectors.",
    inputs: Inputs::One,
    // The table's shape is the input's: nothing to choose.
    options: &[],
    params: &[TABLE],
    build: |_| LayerKind::PositionalEmbedding,
};

/// `y = x + table`, the table `[seq, dim]` shared by every sample of `x [batch, seq, dim]`.
pub(super) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
    let LayerKind::PositionalEmbedding = *kind else {
        unreachable!("positional_embedding lowers positional_embedding layers")
    };
    let (v, from) = cx.input(0);
    let dtype = cx.dtype_of(v.tensor);
    if v.shape.len() != 3 || !dtype.is_float() {
        return Err(cx
            .err(format!(
                "`positional_embedding` adds one vector per position to token vectors \
                 `[seq, dim]`, but `{from}` is {} of {} values: put an `embedding` before it",
                user_shape(&v.shape),
                dtype.name()
            ))
            .related(&[from]));
    }
    let x = cx.cast(&v)?;
    let (batch, seq, dim) = (x.shape[0], x.shape[1], x.shape[2]);
    let y = cx.tensor("out", x.shape.clone(), cx.dtype);
    let table = cx.param(&TABLE, vec![seq, dim]);
    cx.push(
        Op::PositionalEmbedding { batch, seq, dim },
        vec![x.tensor],
        vec![y],
        vec![table],
    );
    Ok(Value {
        tensor: y,
        shape: x.shape,
    })
}
