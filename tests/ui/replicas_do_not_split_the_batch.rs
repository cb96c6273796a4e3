use memwise::prelude::*;

#[memwise::model(batch = 100, replicas = 3, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(10)]
    out: Dense,
}

fn main() {}
