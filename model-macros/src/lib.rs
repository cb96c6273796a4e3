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
    let mut e = Errors::default();
    let mut st: ItemStruct = match syn::parse2(item.clone()) {
        Ok(s) => s,
        Err(_) => {
            e.push(syn::Error::new(
                item_name_span(&item),
                "`#[memwise::model]` goes on a struct with named fields, one per layer: `struct Net { #[dense(10)] logits: Dense }`",
            ));
            return e.to_compile_errors();
        }
    };
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

    let name = st.ident.to_string();
    let mut lowered = lower::lower(&name, &args, &decls, &blocks, &mut e);
    if !e.is_empty() || lowered.incomplete {
        // An incomplete model uses a block with errors, reported at the block.
        return emit::stub_items(&st, e.to_compile_errors());
    }
    // `checkpoint = auto`: the solver chooses the segments that fit the budget with the least
    // recomputation; the model is then exactly as if the user had written them.
    let mut auto_choice = None;
    if let Some(tokens) = &args.checkpoint_auto {
        match &args.budget {
            None => {
                let err = syn::Error::new_spanned(
                    tokens,
                    "`checkpoint = auto` chooses the checkpoints that fit the budget: add `budget = \"…\"`",
                );
                return emit::stub_items(&st, err.to_compile_error());
            }
            Some((budget, btokens)) => {
                match memwise_plan::checkpoint::solve(&lowered.spec, *budget) {
                    Ok(choice) => {
                        lowered.spec = choice.apply(&lowered.spec);
                        auto_choice = Some(choice.to_string());
                    }
                    Err(pe) => {
                        use memwise_plan::checkpoint::{max_batch_with, Policy};
                        let help = match max_batch_with(&lowered.spec, *budget, Policy::AutoCheckpoint) {
                            Some(b) => format!("\n= help: `batch = {b}` fits with `checkpoint = auto` (the largest batch that does)"),
                            None => "\n= note: not even batch 1 fits with `checkpoint = auto`".to_string(),
                        };
                        let err = syn::Error::new_spanned(
                            btokens,
                            format!("`checkpoint = auto`: {}{help}", pe.message),
                        );
                        return emit::stub_items(&st, err.to_compile_error());
                    }
                }
            }
        }
    }
    let plan = match memwise_plan::plan(&lowered.spec) {
        Ok(p) => p,
        Err(pe) => {
            plan_error(&pe, &st, &args, &lowered, &decls, &mut e);
            return emit::stub_items(&st, e.to_compile_errors());
        }
    };
    let budget = args.budget.as_ref().map(|(b, _)| *b);
    let mut out = emit::model_items(&st, &lowered, &plan, budget, auto_choice.as_deref());
    if let Some(text) = &auto_choice {
        let ident = &st.ident;
        out.extend(quote! {
            impl #ident {
                /// What `checkpoint = auto` chose, and what it costs.
                pub const AUTO_CHECKPOINT: &'static str = #text;
            }
        });
    }
    if let Some((budget, tokens)) = &args.budget {
        // The largest batch that fits the budget with the model's own policy, a const.
        let policy = if auto_choice.is_some() {
            memwise_plan::checkpoint::Policy::AutoCheckpoint
        } else {
            memwise_plan::checkpoint::Policy::Plain
        };
        let max =
            memwise_plan::checkpoint::max_batch_with(&lowered.spec, *budget, policy).unwrap_or(0);
        let ident = &st.ident;
        let doc = format!(
            " The largest batch whose training step fits the declared budget ({}), with {} (0: not even batch 1).",
            memwise_plan::advice::format_bytes(*budget),
            if auto_choice.is_some() { "the checkpoints `checkpoint = auto` chooses at each batch" } else { "the model as declared" }
        );
        out.extend(quote! {
            impl #ident {
                #[doc = #doc]
                pub const MAX_BATCH: usize = #max;
            }
        });
        if plan.memory.total > *budget {
            let message = budget_error(&name, &args, &decls, &blocks, &lowered, &plan, *budget);
            out.extend(syn::Error::new_spanned(tokens, message).to_compile_error());
        }
    }
    out
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
    match (field, &args.loss_tokens) {
        (Some(f), _) => e.at(&f.anchor, message),
        (None, Some(loss)) if about_loss => e.at(loss, message),
        _ => e.at(&st.ident, message),
    }
}

#[allow(clippy::too_many_arguments)]
fn budget_error(
    name: &str,
    args: &model_args::ModelArgs,
    decls: &[FieldDecl],
    blocks: &HashMap<String, BlockDef>,
    lowered: &lower::Lowered,
    plan: &memwise_plan::StaticPlan,
    budget: u64,
) -> String {
    use memwise_plan::advice::{fixes_with, total, CheckpointUnit};
    // Checkpoint units are the fields a user can annotate: every non-input field, each as its
    // own segment (a checkpointed block: one segment per instance). Labels carry the field's
    // index so the advice can tell adjacent fields apart.
    let candidates: Vec<usize> = (0..decls.len())
        .filter(|&i| !decls[i].is_input() && decls[i].checkpoint.is_none())
        .collect();
    let units: Vec<CheckpointUnit> = candidates
        .iter()
        .map(|&i| CheckpointUnit {
            label: format!("{i}:{}", decls[i].name),
            saved_bytes: plan
                .memory
                .layers
                .iter()
                .filter(|l| {
                    lowered
                        .spec
                        .layers
                        .iter()
                        .position(|x| x.name == l.name)
                        .is_some_and(|k| lowered.owner[k] == i)
                })
                .map(|l| l.saved_bytes)
                .sum(),
        })
        .collect();
    // Re-lowered exactly as the advice will tell the user to write it: plain `#[checkpoint]`
    // when the runs are apart (a run of marked fields is one segment), numbered segments
    // when two runs touch.
    let base = decls
        .iter()
        .filter_map(|f| f.checkpoint.as_ref()?.segment)
        .max()
        .unwrap_or(0)
        + 1;
    let apply = |runs: &[Vec<usize>]| {
        let mut d = decls.to_vec();
        let adjacent = runs_touch(runs, &candidates);
        for (r, run) in runs.iter().enumerate() {
            for &u in run {
                let segment = adjacent.then_some(base + r as i64);
                d[candidates[u]].checkpoint = Some(fields::Checkpoint {
                    segment,
                    tokens: TokenStream2::new(),
                });
            }
        }
        lower::lower(name, args, &d, blocks, &mut Errors::default()).spec
    };
    let fixes = fixes_with(&lowered.spec, budget, &units, &apply);
    let batch_one = total(&lowered.spec.with_batch(1));
    emit::budget_message(&lowered.spec, plan, &fixes, batch_one, base)
}

/// Two runs of checkpointed fields are adjacent (plain `#[checkpoint]` would merge them).
/// `runs` hold indices into `fields`; labels of the advice carry the same field indices.
fn runs_touch(runs: &[Vec<usize>], fields: &[usize]) -> bool {
    runs.windows(2).any(|w| match (w[0].last(), w[1].first()) {
        (Some(&a), Some(&b)) => fields[b] == fields[a] + 1,
        _ => false,
    })
}

fn expand_block(attr: TokenStream2, item: TokenStream2) -> TokenStream2 {
    let mut e = Errors::default();
    let mut st: ItemStruct = match syn::parse2(item.clone()) {
        Ok(s) => s,
        Err(_) => {
            e.push(syn::Error::new(
                item_name_span(&item),
                "`#[memwise::block]` goes on a struct with named fields, one per layer",
            ));
            return e.to_compile_errors();
        }
    };
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
