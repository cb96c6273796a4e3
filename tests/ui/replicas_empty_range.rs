use memwise::prelude::*;

#[memwise::model(batch = 128, replicas = 8..=2, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(10)]
    out: Dense,
}

fn main() {}
