//! Per layer: output shape, parameter count and bytes kept for backward, against numbers
//! computed by hand.

use memwise_plan::*;

const N: usize = 8;

/// A model: `x` (f32 [shape]) → `pre` (trainable, so gradients flow into `layer`) →
/// `layer` → flatten → dense(1), loss mse vs `y`.
fn one(kind: LayerKind, shape: &[usize]) -> StaticPlan {
    let mut m = ModelSpec::new("One", N);
    m.input("x", shape, DType::F32, 1.0);
    let c = *shape.last().unwrap();
    let pre = if shape.len() == 3 {
        LayerKind::conv2d(c, 1, 1, Padding::Valid, Activation::Linear)
    } else {
        LayerKind::dense(c, Activation::Linear)
    };
    m.add("pre", pre, &["x"]);
    m.add("layer", kind, &["pre"]);
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("head", LayerKind::dense(1, Activation::Linear), &[]);
    m.input("y", &[1], DType::F32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["head", "y"]));
    plan(&m).unwrap_or_else(|e| panic!("{e}"))
}

fn row<'a>(p: &'a StaticPlan, name: &str) -> &'a LayerMemory {
    p.memory.layers.iter().find(|l| l.name == name).unwrap()
}

/// Bytes of the layer's forward tensors alive at the end of the forward pass.
fn kept(p: &StaticPlan, layer: &str) -> u64 {
    let loss = p.steps.iter().position(|s| s.phase == Phase::Loss).unwrap() as u32;
    p.tensors
        .iter()
        .filter(|t| {
            t.layer == layer && t.role == Role::Activation && t.first < loss && t.last >= loss
        })
        .map(|t| t.bytes)
        .sum()
}

fn f32s(n: usize) -> u64 {
    (n * 4).div_ceil(256) as u64 * 256
}
fn u8s(n: usize) -> u64 {
    n.div_ceil(256) as u64 * 256
}

#[test]
fn dense_relu() {
    let p = one(LayerKind::dense(24, Activation::Relu), &[13]);
    let r = row(&p, "layer");
    assert_eq!(&r.output_shape[..], &[N, 24]);
    assert_eq!(r.params, 13 * 24 + 24);
    // relu keeps its output (also the head's input); the pre-activation is overwritten in place.
    assert_eq!(kept(&p, "layer"), f32s(N * 24));
    assert!(r.in_place);
}

#[test]
fn dense_gelu_keeps_its_input_and_remakes_its_output() {
    // GELU's backward keeps its input; its output, the head's input, is remade from it just
    // before the head's backward instead of kept.
    let p = one(LayerKind::dense(24, Activation::Gelu), &[13]);
    assert_eq!(kept(&p, "layer"), f32s(N * 24));
    let redo = p
        .steps
        .iter()
        .position(|s| s.phase == Phase::Recompute && s.layer == "layer")
        .expect("the GELU is redone");
    assert_eq!(p.steps[redo].op.name(), "gelu");
    assert_eq!(
        (p.steps[redo + 1].phase, &*p.steps[redo + 1].layer),
        (Phase::Backward, "head")
    );
    assert_eq!(p.checkpoint_recompute_flops(), 0);
}

#[test]
fn conv2d_same_stride2_relu() {
    let p = one(
        LayerKind::conv2d(32, 3, 2, Padding::Same, Activation::Relu),
        &[28, 28, 1],
    );
    let r = row(&p, "layer");
    assert_eq!(&r.output_shape[..], &[N, 14, 14, 32]);
    assert_eq!(r.params, 3 * 3 * 32 + 32);
    assert_eq!(kept(&p, "layer"), f32s(N * 14 * 14 * 32));
    // The conv's im2col workspace is bounded and lives one step.
    let ws: Vec<_> = p
        .tensors
        .iter()
        .filter(|t| t.role == Role::Workspace)
        .collect();
    assert!(!ws.is_empty());
    assert!(ws.iter().all(|t| t.first == t.last));
}

#[test]
fn conv2d_valid_odd_sizes() {
    let p = one(
        LayerKind::conv2d(5, 3, 2, Padding::Valid, Activation::Linear),
        &[13, 11, 3],
    );
    assert_eq!(&row(&p, "layer").output_shape[..], &[N, 6, 5, 5]);
    // A linear conv keeps nothing of its own: its output is the head's input, kept by flatten's view.
    assert_eq!(kept(&p, "layer"), f32s(N * 6 * 5 * 5));
}

#[test]
fn depthwise_and_separable() {
    let p = one(
        LayerKind::depthwise_conv2d(3, 1, Padding::Same, Activation::Linear),
        &[9, 9, 7],
    );
    let r = row(&p, "layer");
    assert_eq!(&r.output_shape[..], &[N, 9, 9, 7]);
    assert_eq!(r.params, 3 * 3 * 7 + 7);
    let p = one(
        LayerKind::separable_conv2d(16, 3, 1, Padding::Same, Activation::Relu),
        &[9, 9, 7],
    );
    let r = row(&p, "layer");
    assert_eq!(&r.output_shape[..], &[N, 9, 9, 16]);
    assert_eq!(r.params, 3 * 3 * 7 + 7 * 16 + 16);
    // Kept: the depthwise output (pointwise input) and the relu output.
    assert_eq!(kept(&p, "layer"), f32s(N * 81 * 7) + f32s(N * 81 * 16));
}

#[test]
fn conv2d_transpose_shapes() {
    let p = one(
        LayerKind::conv2d_transpose(6, 3, 2, Padding::Same, Activation::Relu),
        &[7, 7, 4],
    );
    let r = row(&p, "layer");
    assert_eq!(&r.output_shape[..], &[N, 14, 14, 6]);
    assert_eq!(r.params, 3 * 3 * 6 * 4 + 6);
    let p = one(
        LayerKind::conv2d_transpose(6, 3, 2, Padding::Valid, Activation::Linear),
        &[7, 7, 4],
    );
    assert_eq!(&row(&p, "layer").output_shape[..], &[N, 15, 15, 6]);
}

#[test]
fn pools() {
    let p = one(LayerKind::max_pool2d(2, 2, Padding::Valid), &[9, 9, 3]);
    assert_eq!(&row(&p, "layer").output_shape[..], &[N, 4, 4, 3]);
    assert_eq!(row(&p, "layer").params, 0);
    // max pool keeps a one-byte argmax per output (and its output, the head's input).
    assert_eq!(kept(&p, "layer"), u8s(N * 48) + f32s(N * 48));
    let p = one(LayerKind::avg_pool2d(3, 2, Padding::Same), &[9, 9, 3]);
    assert_eq!(&row(&p, "layer").output_shape[..], &[N, 5, 5, 3]);
    assert_eq!(kept(&p, "layer"), f32s(N * 75));
    let p = one(LayerKind::GlobalAvgPool, &[5, 5, 3]);
    assert_eq!(&row(&p, "layer").output_shape[..], &[N, 3]);
}

#[test]
fn batch_norm_keeps_normalised_input_and_inv_std() {
    let p = one(LayerKind::batch_norm(), &[5, 5, 3]);
    let r = row(&p, "layer");
    assert_eq!(r.params, 4 * 3); // gamma, beta + running mean and variance
    assert_eq!(p.trainable_count, (3 * 3 + 3) + 2 * 3 + 75 + 1); // pre, bn, head
                                                                 // x_hat + inv_std + its output (the head's input)
    assert_eq!(kept(&p, "layer"), f32s(N * 75) + f32s(3) + f32s(N * 75));
}

/// A residual block's batch norm: its input is also the shortcut convolution's, which keeps
/// it for its weight gradient, so the batch norm keeps its hi/lo mean and 1/σ beside it and
/// rebuilds x̂ in backward instead of keeping x̂ — while the same batch norm without the
/// shortcut keeps x̂.
#[test]
fn batch_norm_rebuilds_x_hat_when_its_input_is_kept_anyway() {
    let block = |shortcut: bool| {
        let mut m = ModelSpec::new("Residual", N);
        m.input("x", &[5, 5, 3], DType::F32, 1.0);
        m.add(
            "pre",
            LayerKind::conv2d(3, 1, 1, Padding::Valid, Activation::Linear),
            &["x"],
        );
        m.add("layer", LayerKind::batch_norm(), &["pre"]);
        let side = if shortcut { "pre" } else { "layer" };
        m.add(
            "side",
            LayerKind::conv2d(3, 1, 1, Padding::Valid, Activation::Linear),
            &[side],
        );
        m.add("sum", LayerKind::add(), &["layer", "side"]);
        m.add("flat", LayerKind::Flatten, &[]);
        m.add("head", LayerKind::dense(1, Activation::Linear), &[]);
        m.input("y", &[1], DType::F32, 1.0);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["head", "y"]));
        plan(&m).unwrap_or_else(|e| panic!("{e}"))
    };
    let rebuilds = |p: &StaticPlan| {
        p.steps.iter().any(|s| {
            matches!(
                s.op,
                Op::BatchNorm {
                    rebuild_x_hat: true,
                    ..
                }
            ) && s.phase == Phase::Backward
        })
    };
    let residual = block(true);
    assert!(rebuilds(&residual));
    assert!(row(&residual, "layer").recomputes_in_backward);
    // The hi/lo mean and 1/σ; the input is the `pre` layer's (kept by `side` anyway).
    assert_eq!(kept(&residual, "layer"), f32s(2 * 3) + f32s(3));
    assert_eq!(kept(&residual, "pre"), f32s(N * 75));
    // Its backward reads the input, the mean, 1/σ and dy.
    let bwd = residual
        .steps
        .iter()
        .find(|s| s.layer == "layer" && s.phase == Phase::Backward)
        .unwrap();
    let name = |id: u32| residual.tensors[id as usize].name.to_string();
    let reads: Vec<String> = bwd.reads.iter().map(|&t| name(t)).collect();
    assert_eq!(reads[..3], ["pre.out", "layer.mean", "layer.inv_std"]);

    let plain = block(false);
    assert!(!rebuilds(&plain));
    assert!(!row(&plain, "layer").recomputes_in_backward);
    // x̂ and 1/σ (its output is `side`'s input, kept by `side`).
    assert_eq!(kept(&plain, "layer"), f32s(N * 75) + f32s(3) + f32s(N * 75));
}

#[test]
fn layer_norm_rebuilds_x_hat_when_its_input_is_kept_anyway() {
    // `pre`'s ReLU keeps its output, the layer norm's input: the norm need not keep x̂ too.
    let block = |act: Activation| {
        let mut m = ModelSpec::new("Mlp", N);
        m.input("x", &[6], DType::F32, 1.0);
        m.add("pre", LayerKind::dense(10, act), &["x"]);
        m.add("layer", LayerKind::layer_norm(), &["pre"]);
        m.add("head", LayerKind::dense(1, Activation::Linear), &[]);
        m.input("y", &[1], DType::F32, 1.0);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["head", "y"]));
        plan(&m).unwrap_or_else(|e| panic!("{e}"))
    };
    let backward = |p: &StaticPlan| {
        p.steps
            .iter()
            .find(|s| s.layer == "layer" && s.phase == Phase::Backward)
            .unwrap()
            .clone()
    };
    let relu = block(Activation::Relu);
    let bwd = backward(&relu);
    assert!(matches!(
        bwd.op,
        Op::LayerNorm {
            rebuild_x_hat: true,
            ..
        }
    ));
    assert!(row(&relu, "layer").recomputes_in_backward);
    // 1/σ alone; the input is `pre`'s output, kept by its ReLU anyway.
    assert_eq!(kept(&relu, "layer"), f32s(N) + f32s(N * 10));
    let name = |id: u32| relu.tensors[id as usize].name.to_string();
    let reads: Vec<String> = bwd.reads.iter().map(|&t| name(t)).collect();
    assert_eq!(reads, ["pre.out", "layer.rstd", "layer.out.grad"]);
    // The backward's scratch holds one recomputed mean per row.
    let scratch = *bwd.writes.last().unwrap();
    assert_eq!(relu.tensors[scratch as usize].shape[..], [N]);

    // Without the ReLU nothing else keeps the input: x̂ (the same bytes) stays kept.
    let linear = block(Activation::Linear);
    assert!(matches!(
        backward(&linear).op,
        Op::LayerNorm {
            rebuild_x_hat: false,
            ..
        }
    ));
    assert!(!row(&linear, "layer").recomputes_in_backward);
    assert_eq!(*backward(&linear).writes.last().unwrap(), NONE);
}

#[test]
fn layer_norm_and_dropout() {
    let p = one(LayerKind::layer_norm(), &[6, 10]);
    assert_eq!(row(&p, "layer").params, 20);
    assert_eq!(kept(&p, "layer"), 2 * f32s(N * 60) + f32s(N * 6));
    let p = one(LayerKind::Dropout { rate: 0.5 }, &[100]);
    // A one-byte mask, and the output (the head's input), written over `pre`'s output in place.
    assert_eq!(kept(&p, "layer"), u8s(N * 100) + f32s(N * 100));
    assert!(row(&p, "layer").in_place);
}

#[test]
fn rms_norm_has_a_scale_only_and_keeps_x_hat_and_one_rstd_per_row() {
    let p = one(LayerKind::rms_norm(), &[6, 10]);
    assert_eq!(row(&p, "layer").params, 10); // γ only: no shift
    assert_eq!(kept(&p, "layer"), 2 * f32s(N * 60) + f32s(N * 6));
    let fwd: Vec<_> = p.steps.iter().filter(|s| s.layer == "layer").collect();
    assert_eq!(fwd[0].op.name(), "rms_norm");
    assert_eq!(
        fwd[0].op,
        memwise_plan::Op::GroupNorm {
            samples: N * 6,
            spatial: 1,
            channels: 10,
            groups: 1,
            epsilon: 1e-6,
            center: false
        }
    );
    assert_eq!(
        &fwd[0].params[..],
        &[p.params
            .iter()
            .position(|q| q.name == "layer.weight")
            .unwrap() as u32]
    );
}

#[test]
fn group_norm_normalises_per_sample_and_group_with_a_scale_and_shift_per_channel() {
    let p = one(
        LayerKind::GroupNorm {
            groups: 2,
            epsilon: 1e-3,
        },
        &[5, 5, 4],
    );
    assert_eq!(row(&p, "layer").params, 8); // γ and β per channel
                                            // x_hat, one rstd per (sample, group), and the output (the head's input).
    assert_eq!(kept(&p, "layer"), 2 * f32s(N * 100) + f32s(N * 2));
    let step = p.steps.iter().find(|s| s.layer == "layer").unwrap();
    assert_eq!(step.op.name(), "group_norm");
    assert_eq!(
        step.op,
        memwise_plan::Op::GroupNorm {
            samples: N,
            spatial: 25,
            channels: 4,
            groups: 2,
            epsilon: 1e-3,
            center: true
        }
    );
}

#[test]
fn group_norm_needs_groups_that_divide_the_channels() {
    let mut m = ModelSpec::new("Groups", N);
    m.input("x", &[4, 4, 6], DType::F32, 1.0);
    // Keras's default, 32 groups, cannot split 6 channels.
    m.add("gn", LayerKind::group_norm(), &[]);
    let e = plan(&m).unwrap_err().to_string();
    assert!(
        e.contains("`group_norm` splits the last axis of its input into 32 groups")
            && e.contains("with 6 channels")
            && e.contains("`groups` must divide the channels"),
        "{e}"
    );
}

#[test]
fn positional_embedding_adds_a_table_per_position_in_place_and_keeps_nothing() {
    let mut m = ModelSpec::new("Pos", N);
    m.input("ids", &[12], DType::I32, 1.0);
    m.add("emb", LayerKind::Embedding { vocab: 50, dim: 16 }, &[]);
    m.add("pos", LayerKind::PositionalEmbedding, &[]);
    m.add("head", LayerKind::dense(50, Activation::Softmax), &[]);
    m.input("next", &[12], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["head", "next"]));
    let p = plan(&m).unwrap();
    assert_eq!(row(&p, "pos").params, 12 * 16); // one vector per position
    let table = p.params.iter().find(|q| q.name == "pos.weight").unwrap();
    assert_eq!(&table.shape[..], &[12, 16]);
    let fwd = p.steps.iter().find(|s| s.layer == "pos").unwrap();
    assert_eq!(
        fwd.op,
        memwise_plan::Op::PositionalEmbedding {
            batch: N,
            seq: 12,
            dim: 16
        }
    );
    // Its backward reads only dy: it saves nothing of its own (what is kept is its output, the
    // head's input), and both passes run in place.
    assert_eq!(kept(&p, "pos"), f32s(N * 12 * 16));
    assert!(row(&p, "pos").in_place);
}

#[test]
fn positional_embedding_reads_token_vectors() {
    let mut m = ModelSpec::new("Pos", N);
    m.input("ids", &[12], DType::I32, 1.0);
    m.add("pos", LayerKind::PositionalEmbedding, &[]);
    let e = plan(&m).unwrap_err().to_string();
    assert!(
        e.contains("`ids` is [12] of i32 values: put an `embedding` before it"),
        "{e}"
    );
}

#[test]
fn views_own_no_bytes() {
    let mut m = ModelSpec::new("Views", N);
    m.input("x", &[4, 6], DType::F32, 1.0);
    m.add("d", LayerKind::dense(6, Activation::Relu), &[]);
    m.add("r", LayerKind::Reshape { shape: vec![24] }, &[]);
    m.add("f", LayerKind::Flatten, &[]);
    m.add("head", LayerKind::dense(2, Activation::Softmax), &[]);
    m.input("label", &[], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy));
    let p = plan(&m).unwrap();
    assert!(p.tensors.iter().all(|t| t.layer != "r" && t.layer != "f"));
    assert_eq!(&row(&p, "r").output_shape[..], &[N, 24]);
    assert_eq!(row(&p, "r").saved_bytes, 0);
}

#[test]
fn embedding_attention_params() {
    let mut m = ModelSpec::new("Tok", N);
    m.input("ids", &[12], DType::I32, 1.0);
    m.add("emb", LayerKind::Embedding { vocab: 50, dim: 16 }, &[]);
    m.add(
        "attn",
        LayerKind::Attention {
            heads: 4,
            causal: false,
            dropout: 0.0,
        },
        &[],
    );
    m.add("pool", LayerKind::Flatten, &[]);
    m.add("head", LayerKind::dense(3, Activation::Softmax), &[]);
    m.input("label", &[], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy));
    let p = plan(&m).unwrap();
    assert_eq!(row(&p, "emb").params, 50 * 16);
    assert_eq!(row(&p, "attn").params, 4 * 16 * 16 + 4 * 16);
    assert_eq!(&row(&p, "attn").output_shape[..], &[N, 12, 16]);
}

#[test]
fn add_concat_sample_normal() {
    let mut m = ModelSpec::new("Dag", N);
    m.input("x", &[10], DType::F32, 1.0);
    m.add("a", LayerKind::dense(6, Activation::Linear), &["x"]);
    m.add("b", LayerKind::dense(6, Activation::Linear), &["x"]);
    m.add("s", LayerKind::add(), &["a", "b"]);
    m.add("c", LayerKind::Concat, &["s", "a"]);
    m.add("mean", LayerKind::dense(2, Activation::Linear), &["c"]);
    m.add("logvar", LayerKind::dense(2, Activation::Linear), &["c"]);
    m.add("z", LayerKind::SampleNormal, &["mean", "logvar"]);
    m.input("y", &[2], DType::F32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["z", "y"]));
    m.loss
        .push(LossTerm::new(LossKind::KlNormal).on(&["mean", "logvar"]));
    let p = plan(&m).unwrap();
    assert_eq!(&row(&p, "c").output_shape[..], &[N, 12]);
    assert_eq!(&row(&p, "z").output_shape[..], &[N, 2]);
    // `a` feeds both the sum and the concat: its gradient is accumulated.
    assert!(p
        .steps
        .iter()
        .any(|s| s.op.name() == "accumulate" && s.layer == "a"));
    // add saves nothing.
    assert_eq!(row(&p, "s").saved_bytes, 0);
}

#[test]
fn shape_errors_name_layer_and_both_shapes() {
    let mut m = ModelSpec::new("Bad", N);
    m.input("x", &[10], DType::F32, 1.0);
    m.add("a", LayerKind::dense(6, Activation::Linear), &["x"]);
    m.add("b", LayerKind::dense(5, Activation::Linear), &["x"]);
    m.add("s", LayerKind::add(), &["a", "b"]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["s", "x"]));
    let e = plan(&m).unwrap_err();
    assert_eq!(e.layer.as_deref(), Some("s"));
    assert!(
        e.message.contains("`a` [6]") && e.message.contains("`b` [5]"),
        "{e}"
    );
    assert_eq!(e.related, vec!["a".to_string(), "b".to_string()]);

    let mut m = ModelSpec::new("Bad", N);
    m.input("x", &[784], DType::U8, 1.0 / 255.0);
    m.add(
        "c",
        LayerKind::conv2d(8, 3, 1, Padding::Same, Activation::Relu),
        &[],
    );
    let e = plan(&m).unwrap_err();
    assert!(
        e.message.contains("[height, width, channels]") && e.message.contains("[784]"),
        "{e}"
    );

    let mut m = ModelSpec::new("Bad", N);
    m.input("x", &[3, 3, 1], DType::F32, 1.0);
    m.add(
        "c",
        LayerKind::conv2d(8, 5, 1, Padding::Valid, Activation::Relu),
        &[],
    );
    let e = plan(&m).unwrap_err();
    assert!(
        e.message.contains("5×5 is larger than its 3×3 input"),
        "{e}"
    );
}

#[test]
fn fp16_halves_exactly_the_bytes_it_covers() {
    let mut m = ModelSpec::new("Half", N);
    m.input("x", &[64], DType::F32, 1.0);
    for h in ["h0", "h1", "h2", "h3"] {
        m.add(h, LayerKind::dense(128, Activation::Relu), &[]);
    }
    m.add("head", LayerKind::dense(4, Activation::Softmax), &[]);
    m.input("label", &[], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy));
    let full = plan(&m).unwrap();
    for h in ["h1", "h2", "h3"] {
        m.set_dtype(h, DType::F16);
    }
    let half = plan(&m).unwrap();
    // An interior layer (f16 in, f16 out) keeps exactly half; a boundary layer also keeps
    // the cast copy of its f32 input, as autocast does.
    assert_eq!(kept(&half, "h2") * 2, kept(&full, "h2"));
    assert_eq!(kept(&half, "h1"), kept(&full, "h1") / 2 + f32s(N * 128) / 2);
    // The f16 copies of the three layers' weights are counted in params.
    let w = (128 * 128 * 2) as u64;
    assert_eq!(half.memory.params - full.memory.params, 3 * w);
    assert!(half.loss_scaling && !full.loss_scaling);
}

#[test]
fn plan_json_has_the_contract_keys() {
    let p = one(LayerKind::dense(3, Activation::Relu), &[5]);
    let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    assert_eq!(v["schema"], "memwise.plan/1");
    for k in [
        "model",
        "batch",
        "alignment",
        "arena_bytes",
        "lower_bound_bytes",
        "memory",
        "tensors",
        "steps",
    ] {
        assert!(v.get(k).is_some(), "{k}");
    }
    for k in [
        "params",
        "grads",
        "optimizer",
        "activations_peak",
        "workspace_peak",
        "inputs",
        "total",
    ] {
        assert!(v["memory"].get(k).is_some(), "{k}");
    }
    let t = &v["tensors"][0];
    for k in [
        "id", "name", "layer", "role", "dtype", "shape", "bytes", "offset", "first", "last",
    ] {
        assert!(t.get(k).is_some(), "{k}");
    }
    let s = &v["steps"][0];
    for k in ["index", "phase", "layer", "op", "reads", "writes"] {
        assert!(s.get(k).is_some(), "{k}");
    }
}

#[test]
fn plan_for_another_batch_scales_activations() {
    let mut m = ModelSpec::new("Mlp", 64);
    m.input("x", &[784], DType::U8, 1.0 / 255.0);
    m.add("h", LayerKind::dense(512, Activation::Relu), &[]);
    m.add("o", LayerKind::dense(10, Activation::Softmax), &[]);
    m.input("label", &[], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy));
    let a = plan(&m).unwrap();
    let b = plan(&m.with_batch(128)).unwrap();
    assert_eq!(a.memory.params, b.memory.params);
    assert!(b.memory.activations_peak > a.memory.activations_peak * 19 / 10);
}

/// A u8 model input scaled to f32 is kept as u8: the first dense layer's weight gradient
/// reads the input cast again just before that backward, and the forward's f32 copy dies
/// after its one forward reader — a quarter of the bytes, for one multiply per element.
#[test]
fn a_u8_input_is_kept_as_u8_and_cast_again_for_the_first_backward() {
    let p = plan(&zoo::mnist_mlp(N)).unwrap();
    let by_name = |n: &str| p.tensors.iter().find(|t| t.name == n).unwrap();
    let loss = p.steps.iter().position(|s| s.phase == Phase::Loss).unwrap() as u32;
    let (raw, scaled) = (by_name("pixels"), by_name("pixels.scaled"));
    assert!(raw.last > loss, "the u8 input lives into the backward");
    assert!(scaled.last < loss, "the f32 copy dies in the forward");
    assert_eq!(raw.bytes, u8s(N * 784));
    assert_eq!(row(&p, "pixels").saved_bytes, u8s(N * 784));
    let again = by_name("pixels.scaled@recompute");
    let redo = &p.steps[again.first as usize];
    assert_eq!(
        (redo.phase, redo.op.name()),
        (Phase::Recompute, "input_cast")
    );
    let bwd = &p.steps[redo.index as usize + 1];
    assert_eq!((bwd.phase, &*bwd.layer), (Phase::Backward, "hidden"));
    assert_eq!(bwd.reads[0], again.id);
    // It is not a checkpoint's cost.
    assert_eq!(p.checkpoint_recompute_flops(), 0);
    assert!(p.phase_flops(Phase::Recompute) > 0);
    // A float32 input has no cast to redo.
    let mut f32_input = zoo::mnist_mlp(N);
    if let LayerKind::Input { dtype, .. } = &mut f32_input.layers[0].kind {
        *dtype = DType::F32;
    }
    let q = plan(&f32_input).unwrap();
    assert!(q.steps.iter().all(|s| s.phase != Phase::Recompute));
}
