//! Code generation: the model's consts and functions (the plan and the spec are the
//! planner's own Rust writer's output) and the `layers()` handles.
use std::collections::HashMap;

use memwise_plan::advice::format_bytes;
use memwise_plan::checkpoint::Policy;
use memwise_plan::{Compiled, StaticPlan};
use proc_macro2::TokenStream;
use quote::{format_ident, quote, ToTokens};
use syn::ItemStruct;

use crate::lower::Handle;

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

/// Parses Rust source the planner wrote.
fn planner_rust(source: String) -> TokenStream {
    source.parse().expect("the planner writes valid Rust")
}

/// `Some(value)` or `None`, as tokens.
fn option_tokens<T: ToTokens>(x: Option<T>) -> TokenStream {
    match x {
        Some(x) => quote!(::core::option::Option::Some(#x)),
        None => quote!(::core::option::Option::None),
    }
}

/// The struct, its inherent consts and functions, and its `memwise::Model` impl.
pub fn model_items(item: &ItemStruct, handles: &[Handle], compiled: &Compiled) -> TokenStream {
    let ident = &item.ident;
    let plan = &compiled.plan;
    let budget = compiled.budget.as_ref();
    let auto_text = compiled.auto_checkpoint.as_ref().map(|c| c.to_string());
    let budget_ts = option_tokens(budget.map(|v| v.budget));
    let choice_ts = option_tokens(auto_text.as_deref());
    let plan_ts = planner_rust(plan.to_rust("::memwise::plan"));
    let spec_ts = planner_rust(compiled.spec.to_rust("::memwise::plan"));
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
    let handles = handles.iter().map(|h| handle_tokens(h, &params));
    let (plan_doc, mem_doc) = plan_docs(plan);
    let auto_const = auto_text.map(|text| {
        quote! {
            impl #ident {
                /// What `checkpoint = auto` chose, and what it costs.
                pub const AUTO_CHECKPOINT: &'static str = #text;
            }
        }
    });
    let max_batch_const = budget.map(|v| {
        let doc = format!(
            " The largest batch whose training step fits the declared budget ({}), with {} (0: not even batch 1).",
            format_bytes(v.budget),
            match v.policy {
                Policy::AutoCheckpoint => "the checkpoints `checkpoint = auto` chooses at each batch",
                _ => "the model as declared",
            }
        );
        let max = v.max_batch.unwrap_or(0);
        quote! {
            impl #ident {
                #[doc = #doc]
                pub const MAX_BATCH: usize = #max;
            }
        }
    });
    let stages = compiled.pipeline.as_ref().map(|pp| stage_consts(ident, pp));
    let stages_ts = match &stages {
        Some(_) => quote!(<#ident>::STAGES),
        None => quote!(&[]),
    };
    quote! {
        #item

        #stages

        impl #ident {
            #[doc = #plan_doc]
            pub const PLAN: ::memwise::plan::StaticPlan = #plan_ts;
            #[doc = #mem_doc]
            pub const MEMORY: ::memwise::plan::MemoryReport = Self::PLAN.memory;
            /// Number of parameters (trainable and not).
            pub const PARAMS: u64 = #params_count;

            /// The model as declared, built at run time.
            pub fn spec() -> ::memwise::plan::ModelSpec {
                #spec_ts
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
            const STAGES: &'static [::memwise::plan::StaticPlan] = #stages_ts;
            fn spec() -> ::memwise::plan::ModelSpec {
                <#ident>::spec()
            }
            fn layers() -> Self {
                <#ident>::layers()
            }
        }

        #auto_const
        #max_batch_const
    }
}

/// A split model's consts: every stage's plan and memory, the largest stage, the bubble.
fn stage_consts(ident: &syn::Ident, pp: &memwise_plan::stage::PipelinePlan) -> TokenStream {
    let plans = pp
        .stages
        .iter()
        .map(|s| planner_rust(s.to_rust("::memwise::plan")));
    let memories = pp
        .stages
        .iter()
        .map(|s| planner_rust(s.memory.to_rust("::memwise::plan")));
    let n = pp.stages.len();
    let (largest, largest_bytes) = pp.largest_stage();
    let bubble = pp.bubble_fraction();
    let m = pp.pipeline.micro_batches;
    let schedule = pp.pipeline.schedule.name();
    let stages_doc = format!(
        " Every pipeline stage's plan, stage 0 first: {n} stages, {m} micro-batches of {} \
         samples, `{schedule}` schedule.",
        pp.stages.first().map_or(0, |s| s.batch)
    );
    let memory_doc = format!(
        " Each stage's memory of one training step; the largest is stage {largest}'s, {}.",
        format_bytes(largest_bytes)
    );
    let bubble_doc = format!(
        " The share of the stages' time the schedule leaves idle: {:.1} %.",
        bubble * 100.0
    );
    quote! {
        impl #ident {
            #[doc = #stages_doc]
            pub const STAGES: &'static [::memwise::plan::StaticPlan] = &[#(#plans),*];
            #[doc = #memory_doc]
            pub const STAGE_MEMORY: [::memwise::plan::MemoryReport; #n] = [#(#memories),*];
            /// The stage whose memory is largest.
            pub const LARGEST_STAGE: usize = #largest;
            /// Micro-batches per step.
            pub const MICRO_BATCHES: usize = #m;
            #[doc = #bubble_doc]
            pub const BUBBLE_FRACTION: f64 = #bubble;
        }
    }
}

/// The doc lines of `PLAN` and `MEMORY`.
fn plan_docs(plan: &StaticPlan) -> (String, String) {
    let m = &plan.memory;
    let plan_doc = format!(
        " The static plan of one training step ({} steps, {} arena tensors in {}), computed by the `#[memwise::model]` macro.",
        plan.steps.len(),
        plan.tensors.len(),
        format_bytes(plan.arena_bytes)
    );
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
    (plan_doc, mem_doc)
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
            pub const STAGES: &'static [::memwise::plan::StaticPlan] = &[];
            pub const LARGEST_STAGE: usize = 0;
            pub const MICRO_BATCHES: usize = 1;
            pub const BUBBLE_FRACTION: f64 = 0.0;
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
