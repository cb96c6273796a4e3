//! The model zoo: the standard graphs the memory-planning literature reports on (ResNet-50,
//! VGG19, MobileNet v1, U-Net, a GPT-2-small block stack) and the seed's own models (the
//! convolutional VAE, the MNIST MLP), each built with the planner's Rust API.
//!
//! They are the planner's benchmark graphs (`examples/plan_bench.rs`) and its reference
//! points for parameter counts (`tests/zoo.rs`). Every function documents the architecture
//! it reproduces and where it departs from it (only where the planner has no such layer, and
//! never in a way that changes a parameter count or an output shape).

use crate::dtype::{DType, Precision};
use crate::spec::{
    Activation, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer, Padding, Reduction,
};

/// A convolution without bias (the layer before a batch norm, whose shift makes a bias
/// redundant).
fn conv_nobias(filters: usize, kernel: usize, stride: usize) -> LayerKind {
    LayerKind::Conv2d {
        filters,
        kernel: [kernel; 2],
        strides: [stride; 2],
        padding: Padding::Same,
        activation: Activation::Linear,
        use_bias: false,
    }
}

/// PyTorch's batch norm defaults (momentum 0.1, i.e. Keras's 0.9; epsilon 1e-5).
fn bn_torch() -> LayerKind {
    LayerKind::BatchNorm {
        momentum: 0.9,
        epsilon: 1e-5,
    }
}

fn relu() -> LayerKind {
    LayerKind::Activation(Activation::Relu)
}

/// `{prefix}_bn` (`bn`) and `{prefix}_relu` after the layer before.
fn bn_relu(m: &mut ModelSpec, prefix: &str, bn: LayerKind) {
    m.add(&format!("{prefix}_bn"), bn, &[]);
    m.add(&format!("{prefix}_relu"), relu(), &[]);
}

/// An ImageNet classifier's start: 224×224×3 u8 pixels (scaled by 1/255) and i32 labels.
fn imagenet(name: &str, batch: usize, optimizer: Optimizer) -> ModelSpec {
    let mut m = ModelSpec::new(name, batch);
    m.optimizer = optimizer;
    m.input("pixels", &[224, 224, 3], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m
}

/// An ImageNet classifier's end: dense 1000 softmax → sparse categorical cross-entropy.
fn classify(mut m: ModelSpec) -> ModelSpec {
    m.add(
        "predictions",
        LayerKind::dense(1000, Activation::Softmax),
        &[],
    );
    m.loss.push(
        LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["predictions", "labels"]),
    );
    m
}

/// ResNet-50 (He et al., *Deep Residual Learning for Image Recognition*, CVPR 2016, table 1),
/// the bottleneck v1 network as torchvision's `resnet50` and Keras's `ResNet50` define it:
///
/// - 224×224×3 u8 pixels (scaled by 1/255 inside the step) and i32 labels;
/// - stem: conv 7×7/2, 64 → batch norm → relu → max pool 3×3/2 (to 56×56);
/// - stages conv2..conv5 of 3, 4, 6, 3 bottleneck blocks with 64, 128, 256, 512 filters:
///   1×1 conv → bn → relu → 3×3 conv → bn → relu → 1×1 conv (×4 filters) → bn, plus the
///   shortcut (a 1×1 projection conv → bn in each stage's first block, the identity
///   elsewhere), added and passed through relu. The stride of stages 3–5 sits on the first
///   1×1 conv and on the projection (v1; torchvision's "v1.5" moves it to the 3×3 conv, with
///   the same parameters and output shapes);
/// - global average pool → dense 1000 softmax → sparse categorical cross-entropy;
/// - SGD with momentum 0.9 (the paper's optimizer), float32.
///
/// Convolutions have no bias (torchvision; the following batch norm's shift makes one
/// redundant), so the trainable count is torchvision's published **25,557,032**; the batch
/// norms' running mean and variance add 53,120 non-trainable values (25,610,152 in all).
/// Keras's `ResNet50` keeps the redundant conv biases: with them the total is Keras's
/// 25,636,712 (`tests/zoo.rs` checks both). Keras pads explicitly (`ZeroPadding2D`) and
/// convolves with `valid`; `same` padding here gives the same shapes.
pub fn resnet50(batch: usize) -> ModelSpec {
    let mut m = imagenet("ResNet50", batch, Optimizer::MOMENTUM);
    m.add("conv1_conv", conv_nobias(64, 7, 2), &["pixels"]);
    bn_relu(&mut m, "conv1", bn_torch());
    let mut x = m.add(
        "pool1_pool",
        LayerKind::max_pool2d(3, 2, Padding::Same),
        &[],
    );
    for (stage, (blocks, filters)) in [(3, 64), (4, 128), (6, 256), (3, 512)]
        .into_iter()
        .enumerate()
    {
        let stage = stage + 2;
        for block in 1..=blocks {
            let stride = if stage > 2 && block == 1 { 2 } else { 1 };
            let p = format!("conv{stage}_block{block}");
            let shortcut = if block == 1 {
                m.add(
                    &format!("{p}_0_conv"),
                    conv_nobias(4 * filters, 1, stride),
                    &[&x],
                );
                m.add(&format!("{p}_0_bn"), bn_torch(), &[])
            } else {
                x.clone()
            };
            m.add(
                &format!("{p}_1_conv"),
                conv_nobias(filters, 1, stride),
                &[&x],
            );
            bn_relu(&mut m, &format!("{p}_1"), bn_torch());
            m.add(&format!("{p}_2_conv"), conv_nobias(filters, 3, 1), &[]);
            bn_relu(&mut m, &format!("{p}_2"), bn_torch());
            m.add(&format!("{p}_3_conv"), conv_nobias(4 * filters, 1, 1), &[]);
            let main = m.add(&format!("{p}_3_bn"), bn_torch(), &[]);
            x = m.add(
                &format!("{p}_out"),
                LayerKind::Add {
                    activation: Activation::Relu,
                },
                &[&shortcut, &main],
            );
        }
    }
    m.add("avg_pool", LayerKind::GlobalAvgPool, &[&x]);
    classify(m)
}

/// VGG19 (Simonyan & Zisserman, *Very Deep Convolutional Networks for Large-Scale Image
/// Recognition*, ICLR 2015, configuration E), as Keras's `VGG19` names its layers:
///
/// - 224×224×3 u8 pixels and i32 labels;
/// - five blocks of 3×3 `same` convolutions with bias and relu (2×64, 2×128, 4×256, 4×512,
///   4×512), each followed by a 2×2/2 max pool (224 → 7);
/// - flatten (7·7·512 = 25,088) → fc1 4096 relu → dropout 0.5 → fc2 4096 relu → dropout 0.5
///   → dense 1000 softmax → sparse categorical cross-entropy;
/// - SGD with momentum 0.9 (the paper's), float32.
///
/// The two dropouts are the paper's training setup (§3.1; Keras's inference-oriented model
/// omits them, torchvision keeps them). They hold no parameters: the count is the published
/// **143,667,240**.
pub fn vgg19(batch: usize) -> ModelSpec {
    let mut m = imagenet("VGG19", batch, Optimizer::MOMENTUM);
    let mut prev = "pixels".to_string();
    for (block, (convs, filters)) in [(2, 64), (2, 128), (4, 256), (4, 512), (4, 512)]
        .into_iter()
        .enumerate()
    {
        let block = block + 1;
        for conv in 1..=convs {
            prev = m.add(
                &format!("block{block}_conv{conv}"),
                LayerKind::conv2d(filters, 3, 1, Padding::Same, Activation::Relu),
                &[&prev],
            );
        }
        prev = m.add(
            &format!("block{block}_pool"),
            LayerKind::max_pool2d(2, 2, Padding::Valid),
            &[],
        );
    }
    m.add("flatten", LayerKind::Flatten, &[]);
    m.add("fc1", LayerKind::dense(4096, Activation::Relu), &[]);
    m.add("fc1_dropout", LayerKind::Dropout { rate: 0.5 }, &[]);
    m.add("fc2", LayerKind::dense(4096, Activation::Relu), &[]);
    m.add("fc2_dropout", LayerKind::Dropout { rate: 0.5 }, &[]);
    classify(m)
}

/// MobileNet v1 (Howard et al., *MobileNets: Efficient Convolutional Neural Networks for
/// Mobile Vision Applications*, 2017, table 1; width multiplier 1.0, 224×224), as Keras's
/// `MobileNet` builds and names it:
///
/// - 224×224×3 u8 pixels and i32 labels;
/// - conv 3×3/2, 32, no bias → bn → relu;
/// - 13 depthwise-separable blocks, each depthwise 3×3 (no bias) → bn → relu → pointwise
///   1×1 conv (no bias) → bn → relu, with pointwise filters 64, 128, 128, 256, 256, 512,
///   5×512, 1024, 1024 and stride 2 on the depthwise conv of blocks 2, 4, 6 and 12;
/// - global average pool → dropout 1e-3 (Keras's default) → dense 1000 softmax (Keras's
///   1×1 `conv_preds` on the pooled 1×1 map: the same parameters) → sparse categorical
///   cross-entropy;
/// - RMSprop (the paper's), float32.
///
/// Keras uses relu6; the planner's relu has the same memory behaviour (its backward reads
/// its output). With the batch norms' running statistics the count is Keras's published
/// **4,253,864** (4,231,976 trainable).
pub fn mobilenet_v1(batch: usize) -> ModelSpec {
    let mut m = imagenet("MobileNetV1", batch, Optimizer::RMSPROP);
    m.add("conv1", conv_nobias(32, 3, 2), &["pixels"]);
    bn_relu(&mut m, "conv1", LayerKind::batch_norm());
    let blocks: [(usize, usize); 13] = [
        (64, 1),
        (128, 2),
        (128, 1),
        (256, 2),
        (256, 1),
        (512, 2),
        (512, 1),
        (512, 1),
        (512, 1),
        (512, 1),
        (512, 1),
        (1024, 2),
        (1024, 1),
    ];
    for (i, (filters, stride)) in blocks.into_iter().enumerate() {
        let b = i + 1;
        m.add(
            &format!("conv_dw_{b}"),
            LayerKind::DepthwiseConv2d {
                kernel: [3, 3],
                strides: [stride; 2],
                padding: Padding::Same,
                multiplier: 1,
                activation: Activation::Linear,
                use_bias: false,
            },
            &[],
        );
        bn_relu(&mut m, &format!("conv_dw_{b}"), LayerKind::batch_norm());
        m.add(&format!("conv_pw_{b}"), conv_nobias(filters, 1, 1), &[]);
        bn_relu(&mut m, &format!("conv_pw_{b}"), LayerKind::batch_norm());
    }
    m.add("global_average_pooling2d", LayerKind::GlobalAvgPool, &[]);
    m.add("dropout", LayerKind::Dropout { rate: 1e-3 }, &[]);
    classify(m)
}

/// U-Net (Ronneberger, Fischer & Brox, *U-Net: Convolutional Networks for Biomedical Image
/// Segmentation*, MICCAI 2015, fig. 1) on 128×128×1 images, with `same` padding (as the
/// common Keras ports do, so the skips need no cropping):
///
/// - 128×128×1 u8 image (scaled by 1/255) and a 128×128×1 u8 mask of 0/1 (scale 1);
/// - contracting path: 4 levels of two 3×3 relu convs (64, 128, 256, 512 filters), each
///   followed by a 2×2/2 max pool; bottleneck: two 3×3 relu convs of 1024 → dropout 0.5
///   ("drop-out layers at the end of the contracting path", §3.1);
/// - expanding path: 4 levels of a 2×2/2 transposed conv halving the filters (the paper's
///   "up-convolution") → concat with the contracting level's output (skip first) → two 3×3
///   relu convs;
/// - 1×1 conv to one channel with sigmoid → binary cross-entropy against the mask;
/// - SGD with momentum 0.99 (the paper's), float32.
///
/// Parameters: 31,030,593, hand-computed level by level in `tests/zoo.rs` (the paper gives
/// no count; its unpadded version has the same parameters with two output classes, 31,030,658).
pub fn unet(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("UNet", batch);
    m.optimizer = Optimizer::Momentum {
        lr: 0.01,
        momentum: 0.99,
        nesterov: false,
    };
    m.input("image", &[128, 128, 1], DType::U8, 1.0 / 255.0);
    m.input("mask_target", &[128, 128, 1], DType::U8, 1.0);
    let conv3 = |f: usize| LayerKind::conv2d(f, 3, 1, Padding::Same, Activation::Relu);
    let mut x = "image".to_string();
    let mut skips = Vec::new();
    for (level, filters) in [64, 128, 256, 512].into_iter().enumerate() {
        let l = level + 1;
        m.add(&format!("enc{l}_conv1"), conv3(filters), &[&x]);
        let skip = m.add(&format!("enc{l}_conv2"), conv3(filters), &[]);
        x = m.add(
            &format!("enc{l}_pool"),
            LayerKind::max_pool2d(2, 2, Padding::Valid),
            &[],
        );
        skips.push((skip, filters));
    }
    m.add("bottleneck_conv1", conv3(1024), &[&x]);
    m.add("bottleneck_conv2", conv3(1024), &[]);
    x = m.add("bottleneck_dropout", LayerKind::Dropout { rate: 0.5 }, &[]);
    for (level, (skip, filters)) in skips.into_iter().enumerate().rev() {
        let l = level + 1;
        let up = m.add(
            &format!("dec{l}_up"),
            LayerKind::conv2d_transpose(filters, 2, 2, Padding::Same, Activation::Linear),
            &[&x],
        );
        m.add(&format!("dec{l}_concat"), LayerKind::Concat, &[&skip, &up]);
        m.add(&format!("dec{l}_conv1"), conv3(filters), &[]);
        x = m.add(&format!("dec{l}_conv2"), conv3(filters), &[]);
    }
    m.add(
        "mask",
        LayerKind::conv2d(1, 1, 1, Padding::Same, Activation::Sigmoid),
        &[&x],
    );
    m.loss
        .push(LossTerm::new(LossKind::BinaryCrossentropy).on(&["mask", "mask_target"]));
    m
}

/// Hidden size of GPT-2 small.
pub const GPT2_HIDDEN: usize = 768;
/// Attention heads of GPT-2 small.
pub const GPT2_HEADS: usize = 12;
/// Context length of GPT-2.
pub const GPT2_SEQ: usize = 1024;
/// GPT-2's vocabulary (its token embedding, not part of [`gpt2_stack`]).
pub const GPT2_VOCAB: usize = 50_257;

/// A stack of `layers` GPT-2-small transformer blocks (Radford et al., *Language Models are
/// Unsupervised Multitask Learners*, 2019; the layout of OpenAI's and Hugging Face's
/// `GPT2Block`), h = 768, 12 heads, sequence 1024, pre-LN:
///
/// - input `hidden_states`: a float16 `[1024, 768]` batch of embeddings (what the token and
///   position embeddings would produce), and a float16 `target` of the same shape;
/// - per block `h{i}`: layer norm (ε 1e-5) → causal self-attention (fused QKV projection,
///   12 heads, dropout 0.1 on the attention probabilities, output projection) → dropout 0.1
///   → add residual → layer norm → dense 3072 gelu → dense 768 → dropout 0.1 → add residual;
/// - the final layer norm `ln_f`, then mean squared error against `target` (a stand-in for
///   the LM head's loss, which this stack leaves out with the embeddings);
/// - AdamW, `mixed_float16` (fp16 activations, f32 master weights and layer-norm statistics,
///   dynamic loss scaling).
///
/// Each block holds 7,087,872 parameters; with `ln_f`, 12 blocks hold 85,056,000, and adding
/// the token (50,257 × 768) and position (1024 × 768) embeddings gives GPT-2 small's
/// published 124,439,808.
pub fn gpt2_stack(batch: usize, layers: usize) -> ModelSpec {
    let (h, heads, seq) = (GPT2_HIDDEN, GPT2_HEADS, GPT2_SEQ);
    let mut m = ModelSpec::new("Gpt2Stack", batch);
    m.precision = Precision::MixedFloat16;
    m.optimizer = Optimizer::ADAMW;
    m.input("hidden_states", &[seq, h], DType::F16, 1.0);
    m.input("target", &[seq, h], DType::F16, 1.0);
    let ln = || LayerKind::LayerNorm { epsilon: 1e-5 };
    let mut x = "hidden_states".to_string();
    for i in 0..layers {
        m.add(&format!("h{i}_ln_1"), ln(), &[&x]);
        m.add(
            &format!("h{i}_attn"),
            LayerKind::Attention {
                heads,
                causal: true,
                dropout: 0.1,
            },
            &[],
        );
        let a = m.add(
            &format!("h{i}_attn_dropout"),
            LayerKind::Dropout { rate: 0.1 },
            &[],
        );
        let r = m.add(&format!("h{i}_add_1"), LayerKind::add(), &[&x, &a]);
        m.add(&format!("h{i}_ln_2"), ln(), &[]);
        m.add(
            &format!("h{i}_mlp_fc"),
            LayerKind::dense(4 * h, Activation::Gelu),
            &[],
        );
        m.add(
            &format!("h{i}_mlp_proj"),
            LayerKind::dense(h, Activation::Linear),
            &[],
        );
        let d = m.add(
            &format!("h{i}_mlp_dropout"),
            LayerKind::Dropout { rate: 0.1 },
            &[],
        );
        x = m.add(&format!("h{i}_add_2"), LayerKind::add(), &[&r, &d]);
    }
    m.add("ln_f", ln(), &[&x]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["ln_f", "target"]));
    m
}

/// A small float32 GPT of `blocks` pre-LN blocks (sequence 16, width 32, 4 heads, causal
/// attention and dropout 0.1, GELU MLP of 128) under mean squared error against `target`:
/// the model the pipeline tests split into stages.
pub fn small_gpt(blocks: usize, batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("Gpt", batch);
    m.input("x", &[16, 32], DType::F32, 1.0);
    m.input("target", &[16, 32], DType::F32, 1.0);
    let mut prev = "x".to_string();
    for k in 0..blocks {
        let n = |s: &str| format!("b{k}_{s}");
        m.add(&n("ln1"), LayerKind::layer_norm(), &[&prev]);
        let attention = LayerKind::Attention {
            heads: 4,
            causal: true,
            dropout: 0.1,
        };
        m.add(&n("attn"), attention, &[]);
        m.add(&n("drop1"), LayerKind::Dropout { rate: 0.1 }, &[]);
        m.add(&n("res1"), LayerKind::add(), &[&n("drop1"), &prev]);
        m.add(&n("ln2"), LayerKind::layer_norm(), &[]);
        m.add(&n("mlp1"), LayerKind::dense(128, Activation::Gelu), &[]);
        m.add(&n("mlp2"), LayerKind::dense(32, Activation::Linear), &[]);
        m.add(&n("res2"), LayerKind::add(), &[&n("mlp2"), &n("res1")]);
        prev = n("res2");
    }
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&[&prev, "target"]));
    m
}

/// The seed's convolutional variational autoencoder (the Keras example "Variational
/// AutoEncoder", fchollet 2020) on 28×28×1 MNIST digits, latent dimension 2:
///
/// - encoder: u8 pixels (scaled by 1/255) → conv 32 3×3/2 same relu → conv 64 3×3/2 same
///   relu → flatten → dense 16 relu → `z_mean` dense 2 and `z_log_var` dense 2 →
///   `z` = sample_normal(z_mean, z_log_var);
/// - decoder: dense 7·7·64 relu → reshape [7, 7, 64] → conv-transpose 64 3×3/2 same relu →
///   conv-transpose 32 3×3/2 same relu → conv-transpose 1 3×3 same sigmoid;
/// - loss: binary cross-entropy(decoded, pixels) summed over the 784 pixels, plus
///   kl_normal(z_mean, z_log_var) summed over the latent, both averaged over the batch
///   (the example's `reconstruction_loss + kl_loss`);
/// - Adam, float32.
///
/// Parameters: 69,076 (encoder) + 65,089 (decoder) = 134,165, as the example's summaries print.
pub fn conv_vae(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("ConvVae", batch);
    m.optimizer = Optimizer::ADAM;
    m.input("pixels", &[28, 28, 1], DType::U8, 1.0 / 255.0);
    m.add(
        "enc_conv1",
        LayerKind::conv2d(32, 3, 2, Padding::Same, Activation::Relu),
        &[],
    );
    m.add(
        "enc_conv2",
        LayerKind::conv2d(64, 3, 2, Padding::Same, Activation::Relu),
        &[],
    );
    m.add("enc_flatten", LayerKind::Flatten, &[]);
    m.add("enc_dense", LayerKind::dense(16, Activation::Relu), &[]);
    m.add(
        "z_mean",
        LayerKind::dense(2, Activation::Linear),
        &["enc_dense"],
    );
    m.add(
        "z_log_var",
        LayerKind::dense(2, Activation::Linear),
        &["enc_dense"],
    );
    m.add("z", LayerKind::SampleNormal, &["z_mean", "z_log_var"]);
    m.add(
        "dec_dense",
        LayerKind::dense(7 * 7 * 64, Activation::Relu),
        &[],
    );
    m.add(
        "dec_reshape",
        LayerKind::Reshape {
            shape: vec![7, 7, 64],
        },
        &[],
    );
    m.add(
        "dec_deconv1",
        LayerKind::conv2d_transpose(64, 3, 2, Padding::Same, Activation::Relu),
        &[],
    );
    m.add(
        "dec_deconv2",
        LayerKind::conv2d_transpose(32, 3, 2, Padding::Same, Activation::Relu),
        &[],
    );
    m.add(
        "decoded",
        LayerKind::conv2d_transpose(1, 3, 1, Padding::Same, Activation::Sigmoid),
        &[],
    );
    m.loss.push(
        LossTerm::new(LossKind::BinaryCrossentropy)
            .on(&["decoded", "pixels"])
            .reduction(Reduction::SumOverFeatures),
    );
    m.loss
        .push(LossTerm::new(LossKind::KlNormal).on(&["z_mean", "z_log_var"]));
    m
}

/// The seed's MNIST multilayer perceptron (the Keras "MNIST MLP" of the guide): u8 pixels
/// `[784]` scaled by 1/255 → dense 512 relu → dense 10 softmax → sparse categorical
/// cross-entropy against i32 labels; RMSprop, float32. 407,050 parameters.
pub fn mnist_mlp(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("MnistMlp", batch);
    m.input("pixels", &[784], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(512, Activation::Relu),
        &["pixels"],
    );
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    m
}

/// Default batch sizes of the benchmark graphs: the (ResNet-50 at 32, the GPT-2
/// stack at 8) and, where it names none, the usual ones (the VAE example's 128, the MLP's 128,
/// 32 for the ImageNet networks, 16 for the U-Net's 128² tiles).
pub const BATCHES: [(&str, usize); 7] = [
    ("resnet50", 32),
    ("vgg19", 32),
    ("mobilenet_v1", 32),
    ("unet", 16),
    ("gpt2_stack", 8),
    ("conv_vae", 128),
    ("mnist_mlp", 128),
];

/// Blocks of the benchmark GPT-2 stack (GPT-2 small's 12).
pub const GPT2_LAYERS: usize = 12;

/// Every zoo model, at its default batch ([`BATCHES`]) times `batch_scale` (rounded, at least
/// 1), in [`BATCHES`] order: `all(1.0)` is the benchmark set.
pub fn all(batch_scale: f64) -> Vec<(&'static str, ModelSpec)> {
    BATCHES
        .iter()
        .map(|&(name, base)| {
            let batch = ((base as f64 * batch_scale).round() as usize).max(1);
            let spec = match name {
                "resnet50" => resnet50(batch),
                "vgg19" => vgg19(batch),
                "mobilenet_v1" => mobilenet_v1(batch),
                "unet" => unet(batch),
                "gpt2_stack" => gpt2_stack(batch, GPT2_LAYERS),
                "conv_vae" => conv_vae(batch),
                "mnist_mlp" => mnist_mlp(batch),
                other => unreachable!("no zoo model `{other}`"),
            };
            (name, spec)
        })
        .collect()
}

/// Puts each run of consecutive layers for which `block_of` gives the same name into its own
/// checkpoint segment (layers where it gives `None` stay outside every segment). With the
/// zoo's layer names, `|n: &str| n.starts_with('h').then(|| n.split('_').next().unwrap_or(n).to_string())`
/// checkpoints every GPT-2 block (`h0_…`, `h1_…`) and
/// `|n: &str| n.get(..12).filter(|p| p.contains("_block")).map(str::to_string)` every
/// ResNet-50 bottleneck (`conv2_block1_…`).
pub fn checkpoint_blocks(spec: &mut ModelSpec, block_of: impl Fn(&str) -> Option<String>) {
    let mut segment = 0u32;
    let mut prev: Option<String> = None;
    for layer in spec.layers.iter_mut() {
        if matches!(layer.kind, LayerKind::Input { .. }) {
            prev = None;
            continue;
        }
        let block = block_of(&layer.name);
        if block.is_some() && block != prev {
            segment += 1;
        }
        layer.checkpoint = block.as_ref().map(|_| segment);
        prev = block;
    }
}
