use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[block]
    hidden: Dense,
}

fn main() {}
