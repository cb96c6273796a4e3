//! `Graph`: the model lowered to ops over tensors, with every shape and dtype inferred.
//! A layer becomes one or more ops (a dense with relu is a GEMM then an activation);
//! flatten and reshape become views that own no bytes. Shape errors name the layer and
//! both shapes.

mod builder;
mod losses;

use crate::dtype::DType;
use crate::error::PlanError;
use crate::op::Op;
use crate::spec::ModelSpec;

use builder::Builder;
pub use builder::LayerCx;

pub type TensorId = usize;

/// A tensor of the forward pass (batch dimension first).
#[derive(Clone, Debug, PartialEq)]
pub struct GTensor {
    pub name: String,
    pub layer: usize,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// A model input, written by the runtime before the step.
    pub is_input: bool,
}

impl GTensor {
    pub fn elems(&self) -> usize {
        prod(&self.shape)
    }
    pub fn bytes(&self) -> u64 {
        (self.elems() as u64).saturating_mul(self.dtype.size())
    }
}

/// A persistent parameter (f32 master copy) or non-trainable statistic.
#[derive(Clone, Debug, PartialEq)]
pub struct GParam {
    pub name: String,
    pub layer: usize,
    pub shape: Vec<usize>,
    pub trainable: bool,
    /// A 16-bit copy that half-precision GEMMs read.
    pub half_copy: Option<DType>,
}

impl GParam {
    pub fn elems(&self) -> usize {
        prod(&self.shape)
    }
}

/// One forward op.
#[derive(Clone, Debug, PartialEq)]
pub struct GOp {
    pub layer: usize,
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub params: Vec<usize>,
    /// The op's backward is folded into a loss (softmax before cross-entropy, sigmoid
    /// before binary cross-entropy).
    pub fused_into_loss: bool,
}

/// A layer's output: a tensor seen with a shape (a view when it differs from the tensor's).
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub tensor: TensorId,
    pub shape: Vec<usize>,
}

/// One lowered layer.
#[derive(Clone, Debug, PartialEq)]
pub struct GLayer {
    pub name: String,
    pub kind: &'static str,
    pub output: Value,
    pub dtype: DType,
    pub checkpoint: Option<u32>,
    /// [`crate::spec::LayerSpec::recompute_output`].
    pub recompute_output: bool,
    pub ops: std::ops::Range<usize>,
}

/// One loss term: an op that reads `reads`, writes a scalar, and writes the gradient of
/// each `grad_of` tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct GLoss {
    pub op: Op,
    pub reads: Vec<TensorId>,
    pub grad_of: Vec<TensorId>,
    /// The prediction the term reads (for metrics).
    pub prediction: TensorId,
}

/// The lowered model.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Graph {
    pub tensors: Vec<GTensor>,
    pub ops: Vec<GOp>,
    pub params: Vec<GParam>,
    pub layers: Vec<GLayer>,
    pub losses: Vec<GLoss>,
    /// Raw input tensors in declaration order.
    pub inputs: Vec<TensorId>,
}

pub(crate) fn fmt_shape(s: &[usize]) -> String {
    let inner: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", inner.join(", "))
}

/// The most elements a tensor, a parameter or an op's workspace may have: 2^40 (4 TiB of
/// f32), beyond any device. Every size is checked against it as the graph is built (sizes
/// computed on the way saturate instead of overflowing), so the arithmetic on sizes in the
/// later stages — bytes, offsets, sums over every tensor — cannot overflow.
pub const MAX_ELEMS: usize = 1 << 40;

/// The product of `dims`, saturating at `usize::MAX` (then over [`MAX_ELEMS`]).
pub(crate) fn prod(dims: &[usize]) -> usize {
    dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// Shape without the batch dimension, as the user wrote it.
pub(crate) fn user_shape(s: &[usize]) -> String {
    fmt_shape(&s[1.min(s.len())..])
}

impl Graph {
    /// Lowers `spec` to ops, inferring every shape and dtype.
    pub fn build(spec: &ModelSpec) -> Result<Graph, PlanError> {
        Graph::build_mode(spec, true)
    }

    /// The inference graph: batch norm from its running statistics, no dropout.
    pub fn build_inference(spec: &ModelSpec) -> Result<Graph, PlanError> {
        Graph::build_mode(spec, false)
    }

    fn build_mode(spec: &ModelSpec, training: bool) -> Result<Graph, PlanError> {
        if spec.batch == 0 {
            return Err(PlanError::model("batch must be at least 1"));
        }
        if spec.layers.is_empty() {
            return Err(PlanError::model("the model has no layers"));
        }
        let mut b = Builder::new(spec, training);
        for (i, l) in spec.layers.iter().enumerate() {
            if b.by_name.contains_key(l.name.as_str()) {
                return Err(PlanError::at(
                    &l.name,
                    format!("two layers are named `{}`", l.name),
                ));
            }
            let ops_before = b.g.ops.len();
            b.layer(i)?;
            if let Some(e) = b.oversize.take() {
                return Err(e);
            }
            for o in &b.g.ops[ops_before..] {
                let ws = o.op.workspace_elems(false).max(o.op.workspace_elems(true));
                if ws > MAX_ELEMS {
                    return Err(PlanError::at(
                        &l.name,
                        format!(
                            "its {} would need a workspace of more than 2^40 elements, the most \
                             the planner accepts: reduce the batch or the layer's sizes",
                            o.op.name()
                        ),
                    ));
                }
            }
            b.by_name.insert(l.name.as_str(), i);
        }
        b.losses()?;
        if let Some(e) = b.oversize.take() {
            return Err(e);
        }
        Ok(b.g)
    }

    /// Total parameter count (trainable and not).
    pub fn param_count(&self) -> u64 {
        self.params.iter().map(|p| p.elems() as u64).sum()
    }

    pub fn trainable_count(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.elems() as u64)
            .sum()
    }
}
