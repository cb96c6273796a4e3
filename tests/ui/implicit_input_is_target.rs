use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse(out, target))]
struct Net {
    #[input(shape = [16])]
    x: Input,
    #[input(shape = [16])]
    target: Input,
    #[dense(16)]
    out: Dense,
}

fn main() {}
