//! Code generation: the model's consts and functions, the runtime form of its spec, the
//! `layers()` handles, and the text of the budget error.
use std::collections::HashMap;

use memwise_plan::advice::{format_bytes, Fixes};
use memwise_plan::{
    DType, LayerKind, LossKind, Metric, ModelSpec, Optimizer, Precision, Reduction, StaticPlan,
};
use proc_macro2::{Literal, TokenStream};
use quote::{format_ident, quote};
use syn::ItemStruct;

use crate::lower::{Handle, Lowered};

fn f32_tokens(x: f32) -> TokenStream {
    if x.is_finite() {
        let lit = Literal::f32_suffixed(x);
        quote!(#lit)
    } else if x.is_nan() {
        quote!(f32::NAN)
    } else if x > 0.0 {
        quote!(f32::INFINITY)
    } else {
        quote!(f32::NEG_INFINITY)
    }
}

fn usize_tokens(x: usize) -> TokenStream {
    let lit = Literal::usize_unsuffixed(x);
    quote!(#lit)
}

fn dtype_tokens(d: DType) -> TokenStream {
    let v = format_ident!("{}", format!("{d:?}"));
    quote!(::memwise::plan::DType::#v)
}

/// The kind as the catalogue writes it (`memwise_plan::layers`), so no layer is named here.
fn kind_tokens(k: &LayerKind) -> TokenStream {
    k.to_rust("::memwise::plan")
        .parse()
        .expect("the layer catalogue writes valid Rust")
}

fn optimizer_tokens(o: &Optimizer) -> TokenStream {
    let p = quote!(::memwise::plan::Optimizer);
    match *o {
        Optimizer::Sgd { lr } => {
            let lr = f32_tokens(lr);
            quote!(#p::Sgd { lr: #lr })
        }
        Optimizer::Momentum {
            lr,
            momentum,
            nesterov,
        } => {
            let (lr, m) = (f32_tokens(lr), f32_tokens(momentum));
            quote!(#p::Momentum { lr: #lr, momentum: #m, nesterov: #nesterov })
        }
        Optimizer::RmsProp {
            lr,
            rho,
            epsilon,
            momentum,
            centered,
        } => {
            let (lr, r, e, m) = (
                f32_tokens(lr),
                f32_tokens(rho),
                f32_tokens(epsilon),
                f32_tokens(momentum),
            );
            quote!(#p::RmsProp { lr: #lr, rho: #r, epsilon: #e, momentum: #m, centered: #centered })
        }
        Optimizer::Adam {
            lr,
            beta_1,
            beta_2,
            epsilon,
        } => {
            let (lr, b1, b2, e) = (
                f32_tokens(lr),
                f32_tokens(beta_1),
                f32_tokens(beta_2),
                f32_tokens(epsilon),
            );
            quote!(#p::Adam { lr: #lr, beta_1: #b1, beta_2: #b2, epsilon: #e })
        }
        Optimizer::AdamW {
            lr,
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
        } => {
            let (lr, b1, b2, e, w) = (
                f32_tokens(lr),
                f32_tokens(beta_1),
                f32_tokens(beta_2),
                f32_tokens(epsilon),
                f32_tokens(weight_decay),
            );
            quote!(#p::AdamW { lr: #lr, beta_1: #b1, beta_2: #b2, epsilon: #e, weight_decay: #w })
        }
    }
}

fn precision_tokens(p: Precision) -> TokenStream {
    let v = format_ident!("{}", format!("{p:?}"));
    quote!(::memwise::plan::Precision::#v)
}

fn spec_tokens(spec: &ModelSpec) -> TokenStream {
    let (name, batch) = (&spec.name, usize_tokens(spec.batch));
    let precision = precision_tokens(spec.precision);
    let optimizer = optimizer_tokens(&spec.optimizer);
    let loss = spec.loss.iter().map(|t| {
        let kind = format_ident!(
            "{}",
            match t.kind {
                LossKind::SparseCategoricalCrossentropy => "SparseCategoricalCrossentropy",
                LossKind::BinaryCrossentropy => "BinaryCrossentropy",
                LossKind::MeanSquaredError => "MeanSquaredError",
                LossKind::KlNormal => "KlNormal",
            }
        );
        let red = format_ident!(
            "{}",
            if t.reduction == Reduction::Mean {
                "Mean"
            } else {
                "SumOverFeatures"
            }
        );
        let (w, inputs) = (f32_tokens(t.weight), &t.inputs);
        quote!(::memwise::plan::LossTerm {
            kind: ::memwise::plan::LossKind::#kind,
            inputs: ::std::vec![#(::std::string::String::from(#inputs)),*],
            weight: #w,
            reduction: ::memwise::plan::Reduction::#red,
        })
    });
    let metrics = spec.metrics.iter().map(|m| {
        let v = format_ident!(
            "{}",
            match m {
                Metric::Accuracy => "Accuracy",
                Metric::BinaryAccuracy => "BinaryAccuracy",
                Metric::MeanSquaredError => "MeanSquaredError",
            }
        );
        quote!(::memwise::plan::Metric::#v)
    });
    let layers = spec.layers.iter().map(|l| {
        let (name, kind, inputs) = (&l.name, kind_tokens(&l.kind), &l.inputs);
        let dtype = match l.dtype {
            Some(d) => {
                let d = dtype_tokens(d);
                quote!(::core::option::Option::Some(#d))
            }
            None => quote!(::core::option::Option::None),
        };
        let checkpoint = match l.checkpoint {
            Some(s) => quote!(::core::option::Option::Some(#s)),
            None => quote!(::core::option::Option::None),
        };
        quote!(::memwise::__private::layer(#name, #kind, &[#(#inputs),*], #dtype, #checkpoint))
    });
    let budget = match spec.budget {
        Some(b) => quote!(::core::option::Option::Some(#b)),
        None => quote!(::core::option::Option::None),
    };
    quote! {
        let mut spec = ::memwise::plan::ModelSpec::new(#name, #batch);
        spec.precision = #precision;
        spec.optimizer = #optimizer;
        spec.loss = ::std::vec![#(#loss),*];
        spec.metrics = ::std::vec![#(#metrics),*];
        spec.layers = ::std::vec![#(#layers),*];
        spec.budget = #budget;
        spec
    }
}

fn handle_tokens(h: &Handle, params: &HashMap<&str, Vec<(u32, &str)>>) -> TokenStream {
    match h {
        Handle::Layer { handle, name } => {
            let ty = format_ident!("{}", handle);
            let ps = params
                .get(name.as_str())
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .map(|(id, n)| quote!(::memwise::layers::Param { id: #id, name: #n }));
            quote!(::memwise::layers::#ty::__new(#name, &[#(#ps),*]))
        }
        Handle::Array(items) => {
            let items = items.iter().map(|i| handle_tokens(i, params));
            quote!([#(#items),*])
        }
        Handle::Block { path, fields } => {
            let fields = fields.iter().map(|f| handle_tokens(f, params));
            quote!(#path::__memwise_new((#(#fields,)*)))
        }
    }
}

/// The struct, its inherent consts and functions, and its `memwise::Model` impl.
pub fn model_items(
    item: &ItemStruct,
    lowered: &Lowered,
    plan: &StaticPlan,
    budget: Option<u64>,
    auto_choice: Option<&str>,
) -> TokenStream {
    let ident = &item.ident;
    let budget_ts = match budget {
        Some(b) => quote!(::core::option::Option::Some(#b)),
        None => quote!(::core::option::Option::None),
    };
    let choice_ts = match auto_choice {
        Some(c) => quote!(::core::option::Option::Some(#c)),
        None => quote!(::core::option::Option::None),
    };
    // `field:` followed by `::path` must not lex as `field::` `:path`.
    let plan_src = plan.to_rust("::memwise::plan");
    let plan_ts: TokenStream = plan_src.parse().expect("the planner writes valid Rust");
    let spec = spec_tokens(&lowered.spec);
    let params_count = plan.params_count;
    let mut params: HashMap<&str, Vec<(u32, &str)>> = HashMap::new();
    for p in plan.params.iter() {
        params
            .entry(p.layer.as_ref())
            .or_default()
            .push((p.id, p.name.as_ref()));
    }
    let fields: Vec<&syn::Ident> = match &item.fields {
        syn::Fields::Named(n) => n.named.iter().filter_map(|f| f.ident.as_ref()).collect(),
        _ => Vec::new(),
    };
    let handles = lowered.handles.iter().map(|h| handle_tokens(h, &params));
    let m = &plan.memory;
    let mem_doc = format!(
        " Memory of one training step at batch {}: {} total — params {}, grads {}, optimizer {}, activations {}, workspace {}, inputs {}.",
        plan.batch,
        format_bytes(m.total),
        format_bytes(m.params),
        format_bytes(m.grads),
        format_bytes(m.optimizer),
        format_bytes(m.activations_peak),
        format_bytes(m.workspace_peak),
        format_bytes(m.inputs)
    );
    let plan_doc = format!(
        " The static plan of one training step ({} steps, {} arena tensors in {}), computed by the `#[memwise::model]` macro.",
        plan.steps.len(),
        plan.tensors.len(),
        format_bytes(plan.arena_bytes)
    );
    quote! {
        #item

        impl #ident {
            #[doc = #plan_doc]
            pub const PLAN: ::memwise::plan::StaticPlan = #plan_ts;
            #[doc = #mem_doc]
            pub const MEMORY: ::memwise::plan::MemoryReport = Self::PLAN.memory;
            /// Number of parameters (trainable and not).
            pub const PARAMS: u64 = #params_count;

            /// The model as declared, built at run time.
            pub fn spec() -> ::memwise::plan::ModelSpec {
                #spec
            }

            /// Plans the same model at another batch size.
            pub fn plan_for_batch(batch: usize) -> ::core::result::Result<::memwise::plan::StaticPlan, ::memwise::plan::PlanError> {
                ::memwise::plan::plan(&Self::spec().with_batch(batch))
            }

            /// A Keras-like table of the layers and the memory of one training step.
            pub fn summary() -> ::std::string::String {
                <Self as ::memwise::Model>::summary()
            }

            /// The layer handles: every field's layer name and parameter ids in `PLAN`.
            pub const fn layers() -> Self {
                Self { #(#fields: #handles),* }
            }

            // Reading every handle once keeps `dead_code` quiet about fields only the
            // runtime reads.
            #[doc(hidden)]
            #[allow(dead_code)]
            fn __memwise_touch(&self) {
                let _ = (#(&self.#fields,)*);
            }
        }

        impl ::memwise::Model for #ident {
            const PLAN: ::memwise::plan::StaticPlan = <#ident>::PLAN;
            const MEMORY: ::memwise::plan::MemoryReport = <#ident>::MEMORY;
            const PARAMS: u64 = <#ident>::PARAMS;
            const BUDGET: ::core::option::Option<u64> = #budget_ts;
            const AUTO_CHECKPOINT_CHOICE: ::core::option::Option<&'static str> = #choice_ts;
            fn spec() -> ::memwise::plan::ModelSpec {
                <#ident>::spec()
            }
            fn layers() -> Self {
                <#ident>::layers()
            }
        }
    }
}

/// What a model whose attributes failed still gets beside its errors: the struct and every
/// item the macro would have added (an empty plan, zero memory), so that `M::new(&device)`,
/// `M::MEMORY` and the rest type-check and one mistake reads as one error, not one per use.
pub fn stub_items(item: &ItemStruct, errors: TokenStream) -> TokenStream {
    let ident = &item.ident;
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    quote! {
        #item
        #errors

        #[allow(dead_code)]
        impl #impl_generics #ident #ty_generics #where_clause {
            pub const PLAN: ::memwise::plan::StaticPlan = ::memwise::plan::StaticPlan::EMPTY;
            pub const MEMORY: ::memwise::plan::MemoryReport = Self::PLAN.memory;
            pub const PARAMS: u64 = 0;
            pub const MAX_BATCH: usize = 0;
            pub const AUTO_CHECKPOINT: &'static str = "";
            pub fn spec() -> ::memwise::plan::ModelSpec {
                ::core::unreachable!("the model did not compile")
            }
            pub fn plan_for_batch(_batch: usize) -> ::core::result::Result<::memwise::plan::StaticPlan, ::memwise::plan::PlanError> {
                ::core::unreachable!("the model did not compile")
            }
            pub fn summary() -> ::std::string::String {
                ::core::unreachable!("the model did not compile")
            }
            pub fn layers() -> Self {
                ::core::unreachable!("the model did not compile")
            }
        }

        impl #impl_generics ::memwise::Model for #ident #ty_generics #where_clause {
            const PLAN: ::memwise::plan::StaticPlan = ::memwise::plan::StaticPlan::EMPTY;
            const MEMORY: ::memwise::plan::MemoryReport = ::memwise::plan::StaticPlan::EMPTY.memory;
            const PARAMS: u64 = 0;
            fn spec() -> ::memwise::plan::ModelSpec {
                ::core::unreachable!("the model did not compile")
            }
            fn layers() -> Self {
                ::core::unreachable!("the model did not compile")
            }
        }
    }
}

/// How to write the checkpoint fix: plain `#[checkpoint]` on every field when no two runs
/// touch (each run of marked fields is one segment), numbered segments when some do.
/// Labels are `index:name` (the field's index in the struct), runs in declaration order.
fn checkpoint_advice(runs: &[Vec<String>], first_segment: i64) -> String {
    let parse = |u: &String| {
        u.split_once(':')
            .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.to_string())))
    };
    let runs: Vec<Vec<(usize, String)>> = runs
        .iter()
        .map(|r| r.iter().filter_map(parse).collect())
        .collect();
    let touch = runs.windows(2).any(|w| match (w[0].last(), w[1].first()) {
        (Some(a), Some(b)) => b.0 == a.0 + 1,
        _ => false,
    });
    let names = |run: &[(usize, String)]| {
        let n: Vec<String> = run.iter().map(|(_, n)| format!("`{n}`")).collect();
        if n.len() > 8 {
            format!(
                "{}, … {} (all {} fields)",
                n[..3].join(", "),
                n[n.len() - 1],
                n.len()
            )
        } else {
            n.join(", ")
        }
    };
    if touch {
        runs.iter()
            .enumerate()
            .map(|(r, run)| {
                format!(
                    "`#[checkpoint(segment = {})]` on {}",
                    first_segment + r as i64,
                    names(run)
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        let all: Vec<(usize, String)> = runs.into_iter().flatten().collect();
        format!("`#[checkpoint]` on {}", names(&all))
    }
}

/// The budget error's text: the headline, the breakdown, and the planned fixes.
pub fn budget_message(
    spec: &ModelSpec,
    plan: &StaticPlan,
    fixes: &Fixes,
    batch_one: Option<u64>,
    first_segment: i64,
) -> String {
    let m = &plan.memory;
    let (need, budget) = (m.total, fixes.budget);
    let mut s = format!(
        "model `{}` needs {} but the budget is {} ({} over)",
        spec.name,
        format_bytes(need),
        format_bytes(budget),
        format_bytes(need - budget)
    );
    let packing = m
        .arena
        .saturating_sub(m.activations_peak + m.workspace_peak + m.inputs);
    let packing = if packing > 0 {
        format!(" + arena packing {}", format_bytes(packing))
    } else {
        String::new()
    };
    s += &format!(
        "\n= note: at batch {}, {}: params {} + grads {} + optimizer {} + activations {} + workspace {} + inputs {}{packing} = {} total, budget {}",
        spec.batch,
        spec.precision.name(),
        format_bytes(m.params),
        format_bytes(m.grads),
        format_bytes(m.optimizer),
        format_bytes(m.activations_peak),
        format_bytes(m.workspace_peak),
        format_bytes(m.inputs),
        format_bytes(need),
        format_bytes(budget),
    );
    let mut fits = Vec::new();
    let mut not = Vec::new();
    match fixes.max_batch {
        Some((b, t)) => fits.push(format!(
            "`batch = {b}` (the largest batch that fits): {}",
            format_bytes(t)
        )),
        None => not.push(match batch_one {
            Some(t) => format!(
                "a smaller batch: even `batch = 1` needs {}",
                format_bytes(t)
            ),
            None => "a smaller batch: no batch size fits".to_string(),
        }),
    }
    if let Some(p) = &fixes.precision {
        let name = p.precision.name();
        if p.total <= budget {
            fits.push(format!("`precision = {name}`: {}", format_bytes(p.total)));
        } else {
            let with = match p.max_batch {
                Some(b) => format!(" (with it, `batch = {b}` fits)"),
                None => String::new(),
            };
            not.push(format!(
                "`precision = {name}` still needs {}{with}",
                format_bytes(p.total)
            ));
        }
    }
    let forward: u64 = m.layers.iter().map(|l| l.forward_flops).sum();
    match (&fixes.checkpoint, fixes.checkpoint_best) {
        (Some(c), _) => {
            let share = if forward > 0 {
                format!(
                    ", recomputing {:.0}% of the forward pass",
                    100.0 * c.recompute_flops as f64 / forward as f64
                )
            } else {
                String::new()
            };
            fits.push(format!(
                "{}: {}{share}",
                checkpoint_advice(&c.runs, first_segment),
                format_bytes(c.total)
            ))
        }
        (None, Some(t)) => not.push(format!(
            "checkpointing: the best placement tried still needs {}",
            format_bytes(t)
        )),
        (None, None) => {}
    }
    if !fits.is_empty() {
        s += "\n= help: each of these fits (planned):";
        for f in &fits {
            s += &format!("\n        - {f}");
        }
    }
    if !not.is_empty() {
        s += if fits.is_empty() {
            "\n= help: no single change fits:"
        } else {
            "\n= note: these do not fit alone:"
        };
        for f in &not {
            s += &format!("\n        - {f}");
        }
    }
    s
}
