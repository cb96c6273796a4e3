//! The layer catalogue is one consistent declaration: every entry builds its own kind, its
//! options are well formed and each is read by its `build`, every parameter a lowered layer
//! creates is declared by its entry with the initialiser Keras gives it, the Keras defaults
//! are the catalogue's, and the docs table lists every entry with its options.

use std::collections::BTreeSet;

use memwise_plan::graph::Graph;
use memwise_plan::layers::{
    self, aliases_doc, layer_table, Fill, Inputs, OptValue, OptionDefault, OptionType,
    OptionValues, CATALOGUE,
};
use memwise_plan::{generate, zoo, Activation, DType, LayerKind, ModelSpec, Padding};

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

#[test]
fn names_and_handles_are_unique_and_in_the_dsl_order() {
    let names: Vec<&str> = CATALOGUE.iter().map(|d| d.name).collect();
    assert_eq!(
        names.join(" "),
        "input dense conv2d depthwise_conv2d separable_conv2d conv2d_transpose max_pool2d \
         avg_pool2d global_avg_pool batch_norm layer_norm rms_norm group_norm dropout flatten \
         reshape add concat embedding positional_embedding attention activation \
         sample_normal"
    );
    for def in CATALOGUE {
        assert_eq!(def.handle, camel(def.name), "the handle of `{}`", def.name);
        assert!(
            !def.doc.is_empty() && def.doc.ends_with('.'),
            "{}",
            def.name
        );
        assert!(std::ptr::eq(layers::find(def.name).unwrap(), *def));
    }
    let handles: BTreeSet<&str> = CATALOGUE.iter().map(|d| d.handle).collect();
    assert_eq!(handles.len(), CATALOGUE.len());
}

#[test]
fn every_entry_builds_its_own_kind_from_its_defaults() {
    for def in CATALOGUE {
        let kind = def.with_defaults();
        assert!(std::ptr::eq(kind.def(), *def), "{}", def.name);
        assert_eq!(kind.name(), def.name);
    }
}

fn has_type(v: &OptValue, ty: OptionType) -> bool {
    matches!(
        (v, ty),
        (OptValue::Usize(n), OptionType::Positive) if *n > 0
    ) || matches!(
        (v, ty),
        (OptValue::Pair(_), OptionType::Pair)
            | (OptValue::Float(_), OptionType::Float)
            | (OptValue::Bool(_), OptionType::Bool)
            | (OptValue::Shape(_), OptionType::Shape)
            | (OptValue::Activation(_), OptionType::Activation)
            | (OptValue::Padding(_), OptionType::Padding)
            | (OptValue::DType(_), OptionType::DType)
            | (OptValue::Int(-1), OptionType::LastAxis)
    ) || matches!((v, ty), (OptValue::Float(r), OptionType::Rate) if (0.0..1.0).contains(r))
}

#[test]
fn options_are_well_formed() {
    for def in CATALOGUE {
        let mut spellings = BTreeSet::new();
        let mut positions = Vec::new();
        for (k, o) in def.options.iter().enumerate() {
            for s in std::iter::once(&o.name).chain(o.aliases) {
                assert!(
                    spellings.insert(*s),
                    "`{}` spells two options of `{}`",
                    s,
                    def.name
                );
                assert_ne!(*s, "from", "`from` names a layer's input, not an option");
            }
            positions.extend(o.position);
            assert!(!o.doc.is_empty(), "{}.{}", def.name, o.name);
            match &o.default {
                OptionDefault::Value(v) => assert!(has_type(v, o.ty), "{}.{}", def.name, o.name),
                OptionDefault::SameAs(other) => {
                    let earlier = def.options[..k].iter().find(|p| p.name == *other);
                    assert!(
                        earlier.is_some_and(|p| p.ty == o.ty),
                        "{}.{} defaults to an earlier option of its type",
                        def.name,
                        o.name
                    );
                }
                OptionDefault::Required { example } => assert!(!example.is_empty()),
            }
            assert!(has_type(&o.ty.placeholder(), o.ty));
        }
        positions.sort();
        let expected: Vec<usize> = (0..positions.len()).collect();
        assert_eq!(positions, expected, "positions of `{}`", def.name);
        if matches!(def.inputs, Inputs::Fields { .. }) {
            assert!(
                positions.is_empty(),
                "`{}` takes its fields by position",
                def.name
            );
        }
    }
}

/// A value of `ty` other than `v`.
fn another(v: &OptValue) -> OptValue {
    match v {
        OptValue::Usize(n) => OptValue::Usize(n + 2),
        OptValue::Pair([a, b]) => OptValue::Pair([a + 1, b + 2]),
        OptValue::Float(x) => OptValue::Float(if *x == 0.5 { 0.25 } else { 0.5 }),
        OptValue::Bool(b) => OptValue::Bool(!b),
        OptValue::Shape(s) => OptValue::Shape([s.as_slice(), &[3]].concat()),
        OptValue::Activation(a) => OptValue::Activation(if *a == Activation::Relu {
            Activation::Tanh
        } else {
            Activation::Relu
        }),
        OptValue::Padding(Padding::Same) => OptValue::Padding(Padding::Valid),
        OptValue::Padding(Padding::Valid) => OptValue::Padding(Padding::Same),
        OptValue::DType(d) => OptValue::DType(if *d == DType::I32 {
            DType::F32
        } else {
            DType::I32
        }),
        OptValue::Int(n) => OptValue::Int(*n),
    }
}

#[test]
fn every_option_an_entry_declares_is_read_by_its_build() {
    for def in CATALOGUE {
        let defaults = OptionValues::defaults(def);
        let base = (def.build)(&defaults);
        for o in def.options {
            if o.ty == OptionType::LastAxis {
                continue; // checked by the macro, one value only
            }
            let mut values = defaults.clone();
            values.set(o.name, another(defaults.get(o.name)));
            assert_ne!(
                (def.build)(&values),
                base,
                "`{}` ignores its option `{}`",
                def.name,
                o.name
            );
        }
    }
}

#[test]
fn the_keras_defaults_are_the_catalogues() {
    let default = |name: &str| layers::find(name).unwrap().with_defaults();
    assert_eq!(LayerKind::batch_norm(), default("batch_norm"));
    assert_eq!(
        LayerKind::batch_norm(),
        LayerKind::BatchNorm {
            momentum: 0.99,
            epsilon: 1e-3
        }
    );
    assert_eq!(LayerKind::layer_norm(), default("layer_norm"));
    assert_eq!(
        LayerKind::layer_norm(),
        LayerKind::LayerNorm { epsilon: 1e-3 }
    );
    assert_eq!(LayerKind::rms_norm(), default("rms_norm"));
    assert_eq!(LayerKind::rms_norm(), LayerKind::RmsNorm { epsilon: 1e-6 });
    assert_eq!(LayerKind::group_norm(), default("group_norm"));
    assert_eq!(
        LayerKind::group_norm(),
        LayerKind::GroupNorm {
            groups: 32,
            epsilon: 1e-3
        }
    );
    assert_eq!(LayerKind::add(), default("add"));
    // Keras: pool strides default to the pool size, whatever it is.
    let pool = layers::find("max_pool2d").unwrap();
    let mut v = OptionValues::default();
    v.set("pool_size", OptValue::Pair([3, 3]));
    let strides = pool.option("strides").unwrap().fallback(&v);
    assert_eq!(strides, OptValue::Pair([3, 3]));
}

/// Every layer kind, each option away from its default somewhere, and both halves of
/// every `use_bias`.
fn every_layer_model() -> ModelSpec {
    let mut m = ModelSpec::new("EveryLayer", 2);
    m.input("image", &[8, 8, 3], DType::U8, 1.0 / 255.0);
    m.add(
        "conv",
        LayerKind::conv2d(4, 3, 1, Padding::Same, Activation::Relu),
        &[],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    m.add(
        "gn",
        LayerKind::GroupNorm {
            groups: 2,
            epsilon: 1e-4,
        },
        &[],
    );
    m.add(
        "dw",
        LayerKind::depthwise_conv2d(3, 1, Padding::Same, Activation::Linear),
        &[],
    );
    let sep = LayerKind::separable_conv2d(4, 3, 1, Padding::Same, Activation::Silu);
    m.add("sep", sep, &[]);
    m.add("max", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add(
        "up",
        LayerKind::conv2d_transpose(4, 2, 2, Padding::Same, Activation::Linear),
        &[],
    );
    m.add("avg", LayerKind::avg_pool2d(2, 2, Padding::Valid), &["up"]);
    m.add("sum", LayerKind::add(), &["max", "avg"]);
    m.add("both", LayerKind::Concat, &["sum", "max"]);
    m.add("gap", LayerKind::GlobalAvgPool, &[]);
    m.add("drop", LayerKind::Dropout { rate: 0.25 }, &[]);
    m.add("flat", LayerKind::Flatten, &[]);
    let no_bias = LayerKind::Dense {
        units: 8,
        activation: Activation::Linear,
        use_bias: false,
    };
    m.add("mean", no_bias, &[]);
    m.add(
        "log_var",
        LayerKind::dense(8, Activation::Linear),
        &["flat"],
    );
    m.add("z", LayerKind::SampleNormal, &["mean", "log_var"]);
    m.add("seq", LayerKind::Reshape { shape: vec![2, 4] }, &[]);
    m.add("act", LayerKind::Activation(Activation::Gelu), &[]);
    m.input("ids", &[6], DType::I32, 1.0);
    m.add(
        "embed",
        LayerKind::Embedding { vocab: 10, dim: 8 },
        &["ids"],
    );
    m.add("pos", LayerKind::PositionalEmbedding, &[]);
    m.add("norm", LayerKind::layer_norm(), &[]);
    m.add("rms", LayerKind::rms_norm(), &[]);
    let attention = LayerKind::Attention {
        heads: 2,
        causal: true,
        dropout: 0.1,
    };
    m.add("attn", attention, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Linear), &[]);
    m.loss.push(
        memwise_plan::LossTerm::new(memwise_plan::LossKind::MeanSquaredError).on(&["z", "z"]),
    );
    m
}

/// The initialiser `runtime/src/init.rs` chose by a parameter's name before the catalogue
/// declared them: the oracle the catalogue must agree with.
fn keras_rule(name: &str, shape: &[usize], layer_kind: &str) -> Fill {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    match (layer_kind, leaf) {
        (_, "bias") | (_, "running_mean") => Fill::Constant(0.0),
        (_, "running_var") => Fill::Constant(1.0),
        ("batch_norm" | "layer_norm" | "rms_norm" | "group_norm", "weight") => Fill::Constant(1.0),
        ("embedding" | "positional_embedding", _) => Fill::Uniform(0.05),
        _ => Fill::Uniform(layers::glorot_limit(shape)),
    }
}

#[test]
fn every_parameter_is_declared_with_the_initialiser_keras_gives_it() {
    let mut specs: Vec<ModelSpec> = zoo::all(0.05).into_iter().map(|(_, s)| s).collect();
    specs.push(every_layer_model());
    for seed in 0..60 {
        specs.push(generate::random_chain(seed));
        specs.push(generate::random_dag(seed));
    }
    let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
    for spec in &specs {
        for training in [true, false] {
            let g = if training {
                Graph::build(spec)
            } else {
                Graph::build_inference(spec)
            }
            .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            for p in &g.params {
                let layer = &g.layers[p.layer];
                let def = layers::find(layer.kind).unwrap();
                let suffix = &p.name[layer.name.len() + 1..];
                let declared = def.param(suffix).unwrap_or_else(|| {
                    panic!(
                        "`{}` creates `{}`, which its entry does not declare",
                        def.name, p.name
                    )
                });
                seen.insert((def.name, declared.suffix));
                let init = layers::param_init(layer.kind, &layer.name, &p.name).unwrap();
                assert_eq!(init, declared.init);
                assert_eq!(
                    init.fill(&p.shape),
                    keras_rule(&p.name, &p.shape, layer.kind),
                    "{}",
                    p.name
                );
                assert_eq!(p.trainable, declared.trainable, "{}", p.name);
                if p.half_copy.is_some() {
                    assert!(declared.gemm, "{} has a 16-bit copy", p.name);
                }
            }
        }
    }
    for def in CATALOGUE {
        for p in def.params {
            assert!(
                seen.contains(&(def.name, p.suffix)),
                "`{}.{}` is declared but no model tried creates it",
                def.name,
                p.suffix
            );
        }
    }
}

#[test]
fn a_kind_is_written_as_rust_from_its_declaration() {
    assert_eq!(
        LayerKind::dense(512, Activation::Relu).to_rust("::k"),
        "::k::LayerKind::Dense {units: 512usize,activation: ::k::Activation::Relu,use_bias: true,}"
    );
    let input = LayerKind::Input {
        shape: vec![28, 28, 1],
        dtype: DType::U8,
        scale: 0.5,
    };
    assert_eq!(
        input.to_rust("::k"),
        "::k::LayerKind::Input {shape: ::std::vec![28usize,28usize,1usize],dtype: ::k::DType::U8,scale: 0.5f32,}"
    );
    assert_eq!(
        LayerKind::max_pool2d(2, 1, Padding::Same).to_rust("::k"),
        "::k::LayerKind::MaxPool2d {pool: [2usize,2usize],strides: [1usize,1usize],padding: ::k::Padding::Same,}"
    );
    assert_eq!(
        LayerKind::Activation(Activation::Gelu).to_rust("::k"),
        "::k::LayerKind::Activation(::k::Activation::Gelu)"
    );
    assert_eq!(LayerKind::Flatten.to_rust("::k"), "::k::LayerKind::Flatten");
}

#[test]
fn the_docs_table_has_a_row_per_entry_with_its_options_and_defaults() {
    let table = layer_table();
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| `")).collect();
    assert_eq!(rows.len(), CATALOGUE.len());
    for (row, def) in rows.iter().zip(CATALOGUE) {
        let head = format!(
            "| `{}` | [`{}`](layers::{}) |",
            def.name, def.handle, def.handle
        );
        assert!(row.starts_with(&head), "{row}");
        for o in def.options {
            let shown = match &o.default {
                OptionDefault::Required { .. } => format!("`{}` (required)", o.name),
                OptionDefault::Value(v) => format!("`{} = {}`", o.name, v.dsl()),
                OptionDefault::SameAs(other) => format!("`{} = {other}`", o.name),
            };
            assert!(row.contains(&shown), "{row} lacks {shown}");
        }
        for p in def.params {
            assert!(row.contains(&format!("`{}` (", p.suffix)), "{row}");
        }
    }
    // The defaults as Keras writes them.
    for d in [
        "`momentum = 0.99`",
        "`epsilon = 1e-3`",
        "`strides = pool_size`",
        "`pool_size = 2`",
        "`padding = valid`",
        "`activation = linear`",
        "`use_bias = true`",
        "`dtype = f32`",
        "`scale = 1.0`",
        "`causal = false`",
        "`dropout = 0.0`",
        "`axis = -1`",
    ] {
        assert!(table.contains(d), "{d}");
    }
    assert_eq!(
        aliases_doc(),
        "Activations: `linear`, `relu`, `sigmoid`, `tanh`, `gelu`, `silu`, \
         `leaky_relu(alpha = 0.3)`, `elu(alpha = 1.0)` and `softmax`. \
         Aliases: `kernel` for `kernel_size`, `stride` for `strides`, `multiplier` for \
         `depth_multiplier`, `pool` for `pool_size`, `shape` for `target_shape`, `vocab` for \
         `input_dim`, `dim` for `output_dim`, `heads` for `num_heads` and `use_causal_mask` \
         for `causal`."
    );
}
