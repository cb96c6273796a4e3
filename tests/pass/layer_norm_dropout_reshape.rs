//! layer_norm, dropout and reshape.
use memwise::prelude::*;

#[memwise::model(batch = 32, optimizer = sgd(lr = 0.1), loss = mse(back, x))]
struct Norms {
    #[input(shape = [64])]
    x: Input,
    #[layer_norm(epsilon = 1e-5)]
    norm: LayerNorm,
    #[dropout(rate = 0.25)]
    drop: Dropout,
    #[reshape(target_shape = [8, 8])]
    square: Reshape,
    #[dense(8)]
    mix: Dense,
    #[reshape([64])]
    back: Reshape,
}

fn main() {
    use memwise::plan::LayerKind;
    let spec = Norms::spec();
    assert_eq!(
        spec.layer("drop").unwrap().kind,
        LayerKind::Dropout { rate: 0.25 }
    );
    assert_eq!(
        spec.layer("norm").unwrap().kind,
        LayerKind::LayerNorm { epsilon: 1e-5 }
    );
    assert_eq!(spec.optimizer, memwise::plan::Optimizer::Sgd { lr: 0.1 });
}
