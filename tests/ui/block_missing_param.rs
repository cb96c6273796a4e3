use memwise::prelude::*;

#[memwise::block(filters, strides = 1)]
struct Residual {
    #[conv2d(filters, 3, strides = strides, padding = same)]
    conv: Conv2d,
}

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[block(strides = 2)]
    stage: Residual,
}

fn main() {}
