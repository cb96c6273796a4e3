//! The reference docs of the layer attributes, written from the catalogue: the table in
//! `memwise::model`'s rustdoc and the lists of activations and aliases below it.

use super::{Inputs, LayerDef, OptionDefault, CATALOGUE};
use crate::spec::Activation;

fn code(s: &str) -> String {
    format!("`{s}`")
}

/// `a`, `b` and `c`.
fn list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The "positional" cell: the fields it names, or its options in their positional order.
fn positional(def: &LayerDef) -> String {
    if let Inputs::Fields { doc, .. } = def.inputs {
        return doc.to_string();
    }
    let mut opts: Vec<_> = def
        .options
        .iter()
        .filter(|o| o.position.is_some())
        .collect();
    opts.sort_by_key(|o| o.position);
    opts.iter()
        .map(|o| code(o.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The "options" cell: each option with its default (or "required") and its doc line,
/// one per line.
fn options(def: &LayerDef) -> String {
    def.options
        .iter()
        .map(|o| {
            let head = match &o.default {
                OptionDefault::Required { .. } => format!("{} (required)", code(o.name)),
                OptionDefault::Value(v) => code(&format!("{} = {}", o.name, v.dsl())),
                OptionDefault::SameAs(other) => code(&format!("{} = {other}", o.name)),
            };
            format!("{head}: {}", o.doc)
        })
        .collect::<Vec<_>>()
        .join("<br>")
}

/// The "parameters" cell: each parameter with its initialiser.
fn params(def: &LayerDef) -> String {
    def.params
        .iter()
        .map(|p| {
            let stat = if p.trainable { "" } else { ", not trained" };
            format!("{} ({}{stat})", code(p.suffix), p.init.describe())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Markdown table of every layer attribute, one row per catalogue entry.
pub fn layer_table() -> String {
    let mut out = String::from(
        "| attribute | type | positional | options (default): what they do | parameters (initialiser) |\n\
         |---|---|---|---|---|\n",
    );
    for def in CATALOGUE {
        out.push_str(&format!(
            "| {} | [`{}`](layers::{}) | {} | {} | {} |\n",
            code(def.name),
            def.handle,
            def.handle,
            positional(def),
            options(def),
            params(def)
        ));
    }
    out
}

/// The sentences after the table: the activations, and the aliases options accept.
pub fn aliases_doc() -> String {
    let activations: Vec<String> = Activation::ALL
        .iter()
        .map(|a| code(&a.signature()))
        .collect();
    let mut aliases: Vec<String> = Vec::new();
    for def in CATALOGUE {
        for o in def.options {
            for a in o.aliases {
                let line = format!("{} for {}", code(a), code(o.name));
                if !aliases.contains(&line) {
                    aliases.push(line);
                }
            }
        }
    }
    format!(
        "Activations: {}. Aliases: {}.",
        list(&activations),
        list(&aliases)
    )
}
