// One mistake in a model reads as one error: the struct still gets every item the macro adds
// (an empty plan), so its uses below type-check instead of each adding "no function `new`".
use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
struct Net {
    #[input(shape = [784])]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(128, activaton = relu, from = pixels)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {
    let device = Device::cpu();
    let _a = Net::new(&device);
    let _b = Net::new(&device);
    let _m = Net::MEMORY.total + Net::PLAN.memory.total;
    println!("{}", Net::summary());
}
