//! The layer attributes: their names, their handle types, and their options with Keras's
//! names and defaults, read into a planner `LayerKind`.
use memwise_plan::{Activation, DType, LayerKind, Padding};
use proc_macro2::TokenStream;

use crate::diag::Errors;
use crate::value::{
    boolean, float, pair, positive, refs, shape, word, Arg, Env, FieldRef, Opts, Val, V,
};

/// A layer attribute and the field type (in `memwise::layers`) that goes with it.
pub struct LayerInfo {
    pub attr: &'static str,
    pub handle: &'static str,
}

macro_rules! layers {
    ($($attr:literal => $handle:literal),* $(,)?) => {
        pub const LAYERS: &[LayerInfo] = &[$(LayerInfo { attr: $attr, handle: $handle }),*];
    };
}

layers! {
    "input" => "Input",
    "dense" => "Dense",
    "conv2d" => "Conv2d",
    "depthwise_conv2d" => "DepthwiseConv2d",
    "separable_conv2d" => "SeparableConv2d",
    "conv2d_transpose" => "Conv2dTranspose",
    "max_pool2d" => "MaxPool2d",
    "avg_pool2d" => "AvgPool2d",
    "global_avg_pool" => "GlobalAvgPool",
    "batch_norm" => "BatchNorm",
    "layer_norm" => "LayerNorm",
    "dropout" => "Dropout",
    "flatten" => "Flatten",
    "reshape" => "Reshape",
    "add" => "Add",
    "concat" => "Concat",
    "embedding" => "Embedding",
    "attention" => "Attention",
    "activation" => "Activation",
    "sample_normal" => "SampleNormal",
}

/// Field attributes that are not layers.
pub const MODIFIERS: &[&str] = &["checkpoint", "fp16", "bf16", "f32", "block"];

pub fn info(attr: &str) -> Option<&'static LayerInfo> {
    LAYERS.iter().find(|l| l.attr == attr)
}

/// Every attribute name a field may carry (for "did you mean").
pub fn attribute_names() -> impl Iterator<Item = &'static str> {
    LAYERS
        .iter()
        .map(|l| l.attr)
        .chain(MODIFIERS.iter().copied())
}

/// A layer as declared: its kind, and the fields it reads (empty: the previous field).
pub struct LayerDecl {
    pub kind: LayerKind,
    pub inputs: Vec<FieldRef>,
}

const ACTIVATIONS: [&str; 7] = {
    let mut names = [""; 7];
    let mut i = 0;
    while i < 7 {
        names[i] = Activation::ALL[i].name();
        i += 1;
    }
    names
};
const PADDINGS: [&str; 2] = ["valid", "same"];
const DTYPES: [&str; 10] = [
    "f32", "f16", "bf16", "u8", "i32", "float32", "float16", "bfloat16", "uint8", "int32",
];

fn activation(v: &Val, what: &str) -> syn::Result<Activation> {
    word(v, what, &ACTIVATIONS).map(|w| Activation::parse(w).expect("listed"))
}

fn padding(v: &Val, what: &str) -> syn::Result<Padding> {
    word(v, what, &PADDINGS).map(|w| {
        if w == "same" {
            Padding::Same
        } else {
            Padding::Valid
        }
    })
}

fn dtype(v: &Val, _what: &str) -> syn::Result<DType> {
    match &v.v {
        V::Word(w) => DType::parse(w).ok_or_else(|| {
            v.err(format!(
                "unsupported dtype `{w}`: inputs are stored as `u8`, `i32`, `f32`, `f16` or `bf16`"
            ))
        }),
        V::Unknown => Ok(DType::F32),
        _ => word(v, "dtype", &DTYPES).map(|_| DType::F32),
    }
}

fn rate(v: &Val, what: &str) -> syn::Result<f32> {
    let r = float(v, what)?;
    if !(0.0..1.0).contains(&r) && !v.is_unknown() {
        return Err(v.err(format!(
            "`{what}` must be in [0, 1), found {}",
            v.describe()
        )));
    }
    Ok(r)
}

fn use_bias(o: &mut Opts, e: &mut Errors) -> bool {
    o.read("use_bias", &[], None, true, e, boolean)
}

fn act(o: &mut Opts, e: &mut Errors) -> Activation {
    o.read("activation", &[], None, Activation::Linear, e, activation)
}

/// Reads one layer attribute. `anchor` is the whole attribute (for "missing option" errors).
pub fn lower_layer(
    attr: &str,
    anchor: TokenStream,
    args: Vec<Arg>,
    env: &Env,
    e: &mut Errors,
) -> LayerDecl {
    let mut opts = Opts::new(format!("`#[{attr}]`"), anchor.clone(), args, env);
    let decl = read_layer(attr, &anchor, &mut opts, env, e);
    opts.finish(e);
    decl
}

fn read_layer(
    attr: &str,
    anchor: &TokenStream,
    o: &mut Opts,
    env: &Env,
    e: &mut Errors,
) -> LayerDecl {
    let kernel = |o: &mut Opts, pos, e: &mut Errors| {
        o.require(
            "kernel_size",
            &["kernel"],
            Some(pos),
            [1, 1],
            "kernel_size = 3",
            e,
            pair,
        )
    };
    let strides =
        |o: &mut Opts, e: &mut Errors| o.read("strides", &["stride"], None, [1, 1], e, pair);
    let pad =
        |o: &mut Opts, e: &mut Errors| o.read("padding", &[], None, Padding::Valid, e, padding);
    let multiplier = |o: &mut Opts, e: &mut Errors| {
        o.read("depth_multiplier", &["multiplier"], None, 1, e, positive)
    };

    // Layers that combine fields take them as arguments; the others may name one with `from`.
    let mut inputs = Vec::new();
    let combine = matches!(attr, "add" | "concat" | "sample_normal");
    let positional = if combine {
        o.rest_positional(0, "fields")
    } else {
        Vec::new()
    };
    for a in &positional {
        if let Some(v) = e.ok(crate::value::eval(&a.value, env)) {
            inputs.extend(e.ok(refs(&v)).unwrap_or_default());
        }
    }

    let kind = match attr {
        "input" => {
            let shape = o.require("shape", &[], Some(0), vec![1], "shape = [784]", e, shape);
            let dtype = o.read("dtype", &[], None, DType::F32, e, dtype);
            let scale = o.read("scale", &[], None, 1.0, e, float);
            LayerKind::Input {
                shape,
                dtype,
                scale,
            }
        }
        "dense" => {
            let units = o.require("units", &[], Some(0), 1, "#[dense(64)]", e, positive);
            LayerKind::Dense {
                units,
                activation: act(o, e),
                use_bias: use_bias(o, e),
            }
        }
        "conv2d" | "conv2d_transpose" | "separable_conv2d" => {
            let filters = o.require("filters", &[], Some(0), 1, "filters = 32", e, positive);
            let kernel = kernel(o, 1, e);
            let (strides, padding) = (strides(o, e), pad(o, e));
            let multiplier = if attr == "separable_conv2d" {
                multiplier(o, e)
            } else {
                1
            };
            let (activation, use_bias) = (act(o, e), use_bias(o, e));
            match attr {
                "conv2d" => LayerKind::Conv2d {
                    filters,
                    kernel,
                    strides,
                    padding,
                    activation,
                    use_bias,
                },
                "conv2d_transpose" => LayerKind::Conv2dTranspose {
                    filters,
                    kernel,
                    strides,
                    padding,
                    activation,
                    use_bias,
                },
                _ => LayerKind::SeparableConv2d {
                    filters,
                    kernel,
                    strides,
                    padding,
                    multiplier,
                    activation,
                    use_bias,
                },
            }
        }
        "depthwise_conv2d" => {
            let kernel = kernel(o, 0, e);
            let (strides, padding, multiplier) = (strides(o, e), pad(o, e), multiplier(o, e));
            LayerKind::DepthwiseConv2d {
                kernel,
                strides,
                padding,
                multiplier,
                activation: act(o, e),
                use_bias: use_bias(o, e),
            }
        }
        "max_pool2d" | "avg_pool2d" => {
            let pool = o.read("pool_size", &["pool"], Some(0), [2, 2], e, pair);
            // Keras: strides default to the pool size.
            let strides = o.read("strides", &["stride"], None, pool, e, pair);
            let padding = pad(o, e);
            if attr == "max_pool2d" {
                LayerKind::MaxPool2d {
                    pool,
                    strides,
                    padding,
                }
            } else {
                LayerKind::AvgPool2d {
                    pool,
                    strides,
                    padding,
                }
            }
        }
        "global_avg_pool" => LayerKind::GlobalAvgPool,
        "batch_norm" => {
            let momentum = o.read("momentum", &[], None, 0.99, e, rate);
            let epsilon = o.read("epsilon", &[], None, 1e-3, e, float);
            LayerKind::BatchNorm { momentum, epsilon }
        }
        "layer_norm" => LayerKind::LayerNorm {
            epsilon: o.read("epsilon", &[], None, 1e-3, e, float),
        },
        "dropout" => LayerKind::Dropout {
            rate: o.require("rate", &[], Some(0), 0.0, "#[dropout(0.5)]", e, rate),
        },
        "flatten" => LayerKind::Flatten,
        "reshape" => LayerKind::Reshape {
            shape: o.require(
                "target_shape",
                &["shape"],
                Some(0),
                vec![1],
                "#[reshape([7, 7, 64])]",
                e,
                shape,
            ),
        },
        "add" => LayerKind::Add {
            activation: act(o, e),
        },
        "concat" => {
            if let Some(v) = o.get("axis", &[], None, e) {
                if !matches!(v.v, V::Int(-1) | V::Unknown) {
                    e.at(&v.tokens, "`#[concat]` joins along the last axis only: drop `axis` or write `axis = -1`");
                }
            }
            LayerKind::Concat
        }
        "embedding" => {
            let vocab = o.require(
                "input_dim",
                &["vocab"],
                Some(0),
                1,
                "#[embedding(input_dim = 50257, output_dim = 768)]",
                e,
                positive,
            );
            let dim = o.require(
                "output_dim",
                &["dim"],
                Some(1),
                1,
                "#[embedding(input_dim = 50257, output_dim = 768)]",
                e,
                positive,
            );
            LayerKind::Embedding { vocab, dim }
        }
        "attention" => {
            let heads = o.require(
                "num_heads",
                &["heads"],
                Some(0),
                1,
                "#[attention(num_heads = 12, causal = true)]",
                e,
                positive,
            );
            let causal = o.read("causal", &["use_causal_mask"], None, false, e, boolean);
            let dropout = o.read("dropout", &[], None, 0.0, e, rate);
            LayerKind::Attention {
                heads,
                causal,
                dropout,
            }
        }
        "activation" => LayerKind::Activation(o.require(
            "activation",
            &[],
            Some(0),
            Activation::Linear,
            "#[activation(relu)]",
            e,
            activation,
        )),
        "sample_normal" => LayerKind::SampleNormal,
        _ => unreachable!("lower_layer is called with known layer names only"),
    };

    if attr != "input" {
        if let Some(v) = o.get("from", &[], None, e) {
            if !positional.is_empty() {
                e.at(
                    &v.tokens,
                    format!(
                        "`#[{attr}]` names its inputs either as arguments or with `from`, not both"
                    ),
                );
            }
            let named = e.ok(refs(&v)).unwrap_or_default();
            if !combine && named.len() > 1 {
                e.at(
                    &v.tokens,
                    format!("`#[{attr}]` reads one field; `from` takes a single name"),
                );
            }
            inputs.extend(named);
        }
    }

    let needed = match attr {
        "add" | "concat" => Some((2, usize::MAX, "#[add(block1, stem)]")),
        "sample_normal" => Some((2, 2, "#[sample_normal(z_mean, z_log_var)]")),
        _ => None,
    };
    if let Some((min, max, example)) = needed {
        if inputs.len() < min || inputs.len() > max {
            let what = if attr == "sample_normal" {
                "exactly two fields, `(mean, log_var)`"
            } else {
                "two or more fields"
            };
            e.at(
                anchor,
                format!(
                    "`#[{attr}]` reads {what}, found {}; e.g. `{example}`",
                    inputs.len()
                ),
            );
        }
    }
    LayerDecl { kind, inputs }
}
