//! An array of layers: `[Dense; 3]` is three dense layers in a row.
use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse(out, x))]
struct DeepMlp {
    #[input(shape = [32])]
    x: Input,
    #[dense(64, activation = relu)]
    hidden: [Dense; 3],
    #[dense(32)]
    out: Dense,
}

fn main() {
    let spec = DeepMlp::spec();
    assert_eq!(spec.layer("hidden.1").unwrap().inputs, ["hidden.0"]);
    assert_eq!(spec.layer("out").unwrap().inputs, ["hidden.2"]);
    let layers = DeepMlp::layers();
    assert_eq!(layers.hidden[2].name(), "hidden.2");
    assert_eq!(layers.hidden[2].params()[0].name, "hidden.2.weight");
}
