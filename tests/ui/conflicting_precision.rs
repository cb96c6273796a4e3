use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[fp16]
    #[bf16]
    #[dense(10)]
    out: Dense,
}

fn main() {}
