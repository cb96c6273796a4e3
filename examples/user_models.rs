//! Three models written as a user would write them, from the README and `docs/` alone — a
//! small U-Net with concatenated skips and `#[checkpoint]`, a two-block mixed-precision GPT on
//! token ids, and a separable-convolution ResNet under `checkpoint = auto` — trained on
//! random data of the right shapes, so their measured memory can be set beside the estimate
//! (`scripts/estimate-table.sh` runs them with `--report-json`).
//!
//! `cargo run --release --example user_models -- --model unet` (or `gpt`, `resnet`; add
//! `--help` for the flags, memwise's own through `memwise::cli::Args`).

use clap::Parser;
use memwise::prelude::*;

#[memwise::model(batch = 16, optimizer = adam, loss = binary_crossentropy(mask, target))]
pub struct SmallUnet {
    #[input(shape = [32, 32, 3], dtype = u8, scale = 1.0 / 255.0)]
    image: Input,
    #[input(shape = [32, 32, 1])]
    target: Input,
    #[conv2d(16, 3, padding = same, activation = relu, from = image)]
    down_1: Conv2d,
    #[max_pool2d(2)]
    pool_1: MaxPool2d,
    #[conv2d(32, 3, padding = same, activation = relu)]
    down_2: Conv2d,
    #[max_pool2d(2)]
    pool_2: MaxPool2d,
    #[checkpoint]
    #[conv2d(64, 3, padding = same, activation = relu)]
    bottom_1: Conv2d,
    #[checkpoint]
    #[conv2d(64, 3, padding = same, activation = relu)]
    bottom_2: Conv2d,
    #[conv2d_transpose(32, 3, strides = 2, padding = same, activation = relu)]
    up_2: Conv2dTranspose,
    #[concat(up_2, down_2)]
    skip_2: Concat,
    #[conv2d(32, 3, padding = same, activation = relu)]
    merge_2: Conv2d,
    #[conv2d_transpose(16, 3, strides = 2, padding = same, activation = relu)]
    up_1: Conv2dTranspose,
    #[concat(up_1, down_1)]
    skip_1: Concat,
    #[conv2d(16, 3, padding = same, activation = relu)]
    merge_1: Conv2d,
    #[conv2d(1, 1)] // logits: the loss fuses the sigmoid
    mask: Conv2d,
}

/// A pre-norm transformer block.
#[memwise::block(heads)]
pub struct Block {
    #[layer_norm(epsilon = 1e-5)]
    ln_1: LayerNorm,
    #[attention(heads = heads, causal = true)]
    attn: Attention,
    #[add(input, attn)]
    res_1: Add,
    #[layer_norm(epsilon = 1e-5)]
    ln_2: LayerNorm,
    #[dense(256, activation = gelu)]
    fc: Dense,
    #[dense(64)]
    proj: Dense,
    #[add(res_1, proj)]
    res_2: Add,
}

#[memwise::model(batch = 32, precision = mixed_float16, optimizer = adamw,
                 loss = sparse_categorical_crossentropy(logits, next), metrics = [accuracy])]
pub struct TinyGpt {
    #[input(shape = [32], dtype = i32)]
    ids: Input,
    #[input(shape = [32], dtype = i32)]
    next: Input,
    #[embedding(input_dim = 256, output_dim = 64, from = ids)]
    embed: Embedding,
    // GPT-2's learned positions (`wpe`), one vector per position, added to the tokens'.
    #[positional_embedding]
    positions: PositionalEmbedding,
    #[block(heads = 4)]
    blocks: [Block; 2],
    // The final norm as LLaMA writes it: a scale, no shift, no mean.
    #[rms_norm(epsilon = 1e-5)]
    ln_f: RmsNorm,
    #[f32]
    #[dense(256)]
    logits: Dense,
}

/// A residual stage of separable convolutions, halving the resolution.
#[memwise::block(size)]
pub struct SeparableStage {
    #[batch_norm]
    bn: BatchNorm,
    #[activation(relu)]
    relu: Activation,
    #[separable_conv2d(size, 3, padding = same, use_bias = false)]
    sep_1: SeparableConv2d,
    #[separable_conv2d(size, 3, padding = same, activation = relu)]
    sep_2: SeparableConv2d,
    #[max_pool2d(3, strides = 2, padding = same)]
    pool: MaxPool2d,
    #[conv2d(size, 1, strides = 2, padding = same, use_bias = false, from = input)]
    shortcut: Conv2d,
    #[add(pool, shortcut)]
    out: Add,
}

#[memwise::model(batch = 32, optimizer = rmsprop, loss = sparse_categorical_crossentropy,
                 metrics = [accuracy], budget = "96 MiB", checkpoint = auto)]
pub struct SeparableResNet {
    #[input(shape = [64, 64, 3], dtype = u8, scale = 1.0 / 255.0)]
    image: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[conv2d(32, 3, strides = 2, padding = same, use_bias = false, from = image)]
    stem: Conv2d,
    #[block(size = 64)]
    stage_1: SeparableStage,
    #[block(size = 128)]
    stage_2: SeparableStage,
    #[block(size = 256)]
    stage_3: SeparableStage,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

#[derive(Parser, Debug)]
struct Flags {
    #[command(flatten)]
    memwise: memwise::cli::Args,
    /// Which model: unet, gpt or resnet.
    #[arg(long, default_value = "unet")]
    model: String,
    /// Samples of random data to train on.
    #[arg(long, default_value_t = 512)]
    samples: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let flags = Flags::parse();
    let samples = flags.samples;
    match flags.model.as_str() {
        "unet" => run::<SmallUnet>(&flags.memwise, samples),
        "gpt" => run::<TinyGpt>(&flags.memwise, samples),
        "resnet" => run::<SeparableResNet>(&flags.memwise, samples),
        other => Err(format!("--model {other}: expected unet, gpt or resnet").into()),
    }
}

/// Trains `M` on random data for `--epochs` (default 1) and reports its memory.
fn run<M: Model>(
    args: &memwise::cli::Args,
    samples: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let batch = args.batch.unwrap_or(M::PLAN.batch);
    let data = random_data(&M::PLAN, samples.max(batch), args.seed)?;
    let Some(mut trainer) = args.build::<M>()? else {
        return Ok(()); // --summary
    };
    let history = trainer.fit(&data, None, &args.fit_options(1), &mut [])?;
    args.finish(&trainer, &history, memwise::serde_json::json!({}))?;
    Ok(())
}

/// `n` samples of every input of `plan`, random but valid: pixels of any value, floats in
/// [0, 1), integers in the range the step that reads them accepts.
fn random_data(
    plan: &memwise::plan::StaticPlan,
    n: usize,
    seed: u64,
) -> Result<InMemory, RuntimeError> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let columns = plan
        .inputs
        .iter()
        .map(|&id| {
            let t = plan.tensor(id);
            let per: usize = t.shape[1..].iter().product();
            let len = n * per;
            match t.dtype {
                memwise::plan::DType::U8 => Column::U8 {
                    data: (0..len).map(|_| next() as u8).collect(),
                    per_sample: per,
                },
                memwise::plan::DType::I32 => {
                    let range = plan.index_limit(id).unwrap_or(2) as u64;
                    Column::I32 {
                        data: (0..len).map(|_| (next() % range) as i32).collect(),
                        per_sample: per,
                    }
                }
                _ => Column::F32 {
                    data: (0..len).map(|_| (next() % 1000) as f32 / 1000.0).collect(),
                    per_sample: per,
                },
            }
        })
        .collect();
    InMemory::new(columns)
}
