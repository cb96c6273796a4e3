use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(128, activation = relu)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {}
