use memwise::prelude::*;

#[memwise::block(filters)]
struct Residual {
    #[conv2d(filters, 3, paddin = same)]
    conv: Conv2d,
    #[add(conv, inptu)]
    out: Add,
}

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[block(filters = 8)]
    stage: Residual,
}

fn main() {}
