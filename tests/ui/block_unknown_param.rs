use memwise::prelude::*;

#[memwise::block(filters)]
struct Residual {
    #[conv2d(filters, 3, padding = same)]
    conv: Conv2d,
}

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[block(filter = 32)]
    stage: Residual,
}

fn main() {}
