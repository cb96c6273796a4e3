//! The guide's first network, declared as a memwise model: 784 → dense 512 relu → dense 10
//! softmax, RMSprop (lr 1e-3), sparse categorical cross-entropy, batch 128. Its memory is
//! planned when it compiles; this trains it on the bundled MNIST digits (or `--data DIR`)
//! and compares the measured memory with that plan.
//!
//! `cargo run --release --example mnist_mlp` (add `-- --help` for the flags).

mod common;

use clap::Parser;
use common::*;
use memwise::prelude::*;

#[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
                 metrics = [accuracy], budget = "2 GiB")]
pub struct MnistMlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(512, activation = relu, from = pixels)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    logits: Dense,
}

// The budget is checked at compile time; this is the same check, visible in the source.
const _: () = assert!(MnistMlp::MEMORY.total < 2 << 30);

fn main() -> Res<()> {
    let flags = Flags::parse();
    let args = &flags.memwise;
    // Data first, so the memory baseline (taken when the model is built) measures the model.
    let (train, test, what) = mnist(args)?;
    dump_batches::<MnistMlp>(&flags, &train)?;
    let Some(mut trainer) = args.build::<MnistMlp>()? else {
        return Ok(()); // --summary
    };
    eprintln!(
        "MnistMlp: {} parameters; one training step at batch {} needs {} (planned at compile time)",
        MnistMlp::PARAMS,
        trainer.plan().batch,
        memwise::plan::advice::format_bytes(trainer.plan().memory.total)
    );
    eprintln!("training on {what}");
    fit_and_evaluate_classifier(args, &mut trainer, (&train, &test), 5)
}
