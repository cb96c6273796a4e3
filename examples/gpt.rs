//! A GPT block as a byte-level language model: token and learned position embeddings, two
//! pre-norm transformer blocks (layer norm, causal multi-head attention, a GELU MLP, residual
//! adds), a final layer norm and the logits over the 256 byte values, in float32 with Adam.
//! It trains on English text that ships with the repository (its own README and guides,
//! about 90 KB) or on any file given with `--data`, and reports the held-out loss in bits
//! per byte, then continues a prompt greedily.
//!
//! `cargo run --release --example gpt` (add `-- --help` for the flags; `--data FILE` reads
//! any text or binary file).

mod common;

use clap::Parser;
use common::*;
use memwise::prelude::*;
use memwise::runtime::data::dataset::{Column, InMemory};

/// Bytes each sample reads; the model predicts the byte after each of them.
const SEQ: usize = 64;

/// A pre-norm transformer block (GPT-2's): attention and an MLP four times as wide as the
/// model, each added back to its input.
#[memwise::block(heads)]
pub struct GptBlock {
    #[layer_norm(epsilon = 1e-5)]
    ln_1: LayerNorm,
    #[attention(heads = heads, causal = true)]
    attn: Attention,
    #[add(input, attn)]
    res_1: Add,
    #[layer_norm(epsilon = 1e-5)]
    ln_2: LayerNorm,
    #[dense(512, activation = gelu)]
    fc: Dense,
    #[dense(128)]
    proj: Dense,
    #[add(res_1, proj)]
    res_2: Add,
}

#[memwise::model(batch = 32, optimizer = adam(lr = 1e-3),
                 loss = sparse_categorical_crossentropy(logits, next), metrics = [accuracy])]
pub struct Gpt {
    #[input(shape = [64], dtype = i32)]
    ids: Input,
    #[input(shape = [64], dtype = i32)]
    next: Input,
    #[embedding(input_dim = 256, output_dim = 128, from = ids)]
    embed: Embedding,
    #[positional_embedding]
    positions: PositionalEmbedding,
    #[block(heads = 4)]
    blocks: [GptBlock; 2],
    #[layer_norm(epsilon = 1e-5)]
    ln_f: LayerNorm,
    // Logits: the loss applies the softmax, stably.
    #[dense(256)]
    logits: Dense,
}

/// The text the example trains on when `--data` is not given: the project's own guides.
const BUNDLED: [&str; 6] = [
    include_str!("../README.md"),
    include_str!("../docs/DSL.md"),
    include_str!("../docs/PLANNER.md"),
    include_str!("../docs/CHECKPOINTING.md"),
    include_str!("../docs/DATA.md"),
    include_str!("../docs/WEIGHTS.md"),
];

fn main() -> Res<()> {
    let flags = Flags::parse();
    let args = &flags.memwise;
    let (text, what) = match &args.data {
        Some(path) => (
            std::fs::read(path).map_err(|e| format!("--data {}: {e}", path.display()))?,
            format!("{}", path.display()),
        ),
        None => (
            BUNDLED.concat().into_bytes(),
            "the bundled guides".to_string(),
        ),
    };
    // Data first, so the memory baseline (taken when the model is built) measures the model.
    let (train, test) = windows(&text)?;
    dump_batches::<Gpt>(&flags, &train)?;
    let Some(mut trainer) = args.build::<Gpt>()? else {
        return Ok(()); // --summary
    };
    eprintln!(
        "Gpt: {} parameters; one training step at batch {} needs {} (planned at compile time)",
        Gpt::PARAMS,
        trainer.plan().batch,
        memwise::plan::advice::format_bytes(trainer.plan().memory.total)
    );
    eprintln!(
        "training on {} bytes of {what}: {} windows of {SEQ}, {} held out",
        text.len(),
        train.len(),
        test.len()
    );
    let history = trainer.fit(&train, None, &args.fit_options(3), &mut [])?;
    let eval = trainer.evaluate(&test)?;
    let bits = eval.loss as f64 / std::f64::consts::LN_2;
    println!(
        "held-out: loss {:.4} ({bits:.3} bits per byte), next-byte accuracy {:.2}% on {} windows",
        eval.loss,
        100.0 * eval.accuracy.unwrap_or(0.0),
        eval.samples
    );
    let prompt = &text[..SEQ.min(text.len())];
    let continued = continue_greedily(&mut trainer, prompt, 48)?;
    println!(
        "greedy continuation of the first {SEQ} bytes: {:?}",
        String::from_utf8_lossy(&continued)
    );
    let metrics = memwise::serde_json::json!({"val_loss": eval.loss, "val_bits_per_byte": bits});
    args.finish(&trainer, &history, metrics)?;
    Ok(())
}

/// `(train, held-out)` windows of `text`: `ids` are `SEQ` bytes, `next` the same bytes one
/// later. Windows start every `SEQ / 2` bytes; the last tenth of the text is held out.
fn windows(text: &[u8]) -> Res<(InMemory, InMemory)> {
    if text.len() < 4 * (SEQ + 1) {
        return Err(format!(
            "the text has {} bytes; the example needs at least {}",
            text.len(),
            4 * (SEQ + 1)
        )
        .into());
    }
    let split = text.len() * 9 / 10;
    Ok((
        window_set(&text[..split])?,
        window_set(&text[split - SEQ..])?,
    ))
}

fn window_set(text: &[u8]) -> Res<InMemory> {
    let starts: Vec<usize> = (0..text.len() - SEQ).step_by(SEQ / 2).collect();
    let bytes = |offset: usize| -> Vec<i32> {
        starts
            .iter()
            .flat_map(|&s| text[s + offset..s + offset + SEQ].iter().map(|&b| b as i32))
            .collect()
    };
    Ok(InMemory::new(vec![
        Column::I32 {
            data: bytes(0),
            per_sample: SEQ,
        },
        Column::I32 {
            data: bytes(1),
            per_sample: SEQ,
        },
    ])?)
}

/// `prompt` followed by `n` bytes, each the most likely after the `SEQ` before it.
fn continue_greedily(trainer: &mut Trainer, prompt: &[u8], n: usize) -> Res<Vec<u8>> {
    let mut out = prompt.to_vec();
    for _ in 0..n {
        let window: Vec<i32> = out[out.len() - SEQ..].iter().map(|&b| b as i32).collect();
        let sample = InMemory::new(vec![
            Column::I32 {
                data: window.clone(),
                per_sample: SEQ,
            },
            Column::I32 {
                data: window,
                per_sample: SEQ,
            },
        ])?;
        let logits = trainer.predict(&sample)?;
        let last = &logits[(SEQ - 1) * 256..SEQ * 256];
        let best = (0..256).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        out.push(best as u8);
    }
    Ok(out[prompt.len()..].to_vec())
}
