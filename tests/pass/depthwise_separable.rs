//! depthwise_conv2d, separable_conv2d, batch_norm, activation and global_avg_pool.
use memwise::prelude::*;

#[memwise::model(batch = 16, loss = sparse_categorical_crossentropy)]
struct MobileStyle {
    #[input(shape = [32, 32, 3])]
    image: Input,
    #[conv2d(16, 3, strides = 2, padding = same, use_bias = false)]
    stem: Conv2d,
    #[batch_norm]
    stem_bn: BatchNorm,
    #[activation(relu)]
    stem_relu: Activation,
    #[depthwise_conv2d(3, padding = same, depth_multiplier = 2, use_bias = false)]
    dw: DepthwiseConv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)]
    dw_bn: BatchNorm,
    #[activation(activation = relu)]
    dw_relu: Activation,
    #[separable_conv2d(filters = 64, kernel_size = 3, strides = 2, padding = same, activation = relu)]
    sep: SeparableConv2d,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dense(10, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

fn main() {
    use memwise::plan::LayerKind;
    let spec = MobileStyle::spec();
    assert!(matches!(
        spec.layer("dw").unwrap().kind,
        LayerKind::DepthwiseConv2d {
            multiplier: 2,
            use_bias: false,
            ..
        }
    ));
    assert!(
        matches!(spec.layer("dw_bn").unwrap().kind, LayerKind::BatchNorm { momentum, .. } if momentum == 0.9)
    );
    assert!(MobileStyle::MEMORY.total > 0);
}
