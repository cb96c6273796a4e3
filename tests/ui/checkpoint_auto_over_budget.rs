// Even checkpointed, batch 1024 does not fit 8 MiB: the error says which batch does.
use memwise::prelude::*;

#[memwise::model(batch = 1024, loss = mse(out, target), budget = "8 MiB", checkpoint = auto)]
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
    #[dense(512)]
    out: Dense,
}

fn main() {}
