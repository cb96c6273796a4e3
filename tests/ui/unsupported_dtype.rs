use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784], dtype = f64)]
    pixels: Input,
    #[dense(10)]
    out: Dense,
}

fn main() {}
