use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse, stages = auto)]
struct Net {
    #[input(shape = [16])]
    x: Input,
    #[dense(16)]
    a: Dense,
    #[dense(16)]
    b: Dense,
    #[input(shape = [16])]
    target: Input,
}

fn main() {}
