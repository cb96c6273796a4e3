//! The types of a catalogue entry: what a layer declares about itself so that the macro's
//! parser, the facade's handle types, the docs table and the weight initialisers can be
//! derived from it.

use crate::dtype::DType;
use crate::spec::{Activation, LayerKind, Padding};

/// One layer kind, as the DSL and the runtime see it. Its lowering to ops is the `lower`
/// function beside it in the same file.
#[derive(Debug)]
pub struct LayerDef {
    /// The DSL attribute: `dense` in `#[dense(64)]`.
    pub name: &'static str,
    /// Its field type in `memwise::layers`: `Dense`.
    pub handle: &'static str,
    /// One line for the handle type's docs and the docs table.
    pub doc: &'static str,
    /// What the layer reads.
    pub inputs: Inputs,
    /// Its options, in the order the macro reads them (their order in messages).
    pub options: &'static [OptionDef],
    /// Every parameter the layer may create (a bias only when `use_bias` …).
    pub params: &'static [ParamDef],
    /// The layer's kind from its option values (each option at its value or default).
    pub build: fn(&OptionValues) -> LayerKind,
}

impl LayerDef {
    /// The option called `name` (its canonical name, not an alias).
    pub fn option(&self, name: &str) -> Option<&'static OptionDef> {
        self.options.iter().find(|o| o.name == name)
    }

    /// The parameter whose name ends the layer's name: `weight`, `qkv.bias`.
    pub fn param(&self, suffix: &str) -> Option<&'static ParamDef> {
        self.params.iter().find(|p| p.suffix == suffix)
    }

    /// The kind with every option at its default (required ones at their placeholder).
    pub fn with_defaults(&self) -> LayerKind {
        self.build_with(&[])
    }

    /// The kind with the options `given` and every other at its default. Panics on an
    /// option the layer does not have.
    pub fn build_with(&self, given: &[(&str, OptValue)]) -> LayerKind {
        for (name, _) in given {
            assert!(
                self.option(name).is_some(),
                "`{}` has no option `{name}`",
                self.name
            );
        }
        let mut values = OptionValues::default();
        for o in self.options {
            let v = match given.iter().find(|(n, _)| *n == o.name) {
                Some((_, v)) => v.clone(),
                None => o.fallback(&values),
            };
            values.set(o.name, v);
        }
        (self.build)(&values)
    }
}

/// What a layer reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inputs {
    /// Nothing: a model input, written by the runtime.
    None,
    /// One tensor: the field above it, or the field `from = …` names.
    One,
    /// The fields it names as its arguments (`add(block1, stem)`), or with `from = [a, b]`.
    Fields {
        /// How many it needs, at least.
        min: usize,
        /// How many it takes, at most (`None`: any number).
        max: Option<usize>,
        /// What the arguments are, for the docs table: "the fields to sum".
        doc: &'static str,
        /// What the macro says it reads when the count is wrong: "two or more fields".
        what: &'static str,
        /// How to write it: `#[add(block1, stem)]`.
        example: &'static str,
    },
}

/// One option of a layer attribute.
#[derive(Clone, Debug)]
pub struct OptionDef {
    /// Keras's name: `kernel_size`.
    pub name: &'static str,
    /// Other accepted spellings: `kernel`.
    pub aliases: &'static [&'static str],
    /// Its place when given without a name (`#[conv2d(32, 3)]`: filters 0, kernel_size 1).
    pub position: Option<usize>,
    pub ty: OptionType,
    pub default: OptionDefault,
    /// One line for the docs table.
    pub doc: &'static str,
}

impl OptionDef {
    const fn with(
        name: &'static str,
        ty: OptionType,
        default: OptionDefault,
        doc: &'static str,
    ) -> Self {
        OptionDef {
            name,
            aliases: &[],
            position: None,
            ty,
            default,
            doc,
        }
    }

    /// An optional option, `name = default`.
    pub const fn new(
        name: &'static str,
        ty: OptionType,
        default: OptValue,
        doc: &'static str,
    ) -> Self {
        OptionDef::with(name, ty, OptionDefault::Value(default), doc)
    }

    /// A required option; `example` shows how to write it.
    pub const fn required(
        name: &'static str,
        ty: OptionType,
        example: &'static str,
        doc: &'static str,
    ) -> Self {
        OptionDef::with(name, ty, OptionDefault::Required { example }, doc)
    }

    /// An option whose default is the value of option `other` of the same layer.
    pub const fn same_as(
        name: &'static str,
        ty: OptionType,
        other: &'static str,
        doc: &'static str,
    ) -> Self {
        OptionDef::with(name, ty, OptionDefault::SameAs(other), doc)
    }

    /// The same option, also accepted without a name at `position`.
    pub const fn at(mut self, position: usize) -> Self {
        self.position = Some(position);
        self
    }

    /// The same option, also spelt `aliases`.
    pub const fn alias(mut self, aliases: &'static [&'static str]) -> Self {
        self.aliases = aliases;
        self
    }

    /// Its value when absent, or when what was written is wrong (an error is reported
    /// then): the default, or for a required option a placeholder of its type.
    pub fn fallback(&self, values: &OptionValues) -> OptValue {
        match &self.default {
            OptionDefault::Value(v) => v.clone(),
            OptionDefault::SameAs(other) => values.get(other).clone(),
            OptionDefault::Required { .. } => self.ty.placeholder(),
        }
    }
}

/// What an option's value must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionType {
    /// An integer of at least 1.
    Positive,
    /// One positive integer or two (`3` or `[3, 5]`): height and width.
    Pair,
    /// Any number.
    Float,
    /// A number in `[0, 1)`.
    Rate,
    Bool,
    /// A list of positive dimensions (`[28, 28, 1]`), or one number.
    Shape,
    Activation,
    Padding,
    /// How an input is stored: `u8`, `i32`, `f32`, `f16`, `bf16`.
    DType,
    /// An axis, of which only the last (`-1`) is supported.
    LastAxis,
}

impl OptionType {
    /// The value a required option takes while its error is reported.
    pub fn placeholder(self) -> OptValue {
        match self {
            OptionType::Positive => OptValue::Usize(1),
            OptionType::Pair => OptValue::Pair([1, 1]),
            OptionType::Float | OptionType::Rate => OptValue::Float(0.0),
            OptionType::Bool => OptValue::Bool(false),
            OptionType::Shape => OptValue::Shape(vec![1]),
            OptionType::Activation => OptValue::Activation(Activation::Linear),
            OptionType::Padding => OptValue::Padding(Padding::Valid),
            OptionType::DType => OptValue::DType(DType::F32),
            OptionType::LastAxis => OptValue::Int(-1),
        }
    }
}

/// An option's default.
#[derive(Clone, Debug)]
pub enum OptionDefault {
    /// The option must be given.
    Required {
        example: &'static str,
    },
    Value(OptValue),
    /// The value of another option of the layer (Keras's pool strides = pool size).
    SameAs(&'static str),
}

/// An option's value, read by the macro (or a default).
#[derive(Clone, Debug, PartialEq)]
pub enum OptValue {
    Usize(usize),
    Pair([usize; 2]),
    Float(f32),
    Bool(bool),
    Shape(Vec<usize>),
    Activation(Activation),
    Padding(Padding),
    DType(DType),
    Int(i64),
}

impl OptValue {
    /// As the DSL writes it: `1` for `[1, 1]`, `valid`, `1e-3`.
    pub fn dsl(&self) -> String {
        match self {
            OptValue::Usize(n) => n.to_string(),
            OptValue::Pair([a, b]) if a == b => a.to_string(),
            OptValue::Pair([a, b]) => format!("[{a}, {b}]"),
            OptValue::Float(x) if *x != 0.0 && x.abs() < 0.01 => format!("{x:e}"),
            OptValue::Float(x) => format!("{x:?}"),
            OptValue::Bool(b) => b.to_string(),
            OptValue::Shape(s) => format!("{s:?}"),
            OptValue::Activation(a) => a.dsl(),
            OptValue::Padding(p) => p.name().to_string(),
            OptValue::DType(d) => d.name().to_string(),
            OptValue::Int(n) => n.to_string(),
        }
    }
}

/// The values of one layer's options, by canonical name: what [`LayerDef::build`] reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptionValues {
    values: Vec<(&'static str, OptValue)>,
}

macro_rules! typed_getters {
    ($($(#[$doc:meta])* $fn:ident -> $ty:ty = $variant:ident;)*) => {$(
        $(#[$doc])*
        pub fn $fn(&self, name: &str) -> $ty {
            match self.get(name) {
                OptValue::$variant(v) => v.clone(),
                other => panic!(
                    "option `{name}` holds {other:?}, not a {}: the catalogue entry's options \
                     and its `build` disagree",
                    stringify!($variant)
                ),
            }
        }
    )*};
}

impl OptionValues {
    /// Every option of `def` at its default (required ones at their placeholder).
    pub fn defaults(def: &LayerDef) -> Self {
        let mut v = OptionValues::default();
        for o in def.options {
            let x = o.fallback(&v);
            v.set(o.name, x);
        }
        v
    }

    pub fn set(&mut self, name: &'static str, value: OptValue) {
        match self.values.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.values.push((name, value)),
        }
    }

    /// The value of option `name`. Panics when the layer has no such option (a catalogue
    /// entry whose `build` reads an option it does not declare; the catalogue's tests
    /// build every entry).
    pub fn get(&self, name: &str) -> &OptValue {
        match self.values.iter().find(|(n, _)| *n == name) {
            Some((_, v)) => v,
            None => panic!("no option `{name}`: the catalogue entry does not declare it"),
        }
    }

    typed_getters! {
        positive -> usize = Usize;
        pair -> [usize; 2] = Pair;
        float -> f32 = Float;
        boolean -> bool = Bool;
        shape -> Vec<usize> = Shape;
        activation -> Activation = Activation;
        padding -> Padding = Padding;
        dtype -> DType = DType;
    }
}

/// One persistent parameter a layer creates: named `<layer>.<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamDef {
    /// `weight`, `bias`, `running_mean`, `qkv.weight`.
    pub suffix: &'static str,
    /// Updated by the optimizer (false: a statistic, such as a running mean).
    pub trainable: bool,
    /// How the runtime fills it before training.
    pub init: Init,
    /// A GEMM operand: half-precision layers keep a 16-bit copy of it.
    pub gemm: bool,
}

impl ParamDef {
    /// A trainable parameter.
    pub const fn trainable(suffix: &'static str, init: Init) -> Self {
        ParamDef {
            suffix,
            trainable: true,
            init,
            gemm: false,
        }
    }

    /// A statistic the optimizer does not touch.
    pub const fn statistic(suffix: &'static str, init: Init) -> Self {
        ParamDef {
            suffix,
            trainable: false,
            init,
            gemm: false,
        }
    }

    /// The same parameter, read by half-precision GEMMs through a 16-bit copy.
    pub const fn gemm(mut self) -> Self {
        self.gemm = true;
        self
    }
}

/// How a parameter starts (Keras's initialisers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Uniform in `±sqrt(6 / (fan_in + fan_out))` ([`glorot_limit`]).
    GlorotUniform,
    /// Uniform in `[-limit, limit]`.
    Uniform(f32),
}

/// What the runtime writes into a parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    Constant(f32),
    /// Uniform draws in `[-limit, limit]`.
    Uniform(f32),
}

impl Init {
    /// The values a parameter of `shape` starts with.
    pub fn fill(self, shape: &[usize]) -> Fill {
        match self {
            Init::Zeros => Fill::Constant(0.0),
            Init::Ones => Fill::Constant(1.0),
            Init::GlorotUniform => Fill::Uniform(glorot_limit(shape)),
            Init::Uniform(limit) => Fill::Uniform(limit),
        }
    }

    /// As the docs name it.
    pub fn describe(self) -> String {
        match self {
            Init::Zeros => "zeros".to_string(),
            Init::Ones => "ones".to_string(),
            Init::GlorotUniform => "Glorot uniform".to_string(),
            Init::Uniform(l) => format!("uniform ±{l}"),
        }
    }
}

/// `sqrt(6 / (fan_in + fan_out))` with Keras's fans: the last two axes times the
/// receptive field (the product of the others).
pub fn glorot_limit(shape: &[usize]) -> f32 {
    let (fan_in, fan_out) = match shape.len() {
        0 => (1, 1),
        1 => (shape[0], shape[0]),
        n => {
            let rf: usize = shape[..n - 2].iter().product();
            (shape[n - 2] * rf, shape[n - 1] * rf)
        }
    };
    (6.0 / (fan_in + fan_out).max(1) as f32).sqrt()
}
