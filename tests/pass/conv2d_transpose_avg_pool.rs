//! conv2d_transpose and avg_pool2d: an upsampling decoder with a pooled skip.
use memwise::prelude::*;

#[memwise::model(batch = 8, loss = mse(out, target))]
struct Upsampler {
    #[input(shape = [8, 8, 16])]
    code: Input,
    #[input(shape = [16, 16, 1])]
    target: Input,
    #[conv2d_transpose(32, 3, strides = 2, padding = same, activation = relu, from = code)]
    up: Conv2dTranspose,
    #[avg_pool2d(pool_size = 2, strides = 1, padding = same)]
    smooth: AvgPool2d,
    #[conv2d_transpose(filters = 1, kernel_size = [3, 3], padding = same, activation = sigmoid)]
    out: Conv2dTranspose,
}

fn main() {
    let m = Upsampler::MEMORY;
    let out = m.layers.iter().find(|l| l.name == "out").unwrap();
    assert_eq!(&out.output_shape[1..], &[16, 16, 1]);
    assert_eq!(Upsampler::PLAN.batch, 8);
}
