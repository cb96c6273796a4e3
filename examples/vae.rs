//! The guide's convolutional VAE (Keras example, latent dimension 2): conv 32 and 64 with
//! stride 2 → dense 16 → z_mean, z_log_var → sampling → dense 7·7·64 → transposed convs →
//! sigmoid; loss = binary cross-entropy summed over pixels + KL divergence. Trains on the
//! bundled MNIST digits and prints the loss falling.
//!
//! `cargo run --release --example vae` (add `-- --help` for the flags).

mod common;

use clap::Parser;
use common::*;
use memwise::prelude::*;
use memwise::runtime::{FitOptions, MemoryCallback, Trainer};

#[memwise::model(
    batch = 128,
    optimizer = adam,
    loss = binary_crossentropy(decoded, pixels, reduction = sum) + kl_normal(z_mean, z_log_var),
    budget = "1 GiB"
)]
pub struct ConvVae {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[conv2d(32, 3, strides = 2, padding = same, activation = relu)]
    enc_conv1: Conv2d,
    #[conv2d(64, 3, strides = 2, padding = same, activation = relu)]
    enc_conv2: Conv2d,
    #[flatten]
    enc_flatten: Flatten,
    #[dense(16, activation = relu)]
    enc_dense: Dense,
    #[dense(2, from = enc_dense)]
    z_mean: Dense,
    #[dense(2, from = enc_dense)]
    z_log_var: Dense,
    #[sample_normal(z_mean, z_log_var)]
    z: SampleNormal,
    #[dense(7 * 7 * 64, activation = relu)]
    dec_dense: Dense,
    #[reshape([7, 7, 64])]
    dec_reshape: Reshape,
    #[conv2d_transpose(64, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv1: Conv2dTranspose,
    #[conv2d_transpose(32, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv2: Conv2dTranspose,
    #[conv2d_transpose(1, 3, padding = same, activation = sigmoid)]
    decoded: Conv2dTranspose,
}

fn main() -> Res<()> {
    let flags = Flags::parse();
    let (spec, plan) = plan_for(&ConvVae::spec(), ConvVae::PLAN, &flags)?;
    if flags.summary {
        println!("{}", memwise::summary::table(&plan));
        return Ok(());
    }
    write_plan(&flags, &plan)?;
    write_pictures(&flags, &spec, &plan)?;
    let device = device(&flags)?;
    let (train, test) = mnist_images(&flags)?;
    eprintln!(
        "ConvVae: {} parameters; one training step at batch {} needs {} (planned at compile time)",
        ConvVae::PARAMS,
        plan.batch,
        memwise::plan::advice::format_bytes(plan.memory.total)
    );
    let monitor = memwise::runtime::monitor::MemoryMonitor::start();
    let mut trainer = rt(Trainer::from_plan(&spec, plan, &device, flags.seed, monitor))?;
    let opts = FitOptions { epochs: flags.epochs.unwrap_or(5), max_steps: flags.steps, seed: flags.seed, ..Default::default() };
    let mut mem = MemoryCallback::default();
    let history = rt(trainer.fit(&train, None, &opts, &mut [&mut mem]))?;
    let eval = rt(trainer.evaluate(&test))?;
    let l = &history.step_losses;
    let head = l.iter().take(10).sum::<f32>() / l.len().min(10).max(1) as f32;
    let tail = l.iter().rev().take(10).sum::<f32>() / l.len().min(10).max(1) as f32;
    println!("loss (reconstruction + KL): first 10 steps {head:.1}, last 10 steps {tail:.1}; held-out {:.1}", eval.loss);
    write_report(&flags, &trainer, &device, &history, serde_json::json!({"val_loss": eval.loss}))?;
    Ok(())
}
