use memwise::prelude::*;

#[memwise::model(batch = 32, loss = binary_crossentropy(decodde, pixels, reduction = sum))]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[dense(784, activation = sigmoid)]
    decoded: Dense,
}

fn main() {}
