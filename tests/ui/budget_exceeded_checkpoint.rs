use memwise::prelude::*;

#[memwise::model(batch = 4096, optimizer = sgd, loss = mse(out, target), budget = "150 MiB")]
struct DeepMlp {
    #[input(shape = [1024])]
    x: Input,
    #[input(shape = [1024])]
    target: Input,
    #[dense(1024, activation = relu, from = x)]
    fc1: Dense,
    #[dense(1024, activation = relu)]
    fc2: Dense,
    #[dense(1024, activation = relu)]
    fc3: Dense,
    #[dense(1024, activation = relu)]
    fc4: Dense,
    #[dense(1024, activation = relu)]
    fc5: Dense,
    #[dense(1024)]
    out: Dense,
}

fn main() {}
