use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {}
