use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [16])]
    x: Input,
    #[dense(16)]
    a: Dense,
    #[stage(2)]
    #[dense(16)]
    b: Dense,
}

fn main() {}
