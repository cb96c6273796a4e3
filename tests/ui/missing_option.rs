use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(activation = relu)]
    hidden: Dense,
}

fn main() {}
