use memwise::prelude::*;

// Two replicas share each global batch of 128: each plans (and holds) 64 samples' step.
#[memwise::model(batch = 128, replicas = 2, optimizer = rmsprop(lr = 1e-3),
                 loss = sparse_categorical_crossentropy, metrics = [accuracy], budget = "2 GiB")]
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

// The per-replica batch and the replica count are consts of the plan.
const _: () = assert!(MnistMlp::PLAN.batch == 64 && MnistMlp::PLAN.replicas == 2);

fn main() {
    let spec = MnistMlp::spec();
    assert_eq!((spec.batch, spec.replicas), (128, 2));
    assert_eq!(MnistMlp::plan_for_batch(128).unwrap(), MnistMlp::PLAN);
    // The largest global batch under the budget is a whole number of replicas' shares.
    assert_eq!(MnistMlp::MAX_BATCH % 2, 0);
    let one = memwise::plan::plan(&spec.with_replicas(1)).unwrap();
    assert!(MnistMlp::MEMORY.total < one.memory.total);
}
