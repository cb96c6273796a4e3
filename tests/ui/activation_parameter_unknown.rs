use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(512, activation = leaky_relu(slope = 0.1))]
    hidden: Dense,
}

fn main() {}
