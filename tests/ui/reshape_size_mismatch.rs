use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[reshape([28, 27, 1])]
    image: Reshape,
}

fn main() {}
