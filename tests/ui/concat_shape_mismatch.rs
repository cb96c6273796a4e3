use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[conv2d(16, 3, padding = same)]
    left: Conv2d,
    #[conv2d(16, 3, strides = 2, padding = same, from = image)]
    right: Conv2d,
    #[concat(left, right)]
    both: Concat,
}

fn main() {}
