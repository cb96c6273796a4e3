use memwise::prelude::*;

#[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
                 metrics = [accuracy], budget = "2 GiB")]
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

const _: () = assert!(MnistMlp::MEMORY.total <= 4 << 30);

fn main() {
    let layers = MnistMlp::layers();
    assert_eq!(layers.hidden.name(), "hidden");
    println!("{}", MnistMlp::summary());
    let spec = MnistMlp::spec();
    assert_eq!(spec.batch, 128);
    assert_eq!(MnistMlp::plan_for_batch(128).unwrap(), MnistMlp::PLAN);
}
