//! sample_normal and a loss that sums terms (the VAE).
use memwise::prelude::*;

#[memwise::model(batch = 32, optimizer = adam,
                 loss = binary_crossentropy(decoded, pixels, reduction = sum) + 0.5 * kl_normal(z_mean, z_log_var))]
struct Vae {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[dense(64, activation = relu)]
    enc: Dense,
    #[dense(2, from = enc)]
    z_mean: Dense,
    #[dense(2, from = enc)]
    z_log_var: Dense,
    #[sample_normal(z_mean, z_log_var)]
    z: SampleNormal,
    #[dense(64, activation = relu)]
    dec: Dense,
    #[dense(784, activation = sigmoid)]
    decoded: Dense,
}

fn main() {
    use memwise::plan::{LossKind, Reduction};
    let spec = Vae::spec();
    assert_eq!(spec.loss.len(), 2);
    assert_eq!(
        (spec.loss[0].kind, spec.loss[0].reduction),
        (LossKind::BinaryCrossentropy, Reduction::SumOverFeatures)
    );
    assert_eq!(
        (spec.loss[1].kind, spec.loss[1].weight),
        (LossKind::KlNormal, 0.5)
    );
    assert_eq!(spec.layer("z").unwrap().inputs, ["z_mean", "z_log_var"]);
    assert_eq!(Vae::PLAN.losses.len(), 2);
}
