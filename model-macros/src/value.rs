//! Attribute arguments: splitting `a, b = c` lists, evaluating option values (numbers with
//! `+ - * /`, names, lists, block parameters) and reading them as the types layers need.
//!
//! Arguments are split by hand rather than parsed as `syn` expressions so that every
//! mistake gets a message about the option, not a raw parse error.
use std::collections::HashMap;

use proc_macro2::{Spacing, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{BinOp, Expr, Lit, UnOp};

use crate::diag::{did_you_mean, list_names, Errors};

/// One argument of an attribute: `value` or `name = value`.
#[derive(Clone)]
pub struct Arg {
    pub name: Option<syn::Ident>,
    pub value: TokenStream,
    /// The whole argument, for spans covering `name = value`.
    pub tokens: TokenStream,
}

impl Arg {
    pub fn name(&self) -> Option<String> {
        self.name.as_ref().map(|n| n.to_string())
    }
}

/// Splits `a, b = c, d = [1, 2]` at top-level commas. A `name =` with nothing after it is an
/// error; empty pieces (a trailing comma) are skipped.
pub fn split_args(ts: TokenStream, errors: &mut Errors) -> Vec<Arg> {
    let mut pieces: Vec<Vec<TokenTree>> = vec![Vec::new()];
    for tt in ts {
        match &tt {
            TokenTree::Punct(p) if p.as_char() == ',' => pieces.push(Vec::new()),
            _ => pieces.last_mut().expect("non-empty").push(tt),
        }
    }
    let mut args = Vec::new();
    for piece in pieces.into_iter().filter(|p| !p.is_empty()) {
        let tokens: TokenStream = piece.iter().cloned().collect();
        let named = match (piece.first(), piece.get(1)) {
            (Some(TokenTree::Ident(id)), Some(TokenTree::Punct(eq)))
                if eq.as_char() == '=' && eq.spacing() == Spacing::Alone =>
            {
                Some(id.clone())
            }
            _ => None,
        };
        match named {
            Some(name) => {
                let value: TokenStream = piece[2..].iter().cloned().collect();
                if value.is_empty() {
                    errors.at(
                        &tokens,
                        format!("option `{name}` has no value: write `{name} = …`"),
                    );
                    continue;
                }
                args.push(Arg {
                    name: Some(name),
                    value,
                    tokens,
                });
            }
            None => {
                // `512 activation = relu`: a forgotten comma, not a strange value. Said once,
                // and both halves read as if the comma were there.
                let missing_comma = (1..piece.len().saturating_sub(1)).find(|&k| {
                    matches!((&piece[k], &piece[k + 1]), (TokenTree::Ident(_), TokenTree::Punct(eq))
                        if eq.as_char() == '=' && eq.spacing() == Spacing::Alone)
                });
                match missing_comma {
                    Some(k) => {
                        errors.at(&piece[k], format!("expected `,` before `{} = …`", piece[k]));
                        let first: TokenStream = piece[..k].iter().cloned().collect();
                        args.push(Arg {
                            name: None,
                            value: first.clone(),
                            tokens: first,
                        });
                        let name = match &piece[k] {
                            TokenTree::Ident(id) => Some(id.clone()),
                            _ => None,
                        };
                        let value: TokenStream = piece[k + 2..].iter().cloned().collect();
                        let tokens: TokenStream = piece[k..].iter().cloned().collect();
                        if !value.is_empty() {
                            args.push(Arg {
                                name,
                                value,
                                tokens,
                            });
                        }
                    }
                    None => args.push(Arg {
                        name: None,
                        value: tokens.clone(),
                        tokens,
                    }),
                }
            }
        }
    }
    args
}

/// An evaluated option value.
#[derive(Clone, Debug, PartialEq)]
pub enum V {
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A bare name: an activation, a padding, a dtype, a field.
    Word(String),
    Str(String),
    List(Vec<Val>),
    /// A name with arguments, `leaky_relu(0.1)` or `elu(alpha = 0.5)`: each argument with its
    /// name when it has one.
    Call(String, Vec<(Option<syn::Ident>, Val)>),
    /// Depends on a block parameter not known yet (checking a block on its own).
    Unknown,
}

/// A value and the tokens it came from (for error spans).
#[derive(Clone, Debug)]
pub struct Val {
    pub v: V,
    pub tokens: TokenStream,
}

impl PartialEq for Val {
    fn eq(&self, other: &Self) -> bool {
        self.v == other.v
    }
}

impl Val {
    /// How a value is named in messages.
    pub fn describe(&self) -> String {
        match &self.v {
            V::Int(n) => format!("`{n}`"),
            V::Float(x) => format!("`{x:?}`"),
            V::Bool(b) => format!("`{b}`"),
            V::Word(w) => format!("`{w}`"),
            V::Str(s) => format!("the string {s:?}"),
            V::List(_) => "a list".to_string(),
            V::Call(name, _) => format!("`{name}(…)`"),
            V::Unknown => "a block parameter".to_string(),
        }
    }

    pub fn err(&self, message: impl std::fmt::Display) -> syn::Error {
        syn::Error::new_spanned(&self.tokens, message)
    }

    pub fn is_unknown(&self) -> bool {
        self.v == V::Unknown
    }
}

/// Block parameters in scope: name → value.
pub type Env = HashMap<String, Val>;

const VALUE_HELP: &str = "expected a value: a number (`64`, `1e-3`, `1.0 / 255.0`), a name (`relu`, `same`, a field), or a list (`[3, 3]`)";

/// Evaluates an option value.
pub fn eval(ts: &TokenStream, env: &Env) -> syn::Result<Val> {
    let expr: Expr =
        syn::parse2(ts.clone()).map_err(|_| syn::Error::new_spanned(ts, VALUE_HELP))?;
    eval_expr(&expr, env)
}

pub fn eval_expr(expr: &Expr, env: &Env) -> syn::Result<Val> {
    let tokens = expr.to_token_stream();
    let v = match expr {
        Expr::Lit(l) => match &l.lit {
            Lit::Int(i) => V::Int(i.base10_parse::<i64>()?),
            Lit::Float(f) => V::Float(f.base10_parse::<f64>()?),
            Lit::Bool(b) => V::Bool(b.value),
            Lit::Str(s) => V::Str(s.value()),
            _ => return Err(syn::Error::new_spanned(expr, VALUE_HELP)),
        },
        Expr::Paren(p) => return eval_expr(&p.expr, env).map(|v| Val { tokens, ..v }),
        Expr::Group(g) => return eval_expr(&g.expr, env),
        Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => {
            let inner = eval_expr(&u.expr, env)?;
            match inner.v {
                V::Int(n) => V::Int(-n),
                V::Float(x) => V::Float(-x),
                V::Unknown => V::Unknown,
                _ => return Err(inner.err(format!("cannot negate {}", inner.describe()))),
            }
        }
        Expr::Binary(b) => {
            let (l, r) = (eval_expr(&b.left, env)?, eval_expr(&b.right, env)?);
            arith(&b.op, &l, &r).map_err(|m| syn::Error::new_spanned(expr, m))?
        }
        Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
            let name = p.path.get_ident().expect("checked").to_string();
            match env.get(&name) {
                // Keep the argument's own tokens: a wrong value is the caller's mistake.
                Some(v) => return Ok(v.clone()),
                None => V::Word(name),
            }
        }
        Expr::Array(a) => V::List(
            a.elems
                .iter()
                .map(|e| eval_expr(e, env))
                .collect::<syn::Result<_>>()?,
        ),
        Expr::Tuple(t) => V::List(
            t.elems
                .iter()
                .map(|e| eval_expr(e, env))
                .collect::<syn::Result<_>>()?,
        ),
        Expr::Call(c) => {
            let name = match &*c.func {
                Expr::Path(f) if f.qself.is_none() => f.path.get_ident(),
                _ => None,
            };
            let Some(name) = name else {
                return Err(syn::Error::new_spanned(expr, VALUE_HELP));
            };
            let args = c
                .args
                .iter()
                .map(|a| match a {
                    Expr::Assign(asg) => match &*asg.left {
                        Expr::Path(p) if p.path.get_ident().is_some() => {
                            Ok((p.path.get_ident().cloned(), eval_expr(&asg.right, env)?))
                        }
                        _ => Err(syn::Error::new_spanned(a, VALUE_HELP)),
                    },
                    _ => Ok((None, eval_expr(a, env)?)),
                })
                .collect::<syn::Result<_>>()?;
            V::Call(name.to_string(), args)
        }
        _ => return Err(syn::Error::new_spanned(expr, VALUE_HELP)),
    };
    Ok(Val { v, tokens })
}

fn arith(op: &BinOp, l: &Val, r: &Val) -> Result<V, String> {
    let num = |v: &Val| match v.v {
        V::Int(n) => Ok(Some(n as f64)),
        V::Float(x) => Ok(Some(x)),
        V::Unknown => Ok(None),
        _ => Err(format!("expected a number, found {}", v.describe())),
    };
    let (a, b) = (num(l)?, num(r)?);
    let (Some(a), Some(b)) = (a, b) else {
        return Ok(V::Unknown);
    };
    let both_int = matches!((&l.v, &r.v), (V::Int(_), V::Int(_)));
    let x = match op {
        BinOp::Add(_) => a + b,
        BinOp::Sub(_) => a - b,
        BinOp::Mul(_) => a * b,
        BinOp::Div(_) => {
            if b == 0.0 {
                return Err("division by zero".into());
            }
            a / b
        }
        _ => return Err("only `+`, `-`, `*` and `/` are allowed in option values".into()),
    };
    // Integers stay integers unless the division is inexact (`1 / 255` is a scale, not 0).
    Ok(if both_int && x.fract() == 0.0 {
        V::Int(x as i64)
    } else {
        V::Float(x)
    })
}

// ---- typed reads ----

pub fn positive(v: &Val, what: &str) -> syn::Result<usize> {
    match v.v {
        V::Int(n) if n > 0 => Ok(n as usize),
        V::Unknown => Ok(1),
        _ => Err(v.err(format!(
            "`{what}` must be a positive integer, found {}",
            v.describe()
        ))),
    }
}

pub fn float(v: &Val, what: &str) -> syn::Result<f32> {
    match v.v {
        V::Int(n) => Ok(n as f32),
        V::Float(x) => Ok(x as f32),
        V::Unknown => Ok(0.0),
        _ => Err(v.err(format!("`{what}` must be a number, found {}", v.describe()))),
    }
}

pub fn boolean(v: &Val, what: &str) -> syn::Result<bool> {
    match v.v {
        V::Bool(b) => Ok(b),
        V::Unknown => Ok(false),
        _ => Err(v.err(format!(
            "`{what}` must be `true` or `false`, found {}",
            v.describe()
        ))),
    }
}

/// A name from `choices` (with a suggestion when it is close to one).
pub fn word<'a>(v: &Val, what: &str, choices: &[&'a str]) -> syn::Result<&'a str> {
    match &v.v {
        V::Word(w) => match choices.iter().find(|c| **c == w) {
            Some(c) => Ok(c),
            None => Err(v.err(format!(
                "unknown {what} `{w}`{}\n= note: expected one of {}",
                did_you_mean(w, choices.iter().copied()),
                list_names(choices.iter().copied())
            ))),
        },
        V::Unknown => Ok(choices[0]),
        _ => Err(v.err(format!(
            "`{what}` must be one of {}, found {}",
            list_names(choices.iter().copied()),
            v.describe()
        ))),
    }
}

/// `3` → `[3, 3]`; `[3, 5]` → `[3, 5]`.
pub fn pair(v: &Val, what: &str) -> syn::Result<[usize; 2]> {
    match &v.v {
        V::List(items) if items.len() == 2 => {
            Ok([positive(&items[0], what)?, positive(&items[1], what)?])
        }
        V::List(_) => Err(v.err(format!(
            "`{what}` takes one number or two (`3` or `[3, 3]`)"
        ))),
        _ => positive(v, what).map(|n| [n, n]),
    }
}

/// A shape without the batch dimension: `[28, 28, 1]`, `784` or `[]` (a scalar per sample).
pub fn shape(v: &Val, what: &str) -> syn::Result<Vec<usize>> {
    match &v.v {
        V::List(items) => items.iter().map(|i| positive(i, what)).collect(),
        V::Int(_) | V::Unknown => positive(v, what).map(|n| vec![n]),
        _ => Err(v.err(format!(
            "`{what}` must be a list of dimensions like `[28, 28, 1]`, found {}",
            v.describe()
        ))),
    }
}

/// A field reference, as its name and tokens.
#[derive(Clone, Debug)]
pub struct FieldRef {
    pub name: String,
    pub tokens: TokenStream,
}

/// `stem` or `[a, b]`.
pub fn refs(v: &Val) -> syn::Result<Vec<FieldRef>> {
    let one = |v: &Val| match &v.v {
        V::Word(w) => Ok(FieldRef {
            name: w.clone(),
            tokens: v.tokens.clone(),
        }),
        _ => Err(v.err(format!("expected a field name, found {}", v.describe()))),
    };
    match &v.v {
        V::List(items) => items.iter().map(one).collect(),
        _ => one(v).map(|r| vec![r]),
    }
}

/// The options of one attribute, taken one by one by name or position; whatever is left at
/// [`Opts::finish`] is reported as unknown.
pub struct Opts<'a> {
    /// `#[dense]`, `optimizer `rmsprop``, for messages.
    pub what: String,
    /// Span for "missing option" errors: the whole attribute.
    pub anchor: TokenStream,
    positional: Vec<Arg>,
    named: Vec<Arg>,
    used: Vec<bool>,
    positional_names: Vec<&'static str>,
    /// Canonical option names (listed in messages) and every accepted spelling (suggested).
    canonical: Vec<&'static str>,
    known: Vec<&'static str>,
    pub env: &'a Env,
}

impl<'a> Opts<'a> {
    pub fn new(what: String, anchor: TokenStream, args: Vec<Arg>, env: &'a Env) -> Self {
        let (named, positional): (Vec<Arg>, Vec<Arg>) =
            args.into_iter().partition(|a| a.name.is_some());
        let used = vec![false; named.len()];
        Opts {
            what,
            anchor,
            positional,
            named,
            used,
            positional_names: Vec::new(),
            canonical: Vec::new(),
            known: Vec::new(),
            env,
        }
    }

    /// The raw argument for `name` (or one of `aliases`), or positional `pos`.
    pub fn raw(
        &mut self,
        name: &'static str,
        aliases: &[&'static str],
        pos: Option<usize>,
        errors: &mut Errors,
    ) -> Option<Arg> {
        self.canonical.push(name);
        self.known.push(name);
        self.known.extend_from_slice(aliases);
        if let Some(p) = pos {
            if self.positional_names.len() <= p {
                self.positional_names.resize(p + 1, "");
            }
            self.positional_names[p] = name;
        }
        let mut found: Option<Arg> = pos.and_then(|p| self.positional.get(p).cloned());
        for (i, a) in self.named.iter().enumerate() {
            let n = a.name().expect("named");
            if n == name || aliases.contains(&n.as_str()) {
                self.used[i] = true;
                if found.is_some() {
                    errors.at(
                        &a.tokens,
                        format!("`{name}` is given twice in {}", self.what),
                    );
                } else {
                    found = Some(a.clone());
                }
            }
        }
        found
    }

    /// The evaluated option, or `None` (absent, or an error already recorded).
    pub fn get(
        &mut self,
        name: &'static str,
        aliases: &[&'static str],
        pos: Option<usize>,
        errors: &mut Errors,
    ) -> Option<Val> {
        let arg = self.raw(name, aliases, pos, errors)?;
        errors.ok(eval(&arg.value, self.env))
    }

    /// Like [`Opts::get`], converting with `f`; `default` when absent or wrong.
    pub fn read<T>(
        &mut self,
        name: &'static str,
        aliases: &[&'static str],
        pos: Option<usize>,
        default: T,
        errors: &mut Errors,
        f: impl FnOnce(&Val, &str) -> syn::Result<T>,
    ) -> T {
        match self.get(name, aliases, pos, errors) {
            Some(v) => errors.ok(f(&v, name)).unwrap_or(default),
            None => default,
        }
    }

    /// A required option: a "missing" error (with `example`) when absent.
    // `read`'s arguments plus the example: a struct for them would only move the list.
    #[allow(clippy::too_many_arguments)]
    pub fn require<T>(
        &mut self,
        name: &'static str,
        aliases: &[&'static str],
        pos: Option<usize>,
        default: T,
        example: &str,
        errors: &mut Errors,
        f: impl FnOnce(&Val, &str) -> syn::Result<T>,
    ) -> T {
        let Some(arg) = self.raw(name, aliases, pos, errors) else {
            // A misspelt `kernal = 3` is reported as unknown (with a suggestion); saying
            // that `kernel_size` is missing as well would only repeat it.
            let misspelt = self.named.iter().zip(&self.used).any(|(a, used)| {
                !used
                    && crate::diag::closest(
                        &a.name().expect("named"),
                        std::iter::once(name).chain(aliases.iter().copied()),
                    )
                    .is_some()
            });
            if !misspelt {
                errors.at(
                    &self.anchor,
                    format!("{} needs `{name}`, e.g. `{example}`", self.what),
                );
            }
            return default;
        };
        match errors.ok(eval(&arg.value, self.env)) {
            Some(v) => errors.ok(f(&v, name)).unwrap_or(default),
            None => default,
        }
    }

    /// Positional arguments from `start` on (field references of `add`, `concat` …).
    pub fn rest_positional(&mut self, start: usize, name: &'static str) -> Vec<Arg> {
        if self.positional_names.len() <= start {
            self.positional_names.resize(start + 1, "");
        }
        self.positional_names[start] = name;
        self.positional_names.push("…");
        self.positional
            .get(start..)
            .map(<[Arg]>::to_vec)
            .unwrap_or_default()
    }

    /// Reports unknown named options (with suggestions) and extra positional arguments.
    pub fn finish(self, errors: &mut Errors) {
        for (a, used) in self.named.iter().zip(&self.used) {
            if !used {
                let n = a.name().expect("named");
                let known: Vec<&str> = self.known.clone();
                let message = if self.canonical.is_empty() {
                    format!("unknown option `{n}`: {} takes no options", self.what)
                } else {
                    format!(
                        "unknown option `{n}` for {}{}\n= note: its options are {}",
                        self.what,
                        did_you_mean(&n, known.iter().copied()),
                        list_names(dedup(&self.canonical))
                    )
                };
                errors.at(a.name.as_ref().expect("named"), message);
            }
        }
        let takes = self.positional_names.iter().filter(|n| **n != "…").count();
        let open = self.positional_names.contains(&"…");
        if !open && self.positional.len() > takes {
            let extra = &self.positional[takes];
            let names: Vec<&str> = self.positional_names.clone();
            let msg = if takes == 0 {
                format!(
                    "{} takes no positional arguments; name the option (`name = value`)",
                    self.what
                )
            } else {
                format!(
                    "{} takes {takes} positional argument{} ({}); name the others (`name = value`)",
                    self.what,
                    if takes == 1 { "" } else { "s" },
                    list_names(names.iter().copied())
                )
            };
            errors.at(&extra.tokens, msg);
        }
    }
}

fn dedup<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(n) {
            out.push(n);
        }
    }
    out
}
