//! The struct's fields: which layer or block each one is, its modifiers (`#[checkpoint]`,
//! `#[fp16]` …), its repeat count (`[Dense; 3]`), and the check that its type fits.
use memwise_plan::layers::CATALOGUE;
use memwise_plan::DType;
use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::{Expr, Fields, ItemStruct, Lit, Meta, Type};

use crate::diag::{closest, Errors};
use crate::layer::{self, attribute_names};
use crate::value::{eval, split_args, Env, Val, V};

#[derive(Clone)]
pub enum FieldKind {
    /// `#[dense(…)]` and the like.
    Layer { attr: String, args: TokenStream },
    /// `#[block(…)]`: an instance of a `#[memwise::block]` struct.
    Block {
        path: syn::Path,
        key: String,
        args: TokenStream,
    },
}

/// `#[checkpoint]` or `#[checkpoint(segment = N)]`.
#[derive(Clone)]
pub struct Checkpoint {
    pub segment: Option<i64>,
    pub tokens: TokenStream,
}

#[derive(Clone)]
pub struct FieldDecl {
    pub name: String,
    pub kind: FieldKind,
    /// The whole layer or block attribute (where most errors about the field go).
    pub anchor: TokenStream,
    /// `[T; N]`: N copies in a row.
    pub repeat: Option<usize>,
    pub checkpoint: Option<Checkpoint>,
    /// `#[recompute_output]`: the attribute's tokens.
    pub recompute_output: Option<TokenStream>,
    /// `#[stage(k)]`: this field and those after it, up to the next `#[stage]`, are pipeline
    /// stage `k`; and the attribute's tokens.
    pub stage: Option<(usize, TokenStream)>,
    pub dtype: Option<(DType, TokenStream)>,
    pub ty: Type,
}

impl FieldDecl {
    pub fn is_input(&self) -> bool {
        matches!(&self.kind, FieldKind::Layer { attr, .. } if attr == "input")
    }
}

/// Attributes the macro leaves on fields for the compiler.
const PASS_THROUGH: &[&str] = &["doc", "allow", "warn", "deny", "expect", "forbid"];

/// Checks the struct's shape (named fields, no generics) and reads every field, removing the
/// macro's attributes from `item` so that it can be emitted as a plain struct.
/// `what` is "model" or "block".
pub fn read_struct(item: &mut ItemStruct, what: &str, e: &mut Errors) -> Vec<FieldDecl> {
    let name = item.ident.to_string();
    if !item.generics.params.is_empty() {
        e.at(
            &item.generics,
            format!(
                "a {what} cannot be generic: its shapes and memory are planned when the macro runs, so every size must be written out\n= help: for a family of {what}s, declare a `#[memwise::block(param, …)]` and pass the values with `#[block(param = …)]`"
            ),
        );
    }
    let in_block = what == "block";
    let mut decls = Vec::new();
    match &mut item.fields {
        Fields::Named(named) => {
            if named.named.is_empty() {
                e.at(&item.ident, format!("{what} `{name}` has no layers: add fields like `#[dense(64)] hidden: Dense`"));
            }
            for field in named.named.iter_mut() {
                if let Some(d) = read_field(field, in_block, e) {
                    decls.push(d);
                }
            }
        }
        Fields::Unnamed(unnamed) => {
            e.at(
                &*unnamed,
                format!("a {what} is a struct with named fields, one per layer: `struct {name} {{ #[dense(10)] logits: Dense }}`"),
            );
            for f in unnamed.unnamed.iter_mut() {
                strip(&mut f.attrs, &[]);
            }
        }
        Fields::Unit => e.at(
            &item.ident,
            format!("{what} `{name}` has no layers: a {what} is a struct with named fields, one per layer: `struct {name} {{ #[dense(10)] logits: Dense }}`"),
        ),
    }
    decls
}

fn is_ours(name: &str) -> bool {
    layer::info(name).is_some() || layer::MODIFIERS.contains(&name)
}

/// Removes the macro's attributes, and `also` (misspelt ones already reported, which the
/// compiler would otherwise report a second time as unknown attributes).
fn strip(attrs: &mut Vec<syn::Attribute>, also: &[String]) {
    attrs.retain(|a| {
        !a.path().get_ident().is_some_and(|i| {
            let n = i.to_string();
            is_ours(&n) || also.contains(&n)
        })
    });
}

fn read_field(field: &mut syn::Field, in_block: bool, e: &mut Errors) -> Option<FieldDecl> {
    let ident = field.ident.clone().expect("named field");
    let name = ident.to_string();
    let mut kind: Option<(FieldKind, TokenStream, String)> = None;
    let mut checkpoint = None;
    let mut recompute_output: Option<TokenStream> = None;
    let mut stage: Option<(usize, TokenStream)> = None;
    let mut dtype: Option<(DType, TokenStream)> = None;
    let mut foreign: Vec<&syn::Attribute> = Vec::new();
    let mut reported: Vec<String> = Vec::new();
    let mut broken = false;
    for attr in &field.attrs {
        let Some(attr_name) = attr.path().get_ident().map(|i| i.to_string()) else {
            foreign.push(attr);
            continue;
        };
        let tokens = attr.to_token_stream();
        let args = match &attr.meta {
            Meta::Path(_) => TokenStream::new(),
            Meta::List(l) => l.tokens.clone(),
            Meta::NameValue(_) if is_ours(&attr_name) => {
                e.at(
                    attr,
                    format!("write `#[{attr_name}(…)]`, not `#[{attr_name} = …]`"),
                );
                broken = true;
                continue;
            }
            Meta::NameValue(_) => TokenStream::new(),
        };
        match attr_name.as_str() {
            "checkpoint" => {
                if checkpoint.is_some() {
                    e.at(
                        attr,
                        format!("`#[checkpoint]` is given twice on field `{name}`"),
                    );
                }
                checkpoint = Some(read_checkpoint(args, tokens, e));
            }
            "recompute_output" => {
                read_flag(attr, &args, &name, recompute_output.is_some(), e);
                recompute_output = Some(tokens);
            }
            "stage" => stage = read_stage(attr, &args, tokens, stage.is_some(), e),
            "fp16" | "bf16" | "f32" => {
                if !args.is_empty() {
                    e.at(attr, format!("`#[{attr_name}]` takes no arguments"));
                }
                let d = DType::parse(&attr_name).unwrap_or(DType::F16);
                let d = if attr_name == "fp16" { DType::F16 } else { d };
                match &dtype {
                    Some((prev, _)) if *prev == d => e.at(attr, format!("`#[{attr_name}]` is given twice on field `{name}`")),
                    Some((prev, _)) => e.at(
                        attr,
                        format!(
                            "conflicting precision on field `{name}`: `#[{}]` and `#[{attr_name}]`; a layer computes in one dtype, keep one",
                            modifier_name(*prev)
                        ),
                    ),
                    None => dtype = Some((d, tokens)),
                }
            }
            "cfg" | "cfg_attr" => {
                e.at(attr, format!("`#[{attr_name}]` on a layer field is not supported: the plan is made before `cfg` is evaluated"));
                broken = true;
            }
            n if layer::info(n).is_some() || n == "block" => {
                let new_kind = if n == "block" {
                    block_kind(&field.ty, args, e).map(|k| (k, tokens.clone(), "block".to_string()))
                } else {
                    Some((
                        FieldKind::Layer {
                            attr: n.to_string(),
                            args,
                        },
                        tokens.clone(),
                        n.to_string(),
                    ))
                };
                match &kind {
                    Some((_, _, prev)) => {
                        e.at(
                            attr,
                            format!("field `{name}` has two layer attributes, `#[{prev}]` and `#[{n}]`; a field is one layer, so split it into two fields"),
                        );
                        broken = true;
                    }
                    None => match new_kind {
                        Some(k) => kind = Some(k),
                        None => broken = true,
                    },
                }
            }
            n if PASS_THROUGH.contains(&n) => {}
            n => {
                if let Some(c) = closest(n, attribute_names()) {
                    e.at(
                        attr.path(),
                        format!("unknown layer `{n}`; did you mean `{c}`?"),
                    );
                    reported.push(n.to_string());
                    broken = true;
                } else {
                    foreign.push(attr);
                }
            }
        }
    }
    let Some((kind, anchor, _)) = kind else {
        if broken {
            // Already reported (an attribute we could not read).
        } else if let Some(first) = foreign.first() {
            let n = first.path().to_token_stream().to_string().replace(' ', "");
            e.at(
                first.path(),
                format!("unknown layer `{n}`\n= note: layers are {}", layer_list()),
            );
            reported.push(n);
        } else {
            e.at(
                &ident,
                format!("field `{name}` has no layer attribute: say what it is, e.g. `#[dense(64)]`, `#[conv2d(filters = 32, kernel_size = 3)]` or `#[input(shape = [784])]`"),
            );
        }
        strip(&mut field.attrs, &reported);
        return None;
    };
    strip(&mut field.attrs, &reported);
    if broken {
        return None;
    }
    let (_, repeat) = element_type(&field.ty, e)?;
    let decl = FieldDecl {
        name: name.clone(),
        kind,
        anchor,
        repeat,
        checkpoint,
        recompute_output,
        stage,
        dtype,
        ty: field.ty.clone(),
    };

    check_field(&decl, &ident, in_block, e);
    Some(decl)
}

/// A modifier that takes no arguments (`#[recompute_output]`), given at most once.
fn read_flag(attr: &syn::Attribute, args: &TokenStream, name: &str, seen: bool, e: &mut Errors) {
    let flag = attr
        .path()
        .get_ident()
        .map(|i| i.to_string())
        .unwrap_or_default();
    if !args.is_empty() {
        e.at(attr, format!("`#[{flag}]` takes no arguments"));
    }
    if seen {
        e.at(
            attr,
            format!("`#[{flag}]` is given twice on field `{name}`"),
        );
    }
}

/// `#[recompute_output]` goes on a norm the field's own checkpointing does not cover already.
fn check_recompute_output(decl: &FieldDecl, e: &mut Errors) {
    let Some(tokens) = &decl.recompute_output else {
        return;
    };
    let name = &decl.name;
    let norm = matches!(&decl.kind, FieldKind::Layer { attr, .. } if attr == "layer_norm" || attr == "batch_norm");
    if !norm {
        e.at(tokens, format!("`#[recompute_output]` on `{name}`: only a `layer_norm` or `batch_norm` field can recompute its output from its kept input; to recompute any other field, use `#[checkpoint]`"));
    } else if decl.checkpoint.is_some() {
        e.at(tokens, format!("`#[recompute_output]` on `{name}`, which is `#[checkpoint]`ed: a checkpointed field recomputes its outputs already; keep one"));
    }
}

/// The field-level rules that need the whole field: its type fits its layer, and what an
/// input (or a field named `input` in a block) may not be.
fn check_field(decl: &FieldDecl, ident: &syn::Ident, in_block: bool, e: &mut Errors) {
    let name = &decl.name;
    if let FieldKind::Layer { attr, .. } = &decl.kind {
        check_type(decl, attr, e);
    }
    check_recompute_output(decl, e);
    if let (true, Some((_, t))) = (in_block, &decl.stage) {
        e.at(t, "`#[stage]` goes on the model's fields: a block runs on one stage, the one of the field that holds it");
    }
    if decl.is_input() {
        if in_block {
            e.at(&decl.anchor, "a block cannot declare inputs: it reads `input` (the field before it, or the field named by `from = …` on its `#[block]`)");
        }
        if let Some(cp) = &decl.checkpoint {
            e.at(&cp.tokens, format!("`#[checkpoint]` on input `{name}`: an input is not computed, so there is nothing to recompute"));
        }
        if let Some((d, t)) = &decl.dtype {
            e.at(
                t,
                format!(
                    "`#[{}]` on input `{name}`: an input is stored as its `dtype = …` option",
                    modifier_name(*d)
                ),
            );
        }
        if decl.repeat.is_some() {
            e.at(
                &decl.ty,
                "an input cannot be an array: declare each input as its own field",
            );
        }
    }
    if in_block && name == "input" {
        e.at(
            ident,
            "`input` names the block's input; call this field something else",
        );
    }
}

fn modifier_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "fp16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

fn layer_list() -> String {
    CATALOGUE
        .iter()
        .map(|l| format!("`{}`", l.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `#[stage(k)]`: the stage's number.
fn read_stage(
    attr: &syn::Attribute,
    args: &TokenStream,
    tokens: TokenStream,
    seen: bool,
    e: &mut Errors,
) -> Option<(usize, TokenStream)> {
    if seen {
        e.at(attr, "`#[stage]` is given twice on this field");
    }
    match eval(args, &Env::new()) {
        Ok(Val { v: V::Int(k), .. }) if k >= 0 => Some((k as usize, tokens)),
        _ => {
            e.at(
                attr,
                "`#[stage(k)]` takes the stage's number, from 0: this field and the ones after \
                 it, up to the next `#[stage]`, run on pipeline stage k",
            );
            None
        }
    }
}

fn read_checkpoint(args: TokenStream, tokens: TokenStream, e: &mut Errors) -> Checkpoint {
    let mut segment = None;
    for a in split_args(args, e) {
        match a.name().as_deref() {
            Some("segment") => match eval(&a.value, &Env::new()) {
                Ok(Val { v: V::Int(n), .. }) if n >= 0 => segment = Some(n),
                _ => e.at(&a.value, "`segment` is a number naming the run: `#[checkpoint(segment = 2)]`"),
            },
            _ => e.at(
                &a.tokens,
                "`#[checkpoint]` takes only `segment = N`: consecutive fields with the same segment are recomputed together",
            ),
        }
    }
    Checkpoint { segment, tokens }
}

/// `T` or `[T; N]`: the element type's path and N.
pub fn element_type(ty: &Type, e: &mut Errors) -> Option<(syn::Path, Option<usize>)> {
    match ty {
        Type::Array(a) => {
            let n = match &a.len {
                Expr::Lit(l) => match &l.lit {
                    Lit::Int(i) => i.base10_parse::<usize>().ok(),
                    _ => None,
                },
                _ => None,
            };
            let Some(n) = n else {
                e.at(
                    &a.len,
                    "the repeat count of an array field must be an integer literal (`[Dense; 3]`)",
                );
                return None;
            };
            if n == 0 {
                e.at(
                    &a.len,
                    "an array field repeats its layer at least once: `[T; 1]` or more",
                );
                return None;
            }
            if matches!(*a.elem, Type::Array(_)) {
                e.at(
                    &a.elem,
                    "arrays of arrays are not supported: use one array, or a block",
                );
                return None;
            }
            element_type(&a.elem, e).map(|(p, _)| (p, Some(n)))
        }
        Type::Path(p) if p.qself.is_none() => {
            if let Some(seg) = p.path.segments.last() {
                if !seg.arguments.is_empty() {
                    e.at(
                        &seg.arguments,
                        "layer and block types take no generic arguments",
                    );
                    return None;
                }
            }
            Some((p.path.clone(), None))
        }
        Type::Group(g) => element_type(&g.elem, e),
        _ => {
            e.at(ty, "expected a layer type from `memwise::layers` (`Dense`, `Conv2d` …), a block, or an array of them");
            None
        }
    }
}

fn check_type(decl: &FieldDecl, attr: &str, e: &mut Errors) {
    let expected = layer::info(attr).expect("known layer").handle;
    let mut scratch = Errors::default();
    let Some((path, _)) = element_type(&decl.ty, &mut scratch) else {
        return;
    };
    let found = path
        .segments
        .last()
        .map(|s| s.ident.to_string())
        .unwrap_or_default();
    if found != expected {
        let ty = if decl.repeat.is_some() {
            format!("[{expected}; N]")
        } else {
            expected.to_string()
        };
        e.at(
            &decl.ty,
            format!(
                "field `{}` is a `#[{attr}]` layer, so its type is `{ty}` (from `memwise::layers`), not `{}`",
                decl.name,
                decl.ty.to_token_stream().to_string().replace(" ;", ";").replace("[ ", "[").replace(" ]", "]")
            ),
        );
    }
}

fn block_kind(ty: &Type, args: TokenStream, e: &mut Errors) -> Option<FieldKind> {
    let (path, _) = element_type(ty, e)?;
    let last = path
        .segments
        .last()
        .map(|s| s.ident.to_string())
        .unwrap_or_default();
    if let Some(l) = CATALOGUE.iter().find(|l| l.handle == last) {
        e.at(
            ty,
            format!(
                "`{last}` is a layer, not a block: use `#[{}(…)]` on this field",
                l.name
            ),
        );
        return None;
    }
    let key = path.to_token_stream().to_string().replace(' ', "");
    Some(FieldKind::Block { path, key, args })
}

/// A block's parameter: `filters` or `strides = 1`.
#[derive(Clone)]
pub struct BlockParam {
    pub name: String,
    pub default: Option<Val>,
    pub tokens: TokenStream,
}

/// Reads `#[memwise::block(filters, strides = 1)]`.
pub fn read_block_params(attr: TokenStream, e: &mut Errors) -> Vec<BlockParam> {
    let mut params: Vec<BlockParam> = Vec::new();
    for a in split_args(attr, e) {
        let (name, default) = match &a.name {
            Some(n) => (n.to_string(), e.ok(eval(&a.value, &Env::new()))),
            None => match syn::parse2::<syn::Ident>(a.value.clone()) {
                Ok(id) => (id.to_string(), None),
                Err(_) => {
                    e.at(&a.tokens, "a block parameter is a name with an optional default: `#[memwise::block(filters, strides = 1)]`");
                    continue;
                }
            },
        };
        if name == "from" || name == "input" {
            e.at(
                &a.tokens,
                format!(
                    "`{name}` is reserved for the block's input; name the parameter differently"
                ),
            );
            continue;
        }
        if params.iter().any(|p| p.name == name) {
            e.at(&a.tokens, format!("parameter `{name}` is declared twice"));
            continue;
        }
        params.push(BlockParam {
            name,
            default,
            tokens: a.tokens,
        });
    }
    params
}
