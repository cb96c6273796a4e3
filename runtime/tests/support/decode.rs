//! Raw bytes → the inputs of memwise's public entry points: a `ModelSpec` for `plan`, batches
//! for `train_step`, datasets for `Trainer`, mutated safetensors files for the loaders.
//!
//! Shared by the fuzz targets (`fuzz/`, through `#[path]`) and the property tests
//! (`runtime/tests/robustness.rs`), so an input one of them finds replays in the other. Every
//! decoder is total: any byte string decodes (missing bytes read as zeros), and the decoders
//! themselves never panic.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use half::{bf16, f16};
use memwise_plan::{
    Activation, DType, LayerKind, LayerSpec, LossKind, LossTerm, ModelSpec, Optimizer, Padding,
    Precision, Reduction, StaticPlan,
};
use memwise_runtime::data::dataset::{Column, InMemory};
use memwise_runtime::Batch;
use safetensors::{Dtype, SafeTensors};

/// A cursor over the input bytes; reads past the end give zeros.
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data, pos: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            self.u8() as usize % n
        }
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// The rest of the input.
    pub fn rest(&mut self) -> &'a [u8] {
        let r = self.data.get(self.pos..).unwrap_or(&[]);
        self.pos = self.data.len();
        r
    }

    /// A size: mostly small (0..=8), sometimes an extreme one.
    pub fn dim(&mut self) -> usize {
        match self.u8() {
            b @ 0..=235 => (b % 9) as usize,
            236 => 16,
            237 => 255,
            238 => 256,
            239 => 1 << 16,
            240 => 1 << 20,
            241 => 1 << 31,
            242 => u32::MAX as usize,
            243 => 1 << 32,
            244 => usize::MAX,
            245 => usize::MAX / 2,
            246 => usize::MAX / 3,
            _ => self.u32() as usize,
        }
    }

    /// A float: mostly an ordinary value, sometimes 0, negative, huge, NaN or infinite.
    pub fn f32(&mut self) -> f32 {
        match self.u8() {
            b @ 0..=199 => b as f32 / 100.0,
            200 => 0.0,
            201 => -1.0,
            202 => f32::NAN,
            203 => f32::INFINITY,
            204 => f32::NEG_INFINITY,
            205 => f32::MAX,
            206 => f32::MIN_POSITIVE,
            207 => 1e-30,
            _ => f32::from_bits(self.u32()),
        }
    }
}

const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::U8, DType::I32];
// Every activation, however many the planner declares.
const ACTIVATIONS: [Activation; Activation::ALL.len()] = Activation::ALL;
const PADDINGS: [Padding; 2] = [Padding::Same, Padding::Valid];
const LOSSES: [LossKind; 4] = [
    LossKind::SparseCategoricalCrossentropy,
    LossKind::BinaryCrossentropy,
    LossKind::MeanSquaredError,
    LossKind::KlNormal,
];

fn shape(b: &mut Bytes<'_>, max_rank: usize) -> Vec<usize> {
    let rank = b.below(max_rank + 1);
    (0..rank).map(|_| b.dim()).collect()
}

fn pair(b: &mut Bytes<'_>) -> [usize; 2] {
    if b.bool() {
        let k = b.dim();
        [k, k]
    } else {
        [b.dim(), b.dim()]
    }
}

fn optimizer(b: &mut Bytes<'_>) -> Optimizer {
    let defaults = [
        Optimizer::SGD,
        Optimizer::MOMENTUM,
        Optimizer::RMSPROP,
        Optimizer::ADAM,
        Optimizer::ADAMW,
    ];
    let o = b.pick(&defaults);
    if b.u8() < 192 {
        return o;
    }
    match o {
        Optimizer::Sgd { .. } => Optimizer::Sgd { lr: b.f32() },
        Optimizer::Momentum { .. } => Optimizer::Momentum {
            lr: b.f32(),
            momentum: b.f32(),
            nesterov: b.bool(),
        },
        Optimizer::RmsProp { .. } => Optimizer::RmsProp {
            lr: b.f32(),
            rho: b.f32(),
            epsilon: b.f32(),
            momentum: b.f32(),
            centered: b.bool(),
        },
        Optimizer::Adam { .. } => Optimizer::Adam {
            lr: b.f32(),
            beta_1: b.f32(),
            beta_2: b.f32(),
            epsilon: b.f32(),
        },
        Optimizer::AdamW { .. } => Optimizer::AdamW {
            lr: b.f32(),
            beta_1: b.f32(),
            beta_2: b.f32(),
            epsilon: b.f32(),
            weight_decay: b.f32(),
        },
    }
}

fn layer_kind(b: &mut Bytes<'_>) -> LayerKind {
    match b.u8() % 20 {
        0 => LayerKind::Input {
            shape: shape(b, 3),
            dtype: b.pick(&DTYPES),
            scale: b.f32(),
        },
        1 => LayerKind::Dense {
            units: b.dim(),
            activation: b.pick(&ACTIVATIONS),
            use_bias: b.bool(),
        },
        2 => LayerKind::Conv2d {
            filters: b.dim(),
            kernel: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
            activation: b.pick(&ACTIVATIONS),
            use_bias: b.bool(),
        },
        3 => LayerKind::DepthwiseConv2d {
            kernel: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
            multiplier: b.dim(),
            activation: b.pick(&ACTIVATIONS),
            use_bias: b.bool(),
        },
        4 => LayerKind::SeparableConv2d {
            filters: b.dim(),
            kernel: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
            multiplier: b.dim(),
            activation: b.pick(&ACTIVATIONS),
            use_bias: b.bool(),
        },
        5 => LayerKind::Conv2dTranspose {
            filters: b.dim(),
            kernel: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
            activation: b.pick(&ACTIVATIONS),
            use_bias: b.bool(),
        },
        6 => LayerKind::MaxPool2d {
            pool: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
        },
        7 => LayerKind::AvgPool2d {
            pool: pair(b),
            strides: pair(b),
            padding: b.pick(&PADDINGS),
        },
        8 => LayerKind::GlobalAvgPool,
        9 => LayerKind::BatchNorm {
            momentum: b.f32(),
            epsilon: b.f32(),
        },
        10 => LayerKind::LayerNorm { epsilon: b.f32() },
        11 => LayerKind::Dropout { rate: b.f32() },
        12 => LayerKind::Flatten,
        13 => LayerKind::Reshape { shape: shape(b, 3) },
        14 => LayerKind::Add {
            activation: b.pick(&ACTIVATIONS),
        },
        15 => LayerKind::Concat,
        16 => LayerKind::Embedding {
            vocab: b.dim(),
            dim: b.dim(),
        },
        17 => LayerKind::Attention {
            heads: b.dim(),
            causal: b.bool(),
            dropout: b.f32(),
        },
        18 => LayerKind::Activation(b.pick(&ACTIVATIONS)),
        _ => LayerKind::SampleNormal,
    }
}

/// A name: usually an earlier layer's, sometimes a later one, an unknown one or empty.
fn layer_ref(b: &mut Bytes<'_>, names: &[String], upto: usize) -> String {
    match b.u8() {
        0..=219 if !names.is_empty() => names[b.below(names.len().min(upto.max(1)))].clone(),
        220..=239 if !names.is_empty() => names[b.below(names.len())].clone(),
        240..=247 => "nope".to_string(),
        248..=251 => String::new(),
        _ => format!("l{}", b.u8()),
    }
}

/// Any model: up to 12 layers of any kind with any options (including zero and enormous
/// sizes and non-finite floats), inputs that may not exist, any losses and optimizer.
pub fn model_spec(data: &[u8]) -> ModelSpec {
    let mut b = Bytes::new(data);
    let batch = match b.u8() {
        0..=239 => 1 + b.below(4),
        _ => b.dim(),
    };
    let mut spec = ModelSpec::new("Fuzzed", batch);
    spec.precision = b.pick(&[
        Precision::Float32,
        Precision::MixedFloat16,
        Precision::MixedBFloat16,
    ]);
    spec.optimizer = optimizer(&mut b);
    let n_layers = b.below(13);
    let mut names: Vec<String> = (0..n_layers).map(|i| format!("l{i}")).collect();
    // Start like a real model: one input (sometimes two, the second i32 labels).
    for i in 0..n_layers {
        let kind = match (i, b.u8()) {
            (0, 0..=199) => LayerKind::Input {
                shape: shape(&mut b, 3),
                dtype: b.pick(&[DType::F32, DType::U8, DType::I32, DType::F16]),
                scale: 1.0,
            },
            (1, 0..=99) => LayerKind::Input {
                shape: vec![],
                dtype: DType::I32,
                scale: 1.0,
            },
            _ => layer_kind(&mut b),
        };
        if b.u8() == 255 {
            // A duplicate name.
            names[i] = names[b.below(i + 1)].clone();
        }
        let arity = match &kind {
            LayerKind::Input { .. } => 0,
            LayerKind::Add { .. } | LayerKind::Concat | LayerKind::SampleNormal => 2,
            _ => 1,
        };
        let inputs = match b.u8() {
            0..=159 if arity != 2 => Vec::new(),
            0..=239 => (0..arity.max(1))
                .map(|_| layer_ref(&mut b, &names, i))
                .collect(),
            _ => (0..b.below(4))
                .map(|_| layer_ref(&mut b, &names, i))
                .collect(),
        };
        let dtype = match b.u8() {
            0..=223 => None,
            _ => Some(b.pick(&DTYPES)),
        };
        let checkpoint = match b.u8() {
            0..=191 => None,
            _ => Some(b.below(3) as u32),
        };
        spec.layers.push(LayerSpec {
            name: names[i].clone(),
            kind,
            inputs,
            dtype,
            checkpoint,
            // Every other layer (norms take it, others ignore it) without a byte of its
            // own, so that the stored inputs decode to the models they did.
            recompute_output: i % 2 == 1,
        });
    }
    for _ in 0..b.below(3) {
        let kind = b.pick(&LOSSES);
        let mut term = LossTerm::new(kind);
        if b.u8() < 160 {
            term.inputs = (0..2)
                .map(|_| layer_ref(&mut b, &names, n_layers))
                .collect();
        } else if b.u8() < 32 {
            term.inputs = (0..b.below(4))
                .map(|_| layer_ref(&mut b, &names, n_layers))
                .collect();
        }
        if b.u8() > 224 {
            term.weight = b.f32();
        }
        term.reduction = b.pick(&[Reduction::Mean, Reduction::SumOverFeatures]);
        spec.loss.push(term);
    }
    if b.u8() > 200 {
        spec.budget = Some(b.u64());
    }
    spec
}

/// The fixed models `train_step` is fuzzed on: small, every input dtype and the main ops.
pub fn train_models() -> Vec<ModelSpec> {
    let mut v = Vec::new();
    // 0: u8 pixels → dense → softmax, sparse cross-entropy on i32 labels (the MNIST MLP, small).
    let mut m = ModelSpec::new("Mlp", 4);
    m.input("pixels", &[8], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(16, Activation::Relu),
        &["pixels"],
    );
    m.add("probs", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "labels"]));
    v.push(m);
    // 1: f32 image → conv, batch norm, max pool, dropout → logits; Adam.
    let mut m = ModelSpec::new("Cnn", 2);
    m.optimizer = Optimizer::ADAM;
    m.input("image", &[6, 6, 2], DType::F32, 1.0);
    m.input("label", &[], DType::I32, 1.0);
    m.add(
        "conv",
        LayerKind::conv2d(4, 3, 1, Padding::Same, Activation::Linear),
        &["image"],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    m.add("relu", LayerKind::Activation(Activation::Relu), &[]);
    m.add("pool", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("drop", LayerKind::Dropout { rate: 0.25 }, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Linear), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "label"]));
    v.push(m);
    // 2: token ids → embedding → attention → logits over the vocabulary (mixed float16).
    let mut m = ModelSpec::new("Lm", 2);
    m.precision = Precision::MixedFloat16;
    m.input("ids", &[4], DType::I32, 1.0);
    m.input("next", &[4], DType::I32, 1.0);
    m.add(
        "embed",
        LayerKind::Embedding { vocab: 10, dim: 8 },
        &["ids"],
    );
    m.add("norm", LayerKind::layer_norm(), &[]);
    m.add(
        "attn",
        LayerKind::Attention {
            heads: 2,
            causal: true,
            dropout: 0.0,
        },
        &[],
    );
    m.add("logits", LayerKind::dense(10, Activation::Linear), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "next"]));
    v.push(m);
    // 3: a VAE on f16 inputs: sampling, binary cross-entropy + KL (mixed bfloat16).
    let mut m = ModelSpec::new("Vae", 2);
    m.precision = Precision::MixedBFloat16;
    m.input("x", &[6], DType::F16, 1.0);
    m.add("enc", LayerKind::dense(8, Activation::Relu), &["x"]);
    m.add("mean", LayerKind::dense(2, Activation::Linear), &["enc"]);
    m.add("log_var", LayerKind::dense(2, Activation::Linear), &["enc"]);
    m.add("z", LayerKind::SampleNormal, &["mean", "log_var"]);
    m.add("dec", LayerKind::dense(6, Activation::Sigmoid), &["z"]);
    m.loss.push(
        LossTerm::new(LossKind::BinaryCrossentropy)
            .on(&["dec", "x"])
            .reduction(Reduction::SumOverFeatures),
    );
    m.loss.push(
        LossTerm::new(LossKind::KlNormal)
            .on(&["mean", "log_var"])
            .weight(0.5),
    );
    v.push(m);
    // 4: regression on bf16 inputs and f32 targets: residual add, concat, mse; SGD.
    let mut m = ModelSpec::new("Reg", 3);
    m.optimizer = Optimizer::SGD;
    m.input("x", &[4], DType::BF16, 1.0);
    m.input("y", &[3], DType::F32, 1.0);
    m.add("a", LayerKind::dense(4, Activation::Tanh), &["x"]);
    m.add("sum", LayerKind::add(), &["a", "x"]);
    m.add("both", LayerKind::Concat, &["sum", "a"]);
    m.add("out", LayerKind::dense(3, Activation::Linear), &["both"]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "y"]));
    v.push(m);
    v
}

/// A batch that owns its values.
#[derive(Clone, Debug)]
pub enum Owned {
    U8(Vec<u8>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Owned {
    pub fn as_batch(&self) -> Batch<'_> {
        match self {
            Owned::U8(x) => Batch::U8(x),
            Owned::I32(x) => Batch::I32(x),
            Owned::F32(x) => Batch::F32(x),
            Owned::F16(x) => Batch::F16(x),
            Owned::BF16(x) => Batch::BF16(x),
        }
    }
}

fn values(b: &mut Bytes<'_>, dtype: DType, len: usize) -> Owned {
    // Integers: mostly small (valid labels and token ids), sometimes anything.
    let raw = b.u8() > 224;
    match dtype {
        DType::U8 => Owned::U8((0..len).map(|_| b.u8()).collect()),
        DType::I32 => Owned::I32(
            (0..len)
                .map(|_| {
                    if raw {
                        b.u32() as i32
                    } else {
                        (b.u8() % 10) as i32
                    }
                })
                .collect(),
        ),
        DType::F32 => Owned::F32((0..len).map(|_| b.f32()).collect()),
        DType::F16 => Owned::F16((0..len).map(|_| f16::from_f32(b.f32())).collect()),
        DType::BF16 => Owned::BF16((0..len).map(|_| bf16::from_f32(b.f32())).collect()),
    }
}

/// Batches for `plan`'s inputs: usually the right count, dtypes and lengths (so the step
/// runs), sometimes a wrong count, dtype or length; values from the bytes (non-finite
/// floats and out-of-range labels included).
pub fn batches(plan: &StaticPlan, b: &mut Bytes<'_>) -> Vec<Owned> {
    let want: Vec<(DType, usize)> = plan
        .inputs
        .iter()
        .map(|&id| {
            let t = plan.tensor(id);
            (t.dtype, t.elems())
        })
        .collect();
    let count = match b.u8() {
        0..=239 => want.len(),
        _ => b.below(4),
    };
    (0..count)
        .map(|k| {
            let (dt, n) = want.get(k).copied().unwrap_or((DType::F32, 4));
            let dt = if b.u8() < 240 { dt } else { b.pick(&DTYPES) };
            let len = match b.u8() {
                0..=223 => n,
                224..=239 => n.saturating_add(b.below(5)).saturating_sub(2),
                240..=247 => n * 2,
                _ => b.below(64),
            };
            values(b, dt, len)
        })
        .collect()
}

/// A dataset for `model`'s inputs: usually matching columns, sometimes a wrong count,
/// dtype or per-sample size; 0 to 11 samples.
pub fn dataset(plan: &StaticPlan, b: &mut Bytes<'_>) -> Option<InMemory> {
    let samples = b.below(12);
    let count = match b.u8() {
        0..=239 => plan.inputs.len(),
        _ => b.below(4),
    };
    let cols = (0..count)
        .map(|k| {
            let (dt, per) = plan
                .inputs
                .get(k)
                .map(|&id| {
                    let t = plan.tensor(id);
                    (t.dtype, t.shape[1..].iter().product::<usize>())
                })
                .unwrap_or((DType::F32, 1));
            let dt = if b.u8() < 240 {
                dt
            } else {
                b.pick(&[DType::U8, DType::I32, DType::F32])
            };
            let per = if b.u8() < 240 { per } else { b.below(9) };
            let n = samples * per.max(1);
            match values(b, dt, n) {
                Owned::U8(data) => Column::U8 {
                    data,
                    per_sample: per,
                },
                Owned::I32(data) => Column::I32 {
                    data,
                    per_sample: per,
                },
                Owned::F32(data) => Column::F32 {
                    data,
                    per_sample: per,
                },
                Owned::F16(x) => Column::F32 {
                    data: x.iter().map(|v| v.to_f32()).collect(),
                    per_sample: per,
                },
                Owned::BF16(x) => Column::F32 {
                    data: x.iter().map(|v| v.to_f32()).collect(),
                    per_sample: per,
                },
            }
        })
        .collect();
    InMemory::new(cols).ok()
}

/// One tensor of a safetensors file being mutated.
struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

const ST_DTYPES: [Dtype; 8] = [
    Dtype::F32,
    Dtype::F16,
    Dtype::BF16,
    Dtype::F64,
    Dtype::I32,
    Dtype::U8,
    Dtype::I64,
    Dtype::BOOL,
];

const META_KEYS: [&str; 17] = [
    "memwise.format_version",
    "memwise.kind",
    "memwise.model",
    "memwise.layout",
    "memwise.checksum",
    "memwise.optimizer",
    "memwise.optimizer_slots",
    "memwise.seed",
    "memwise.step",
    "memwise.updates",
    "memwise.loss_scaling",
    "memwise.loss_scale",
    "memwise.loss_scale_growth_interval",
    "memwise.loss_scale_growth",
    "memwise.loss_scale_backoff",
    "memwise.loss_scale_good_steps",
    "memwise.loss_scale_skipped_in_a_row",
];

const META_VALUES: [&str; 22] = [
    "",
    "0",
    "1",
    "2",
    "3",
    "-1",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "true",
    "false",
    "weights",
    "checkpoint",
    "adam",
    "sgd",
    "rmsprop",
    "0x47000000",
    "0x7fc00000",
    "0x7f800000",
    "0x00000000",
    "0xffffffff",
    "Other",
];

fn elems_size(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))?
        .checked_mul(dtype.bitsize())
        .map(|bits| bits.div_ceil(8))
}

/// `valid` (a safetensors file) changed as the bytes say: tensors renamed, dropped,
/// duplicated, re-typed or re-shaped, metadata set or removed, data bytes flipped — with the
/// memwise checksum usually recomputed so the loader's later checks are reached — then,
/// sometimes, raw damage: truncation, a flipped byte, a new header length.
pub fn mutate_safetensors(valid: &[u8], b: &mut Bytes<'_>) -> Vec<u8> {
    let Ok(st) = SafeTensors::deserialize(valid) else {
        return valid.to_vec();
    };
    let mut meta: BTreeMap<String, String> = SafeTensors::read_metadata(valid)
        .ok()
        .and_then(|(_, m)| m.metadata().clone())
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    let mut tensors: Vec<Tensor> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| Tensor {
            name,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data().to_vec(),
        })
        .collect();
    tensors.sort_by(|a, c| a.name.cmp(&c.name));
    for _ in 0..b.below(5) {
        let k = b.below(tensors.len());
        match b.u8() % 9 {
            0 if !tensors.is_empty() => {
                let suffix = b.pick(&["x", ".opt0", ".opt9", ".weight", ""]);
                let other = b.below(tensors.len());
                let base = if b.bool() {
                    tensors[other].name.clone()
                } else {
                    tensors[k].name.clone()
                };
                tensors[k].name = format!("{base}{suffix}");
            }
            1 if !tensors.is_empty() => {
                tensors.remove(k);
            }
            2 if !tensors.is_empty() => {
                let t = &tensors[k];
                let copy = Tensor {
                    name: format!("{}.copy", t.name),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data: t.data.clone(),
                };
                tensors.push(copy);
            }
            3 if !tensors.is_empty() => {
                let dt = b.pick(&ST_DTYPES);
                let t = &mut tensors[k];
                if let Some(n) = elems_size(dt, &t.shape) {
                    t.dtype = dt;
                    t.data.resize(n, 0);
                }
            }
            4 if !tensors.is_empty() => {
                let t = &mut tensors[k];
                let mut s = t.shape.clone();
                match b.u8() % 4 {
                    0 => s.reverse(),
                    1 => s.push(1),
                    2 => {
                        s.pop();
                    }
                    _ => {
                        let i = b.below(s.len());
                        if let Some(d) = s.get_mut(i) {
                            *d = b.below(9);
                        }
                    }
                }
                if let Some(n) = elems_size(t.dtype, &s) {
                    if n <= 1 << 20 {
                        t.shape = s;
                        t.data.resize(n, 0);
                    }
                }
            }
            5 => {
                let key = b.pick(&META_KEYS);
                let value = if b.u8() < 200 {
                    b.pick(&META_VALUES).to_string()
                } else {
                    String::from_utf8_lossy(&[b.u8(), b.u8(), b.u8()]).into_owned()
                };
                meta.insert(key.to_string(), value);
            }
            6 => {
                let key = b.pick(&META_KEYS);
                meta.remove(key);
            }
            7 if !tensors.is_empty() => {
                let t = &mut tensors[k];
                let i = b.u16() as usize;
                if !t.data.is_empty() {
                    let n = t.data.len();
                    t.data[i % n] ^= b.u8() | 1;
                }
            }
            _ => {}
        }
    }
    // Names must stay unique for `serialize`.
    tensors.sort_by(|a, c| a.name.cmp(&c.name));
    tensors.dedup_by(|a, c| a.name == c.name);
    match b.u8() {
        0..=215 => {
            let sum = memwise_runtime::weights::checksum(
                tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.dtype, &t.shape[..], &t.data[..])),
            );
            meta.insert("memwise.checksum".into(), format!("fnv1a64:{sum:016x}"));
        }
        216..=239 => {}
        _ => {
            meta.remove("memwise.checksum");
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .filter_map(|t| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .ok()
                .map(|v| (t.name.clone(), v))
        })
        .collect();
    let meta: HashMap<String, String> = meta.into_iter().collect();
    let mut out = safetensors::serialize(views, Some(meta)).unwrap_or_else(|_| valid.to_vec());
    // Raw damage.
    for _ in 0..b.below(3) {
        if out.is_empty() {
            break;
        }
        let at = b.u32() as usize % out.len();
        match b.u8() % 5 {
            0 => out.truncate(at),
            1 => out[at] ^= b.u8() | 1,
            2 if out.len() >= 8 => {
                let n = match b.u8() % 4 {
                    0 => 0,
                    1 => u64::MAX,
                    2 => out.len() as u64,
                    _ => b.u64(),
                };
                out[..8].copy_from_slice(&n.to_le_bytes());
            }
            3 => {
                let extra = b.below(16);
                out.splice(at..at, std::iter::repeat_n(b.u8(), extra));
            }
            _ => {}
        }
    }
    out
}

/// An IDX file: sometimes valid (gzipped or not), sometimes with a wrong magic, dtype,
/// dims or payload size.
pub fn idx_file(b: &mut Bytes<'_>) -> Vec<u8> {
    let mode = b.u8();
    if mode < 64 {
        return b.rest().to_vec();
    }
    let dtype = if b.u8() < 224 { 0x08 } else { b.u8() };
    let ndim = if b.u8() < 240 {
        b.below(4) as u8
    } else {
        b.u8()
    };
    let mut out = vec![0, 0, dtype, ndim];
    let mut dims = Vec::new();
    for _ in 0..ndim.min(8) {
        let d = if b.u8() < 224 {
            b.below(6) as u32
        } else {
            b.u32()
        };
        dims.push(d as usize);
        out.extend_from_slice(&d.to_be_bytes());
    }
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(0)
        .min(4096);
    let n = match b.u8() {
        0..=199 => n,
        200..=227 => n.saturating_sub(1),
        _ => n + 1,
    };
    out.extend((0..n).map(|_| b.u8()));
    if mode >= 192 {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let _ = enc.write_all(&out);
        let mut gz = enc.finish().unwrap_or_default();
        if b.u8() > 200 && !gz.is_empty() {
            let len = gz.len();
            gz.truncate(b.below(len));
        }
        return gz;
    }
    out
}

/// An image file and the target it decodes into: raw bytes, or a valid PNG (1–4 channels)
/// or JPEG (gray or RGB, baseline or progressive) of up to 40 × 40 pixels, then perhaps
/// truncated, with bytes flipped, or its header's size fields overwritten; a target of 1 or 3
/// channels and 1–48 pixels a side. Returns the bytes, the format the file's name would
/// promise, and the target.
pub fn image_file(
    b: &mut Bytes<'_>,
) -> (
    Vec<u8>,
    memwise_runtime::data::image::ImageFormat,
    memwise_runtime::data::image::ImageShape,
) {
    use memwise_runtime::data::digits_folder::{encode_jpeg_with, encode_png};
    use memwise_runtime::data::image::{ImageFormat, ImageShape};
    let target = ImageShape {
        height: 1 + b.below(48) as u32,
        width: 1 + b.below(48) as u32,
        channels: if b.bool() { 3 } else { 1 },
    };
    let mode = b.u8();
    // Even modes make a PNG, odd ones a JPEG; the name promises the other format at times.
    let png = mode.is_multiple_of(2);
    let promised = match (png, b.u8() < 224) {
        (true, true) | (false, false) => ImageFormat::Png,
        (true, false) | (false, true) => ImageFormat::Jpeg,
    };
    if mode < 48 {
        return (b.rest().to_vec(), promised, target);
    }
    let (w, h) = (1 + b.below(40) as u32, 1 + b.below(40) as u32);
    let channels = if png {
        1 + b.below(4) as u32
    } else if b.bool() {
        3
    } else {
        1
    };
    let pixels: Vec<u8> = (0..(w * h * channels)).map(|_| b.u8()).collect();
    let mut file = if png {
        encode_png(&pixels, w, h, channels).unwrap_or_default()
    } else {
        encode_jpeg_with(&pixels, w, h, channels, 1 + b.below(100) as u8, b.bool())
            .unwrap_or_default()
    };
    for _ in 0..b.below(4) {
        match b.u8() {
            0..=99 if !file.is_empty() => {
                let at = b.below(file.len());
                file[at] ^= 1 << b.below(8);
            }
            100..=149 if !file.is_empty() => {
                let len = file.len();
                file.truncate(b.below(len));
            }
            // A header size field: PNG's width/height at bytes 16..24, JPEG's SOF0 size.
            150..=199 if file.len() > 24 => {
                let at = 16 + b.below(8);
                file[at] = b.u8();
            }
            _ => {}
        }
    }
    (file, promised, target)
}
