//! The seed's models, a ResNet-50 and a 12-layer GPT-2-small written in the
//! `#[memwise::model]` DSL, each with the memory of one training step planned at compile
//! time. `cargo run --release --example dsl_models` prints every model's `MEMORY.total` and
//! summary.
use memwise::prelude::*;

// ---- The MNIST MLP (the guide's first model) ----

#[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
                 metrics = [accuracy], budget = "2 GiB")]
pub struct MnistMlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(512, activation = relu, from = pixels)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    logits: Dense,
}

// ---- A small residual convnet with separable convolutions (the guide's chapter-9 style) ----

/// Pre-activation residual block: two separable convs, a strided max pool, and a strided
/// 1×1 projection of the block's input added back.
#[memwise::block(size)]
pub struct SeparableResidual {
    #[batch_norm]
    bn_1: BatchNorm,
    #[activation(relu)]
    relu_1: Activation,
    #[separable_conv2d(size, 3, padding = same, use_bias = false)]
    sep_1: SeparableConv2d,
    #[batch_norm]
    bn_2: BatchNorm,
    #[activation(relu)]
    relu_2: Activation,
    #[separable_conv2d(size, 3, padding = same, use_bias = false)]
    sep_2: SeparableConv2d,
    #[max_pool2d(3, strides = 2, padding = same)]
    pool: MaxPool2d,
    #[conv2d(size, 1, strides = 2, padding = same, use_bias = false, from = input)]
    residual: Conv2d,
    #[add(pool, residual)]
    out: Add,
}

#[memwise::model(batch = 128, loss = sparse_categorical_crossentropy, metrics = [accuracy], budget = "1 GiB")]
pub struct SeparableConvNet {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[conv2d(32, 5, use_bias = false, from = pixels)]
    stem: Conv2d,
    #[block(size = 32)]
    block_32: SeparableResidual,
    #[block(size = 64)]
    block_64: SeparableResidual,
    #[block(size = 128)]
    block_128: SeparableResidual,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dropout(0.5)]
    dropout: Dropout,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

// ---- The convolutional VAE (Keras example, latent dimension 2) ----

#[memwise::model(
    batch = 128,
    optimizer = adam,
    loss = binary_crossentropy(decoded, pixels, reduction = sum) + kl_normal(z_mean, z_log_var),
    budget = "1 GiB"
)]
pub struct ConvVae {
    #[input(shape = [28, 28, 1], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[conv2d(32, 3, strides = 2, padding = same, activation = relu)]
    enc_conv1: Conv2d,
    #[conv2d(64, 3, strides = 2, padding = same, activation = relu)]
    enc_conv2: Conv2d,
    #[flatten]
    enc_flatten: Flatten,
    #[dense(16, activation = relu)]
    enc_dense: Dense,
    #[dense(2, from = enc_dense)]
    z_mean: Dense,
    #[dense(2, from = enc_dense)]
    z_log_var: Dense,
    #[sample_normal(z_mean, z_log_var)]
    z: SampleNormal,
    #[dense(7 * 7 * 64, activation = relu)]
    dec_dense: Dense,
    #[reshape([7, 7, 64])]
    dec_reshape: Reshape,
    #[conv2d_transpose(64, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv1: Conv2dTranspose,
    #[conv2d_transpose(32, 3, strides = 2, padding = same, activation = relu)]
    dec_deconv2: Conv2dTranspose,
    #[conv2d_transpose(1, 3, padding = same, activation = sigmoid)]
    decoded: Conv2dTranspose,
}

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
    show::<SeparableConvNet>("SeparableConvNet");
    show::<ConvVae>("ConvVae");
    show::<ResNet50>("ResNet50");
    show::<Gpt2Small>("Gpt2Small");
}
