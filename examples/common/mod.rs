//! What every example shares beyond `memwise::cli::Args`: the MNIST data (bundled, or IDX
//! files from `--data`) and `--dump-batches`, which the PyTorch twins in `bench/` read.
#![allow(dead_code)]

use std::path::PathBuf;

use clap::Parser;
pub use memwise::cli::Args;
use memwise::plan::LayerKind;
use memwise::runtime::data::dataset::{Column, Dataset, InMemory};
use memwise::runtime::data::idx::{load_bundled_digits, load_mnist_dir};
use memwise::runtime::RuntimeError;

/// Flags every example takes: memwise's own (`memwise::cli::Args`, what any program built
/// on memwise gets in two lines) and the examples' `--dump-batches`.
#[derive(Parser, Debug, Clone)]
pub struct Flags {
    #[command(flatten)]
    pub memwise: Args,
    /// Write the batches of the first `--steps` training steps (default 20) as safetensors,
    /// one tensor per model input, `[steps, batch, …]` in the stored dtype; needs
    /// `--no-shuffle`. Its metadata names the model's layers in order (the random streams of
    /// dropout and sampling are keyed by that index, see kernels/src/random.rs).
    #[arg(long, value_name = "PATH")]
    pub dump_batches: Option<PathBuf>,
}

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Writes `--dump-batches`: the batches the first `--steps` (default 20) steps of an
/// unshuffled first epoch will see. Call it before the memory baseline is taken.
pub fn dump_batches<M: memwise::Model>(flags: &Flags, train: &InMemory) -> Res<()> {
    let Some(path) = &flags.dump_batches else {
        return Ok(());
    };
    let args = &flags.memwise;
    let spec = M::spec();
    let batch = args.batch.unwrap_or(spec.batch);
    if !args.no_shuffle {
        return Err(
            "--dump-batches needs --no-shuffle (the batches are the training set in order)".into(),
        );
    }
    let steps = args.steps.unwrap_or(20).min(train.len() / batch.max(1));
    let n = steps * batch;
    let idx: Vec<usize> = (0..n).collect();
    let mut bufs: Vec<Column> = train.columns().iter().map(|c| c.buffer(n)).collect();
    train.gather(&idx, &mut bufs)?;
    let names: Vec<&str> = spec
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Input { .. }))
        .map(|l| l.name.as_str())
        .collect();
    let mut tensors: Vec<(String, &'static str, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, b) in bufs.iter().enumerate() {
        let name = names
            .get(k)
            .map_or_else(|| format!("input{k}"), |s| s.to_string());
        let shape = match spec.layers.iter().find(|l| l.name == name).map(|l| &l.kind) {
            Some(LayerKind::Input { shape, .. }) => shape.clone(),
            _ => vec![b.per_sample()],
        };
        let dims = [vec![steps, batch], shape].concat();
        let (dtype, bytes) = match b {
            Column::U8 { data, .. } => ("U8", data.clone()),
            Column::I32 { data, .. } => {
                ("I32", data.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
            Column::F32 { data, .. } => {
                ("F32", data.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
        };
        tensors.push((name, dtype, dims, bytes));
    }
    let layers: Vec<&str> = spec.layers.iter().map(|l| l.name.as_str()).collect();
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "memwise.model": spec.name, "memwise.seed": args.seed.to_string(),
            "memwise.steps": steps.to_string(), "memwise.batch": batch.to_string(),
            "memwise.layers": serde_json::to_string(&layers)?,
        }),
    );
    let mut at = 0usize;
    for (name, dtype, dims, bytes) in &tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": dims, "data_offsets": [at, at + bytes.len()]}));
        at += bytes.len();
    }
    let mut h = serde_json::to_string(&header)?.into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + at);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, _, bytes) in &tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out)?;
    eprintln!("{steps} batches written to {}", path.display());
    Ok(())
}

/// `(train, held-out)` MNIST digits as (pixels u8, labels i32) datasets.
pub fn mnist(flags: &Args) -> Res<(InMemory, InMemory, String)> {
    match &flags.data {
        Some(dir) => {
            let set = load_mnist_dir(dir)?;
            Ok((
                InMemory::mnist(&set.train),
                InMemory::mnist(&set.test),
                format!("MNIST from {}", dir.display()),
            ))
        }
        None => {
            let (tr, te) = load_bundled_digits()?;
            Ok((
                InMemory::mnist(&tr),
                InMemory::mnist(&te),
                "bundled MNIST digits (8,000 train / 2,000 held out)".into(),
            ))
        }
    }
}

/// Same, images only (autoencoders).
pub fn mnist_images(flags: &Args) -> Res<(InMemory, InMemory)> {
    match &flags.data {
        Some(dir) => {
            let set = load_mnist_dir(dir)?;
            Ok((
                InMemory::mnist_images(&set.train),
                InMemory::mnist_images(&set.test),
            ))
        }
        None => {
            let (tr, te) = load_bundled_digits()?;
            Ok((InMemory::mnist_images(&tr), InMemory::mnist_images(&te)))
        }
    }
}

/// Trains a classifier for `default_epochs` (or `--epochs`), prints its held-out loss and
/// accuracy, and writes what `--report-json` and `--save-weights` ask for.
pub fn fit_and_evaluate_classifier(
    args: &Args,
    trainer: &mut memwise::prelude::Trainer,
    (train, test): (&InMemory, &InMemory),
    default_epochs: usize,
) -> Res<()> {
    let mut mem = memwise::prelude::MemoryCallback::default();
    let options = args.fit_options(default_epochs);
    let history = trainer.fit(train, None, &options, &mut [&mut mem])?;
    let eval = trainer.evaluate(test)?;
    let acc = eval.accuracy.unwrap_or(0.0);
    if trainer.rank() == 0 {
        println!(
            "held-out: loss {:.4}, accuracy {:.2}% on {} samples",
            eval.loss,
            100.0 * acc,
            eval.samples
        );
    }
    let metrics = memwise::serde_json::json!({"val_loss": eval.loss, "val_accuracy": acc});
    args.finish(trainer, &history, metrics)?;
    Ok(())
}

/// Turns a runtime error into the example's error.
pub fn rt<T>(r: Result<T, RuntimeError>) -> Res<T> {
    r.map_err(|e| e.into())
}
