use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[conv2d(32, 3, padding = same)]
    stem: Conv2d,
    #[conv2d(32, 3, strides = 2, padding = same)]
    block1: Conv2d,
    #[add(block1, stem)]
    sum: Add,
}

fn main() {}
