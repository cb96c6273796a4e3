//! `#[memwise::model]` and `#[memwise::block]`: read an annotated struct into a planner
//! `ModelSpec`, plan it at compile time, and emit the plan as consts — or a spanned error.
//!
//! The macro stays thin (serde_derive-style): syntax in, `ModelSpec` out, and everything
//! else — shapes, memory, the fixes for an exceeded budget — is the planner's.
//! Use these macros through the `memwise` crate, which documents every attribute.
//!
//! Blocks used as field types are defined in other items, which a proc macro cannot read.
//! So `#[memwise::block]` also emits a `macro_rules!` carrying the block's own tokens; the
//! model macro calls it with its state, and the block's macro calls back
//! `::memwise::__model_continue!` with its definition appended — once per block type.

mod diag;
mod emit;
mod fields;
mod layer;
mod lower;
mod model_args;
mod value;

use std::collections::HashMap;

use proc_macro::TokenStream;
use proc_macro2::{Delimiter, Span, TokenStream as TokenStream2, TokenTree};
use quote::{format_ident, quote, ToTokens};
use syn::ItemStruct;

use diag::Errors;
use fields::{FieldDecl, FieldKind};
use lower::BlockDef;
use memwise_plan::advice::{Annotation, CheckpointUnit, UserCheckpoints};
use memwise_plan::{CompileError, CompileOptions};

/// Declares a model: see the `memwise` crate's documentation of `model`.
#[proc_macro_attribute]
pub fn model(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand_model(attr.into(), item.into(), Vec::new()).into()
}

/// Declares a reusable block of layers: see the `memwise` crate's documentation of `block`.
#[proc_macro_attribute]
pub fn block(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand_block(attr.into(), item.into()).into()
}

/// The facade's layer handle types, from the planner's layer catalogue:
/// `__layer_handles!(callback)` expands to `callback! { #[doc = "…"] Dense = "dense"; … }`.
#[doc(hidden)]
#[proc_macro]
pub fn __layer_handles(input: TokenStream) -> TokenStream {
    layer::handle_types(input.into()).into()
}

/// The reference table of the layer attributes, from the layer catalogue, as a string
/// literal (for `#[doc = …]`).
#[doc(hidden)]
#[proc_macro]
pub fn __layer_docs(_: TokenStream) -> TokenStream {
    layer::docs_table().into()
}

/// The model macro's continuation after a block's `macro_rules!` handed over its definition.
/// Input: `{attr} {item} {("key" {def})*} "key" {def}`.
#[doc(hidden)]
#[proc_macro]
pub fn __model_continue(input: TokenStream) -> TokenStream {
    let tts: Vec<TokenTree> = TokenStream2::from(input).into_iter().collect();
    let group = |i: usize| match tts.get(i) {
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Brace => Some(g.stream()),
        _ => None,
    };
    let (Some(attr), Some(item), Some(collected_ts)) = (group(0), group(1), group(2)) else {
        return quote!(::core::compile_error!("memwise: malformed internal macro call");).into();
    };
    let mut collected = pairs(collected_ts);
    if let (Some(TokenTree::Literal(key)), Some(def)) = (tts.get(3), group(4)) {
        collected.push((unquote(&key.to_string()), def));
    }
    expand_model(attr, item, collected).into()
}

/// The span of an item's name (`enum Net` → `Net`), for "this must be a struct".
fn item_name_span(item: &TokenStream2) -> Span {
    let ident = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Enum(x)) => Some(x.ident),
        Ok(syn::Item::Union(x)) => Some(x.ident),
        Ok(syn::Item::Fn(x)) => Some(x.sig.ident),
        Ok(syn::Item::Type(x)) => Some(x.ident),
        Ok(syn::Item::Trait(x)) => Some(x.ident),
        _ => None,
    };
    ident.map_or_else(Span::call_site, |i| i.span())
}

/// The struct a model or block attribute is on, or the error `message` on the item's name.
fn parse_struct(item: &TokenStream2, message: &str) -> Result<ItemStruct, TokenStream2> {
    syn::parse2(item.clone())
        .map_err(|_| syn::Error::new(item_name_span(item), message).to_compile_error())
}

fn unquote(s: &str) -> String {
    s.trim_matches('"').to_string()
}

fn pairs(ts: TokenStream2) -> Vec<(String, TokenStream2)> {
    let tts: Vec<TokenTree> = ts.into_iter().collect();
    tts.chunks(2)
        .filter_map(|c| match c {
            [TokenTree::Literal(k), TokenTree::Group(g)] => {
                Some((unquote(&k.to_string()), g.stream()))
            }
            _ => None,
        })
        .collect()
}

/// Reads a block's definition as its macro hands it over: `valid (attr) struct …`.
fn read_block_def(def: TokenStream2) -> Option<BlockDef> {
    let tts: Vec<TokenTree> = def.into_iter().collect();
    let valid = matches!(tts.first(), Some(TokenTree::Ident(i)) if i == "true");
    let attr = match tts.get(1) {
        Some(TokenTree::Group(g)) => g.stream(),
        _ => return None,
    };
    let mut item: ItemStruct = syn::parse2(tts[2..].iter().cloned().collect()).ok()?;
    // Errors in the definition were reported where it is declared.
    let mut ignored = Errors::default();
    let params = fields::read_block_params(attr, &mut ignored);
    let fields = fields::read_struct(&mut item, "block", &mut ignored);
    Some(BlockDef {
        name: item.ident.to_string(),
        params,
        fields,
        valid: valid && ignored.is_empty(),
    })
}

fn block_keys(decls: &[FieldDecl]) -> impl Iterator<Item = (&String, &syn::Path)> {
    decls.iter().filter_map(|d| match &d.kind {
        FieldKind::Block { key, path, .. } => Some((key, path)),
        _ => None,
    })
}

fn expand_model(
    attr: TokenStream2,
    item: TokenStream2,
    collected: Vec<(String, TokenStream2)>,
) -> TokenStream2 {
    let mut st = match parse_struct(
        &item,
        "`#[memwise::model]` goes on a struct with named fields, one per layer: `struct Net { #[dense(10)] logits: Dense }`",
    ) {
        Ok(st) => st,
        Err(errors) => return errors,
    };
    let mut e = Errors::default();
    let args = model_args::parse(attr.clone(), &mut e);
    let decls = fields::read_struct(&mut st, "model", &mut e);

    let mut blocks: HashMap<String, BlockDef> = HashMap::new();
    for (key, def) in &collected {
        if let Some(d) = read_block_def(def.clone()) {
            blocks.insert(key.clone(), d);
        }
    }
    // The first block type not yet collected, in the model or inside a collected block.
    let missing = block_keys(&decls)
        .chain(blocks.values().flat_map(|b| block_keys(&b.fields)))
        .find(|(k, _)| !blocks.contains_key(*k) && !collected.iter().any(|(c, _)| c == *k))
        .map(|(k, p)| (k.clone(), p.clone()));
    if let Some((key, path)) = missing {
        if !e.is_empty() {
            return emit::stub_items(&st, e.to_compile_errors());
        }
        let done = collected.iter().map(|(k, d)| quote!(#k { #d }));
        return quote!(#path! { { #attr } { #item } { #(#done)* } #key });
    }
    if !e.is_empty() {
        return emit::stub_items(&st, e.to_compile_errors());
    }

    compile_model(&st, &args, &decls, &blocks)
}

/// Lowers a model whose attributes parsed, compiles it with the planner, and emits its items
/// with the planner's errors on their spans.
fn compile_model(
    st: &ItemStruct,
    args: &model_args::ModelArgs,
    decls: &[FieldDecl],
    blocks: &HashMap<String, BlockDef>,
) -> TokenStream2 {
    let mut e = Errors::default();
    let name = st.ident.to_string();
    let lowered = lower::lower(&name, args, decls, blocks, &mut e);
    if !e.is_empty() || lowered.incomplete {
        // An incomplete model uses a block with errors, reported at the block.
        return emit::stub_items(st, e.to_compile_errors());
    }
    // The budget error's checkpoint fix is written on fields: the spec it plans is the one
    // these fields lower to with the annotations the fix tells the user to write.
    let relower =
        |d: &[FieldDecl]| lower::lower(&name, args, d, blocks, &mut Errors::default()).spec;
    let apply =
        |runs: &[Vec<usize>], annotation: Annotation| annotate(decls, runs, annotation, &relower);
    let checkpoints = user_checkpoints(decls, &lowered, &apply);
    let options = CompileOptions {
        budget: args.budget.as_ref().map(|(b, _)| *b),
        auto_checkpoint: args.checkpoint_auto.is_some(),
        checkpoints: Some(&checkpoints),
        stages: args.pipeline.stages.as_ref().map(|(s, _)| *s),
    };
    match memwise_plan::compile(&lowered.spec, &options) {
        Ok(compiled) => {
            let mut out = emit::model_items(st, &lowered.handles, &compiled);
            let over = compiled.budget.as_ref().and_then(|v| v.over.as_ref());
            if let (Some(over), Some((_, tokens))) = (over, &args.budget) {
                out.extend(syn::Error::new_spanned(tokens, &over.message).to_compile_error());
            }
            out
        }
        Err(err) => {
            let at = |tokens: Option<&TokenStream2>| {
                let tokens = tokens
                    .cloned()
                    .unwrap_or_else(|| st.ident.to_token_stream());
                syn::Error::new_spanned(tokens, err.to_string()).to_compile_error()
            };
            let errors = match &err {
                CompileError::Plan(pe) => {
                    plan_error(pe, st, args, &lowered, decls, &mut e);
                    e.to_compile_errors()
                }
                CompileError::AutoCheckpointWithoutBudget => at(args.checkpoint_auto.as_ref()),
                CompileError::AutoStagesWithoutBudget => {
                    at(args.pipeline.stages.as_ref().map(|(_, t)| t))
                }
                CompileError::AutoCheckpointOverBudget { .. } => {
                    at(args.budget.as_ref().map(|(_, t)| t))
                }
            };
            emit::stub_items(st, errors)
        }
    }
}

/// Puts a planner error on the field it names (the layer attribute, or the `#[block]` of
/// the block instance the layer is in).
fn plan_error(
    pe: &memwise_plan::PlanError,
    st: &ItemStruct,
    args: &model_args::ModelArgs,
    lowered: &lower::Lowered,
    decls: &[FieldDecl],
    e: &mut Errors,
) {
    let field = pe
        .layer
        .as_ref()
        .and_then(|l| lowered.spec.layers.iter().position(|x| &x.name == l))
        .map(|i| &decls[lowered.owner[i]]);
    let mut message = pe.message.clone();
    if let (Some(layer), Some(f)) = (&pe.layer, field) {
        if *layer != f.name && !message.contains(&format!("`{layer}`")) {
            message = format!("layer `{layer}`: {message}");
        }
    }
    for r in &pe.related {
        if !message.contains(&format!("`{r}`")) {
            message += &format!("\n= note: see field `{r}`");
        }
    }
    let about_loss = pe.layer.is_none()
        && (message.contains("loss")
            || args
                .loss
                .iter()
                .any(|t| message.contains(t.term.kind.name())));
    let pipeline = [
        &args.pipeline.micro_batches.as_ref().map(|m| &m.1),
        &args.pipeline.stages.as_ref().map(|s| &s.1),
    ];
    let about_pipeline = pe.layer.is_none() && message.contains("micro-batch");
    match (field, &args.loss_tokens) {
        (Some(f), _) => e.at(&f.anchor, message),
        (None, Some(loss)) if about_loss => e.at(loss, message),
        (None, _) if about_pipeline && pipeline.iter().any(|t| t.is_some()) => {
            let tokens = pipeline.iter().find_map(|t| **t).expect("one is given");
            e.at(tokens, message)
        }
        _ => e.at(&st.ident, message),
    }
}

/// The fields a user can checkpoint with one annotation: every non-input field not already
/// checkpointed (a checkpointed block: one segment per instance), with the spec layers it
/// lowers to, at its place among the fields.
fn user_checkpoints<'a>(
    decls: &[FieldDecl],
    lowered: &lower::Lowered,
    apply: &'a dyn Fn(&[Vec<usize>], Annotation) -> memwise_plan::ModelSpec,
) -> UserCheckpoints<'a> {
    let units = candidates(decls)
        .map(|i| CheckpointUnit {
            label: decls[i].name.clone(),
            position: i,
            layers: lowered
                .spec
                .layers
                .iter()
                .zip(&lowered.owner)
                .filter(|&(_, &owner)| owner == i)
                .map(|(l, _)| l.name.clone())
                .collect(),
        })
        .collect();
    // Numbered segments go above any the user wrote.
    let first_segment = decls
        .iter()
        .filter_map(|f| f.checkpoint.as_ref()?.segment)
        .max()
        .unwrap_or(0)
        + 1;
    UserCheckpoints {
        units,
        first_segment,
        apply,
    }
}

/// Indices of the fields a checkpoint fix may annotate.
fn candidates(decls: &[FieldDecl]) -> impl Iterator<Item = usize> + '_ {
    (0..decls.len()).filter(|&i| !decls[i].is_input() && decls[i].checkpoint.is_none())
}

/// The spec of the model with `runs` of [`candidates`] annotated as the fix writes them.
fn annotate(
    decls: &[FieldDecl],
    runs: &[Vec<usize>],
    annotation: Annotation,
    relower: &dyn Fn(&[FieldDecl]) -> memwise_plan::ModelSpec,
) -> memwise_plan::ModelSpec {
    let fields: Vec<usize> = candidates(decls).collect();
    let mut d = decls.to_vec();
    for (r, run) in runs.iter().enumerate() {
        let segment = match annotation {
            Annotation::Plain => None,
            Annotation::Numbered { first } => Some(first + r as i64),
        };
        for &u in run {
            d[fields[u]].checkpoint = Some(fields::Checkpoint {
                segment,
                tokens: TokenStream2::new(),
            });
        }
    }
    relower(&d)
}

fn expand_block(attr: TokenStream2, item: TokenStream2) -> TokenStream2 {
    let mut st = match parse_struct(
        &item,
        "`#[memwise::block]` goes on a struct with named fields, one per layer",
    ) {
        Ok(st) => st,
        Err(errors) => return errors,
    };
    let mut e = Errors::default();
    let params = fields::read_block_params(attr.clone(), &mut e);
    let decls = fields::read_struct(&mut st, "block", &mut e);
    let def = BlockDef {
        name: st.ident.to_string(),
        params,
        fields: decls,
        valid: true,
    };
    if e.is_empty() {
        lower::check_block(&def, &mut e);
    }
    let valid = e.is_empty();
    let ident = &st.ident;
    let macro_name = format_ident!("__memwise_block_{}", ident);
    let valid_tok = format_ident!("{}", if valid { "true" } else { "false" });
    let (names, types): (Vec<&syn::Ident>, Vec<&syn::Type>) = match &st.fields {
        syn::Fields::Named(n) => n
            .named
            .iter()
            .filter_map(|f| Some((f.ident.as_ref()?, &f.ty)))
            .unzip(),
        _ => (Vec::new(), Vec::new()),
    };
    let ctor = (!names.is_empty() && st.generics.params.is_empty()).then(|| {
        quote! {
            impl #ident {
                #[doc(hidden)]
                pub const fn __memwise_new(fields: (#(#types,)*)) -> Self {
                    let (#(#names,)*) = fields;
                    Self { #(#names),* }
                }
                #[doc(hidden)]
                #[allow(dead_code)]
                fn __memwise_touch(&self) {
                    let _ = (#(&self.#names,)*);
                }
            }
        }
    });
    let errors = e.to_compile_errors();
    let _ = item.to_token_stream();
    quote! {
        #st
        #ctor
        #[doc(hidden)]
        #[allow(unused_macros)]
        macro_rules! #macro_name {
            ($($state:tt)*) => {
                ::memwise::__model_continue! { $($state)* { #valid_tok (#attr) #item } }
            };
        }
        #[doc(hidden)]
        #[allow(unused_imports)]
        pub(crate) use #macro_name as #ident;
        #errors
    }
}
