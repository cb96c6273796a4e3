use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[conv2d(32, 3)]
    conv: Conv2d,
}

fn main() {}
