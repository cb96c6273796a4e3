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

#[derive(Parser, Debug)]
struct VaeFlags {
    #[command(flatten)]
    flags: Flags,
    /// The guide's before/after, with numbers: float32, mixed_float16, checkpointed, both, and
    /// `checkpoint = auto` under `--compare-budget`; a table and `--compare-svg`.
    #[arg(long)]
    compare: bool,
    /// Training steps per variant in `--compare`.
    #[arg(long, default_value_t = 30)]
    compare_steps: usize,
    /// The budget `checkpoint = auto` must fit in `--compare` (default: 90% of float32's).
    #[arg(long)]
    compare_budget: Option<String>,
    /// Bar chart of the comparison (SVG).
    #[arg(long, default_value = "vae_compare.svg")]
    compare_svg: std::path::PathBuf,
}

/// One row of the comparison.
struct Row {
    name: String,
    estimate: u64,
    measured: u64,
    step_ms: f64,
    final_loss: f32,
}

fn compare(args: &VaeFlags) -> Res<()> {
    use memwise::plan::advice::format_bytes;
    use memwise::plan::{checkpoint, Precision};
    use memwise::runtime::monitor::{reset_peak, MemoryMonitor};
    let flags = &args.flags.memwise;
    let base = ConvVae::spec().with_batch(flags.batch.unwrap_or(ConvVae::spec().batch));
    let f32_total = memwise::plan::plan(&base)?.memory.total;
    let budget = match &args.compare_budget {
        Some(b) => memwise::plan::advice::parse_bytes(b)?,
        None => f32_total * 9 / 10,
    };
    // Checkpoint the encoder and the decoder, each as one segment.
    let by_hand = |mut s: memwise::plan::ModelSpec| {
        for l in s.layers.iter_mut() {
            l.checkpoint = if l.name.starts_with("enc_") {
                Some(1)
            } else if l.name.starts_with("dec_") {
                Some(2)
            } else {
                None
            };
        }
        s
    };
    let mut fp16 = base.clone();
    fp16.precision = Precision::MixedFloat16;
    let auto = checkpoint::solve(&base, budget)?;
    eprintln!("checkpoint = auto under {}: {auto}", format_bytes(budget));
    let variants = vec![
        ("float32".to_string(), base.clone()),
        ("mixed_float16".to_string(), fp16.clone()),
        (
            "checkpointed (encoder, decoder)".to_string(),
            by_hand(base.clone()),
        ),
        ("mixed_float16 + checkpointed".to_string(), by_hand(fp16)),
        (
            format!("checkpoint = auto ({} budget)", format_bytes(budget)),
            auto.apply(&base),
        ),
    ];
    let (train, _) = mnist_images(flags)?;
    let device = flags.device()?;
    let mut rows = Vec::new();
    for (name, spec) in variants {
        let plan = memwise::plan::plan(&spec)?;
        reset_peak();
        let monitor = MemoryMonitor::start_on(&device);
        let mut trainer = rt(Trainer::from_plan(
            &spec, plan, &device, flags.seed, monitor,
        ))?;
        let opts = FitOptions {
            epochs: args.compare_steps,
            max_steps: Some(args.compare_steps),
            seed: flags.seed,
            verbose: false,
            ..Default::default()
        };
        let h = rt(trainer.fit(&train, None, &opts, &mut []))?;
        // On CUDA the device memory the model held at its peak; on the CPU resident growth.
        let measured = match trainer.device_peak_bytes() {
            Some(device) => device,
            None => trainer.monitor().growth().map_or(0, |g| g.peak),
        };
        let last = h.step_losses.iter().rev().take(5).sum::<f32>()
            / h.step_losses.len().clamp(1, 5) as f32;
        rows.push(Row {
            name,
            estimate: trainer.estimate_bytes(),
            measured,
            step_ms: h.step_ms_median(),
            final_loss: last,
        });
    }
    println!("| variant | estimated peak | measured peak | error | step (ms, median) | loss (last 5 of {} steps) |", args.compare_steps);
    println!("|---|--:|--:|--:|--:|--:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:+.1}% | {:.1} | {:.1} |",
            r.name,
            format_bytes(r.estimate),
            format_bytes(r.measured),
            memwise::runtime::monitor::error_percent(r.measured, r.estimate),
            r.step_ms,
            r.final_loss
        );
    }
    let bars: Vec<(String, u64, u64)> = rows
        .iter()
        .map(|r| (r.name.clone(), r.estimate, r.measured))
        .collect();
    std::fs::write(
        &args.compare_svg,
        bar_chart(
            "ConvVae: one training step's memory, estimated vs measured",
            &bars,
            Some(budget),
        ),
    )?;
    eprintln!("bar chart written to {}", args.compare_svg.display());
    Ok(())
}

/// A grouped bar chart (estimated vs measured per variant) as SVG, binary units.
fn bar_chart(title: &str, rows: &[(String, u64, u64)], budget: Option<u64>) -> String {
    use memwise::plan::advice::format_bytes;
    let (w, row_h, left, top) = (900.0f64, 56.0f64, 300.0f64, 60.0f64);
    let max = rows
        .iter()
        .map(|r| r.1.max(r.2))
        .chain(budget)
        .max()
        .unwrap_or(1) as f64
        * 1.1;
    let scale = |b: u64| (w - left - 40.0) * b as f64 / max;
    let h = top + row_h * rows.len() as f64 + 50.0;
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"13\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"20\" y=\"28\" font-size=\"16\" font-weight=\"bold\">{}</text>\n\
         <rect x=\"{left}\" y=\"38\" width=\"12\" height=\"12\" fill=\"#7aa6d6\"/><text x=\"{}\" y=\"49\">estimated (compile time)</text>\n\
         <rect x=\"{}\" y=\"38\" width=\"12\" height=\"12\" fill=\"#e07b39\"/><text x=\"{}\" y=\"49\">measured (peak RSS growth)</text>\n",
        esc(title), left + 16.0, left + 220.0, left + 236.0
    );
    for (i, (name, est, meas)) in rows.iter().enumerate() {
        let y = top + row_h * i as f64;
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            left - 10.0,
            y + 26.0,
            esc(name)
        );
        for (k, (v, colour)) in [(*est, "#7aa6d6"), (*meas, "#e07b39")].iter().enumerate() {
            let yy = y + 6.0 + 22.0 * k as f64;
            s += &format!(
                "<rect x=\"{left}\" y=\"{yy}\" width=\"{:.1}\" height=\"18\" fill=\"{colour}\"><title>{}: {}</title></rect>\
                 <text x=\"{:.1}\" y=\"{}\" font-size=\"12\">{}</text>\n",
                scale(*v),
                esc(name),
                format_bytes(*v),
                left + scale(*v) + 6.0,
                yy + 14.0,
                format_bytes(*v)
            );
        }
    }
    if let Some(b) = budget {
        let x = left + scale(b);
        s += &format!(
            "<line x1=\"{x:.1}\" y1=\"{top}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#c0392b\" stroke-dasharray=\"6 4\"/>\
             <text x=\"{x:.1}\" y=\"{}\" fill=\"#c0392b\" text-anchor=\"middle\">budget {}</text>\n",
            h - 40.0,
            h - 24.0,
            format_bytes(b)
        );
    }
    s + "</svg>\n"
}

fn main() -> Res<()> {
    let vae = VaeFlags::parse();
    if vae.compare {
        return compare(&vae);
    }
    let flags = vae.flags;
    let args = &flags.memwise;
    let (train, test) = mnist_images(args)?;
    dump_batches::<ConvVae>(&flags, &train)?;
    let Some(mut trainer) = args.build::<ConvVae>()? else {
        return Ok(()); // --summary
    };
    eprintln!(
        "ConvVae: {} parameters; one training step at batch {} needs {} (planned at compile time)",
        ConvVae::PARAMS,
        trainer.plan().batch,
        memwise::plan::advice::format_bytes(trainer.plan().memory.total)
    );
    let mut mem = MemoryCallback::default();
    let history = trainer.fit(&train, None, &args.fit_options(5), &mut [&mut mem])?;
    let eval = trainer.evaluate(&test)?;
    let l = &history.step_losses;
    let head = l.iter().take(10).sum::<f32>() / l.len().clamp(1, 10) as f32;
    let tail = l.iter().rev().take(10).sum::<f32>() / l.len().clamp(1, 10) as f32;
    if trainer.rank() == 0 {
        println!("loss (reconstruction + KL): first 10 steps {head:.1}, last 10 steps {tail:.1}; held-out {:.1}", eval.loss);
    }
    args.finish(
        &trainer,
        &history,
        memwise::serde_json::json!({"val_loss": eval.loss}),
    )?;
    Ok(())
}
