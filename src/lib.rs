//! memwise: declare a model as an annotated struct; the compiler plans its memory.
//!
//! ```
//! use memwise::prelude::*;
//!
//! #[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3),
//!                  loss = sparse_categorical_crossentropy, budget = "2 GiB")]
//! pub struct MnistMlp {
//!     #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
//!     pixels: Input,
//!     #[input(shape = [], dtype = i32)]
//!     labels: Input,
//!     #[dense(512, activation = relu, from = pixels)]
//!     hidden: Dense,
//!     #[dense(10, activation = softmax)]
//!     probs: Dense,
//! }
//!
//! // Known when `cargo check` finishes:
//! const _: () = assert!(MnistMlp::MEMORY.total < 8 << 20);
//! # fn main() {}
//! ```
//!
//! The DSL is documented on [`model`] (every attribute) and [`block`] (repetition); the
//! design notes are in `docs/DSL.md`.
pub mod cli;
pub mod layers;
pub mod prelude;
pub mod summary;

pub use memwise_plan as plan;
pub use memwise_runtime as runtime;
/// The image-folder loader (Keras's `image_dataset_from_directory`), at the top for users of
/// the facade alone.
pub use memwise_runtime::data::image_folder::{ImageFolder, LabelMode, Subset};
/// JSON values for [`cli::Args::finish`]'s metrics and the run report, so a program needs no
/// dependency besides memwise: `memwise::serde_json::json!({"val_accuracy": acc})`.
pub use serde_json;

#[doc(hidden)]
pub use memwise_macros::__model_continue;

/// Declares a model: a struct whose fields are layers. The macro plans one training step
/// at compile time and adds the plan to the struct as consts — or stops the build with a
/// spanned error.
///
/// ```
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
///                  metrics = [accuracy], budget = "2 GiB")]
/// pub struct MnistMlp {
///     #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
///     pixels: Input,
///     #[input(shape = [], dtype = i32)]
///     labels: Input,
///     #[dense(512, activation = relu, from = pixels)]
///     hidden: Dense,
///     #[dense(10, activation = softmax)]
///     probs: Dense,
/// }
///
/// const _: () = assert!(MnistMlp::MEMORY.total <= 4 << 30);
///
/// fn main() {
///     println!("{}", MnistMlp::summary());
///     assert_eq!(MnistMlp::PARAMS, 407_050);
///     assert_eq!(MnistMlp::layers().hidden.params()[0].name, "hidden.weight");
/// }
/// ```
///
/// # The model attribute
///
/// | argument | values | default |
/// |---|---|---|
/// | `batch` | a positive integer (also `batch_size`) | 32 (Keras's `fit`) |
/// | `optimizer` | `sgd`, `momentum`, `rmsprop`, `adam`, `adamw`, bare or with options: `adam(lr = 1e-4)` | `rmsprop` |
/// | `loss` | a loss, or a weighted sum of terms (below) | required |
/// | `metrics` | `[accuracy]`, `[binary_accuracy]`, `[mse]` (recorded for training) | none |
/// | `budget` | a string: `"512 MiB"`, `"8 GiB"`, `"1.5 GiB"` (powers of 1024) or `"80GB"` (powers of 1000) | none |
/// | `precision` | `float32`, `mixed_float16`, `mixed_bfloat16` (Keras's global policy) | `float32` |
/// | `checkpoint` | `auto`: the macro chooses the segments to checkpoint so the step fits `budget` (required with it) with the least recomputation; `AUTO_CHECKPOINT` says what it chose | none (`#[checkpoint]` on fields) |
/// | `replicas` | data-parallel replicas sharing each global `batch` (which they must divide), or a range of counts chosen at run time, `2..=8` (the consts are then the smallest count's, whose replicas hold the most); the plan and `MEMORY` are one replica's (`docs/DATA_PARALLEL.md`) | 1 |
/// | `zero` | the ZeRO stage: `1` shards the optimizer state over the replicas (each updates its 1/N, then the weights are gathered), `0` none | 0 |
/// | `stages` | model parallel: `N` splits the model into N pipeline stages (one device each), the split chosen to make the largest stage's memory smallest, then the bubble; `auto` takes the fewest stages (up to 8) whose largest fits `budget`. Or mark the fields with `#[stage(k)]` (`docs/PIPELINE.md`) | one stage |
/// | `micro_batches` | each batch is cut into this many micro-batches, which flow through the stages (it must divide `batch`); with one stage this is gradient accumulation | 1 |
/// | `schedule` | the stages' order of micro-batches: `one_f_one_b` (1F1B: a stage keeps at most as many in flight as stages follow it) or `gpipe` (every forward, then every backward) | `one_f_one_b` |
///
/// Optimizer options, with Keras's names and defaults: `sgd(lr = 0.01, momentum = 0.0,
/// nesterov = false)` (a momentum above 0 makes it `momentum`), `momentum(lr = 0.01,
/// momentum = 0.9, nesterov = false)`, `rmsprop(lr = 1e-3, rho = 0.9, epsilon = 1e-7,
/// momentum = 0.0, centered = false)`, `adam(lr = 1e-3, beta_1 = 0.9, beta_2 = 0.999,
/// epsilon = 1e-7)`, `adamw(…, weight_decay = 0.004)`. `lr` may be spelt `learning_rate`
/// or given first: `adam(3e-4)`.
///
/// Losses: `sparse_categorical_crossentropy`, `binary_crossentropy` (`bce`), `mse`
/// (`mean_squared_error`), `kl_normal` (`kl`). Bare, a loss reads the last layer as its
/// prediction and the one input no layer reads as its target. Called, it names its fields
/// — `(prediction, target)`, or `(mean, log_var)` for `kl_normal` — and takes
/// `reduction = mean | sum` (sum over features, mean over the batch) and `weight = w`.
/// Terms add up, and a number in front weights a term:
///
/// ```
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 32, optimizer = adam,
///                  loss = binary_crossentropy(decoded, pixels, reduction = sum) + 0.5 * kl_normal(z_mean, z_log_var))]
/// struct Vae {
///     #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
///     pixels: Input,
///     #[dense(64, activation = relu)]
///     encoder: Dense,
///     #[dense(2, from = encoder)]
///     z_mean: Dense,
///     #[dense(2, from = encoder)]
///     z_log_var: Dense,
///     #[sample_normal(z_mean, z_log_var)]
///     z: SampleNormal,
///     #[dense(784, activation = sigmoid)]
///     decoded: Dense,
/// }
/// # fn main() { assert_eq!(Vae::spec().loss.len(), 2); }
/// ```
///
/// # Layer attributes
///
/// Every field carries exactly one layer attribute, and its type is the layer's handle
/// from [`layers`] (an array `[T; N]` repeats the layer N times in a row). Options use
/// Keras's names and defaults; the ones in the "positional" column may be given in that
/// order without a name. A layer reads the field above it unless `from = field` names
/// another; `add`, `concat` and `sample_normal` name their inputs as arguments.
/// Option values may be numbers with `+ - * /` (`7 * 7 * 64`, `1.0 / 255.0`), names
/// (`relu`, `same`), or lists (`[3, 3]`); `kernel_size`, `strides` and `pool_size` take one
/// number or two.
///
// The table, the activations and the aliases are written from the planner's layer
// catalogue (`memwise::plan::layers`), so they list every layer with its real defaults.
#[doc = memwise_macros::__layer_docs!()]
///
/// ```
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
/// struct Cnn {
///     #[input(shape = [32, 32, 3], dtype = u8, scale = 1.0 / 255.0)]
///     image: Input,
///     #[conv2d(32, 3, padding = same, use_bias = false)]
///     conv: Conv2d,
///     #[batch_norm]
///     bn: BatchNorm,
///     #[activation(relu)]
///     relu: Activation,
///     #[depthwise_conv2d(3, strides = 2, padding = same, activation = relu)]
///     depthwise: DepthwiseConv2d,
///     #[separable_conv2d(64, 3, padding = same, activation = relu)]
///     separable: SeparableConv2d,
///     #[max_pool2d(2)]
///     max_pool: MaxPool2d,
///     #[conv2d_transpose(32, 3, strides = 2, padding = same)]
///     up: Conv2dTranspose,
///     #[avg_pool2d(pool_size = 2, strides = 2)]
///     avg_pool: AvgPool2d,
///     #[conv2d(32, 1, from = up)]
///     skip: Conv2d,
///     #[max_pool2d(2)]
///     skip_pool: MaxPool2d,
///     #[add(avg_pool, skip_pool, activation = relu)]
///     merged: Add,
///     #[concat(merged, avg_pool)]
///     both: Concat,
///     #[global_avg_pool]
///     pool: GlobalAvgPool,
///     #[dropout(0.5)]
///     drop: Dropout,
///     #[dense(10, activation = softmax)]
///     probs: Dense,
///     #[input(shape = [], dtype = i32)]
///     label: Input,
/// }
///
/// #[memwise::model(batch = 4, precision = mixed_float16, loss = sparse_categorical_crossentropy(logits, next))]
/// struct TinyLm {
///     #[input(shape = [64], dtype = i32)]
///     ids: Input,
///     #[input(shape = [64], dtype = i32)]
///     next: Input,
///     #[embedding(input_dim = 512, output_dim = 32, from = ids)]
///     embed: Embedding,
///     #[layer_norm(epsilon = 1e-5)]
///     norm: LayerNorm,
///     #[attention(num_heads = 4, causal = true)]
///     attn: Attention,
///     #[dense(64)]
///     flat_in: Dense,
///     #[flatten]
///     flat: Flatten,
///     #[reshape([64, 64])]
///     back: Reshape,
///     #[dense(512)]
///     logits: Dense,
/// }
/// # fn main() { assert!(Cnn::MEMORY.total > 0 && TinyLm::MEMORY.total > 0); }
/// ```
///
/// # Modifiers
///
/// - `#[checkpoint]`: the field's activations are dropped after the forward pass and
///   recomputed before its backward pass. A run of consecutive `#[checkpoint]` fields is
///   **one** segment (everything inside it is recomputed; only its input stays). To cut a
///   run in two, number the segments: `#[checkpoint(segment = 1)]` … `#[checkpoint(segment
///   = 2)]`; consecutive fields with the same number form one segment. A checkpointed
///   block field is one segment per instance. Inputs cannot be checkpointed.
/// - `#[recompute_output]` (on a `layer_norm` or `batch_norm` field): selective
///   recomputation of one op. The norm keeps its input instead of x̂ and its output, and its
///   output is remade (the norm's forward again) just before the first backward that reads
///   it — in a transformer, one `s·b·h` activation fewer per norm for a few FLOPs per
///   element. `checkpoint = auto` weighs it next to segments. Not beside `#[checkpoint]`.
/// - `#[fp16]`, `#[bf16]`, `#[f32]`: the layer computes and stores its activations in that
///   type, whatever the model's `precision` (one per field; not on inputs).
/// - `#[stage(k)]` (on a model's field): model parallel — this field and the ones after it,
///   up to the next `#[stage]`, are pipeline stage `k` (stages numbered from 0 in field
///   order; the fields before the first `#[stage]` are stage 0). A checkpoint segment stays
///   within one stage.
///
/// ```
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 256, precision = mixed_float16, loss = mse(out, x))]
/// struct Deep {
///     #[input(shape = [512])]
///     x: Input,
///     #[checkpoint]
///     #[dense(512, activation = relu)]
///     a: Dense,
///     #[checkpoint]
///     #[dense(512, activation = relu)]
///     b: Dense,
///     #[checkpoint(segment = 2)]
///     #[dense(512, activation = relu)]
///     c: Dense,
///     #[f32]
///     #[dense(512)]
///     out: Dense,
/// }
/// # fn main() {
/// #     let s = Deep::spec();
/// #     assert_eq!(s.layer("a").unwrap().checkpoint, s.layer("b").unwrap().checkpoint);
/// #     assert_ne!(s.layer("b").unwrap().checkpoint, s.layer("c").unwrap().checkpoint);
/// # }
/// ```
///
/// # Repetition
///
/// An array field repeats its layer (`[Dense; 3]`: three in a row, named `field.0` …). A
/// `#[block(args)]` field instantiates a [`macro@block`]; an array of blocks repeats it,
/// each instance reading the previous one's output. See [`macro@block`].
///
/// # What it generates
///
/// The struct stays an ordinary struct (the macro's attributes removed) whose fields are
/// layer handles, plus, as inherent items and through the [`Model`] trait:
///
/// - `const PLAN: memwise::plan::StaticPlan` — every step, tensor, offset of one training
///   step, executed later by the runtime;
/// - `const MEMORY: memwise::plan::MemoryReport` — params, grads, optimizer state,
///   activations, workspace, inputs, `total`; usable in `const` context;
/// - `const PARAMS: u64`;
/// - `fn spec() -> ModelSpec` (the model as declared), `fn plan_for_batch(n)`,
///   `fn summary() -> String` (a Keras-like table), `const fn layers() -> Self` (the
///   handles: layer names and parameter ids in `PLAN`).
///
/// - with `budget = "…"`: `const MAX_BATCH: usize`, the largest batch whose step fits the
///   budget (with `checkpoint = auto`, checkpointed as the solver chooses at that batch);
/// - with `checkpoint = auto`: `const AUTO_CHECKPOINT: &str`, what the solver chose and what
///   it costs ("checkpoints 2 segments (5 layers): … recomputes 31% of forward FLOPs"),
///   also shown by `summary()`;
/// - split into pipeline stages (`#[stage(k)]`, `stages`, `micro_batches`): `const STAGES:
///   &[StaticPlan]` (every stage's plan, each run by its own rank through
///   `memwise::runtime::stage::StageTrainer`), `const STAGE_MEMORY: [MemoryReport; N]`,
///   `const LARGEST_STAGE: usize`, `const MICRO_BATCHES: usize`, `const BUBBLE_FRACTION:
///   f64`; `PLAN` and `MEMORY` stay the whole model on one device, for comparison, and the
///   budget (with `MAX_BATCH`) applies to each stage. `summary()` shows every stage.
///
/// The [`Model`] trait adds `MyNet::new(&Device)` (import `memwise::Model`, or use the
/// prelude): the model built on a device, ready to `fit`, `evaluate` and `predict`;
/// `MyNet::fit_to_device(&device)`, the same built to fit the memory the device has free
/// (as declared, else checkpointed, else at a smaller batch — decided by the planner, never
/// by trial and OOM); and `MyNet::max_batch(budget)` / `max_batch_with(budget, policy)` at
/// run time.
///
/// # The budget error
///
/// With `budget = "…"`, a plan that does not fit stops the build with one error on the
/// `budget` argument: what the step needs, the breakdown, and the fixes that were planned
/// and fit — the largest batch, `mixed_float16`, which fields to `#[checkpoint]`:
///
/// ```compile_fail
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 4096, loss = mse(out, x), budget = "64 MiB")]
/// struct TooBig {
///     #[input(shape = [1024])]
///     x: Input,
///     #[dense(1024, activation = relu)]
///     hidden: Dense,
///     #[dense(1024)]
///     out: Dense,
/// }
/// # fn main() {}
/// ```
///
/// ```text
/// error: model `TooBig` needs 88.09 MiB but the budget is 64 MiB (24.09 MiB over)
///        = note: at batch 4096, float32: params 8.01 MiB + grads 8.01 MiB + optimizer 8.01 MiB + activations 48 MiB + workspace 72 KiB + inputs 16 MiB = 88.09 MiB total, budget 64 MiB
///        = help: each of these fits (planned):
///                - `batch = 2553` (the largest batch that fits): 63.98 MiB
///                - `replicas = 2` (data parallel: 2 devices, each planned for 2048 of the 4096 samples): 56.09 MiB per device
///        = note: these do not fit alone:
///                - `precision = mixed_float16` still needs 76.03 MiB (with it, `batch = 3069` fits)
///                - checkpointing: the best placement tried still needs 88.09 MiB
///  --> src/main.rs:3:52
///   |
/// 3 | #[memwise::model(batch = 4096, loss = mse(out, x), budget = "64 MiB")]
///   |                                                    ^^^^^^^^^^^^^^^^^
/// ```
///
/// Every other mistake — an unknown layer or option (with a suggestion), a missing or
/// mistyped option, a reference to an unknown or later field, two layers on one field,
/// shapes that do not match — is an error on the field at fault.
pub use memwise_macros::model;

/// Declares a reusable block of layers with parameters, used as a field type by
/// [`macro@model`] (or by another block) with `#[block(param = value, …)]`.
///
/// A block's fields are layers like a model's, but it has no inputs: its first field reads
/// the field above the `#[block]` field (or `from = field` given there), and the name
/// `input` refers to that input inside the block. Its output is its last field. Parameters
/// are declared in the attribute, optionally with a default, and used in option values,
/// with arithmetic: `filters * 4`.
///
/// An array of blocks, `[Bottleneck; 3]`, chains three instances. Layers are named
/// `field.inner` (or `field.i.inner` in an array), PyTorch's state-dict names.
///
/// ```
/// use memwise::prelude::*;
///
/// /// A residual bottleneck; `strides = 2` halves the resolution.
/// #[memwise::block(filters, strides = 1)]
/// pub struct Bottleneck {
///     #[conv2d(filters * 4, 1, strides = strides, use_bias = false)]
///     shortcut: Conv2d,
///     #[conv2d(filters, 1, strides = strides, activation = relu, from = input)]
///     reduce: Conv2d,
///     #[conv2d(filters, 3, padding = same, activation = relu)]
///     conv: Conv2d,
///     #[conv2d(filters * 4, 1)]
///     expand: Conv2d,
///     #[add(shortcut, expand, activation = relu)]
///     out: Add,
/// }
///
/// #[memwise::model(batch = 8, loss = sparse_categorical_crossentropy)]
/// pub struct Net {
///     #[input(shape = [64, 64, 3])]
///     image: Input,
///     #[block(filters = 16, strides = 2)]
///     stage1: Bottleneck,
///     #[checkpoint]
///     #[block(filters = 32, strides = 2)]
///     stage2: [Bottleneck; 3],
///     #[global_avg_pool]
///     pool: GlobalAvgPool,
///     #[dense(10, activation = softmax)]
///     probs: Dense,
///     #[input(shape = [], dtype = i32)]
///     label: Input,
/// }
///
/// fn main() {
///     let spec = Net::spec();
///     assert_eq!(spec.layer("stage2.2.out").unwrap().inputs, ["stage2.2.shortcut", "stage2.2.expand"]);
///     assert_eq!(spec.layer("stage2.1.reduce").unwrap().inputs, ["stage2.0.out"]);
/// }
/// ```
///
/// Blocks may contain blocks. The model macro reads a block's definition through a
/// `macro_rules!` the block macro leaves next to it, named like the struct: import a block
/// where the model is (`use blocks::Bottleneck;`), as you would the type, and blocks nested
/// in blocks must be importable under the same path from the model's module. A block is
/// usable within its crate.
pub use memwise_macros::block;

use plan::{MemoryReport, ModelSpec, PlanError, StaticPlan};

/// What `#[memwise::model]` implements for a model struct (the same items are inherent, so
/// `MyNet::MEMORY` needs no import). The runtime is generic over it.
///
/// Training a model of your own, from data in memory to saved weights:
///
/// ```
/// use memwise::prelude::*;
///
/// #[memwise::model(batch = 32, optimizer = adam(lr = 1e-2),
///                  loss = sparse_categorical_crossentropy, metrics = [accuracy])]
/// struct Quadrants {
///     #[input(shape = [2])]
///     point: Input,
///     #[input(shape = [], dtype = i32)]
///     quadrant: Input,
///     #[dense(16, activation = relu, from = point)]
///     hidden: Dense,
///     #[dense(4)] // logits: the loss fuses the softmax
///     logits: Dense,
/// }
///
/// # fn main() -> Result<(), RuntimeError> {
/// // One column per input, in the order the inputs are declared: `point`, then `quadrant`.
/// let points: Vec<f32> = (0..640).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
/// let quadrants: Vec<i32> = points
///     .chunks(2)
///     .map(|p| (p[0] > 0.0) as i32 + 2 * (p[1] > 0.0) as i32)
///     .collect();
/// let data = InMemory::new(vec![
///     Column::F32 { data: points, per_sample: 2 },
///     Column::I32 { data: quadrants, per_sample: 1 },
/// ])?;
/// let (train, validation) = data.validation_split(0.25);
///
/// let mut model = Quadrants::new(&Device::cpu())?; // the compile-time plan, allocated once
/// let options = FitOptions { epochs: 3, verbose: false, ..Default::default() };
/// let history = model.fit(&train, Some(&validation), &options, &mut [])?;
/// assert_eq!(history.epochs.len(), 3);
/// let eval = model.evaluate(&validation)?;
/// assert!((0.0..=1.0).contains(&eval.accuracy.unwrap()));
/// let logits = model.predict(&validation)?; // 80 samples × 4 logits, row-major
/// assert_eq!(logits.len(), 80 * 4);
///
/// let path = std::env::temp_dir().join("memwise-doctest-quadrants.safetensors");
/// model.save_weights(&path)?;
/// let mut restored = Quadrants::new(&Device::cpu())?;
/// restored.load_weights(&path)?;
/// assert_eq!(restored.predict(&validation)?, logits);
/// # std::fs::remove_file(&path).ok();
/// # Ok(())
/// # }
/// ```
pub trait Model: Sized {
    /// The static plan of one training step.
    const PLAN: StaticPlan;
    /// Where its memory goes.
    const MEMORY: MemoryReport;
    /// Number of parameters.
    const PARAMS: u64;
    /// The model as declared.
    fn spec() -> ModelSpec;
    /// The layer handles.
    fn layers() -> Self;
    /// The plan at another batch size.
    fn plan_for_batch(batch: usize) -> Result<StaticPlan, PlanError> {
        plan::plan(&Self::spec().with_batch(batch))
    }
    /// The `budget` declared in the attribute, in bytes.
    const BUDGET: Option<u64> = None;
    /// What `checkpoint = auto` chose and what it costs (`None` without it).
    const AUTO_CHECKPOINT_CHOICE: Option<&'static str> = None;
    /// A model split into pipeline stages (`#[stage(k)]`, `stages = N`): every stage's plan,
    /// stage 0 first; empty for a model that runs whole on each device.
    const STAGES: &'static [StaticPlan] = &[];
    /// The Keras-like summary table (compact; [`summary::Summary::of`] has the wide one).
    fn summary() -> String {
        summary::Summary::of::<Self>().to_string()
    }
    /// The largest batch whose training step fits `budget` bytes with the model's own
    /// policy: as declared, or with the checkpoints `checkpoint = auto` chooses at each
    /// batch. `None` when batch 1 does not fit. A model split into stages: the largest
    /// batch (a multiple of its micro-batches) at which every stage fits `budget`. With
    /// `budget` in the attribute the same number is the const `MAX_BATCH`.
    fn max_batch(budget: u64) -> Option<usize> {
        let spec = Self::spec();
        if let Some(pipe) = &spec.pipeline {
            return plan::split::max_batch(&spec, pipe, budget);
        }
        let policy = if Self::AUTO_CHECKPOINT_CHOICE.is_some() {
            plan::checkpoint::Policy::AutoCheckpoint
        } else {
            plan::checkpoint::Policy::Plain
        };
        Self::max_batch_with(budget, policy)
    }
    /// The largest batch that fits `budget` under `policy` (plain, fp16, auto-checkpoint, or
    /// both).
    fn max_batch_with(budget: u64, policy: plan::checkpoint::Policy) -> Option<usize> {
        plan::checkpoint::max_batch_with(&Self::spec(), budget, policy)
    }
    /// Builds the model to fit the memory `device` has free, less a stated safety margin
    /// ([`runtime::fit_device`]): as declared when it fits; else checkpointed at the
    /// declared batch; else at the largest batch that fits with checkpointing. Nothing is
    /// tried and retried: the planner decides before anything is allocated. Returns the
    /// trainer and what was chosen.
    fn fit_to_device(
        device: &runtime::Device,
    ) -> Result<(runtime::Trainer, runtime::fit_device::DeviceFit), runtime::RuntimeError> {
        let chosen = runtime::fit_device::fit_to_device(&Self::spec(), device)?;
        let monitor = runtime::monitor::MemoryMonitor::start_on(device);
        let trainer = runtime::Trainer::from_plan(
            &chosen.fit.spec,
            chosen.fit.plan.clone(),
            device,
            0,
            monitor,
        )?;
        Ok((trainer, chosen))
    }
    /// Builds the model on `device` with the compile-time plan: allocates its two regions
    /// (or fails with the numbers, allocating nothing) and initialises the weights as Keras
    /// does, seeded with 0. The returned trainer fits, evaluates and predicts.
    // `new` returns the model built on a device (a trainer), not the handle struct: the
    // name users of Keras and PyTorch reach for.
    #[allow(clippy::new_ret_no_self)]
    fn new(device: &runtime::Device) -> Result<runtime::Trainer, runtime::RuntimeError> {
        Self::new_seeded(device, 0)
    }
    /// [`Model::new`] with another weight-initialisation seed.
    fn new_seeded(
        device: &runtime::Device,
        seed: u64,
    ) -> Result<runtime::Trainer, runtime::RuntimeError> {
        let monitor = runtime::monitor::MemoryMonitor::start_on(device);
        runtime::Trainer::from_plan(&Self::spec(), Self::PLAN, device, seed, monitor)
    }
}
