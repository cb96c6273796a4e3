use memwise::prelude::*;

#[memwise::model(batch = 128, replicas = 2, zero = optimizer, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(10)]
    out: Dense,
}

fn main() {}
