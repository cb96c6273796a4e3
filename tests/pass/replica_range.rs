use memwise::prelude::*;

// Launched on 2 to 8 replicas, the count chosen at run time (`--data-parallel` takes the
// job's); the consts describe the smallest count, whose per-replica step is the largest.
#[memwise::model(batch = 128, replicas = 2..=8, optimizer = adam,
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

const _: () = assert!(MnistMlp::PLAN.replicas == 2 && MnistMlp::PLAN.batch == 64);

fn main() {
    let spec = MnistMlp::spec();
    assert_eq!(spec.replica_range, Some([2, 8]));
    // Every count in the range that splits the batch plans, each replica holding less.
    let four = memwise::plan::plan(&spec.with_replicas(4)).unwrap();
    assert_eq!(four.batch, 32);
    assert!(four.memory.total < MnistMlp::MEMORY.total);
    let e = memwise::plan::plan(&spec.with_replicas(16)).unwrap_err();
    assert!(e.message.contains("declared for 2 to 8 replicas"), "{}", e.message);
    let e = memwise::plan::plan(&spec.with_replicas(3)).unwrap_err();
    assert!(e.message.contains("does not split evenly"), "{}", e.message);
}
