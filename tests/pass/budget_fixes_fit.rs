//! The fixes the budget error proposes for `tests/ui/budget_exceeded_checkpoint.rs` (a
//! 150 MiB budget), applied one at a time: each one compiles, so each one fits.
use memwise::prelude::*;

macro_rules! deep_mlp {
    ($name:ident, batch = $batch:literal, precision = $precision:ident, [$($c1:tt)*], [$($c2:tt)*]) => {
        #[memwise::model(batch = $batch, precision = $precision, optimizer = sgd, loss = mse(out, target), budget = "150 MiB")]
        struct $name {
            #[input(shape = [1024])]
            x: Input,
            #[input(shape = [1024])]
            target: Input,
            $($c1)* #[dense(1024, activation = relu, from = x)]
            fc1: Dense,
            $($c1)* #[dense(1024, activation = relu)]
            fc2: Dense,
            $($c2)* #[dense(1024, activation = relu)]
            fc3: Dense,
            $($c2)* #[dense(1024, activation = relu)]
            fc4: Dense,
            $($c2)* #[dense(1024, activation = relu)]
            fc5: Dense,
            #[dense(1024)]
            out: Dense,
        }
    };
}

deep_mlp!(SmallerBatch, batch = 2899, precision = float32, [], []);
deep_mlp!(
    MixedPrecision,
    batch = 4096,
    precision = mixed_float16,
    [],
    []
);
deep_mlp!(Checkpointed, batch = 4096, precision = float32, [#[checkpoint(segment = 1)]], [#[checkpoint(segment = 2)]]);

const _: () = assert!(SmallerBatch::MEMORY.total <= 150 << 20);
const _: () = assert!(MixedPrecision::MEMORY.total <= 150 << 20);
const _: () = assert!(Checkpointed::MEMORY.total <= 150 << 20);

fn main() {
    // One more sample no longer fits: the batch was the largest.
    assert!(SmallerBatch::plan_for_batch(2900).unwrap().memory.total > 150 << 20);
}
