use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(512, activation = relu(0.5))]
    hidden: Dense,
}

fn main() {}
