use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [5, 5, 1])]
    image: Input,
    #[conv2d(8, 7)]
    conv: Conv2d,
}

fn main() {}
