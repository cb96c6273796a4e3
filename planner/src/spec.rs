//! `ModelSpec`: a model as declared — layers, their options and inputs, precision, optimizer,
//! loss, batch and budget — before any shape is inferred. The macro builds one from an
//! annotated struct; Rust code can build one with [`ModelSpec::add`].

use crate::dtype::{DType, Precision};

/// Declares the activations: the enum, [`Activation::ALL`], each one's DSL name, its parameter
/// (name and Keras's default) when it takes one, and what its backward pass reads. A new
/// activation is one line here (and its kernels, found by name: `kernels/src/activation.rs`,
/// `kernels/cuda/activation.cu`).
macro_rules! activations {
    ($($(#[$doc:meta])* $v:ident $(($p:ident = $default:literal))? = $name:literal,
       backward reads $reads:ident;)*) => {
        /// Activation applied after a layer (Keras's `activation=`). Equal (and hashed) by
        /// kind and the bits of its parameter.
        #[derive(Clone, Copy, Debug)]
        pub enum Activation {
            $($(#[$doc])* $v $({ $p: f32 })?,)*
        }

        impl Activation {
            /// Every activation, in declaration order (the order the DSL lists them), each
            /// with its default parameter.
            pub const ALL: [Activation; [$(stringify!($v)),*].len()] =
                [$(Activation::$v $({ $p: $default })?),*];

            /// The DSL name (`relu`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Activation::$v { .. } => $name,)*
                }
            }

            /// True when the backward pass needs the activation's output (relu, sigmoid,
            /// tanh, softmax); false when it needs the input (gelu, silu) or nothing.
            pub const fn backward_reads_output(self) -> bool {
                match self {
                    $(Activation::$v { .. } => matches!(Reads::$reads, Reads::Output),)*
                }
            }

            /// The variant's name in Rust source (`Relu`).
            pub const fn variant(self) -> &'static str {
                match self {
                    $(Activation::$v { .. } => stringify!($v),)*
                }
            }

            /// Its parameter's name and value (`("alpha", 0.2)`), or `None` when it takes none.
            pub const fn param(self) -> Option<(&'static str, f32)> {
                match self {
                    $(Activation::$v $({ $p })? => param_of!($($p)?),)*
                }
            }

            /// The same activation with its parameter at `value` (unchanged without one).
            pub const fn with_param(self, value: f32) -> Activation {
                let _ = value; // read only by the activations that take a parameter
                match self {
                    $(Activation::$v $({ $p: _ })? => Activation::$v $({ $p: value })?,)*
                }
            }
        }
    };
}

/// `None`, or `Some((name, value))` of the parameter bound as `$p`.
macro_rules! param_of {
    () => {
        None
    };
    ($p:ident) => {
        Some((stringify!($p), $p))
    };
}

/// What an activation's backward pass reads.
enum Reads {
    Nothing,
    Input,
    Output,
}

activations! {
    /// The identity: no op.
    Linear = "linear", backward reads Nothing;
    Relu = "relu", backward reads Output;
    Sigmoid = "sigmoid", backward reads Output;
    Tanh = "tanh", backward reads Output;
    Gelu = "gelu", backward reads Input;
    Silu = "silu", backward reads Input;
    /// `x` for `x > 0`, else `alpha·x`. The default slope is Keras's `LeakyReLU` layer's, 0.3
    /// (the function `keras.activations.leaky_relu` defaults to 0.2, PyTorch's `LeakyReLU`
    /// to 0.01: write `leaky_relu(alpha = 0.01)` for PyTorch parity).
    LeakyRelu(alpha = 0.3) = "leaky_relu", backward reads Output;
    /// `x` for `x > 0`, else `alpha·(eˣ − 1)`; Keras's and PyTorch's default alpha is 1.
    Elu(alpha = 1.0) = "elu", backward reads Output;
    /// Over the last axis.
    Softmax = "softmax", backward reads Output;
}

impl Activation {
    /// The activation called `s`, with its default parameter.
    pub fn parse(s: &str) -> Option<Activation> {
        Activation::ALL.into_iter().find(|a| a.name() == s)
    }

    /// Its parameter's bits, for equality and hashing.
    fn param_bits(self) -> Option<u32> {
        self.param().map(|(_, v)| v.to_bits())
    }

    /// `Err` with the reason when its parameter is one the kernels cannot take: a parameter
    /// (leaky relu's slope, elu's scale) must be a finite number ≥ 0, which keeps the sign
    /// of `y` that of `x`, so a backward that reads `y` sees which side of 0 `x` was on.
    pub fn check(self) -> Result<(), String> {
        match self.param() {
            Some((p, v)) if !(v.is_finite() && v >= 0.0) => Err(format!(
                "`{}`'s `{p}` must be a finite number ≥ 0 (its backward reads its output), found {v}",
                self.name()
            )),
            _ => Ok(()),
        }
    }

    /// As the DSL writes it: `relu`, `leaky_relu`, or `leaky_relu(alpha = 0.1)` when the
    /// parameter is not the default.
    pub fn dsl(self) -> String {
        let default = Activation::parse(self.name()).and_then(Activation::param);
        match self.param() {
            Some((p, v)) if default.map(|(_, d)| d.to_bits()) != Some(v.to_bits()) => {
                format!("{}({p} = {v:?})", self.name())
            }
            _ => self.name().to_string(),
        }
    }

    /// How the docs list it: `relu`, or `leaky_relu(alpha = 0.2)` with its default.
    pub fn signature(self) -> String {
        let d = Activation::parse(self.name()).unwrap_or(self);
        match d.param() {
            Some((p, v)) => format!("{}({p} = {v:?})", d.name()),
            None => d.name().to_string(),
        }
    }
}

impl PartialEq for Activation {
    fn eq(&self, other: &Activation) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.param_bits() == other.param_bits()
    }
}

impl Eq for Activation {}

impl std::hash::Hash for Activation {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::mem::discriminant(self).hash(state);
        self.param_bits().hash(state);
    }
}

impl crate::plan::ToRust for Activation {
    fn write_rust(&self, w: &mut crate::plan::RustWriter<'_>) {
        w.path("Activation::");
        w.s(self.variant());
        if let Some((p, v)) = self.param() {
            w.s("{");
            w.s(p);
            w.s(": ");
            v.write_rust(w);
            w.s(",}");
        }
    }
}

/// Convolution and pooling padding, with TensorFlow's rules (shared with the kernels).
pub use memwise_geometry::Padding;

pub use crate::layers::LayerKind;

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
    /// Selective recomputation of a norm's output (`#[recompute_output]`, or chosen by
    /// `checkpoint = auto`): a `layer_norm` or `batch_norm` whose output a later backward
    /// reads keeps its input and statistics instead of x̂ and the output, rebuilds x̂ from
    /// them in its own backward, and remakes the output just before the first backward that
    /// reads it — one activation fewer kept, for a norm's forward again. Ignored in a
    /// checkpointed layer (whose outputs are recomputed anyway).
    pub recompute_output: bool,
}

impl LayerSpec {
    /// Its kind can recompute its output from its kept input ([`LayerSpec::recompute_output`]).
    pub fn can_recompute_output(&self) -> bool {
        matches!(
            self.kind,
            LayerKind::LayerNorm { .. } | LayerKind::BatchNorm { .. }
        )
    }
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
    /// Data parallelism: how many replicas share each batch of `batch` samples (1: one
    /// device). A training plan is one replica's step: `batch / replicas` samples, the
    /// gradients summed over the replicas ([`ModelSpec::per_replica`]).
    pub replicas: usize,
    /// Which model states the replicas split among them: the optimizer state under ZeRO
    /// stage 1 (`zero = 1`); nothing by default.
    pub sharding: crate::data_parallel::Sharding,
    /// `replicas = 2..=8`: the replica counts the model may be launched with (inclusive),
    /// the job's chosen at run time; `replicas` is then the smallest, whose per-replica step
    /// is the largest. `None`: any count (the launcher's re-plan decides).
    pub replica_range: Option<[usize; 2]>,
    /// Model parallelism: the stages the model is split into, its micro-batches and their
    /// schedule ([`crate::stage`]); `None`: the whole model on each device.
    pub pipeline: Option<crate::stage::Pipeline>,
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
            replicas: 1,
            sharding: crate::data_parallel::Sharding::Replicated,
            replica_range: None,
            pipeline: None,
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
            recompute_output: false,
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

    /// Marks the named layers' outputs for selective recomputation
    /// ([`LayerSpec::recompute_output`]).
    pub fn recompute_output(&mut self, layers: &[&str]) {
        for l in self.layers.iter_mut() {
            if layers.contains(&l.name.as_str()) {
                l.recompute_output = true;
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

    /// The same model trained on `replicas` data-parallel replicas (the global batch stays).
    pub fn with_replicas(&self, replicas: usize) -> Self {
        ModelSpec {
            replicas,
            ..self.clone()
        }
    }

    /// The same model on one device: no replicas, nothing sharded, no declared range.
    pub fn one_device(&self) -> Self {
        ModelSpec {
            replicas: 1,
            sharding: crate::data_parallel::Sharding::Replicated,
            replica_range: None,
            ..self.clone()
        }
    }

    /// The same model with its replicas' model states split as `sharding` says.
    pub fn with_sharding(&self, sharding: crate::data_parallel::Sharding) -> Self {
        ModelSpec {
            sharding,
            ..self.clone()
        }
    }

    /// One replica's share of a data-parallel step: `batch / replicas` samples, and every
    /// loss term's weight divided by `replicas`. Every loss is a mean over the batch, so the
    /// sum over the replicas of their losses and of their gradients is the loss and the
    /// gradient of the whole batch: the collective only ever sums. `replicas` is kept, so the
    /// plan adds the gradient sums. A batch the replicas do not divide is an error.
    pub fn per_replica(&self) -> Result<ModelSpec, crate::PlanError> {
        let n = self.replicas;
        if n == 0 {
            return Err(crate::PlanError::model("`replicas` must be at least 1"));
        }
        if let Some([lo, hi]) = self.replica_range {
            if !(lo..=hi).contains(&n) {
                return Err(crate::PlanError::model(format!(
                    "the model is declared for {lo} to {hi} replicas (`replicas = {lo}..={hi}`), \
                     not {n}: launch between {lo} and {hi} ranks, or widen the range"
                )));
            }
        }
        if self.sharding == crate::data_parallel::Sharding::Gradients {
            return Err(crate::PlanError::model(
                "`zero = 2` (gradients sharded too) is not executed yet: `zero = 1` shards the \
                 optimizer state; `memwise::plan::data_parallel::replica_states` gives stage 2's \
                 per-replica bytes",
            ));
        }
        if n == 1 {
            return Ok(self.clone());
        }
        if !self.batch.is_multiple_of(n) {
            let below = self.batch / n * n;
            let above = below + n;
            return Err(crate::PlanError::model(format!(
                "`batch = {}` does not split evenly over {n} replicas: the global batch must be a \
                 multiple of the replica count (`batch = {}` or `batch = {above}` would be)",
                self.batch,
                below.max(n),
            )));
        }
        let mut local = self.with_batch(self.batch / n);
        for term in &mut local.loss {
            term.weight /= n as f32;
        }
        Ok(local)
    }
}
