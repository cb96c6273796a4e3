//! conv2d, max_pool2d, flatten and dense: a small CNN.
use memwise::prelude::*;

#[memwise::model(batch = 64, optimizer = adam, loss = sparse_categorical_crossentropy, metrics = [accuracy])]
struct SmallCnn {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    image: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[conv2d(filters = 32, kernel_size = 3, activation = relu, from = image)]
    conv1: Conv2d,
    #[max_pool2d(pool_size = 2)]
    pool1: MaxPool2d,
    #[conv2d(64, [3, 3], strides = 1, padding = valid, activation = relu)]
    conv2: Conv2d,
    #[max_pool2d(2, strides = 2, padding = same)]
    pool2: MaxPool2d,
    #[flatten]
    flat: Flatten,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {
    let spec = SmallCnn::spec();
    assert_eq!(spec.layer("conv1").unwrap().inputs, ["image"]);
    assert_eq!(
        spec.layer("pool1").unwrap().kind,
        memwise::plan::LayerKind::max_pool2d(2, 2, memwise::plan::Padding::Valid)
    );
    // 28 → 26 → 13 → 11 → 6: 6·6·64 features.
    assert_eq!(SmallCnn::PARAMS, 320 + 18_496 + (6 * 6 * 64 * 10 + 10));
    assert_eq!(SmallCnn::layers().conv2.params().len(), 2);
}
