use memwise::prelude::*;

#[memwise::block]
struct Mlp {
    #[layer_norm]
    norm: LayerNorm,
    #[dense(1024, activation = gelu)]
    up: Dense,
    #[dense(256)]
    down: Dense,
    #[add(input, down)]
    out: Add,
}

#[memwise::model(batch = 64, optimizer = adam, loss = mse(head, target), budget = "200 MiB")]
struct Stack {
    #[input(shape = [128, 256])]
    x: Input,
    #[input(shape = [128, 256])]
    target: Input,
    #[block(from = x)]
    blocks: [Mlp; 8],
    #[dense(256)]
    head: Dense,
}

fn main() {}
