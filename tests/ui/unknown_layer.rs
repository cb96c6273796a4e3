use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dens(512, activation = relu)]
    hidden: Dense,
}

fn main() {}
