use memwise::prelude::*;

#[memwise::model(batch = 4096, loss = mse(out, x), budget = "64 MiB")]
struct TooBig {
    #[input(shape = [1024])]
    x: Input,
    #[dense(1024, activation = relu)]
    hidden: Dense,
    #[dense(1024)]
    out: Dense,
}

fn main() {}
