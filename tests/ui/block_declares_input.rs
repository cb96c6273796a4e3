use memwise::prelude::*;

#[memwise::block]
struct Stem {
    #[input(shape = [28, 28, 1])]
    image: Input,
    #[conv2d(8, 3)]
    conv: Conv2d,
}

fn main() {}
