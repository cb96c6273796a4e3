use memwise::plan::data_parallel::Sharding;
use memwise::prelude::*;

// ZeRO stage 1: two replicas, each keeping and updating half of Adam's two state slots.
#[memwise::model(batch = 128, replicas = 2, zero = 1, optimizer = adam(lr = 1e-3),
                 loss = sparse_categorical_crossentropy, budget = "2 GiB")]
pub struct MnistMlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[dense(512, activation = relu)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

// The sharding is a const of the plan, and so is the sharded optimizer state.
const _: () = assert!(matches!(MnistMlp::PLAN.sharding, Sharding::OptimizerState));

fn main() {
    let spec = MnistMlp::spec();
    assert_eq!(spec.sharding, Sharding::OptimizerState);
    let whole = memwise::plan::plan(&spec.with_sharding(Sharding::Replicated)).unwrap();
    // Half of the state, plus each shard's rounding to the alignment.
    let half = whole.memory.optimizer / 2;
    assert!(MnistMlp::MEMORY.optimizer >= half);
    assert!(MnistMlp::MEMORY.optimizer < half + 4 * 256 * 2);
    assert_eq!(MnistMlp::MEMORY.params, whole.memory.params);
    let summary = MnistMlp::summary().to_string();
    assert!(
        summary.contains("(this replica's 1/2 shard: ZeRO stage 1)"),
        "{summary}"
    );
    assert!(
        summary.contains("the optimizer state is split among them"),
        "{summary}"
    );
}
