//! The layer attributes, read into a planner `LayerKind` through the planner's layer
//! catalogue (`memwise_plan::layers`): the attribute names, handle types, options with
//! their aliases, positions and defaults, and what each layer reads all come from there,
//! so this file names no layer. It also writes the facade's handle types and docs table
//! from the catalogue.
use memwise_plan::layers::{
    self, aliases_doc, layer_table, Inputs, LayerDef, OptValue, OptionDef, OptionDefault,
    OptionType, OptionValues, CATALOGUE,
};
use memwise_plan::{Activation, DType, LayerKind, Padding};
use proc_macro2::{Literal, TokenStream};
use quote::{format_ident, quote};

use crate::diag::Errors;
use crate::value::{
    boolean, float, pair, positive, refs, shape, word, Arg, Env, FieldRef, Opts, Val, V,
};

/// Field attributes that are not layers.
pub const MODIFIERS: &[&str] = &[
    "checkpoint",
    "stage",
    "recompute_output",
    "fp16",
    "bf16",
    "f32",
    "block",
];

/// The catalogue entry of layer attribute `attr`.
pub fn info(attr: &str) -> Option<&'static LayerDef> {
    layers::find(attr)
}

/// Every attribute name a field may carry (for "did you mean").
pub fn attribute_names() -> impl Iterator<Item = &'static str> {
    CATALOGUE
        .iter()
        .map(|l| l.name)
        .chain(MODIFIERS.iter().copied())
}

/// A layer as declared: its kind, and the fields it reads (empty: the previous field).
pub struct LayerDecl {
    pub kind: LayerKind,
    pub inputs: Vec<FieldRef>,
}

const DTYPES: [&str; 10] = [
    "f32", "f16", "bf16", "u8", "i32", "float32", "float16", "bfloat16", "uint8", "int32",
];

/// `relu`, `leaky_relu` (its parameter at the default), `leaky_relu(0.1)` or
/// `leaky_relu(alpha = 0.1)`: any activation of the planner's list, with the parameter it
/// declares.
fn activation(v: &Val, what: &str) -> syn::Result<Activation> {
    let names = Activation::ALL.map(Activation::name);
    let (name, args) = match &v.v {
        V::Call(name, args) => (
            Val {
                v: V::Word(name.clone()),
                tokens: v.tokens.clone(),
            },
            Some(args),
        ),
        _ => (v.clone(), None),
    };
    let act = word(&name, what, &names).map(|w| Activation::parse(w).expect("listed"))?;
    match args {
        Some(args) => activation_param(act, v, args),
        None => Ok(act),
    }
}

/// `act` with the parameter `args` give it (by position or by name): a finite number ≥ 0.
fn activation_param(
    act: Activation,
    call: &Val,
    args: &[(Option<syn::Ident>, Val)],
) -> syn::Result<Activation> {
    let a = act.name();
    let Some((param, _)) = act.param() else {
        return Err(call.err(format!(
            "the activation `{a}` takes no parameter: write `{a}`"
        )));
    };
    let mut value: Option<&Val> = None;
    for (k, (name, v)) in args.iter().enumerate() {
        match name {
            Some(n) if n != param => {
                return Err(syn::Error::new_spanned(
                    n,
                    format!(
                        "unknown parameter `{n}` of the activation `{a}`{}\n= note: its parameter is `{param}`",
                        crate::diag::did_you_mean(&n.to_string(), [param])
                    ),
                ))
            }
            _ if value.is_some() || k > 0 => {
                return Err(v.err(format!(
                    "the activation `{a}` takes one parameter, `{param}`"
                )))
            }
            _ => value = Some(v),
        }
    }
    let Some(v) = value else {
        return Ok(act);
    };
    let x = float(v, param)?;
    // A block parameter is checked where the block is used, when its value is known.
    let allowed = v.is_unknown() || (x.is_finite() && x >= 0.0);
    if !allowed {
        return Err(v.err(format!(
            "`{param}` of `{a}` must be a number ≥ 0 (its backward reads its output), found {}",
            v.describe()
        )));
    }
    Ok(act.with_param(x))
}

fn padding(v: &Val, what: &str) -> syn::Result<Padding> {
    let names = Padding::ALL.map(Padding::name);
    word(v, what, &names).map(|w| {
        Padding::ALL
            .into_iter()
            .find(|p| p.name() == w)
            .expect("listed")
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

/// Reads `v` as an option of type `ty` of layer `attr`.
fn value(attr: &str, ty: OptionType, v: &Val, what: &str) -> syn::Result<OptValue> {
    Ok(match ty {
        OptionType::Positive => OptValue::Usize(positive(v, what)?),
        OptionType::Pair => OptValue::Pair(pair(v, what)?),
        OptionType::Float => OptValue::Float(float(v, what)?),
        OptionType::Rate => OptValue::Float(rate(v, what)?),
        OptionType::Bool => OptValue::Bool(boolean(v, what)?),
        OptionType::Shape => OptValue::Shape(shape(v, what)?),
        OptionType::Activation => OptValue::Activation(activation(v, what)?),
        OptionType::Padding => OptValue::Padding(padding(v, what)?),
        OptionType::DType => OptValue::DType(dtype(v, what)?),
        OptionType::LastAxis => {
            if !matches!(v.v, V::Int(-1) | V::Unknown) {
                return Err(v.err(format!(
                    "`#[{attr}]` joins along the last axis only: drop `{what}` or write `{what} = -1`"
                )));
            }
            OptValue::Int(-1)
        }
    })
}

/// Reads one option as its catalogue entry declares it: by name, alias or position, its
/// default when absent, an error when required and absent or when the value is wrong.
fn option(
    attr: &str,
    def: &'static OptionDef,
    values: &OptionValues,
    o: &mut Opts,
    e: &mut Errors,
) -> OptValue {
    let fallback = def.fallback(values);
    let read = |v: &Val, what: &str| value(attr, def.ty, v, what);
    match &def.default {
        OptionDefault::Required { example } => o.require(
            def.name,
            def.aliases,
            def.position,
            fallback,
            example,
            e,
            read,
        ),
        _ => o.read(def.name, def.aliases, def.position, fallback, e, read),
    }
}

/// Reads one layer attribute. `anchor` is the whole attribute (for "missing option" errors).
pub fn lower_layer(
    attr: &str,
    anchor: TokenStream,
    args: Vec<Arg>,
    env: &Env,
    e: &mut Errors,
) -> LayerDecl {
    let def = info(attr).expect("lower_layer is called with known layer names only");
    let mut opts = Opts::new(format!("`#[{attr}]`"), anchor.clone(), args, env);
    let decl = read_layer(def, &anchor, &mut opts, env, e);
    opts.finish(e);
    decl
}

fn read_layer(
    def: &'static LayerDef,
    anchor: &TokenStream,
    o: &mut Opts,
    env: &Env,
    e: &mut Errors,
) -> LayerDecl {
    let attr = def.name;
    // Layers that combine fields take them as arguments; the others may name one with `from`.
    let mut inputs = Vec::new();
    let combine = matches!(def.inputs, Inputs::Fields { .. });
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

    let mut values = OptionValues::default();
    for opt in def.options {
        let v = option(attr, opt, &values, o, e);
        values.set(opt.name, v);
    }
    let kind = (def.build)(&values);

    if def.inputs != Inputs::None {
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

    if let Inputs::Fields {
        min,
        max,
        what,
        example,
        ..
    } = def.inputs
    {
        if inputs.len() < min || max.is_some_and(|m| inputs.len() > m) {
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

/// `callback! { #[doc = "…"] Dense = "dense"; … }`, one line per catalogue entry: the
/// facade's handle types (`memwise::layers`), declared by its `callback` macro.
pub fn handle_types(callback: TokenStream) -> TokenStream {
    let entries = CATALOGUE.iter().map(|d| {
        let (ty, kind, doc) = (format_ident!("{}", d.handle), d.name, d.doc);
        quote!(#[doc = #doc] #ty = #kind;)
    });
    quote!(#callback! { #(#entries)* })
}

/// The reference of the layer attributes, as a string literal for `#[doc = …]`: the
/// table of every catalogue entry, then the activations and the aliases.
pub fn docs_table() -> TokenStream {
    let text = format!("{}\n{}", layer_table(), aliases_doc());
    let lit = Literal::string(&text);
    quote!(#lit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::split_args;

    /// A value of `ty` as the DSL writes it, and as it is read.
    fn sample(ty: OptionType) -> (&'static str, OptValue) {
        match ty {
            OptionType::Positive => ("3", OptValue::Usize(3)),
            OptionType::Pair => ("[3, 5]", OptValue::Pair([3, 5])),
            OptionType::Float => ("0.5", OptValue::Float(0.5)),
            OptionType::Rate => ("0.25", OptValue::Float(0.25)),
            OptionType::Bool => ("false", OptValue::Bool(false)),
            OptionType::Shape => ("[4, 2]", OptValue::Shape(vec![4, 2])),
            OptionType::Activation => ("tanh", OptValue::Activation(Activation::Tanh)),
            OptionType::Padding => ("same", OptValue::Padding(Padding::Same)),
            OptionType::DType => ("i32", OptValue::DType(DType::I32)),
            OptionType::LastAxis => ("-1", OptValue::Int(-1)),
        }
    }

    fn read(def: &LayerDef, args: &str) -> (LayerDecl, String) {
        let mut e = Errors::default();
        let tokens: TokenStream = args.parse().expect("tokens");
        let args = split_args(tokens, &mut e);
        let decl = lower_layer(def.name, quote!(#[x]), args, &Env::new(), &mut e);
        (decl, e.to_compile_errors().to_string())
    }

    /// `#[attr(fields…, option = value, …)]` with every option spelt by `spell`, and the
    /// kind it must read as.
    fn every_option(def: &LayerDef, spell: impl Fn(&OptionDef) -> &str) -> (String, LayerKind) {
        let mut args: Vec<String> = Vec::new();
        if matches!(def.inputs, Inputs::Fields { .. }) {
            args.extend(["a".to_string(), "b".to_string()]);
        }
        let mut values = OptionValues::defaults(def);
        for o in def.options {
            let (text, v) = sample(o.ty);
            args.push(format!("{} = {text}", spell(o)));
            values.set(o.name, v);
        }
        (args.join(", "), (def.build)(&values))
    }

    #[test]
    fn every_catalogue_layer_reads_its_options_by_name_and_by_alias() {
        for def in CATALOGUE {
            let (args, want) = every_option(def, |o| o.name);
            let (decl, errors) = read(def, &args);
            assert_eq!(errors, "", "#[{}({args})]", def.name);
            assert_eq!(decl.kind, want, "#[{}({args})]", def.name);
            let fields = usize::from(matches!(def.inputs, Inputs::Fields { .. })) * 2;
            assert_eq!(decl.inputs.len(), fields);

            let (args, want) = every_option(def, |o| o.aliases.first().unwrap_or(&o.name));
            let (decl, errors) = read(def, &args);
            assert_eq!(errors, "", "#[{}({args})]", def.name);
            assert_eq!(decl.kind, want, "#[{}({args})]", def.name);
        }
    }

    #[test]
    fn every_catalogue_layer_reads_its_positional_options_in_order() {
        for def in CATALOGUE {
            let mut positional: Vec<&OptionDef> = def
                .options
                .iter()
                .filter(|o| o.position.is_some())
                .collect();
            positional.sort_by_key(|o| o.position);
            let args: Vec<&str> = positional.iter().map(|o| sample(o.ty).0).collect();
            let args = args.join(", ");
            // The others at their defaults, which may follow the given ones (pool strides).
            let mut values = OptionValues::default();
            for o in def.options {
                let v = match o.position {
                    Some(_) => sample(o.ty).1,
                    None => o.fallback(&values),
                };
                values.set(o.name, v);
            }
            let (decl, errors) = read(def, &args);
            if matches!(def.inputs, Inputs::Fields { .. }) {
                continue; // their positional arguments are fields
            }
            assert_eq!(errors, "", "#[{}({args})]", def.name);
            assert_eq!(decl.kind, (def.build)(&values), "#[{}({args})]", def.name);
        }
    }

    #[test]
    fn a_missing_required_option_or_field_is_an_error_naming_it() {
        for def in CATALOGUE {
            let (decl, errors) = read(def, "");
            for o in def.options {
                let needs = format!("`#[{}]` needs `{}`", def.name, o.name);
                let required = matches!(o.default, OptionDefault::Required { .. });
                assert_eq!(errors.contains(&needs), required, "{errors}");
            }
            if let Inputs::Fields { what, .. } = def.inputs {
                assert!(
                    errors.contains(&format!("reads {what}, found 0")),
                    "{errors}"
                );
            }
            // The placeholders stand in, so the rest of the model can still be checked.
            assert_eq!(decl.kind, def.with_defaults());
        }
    }

    #[test]
    fn the_handle_types_and_docs_come_from_every_entry() {
        let handles = handle_types(quote!(handles)).to_string();
        for def in CATALOGUE {
            assert!(handles.contains(&format!("{} = \"{}\"", def.handle, def.name)));
        }
        let docs = docs_table().to_string();
        assert_eq!(docs.matches("(layers::").count(), CATALOGUE.len());
    }
}
