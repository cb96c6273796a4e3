//! The graph under construction, and [`LayerCx`]: what a layer's lowering (in
//! [`crate::layers`]) uses to add its tensors, parameters and ops.

use std::collections::HashMap;

use super::{fmt_shape, prod, user_shape, GLayer, GOp, GParam, GTensor, Graph, TensorId, Value};
use crate::dtype::DType;
use crate::error::PlanError;
use crate::layers::{self, Inputs, ParamDef};
use crate::op::{out_len, Op, Window2d, IM2COL_CAP_BYTES};
use crate::spec::{Activation, LayerKind, ModelSpec, Padding};

pub(super) struct Builder<'a> {
    pub(super) spec: &'a ModelSpec,
    pub(super) g: Graph,
    pub(super) by_name: HashMap<&'a str, usize>,
    /// Which layers read each layer (to find the unconsumed input for a default loss target).
    pub(super) consumed: Vec<bool>,
    /// Training graph (batch statistics, dropout) or inference graph (running statistics,
    /// no dropout).
    training: bool,
    /// The first tensor or parameter over [`super::MAX_ELEMS`], reported when its layer is
    /// done.
    pub(super) oversize: Option<PlanError>,
}

impl<'a> Builder<'a> {
    pub(super) fn new(spec: &'a ModelSpec, training: bool) -> Self {
        Builder {
            spec,
            g: Graph::default(),
            by_name: HashMap::new(),
            consumed: vec![false; spec.layers.len()],
            training,
            oversize: None,
        }
    }

    /// Notes `shape` as the layer's error when it has more than [`super::MAX_ELEMS`]
    /// elements, not counting zero dimensions (so that no product of its dimensions, in any
    /// order, can overflow later).
    fn check_size(&mut self, layer: usize, what: &str, shape: &[usize]) {
        let nonzero = shape
            .iter()
            .filter(|&&d| d != 0)
            .fold(1usize, |a, &d| a.saturating_mul(d));
        if self.oversize.is_none() && nonzero > super::MAX_ELEMS {
            self.oversize = Some(PlanError::at(
                &self.spec.layers[layer].name,
                format!(
                    "its {what} {} would have more than 2^40 elements (4 TiB of f32), the most \
                     the planner accepts: reduce the batch or the layer's sizes",
                    fmt_shape(shape)
                ),
            ));
        }
    }

    fn tensor(&mut self, layer: usize, suffix: &str, shape: Vec<usize>, dtype: DType) -> TensorId {
        self.check_size(layer, &format!("tensor `{suffix}`"), &shape);
        let name = format!("{}.{}", self.spec.layers[layer].name, suffix);
        self.g.tensors.push(GTensor {
            name,
            layer,
            shape,
            dtype,
            is_input: false,
        });
        self.g.tensors.len() - 1
    }

    fn push(
        &mut self,
        layer: usize,
        op: Op,
        inputs: Vec<TensorId>,
        outputs: Vec<TensorId>,
        params: Vec<usize>,
    ) {
        self.g.ops.push(GOp {
            layer,
            op,
            inputs,
            outputs,
            params,
            fused_into_loss: false,
        });
    }

    fn name(&self, layer: usize) -> &'a str {
        &self.spec.layers[layer].name
    }

    /// `v` in dtype `dt`, inserting a cast op owned by `layer` when needed.
    pub(super) fn cast_to(
        &mut self,
        layer: usize,
        v: &Value,
        dt: DType,
    ) -> Result<Value, PlanError> {
        let have = self.g.tensors[v.tensor].dtype;
        if have == dt {
            return Ok(v.clone());
        }
        if !have.is_float() {
            let src = &self.g.tensors[v.tensor].name;
            return Err(PlanError::at(
                self.name(layer),
                format!(
                    "`{}` expects a floating-point input, but `{src}` holds {} values",
                    self.spec.layers[layer].kind.name(),
                    have.name()
                ),
            ));
        }
        let shape = self.g.tensors[v.tensor].shape.clone();
        let elems = prod(&shape);
        let out = self.tensor(layer, &format!("cast_{}", dt.name()), shape, dt);
        self.push(layer, Op::Cast { elems }, vec![v.tensor], vec![out], vec![]);
        Ok(Value {
            tensor: out,
            shape: v.shape.clone(),
        })
    }

    /// The layer's inputs: the fields it names, or the field above it.
    fn resolve_inputs(&mut self, i: usize) -> Result<Vec<(Value, &'a str)>, PlanError> {
        let spec = self.spec;
        let ls = &spec.layers[i];
        let name = ls.name.as_str();
        let mut ins: Vec<(Value, &str)> = Vec::new();
        if ls.kind.def().inputs == Inputs::None {
            return Ok(ins);
        }
        if ls.inputs.is_empty() {
            if i == 0 {
                return Err(PlanError::at(
                    name,
                    "the first layer has no input: declare an `#[input(..)]` field first",
                ));
            }
            let prev = i - 1;
            ins.push((self.g.layers[prev].output.clone(), self.name(prev)));
            self.consumed[prev] = true;
            return Ok(ins);
        }
        for src in &ls.inputs {
            let Some(&j) = self.by_name.get(src.as_str()) else {
                let later = spec.layers.iter().skip(i).any(|l| &l.name == src);
                let msg = if later {
                    format!("reads `{src}`, which is declared after it; a layer can only read fields above it")
                } else {
                    format!("reads `{src}`, but the model has no field of that name")
                };
                return Err(PlanError::at(name, msg));
            };
            ins.push((
                self.g.layers[j].output.clone(),
                spec.layers[j].name.as_str(),
            ));
            self.consumed[j] = true;
        }
        Ok(ins)
    }

    /// Lowers layer `i`: resolves its inputs, checks their count against its catalogue
    /// entry, lets the entry's lowering add its ops, and records the lowered layer.
    pub(super) fn layer(&mut self, i: usize) -> Result<(), PlanError> {
        let spec = self.spec;
        let ls = &spec.layers[i];
        let ops_start = self.g.ops.len();
        let inputs = self.resolve_inputs(i)?;
        check_arity(ls.name.as_str(), &ls.kind, inputs.len())?;
        let mut cx = LayerCx {
            b: self,
            index: i,
            name: ls.name.as_str(),
            dtype: ls.dtype.unwrap_or(spec.precision.compute_dtype()),
            explicit_dtype: ls.dtype.is_some(),
            inputs,
        };
        let output = layers::lower(&mut cx, &ls.kind)?;
        self.finish_layer(i, ops_start, output);
        Ok(())
    }

    /// Names the layer's output and records the lowered layer.
    fn finish_layer(&mut self, i: usize, ops_start: usize, output: Value) {
        let ls = &self.spec.layers[i];
        let name = ls.name.as_str();
        // Name the layer's final tensor `<layer>.out` unless it is a view or an input.
        let ops_end = self.g.ops.len();
        if ops_end > ops_start {
            let t = &mut self.g.tensors[output.tensor];
            if t.layer == i
                && !t.is_input
                && !t.name.ends_with(".out")
                && !t.name.ends_with(".scaled")
            {
                t.name = format!("{name}.out");
            }
        }
        let dtype = self.g.tensors[output.tensor].dtype;
        self.g.layers.push(GLayer {
            name: name.to_string(),
            kind: ls.kind.name(),
            output,
            dtype,
            checkpoint: ls.checkpoint,
            recompute_output: ls.recompute_output && ls.can_recompute_output(),
            ops: ops_start..ops_end,
        });
    }
}

/// The number of inputs the layer's catalogue entry takes.
fn check_arity(name: &str, kind: &LayerKind, given: usize) -> Result<(), PlanError> {
    let exact = |want: usize| {
        PlanError::at(
            name,
            format!(
                "`{}` takes {want} input(s), but {given} were given",
                kind.name()
            ),
        )
    };
    match kind.def().inputs {
        Inputs::None => Ok(()),
        Inputs::One if given != 1 => Err(exact(1)),
        Inputs::One => Ok(()),
        Inputs::Fields { min, max, .. } if max == Some(min) && given != min => Err(exact(min)),
        Inputs::Fields { min, .. } if given < min => Err(PlanError::at(
            name,
            format!(
                "`{}` needs at least {} inputs, got {given}",
                kind.name(),
                number(min)
            ),
        )),
        Inputs::Fields { max: Some(max), .. } if given > max => Err(exact(max)),
        Inputs::Fields { .. } => Ok(()),
    }
}

fn number(n: usize) -> String {
    match n {
        2 => "two".to_string(),
        3 => "three".to_string(),
        n => n.to_string(),
    }
}

/// One layer being lowered: its name, dtype and inputs, and the methods that add its
/// tensors (named `<layer>.<suffix>`), parameters (`<layer>.<param suffix>`) and ops. An
/// op's inputs and outputs are pushed in the order its `Op` variant documents.
pub struct LayerCx<'b, 'a> {
    b: &'b mut Builder<'a>,
    index: usize,
    /// The layer's name (its field).
    pub name: &'a str,
    /// The dtype it computes in: its `#[fp16]`-style override, else the model's compute
    /// dtype.
    pub dtype: DType,
    /// Whether the dtype was asked for on the layer (softmax then stays in it).
    pub explicit_dtype: bool,
    inputs: Vec<(Value, &'a str)>,
}

impl<'a> LayerCx<'_, 'a> {
    /// The model being built.
    pub fn spec(&self) -> &'a ModelSpec {
        self.b.spec
    }

    /// Input `k` and the name of the layer that makes it (its count is already checked).
    pub fn input(&self, k: usize) -> (Value, &'a str) {
        self.inputs[k].clone()
    }

    /// Every input, with the name of the layer that makes it.
    pub fn inputs(&self) -> Vec<(Value, &'a str)> {
        self.inputs.clone()
    }

    /// The model's batch size.
    pub fn batch(&self) -> usize {
        self.b.spec.batch
    }

    /// A training graph (batch statistics, dropout) rather than an inference one.
    pub fn training(&self) -> bool {
        self.b.training
    }

    /// The seed key of the layer's random ops (dropout masks, samples).
    pub fn key(&self) -> u32 {
        self.index as u32
    }

    /// The dtype tensor `t` is stored in.
    pub fn dtype_of(&self, t: TensorId) -> DType {
        self.b.g.tensors[t].dtype
    }

    /// An error about this layer.
    pub fn err(&self, message: impl Into<String>) -> PlanError {
        PlanError::at(self.name, message)
    }

    /// A new tensor `<layer>.<suffix>`.
    pub fn tensor(&mut self, suffix: &str, shape: Vec<usize>, dtype: DType) -> TensorId {
        self.b.tensor(self.index, suffix, shape, dtype)
    }

    /// Renames tensor `t` to `<layer>.<suffix>`.
    pub fn rename(&mut self, t: TensorId, suffix: &str) {
        self.b.g.tensors[t].name = format!("{}.{suffix}", self.name);
    }

    /// A model input of `shape` (batch first), written by the runtime before the step.
    pub fn model_input(&mut self, shape: Vec<usize>, dtype: DType) -> TensorId {
        self.b.check_size(self.index, "input", &shape);
        self.b.g.tensors.push(GTensor {
            name: self.name.to_string(),
            layer: self.index,
            shape,
            dtype,
            is_input: true,
        });
        let t = self.b.g.tensors.len() - 1;
        self.b.g.inputs.push(t);
        t
    }

    /// The parameter `def` (one of the layer's catalogue entry's) with `shape`.
    pub fn param(&mut self, def: &ParamDef, shape: Vec<usize>) -> usize {
        let layer = self.index;
        self.b
            .check_size(layer, &format!("parameter `{}`", def.suffix), &shape);
        let half_copy = (def.gemm && self.dtype.is_half()).then_some(self.dtype);
        self.b.g.params.push(GParam {
            name: format!("{}.{}", self.name, def.suffix),
            layer,
            shape,
            trainable: def.trainable,
            half_copy,
        });
        self.b.g.params.len() - 1
    }

    /// Adds `op` reading `inputs` and writing `outputs`, in the order its variant documents.
    pub fn push(
        &mut self,
        op: Op,
        inputs: Vec<TensorId>,
        outputs: Vec<TensorId>,
        params: Vec<usize>,
    ) {
        self.b.push(self.index, op, inputs, outputs, params);
    }

    /// `v` in the layer's dtype (a cast op when it is not).
    pub fn cast(&mut self, v: &Value) -> Result<Value, PlanError> {
        self.b.cast_to(self.index, v, self.dtype)
    }

    /// `act` applied to `v` (nothing for linear).
    pub fn activation(&mut self, v: Value, act: Activation) -> Value {
        if act == Activation::Linear {
            return v;
        }
        let in_dt = self.dtype_of(v.tensor);
        // Softmax stays f32 under a mixed policy (as Keras and PyTorch autocast do), unless
        // the layer asked for a precision explicitly.
        let out_dt = if act == Activation::Softmax && !self.explicit_dtype {
            DType::F32
        } else {
            in_dt
        };
        let cols = *v.shape.last().unwrap_or(&1);
        let elems = prod(&v.shape);
        let out = self.tensor(act.name(), v.shape.clone(), out_dt);
        self.push(
            Op::Activation { act, elems, cols },
            vec![v.tensor],
            vec![out],
            vec![],
        );
        Value {
            tensor: out,
            shape: v.shape,
        }
    }

    /// `v`'s `[batch, height, width, channels]`, or an error naming `from`.
    pub fn rank4(&self, v: &Value, from: &str) -> Result<(usize, usize, usize, usize), PlanError> {
        if v.shape.len() != 4 {
            return Err(self
                .err(format!(
                    "`{}` expects a [height, width, channels] input, but `{from}` gives {}",
                    self.b.spec.layers[self.index].kind.name(),
                    user_shape(&v.shape)
                ))
                .related(&[from]));
        }
        Ok((v.shape[0], v.shape[1], v.shape[2], v.shape[3]))
    }

    /// The window of a convolution or pooling over `v` with `c_out` output channels;
    /// `what` names the window in errors ("kernel", "pool window").
    #[allow(clippy::too_many_arguments)]
    pub fn window(
        &self,
        v: &Value,
        from: &str,
        c_out: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        what: &str,
    ) -> Result<Window2d, PlanError> {
        let (n, h, w, c) = self.rank4(v, from)?;
        if kernel[0] == 0 || kernel[1] == 0 || strides[0] == 0 || strides[1] == 0 {
            return Err(self.err(format!("{what} and strides must be at least 1")));
        }
        if padding == Padding::Valid && (kernel[0] > h || kernel[1] > w) {
            return Err(self
                .err(format!(
                    "{what} {}×{} is larger than its {h}×{w} input from `{from}` (padding = valid)",
                    kernel[0], kernel[1]
                ))
                .related(&[from]));
        }
        let d = Window2d {
            n,
            h,
            w,
            c_in: c,
            c_out,
            kh: kernel[0],
            kw: kernel[1],
            sh: strides[0],
            sw: strides[1],
            padding,
        };
        debug_assert!(out_len(h, d.kh, d.sh, padding) > 0);
        Ok(d)
    }

    /// How many samples one im2col chunk holds, `per_sample_elems` columns each.
    pub fn conv_chunk(&self, n: usize, per_sample_elems: usize) -> usize {
        let per_sample = (per_sample_elems as u64)
            .saturating_mul(self.dtype.size())
            .max(1);
        ((IM2COL_CAP_BYTES / per_sample) as usize).clamp(1, n.max(1))
    }
}
