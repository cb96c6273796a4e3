//! The seed's models written in the `#[memwise::model]` DSL: the MNIST MLP, the convnet
//! and the VAE of the three trained examples, a ResNet-50 and a 12-layer GPT-2-small, each
//! with the memory of one training step planned at compile time.
//! `cargo run --release --example dsl_models` prints every model's `MEMORY.total` and
//! summary.
// Each example file declares its own `mod common;`: loading three of them here loads it thrice.
#![allow(clippy::duplicate_mod)]
use memwise::prelude::*;

// ---- The three trained examples' models, read from their own files ----
// (each file is also its example's `main`; here only its model is used)

#[allow(dead_code)]
#[path = "convnet.rs"]
mod convnet;
#[allow(dead_code)]
#[path = "mnist_mlp.rs"]
mod mnist_mlp;
#[allow(dead_code)]
#[path = "vae.rs"]
mod vae;
pub use convnet::ConvNet;
pub use mnist_mlp::MnistMlp;
pub use vae::ConvVae;

// ---- ResNet-50 (224², batch 32) and GPT-2 small: one line per layer ----
// (`rustfmt::skip` keeps the table layout; `tests/dsl_zoo.rs` checks that each model stays
// under 60 lines and plans exactly like the planner's zoo version.)

/// Bottleneck block opening a stage: a strided 1×1 projection shortcut.
#[rustfmt::skip]
#[memwise::block(filters, strides = 1)]
pub struct Bottleneck {
    #[conv2d(filters * 4, 1, strides = strides, padding = same, use_bias = false)] proj_conv: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] proj_bn: BatchNorm,
    #[conv2d(filters, 1, strides = strides, padding = same, use_bias = false, from = input)] conv_1: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_1: BatchNorm,
    #[activation(relu)] relu_1: Activation,
    #[conv2d(filters, 3, padding = same, use_bias = false)] conv_2: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_2: BatchNorm,
    #[activation(relu)] relu_2: Activation,
    #[conv2d(filters * 4, 1, padding = same, use_bias = false)] conv_3: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_3: BatchNorm,
    #[add(proj_bn, bn_3, activation = relu)] out: Add,
}

/// Bottleneck block with the identity shortcut.
#[rustfmt::skip]
#[memwise::block(filters)]
pub struct Identity {
    #[conv2d(filters, 1, padding = same, use_bias = false)] conv_1: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_1: BatchNorm,
    #[activation(relu)] relu_1: Activation,
    #[conv2d(filters, 3, padding = same, use_bias = false)] conv_2: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_2: BatchNorm,
    #[activation(relu)] relu_2: Activation,
    #[conv2d(filters * 4, 1, padding = same, use_bias = false)] conv_3: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] bn_3: BatchNorm,
    #[add(input, bn_3, activation = relu)] out: Add,
}

#[rustfmt::skip]
#[memwise::model(batch = 32, optimizer = sgd(lr = 0.01, momentum = 0.9), loss = sparse_categorical_crossentropy)]
pub struct ResNet50 {
    #[input(shape = [224, 224, 3], dtype = u8, scale = 1.0 / 255.0)] pixels: Input,
    #[input(shape = [], dtype = i32)] labels: Input,
    #[conv2d(64, 7, strides = 2, padding = same, use_bias = false, from = pixels)] conv1: Conv2d,
    #[batch_norm(momentum = 0.9, epsilon = 1e-5)] conv1_bn: BatchNorm,
    #[activation(relu)] conv1_relu: Activation,
    #[max_pool2d(3, strides = 2, padding = same)] pool1: MaxPool2d,
    #[block(filters = 64)] conv2_1: Bottleneck,
    #[block(filters = 64)] conv2: [Identity; 2],
    #[block(filters = 128, strides = 2)] conv3_1: Bottleneck,
    #[block(filters = 128)] conv3: [Identity; 3],
    #[block(filters = 256, strides = 2)] conv4_1: Bottleneck,
    #[block(filters = 256)] conv4: [Identity; 5],
    #[block(filters = 512, strides = 2)] conv5_1: Bottleneck,
    #[block(filters = 512)] conv5: [Identity; 2],
    #[global_avg_pool] avg_pool: GlobalAvgPool,
    #[dense(1000, activation = softmax)] predictions: Dense,
}

// ---- GPT-2 small, 12 layers (inputs already embedded, float16) ----

/// A pre-LN GPT-2 block: causal self-attention and a 4× MLP, each with a residual.
#[rustfmt::skip]
#[memwise::block]
pub struct Gpt2Block {
    #[layer_norm(epsilon = 1e-5)] ln_1: LayerNorm,
    #[attention(heads = 12, causal = true, dropout = 0.1)] attn: Attention,
    #[dropout(0.1)] attn_dropout: Dropout,
    #[add(input, attn_dropout)] add_1: Add,
    #[layer_norm(epsilon = 1e-5)] ln_2: LayerNorm,
    #[dense(3072, activation = gelu)] mlp_fc: Dense,
    #[dense(768)] mlp_proj: Dense,
    #[dropout(0.1)] mlp_dropout: Dropout,
    #[add(add_1, mlp_dropout)] add_2: Add,
}

#[rustfmt::skip]
#[memwise::model(batch = 8, precision = mixed_float16, optimizer = adamw, loss = mse(ln_f, target))]
pub struct Gpt2Small {
    #[input(shape = [1024, 768], dtype = f16)] hidden_states: Input,
    #[input(shape = [1024, 768], dtype = f16)] target: Input,
    #[block(from = hidden_states)] h: [Gpt2Block; 12],
    #[layer_norm(epsilon = 1e-5)] ln_f: LayerNorm,
}

// Checked by the compiler: the MLP's step fits in 8 MiB.
const _: () = assert!(MnistMlp::MEMORY.total <= 8 << 20);

fn show<M: Model>(name: &str) {
    let m = M::MEMORY;
    println!(
        "{name}: {} per training step ({} bytes; {} parameters; batch {})",
        memwise::plan::advice::format_bytes(m.total),
        m.total,
        M::PARAMS,
        M::PLAN.batch
    );
    println!("{}", M::summary());
}

fn main() {
    show::<MnistMlp>("MnistMlp");
    show::<ConvNet>("ConvNet");
    show::<ConvVae>("ConvVae");
    show::<ResNet50>("ResNet50");
    show::<Gpt2Small>("Gpt2Small");
}
