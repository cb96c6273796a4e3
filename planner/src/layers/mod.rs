//! The layer catalogue: every layer kind, declared once. Each kind's file holds its
//! [`LayerDef`] — DSL name, handle type, options with defaults and docs, inputs, parameters
//! with their initialisers — and its `lower` function (shape and dtype inference and the
//! ops it adds). The list below adds its `LayerKind` variant. From these the macro parses
//! attributes, the facade defines its handle types, the docs table is written and the
//! runtime initialises weights; `docs/ADDING_A_LAYER.md` walks through adding one.

mod common;
mod def;
mod docs;

/// What every layer file uses.
mod prelude {
    pub(super) use super::{
        Init, Inputs, LayerDef, LayerKind, OptValue, OptionDef, OptionType, ParamDef,
    };
    pub(super) use crate::dtype::DType;
    pub(super) use crate::error::PlanError;
    pub(super) use crate::graph::{fmt_shape, prod, user_shape, LayerCx, Value};
    pub(super) use crate::op::{Op, Window2d};
    pub(super) use crate::spec::{Activation, Padding};
}

pub use def::{
    glorot_limit, Fill, Init, Inputs, LayerDef, OptValue, OptionDef, OptionDefault, OptionType,
    OptionValues, ParamDef,
};
pub use docs::{aliases_doc, layer_table};

use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{LayerCx, Value};
use crate::plan::{RustWriter, ToRust};
use crate::spec::{Activation, Padding};

/// Declares the catalogue: one entry per layer kind, `module::Variant { fields }` (or
/// `(field)`, or nothing). Generates `LayerKind`, [`CATALOGUE`], [`LayerKind::def`], the
/// dispatch to each module's `lower`, and `LayerKind`'s `ToRust` writer.
macro_rules! catalogue {
    ($(
        $(#[$doc:meta])*
        $module:ident :: $variant:ident
            $({ $($field:ident : $fty:ty),* $(,)? })?
            $(($tty:ty))?
    ),* $(,)?) => {
        $(mod $module;)*

        /// One layer's kind and options, as the catalogue declares them. Shapes exclude the
        /// batch dimension.
        #[derive(Clone, Debug, PartialEq)]
        pub enum LayerKind {
            $(
                $(#[$doc])*
                $variant $({ $($field: $fty),* })? $(($tty))?,
            )*
        }

        /// Every layer kind, in the order the DSL lists them.
        pub static CATALOGUE: &[&LayerDef] = &[$(&$module::DEF),*];

        impl LayerKind {
            /// The kind's catalogue entry.
            pub fn def(&self) -> &'static LayerDef {
                match self {
                    $(LayerKind::$variant { .. } => &$module::DEF,)*
                }
            }
        }

        /// Adds the ops of one layer and returns its output.
        pub(crate) fn lower(cx: &mut LayerCx<'_, '_>, kind: &LayerKind) -> Result<Value, PlanError> {
            match kind {
                $(LayerKind::$variant { .. } => $module::lower(cx, kind),)*
            }
        }

        impl ToRust for LayerKind {
            fn write_rust(&self, w: &mut RustWriter<'_>) {
                match self {
                    $(LayerKind::$variant { .. } => {
                        variant_to_rust!(w, self, $variant $({ $($field),* })? $(($tty))?)
                    })*
                }
            }
        }
    };
}

/// Writes one `LayerKind` variant as Rust source.
macro_rules! variant_to_rust {
    ($w:ident, $self:ident, $variant:ident { $($field:ident),* }) => {
        if let LayerKind::$variant { $($field),* } = $self {
            $w.path(concat!("LayerKind::", stringify!($variant), " {"));
            $(
                $w.s(concat!(stringify!($field), ": "));
                Field::write($field, $w);
                $w.s(",");
            )*
            $w.s("}");
        }
    };
    ($w:ident, $self:ident, $variant:ident ($ty:ty)) => {
        if let LayerKind::$variant(x) = $self {
            $w.path(concat!("LayerKind::", stringify!($variant), "("));
            Field::write(x, $w);
            $w.s(")");
        }
    };
    ($w:ident, $self:ident, $variant:ident) => {
        $w.path(concat!("LayerKind::", stringify!($variant)))
    };
}

catalogue! {
    /// A model input. `dtype` is how it is stored (u8 pixels, i32 labels/ids, or a float);
    /// u8 inputs are scaled by `scale` into the compute dtype inside the step.
    input::Input { shape: Vec<usize>, dtype: DType, scale: f32 },
    dense::Dense { units: usize, activation: Activation, use_bias: bool },
    conv2d::Conv2d {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        activation: Activation,
        use_bias: bool,
    },
    depthwise_conv2d::DepthwiseConv2d {
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        multiplier: usize,
        activation: Activation,
        use_bias: bool,
    },
    separable_conv2d::SeparableConv2d {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        multiplier: usize,
        activation: Activation,
        use_bias: bool,
    },
    conv2d_transpose::Conv2dTranspose {
        filters: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        activation: Activation,
        use_bias: bool,
    },
    max_pool2d::MaxPool2d { pool: [usize; 2], strides: [usize; 2], padding: Padding },
    avg_pool2d::AvgPool2d { pool: [usize; 2], strides: [usize; 2], padding: Padding },
    global_avg_pool::GlobalAvgPool,
    /// Batch normalisation in training mode over the last axis (Keras defaults 0.99, 1e-3).
    batch_norm::BatchNorm { momentum: f32, epsilon: f32 },
    layer_norm::LayerNorm { epsilon: f32 },
    /// Root-mean-square normalisation over the last axis (Keras default epsilon 1e-6).
    rms_norm::RmsNorm { epsilon: f32 },
    /// Group normalisation over channel groups, per sample (Keras defaults 32 groups, 1e-3).
    group_norm::GroupNorm { groups: usize, epsilon: f32 },
    dropout::Dropout { rate: f32 },
    /// A view: no op, no new bytes.
    flatten::Flatten,
    /// A view to `shape` (without batch): no op, no new bytes.
    reshape::Reshape { shape: Vec<usize> },
    /// Element-wise sum of two or more inputs of the same shape, then `activation`.
    add::Add { activation: Activation },
    /// Concatenation along the last axis.
    concat::Concat,
    /// Token ids (i32) → vectors.
    embedding::Embedding { vocab: usize, dim: usize },
    /// A learned position table added to token vectors `[seq, dim]` (GPT-2's `wpe`).
    positional_embedding::PositionalEmbedding,
    /// Multi-head self-attention over `[seq, hidden]`: fused QKV projection, scaled
    /// dot-product attention (optionally causal, with dropout on the probabilities) and an
    /// output projection.
    attention::Attention { heads: usize, causal: bool, dropout: f32 },
    activation::Activation(Activation),
    /// The VAE's reparameterisation: inputs `(mean, log_var)`, output `mean + exp(log_var/2)·ε`.
    sample_normal::SampleNormal,
}

impl LayerKind {
    /// The attribute name the DSL uses for this layer.
    pub fn name(&self) -> &'static str {
        self.def().name
    }
}

/// The catalogue entry of the DSL attribute `name` (`dense`).
pub fn find(name: &str) -> Option<&'static LayerDef> {
    CATALOGUE.iter().copied().find(|d| d.name == name)
}

/// How the runtime fills parameter `param` (its full name, `hidden.weight`) of layer
/// `layer` (`hidden`), a `kind` layer (`dense`): what the layer's catalogue entry declares.
/// `None` when the kind has no such parameter.
pub fn param_init(kind: &str, layer: &str, param: &str) -> Option<Init> {
    let suffix = param.strip_prefix(layer)?.strip_prefix('.')?;
    Some(find(kind)?.param(suffix)?.init)
}

/// The field types of `LayerKind` variants, written as Rust source.
trait Field {
    fn write(&self, w: &mut RustWriter<'_>);
}

macro_rules! field_via_to_rust {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn write(&self, w: &mut RustWriter<'_>) {
                self.write_rust(w);
            }
        }
    )*};
}
field_via_to_rust!(usize, f32, bool, DType, Padding, Activation);

impl Field for [usize; 2] {
    fn write(&self, w: &mut RustWriter<'_>) {
        w.s("[");
        self[0].write_rust(w);
        w.s(",");
        self[1].write_rust(w);
        w.s("]");
    }
}

impl Field for Vec<usize> {
    fn write(&self, w: &mut RustWriter<'_>) {
        w.s("::std::vec![");
        for (i, d) in self.iter().enumerate() {
            if i > 0 {
                w.s(",");
            }
            d.write_rust(w);
        }
        w.s("]");
    }
}

impl LayerKind {
    /// The kind as a Rust expression (`krate` is this crate's path as the generated code
    /// sees it, `::memwise::plan`).
    pub fn to_rust(&self, krate: &str) -> String {
        let mut out = String::new();
        self.write_rust(&mut RustWriter::new(&mut out, krate));
        out
    }
}
