use memwise::prelude::*;

const N: usize = 3;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[dense(64)]
    hidden: [Dense; N],
}

fn main() {}
