use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[dense(64, from = second)]
    first: Dense,
    #[dense(64)]
    second: Dense,
}

fn main() {}
