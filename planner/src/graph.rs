//! `Graph`: the model lowered to ops over tensors, with every shape and dtype inferred.
//! A layer becomes one or more ops (a dense with relu is a GEMM then an activation);
//! flatten and reshape become views that own no bytes. Shape errors name the layer and
//! both shapes.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::PlanError;
use crate::op::{out_len, transpose_out_len, Op, Window2d, IM2COL_CAP_BYTES};
use crate::spec::{Activation, LayerKind, LossKind, ModelSpec, Padding};

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

fn fmt_shape(s: &[usize]) -> String {
    let inner: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", inner.join(", "))
}

/// The most elements a tensor, a parameter or an op's workspace may have: 2^40 (4 TiB of
/// f32), beyond any device. Every size is checked against it as the graph is built (sizes
/// computed on the way saturate instead of overflowing), so the arithmetic on sizes in the
/// later stages — bytes, offsets, sums over every tensor — cannot overflow.
pub const MAX_ELEMS: usize = 1 << 40;

/// The product of `dims`, saturating at `usize::MAX` (then over [`MAX_ELEMS`]).
fn prod(dims: &[usize]) -> usize {
    dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// Shape without the batch dimension, as the user wrote it.
fn user_shape(s: &[usize]) -> String {
    fmt_shape(&s[1.min(s.len())..])
}

struct Builder<'a> {
    spec: &'a ModelSpec,
    g: Graph,
    by_name: HashMap<&'a str, usize>,
    /// Which layers read each layer (to find the unconsumed input for a default loss target).
    consumed: Vec<bool>,
    /// Training graph (batch statistics, dropout) or inference graph (running statistics,
    /// no dropout).
    training: bool,
    /// The first tensor or parameter over [`MAX_ELEMS`], reported when its layer is done.
    oversize: Option<PlanError>,
}

impl<'a> Builder<'a> {
    /// Notes `shape` as the layer's error when it has more than [`MAX_ELEMS`] elements, not
    /// counting zero dimensions (so that no product of its dimensions, in any order, can
    /// overflow later).
    fn check_size(&mut self, layer: usize, what: &str, shape: &[usize]) {
        let nonzero = shape
            .iter()
            .filter(|&&d| d != 0)
            .fold(1usize, |a, &d| a.saturating_mul(d));
        if self.oversize.is_none() && nonzero > MAX_ELEMS {
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

    fn param(
        &mut self,
        layer: usize,
        suffix: &str,
        shape: Vec<usize>,
        trainable: bool,
        half: Option<DType>,
    ) -> usize {
        self.check_size(layer, &format!("parameter `{suffix}`"), &shape);
        let name = format!("{}.{}", self.spec.layers[layer].name, suffix);
        self.g.params.push(GParam {
            name,
            layer,
            shape,
            trainable,
            half_copy: half,
        });
        self.g.params.len() - 1
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
    fn cast_to(&mut self, layer: usize, v: &Value, dt: DType) -> Result<Value, PlanError> {
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

    fn activation(
        &mut self,
        layer: usize,
        v: Value,
        act: Activation,
        explicit_dtype: bool,
    ) -> Value {
        if act == Activation::Linear {
            return v;
        }
        let in_dt = self.g.tensors[v.tensor].dtype;
        // Softmax stays f32 under a mixed policy (as Keras and PyTorch autocast do), unless
        // the layer asked for a precision explicitly.
        let out_dt = if act == Activation::Softmax && !explicit_dtype {
            DType::F32
        } else {
            in_dt
        };
        let cols = *v.shape.last().unwrap_or(&1);
        let elems = prod(&v.shape);
        let out = self.tensor(layer, act.name(), v.shape.clone(), out_dt);
        self.push(
            layer,
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

    fn rank4(
        &self,
        layer: usize,
        v: &Value,
        from: &str,
    ) -> Result<(usize, usize, usize, usize), PlanError> {
        if v.shape.len() != 4 {
            return Err(PlanError::at(
                self.name(layer),
                format!(
                    "`{}` expects a [height, width, channels] input, but `{from}` gives {}",
                    self.spec.layers[layer].kind.name(),
                    user_shape(&v.shape)
                ),
            )
            .related(&[from]));
        }
        Ok((v.shape[0], v.shape[1], v.shape[2], v.shape[3]))
    }

    #[allow(clippy::too_many_arguments)]
    fn window(
        &self,
        layer: usize,
        v: &Value,
        from: &str,
        c_out: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        what: &str,
    ) -> Result<Window2d, PlanError> {
        let (n, h, w, c) = self.rank4(layer, v, from)?;
        if kernel[0] == 0 || kernel[1] == 0 || strides[0] == 0 || strides[1] == 0 {
            return Err(PlanError::at(
                self.name(layer),
                format!("{what} and strides must be at least 1"),
            ));
        }
        if padding == Padding::Valid && (kernel[0] > h || kernel[1] > w) {
            return Err(PlanError::at(
                self.name(layer),
                format!(
                    "{what} {}×{} is larger than its {h}×{w} input from `{from}` (padding = valid)",
                    kernel[0], kernel[1]
                ),
            )
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

    fn conv_chunk(&self, n: usize, per_sample_elems: usize, dt: DType) -> usize {
        let per_sample = (per_sample_elems as u64).saturating_mul(dt.size()).max(1);
        ((IM2COL_CAP_BYTES / per_sample) as usize).clamp(1, n.max(1))
    }

    fn half(dt: DType) -> Option<DType> {
        dt.is_half().then_some(dt)
    }

    fn layer(&mut self, i: usize) -> Result<(), PlanError> {
        let spec = self.spec;
        let ls = &spec.layers[i];
        let name = ls.name.as_str();
        let dt = ls.dtype.unwrap_or(spec.precision.compute_dtype());
        let explicit = ls.dtype.is_some();
        let batch = spec.batch;
        let ops_start = self.g.ops.len();

        // Resolve inputs.
        let mut ins: Vec<(Value, &str)> = Vec::new();
        if !matches!(ls.kind, LayerKind::Input { .. }) {
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
            } else {
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
            }
        }
        let arity = |want: usize| -> Result<(), PlanError> {
            if ins.len() != want {
                Err(PlanError::at(
                    name,
                    format!(
                        "`{}` takes {want} input(s), but {} were given",
                        ls.kind.name(),
                        ins.len()
                    ),
                ))
            } else {
                Ok(())
            }
        };

        let output: Value = match &ls.kind {
            LayerKind::Input {
                shape,
                dtype,
                scale,
            } => {
                if shape.contains(&0) {
                    return Err(PlanError::at(
                        name,
                        format!("input shape {} has a zero dimension", fmt_shape(shape)),
                    ));
                }
                let mut full = vec![batch];
                full.extend_from_slice(shape);
                self.check_size(i, "input", &full);
                self.g.tensors.push(GTensor {
                    name: name.to_string(),
                    layer: i,
                    shape: full.clone(),
                    dtype: *dtype,
                    is_input: true,
                });
                let raw = self.g.tensors.len() - 1;
                self.g.inputs.push(raw);
                if *dtype == DType::U8 {
                    let elems = prod(&full);
                    let out = self.tensor(i, "scaled", full.clone(), dt);
                    self.push(
                        i,
                        Op::InputCast {
                            elems,
                            scale: *scale,
                        },
                        vec![raw],
                        vec![out],
                        vec![],
                    );
                    Value {
                        tensor: out,
                        shape: full,
                    }
                } else {
                    Value {
                        tensor: raw,
                        shape: full,
                    }
                }
            }
            LayerKind::Dense {
                units,
                activation,
                use_bias,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                if v.shape.len() < 2 {
                    return Err(PlanError::at(
                        name,
                        format!(
                            "dense needs features, but `{from}` gives {}",
                            user_shape(&v.shape)
                        ),
                    ));
                }
                if *units == 0 {
                    return Err(PlanError::at(name, "dense units must be at least 1"));
                }
                let x = self.cast_to(i, v, dt)?;
                let in_f = *x.shape.last().unwrap_or(&1);
                let rows = prod(&x.shape) / in_f.max(1);
                let mut oshape = x.shape.clone();
                *oshape.last_mut().expect("rank >= 2") = *units;
                let suffix = if *activation == Activation::Linear {
                    "out"
                } else {
                    "linear"
                };
                let y = self.tensor(i, suffix, oshape.clone(), dt);
                let mut ps =
                    vec![self.param(i, "weight", vec![in_f, *units], true, Self::half(dt))];
                if *use_bias {
                    ps.push(self.param(i, "bias", vec![*units], true, None));
                }
                self.push(
                    i,
                    Op::Dense {
                        rows,
                        in_features: in_f,
                        units: *units,
                        bias: *use_bias,
                    },
                    vec![x.tensor],
                    vec![y],
                    ps,
                );
                self.activation(
                    i,
                    Value {
                        tensor: y,
                        shape: oshape,
                    },
                    *activation,
                    explicit,
                )
            }
            LayerKind::Conv2d {
                filters,
                kernel,
                strides,
                padding,
                activation,
                use_bias,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let d = self.window(i, v, from, *filters, *kernel, *strides, *padding, "kernel")?;
                if *filters == 0 {
                    return Err(PlanError::at(name, "conv2d filters must be at least 1"));
                }
                let x = self.cast_to(i, v, dt)?;
                let per_sample = prod(&[d.out_h(), d.out_w(), d.kh, d.kw, d.c_in]);
                let chunk = self.conv_chunk(d.n, per_sample, dt);
                let oshape = vec![d.n, d.out_h(), d.out_w(), *filters];
                let y = self.tensor(
                    i,
                    if *activation == Activation::Linear {
                        "out"
                    } else {
                        "conv"
                    },
                    oshape.clone(),
                    dt,
                );
                let mut ps = vec![self.param(
                    i,
                    "weight",
                    vec![d.kh, d.kw, d.c_in, *filters],
                    true,
                    Self::half(dt),
                )];
                if *use_bias {
                    ps.push(self.param(i, "bias", vec![*filters], true, None));
                }
                self.push(
                    i,
                    Op::Conv2d {
                        dims: d,
                        bias: *use_bias,
                        chunk,
                    },
                    vec![x.tensor],
                    vec![y],
                    ps,
                );
                self.activation(
                    i,
                    Value {
                        tensor: y,
                        shape: oshape,
                    },
                    *activation,
                    explicit,
                )
            }
            LayerKind::DepthwiseConv2d {
                kernel,
                strides,
                padding,
                multiplier,
                activation,
                use_bias,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let c = v.shape.last().copied().unwrap_or(0);
                let d = self.window(
                    i,
                    v,
                    from,
                    c.saturating_mul(*multiplier),
                    *kernel,
                    *strides,
                    *padding,
                    "kernel",
                )?;
                let x = self.cast_to(i, v, dt)?;
                let oshape = vec![d.n, d.out_h(), d.out_w(), d.c_out];
                let y = self.tensor(
                    i,
                    if *activation == Activation::Linear {
                        "out"
                    } else {
                        "conv"
                    },
                    oshape.clone(),
                    dt,
                );
                let mut ps = vec![self.param(
                    i,
                    "weight",
                    vec![d.kh, d.kw, d.c_in, *multiplier],
                    true,
                    Self::half(dt),
                )];
                if *use_bias {
                    ps.push(self.param(i, "bias", vec![d.c_out], true, None));
                }
                self.push(
                    i,
                    Op::DepthwiseConv2d {
                        dims: d,
                        bias: *use_bias,
                    },
                    vec![x.tensor],
                    vec![y],
                    ps,
                );
                self.activation(
                    i,
                    Value {
                        tensor: y,
                        shape: oshape,
                    },
                    *activation,
                    explicit,
                )
            }
            LayerKind::SeparableConv2d {
                filters,
                kernel,
                strides,
                padding,
                multiplier,
                activation,
                use_bias,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let c = v.shape.last().copied().unwrap_or(0);
                let d = self.window(
                    i,
                    v,
                    from,
                    c.saturating_mul(*multiplier),
                    *kernel,
                    *strides,
                    *padding,
                    "kernel",
                )?;
                let x = self.cast_to(i, v, dt)?;
                let mid = vec![d.n, d.out_h(), d.out_w(), d.c_out];
                let t = self.tensor(i, "depthwise", mid.clone(), dt);
                let dw = self.param(
                    i,
                    "depthwise_weight",
                    vec![d.kh, d.kw, d.c_in, *multiplier],
                    true,
                    Self::half(dt),
                );
                self.push(
                    i,
                    Op::DepthwiseConv2d {
                        dims: d,
                        bias: false,
                    },
                    vec![x.tensor],
                    vec![t],
                    vec![dw],
                );
                let pd = Window2d {
                    n: d.n,
                    h: d.out_h(),
                    w: d.out_w(),
                    c_in: d.c_out,
                    c_out: *filters,
                    kh: 1,
                    kw: 1,
                    sh: 1,
                    sw: 1,
                    padding: Padding::Valid,
                };
                let oshape = vec![d.n, d.out_h(), d.out_w(), *filters];
                let y = self.tensor(
                    i,
                    if *activation == Activation::Linear {
                        "out"
                    } else {
                        "pointwise"
                    },
                    oshape.clone(),
                    dt,
                );
                let mut ps = vec![self.param(
                    i,
                    "pointwise_weight",
                    vec![1, 1, d.c_out, *filters],
                    true,
                    Self::half(dt),
                )];
                if *use_bias {
                    ps.push(self.param(i, "bias", vec![*filters], true, None));
                }
                self.push(
                    i,
                    Op::Conv2d {
                        dims: pd,
                        bias: *use_bias,
                        chunk: d.n,
                    },
                    vec![t],
                    vec![y],
                    ps,
                );
                self.activation(
                    i,
                    Value {
                        tensor: y,
                        shape: oshape,
                    },
                    *activation,
                    explicit,
                )
            }
            LayerKind::Conv2dTranspose {
                filters,
                kernel,
                strides,
                padding,
                activation,
                use_bias,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let d = self.window(
                    i,
                    v,
                    from,
                    *filters,
                    *kernel,
                    *strides,
                    Padding::Same,
                    "kernel",
                )?;
                let d = Window2d {
                    padding: *padding,
                    ..d
                };
                let x = self.cast_to(i, v, dt)?;
                let (oh, ow) = (
                    transpose_out_len(d.h, d.kh, d.sh, *padding),
                    transpose_out_len(d.w, d.kw, d.sw, *padding),
                );
                let chunk = self.conv_chunk(d.n, prod(&[d.h, d.w, d.kh, d.kw, *filters]), dt);
                let oshape = vec![d.n, oh, ow, *filters];
                let y = self.tensor(
                    i,
                    if *activation == Activation::Linear {
                        "out"
                    } else {
                        "conv"
                    },
                    oshape.clone(),
                    dt,
                );
                let mut ps = vec![self.param(
                    i,
                    "weight",
                    vec![d.kh, d.kw, *filters, d.c_in],
                    true,
                    Self::half(dt),
                )];
                if *use_bias {
                    ps.push(self.param(i, "bias", vec![*filters], true, None));
                }
                self.push(
                    i,
                    Op::Conv2dTranspose {
                        dims: d,
                        bias: *use_bias,
                        chunk,
                    },
                    vec![x.tensor],
                    vec![y],
                    ps,
                );
                self.activation(
                    i,
                    Value {
                        tensor: y,
                        shape: oshape,
                    },
                    *activation,
                    explicit,
                )
            }
            LayerKind::MaxPool2d {
                pool,
                strides,
                padding,
            }
            | LayerKind::AvgPool2d {
                pool,
                strides,
                padding,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let c = v.shape.last().copied().unwrap_or(0);
                let d = self.window(i, v, from, c, *pool, *strides, *padding, "pool window")?;
                let x = self.cast_to(i, v, dt)?;
                let oshape = vec![d.n, d.out_h(), d.out_w(), c];
                let y = self.tensor(i, "out", oshape.clone(), dt);
                if matches!(ls.kind, LayerKind::MaxPool2d { .. }) {
                    if d.kh.saturating_mul(d.kw) > 255 {
                        return Err(PlanError::at(name, format!("max_pool2d window {}×{} has more than 255 elements (its argmax is stored in one byte)", d.kh, d.kw)));
                    }
                    let arg = self.tensor(i, "argmax", oshape.clone(), DType::U8);
                    self.push(
                        i,
                        Op::MaxPool2d { dims: d },
                        vec![x.tensor],
                        vec![y, arg],
                        vec![],
                    );
                } else {
                    self.push(
                        i,
                        Op::AvgPool2d { dims: d },
                        vec![x.tensor],
                        vec![y],
                        vec![],
                    );
                }
                Value {
                    tensor: y,
                    shape: oshape,
                }
            }
            LayerKind::GlobalAvgPool => {
                arity(1)?;
                let (v, from) = &ins[0];
                let (n, h, w, c) = self.rank4(i, v, from)?;
                let x = self.cast_to(i, v, dt)?;
                let y = self.tensor(i, "out", vec![n, c], dt);
                self.push(
                    i,
                    Op::GlobalAvgPool { n, hw: h * w, c },
                    vec![x.tensor],
                    vec![y],
                    vec![],
                );
                Value {
                    tensor: y,
                    shape: vec![n, c],
                }
            }
            LayerKind::BatchNorm { momentum, epsilon } => {
                arity(1)?;
                let (v, _) = &ins[0];
                let x = self.cast_to(i, v, dt)?;
                let c = *x.shape.last().unwrap_or(&1);
                let rows = prod(&x.shape) / c.max(1);
                let y = self.tensor(i, "out", x.shape.clone(), dt);
                let ps = vec![
                    self.param(i, "weight", vec![c], true, None),
                    self.param(i, "bias", vec![c], true, None),
                    self.param(i, "running_mean", vec![c], false, None),
                    self.param(i, "running_var", vec![c], false, None),
                ];
                if !self.training {
                    let op = Op::BatchNormInference {
                        rows,
                        channels: c,
                        epsilon: *epsilon,
                    };
                    self.push(i, op, vec![x.tensor], vec![y], ps);
                    return self.finish_layer(
                        i,
                        ops_start,
                        Value {
                            tensor: y,
                            shape: x.shape,
                        },
                    );
                }
                let xh = self.tensor(i, "x_hat", x.shape.clone(), dt);
                let mean = self.tensor(i, "mean", vec![c], DType::F32);
                let inv = self.tensor(i, "inv_std", vec![c], DType::F32);
                self.push(
                    i,
                    Op::BatchNorm {
                        rows,
                        channels: c,
                        momentum: *momentum,
                        epsilon: *epsilon,
                    },
                    vec![x.tensor],
                    vec![y, xh, mean, inv],
                    ps,
                );
                Value {
                    tensor: y,
                    shape: x.shape,
                }
            }
            LayerKind::LayerNorm { epsilon } => {
                arity(1)?;
                let (v, _) = &ins[0];
                let x = self.cast_to(i, v, dt)?;
                let f = *x.shape.last().unwrap_or(&1);
                let rows = prod(&x.shape) / f.max(1);
                let y = self.tensor(i, "out", x.shape.clone(), dt);
                let xh = self.tensor(i, "x_hat", x.shape.clone(), dt);
                let rstd = self.tensor(i, "rstd", vec![rows], DType::F32);
                let ps = vec![
                    self.param(i, "weight", vec![f], true, None),
                    self.param(i, "bias", vec![f], true, None),
                ];
                self.push(
                    i,
                    Op::LayerNorm {
                        rows,
                        features: f,
                        epsilon: *epsilon,
                    },
                    vec![x.tensor],
                    vec![y, xh, rstd],
                    ps,
                );
                Value {
                    tensor: y,
                    shape: x.shape,
                }
            }
            LayerKind::Dropout { rate } => {
                arity(1)?;
                if !(0.0..1.0).contains(rate) {
                    return Err(PlanError::at(
                        name,
                        format!("dropout rate must be in [0, 1), got {rate}"),
                    ));
                }
                let (v, _) = &ins[0];
                if *rate == 0.0 || !self.training {
                    v.clone()
                } else {
                    let x = self.cast_to(i, v, dt)?;
                    let elems = prod(&x.shape);
                    let y = self.tensor(i, "out", x.shape.clone(), dt);
                    let mask = self.tensor(i, "mask", x.shape.clone(), DType::U8);
                    self.push(
                        i,
                        Op::Dropout {
                            elems,
                            rate: *rate,
                            key: i as u32,
                        },
                        vec![x.tensor],
                        vec![y, mask],
                        vec![],
                    );
                    Value {
                        tensor: y,
                        shape: x.shape,
                    }
                }
            }
            LayerKind::Flatten => {
                arity(1)?;
                let (v, _) = &ins[0];
                let rest: usize = prod(&v.shape[1..]);
                Value {
                    tensor: v.tensor,
                    shape: vec![v.shape[0], rest],
                }
            }
            LayerKind::Reshape { shape } => {
                arity(1)?;
                let (v, from) = &ins[0];
                let have: usize = prod(&v.shape[1..]);
                let want: usize = prod(shape);
                if have != want {
                    return Err(PlanError::at(
                        name,
                        format!(
                            "cannot reshape {} from `{from}` ({have} values per sample) to {} ({want} values)",
                            user_shape(&v.shape),
                            fmt_shape(shape)
                        ),
                    )
                    .related(&[from]));
                }
                let mut full = vec![v.shape[0]];
                full.extend_from_slice(shape);
                Value {
                    tensor: v.tensor,
                    shape: full,
                }
            }
            LayerKind::Add { activation } => {
                if ins.len() < 2 {
                    return Err(PlanError::at(
                        name,
                        format!("`add` needs at least two inputs, got {}", ins.len()),
                    ));
                }
                let (v0, f0) = &ins[0];
                for (v, f) in &ins[1..] {
                    if v.shape != v0.shape {
                        return Err(PlanError::at(
                            name,
                            format!(
                                "cannot add `{f0}` {} and `{f}` {}: shapes differ",
                                user_shape(&v0.shape),
                                user_shape(&v.shape)
                            ),
                        )
                        .related(&[f0, f]));
                    }
                }
                let mut ts = Vec::new();
                for (v, _) in &ins {
                    ts.push(self.cast_to(i, v, dt)?.tensor);
                }
                let shape = v0.shape.clone();
                let elems = prod(&shape);
                let y = self.tensor(
                    i,
                    if *activation == Activation::Linear {
                        "out"
                    } else {
                        "sum"
                    },
                    shape.clone(),
                    dt,
                );
                let n = ts.len();
                self.push(i, Op::Add { elems, arity: n }, ts, vec![y], vec![]);
                self.activation(i, Value { tensor: y, shape }, *activation, explicit)
            }
            LayerKind::Concat => {
                if ins.len() < 2 {
                    return Err(PlanError::at(
                        name,
                        format!("`concat` needs at least two inputs, got {}", ins.len()),
                    ));
                }
                let (v0, f0) = ins[0].clone();
                let mut acc = self.cast_to(i, &v0, dt)?;
                let rank = v0.shape.len();
                for (k, (v, f)) in ins[1..].iter().enumerate() {
                    if v.shape.len() != rank || v.shape[..rank - 1] != v0.shape[..rank - 1] {
                        return Err(PlanError::at(
                            name,
                            format!(
                                "cannot concatenate `{f0}` {} and `{f}` {}: all axes but the last must match",
                                user_shape(&v0.shape),
                                user_shape(&v.shape)
                            ),
                        )
                        .related(&[f0, f]));
                    }
                    let x = self.cast_to(i, v, dt)?;
                    let a = *acc.shape.last().unwrap_or(&1);
                    let b = *x.shape.last().unwrap_or(&1);
                    let rows = prod(&acc.shape) / a.max(1);
                    let mut shape = acc.shape.clone();
                    *shape.last_mut().expect("rank >= 1") = a + b;
                    let last = k + 2 == ins.len();
                    let y = self.tensor(
                        i,
                        if last {
                            "out".to_string()
                        } else {
                            format!("part{k}")
                        }
                        .as_str(),
                        shape.clone(),
                        dt,
                    );
                    self.push(
                        i,
                        Op::Concat { rows, a, b },
                        vec![acc.tensor, x.tensor],
                        vec![y],
                        vec![],
                    );
                    acc = Value { tensor: y, shape };
                }
                acc
            }
            LayerKind::Embedding { vocab, dim } => {
                arity(1)?;
                let (v, from) = &ins[0];
                if self.g.tensors[v.tensor].dtype != DType::I32 {
                    return Err(PlanError::at(name, format!("`embedding` reads token ids (an i32 input), but `{from}` holds {} values", self.g.tensors[v.tensor].dtype.name())).related(&[from]));
                }
                let tokens: usize = prod(&v.shape);
                let mut shape = v.shape.clone();
                shape.push(*dim);
                let y = self.tensor(i, "out", shape.clone(), dt);
                let w = self.param(i, "weight", vec![*vocab, *dim], true, None);
                self.push(
                    i,
                    Op::Embedding {
                        tokens,
                        vocab: *vocab,
                        dim: *dim,
                    },
                    vec![v.tensor],
                    vec![y],
                    vec![w],
                );
                Value { tensor: y, shape }
            }
            LayerKind::Attention {
                heads,
                causal,
                dropout,
            } => {
                arity(1)?;
                let (v, from) = &ins[0];
                if v.shape.len() != 3 {
                    return Err(PlanError::at(
                        name,
                        format!(
                            "`attention` expects a [sequence, hidden] input, but `{from}` gives {}",
                            user_shape(&v.shape)
                        ),
                    )
                    .related(&[from]));
                }
                let (b, s, h) = (v.shape[0], v.shape[1], v.shape[2]);
                if *heads == 0 || h % heads != 0 {
                    return Err(PlanError::at(
                        name,
                        format!("hidden size {h} is not divisible by heads = {heads}"),
                    ));
                }
                if !(0.0..1.0).contains(dropout) {
                    return Err(PlanError::at(
                        name,
                        format!("attention dropout must be in [0, 1), got {dropout}"),
                    ));
                }
                let x = self.cast_to(i, v, dt)?;
                let qkv = self.tensor(i, "qkv", vec![b, s, 3 * h], dt);
                let wq = self.param(i, "qkv.weight", vec![h, 3 * h], true, Self::half(dt));
                let bq = self.param(i, "qkv.bias", vec![3 * h], true, None);
                self.push(
                    i,
                    Op::Dense {
                        rows: b * s,
                        in_features: h,
                        units: 3 * h,
                        bias: true,
                    },
                    vec![x.tensor],
                    vec![qkv],
                    vec![wq, bq],
                );
                let probs = self.tensor(i, "probs", vec![b, *heads, s, s], dt);
                let ctx_shape = vec![b, s, h];
                let mut outs = vec![probs];
                if *dropout > 0.0 {
                    outs.push(self.tensor(i, "probs_mask", vec![b, *heads, s, s], DType::U8));
                    outs.push(self.tensor(i, "probs_dropped", vec![b, *heads, s, s], dt));
                }
                let ctx = self.tensor(i, "ctx", ctx_shape.clone(), dt);
                outs.push(ctx);
                let op = Op::Attention {
                    batch: b,
                    seq: s,
                    heads: *heads,
                    head_dim: h / heads,
                    causal: *causal,
                    dropout: *dropout,
                    key: i as u32,
                };
                self.push(i, op, vec![qkv], outs, vec![]);
                let y = self.tensor(i, "out", ctx_shape.clone(), dt);
                let wo = self.param(i, "out.weight", vec![h, h], true, Self::half(dt));
                let bo = self.param(i, "out.bias", vec![h], true, None);
                self.push(
                    i,
                    Op::Dense {
                        rows: b * s,
                        in_features: h,
                        units: h,
                        bias: true,
                    },
                    vec![ctx],
                    vec![y],
                    vec![wo, bo],
                );
                Value {
                    tensor: y,
                    shape: ctx_shape,
                }
            }
            LayerKind::Activation(act) => {
                arity(1)?;
                let (v, _) = &ins[0];
                let x = self.cast_to(i, v, dt)?;
                if *act == Activation::Linear {
                    x
                } else {
                    let y = self.activation(i, x, *act, explicit);
                    // The activation layer's only op: name its output `out`.
                    self.g.tensors[y.tensor].name = format!("{name}.out");
                    y
                }
            }
            LayerKind::SampleNormal => {
                arity(2)?;
                let (m, fm) = &ins[0];
                let (lv, fl) = &ins[1];
                if m.shape != lv.shape {
                    return Err(PlanError::at(name, format!("`sample_normal` needs mean and log-variance of one shape, but `{fm}` is {} and `{fl}` is {}", user_shape(&m.shape), user_shape(&lv.shape))).related(&[fm, fl]));
                }
                let m = self.cast_to(i, m, dt)?;
                let lv = self.cast_to(i, lv, dt)?;
                let elems = prod(&m.shape);
                let z = self.tensor(i, "out", m.shape.clone(), dt);
                self.push(
                    i,
                    Op::SampleNormal {
                        elems,
                        key: i as u32,
                    },
                    vec![m.tensor, lv.tensor],
                    vec![z],
                    vec![],
                );
                Value {
                    tensor: z,
                    shape: m.shape,
                }
            }
        };
        self.finish_layer(i, ops_start, output)
    }

    /// Names the layer's output and records the lowered layer.
    fn finish_layer(&mut self, i: usize, ops_start: usize, output: Value) -> Result<(), PlanError> {
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
            ops: ops_start..ops_end,
        });
        Ok(())
    }

    /// The activation op `p` is when it turns logits into probabilities (sigmoid or
    /// softmax): the one rule by which every loss tells probabilities from logits.
    fn output_activation(&self, p: usize) -> Option<Activation> {
        match self.g.ops[p].op {
            Op::Activation {
                act: act @ (Activation::Sigmoid | Activation::Softmax),
                ..
            } => Some(act),
            _ => None,
        }
    }

    fn producer(&self, t: TensorId) -> Option<usize> {
        self.g.ops.iter().position(|o| o.outputs.contains(&t))
    }

    fn consumers(&self, t: TensorId) -> usize {
        self.g.ops.iter().filter(|o| o.inputs.contains(&t)).count()
    }

    fn resolve(&self, n: &str) -> Result<Value, PlanError> {
        match self.by_name.get(n) {
            Some(&j) => Ok(self.g.layers[j].output.clone()),
            None => Err(PlanError::model(format!(
                "the loss reads `{n}`, but the model has no field of that name"
            ))),
        }
    }

    fn losses(&mut self) -> Result<(), PlanError> {
        let spec = self.spec;
        if spec.loss.is_empty() {
            return Err(PlanError::model(
                "the model has no loss: add `loss = …` to #[memwise::model]",
            ));
        }
        let last_layer = spec
            .layers
            .iter()
            .rposition(|l| !matches!(l.kind, LayerKind::Input { .. }))
            .ok_or_else(|| PlanError::model("the model has no layers besides its inputs"))?;
        // How many loss terms read each field (a fused activation must feed one term only).
        let default_pred = spec.layers[last_layer].name.clone();
        let loss_readers = |n: &str| -> usize {
            spec.loss
                .iter()
                .filter(|t| {
                    if t.inputs.is_empty() {
                        n == default_pred
                    } else {
                        t.inputs.iter().any(|i| i == n)
                    }
                })
                .count()
        };
        for term in &spec.loss {
            let kname = term.kind.name();
            let names: Vec<String> = if term.inputs.is_empty() {
                if term.kind == LossKind::KlNormal {
                    return Err(PlanError::model(
                        "`kl_normal` needs its inputs: kl_normal(mean, log_var)",
                    ));
                }
                let unconsumed: Vec<usize> = (0..spec.layers.len())
                    .filter(|&j| {
                        matches!(spec.layers[j].kind, LayerKind::Input { .. }) && !self.consumed[j]
                    })
                    .collect();
                if unconsumed.is_empty() {
                    let (decl, example) = match term.kind {
                        LossKind::SparseCategoricalCrossentropy => {
                            ("#[input(shape = [], dtype = i32)] labels: Input", "labels")
                        }
                        _ => ("#[input(shape = [...])] target: Input", "target"),
                    };
                    return Err(PlanError::model(format!(
                        "`{kname}` needs a target, and every input is read by a layer: declare one \
                         (`{decl}`), which the loss then reads (or name both: `{kname}({}, {example})`)",
                        spec.layers[last_layer].name
                    )));
                }
                if unconsumed.len() > 1 {
                    let names: Vec<&str> = unconsumed
                        .iter()
                        .map(|&j| spec.layers[j].name.as_str())
                        .collect();
                    return Err(PlanError::model(format!(
                        "`{kname}` needs a target, and no layer reads {}: name it, as in {kname}({}, {})",
                        names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" or "),
                        spec.layers[last_layer].name,
                        names[0]
                    )));
                }
                vec![
                    spec.layers[last_layer].name.clone(),
                    spec.layers[unconsumed[0]].name.clone(),
                ]
            } else {
                term.inputs.clone()
            };
            if names.len() != 2 {
                return Err(PlanError::model(format!(
                    "`{kname}` takes two inputs, got {}",
                    names.len()
                )));
            }
            let a = self.resolve(&names[0])?;
            let b = self.resolve(&names[1])?;
            for (n, v) in [(&names[0], &a), (&names[1], &b)] {
                if let Some(&j) = self.by_name.get(n.as_str()) {
                    self.consumed[j] = true;
                }
                let _ = v;
            }
            let (ta, tb) = (a.tensor, b.tensor);
            let feat = |v: &Value| *v.shape.last().unwrap_or(&1);
            let rows_of = |v: &Value| prod(&v.shape) / feat(v).max(1);
            let weight = term.weight;
            let reduction = term.reduction;
            let mismatch = |what: &str| {
                PlanError::model(format!(
                    "`{kname}({}, {})`: {what}: `{}` is {} and `{}` is {}",
                    names[0],
                    names[1],
                    names[0],
                    user_shape(&a.shape),
                    names[1],
                    user_shape(&b.shape)
                ))
                .related(&[&names[0], &names[1]])
            };
            let loss = match term.kind {
                LossKind::SparseCategoricalCrossentropy => {
                    if self.g.tensors[tb].dtype != DType::I32 {
                        return Err(PlanError::model(format!(
                            "`{kname}` needs integer labels (an `#[input(dtype = i32)]`), but `{}` holds {} values",
                            names[1],
                            self.g.tensors[tb].dtype.name()
                        )));
                    }
                    let classes = feat(&a);
                    let rows = rows_of(&a);
                    if prod(&b.shape) != rows {
                        return Err(mismatch("one label per prediction row is needed"));
                    }
                    match self.producer(ta) {
                        Some(p)
                            if matches!(
                                self.g.ops[p].op,
                                Op::Activation {
                                    act: Activation::Softmax,
                                    ..
                                }
                            ) && self.consumers(ta) == 0
                                && loss_readers(&names[0]) == 1 =>
                        {
                            self.g.ops[p].fused_into_loss = true;
                            let logits = self.g.ops[p].inputs[0];
                            GLoss {
                                op: Op::SoftmaxCrossEntropy {
                                    rows,
                                    classes,
                                    weight,
                                },
                                reads: vec![ta, tb],
                                grad_of: vec![logits],
                                prediction: ta,
                            }
                        }
                        Some(p)
                            if matches!(
                                self.g.ops[p].op,
                                Op::Activation {
                                    act: Activation::Softmax,
                                    ..
                                }
                            ) =>
                        {
                            return Err(PlanError::at(
                                &names[0],
                                format!(
                                    "`{kname}` reads `{}`, a softmax whose output is also read elsewhere; \
                                     the loss folds the softmax into its gradient, so give the loss its own \
                                     softmax (or read the logits: a layer without `activation = softmax`)",
                                    names[0]
                                ),
                            ));
                        }
                        Some(p) if self.output_activation(p) == Some(Activation::Sigmoid) => {
                            return Err(PlanError::at(
                                &names[0],
                                format!(
                                    "`{kname}` reads `{}`, a sigmoid output: it needs probabilities over the \
                                     classes (`activation = softmax`) or logits (no activation, the softmax is \
                                     then fused into the loss)",
                                    names[0]
                                ),
                            ));
                        }
                        _ => GLoss {
                            op: Op::SoftmaxCrossEntropyFromLogits {
                                rows,
                                classes,
                                weight,
                            },
                            reads: vec![ta, tb],
                            grad_of: vec![ta],
                            prediction: ta,
                        },
                    }
                }
                LossKind::BinaryCrossentropy | LossKind::MeanSquaredError => {
                    if a.shape != b.shape {
                        return Err(mismatch("prediction and target must have one shape"));
                    }
                    if !self.g.tensors[tb].dtype.is_float() {
                        return Err(PlanError::model(format!(
                            "`{kname}` needs a floating-point target, but `{}` holds {} values",
                            names[1],
                            self.g.tensors[tb].dtype.name()
                        )));
                    }
                    let features = prod(&a.shape[1..]);
                    let rows = a.shape[0];
                    if term.kind == LossKind::MeanSquaredError {
                        GLoss {
                            op: Op::MeanSquaredError {
                                rows,
                                features,
                                reduction,
                                weight,
                            },
                            reads: vec![ta, tb],
                            grad_of: vec![ta],
                            prediction: ta,
                        }
                    } else {
                        match self.producer(ta) {
                            Some(p)
                                if matches!(
                                    self.g.ops[p].op,
                                    Op::Activation {
                                        act: Activation::Sigmoid,
                                        ..
                                    }
                                ) && self.consumers(ta) == 0
                                    && loss_readers(&names[0]) == 1 =>
                            {
                                self.g.ops[p].fused_into_loss = true;
                                let logits = self.g.ops[p].inputs[0];
                                GLoss {
                                    op: Op::SigmoidBinaryCrossentropy {
                                        rows,
                                        features,
                                        reduction,
                                        weight,
                                    },
                                    reads: vec![ta, tb],
                                    grad_of: vec![logits],
                                    prediction: ta,
                                }
                            }
                            // Probabilities read elsewhere too, or a softmax's: plain BCE.
                            Some(p) if self.output_activation(p).is_some() => GLoss {
                                op: Op::BinaryCrossentropy {
                                    rows,
                                    features,
                                    reduction,
                                    weight,
                                },
                                reads: vec![ta, tb],
                                grad_of: vec![ta],
                                prediction: ta,
                            },
                            // Any other output is logits: the sigmoid is fused, stably.
                            _ => GLoss {
                                op: Op::BinaryCrossentropyFromLogits {
                                    rows,
                                    features,
                                    reduction,
                                    weight,
                                },
                                reads: vec![ta, tb],
                                grad_of: vec![ta],
                                prediction: ta,
                            },
                        }
                    }
                }
                LossKind::KlNormal => {
                    if a.shape != b.shape {
                        return Err(mismatch("mean and log-variance must have one shape"));
                    }
                    let features = prod(&a.shape[1..]);
                    // One kernel reads both: give the log-variance the mean's dtype.
                    let (da, db) = (self.g.tensors[ta].dtype, self.g.tensors[tb].dtype);
                    if !da.is_float() || !db.is_float() {
                        return Err(mismatch("mean and log-variance must be floating-point"));
                    }
                    let tb = if da != db {
                        let layer = self.g.tensors[tb].layer;
                        self.cast_to(layer, &b, da)?.tensor
                    } else {
                        tb
                    };
                    GLoss {
                        op: Op::KlNormal {
                            rows: a.shape[0],
                            features,
                            reduction,
                            weight,
                        },
                        reads: vec![ta, tb],
                        grad_of: vec![ta, tb],
                        prediction: ta,
                    }
                }
            };
            self.g.losses.push(loss);
        }
        // A loss may not fuse into a softmax/sigmoid twice.
        let mut fused_grads: Vec<TensorId> = Vec::new();
        for l in &self.g.losses {
            if matches!(
                l.op,
                Op::SoftmaxCrossEntropy { .. } | Op::SigmoidBinaryCrossentropy { .. }
            ) {
                if fused_grads.contains(&l.grad_of[0]) {
                    return Err(PlanError::model("two loss terms read the same softmax/sigmoid output; give each its own layer"));
                }
                fused_grads.push(l.grad_of[0]);
            }
        }
        Ok(())
    }
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
        let mut b = Builder {
            spec,
            g: Graph::default(),
            by_name: HashMap::new(),
            consumed: vec![false; spec.layers.len()],
            training,
            oversize: None,
        };
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
