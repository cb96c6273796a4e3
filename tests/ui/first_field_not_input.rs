use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[dense(10)]
    out: Dense,
    #[input(shape = [784])]
    pixels: Input,
}

fn main() {}
