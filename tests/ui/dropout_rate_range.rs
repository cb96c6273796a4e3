use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dropout(1.5)]
    drop: Dropout,
}

fn main() {}
