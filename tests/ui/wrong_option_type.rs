use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[conv2d(filters = 32.5, kernel_size = 3, use_bias = 1)]
    conv: Conv2d,
}

fn main() {}
