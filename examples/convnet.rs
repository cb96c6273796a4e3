//! The guide's chapter-9 patterns on the bundled digits: a stem convolution, then residual
//! blocks of batch norm → relu → separable convolutions with a strided 1×1 projection added
//! back, global average pooling, dropout and a softmax. `--summary` also prints the same
//! architecture at the guide's 180×180×3 input (`--large`).
//!
//! `cargo run --release --example convnet` (add `-- --help` for the flags).

mod common;

use clap::Parser;
use common::*;
use memwise::prelude::*;

/// Pre-activation residual block: two separable convolutions and a strided max pool, with a
/// strided 1×1 projection of the block's input added back.
#[memwise::block(size)]
pub struct SeparableResidual {
    #[batch_norm]
    bn_1: BatchNorm,
    #[activation(relu)]
    relu_1: Activation,
    #[separable_conv2d(size, 3, padding = same, use_bias = false)]
    sep_1: SeparableConv2d,
    #[batch_norm]
    bn_2: BatchNorm,
    #[activation(relu)]
    relu_2: Activation,
    #[separable_conv2d(size, 3, padding = same, use_bias = false)]
    sep_2: SeparableConv2d,
    #[max_pool2d(3, strides = 2, padding = same)]
    pool: MaxPool2d,
    #[conv2d(size, 1, strides = 2, padding = same, use_bias = false, from = input)]
    residual: Conv2d,
    #[add(pool, residual)]
    out: Add,
}

#[memwise::model(batch = 64, optimizer = rmsprop, loss = sparse_categorical_crossentropy, metrics = [accuracy], budget = "1 GiB")]
pub struct ConvNet {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[conv2d(32, 5, use_bias = false, from = pixels)]
    stem: Conv2d,
    #[block(size = 32)]
    block_32: SeparableResidual,
    #[block(size = 64)]
    block_64: SeparableResidual,
    #[block(size = 128)]
    block_128: SeparableResidual,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dropout(0.5)]
    dropout: Dropout,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

/// The same network at the guide's 180×180×3 input (cats vs dogs), for `--summary --large`.
#[memwise::model(batch = 32, optimizer = rmsprop, loss = binary_crossentropy(probs, label))]
pub struct ConvNet180 {
    #[input(shape = [180, 180, 3], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [1], dtype = f32)]
    label: Input,
    #[conv2d(32, 5, use_bias = false, from = pixels)]
    stem: Conv2d,
    #[block(size = 32)]
    block_32: SeparableResidual,
    #[block(size = 64)]
    block_64: SeparableResidual,
    #[block(size = 128)]
    block_128: SeparableResidual,
    #[block(size = 256)]
    block_256: SeparableResidual,
    #[block(size = 512)]
    block_512: SeparableResidual,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dropout(0.5)]
    dropout: Dropout,
    #[dense(1, activation = sigmoid)]
    probs: Dense,
}

#[derive(Parser, Debug)]
struct ConvNetFlags {
    #[command(flatten)]
    flags: Flags,
    /// With --summary: the 180×180×3 version.
    #[arg(long)]
    large: bool,
}

fn main() -> Res<()> {
    let ConvNetFlags { flags, large } = ConvNetFlags::parse();
    let args = &flags.memwise;
    if args.summary && large {
        println!("{}", args.summary::<ConvNet180>(&ConvNet180::PLAN));
        return Ok(());
    }
    let (train, test, what) = mnist(args)?;
    dump_batches::<ConvNet>(&flags, &train)?;
    let Some(mut trainer) = args.build::<ConvNet>()? else {
        return Ok(()); // --summary
    };
    eprintln!(
        "ConvNet: {} parameters; one training step at batch {} needs {} (planned at compile time); training on {what}",
        ConvNet::PARAMS,
        trainer.plan().batch,
        memwise::plan::advice::format_bytes(trainer.plan().memory.total)
    );
    fit_and_evaluate_classifier(args, &mut trainer, (&train, &test), 2)
}
