//! The zoo's benchmark graphs: every one plans and validates; parameter counts match the
//! published numbers (or a hand count where none is published); key layers have the output
//! shapes of their source architectures.

use memwise_plan::{
    arena, plan, zoo, Activation, DType, LayerKind, ModelSpec, Op, Phase, StaticPlan,
};

fn planned(spec: &ModelSpec) -> StaticPlan {
    let p = plan(spec).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    arena::validate(&p).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    p
}

fn shape(p: &StaticPlan, layer: &str) -> Vec<usize> {
    let row = p
        .memory
        .layers
        .iter()
        .find(|l| l.name == layer)
        .unwrap_or_else(|| panic!("no layer `{layer}`"));
    row.output_shape.to_vec()
}

fn layer_params(p: &StaticPlan, prefix: &str) -> u64 {
    p.memory
        .layers
        .iter()
        .filter(|l| l.name.starts_with(prefix))
        .map(|l| l.params)
        .sum()
}

#[test]
fn every_zoo_model_plans_and_validates_at_its_benchmark_batch() {
    let all = zoo::all(1.0);
    let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, zoo::BATCHES.map(|(n, _)| n));
    for (name, spec) in &all {
        let p = planned(spec);
        let want = zoo::BATCHES
            .iter()
            .find(|(n, _)| n == name)
            .expect("listed")
            .1;
        assert_eq!(p.batch, want, "{name}");
        assert!(p.lower_bound_bytes <= p.arena_bytes, "{name}");
        assert!(p.steps.iter().any(|s| s.phase == Phase::Backward), "{name}");
        // The executors zero this range before each backward: it must be exactly the
        // gradients the report counts, and hold every trainable parameter's gradient.
        let (g0, g1) = p.grads_range();
        assert_eq!(g1 - g0, p.memory.grads, "{name}");
        for q in p.params.iter().filter(|q| q.trainable) {
            assert!(
                g0 <= q.grad_offset && q.grad_offset + 4 * q.elems() as u64 <= g1,
                "{name}: {}",
                q.name
            );
        }
    }
    // The batch sizes.
    assert_eq!(
        all.iter()
            .find(|(n, _)| *n == "resnet50")
            .expect("listed")
            .1
            .batch,
        32
    );
    let gpt2 = &all
        .iter()
        .find(|(n, _)| *n == "gpt2_stack")
        .expect("listed")
        .1;
    assert_eq!(gpt2.batch, 8);
    assert_eq!(
        gpt2.layers
            .iter()
            .filter(|l| matches!(l.kind, LayerKind::Attention { .. }))
            .count(),
        12
    );
}

#[test]
fn batch_scale_scales_every_batch() {
    for ((_, half), (_, base)) in zoo::all(0.5).iter().zip(zoo::BATCHES.iter()) {
        assert_eq!(half.batch, (*base as f64 * 0.5).round() as usize);
    }
    assert!(zoo::all(0.001).iter().all(|(_, s)| s.batch == 1));
}

#[test]
fn resnet50_parameters_match_torchvision_and_keras() {
    let p = planned(&zoo::resnet50(2));
    // torchvision's resnet50: 25,557,032 trainable; the batch norms' running mean and
    // variance (2 × 26,560 channels) are statistics, not trained.
    assert_eq!(p.trainable_count, 25_557_032);
    assert_eq!(p.params_count, 25_557_032 + 53_120);
    // Keras's ResNet50 also gives every convolution a bias: 25,636,712 in all.
    let mut keras = zoo::resnet50(2);
    for l in keras.layers.iter_mut() {
        if let LayerKind::Conv2d { use_bias, .. } = &mut l.kind {
            *use_bias = true;
        }
    }
    let k = planned(&keras);
    assert_eq!(k.params_count, 25_636_712);
    assert_eq!(k.trainable_count, 25_583_592);
    // The head: 2048 × 1000 + 1000.
    assert_eq!(layer_params(&p, "predictions"), 2_049_000);
}

#[test]
fn resnet50_output_shapes() {
    let p = planned(&zoo::resnet50(4));
    for (layer, want) in [
        ("conv1_conv", vec![4, 112, 112, 64]),
        ("pool1_pool", vec![4, 56, 56, 64]),
        ("conv2_block1_0_conv", vec![4, 56, 56, 256]),
        ("conv2_block3_out", vec![4, 56, 56, 256]),
        ("conv3_block1_1_conv", vec![4, 28, 28, 128]),
        ("conv3_block4_out", vec![4, 28, 28, 512]),
        ("conv4_block6_out", vec![4, 14, 14, 1024]),
        ("conv5_block3_out", vec![4, 7, 7, 2048]),
        ("avg_pool", vec![4, 2048]),
        ("predictions", vec![4, 1000]),
    ] {
        assert_eq!(shape(&p, layer), want, "{layer}");
    }
    // 53 convolutions (1 stem + 16 blocks × 3 + 4 projections) and 53 batch norms.
    let count = |kind: &str| p.memory.layers.iter().filter(|l| l.kind == kind).count();
    assert_eq!(
        (count("conv2d"), count("batch_norm"), count("add")),
        (53, 53, 16)
    );
}

#[test]
fn vgg19_parameters_and_shapes() {
    let p = planned(&zoo::vgg19(2));
    assert_eq!(p.params_count, 143_667_240);
    assert_eq!(p.trainable_count, 143_667_240);
    assert_eq!(layer_params(&p, "fc1"), 25_088 * 4096 + 4096);
    assert_eq!(shape(&p, "block1_conv2"), [2, 224, 224, 64]);
    assert_eq!(shape(&p, "block5_pool"), [2, 7, 7, 512]);
    assert_eq!(shape(&p, "flatten"), [2, 25_088]);
    assert_eq!(shape(&p, "predictions"), [2, 1000]);
    assert_eq!(
        p.memory
            .layers
            .iter()
            .filter(|l| l.kind == "conv2d")
            .count(),
        16
    );
}

#[test]
fn mobilenet_v1_parameters_match_keras() {
    let p = planned(&zoo::mobilenet_v1(2));
    assert_eq!(p.params_count, 4_253_864);
    assert_eq!(p.trainable_count, 4_231_976);
    assert_eq!(shape(&p, "conv1_relu"), [2, 112, 112, 32]);
    assert_eq!(shape(&p, "conv_pw_1_relu"), [2, 112, 112, 64]);
    assert_eq!(shape(&p, "conv_dw_2"), [2, 56, 56, 64]);
    assert_eq!(shape(&p, "conv_pw_11_relu"), [2, 14, 14, 512]);
    assert_eq!(shape(&p, "conv_pw_13_relu"), [2, 7, 7, 1024]);
    assert_eq!(shape(&p, "global_average_pooling2d"), [2, 1024]);
    // Depthwise 3×3 over 512 channels has no bias: 4,608 parameters.
    assert_eq!(layer_params(&p, "conv_dw_7"), 9 * 512 + 4 * 512); // + its batch norm's 4 × 512
}

#[test]
fn unet_parameters_by_hand_and_shapes() {
    let p = planned(&zoo::unet(2));
    let conv = |k: u64, c_in: u64, f: u64| k * k * c_in * f + f;
    let level = |c_in: u64, f: u64| conv(3, c_in, f) + conv(3, f, f);
    let encoder = level(1, 64) + level(64, 128) + level(128, 256) + level(256, 512);
    let bottleneck = level(512, 1024);
    // Each expanding level: a 2×2 transposed conv halving the filters, then two 3×3 convs
    // over the concatenation (skip + up = 2 × filters).
    let up = |f: u64| conv(2, 2 * f, f) + level(2 * f, f);
    let decoder = up(512) + up(256) + up(128) + up(64);
    let head = conv(1, 64, 1);
    assert_eq!(encoder + bottleneck + decoder + head, 31_030_593);
    assert_eq!(p.params_count, 31_030_593);
    assert_eq!(layer_params(&p, "enc"), encoder);
    assert_eq!(layer_params(&p, "dec"), decoder);
    assert_eq!(shape(&p, "enc1_conv2"), [2, 128, 128, 64]);
    assert_eq!(shape(&p, "enc4_pool"), [2, 8, 8, 512]);
    assert_eq!(shape(&p, "bottleneck_dropout"), [2, 8, 8, 1024]);
    assert_eq!(shape(&p, "dec4_up"), [2, 16, 16, 512]);
    assert_eq!(shape(&p, "dec4_concat"), [2, 16, 16, 1024]);
    assert_eq!(shape(&p, "dec1_conv2"), [2, 128, 128, 64]);
    assert_eq!(shape(&p, "mask"), [2, 128, 128, 1]);
    // The mask target is stored as u8: one byte per pixel.
    let target = p
        .tensors
        .iter()
        .find(|t| t.name == "mask_target")
        .expect("input tensor");
    assert_eq!(target.dtype, DType::U8);
}

#[test]
fn gpt2_stack_parameters_match_gpt2_small() {
    let p = planned(&zoo::gpt2_stack(1, 12));
    // Per block: 2 layer norms (2 × 1,536), QKV 768 × 2304 + 2304, attention output
    // 768 × 768 + 768, MLP 768 × 3072 + 3072 and 3072 × 768 + 768.
    let block = 2 * 1536
        + (768 * 2304 + 2304)
        + (768 * 768 + 768)
        + (768 * 3072 + 3072)
        + (3072 * 768 + 768);
    assert_eq!(block, 7_087_872);
    assert_eq!(layer_params(&p, "h0_"), block);
    assert_eq!(p.params_count, 12 * block + 1536);
    assert_eq!(p.params_count, 85_056_000);
    // With the token and position embeddings this stack leaves out: GPT-2 small's 124,439,808.
    let embeddings = (zoo::GPT2_VOCAB * 768 + zoo::GPT2_SEQ * 768) as u64;
    assert_eq!(p.params_count + embeddings, 124_439_808);
}

#[test]
fn gpt2_stack_runs_in_mixed_float16() {
    let p = planned(&zoo::gpt2_stack(2, 2));
    assert!(p.loss_scaling);
    assert_eq!(shape(&p, "h0_attn"), [2, 1024, 768]);
    assert_eq!(shape(&p, "h1_mlp_fc"), [2, 1024, 3072]);
    assert_eq!(shape(&p, "ln_f"), [2, 1024, 768]);
    for l in p.memory.layers.iter() {
        assert_eq!(l.dtype, DType::F16, "{}", l.name);
    }
    // The memory-efficient attention: one f32 log-sum-exp per row and head (batch × heads ×
    // seq), not the f16 batch × heads × seq × seq probabilities and their u8 dropout mask.
    let lse = p
        .tensors
        .iter()
        .find(|t| t.name == "h0_attn.lse")
        .expect("lse");
    assert_eq!(
        (lse.shape.to_vec(), lse.dtype),
        (vec![2, 12, 1024], DType::F32)
    );
    assert!(!p
        .tensors
        .iter()
        .any(|t| t.name.starts_with("h0_attn.probs")));
    assert!(p.steps.iter().any(|s| matches!(
        s.op,
        Op::FlashAttention {
            seq: 1024,
            heads: 12,
            head_dim: 64,
            causal: true,
            ..
        }
    )));
}

#[test]
fn conv_vae_matches_the_keras_example() {
    let p = planned(&zoo::conv_vae(128));
    let encoder = layer_params(&p, "enc_") + layer_params(&p, "z_");
    let decoder = layer_params(&p, "dec_") + layer_params(&p, "decoded");
    assert_eq!((encoder, decoder), (69_076, 65_089));
    assert_eq!(p.params_count, 134_165);
    assert_eq!(shape(&p, "enc_conv1"), [128, 14, 14, 32]);
    assert_eq!(shape(&p, "enc_conv2"), [128, 7, 7, 64]);
    assert_eq!(shape(&p, "enc_flatten"), [128, 3136]);
    assert_eq!(shape(&p, "z"), [128, 2]);
    assert_eq!(shape(&p, "dec_reshape"), [128, 7, 7, 64]);
    assert_eq!(shape(&p, "dec_deconv1"), [128, 14, 14, 64]);
    assert_eq!(shape(&p, "decoded"), [128, 28, 28, 1]);
    assert_eq!(p.losses.len(), 2, "reconstruction + KL");
}

#[test]
fn mnist_mlp_parameters() {
    let p = planned(&zoo::mnist_mlp(128));
    assert_eq!(p.params_count, 784 * 512 + 512 + 512 * 10 + 10);
    assert_eq!(p.params_count, 407_050);
    assert_eq!(shape(&p, "logits"), [128, 10]);
}

#[test]
fn checkpointing_every_block_lowers_the_zoo_peaks() {
    let by_block = |n: &str| {
        n.get(..12)
            .filter(|p| p.contains("_block"))
            .map(str::to_string)
    };
    let mut resnet = zoo::resnet50(4);
    zoo::checkpoint_blocks(&mut resnet, by_block);
    let segments: std::collections::BTreeSet<u32> =
        resnet.layers.iter().filter_map(|l| l.checkpoint).collect();
    assert_eq!(segments.len(), 16, "one segment per bottleneck");
    assert!(resnet
        .layer("conv1_conv")
        .is_some_and(|l| l.checkpoint.is_none()));
    let base = planned(&zoo::resnet50(4));
    let ckpt = planned(&resnet);
    assert!(ckpt.memory.activations_peak < base.memory.activations_peak);

    let mut gpt2 = zoo::gpt2_stack(1, 4);
    zoo::checkpoint_blocks(&mut gpt2, |n| {
        n.starts_with('h')
            .then(|| n.split('_').next().unwrap_or(n).to_string())
    });
    assert!(gpt2.layer("ln_f").is_some_and(|l| l.checkpoint.is_none()));
    let base = planned(&zoo::gpt2_stack(1, 4));
    let ckpt = planned(&gpt2);
    assert!(ckpt.memory.activations_peak * 2 < base.memory.activations_peak);
}

#[test]
fn zoo_heads_are_what_the_sources_use() {
    // Softmax classifiers fuse into their cross-entropy; the U-Net and the VAE end in sigmoid.
    for spec in [
        zoo::resnet50(1),
        zoo::vgg19(1),
        zoo::mobilenet_v1(1),
        zoo::mnist_mlp(1),
    ] {
        let last = spec
            .layers
            .iter()
            .rev()
            .find(|l| !matches!(l.kind, LayerKind::Input { .. }))
            .expect("layers");
        assert!(
            matches!(
                last.kind,
                LayerKind::Dense {
                    activation: Activation::Softmax,
                    ..
                }
            ),
            "{}",
            spec.name
        );
    }
    for spec in [zoo::unet(1), zoo::conv_vae(1)] {
        let last = spec.layers.last().expect("layers");
        let sigmoid = matches!(
            last.kind,
            LayerKind::Conv2d {
                activation: Activation::Sigmoid,
                ..
            } | LayerKind::Conv2dTranspose {
                activation: Activation::Sigmoid,
                ..
            }
        );
        assert!(sigmoid, "{}", spec.name);
    }
}
