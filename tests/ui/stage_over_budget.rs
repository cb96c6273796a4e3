use memwise::prelude::*;

// The first stage keeps two layers' activations for all 2048 samples: over the budget. The
// error names the stage, and the micro-batch count and the split that would fit.
#[memwise::model(batch = 2048, loss = mse, budget = "40 MiB")]
struct Net {
    #[input(shape = [512])]
    x: Input,
    #[dense(1024, activation = relu)]
    a: Dense,
    #[dense(1024, activation = relu)]
    b: Dense,
    #[dense(1024, activation = relu)]
    c: Dense,
    #[stage(1)]
    #[dense(512)]
    out: Dense,
    #[input(shape = [512])]
    target: Input,
}

fn main() {}
