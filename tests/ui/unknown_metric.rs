use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy, metrics = [acuracy])]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[dense(10, activation = softmax, from = pixels)]
    probs: Dense,
}

fn main() {}
