use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net(#[input(shape = [784])] Input, #[dense(10)] Dense);

fn main() {}
