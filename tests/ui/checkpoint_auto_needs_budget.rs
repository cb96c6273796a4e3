use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse, checkpoint = auto)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(10)]
    out: Dense,
}

fn main() {}
