use memwise::prelude::*;

#[memwise::model(batch = 8, optimizer = sgd(lr = 0.1), loss = mse(norm, x))]
struct Misplaced {
    #[input(shape = [16])]
    x: Input,
    #[recompute_output]
    #[dense(16)]
    hidden: Dense,
    #[checkpoint]
    #[recompute_output]
    #[layer_norm]
    norm: LayerNorm,
}

fn main() {}
