//! Random model generators: deterministic, seeded [`ModelSpec`]s — chains
//! ([`random_chain`]) and DAGs ([`random_dag`]) — small enough for a CPU to run hundreds
//! of training steps quickly. The planner's property tests plan them; the runtime's
//! poisoned-arena test executes them.
//!
//! The same seed always gives the same model, on every machine and with every build: the
//! random numbers come from [`SplitMix64`] (no dependency), and every choice below is made
//! by it in a fixed order.
//!
//! # The distribution
//!
//! Sizes: every tensor, workspace included, holds at most [`MAX_ELEMS`] elements counting
//! the batch (convolutions' im2col scratch and attention's score matrices are checked too).
//!
//! - **Batch**: uniform over [`BATCHES`], which mixes powers of two with odd and prime sizes
//!   (1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 23, 32).
//! - **Model precision**: float32 50 %, mixed_float16 25 %, mixed_bfloat16 25 %.
//! - **Optimizer**: uniform over SGD, momentum, RMSprop, RMSprop with momentum and
//!   `centered` (3 state slots), Adam, AdamW (Keras defaults).
//! - **First input**, one of three kinds of value, uniform: an image `[h, w, c]` (h, w in
//!   3..=16, c in 1..=4), a sequence `[s, d]` (s in 2..=12, d in {4, 6, 8, 12, 16}) or flat
//!   features `[f]` (f in 1..=48), shrunk to the per-sample budget. Images and features are
//!   stored as u8 (scaled by 1/255) 40 %, f32 30 %, f16 15 %, bf16 15 %; sequences are
//!   floats, or (30 %) i32 token ids `[s]` read by an embedding (vocabulary 5..=50).
//! - **Layers**: each reads the current value and is drawn uniformly from what its shape
//!   allows, re-drawn (up to 32 times) when the result would exceed the budget, and an
//!   activation otherwise:
//!   - images: conv2d (1..=12 filters, kernel 1/3/5 or, 20 %, a non-square one, stride 1 or
//!     2, same/valid), depthwise (multiplier 1–2), separable, conv2d_transpose (kernel 1–3,
//!     stride 1–2), max/avg pool (2 or 3, stride 1, 2 or the window), global average pool,
//!     dense over channels, flatten, reshape (to a sequence or a transposed image), and the
//!     shape-preserving layers below;
//!   - sequences: dense, multi-head self-attention (heads dividing d, causal 50 %, dropout
//!     0 or 0.1), flatten, reshape to an image, shape-preserving layers;
//!   - features: dense (1..=32 units), reshape to a sequence or an image, shape-preserving;
//!   - shape-preserving (any value): batch_norm, layer_norm, dropout (rate 0, 0.1, 0.2 or
//!     0.5), an activation (linear, relu, sigmoid, tanh, gelu, silu, softmax), flatten or
//!     reshape to the same shape (views).
//!
//!   Layers that take an activation draw it from linear 30 %, relu 25 %, and sigmoid, tanh,
//!   gelu, silu 10 % each, softmax 5 %; 70 % have a bias.
//! - **Chains** ([`random_chain`]): 2..=10 such layers, each reading the previous one
//!   (inputs left implicit, as the DSL writes a chain).
//! - **DAGs** ([`random_dag`]): 2..=6 blocks, each one of: a single layer (25 %); a residual
//!   block `add(x, f(x))` or `add(x, f(x), g(x))` with 1–3 shape-preserving layers per
//!   branch and a random activation on the sum (20 %); a projection residual (a strided
//!   conv or a dense beside a 1×1 conv or dense shortcut, 10 %); an inception-style concat
//!   of 2–3 branches (15 %); a U-Net step (pool or strided conv down, one layer, transposed
//!   conv up, concat with the skip; 10 %); a long skip to a value saved earlier, merged by
//!   concat or add when shapes allow (10 %); a duplicated read `add(x, x)` or `concat(x, x)`
//!   (3 %); a VAE bottleneck (two dense heads, `sample_normal`, and 70 % a KL loss term on
//!   them; 5 %); a second model input merged by concat (2 %). Every branch ends in a merge
//!   or a loss: there are no dead ends.
//! - **Head and loss**: sparse categorical cross-entropy (40 %: a dense, or for images a
//!   1×1 conv for per-pixel classes, to 2..=10 classes with softmax or plain logits, and
//!   i32 labels), binary cross-entropy (30 %: a sigmoid head against a u8 or float target)
//!   or mean squared error (30 %: 70 % a linear head, else the value itself, against a u8
//!   or float target). A loss only reads values that depend on a trainable parameter (the
//!   planner rejects the others): a head that would read the value itself gets a dense or
//!   1×1 conv of width 1 when the value depends on none. DAGs get a second head and loss 25 % of the time. Reductions are
//!   mean or sum over features, weights 1 or 0.5.
//! - **Per-layer precision**: each layer gets an explicit f16, bf16 or f32 15 % of the time.
//! - **Checkpoint segments**: none 40 %; otherwise 1–3 runs of 1–6 consecutive layers, each
//!   run its own segment (adjacent runs included), or (10 % of those) every layer its own
//!   segment, or (10 %) one segment over all of them.

pub use crate::rng::SplitMix64;

use crate::dtype::{DType, Precision};
use crate::op::{out_len, transpose_out_len};
use crate::spec::{
    Activation, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer, Padding, Reduction,
};

/// Most elements any generated tensor (or workspace) holds, batch included.
pub const MAX_ELEMS: usize = 100_000;

/// The batch sizes the generators draw from.
pub const BATCHES: [usize; 12] = [1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 23, 32];

/// A value's shape without the batch dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Flat(usize),
    Seq(usize, usize),
    Image(usize, usize, usize),
}

impl Shape {
    fn elems(self) -> usize {
        match self {
            Shape::Flat(f) => f,
            Shape::Seq(s, d) => s * d,
            Shape::Image(h, w, c) => h * w * c,
        }
    }

    fn dims(self) -> Vec<usize> {
        match self {
            Shape::Flat(f) => vec![f],
            Shape::Seq(s, d) => vec![s, d],
            Shape::Image(h, w, c) => vec![h, w, c],
        }
    }

    fn last(self) -> usize {
        match self {
            Shape::Flat(f) => f,
            Shape::Seq(_, d) => d,
            Shape::Image(_, _, c) => c,
        }
    }

    /// The same shape with another last dimension.
    fn with_last(self, last: usize) -> Shape {
        match self {
            Shape::Flat(_) => Shape::Flat(last),
            Shape::Seq(s, _) => Shape::Seq(s, last),
            Shape::Image(h, w, _) => Shape::Image(h, w, last),
        }
    }

    /// All dimensions but the last agree (and the rank), so the two can be concatenated.
    fn concat_compatible(self, other: Shape) -> bool {
        self.with_last(1) == other.with_last(1)
    }
}

/// A layer's output as the generator tracks it.
#[derive(Clone, Debug, PartialEq)]
struct Val {
    name: String,
    shape: Shape,
    /// Depends on a trainable parameter (a loss may only read such a value).
    trained: bool,
}

struct Gen {
    rng: SplitMix64,
    spec: ModelSpec,
    counter: usize,
}

const ACTIVATIONS: [(u32, Activation); 7] = [
    (30, Activation::Linear),
    (25, Activation::Relu),
    (10, Activation::Sigmoid),
    (10, Activation::Tanh),
    (10, Activation::Gelu),
    (10, Activation::Silu),
    (5, Activation::Softmax),
];

const OPTIMIZERS: [Optimizer; 6] = [
    Optimizer::SGD,
    Optimizer::MOMENTUM,
    Optimizer::RMSPROP,
    Optimizer::RmsProp {
        lr: 1e-3,
        rho: 0.9,
        epsilon: 1e-7,
        momentum: 0.9,
        centered: true,
    },
    Optimizer::ADAM,
    Optimizer::ADAMW,
];

impl Gen {
    fn new(seed: u64, kind: &str) -> Gen {
        // Decorrelate chains from DAGs of the same seed.
        let salt = if kind == "chain" {
            0x6368_6169_6e00_0000
        } else {
            0x6461_6700_0000_0000
        };
        let mut rng = SplitMix64::new(seed ^ salt);
        let batch = rng.pick(&BATCHES);
        let name = if kind == "chain" {
            format!("RandomChain{seed}")
        } else {
            format!("RandomDag{seed}")
        };
        let mut spec = ModelSpec::new(&name, batch);
        spec.precision = rng.weighted(&[
            (2, Precision::Float32),
            (1, Precision::MixedFloat16),
            (1, Precision::MixedBFloat16),
        ]);
        spec.optimizer = rng.pick(&OPTIMIZERS);
        Gen {
            rng,
            spec,
            counter: 0,
        }
    }

    /// Elements per sample the budget allows.
    fn per_sample(&self) -> usize {
        (MAX_ELEMS / self.spec.batch).max(1)
    }

    fn fits(&self, per_sample: usize) -> bool {
        per_sample >= 1 && self.spec.batch * per_sample <= MAX_ELEMS
    }

    /// Appends a layer; a single input that is the previous layer is left implicit.
    fn push(&mut self, kind: LayerKind, inputs: &[&Val], shape: Shape) -> Val {
        let name = format!("l{}_{}", self.counter, kind.name());
        self.counter += 1;
        let implicit = inputs.len() == 1
            && self
                .spec
                .layers
                .last()
                .is_some_and(|l| l.name == inputs[0].name);
        let names: Vec<&str> = if implicit {
            Vec::new()
        } else {
            inputs.iter().map(|v| v.name.as_str()).collect()
        };
        let trained = inputs.iter().any(|v| v.trained)
            || matches!(
                kind,
                LayerKind::Dense { .. }
                    | LayerKind::Conv2d { .. }
                    | LayerKind::DepthwiseConv2d { .. }
                    | LayerKind::SeparableConv2d { .. }
                    | LayerKind::Conv2dTranspose { .. }
                    | LayerKind::BatchNorm { .. }
                    | LayerKind::LayerNorm { .. }
                    | LayerKind::Embedding { .. }
                    | LayerKind::Attention { .. }
            );
        self.spec.add(&name, kind, &names);
        Val {
            name,
            shape,
            trained,
        }
    }

    fn input(&mut self, shape: Shape, dtype: DType) -> Val {
        let scale = if dtype == DType::U8 { 1.0 / 255.0 } else { 1.0 };
        self.push(
            LayerKind::Input {
                shape: shape.dims(),
                dtype,
                scale,
            },
            &[],
            shape,
        )
    }

    fn data_dtype(&mut self) -> DType {
        self.rng.weighted(&[
            (40, DType::U8),
            (30, DType::F32),
            (15, DType::F16),
            (15, DType::BF16),
        ])
    }

    fn float_dtype(&mut self) -> DType {
        self.rng
            .weighted(&[(2, DType::F32), (1, DType::F16), (1, DType::BF16)])
    }

    fn act(&mut self) -> Activation {
        self.rng.weighted(&ACTIVATIONS)
    }

    fn padding(&mut self) -> Padding {
        if self.rng.chance(0.5) {
            Padding::Same
        } else {
            Padding::Valid
        }
    }

    fn bias(&mut self) -> bool {
        self.rng.chance(0.7)
    }

    /// A kernel: square 1, 3 or 5 (80 %) or two independent sides.
    fn kernel(&mut self, sides: &[usize]) -> [usize; 2] {
        if self.rng.chance(0.8) {
            [self.rng.pick(sides); 2]
        } else {
            [self.rng.pick(sides), self.rng.pick(sides)]
        }
    }

    /// The model's first input, and the value the layers start from.
    fn start(&mut self) -> Val {
        let budget = self.per_sample();
        match self.rng.below(3) {
            0 => {
                let c = self.rng.range(1, 4);
                let mut h = self.rng.range(3, 16);
                let mut w = self.rng.range(3, 16);
                while h * w * c > budget && (h > 1 || w > 1) {
                    if h >= w {
                        h -= 1;
                    } else {
                        w -= 1;
                    }
                }
                let dt = self.data_dtype();
                self.input(Shape::Image(h, w, c), dt)
            }
            1 => {
                let mut s = self.rng.range(2, 12);
                let d = self.rng.pick(&[4, 6, 8, 12, 16]);
                while s * d * 3 > budget && s > 1 {
                    s -= 1;
                }
                if self.rng.chance(0.3) && self.fits(s * d) {
                    let ids = self.input(Shape::Flat(s), DType::I32);
                    let vocab = self.rng.range(5, 50);
                    self.push(
                        LayerKind::Embedding { vocab, dim: d },
                        &[&ids],
                        Shape::Seq(s, d),
                    )
                } else {
                    let dt = self.float_dtype();
                    self.input(Shape::Seq(s, d), dt)
                }
            }
            _ => {
                let f = self.rng.range(1, 48).min(budget);
                let dt = self.data_dtype();
                self.input(Shape::Flat(f), dt)
            }
        }
    }

    /// One layer reading `x`; with `preserve`, its output has `x`'s shape.
    fn layer(&mut self, x: &Val, preserve: bool) -> Val {
        for _ in 0..32 {
            let choice = match x.shape {
                Shape::Image(h, w, c) => self.image_layer(h, w, c, preserve),
                Shape::Seq(s, d) => self.seq_layer(s, d, preserve),
                Shape::Flat(f) => self.flat_layer(f, preserve),
            };
            if let Some((kind, shape)) = choice {
                if preserve && shape != x.shape {
                    continue;
                }
                return self.push(kind, &[x], shape);
            }
        }
        let act = self.act();
        self.push(LayerKind::Activation(act), &[x], x.shape)
    }

    /// A layer that keeps the shape: normalisation, dropout, activation or a view.
    fn same_shape_layer(&mut self, shape: Shape) -> (LayerKind, Shape) {
        let kind = match self.rng.below(9) {
            0 | 1 => LayerKind::BatchNorm {
                momentum: 0.99,
                epsilon: 1e-3,
            },
            2 | 3 => LayerKind::LayerNorm { epsilon: 1e-5 },
            4 | 5 => LayerKind::Dropout {
                rate: self.rng.weighted(&[(1, 0.0), (3, 0.1), (2, 0.2), (2, 0.5)]),
            },
            6 | 7 => LayerKind::Activation(self.act()),
            _ => match shape {
                Shape::Flat(_) => LayerKind::Flatten,
                _ => LayerKind::Reshape {
                    shape: shape.dims(),
                },
            },
        };
        (kind, shape)
    }

    fn dense(&mut self, units: usize) -> LayerKind {
        LayerKind::Dense {
            units,
            activation: self.act(),
            use_bias: self.bias(),
        }
    }

    fn image_layer(
        &mut self,
        h: usize,
        w: usize,
        c: usize,
        preserve: bool,
    ) -> Option<(LayerKind, Shape)> {
        let pick = if preserve {
            self.rng.pick(&[0, 1, 2, 3, 4, 8, 8, 8])
        } else {
            self.rng.below(12)
        };
        match pick {
            0 => self.conv_layer((h, w, c), preserve, false),
            1 | 2 => self.depthwise_layer((h, w, c), preserve, pick == 2),
            3 => self.conv_layer((h, w, c), preserve, true),
            4 => self.pool_layer((h, w, c), preserve),
            5 => Some((LayerKind::GlobalAvgPool, Shape::Flat(c))),
            6 => {
                let units = self.rng.range(1, 16);
                if !self.fits(h * w * units) {
                    return None;
                }
                Some((self.dense(units), Shape::Image(h, w, units)))
            }
            7 => Some((LayerKind::Flatten, Shape::Flat(h * w * c))),
            9 => {
                let to = if self.rng.chance(0.5) {
                    Shape::Seq(h * w, c)
                } else {
                    Shape::Image(w, h, c)
                };
                Some((LayerKind::Reshape { shape: to.dims() }, to))
            }
            _ => Some(self.same_shape_layer(Shape::Image(h, w, c))),
        }
    }

    /// A convolution's first size (filters or multiplier), kernel, stride and padding:
    /// `keep`, a small kernel, stride 1 and `same` when `preserve` (the shape is kept), else
    /// drawn from `range`, `kernels`, `strides` and either padding.
    fn window(
        &mut self,
        preserve: bool,
        keep: usize,
        range: (usize, usize),
        kernels: &[usize],
        strides: &[usize],
    ) -> (usize, [usize; 2], usize, Padding) {
        if preserve {
            (keep, self.kernel(&[1, 3]), 1, Padding::Same)
        } else {
            (
                self.rng.range(range.0, range.1),
                self.kernel(kernels),
                self.rng.pick(strides),
                self.padding(),
            )
        }
    }

    /// A conv2d or (`transpose`) conv2d_transpose over an `h × w × c` image (`preserve`:
    /// keeping its shape).
    fn conv_layer(
        &mut self,
        (h, w, c): (usize, usize, usize),
        preserve: bool,
        transpose: bool,
    ) -> Option<(LayerKind, Shape)> {
        let (f, k, s, pad) = if transpose {
            self.window(preserve, c, (1, 8), &[1, 2, 3], &[1, 2])
        } else {
            self.window(preserve, c, (1, 12), &[1, 3, 5], &[1, 1, 2])
        };
        // The output, and the im2col (or col2im) scratch, must fit.
        let (oh, ow, scratch) = if transpose {
            let (oh, ow) = (
                transpose_out_len(h, k[0], s, pad),
                transpose_out_len(w, k[1], s, pad),
            );
            (oh, ow, h * w * k[0] * k[1] * f)
        } else {
            let (oh, ow) = self.window_out(h, w, k, s, pad)?;
            (oh, ow, oh * ow * k[0] * k[1] * c)
        };
        if !self.fits(oh * ow * f) || !self.fits(scratch) {
            return None;
        }
        let kind = if transpose {
            LayerKind::Conv2dTranspose {
                filters: f,
                kernel: k,
                strides: [s; 2],
                padding: pad,
                activation: self.act(),
                use_bias: self.bias(),
            }
        } else {
            LayerKind::Conv2d {
                filters: f,
                kernel: k,
                strides: [s; 2],
                padding: pad,
                activation: self.act(),
                use_bias: self.bias(),
            }
        };
        Some((kind, Shape::Image(oh, ow, f)))
    }

    /// The output size of a window over `h × w`; `None` when a `valid` window is larger.
    fn window_out(
        &self,
        h: usize,
        w: usize,
        k: [usize; 2],
        s: usize,
        pad: Padding,
    ) -> Option<(usize, usize)> {
        if pad == Padding::Valid && (k[0] > h || k[1] > w) {
            return None;
        }
        Some((out_len(h, k[0], s, pad), out_len(w, k[1], s, pad)))
    }

    /// A depthwise or (`separable`) separable conv2d over an `h × w × c` image.
    fn depthwise_layer(
        &mut self,
        (h, w, c): (usize, usize, usize),
        preserve: bool,
        separable: bool,
    ) -> Option<(LayerKind, Shape)> {
        let (mult, k, s, pad) = self.window(preserve, 1, (1, 2), &[1, 3, 5], &[1, 1, 2]);
        let (oh, ow) = self.window_out(h, w, k, s, pad)?;
        if !self.fits(oh * ow * c * mult) {
            return None;
        }
        let (activation, use_bias) = (self.act(), self.bias());
        if separable {
            let f = if preserve { c } else { self.rng.range(1, 12) };
            if !self.fits(oh * ow * f) {
                return None;
            }
            let kind = LayerKind::SeparableConv2d {
                filters: f,
                kernel: k,
                strides: [s; 2],
                padding: pad,
                multiplier: mult,
                activation,
                use_bias,
            };
            Some((kind, Shape::Image(oh, ow, f)))
        } else {
            let kind = LayerKind::DepthwiseConv2d {
                kernel: k,
                strides: [s; 2],
                padding: pad,
                multiplier: mult,
                activation,
                use_bias,
            };
            Some((kind, Shape::Image(oh, ow, c * mult)))
        }
    }

    /// A max or average pool over an `h × w × c` image.
    fn pool_layer(
        &mut self,
        (h, w, c): (usize, usize, usize),
        preserve: bool,
    ) -> Option<(LayerKind, Shape)> {
        let pool = self.rng.pick(&[2, 3]);
        let (s, pad) = if preserve {
            (1, Padding::Same)
        } else {
            (self.rng.pick(&[1, 2, pool]), self.padding())
        };
        let (oh, ow) = self.window_out(h, w, [pool; 2], s, pad)?;
        let kind = if self.rng.chance(0.5) {
            LayerKind::max_pool2d(pool, s, pad)
        } else {
            LayerKind::avg_pool2d(pool, s, pad)
        };
        Some((kind, Shape::Image(oh, ow, c)))
    }

    fn seq_layer(&mut self, s: usize, d: usize, preserve: bool) -> Option<(LayerKind, Shape)> {
        let pick = if preserve {
            self.rng.pick(&[0, 1, 5, 5])
        } else {
            self.rng.below(7)
        };
        match pick {
            0 => {
                let units = if preserve { d } else { self.rng.range(1, 24) };
                if !self.fits(s * units) {
                    return None;
                }
                Some((self.dense(units), Shape::Seq(s, units)))
            }
            1 => {
                let divisors: Vec<usize> = (1..=4).filter(|&h| d.is_multiple_of(h)).collect();
                let heads = self.rng.pick(&divisors);
                // The memory-efficient attention's scratch too, should the planner pick it.
                let flash =
                    crate::op::flash_attention_scratch_elems(self.spec.batch, s, heads, d / heads);
                if !self.fits(heads * s * s) || !self.fits(3 * s * d) || flash > MAX_ELEMS {
                    return None;
                }
                let dropout = if self.rng.chance(0.5) { 0.0 } else { 0.1 };
                let kind = LayerKind::Attention {
                    heads,
                    causal: self.rng.chance(0.5),
                    dropout,
                };
                Some((kind, Shape::Seq(s, d)))
            }
            2 => Some((LayerKind::Flatten, Shape::Flat(s * d))),
            3 => {
                let to = if self.rng.chance(0.5) {
                    Shape::Image(s, d, 1)
                } else {
                    Shape::Image(s, 1, d)
                };
                Some((LayerKind::Reshape { shape: to.dims() }, to))
            }
            _ => Some(self.same_shape_layer(Shape::Seq(s, d))),
        }
    }

    fn flat_layer(&mut self, f: usize, preserve: bool) -> Option<(LayerKind, Shape)> {
        let pick = if preserve {
            self.rng.pick(&[0, 3, 3])
        } else {
            self.rng.below(5)
        };
        match pick {
            0 | 1 => {
                let units = if preserve { f } else { self.rng.range(1, 32) };
                Some((self.dense(units), Shape::Flat(units)))
            }
            2 => {
                let divisors: Vec<usize> = (2..=f).filter(|&a| f.is_multiple_of(a)).collect();
                let to = if divisors.is_empty() || self.rng.chance(0.3) {
                    Shape::Image(1, 1, f)
                } else {
                    let a = self.rng.pick(&divisors);
                    if self.rng.chance(0.5) {
                        Shape::Seq(a, f / a)
                    } else {
                        Shape::Image(a, f / a, 1)
                    }
                };
                Some((LayerKind::Reshape { shape: to.dims() }, to))
            }
            _ => Some(self.same_shape_layer(Shape::Flat(f))),
        }
    }

    /// A head on `x` and its loss term; declares the target input.
    fn head(&mut self, x: &Val) {
        let weight = if self.rng.chance(0.8) { 1.0 } else { 0.5 };
        let reduction = if self.rng.chance(0.5) {
            Reduction::Mean
        } else {
            Reduction::SumOverFeatures
        };
        match self.rng.weighted(&[(40, 0), (30, 1), (30, 2)]) {
            0 => {
                let classes = self.rng.range(2, 10);
                let activation = if self.rng.chance(0.6) {
                    Activation::Softmax
                } else {
                    Activation::Linear
                };
                let (kind, labels) = match x.shape {
                    Shape::Image(h, w, _) if self.fits(h * w * classes) => (
                        LayerKind::Conv2d {
                            filters: classes,
                            kernel: [1, 1],
                            strides: [1, 1],
                            padding: Padding::Same,
                            activation,
                            use_bias: true,
                        },
                        Shape::Seq(h, w),
                    ),
                    Shape::Seq(s, _) if self.fits(s * classes) => (
                        LayerKind::Dense {
                            units: classes,
                            activation,
                            use_bias: true,
                        },
                        Shape::Flat(s),
                    ),
                    _ => {
                        let x2 = self.flattened(x);
                        let p = self.push(
                            LayerKind::Dense {
                                units: classes,
                                activation,
                                use_bias: true,
                            },
                            &[&x2],
                            Shape::Flat(classes),
                        );
                        return self.sce(&p, None, weight);
                    }
                };
                let p = self.push(kind, &[x], x.shape.with_last(classes));
                self.sce(&p, Some(labels), weight);
            }
            1 => {
                let mut units = self.rng.range(1, 8);
                if !self.fits(x.shape.with_last(units).elems()) && !x.trained {
                    units = 1; // never larger than `x`
                }
                let shape = x.shape.with_last(units);
                let p = if self.fits(shape.elems()) {
                    let kind = match x.shape {
                        Shape::Image(..) => {
                            LayerKind::conv2d(units, 1, 1, Padding::Same, Activation::Sigmoid)
                        }
                        _ => LayerKind::dense(units, Activation::Sigmoid),
                    };
                    self.push(kind, &[x], shape)
                } else {
                    self.push(LayerKind::Activation(Activation::Sigmoid), &[x], x.shape)
                };
                let dt = self.data_dtype();
                let target = self.input(p.shape, dt);
                let term = LossTerm::new(LossKind::BinaryCrossentropy).on(&[&p.name, &target.name]);
                self.spec
                    .loss
                    .push(term.reduction(reduction).weight(weight));
            }
            _ => {
                // A loss may only read a value that depends on a trainable parameter.
                let p = if self.rng.chance(0.7) || !x.trained {
                    let mut units = self.rng.range(1, 8);
                    if !self.fits(x.shape.with_last(units).elems()) && !x.trained {
                        units = 1; // never larger than `x`
                    }
                    let shape = x.shape.with_last(units);
                    if self.fits(shape.elems()) {
                        let kind = LayerKind::Dense {
                            units,
                            activation: Activation::Linear,
                            use_bias: self.bias(),
                        };
                        self.push(kind, &[x], shape)
                    } else {
                        x.clone()
                    }
                } else {
                    x.clone()
                };
                let dt = self.data_dtype();
                let target = self.input(p.shape, dt);
                let term = LossTerm::new(LossKind::MeanSquaredError).on(&[&p.name, &target.name]);
                self.spec
                    .loss
                    .push(term.reduction(reduction).weight(weight));
            }
        }
    }

    /// Sparse categorical cross-entropy of `p` against new i32 labels (`None`: one per sample).
    fn sce(&mut self, p: &Val, labels: Option<Shape>, weight: f32) {
        let dims = labels.map(Shape::dims).unwrap_or_default();
        let name = format!("l{}_labels", self.counter);
        self.counter += 1;
        self.spec.input(&name, &dims, DType::I32, 1.0);
        let term = LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&[&p.name, &name]);
        self.spec.loss.push(term.weight(weight));
    }

    /// `x` as flat features: itself, a global average pool of an image that would not fit
    /// flattened, or a flatten view.
    fn flattened(&mut self, x: &Val) -> Val {
        match x.shape {
            Shape::Flat(_) => x.clone(),
            Shape::Image(_, _, c) if self.rng.chance(0.5) => {
                self.push(LayerKind::GlobalAvgPool, &[x], Shape::Flat(c))
            }
            s => self.push(LayerKind::Flatten, &[x], Shape::Flat(s.elems())),
        }
    }

    /// Random per-layer precisions and checkpoint segments over the finished model.
    fn decorate(&mut self) {
        for (i, l) in self.spec.layers.iter_mut().enumerate() {
            if self.rng.chance(0.15) {
                l.dtype = Some(self.rng.pick(&[DType::F16, DType::BF16, DType::F32]));
            }
            // Every other norm recomputes its output (no draw: the stream, and so every
            // other choice of the generator, stays as it was).
            l.recompute_output = l.can_recompute_output() && i % 2 == 0;
        }
        if self.rng.chance(0.4) {
            return;
        }
        let candidates: Vec<usize> = (0..self.spec.layers.len())
            .filter(|&i| !matches!(self.spec.layers[i].kind, LayerKind::Input { .. }))
            .collect();
        if candidates.is_empty() {
            return;
        }
        match self.rng.below(10) {
            0 => {
                for (seg, &i) in candidates.iter().enumerate() {
                    self.spec.layers[i].checkpoint = Some(seg as u32);
                }
            }
            1 => {
                for &i in &candidates {
                    self.spec.layers[i].checkpoint = Some(0);
                }
            }
            _ => {
                for seg in 0..self.rng.range(1, 3) {
                    let start = self.rng.below(candidates.len());
                    let len = self.rng.range(1, 6);
                    for &i in candidates.iter().skip(start).take(len) {
                        self.spec.layers[i].checkpoint = Some(seg as u32 + 100);
                    }
                }
            }
        }
    }

    fn finish(mut self) -> ModelSpec {
        self.decorate();
        self.spec
    }
}

/// A random chain: one input, 2..=10 layers each reading the previous one, a head and its
/// loss (see the [module documentation](self) for the distribution).
pub fn random_chain(seed: u64) -> ModelSpec {
    let mut g = Gen::new(seed, "chain");
    let mut x = g.start();
    for _ in 0..g.rng.range(2, 10) {
        x = g.layer(&x, false);
    }
    g.head(&x);
    g.finish()
}

/// A random DAG: residual, projection, concat, U-Net, long-skip, duplicated-read, VAE and
/// multi-input blocks over the same layers as [`random_chain`], with one or two heads (see
/// the [module documentation](self) for the distribution).
pub fn random_dag(seed: u64) -> ModelSpec {
    let mut g = Gen::new(seed, "dag");
    let mut x = g.start();
    let mut saved: Vec<Val> = Vec::new();
    for _ in 0..g.rng.range(2, 6) {
        let block = g.rng.weighted(&[
            (25, 0),
            (20, 1),
            (10, 2),
            (15, 3),
            (10, 4),
            (10, 5),
            (3, 6),
            (5, 7),
            (2, 8),
        ]);
        if g.rng.chance(0.3) {
            saved.push(x.clone());
        }
        x = match block {
            1 => residual(&mut g, &x),
            2 => projection(&mut g, &x),
            3 => inception(&mut g, &x),
            4 => unet_step(&mut g, &x),
            5 => long_skip(&mut g, &x, &saved),
            6 => duplicate_read(&mut g, &x),
            7 => vae(&mut g, &x),
            8 => second_input(&mut g, &x),
            _ => g.layer(&x, false),
        };
    }
    g.head(&x);
    if g.rng.chance(0.25) {
        g.head(&x);
    }
    g.finish()
}

/// `x + f(x) [+ g(x)]`, each branch 1–3 shape-preserving layers.
fn residual(g: &mut Gen, x: &Val) -> Val {
    let branches = if g.rng.chance(0.2) { 2 } else { 1 };
    let mut ins = vec![x.clone()];
    for _ in 0..branches {
        let mut y = x.clone();
        for _ in 0..g.rng.range(1, 3) {
            y = g.layer(&y, true);
        }
        ins.push(y);
    }
    let refs: Vec<&Val> = ins.iter().collect();
    let activation = g.act();
    g.push(LayerKind::Add { activation }, &refs, x.shape)
}

/// A shape-changing layer beside a shortcut that changes the shape the same way.
fn projection(g: &mut Gen, x: &Val) -> Val {
    let (main, short, shape) = match x.shape {
        Shape::Image(h, w, _) => {
            let (f, s) = (g.rng.range(1, 12), g.rng.pick(&[1, 2]));
            let (oh, ow) = (h.div_ceil(s), w.div_ceil(s));
            let k = g.rng.pick(&[1, 3]);
            if !g.fits(oh * ow * f) || !g.fits(oh * ow * k * k * x.shape.last()) {
                return g.layer(x, false);
            }
            (
                LayerKind::conv2d(f, k, s, Padding::Same, g.act()),
                LayerKind::Conv2d {
                    filters: f,
                    kernel: [1, 1],
                    strides: [s; 2],
                    padding: Padding::Same,
                    activation: Activation::Linear,
                    use_bias: false,
                },
                Shape::Image(oh, ow, f),
            )
        }
        shape => {
            let units = g.rng.range(1, 24);
            let out = shape.with_last(units);
            if !g.fits(out.elems()) {
                return g.layer(x, false);
            }
            (
                g.dense(units),
                LayerKind::Dense {
                    units,
                    activation: Activation::Linear,
                    use_bias: false,
                },
                out,
            )
        }
    };
    let a = g.push(main, &[x], shape);
    let a = if g.rng.chance(0.5) {
        g.layer(&a, true)
    } else {
        a
    };
    let b = g.push(short, &[x], shape);
    let activation = g.act();
    g.push(LayerKind::Add { activation }, &[&a, &b], shape)
}

/// Two or three branches of different widths (a conv or dense of 1–8 units, or 25 % a
/// shape-preserving layer), concatenated.
fn inception(g: &mut Gen, x: &Val) -> Val {
    let widths: Vec<Option<usize>> = (0..g.rng.range(2, 3))
        .map(|_| {
            if g.rng.chance(0.25) {
                None
            } else {
                Some(g.rng.range(1, 8))
            }
        })
        .collect();
    let width: usize = widths.iter().map(|u| u.unwrap_or(x.shape.last())).sum();
    let out = x.shape.with_last(width);
    let c = x.shape.last();
    let widest = widths.iter().map(|u| u.unwrap_or(0)).max().unwrap_or(0);
    // The joined output, every branch, and a 3×3 conv's im2col must fit.
    if !g.fits(out.elems()) || !g.fits(x.shape.with_last(widest.max(9 * c)).elems()) {
        return g.layer(x, false);
    }
    let mut branches = Vec::new();
    for units in widths {
        let b = match units {
            None => g.layer(x, true),
            Some(units) => {
                let kind = match x.shape {
                    Shape::Image(..) => {
                        let k = g.rng.pick(&[1, 3]);
                        LayerKind::conv2d(units, k, 1, Padding::Same, g.act())
                    }
                    _ => g.dense(units),
                };
                g.push(kind, &[x], x.shape.with_last(units))
            }
        };
        branches.push(b);
    }
    let refs: Vec<&Val> = branches.iter().collect();
    g.push(LayerKind::Concat, &refs, out)
}

/// Down (pool or strided conv), one layer, up (transposed conv), concat with the skip.
fn unet_step(g: &mut Gen, x: &Val) -> Val {
    let Shape::Image(h, w, c) = x.shape else {
        return g.layer(x, false);
    };
    if h < 2 || w < 2 || h % 2 != 0 || w % 2 != 0 {
        return g.layer(x, false);
    }
    let (dh, dw) = (h / 2, w / 2);
    let down = if g.rng.chance(0.5) {
        g.push(
            LayerKind::max_pool2d(2, 2, Padding::Valid),
            &[x],
            Shape::Image(dh, dw, c),
        )
    } else {
        let f = g.rng.range(1, 12);
        if !g.fits(dh * dw * f) || !g.fits(dh * dw * 9 * c) {
            return g.layer(x, false);
        }
        g.push(
            LayerKind::conv2d(f, 3, 2, Padding::Same, Activation::Relu),
            &[x],
            Shape::Image(dh, dw, f),
        )
    };
    let mid = g.layer(&down, true);
    let f = g.rng.range(1, 8);
    if !g.fits(h * w * f) || !g.fits(dh * dw * 4 * f) || !g.fits(h * w * (c + f)) {
        return mid;
    }
    let act = g.act();
    let up = g.push(
        LayerKind::conv2d_transpose(f, 2, 2, Padding::Same, act),
        &[&mid],
        Shape::Image(h, w, f),
    );
    g.push(LayerKind::Concat, &[x, &up], Shape::Image(h, w, c + f))
}

/// Merges `x` with a value saved earlier, when the shapes allow.
fn long_skip(g: &mut Gen, x: &Val, saved: &[Val]) -> Val {
    let fits: Vec<&Val> = saved
        .iter()
        .filter(|s| s.name != x.name && s.shape.concat_compatible(x.shape))
        .collect();
    if fits.is_empty() {
        return g.layer(x, false);
    }
    let s = fits[g.rng.below(fits.len())].clone();
    if s.shape == x.shape && g.rng.chance(0.5) {
        return g.push(LayerKind::add(), &[&s, x], x.shape);
    }
    let out = x.shape.with_last(x.shape.last() + s.shape.last());
    if !g.fits(out.elems()) {
        return g.layer(x, false);
    }
    g.push(LayerKind::Concat, &[x, &s], out)
}

/// `add(x, x)` or `concat(x, x)`: one tensor read twice by one layer.
fn duplicate_read(g: &mut Gen, x: &Val) -> Val {
    let out = x.shape.with_last(2 * x.shape.last());
    if g.rng.chance(0.5) || !g.fits(out.elems()) {
        g.push(LayerKind::add(), &[x, x], x.shape)
    } else {
        g.push(LayerKind::Concat, &[x, x], out)
    }
}

/// A VAE bottleneck: mean and log-variance heads, a sample, and (70 %) their KL term.
fn vae(g: &mut Gen, x: &Val) -> Val {
    let base = match x.shape {
        Shape::Image(..) => g.flattened(x),
        _ => x.clone(),
    };
    let latent = g.rng.range(1, 8);
    let shape = base.shape.with_last(latent);
    if !g.fits(shape.elems()) {
        return g.layer(x, false);
    }
    let mean = g.push(
        LayerKind::dense(latent, Activation::Linear),
        &[&base],
        shape,
    );
    let log_var = g.push(
        LayerKind::dense(latent, Activation::Linear),
        &[&base],
        shape,
    );
    if g.rng.chance(0.7) {
        let term = LossTerm::new(LossKind::KlNormal).on(&[&mean.name, &log_var.name]);
        g.spec.loss.push(term);
    }
    g.push(LayerKind::SampleNormal, &[&mean, &log_var], shape)
}

/// A second model input of flat features, concatenated with `x` made flat.
fn second_input(g: &mut Gen, x: &Val) -> Val {
    let flat = g.flattened(x);
    let k = g.rng.range(1, 16);
    if !g.fits(flat.shape.elems() + k) {
        return g.layer(x, false);
    }
    let dt = g.data_dtype();
    let aux = g.input(Shape::Flat(k), dt);
    g.push(
        LayerKind::Concat,
        &[&flat, &aux],
        Shape::Flat(flat.shape.elems() + k),
    )
}
