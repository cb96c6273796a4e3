//! `ModelSpec`: a model as declared — layers, their options and inputs, precision, optimizer,
//! loss, batch and budget — before any shape is inferred. The macro builds one from an
//! annotated struct; Rust code can build one with [`ModelSpec::add`].

use crate::dtype::{DType, Precision};

/// Activation applied after a layer (Keras's `activation=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Linear,
    Relu,
    Sigmoid,
    Tanh,
    Gelu,
    Silu,
    Softmax,
}

impl Activation {
    pub const ALL: [Activation; 7] = [
        Activation::Linear,
        Activation::Relu,
        Activation::Sigmoid,
        Activation::Tanh,
        Activation::Gelu,
        Activation::Silu,
        Activation::Softmax,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Activation::Linear => "linear",
            Activation::Relu => "relu",
            Activation::Sigmoid => "sigmoid",
            Activation::Tanh => "tanh",
            Activation::Gelu => "gelu",
            Activation::Silu => "silu",
            Activation::Softmax => "softmax",
        }
    }

    pub fn parse(s: &str) -> Option<Activation> {
        Activation::ALL.into_iter().find(|a| a.name() == s)
    }

    /// True when the backward pass needs the activation's output (relu, sigmoid, tanh,
    /// softmax); false when it needs the input (gelu, silu).
    pub const fn backward_reads_output(self) -> bool {
        matches!(
            self,
            Activation::Relu | Activation::Sigmoid | Activation::Tanh | Activation::Softmax
        )
    }
}

/// Convolution and pooling padding, with TensorFlow's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Padding {
    /// Output `ceil(in / stride)`; the input is padded, the extra pixel after.
    Same,
    /// No padding: output `(in - kernel) / stride + 1`.
    Valid,
}

impl Padding {
    pub const fn name(self) -> &'static str {
        match self {
            Padding::Same => "same",
            Padding::Valid => "valid",
        }
    }
}

/// One layer's kind and options. Shapes exclude the batch dimension.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerKind {
    /// A model input. `dtype` is how it is stored (u8 pixels, i32 labels/ids, or a float);
    /// u8 inputs are scaled by `scale` into the compute dtype inside the step.
    Input {
        shape: Vec<usize>,
        dtype: DType,
        scale: f32,
    },
    Dense {
        units: usize,
        activation: Activation,
        use_bias: bool,
    },
    Conv2d {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        activation: Activation,
        use_bias: bool,
    },
    DepthwiseConv2d {
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        multiplier: usize,
        activation: Activation,
        use_bias: bool,
    },
    SeparableConv2d {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        multiplier: usize,
        activation: Activation,
        use_bias: bool,
    },
    Conv2dTranspose {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        activation: Activation,
        use_bias: bool,
    },
    MaxPool2d {
        pool: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    AvgPool2d {
        pool: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
    },
    GlobalAvgPool,
    /// Batch normalisation in training mode over the last axis (Keras defaults 0.99, 1e-3).
    BatchNorm {
        momentum: f32,
        epsilon: f32,
    },
    LayerNorm {
        epsilon: f32,
    },
    Dropout {
        rate: f32,
    },
    /// A view: no op, no new bytes.
    Flatten,
    /// A view to `shape` (without batch): no op, no new bytes.
    Reshape {
        shape: Vec<usize>,
    },
    /// Element-wise sum of two or more inputs of the same shape, then `activation`.
    Add {
        activation: Activation,
    },
    /// Concatenation along the last axis.
    Concat,
    /// Token ids (i32) → vectors.
    Embedding {
        vocab: usize,
        dim: usize,
    },
    /// Multi-head self-attention over `[seq, hidden]`: fused QKV projection, scaled
    /// dot-product attention (optionally causal, with dropout on the probabilities) and an
    /// output projection.
    Attention {
        heads: usize,
        causal: bool,
        dropout: f32,
    },
    Activation(Activation),
    /// The VAE's reparameterisation: inputs `(mean, log_var)`, output `mean + exp(log_var/2)·ε`.
    SampleNormal,
}

impl LayerKind {
    /// The attribute name the DSL uses for this layer.
    pub fn name(&self) -> &'static str {
        match self {
            LayerKind::Input { .. } => "input",
            LayerKind::Dense { .. } => "dense",
            LayerKind::Conv2d { .. } => "conv2d",
            LayerKind::DepthwiseConv2d { .. } => "depthwise_conv2d",
            LayerKind::SeparableConv2d { .. } => "separable_conv2d",
            LayerKind::Conv2dTranspose { .. } => "conv2d_transpose",
            LayerKind::MaxPool2d { .. } => "max_pool2d",
            LayerKind::AvgPool2d { .. } => "avg_pool2d",
            LayerKind::GlobalAvgPool => "global_avg_pool",
            LayerKind::BatchNorm { .. } => "batch_norm",
            LayerKind::LayerNorm { .. } => "layer_norm",
            LayerKind::Dropout { .. } => "dropout",
            LayerKind::Flatten => "flatten",
            LayerKind::Reshape { .. } => "reshape",
            LayerKind::Add { .. } => "add",
            LayerKind::Concat => "concat",
            LayerKind::Embedding { .. } => "embedding",
            LayerKind::Attention { .. } => "attention",
            LayerKind::Activation(_) => "activation",
            LayerKind::SampleNormal => "sample_normal",
        }
    }

    /// Dense layer with bias.
    pub fn dense(units: usize, activation: Activation) -> Self {
        LayerKind::Dense {
            units,
            activation,
            use_bias: true,
        }
    }

    /// Square-kernel conv2d with bias.
    pub fn conv2d(
        filters: usize,
        kernel: usize,
        stride: usize,
        padding: Padding,
        activation: Activation,
    ) -> Self {
        LayerKind::Conv2d {
            filters,
            kernel: [kernel; 2],
            strides: [stride; 2],
            padding,
            activation,
            use_bias: true,
        }
    }

    /// Square-kernel separable conv2d (depth multiplier 1) with bias.
    pub fn separable_conv2d(
        filters: usize,
        kernel: usize,
        stride: usize,
        padding: Padding,
        activation: Activation,
    ) -> Self {
        LayerKind::SeparableConv2d {
            filters,
            kernel: [kernel; 2],
            strides: [stride; 2],
            padding,
            multiplier: 1,
            activation,
            use_bias: true,
        }
    }

    /// Square-kernel depthwise conv2d (multiplier 1).
    pub fn depthwise_conv2d(
        kernel: usize,
        stride: usize,
        padding: Padding,
        activation: Activation,
    ) -> Self {
        LayerKind::DepthwiseConv2d {
            kernel: [kernel; 2],
            strides: [stride; 2],
            padding,
            multiplier: 1,
            activation,
            use_bias: true,
        }
    }

    /// Square-kernel transposed conv2d with bias.
    pub fn conv2d_transpose(
        filters: usize,
        kernel: usize,
        stride: usize,
        padding: Padding,
        activation: Activation,
    ) -> Self {
        LayerKind::Conv2dTranspose {
            filters,
            kernel: [kernel; 2],
            strides: [stride; 2],
            padding,
            activation,
            use_bias: true,
        }
    }

    pub fn max_pool2d(pool: usize, stride: usize, padding: Padding) -> Self {
        LayerKind::MaxPool2d {
            pool: [pool; 2],
            strides: [stride; 2],
            padding,
        }
    }

    pub fn avg_pool2d(pool: usize, stride: usize, padding: Padding) -> Self {
        LayerKind::AvgPool2d {
            pool: [pool; 2],
            strides: [stride; 2],
            padding,
        }
    }

    /// Keras defaults: momentum 0.99, epsilon 1e-3.
    pub fn batch_norm() -> Self {
        LayerKind::BatchNorm {
            momentum: 0.99,
            epsilon: 1e-3,
        }
    }

    /// Keras default epsilon 1e-3 (PyTorch uses 1e-5; say `epsilon = 1e-5` for parity).
    pub fn layer_norm() -> Self {
        LayerKind::LayerNorm { epsilon: 1e-3 }
    }

    pub fn add() -> Self {
        LayerKind::Add {
            activation: Activation::Linear,
        }
    }
}

/// The optimizer and its hyper-parameters (Keras names and defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    Sgd {
        lr: f32,
    },
    Momentum {
        lr: f32,
        momentum: f32,
        nesterov: bool,
    },
    RmsProp {
        lr: f32,
        rho: f32,
        epsilon: f32,
        momentum: f32,
        centered: bool,
    },
    Adam {
        lr: f32,
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
    },
    AdamW {
        lr: f32,
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        weight_decay: f32,
    },
}

impl Optimizer {
    /// Keras defaults.
    pub const SGD: Optimizer = Optimizer::Sgd { lr: 0.01 };
    pub const MOMENTUM: Optimizer = Optimizer::Momentum {
        lr: 0.01,
        momentum: 0.9,
        nesterov: false,
    };
    pub const RMSPROP: Optimizer = Optimizer::RmsProp {
        lr: 1e-3,
        rho: 0.9,
        epsilon: 1e-7,
        momentum: 0.0,
        centered: false,
    };
    pub const ADAM: Optimizer = Optimizer::Adam {
        lr: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };
    pub const ADAMW: Optimizer = Optimizer::AdamW {
        lr: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
        weight_decay: 0.004,
    };

    pub const fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Momentum { .. } => "momentum",
            Optimizer::RmsProp { .. } => "rmsprop",
            Optimizer::Adam { .. } => "adam",
            Optimizer::AdamW { .. } => "adamw",
        }
    }

    /// f32 state copies kept per trainable parameter element.
    pub const fn state_slots(&self) -> u64 {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::Momentum { momentum, .. } => (*momentum != 0.0) as u64,
            Optimizer::RmsProp {
                momentum, centered, ..
            } => 1 + (*momentum > 0.0) as u64 + *centered as u64,
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => 2,
        }
    }

    pub const fn learning_rate(&self) -> f32 {
        match *self {
            Optimizer::Sgd { lr }
            | Optimizer::Momentum { lr, .. }
            | Optimizer::RmsProp { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::AdamW { lr, .. } => lr,
        }
    }
}

/// A loss function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossKind {
    /// Integer labels vs class probabilities (or logits, when the prediction has no softmax).
    SparseCategoricalCrossentropy,
    /// Targets in [0, 1] vs probabilities (fused with a preceding sigmoid).
    BinaryCrossentropy,
    MeanSquaredError,
    /// KL divergence of N(mean, exp(log_var)) from N(0, 1): inputs `(mean, log_var)`.
    KlNormal,
}

impl LossKind {
    pub const fn name(self) -> &'static str {
        match self {
            LossKind::SparseCategoricalCrossentropy => "sparse_categorical_crossentropy",
            LossKind::BinaryCrossentropy => "binary_crossentropy",
            LossKind::MeanSquaredError => "mse",
            LossKind::KlNormal => "kl_normal",
        }
    }

    pub fn parse(s: &str) -> Option<LossKind> {
        Some(match s {
            "sparse_categorical_crossentropy" => LossKind::SparseCategoricalCrossentropy,
            "binary_crossentropy" | "bce" => LossKind::BinaryCrossentropy,
            "mse" | "mean_squared_error" => LossKind::MeanSquaredError,
            "kl_normal" | "kl_divergence" | "kl" => LossKind::KlNormal,
            _ => return None,
        })
    }
}

/// How a loss reduces over elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// Mean over every element (Keras's default).
    Mean,
    /// Sum over the features of a sample, mean over the batch (the Keras VAE example's
    /// reconstruction and KL terms).
    SumOverFeatures,
}

impl Reduction {
    pub const fn name(self) -> &'static str {
        match self {
            Reduction::Mean => "mean",
            Reduction::SumOverFeatures => "sum",
        }
    }
}

/// One term of the loss: `weight · kind(inputs…)`. Empty `inputs` means the default:
/// the last layer as prediction and the model's one unconsumed input as target.
#[derive(Clone, Debug, PartialEq)]
pub struct LossTerm {
    pub kind: LossKind,
    pub inputs: Vec<String>,
    pub weight: f32,
    pub reduction: Reduction,
}

impl LossTerm {
    pub fn new(kind: LossKind) -> Self {
        let reduction = match kind {
            LossKind::KlNormal => Reduction::SumOverFeatures,
            _ => Reduction::Mean,
        };
        LossTerm {
            kind,
            inputs: Vec::new(),
            weight: 1.0,
            reduction,
        }
    }

    pub fn on(mut self, inputs: &[&str]) -> Self {
        self.inputs = inputs.iter().map(|s| s.to_string()).collect();
        self
    }

    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    pub fn weight(mut self, weight: f32) -> Self {
        self.weight = weight;
        self
    }
}

/// A metric reported by training (the planner only records it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    Accuracy,
    BinaryAccuracy,
    MeanSquaredError,
}

impl Metric {
    pub const fn name(self) -> &'static str {
        match self {
            Metric::Accuracy => "accuracy",
            Metric::BinaryAccuracy => "binary_accuracy",
            Metric::MeanSquaredError => "mse",
        }
    }

    pub fn parse(s: &str) -> Option<Metric> {
        Some(match s {
            "accuracy" | "acc" => Metric::Accuracy,
            "binary_accuracy" => Metric::BinaryAccuracy,
            "mse" | "mean_squared_error" => Metric::MeanSquaredError,
            _ => return None,
        })
    }
}

/// One declared layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// The field name: unique in the model, prefixes its parameters (`hidden.weight`).
    pub name: String,
    pub kind: LayerKind,
    /// Named inputs; empty means "the previous layer".
    pub inputs: Vec<String>,
    /// A per-layer precision override (`#[fp16]`, `#[bf16]`, `#[f32]`).
    pub dtype: Option<DType>,
    /// Checkpoint segment: consecutive layers with the same id form one segment whose inner
    /// tensors are dropped after forward and recomputed before their backward.
    pub checkpoint: Option<u32>,
}

/// A whole model as declared.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub name: String,
    pub batch: usize,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub loss: Vec<LossTerm>,
    pub metrics: Vec<Metric>,
    pub layers: Vec<LayerSpec>,
    /// Budget in bytes for one training step, if any.
    pub budget: Option<u64>,
}

impl ModelSpec {
    /// An empty model: float32, RMSprop with Keras defaults, no loss yet.
    pub fn new(name: &str, batch: usize) -> Self {
        ModelSpec {
            name: name.to_string(),
            batch,
            precision: Precision::Float32,
            optimizer: Optimizer::RMSPROP,
            loss: Vec::new(),
            metrics: Vec::new(),
            layers: Vec::new(),
            budget: None,
        }
    }

    /// Appends a layer reading `inputs` (empty: the previous layer) and returns its name.
    pub fn add(&mut self, name: &str, kind: LayerKind, inputs: &[&str]) -> String {
        self.layers.push(LayerSpec {
            name: name.to_string(),
            kind,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            dtype: None,
            checkpoint: None,
        });
        name.to_string()
    }

    /// Appends an input layer and returns its name.
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType, scale: f32) -> String {
        self.add(
            name,
            LayerKind::Input {
                shape: shape.to_vec(),
                dtype,
                scale,
            },
            &[],
        )
    }

    /// Puts the named layers into checkpoint segment `segment`.
    pub fn checkpoint(&mut self, layers: &[&str], segment: u32) {
        for l in self.layers.iter_mut() {
            if layers.contains(&l.name.as_str()) {
                l.checkpoint = Some(segment);
            }
        }
    }

    /// Sets a per-layer precision override.
    pub fn set_dtype(&mut self, layer: &str, dtype: DType) {
        if let Some(l) = self.layers.iter_mut().find(|l| l.name == layer) {
            l.dtype = Some(dtype);
        }
    }

    pub fn layer(&self, name: &str) -> Option<&LayerSpec> {
        self.layers.iter().find(|l| l.name == name)
    }

    /// The same model at another batch size.
    pub fn with_batch(&self, batch: usize) -> Self {
        ModelSpec {
            batch,
            ..self.clone()
        }
    }
}
