//! The guide's chapter-8 convnet for cats vs dogs, trained from a folder of images streamed as
//! uint8 at 180×180×3: rescaling, five 3×3 convolutions of 32/64/128/256/256 filters with
//! 2×2 max pooling between them, flatten, one sigmoid unit, binary cross-entropy, RMSprop,
//! batch 32 — 991,041 parameters, as in the guide.
//!
//! `--data DIR` reads the Kaggle layout (`DIR/cat/*.jpg`, `DIR/dog/*.jpg`: one folder per
//! class; or the guide's `DIR/train/…` and `DIR/validation/…`). Without it, the bundled MNIST
//! digits 0 and 1 are written as such a folder of 28×28 PNG (and some JPEG) files, so the
//! decode-and-resize path runs on real images out of the box.
//!
//! `cargo run --release --example cats_vs_dogs` (add `-- --help` for the flags; `--summary`
//! shows the 180×180 plan, `--fit-to-device` the batch that fits).

mod common;

use std::path::{Path, PathBuf};

use clap::Parser;
use common::*;
use memwise::plan::advice::format_bytes;
use memwise::prelude::*;
use memwise::runtime::data::dataset::Dataset;
use memwise::runtime::data::digits_folder::write_digits_folder;
use memwise::runtime::MemoryCallback;

#[memwise::model(batch = 32, optimizer = rmsprop, loss = binary_crossentropy(probs, label))]
pub struct CatsVsDogs {
    #[input(shape = [180, 180, 3], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [1], dtype = f32)]
    label: Input,
    #[conv2d(32, 3, activation = relu, from = pixels)]
    conv_1: Conv2d,
    #[max_pool2d(2)]
    pool_1: MaxPool2d,
    #[conv2d(64, 3, activation = relu)]
    conv_2: Conv2d,
    #[max_pool2d(2)]
    pool_2: MaxPool2d,
    #[conv2d(128, 3, activation = relu)]
    conv_3: Conv2d,
    #[max_pool2d(2)]
    pool_3: MaxPool2d,
    #[conv2d(256, 3, activation = relu)]
    conv_4: Conv2d,
    #[max_pool2d(2)]
    pool_4: MaxPool2d,
    #[conv2d(256, 3, activation = relu)]
    conv_5: Conv2d,
    #[flatten]
    flatten: Flatten,
    #[dense(1, activation = sigmoid)]
    probs: Dense,
}

const _: () = assert!(CatsVsDogs::PARAMS == 991_041); // the guide's count

/// Trains the guide's chapter-8 convnet (cats vs dogs, 180×180×3) from a folder of images, or
/// from the bundled digits 0 and 1 written as one.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    flags: Flags,
    /// Decoding threads (default: one per CPU).
    #[arg(long)]
    workers: Option<usize>,
    /// Batches decoded ahead of the step (default: 2 per worker).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Stop at the first bad file instead of skipping it with a warning.
    #[arg(long)]
    strict: bool,
    /// Fraction of the folder held out for validation (when it has no `validation/`).
    #[arg(long, default_value_t = 0.2)]
    validation_split: f64,
}

/// The training and validation folders: `--data DIR` (its `train/` and `validation/` when it
/// has both, else DIR split), or the bundled digits written as a folder.
fn data_dir(flags: &memwise::cli::Args) -> Res<(PathBuf, Option<PathBuf>, String)> {
    if let Some(dir) = &flags.data {
        let (t, v) = (dir.join("train"), dir.join("validation"));
        if t.is_dir() && v.is_dir() {
            return Ok((
                t,
                Some(v),
                format!("{} (train/ and validation/)", dir.display()),
            ));
        }
        return Ok((dir.clone(), None, dir.display().to_string()));
    }
    let dir = std::env::temp_dir().join("memwise-cats-vs-dogs-digits");
    let written = write_digits_folder(&dir, &[0, 1], 10)?;
    let what = format!(
        "no --data: the bundled MNIST digits 0 and 1 written as an image folder, {} PNG and {} JPEG \
         files of 28×28 grayscale in {}/{{{}}} (decoded, made RGB and resized to 180×180 as photos would be)",
        written.png,
        written.jpeg,
        dir.display(),
        written.classes.join(",")
    );
    Ok((dir, None, what))
}

fn open_folders(
    args: &Args,
    plan: &memwise::plan::StaticPlan,
    train: &Path,
    val: Option<&Path>,
) -> Res<(ImageFolder, ImageFolder)> {
    let options = |dir: &Path| {
        let mut o = ImageFolder::options(dir)
            .for_plan(plan)
            .seed(1337)
            .strict(args.strict);
        if let Some(w) = args.workers {
            o = o.workers(w);
        }
        if let Some(p) = args.prefetch {
            o = o.prefetch(p);
        }
        o
    };
    Ok(match val {
        Some(v) => (options(train).open()?, options(v).open()?),
        None => options(train)
            .validation_split(args.validation_split)
            .open_split()?,
    })
}

fn main() -> Res<()> {
    let args = Args::parse();
    let m = &args.flags.memwise;
    if m.summary {
        m.build::<CatsVsDogs>()?; // prints the summary
        return Ok(());
    }
    // The plan the folders are read for: the compile-time one, or --batch / --fit-to-device's.
    let (_, plan) = m.plan::<CatsVsDogs>(&m.device()?)?;
    let (train_dir, val_dir, what) = data_dir(m)?;
    eprintln!("training on {what}");
    // Folders opened (listed, headers read) before the memory baseline; their workers start
    // with the first epoch, so their queue and buffers count as growth.
    let (train, val) = open_folders(&args, &plan, &train_dir, val_dir.as_deref())?;
    let lp = train.prefetch_plan(plan.batch);
    eprintln!(
        "CatsVsDogs: {} parameters; one training step at batch {} needs {} (planned at compile time); \
         {} training / {} validation images ({}); loader: {} workers, {} batches in flight, {} planned \
         ({} queue + {} × {} decode buffers)",
        CatsVsDogs::PARAMS,
        plan.batch,
        format_bytes(plan.memory.total),
        train.len(),
        val.len(),
        train.class_names().join(" = 0, ") + " = 1",
        lp.workers,
        lp.batches,
        format_bytes(lp.total()),
        format_bytes(lp.queue_bytes),
        lp.workers,
        format_bytes(lp.worker_bytes),
    );
    let Some(mut trainer) = m.build::<CatsVsDogs>()? else {
        return Ok(());
    };
    let mut mem = MemoryCallback::default();
    let history = trainer.fit(&train, None, &m.fit_options(1), &mut [&mut mem])?;
    let (stats, synchronous) = train.stats();
    eprintln!(
        "data wait: {:.2} ms/step after the first step (first step {:.1} ms); blocked on the queue {:.2} s \
         in all; {} batches prefetched, {} decoded in the step; at most {} batch buffers",
        history.data_wait_ms_after_warmup(),
        history.data_wait_ms.first().copied().unwrap_or(0.0),
        stats.blocked.as_secs_f64(),
        stats.prefetched,
        synchronous,
        stats.max_buffers
    );
    let eval = trainer.evaluate(&val)?;
    let probs = trainer.predict(&val)?;
    let correct = probs
        .iter()
        .zip(val.files())
        .filter(|(p, (_, label))| (**p > 0.5) == (*label == 1))
        .count();
    let acc = correct as f32 / val.len().max(1) as f32;
    println!(
        "validation: loss {:.4}, accuracy {:.2}% on {} images",
        eval.loss,
        100.0 * acc,
        eval.samples
    );
    let metrics = memwise::serde_json::json!({"val_loss": eval.loss, "val_accuracy": acc,
        "data_wait_ms": history.data_wait_ms,
        "queue_blocked_s": stats.blocked.as_secs_f64(),
        "prefetch_planned_bytes": trainer.host_bytes().prefetch});
    m.finish(&trainer, &history, metrics)?;
    Ok(())
}
