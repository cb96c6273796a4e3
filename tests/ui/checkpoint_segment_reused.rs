use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[checkpoint(segment = 1)]
    #[dense(64)]
    a: Dense,
    #[dense(64)]
    b: Dense,
    #[checkpoint(segment = 1)]
    #[dense(64)]
    c: Dense,
}

fn main() {}
