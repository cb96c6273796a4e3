//! `checkpoint = auto` chooses checkpoints that fit the budget: this chain needs 17.27 MiB
//! unchecked at batch 1024; under 15 MiB the solver recomputes part of it.
use memwise::prelude::*;

#[memwise::model(batch = 1024, loss = mse(out, target), budget = "15 MiB", checkpoint = auto)]
struct Net {
    #[input(shape = [512])]
    x: Input,
    #[input(shape = [512])]
    target: Input,
    #[dense(256, activation = gelu, from = x)]
    h1: Dense,
    #[dense(256, activation = gelu)]
    h2: Dense,
    #[dense(256, activation = gelu)]
    h3: Dense,
    #[dense(256, activation = gelu)]
    h4: Dense,
    #[dense(512)]
    out: Dense,
}

const _: () = assert!(Net::MEMORY.total <= 15 << 20);

fn main() {
    assert!(Net::AUTO_CHECKPOINT.contains("recomputes"), "{}", Net::AUTO_CHECKPOINT);
    assert!(Net::spec().layers.iter().any(|l| l.checkpoint.is_some()));
}
