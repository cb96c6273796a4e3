use memwise::prelude::*;

#[memwise::model(batch = 30, loss = mse, micro_batches = 4)]
struct Net {
    #[input(shape = [16])]
    x: Input,
    #[dense(16)]
    a: Dense,
    #[stage(1)]
    #[dense(16)]
    b: Dense,
    #[input(shape = [16])]
    target: Input,
}

fn main() {}
