use memwise::prelude::*;

#[memwise::model(batch = 256, optimizer = adam, loss = sparse_categorical_crossentropy, budget = "64 MiB")]
struct Net {
    #[input(shape = [32, 32, 3], dtype = u8, scale = 1.0 / 255.0)]
    image: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[conv2d(64, 3, padding = same, activation = relu, from = image)]
    conv1: Conv2d,
    #[conv2d(64, 3, padding = same, activation = relu)]
    conv2: Conv2d,
    #[max_pool2d(2)]
    pool: MaxPool2d,
    #[flatten]
    flat: Flatten,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {}
