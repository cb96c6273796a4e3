//! The model attribute's arguments: `batch`, `optimizer`, `loss`, `metrics`, `budget`,
//! `precision`, `checkpoint`, `replicas`, `zero`, `stages`, `micro_batches`, `schedule`.
use memwise_plan::advice::parse_bytes;
use memwise_plan::data_parallel::Sharding;
use memwise_plan::pipeline::PipelineSchedule;
use memwise_plan::Stages;
use memwise_plan::{
    LossKind, LossTerm, Metric, ModelSpec, Optimizer, Precision, Reduction, DEFAULT_BATCH,
};
use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::{BinOp, Expr};

use crate::diag::{did_you_mean, list_names, Errors};
use crate::value::{
    boolean, eval, eval_expr, float, split_args, word, Arg, Env, FieldRef, Opts, V,
};

/// One loss term with the fields it names (resolved against the struct later).
pub struct LossDecl {
    pub term: LossTerm,
    pub inputs: Vec<FieldRef>,
}

pub struct ModelArgs {
    pub batch: usize,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub loss: Vec<LossDecl>,
    /// The `loss = …` argument (where planner errors about the loss go).
    pub loss_tokens: Option<TokenStream>,
    pub metrics: Vec<Metric>,
    /// Bytes, and the whole `budget = "…"` argument (where the budget error goes).
    pub budget: Option<(u64, TokenStream)>,
    /// `checkpoint = auto`: the whole argument, when given.
    pub checkpoint_auto: Option<TokenStream>,
    /// `replicas = N`: data-parallel replicas sharing each batch (1 when not given).
    pub replicas: usize,
    /// `zero = 1`: the replicas shard the optimizer state (ZeRO stage 1).
    pub sharding: Sharding,
    /// `replicas = 2..=8`: the counts the model may be launched with (`replicas` is then the
    /// smallest).
    pub replica_range: Option<[usize; 2]>,
    pub pipeline: PipelineArgs,
}

/// The pipeline's options.
#[derive(Default)]
pub struct PipelineArgs {
    /// `stages = N` or `stages = auto`: the planner chooses the split; and the argument.
    pub stages: Option<(Stages, TokenStream)>,
    /// `micro_batches = M` (1 when not given); and the argument.
    pub micro_batches: Option<(usize, TokenStream)>,
    /// `schedule = gpipe | one_f_one_b` (1F1B when not given).
    pub schedule: Option<PipelineSchedule>,
}

const ARGS: [&str; 12] = [
    "batch",
    "optimizer",
    "loss",
    "metrics",
    "budget",
    "precision",
    "checkpoint",
    "replicas",
    "zero",
    "stages",
    "micro_batches",
    "schedule",
];
const SCHEDULES: [&str; 2] = ["gpipe", "one_f_one_b"];
const OPTIMIZERS: [&str; 5] = ["sgd", "momentum", "rmsprop", "adam", "adamw"];
const LOSSES: [&str; 4] = [
    "sparse_categorical_crossentropy",
    "binary_crossentropy",
    "mse",
    "kl_normal",
];
const LOSS_SPELLINGS: [&str; 8] = [
    "sparse_categorical_crossentropy",
    "binary_crossentropy",
    "bce",
    "mse",
    "mean_squared_error",
    "kl_normal",
    "kl_divergence",
    "kl",
];
const METRICS: [&str; 5] = [
    "accuracy",
    "acc",
    "binary_accuracy",
    "mse",
    "mean_squared_error",
];
const PRECISIONS: [&str; 3] = ["float32", "mixed_float16", "mixed_bfloat16"];

pub fn parse(attr: TokenStream, e: &mut Errors) -> ModelArgs {
    // What an attribute that says nothing gets: the planner's defaults.
    let defaults = ModelSpec::new("", DEFAULT_BATCH);
    let mut out = ModelArgs {
        batch: defaults.batch,
        precision: defaults.precision,
        optimizer: defaults.optimizer,
        loss: Vec::new(),
        loss_tokens: None,
        metrics: Vec::new(),
        budget: None,
        checkpoint_auto: None,
        replicas: defaults.replicas,
        sharding: defaults.sharding,
        replica_range: defaults.replica_range,
        pipeline: PipelineArgs::default(),
    };
    let mut replicas_tokens: Option<TokenStream> = None;
    let mut zero_tokens: Option<TokenStream> = None;
    let env = Env::new();
    let mut seen: Vec<String> = Vec::new();
    for arg in split_args(attr, e) {
        let Some(name) = arg.name() else {
            e.at(&arg.tokens, "expected `name = value`, e.g. `batch = 128`, `loss = sparse_categorical_crossentropy` or `budget = \"2 GiB\"`");
            continue;
        };
        if seen.contains(&name) {
            e.at(&arg.tokens, format!("`{name}` is given twice"));
            continue;
        }
        seen.push(name.clone());
        match name.as_str() {
            "batch" | "batch_size" => {
                if let Some(v) = e.ok(eval(&arg.value, &env)) {
                    match v.v {
                        V::Int(n) if n > 0 => out.batch = n as usize,
                        V::Int(_) => e.at(&v.tokens, "`batch` must be at least 1"),
                        _ => e.at(
                            &v.tokens,
                            format!("`batch` must be a positive integer, found {}", v.describe()),
                        ),
                    }
                }
            }
            "replicas" => {
                if let Some([lo, hi]) = replicas(&arg, &env, e) {
                    out.replicas = lo;
                    out.replica_range = (lo < hi).then_some([lo, hi]);
                    replicas_tokens = Some(arg.tokens.clone());
                }
            }
            "zero" => {
                if let Some(sharding) = zero(&arg, &env, e) {
                    out.sharding = sharding;
                    zero_tokens = Some(arg.tokens.clone());
                }
            }
            "stages" | "micro_batches" | "schedule" => pipeline_arg(&name, &arg, &env, &mut out, e),
            "precision" => {
                if let Some(v) = e.ok(eval(&arg.value, &env)) {
                    if let Some(w) = e.ok(word(&v, "precision", &PRECISIONS)) {
                        out.precision = Precision::parse(w).expect("listed");
                    }
                }
            }
            "optimizer" => {
                if let Some(o) = optimizer(&arg, e) {
                    out.optimizer = o;
                }
            }
            "loss" => {
                out.loss_tokens = Some(arg.tokens.clone());
                match syn::parse2::<Expr>(arg.value.clone()) {
                    Ok(expr) => loss(&expr, 1.0, &mut out.loss, e),
                    Err(_) => e.at(&arg.value, LOSS_HELP),
                }
            }
            "metrics" => {
                if let Some(v) = e.ok(eval(&arg.value, &env)) {
                    let items = match v.v {
                        V::List(items) => items,
                        _ => vec![v],
                    };
                    for m in items {
                        if let Some(w) = e.ok(word(&m, "metric", &METRICS)) {
                            out.metrics.push(Metric::parse(w).expect("listed"));
                        }
                    }
                }
            }
            "budget" => {
                let text = match syn::parse2::<Expr>(arg.value.clone())
                    .ok()
                    .map(|x| eval_expr(&x, &env))
                {
                    Some(Ok(v)) => match v.v {
                        V::Str(s) => Some(s),
                        V::Int(n) if n > 0 => Some(n.to_string()),
                        _ => None,
                    },
                    _ => None,
                };
                match text.map(|t| parse_bytes(&t)) {
                    Some(Ok(0)) => e.at(&arg.value, "the budget must be more than 0 bytes"),
                    Some(Ok(b)) => out.budget = Some((b, arg.tokens.clone())),
                    Some(Err(msg)) => e.at(&arg.value, format!("malformed budget: {msg}")),
                    None => e.at(
                        &arg.value,
                        "`budget` must be a string with a unit: `\"512 MiB\"`, `\"8 GiB\"` (powers of 1024) or `\"80GB\"` (powers of 1000)",
                    ),
                }
            }
            "checkpoint" => {
                let auto = matches!(eval(&arg.value, &env), Ok(v) if v.v == V::Word("auto".into()));
                if auto {
                    out.checkpoint_auto = Some(arg.tokens.clone());
                } else {
                    e.at(
                        &arg.tokens,
                        "`checkpoint` takes `auto` (memwise chooses the checkpoints that fit `budget`); \
                         or mark layers with `#[checkpoint]` on their fields",
                    );
                }
            }
            other => e.at(
                arg.name.as_ref().expect("named"),
                format!(
                    "unknown model option `{other}`{}\n= note: the options are {}",
                    did_you_mean(other, ARGS),
                    list_names(ARGS)
                ),
            ),
        }
    }
    // The planner says the same for specs built in code; here it points at the attribute.
    let mut spec = ModelSpec::new("", out.batch)
        .with_replicas(out.replicas)
        .with_sharding(out.sharding);
    spec.replica_range = out.replica_range;
    // A stage-2 error points at `zero`, a batch that does not split at `replicas`.
    let at = match out.sharding {
        Sharding::Gradients => zero_tokens,
        Sharding::Replicated | Sharding::OptimizerState => replicas_tokens,
    };
    if let (Err(err), Some(tokens)) = (spec.per_replica(), at) {
        e.at(&tokens, err.message);
    }
    out
}

/// The pipeline's options: `stages = N | auto`, `micro_batches = M`, `schedule = …`.
fn pipeline_arg(name: &str, arg: &Arg, env: &Env, out: &mut ModelArgs, e: &mut Errors) {
    match name {
        "stages" => out.pipeline.stages = stages(arg, env, e).map(|s| (s, arg.tokens.clone())),
        "micro_batches" => {
            let Some(v) = e.ok(eval(&arg.value, env)) else {
                return;
            };
            match v.v {
                V::Int(n) if n > 0 => {
                    out.pipeline.micro_batches = Some((n as usize, arg.tokens.clone()))
                }
                _ => e.at(
                    &v.tokens,
                    format!(
                        "`micro_batches` is how many micro-batches each batch is cut into on the \
                         pipeline: a positive integer, found {}",
                        v.describe()
                    ),
                ),
            }
        }
        _ => {
            let Some(v) = e.ok(eval(&arg.value, env)) else {
                return;
            };
            if let Some(w) = e.ok(word(&v, "schedule", &SCHEDULES)) {
                out.pipeline.schedule = Some(match w {
                    "gpipe" => PipelineSchedule::GPipe,
                    _ => PipelineSchedule::OneFOneB,
                });
            }
        }
    }
}

/// `stages = N` (a positive integer) or `stages = auto`.
fn stages(arg: &Arg, env: &Env, e: &mut Errors) -> Option<Stages> {
    const HELP: &str = "`stages` is how many pipeline stages (devices) the model is split into, \
        the split chosen to make the largest stage smallest: a positive integer, or `auto` (the \
        fewest stages that fit `budget`); or put `#[stage(k)]` on the fields that begin each stage";
    match e.ok(eval(&arg.value, env))?.v {
        V::Int(n) if n > 0 => Some(Stages::Count(n as usize)),
        V::Word(w) if w == "auto" => Some(Stages::Auto),
        _ => {
            e.at(&arg.value, HELP);
            None
        }
    }
}

/// `replicas = N`, a positive integer, or a range of them, `2..=8` (or `2..9`): the
/// smallest and largest count, inclusive.
fn replicas(arg: &Arg, env: &Env, e: &mut Errors) -> Option<[usize; 2]> {
    const HELP: &str = "`replicas` is how many devices train the model data-parallel: a \
                        positive integer, or a range of them chosen at run time (`2..=8`)";
    if let Ok(Expr::Range(r)) = syn::parse2::<Expr>(arg.value.clone()) {
        let bound = |x: &Option<Box<Expr>>| {
            x.as_deref()
                .and_then(|x| eval_expr(x, env).ok())
                .and_then(|v| match v.v {
                    V::Int(n) if n > 0 => Some(n as usize),
                    _ => None,
                })
        };
        let closed = matches!(r.limits, syn::RangeLimits::Closed(_));
        let range = match (bound(&r.start), bound(&r.end)) {
            (Some(lo), Some(hi)) if closed && lo <= hi => Some([lo, hi]),
            (Some(lo), Some(end)) if !closed && lo < end => Some([lo, end - 1]),
            _ => None,
        };
        if range.is_none() {
            e.at(
                &arg.value,
                format!("{HELP}: a non-empty range of positive integers"),
            );
        }
        return range;
    }
    let v = e.ok(eval(&arg.value, env))?;
    match v.v {
        V::Int(n) if n > 0 => Some([n as usize; 2]),
        _ => {
            e.at(&v.tokens, format!("{HELP}, found {}", v.describe()));
            None
        }
    }
}

/// `zero = S`: the ZeRO stage, 0 to 2 (the planner refuses 2, pointing here).
fn zero(arg: &Arg, env: &Env, e: &mut Errors) -> Option<Sharding> {
    let v = e.ok(eval(&arg.value, env))?;
    match v.v {
        V::Int(n @ 0..=2) => Sharding::from_zero_stage(n as u8),
        _ => {
            e.at(
                &v.tokens,
                format!(
                    "`zero` is the ZeRO stage of data-parallel training: `0` (nothing sharded) \
                     or `1` (each replica keeps 1/N of the optimizer state), found {}",
                    v.describe()
                ),
            );
            None
        }
    }
}

/// `name` or `name(…)` as a name and its arguments (`a = b` named, others positional).
fn call(expr: &Expr) -> Option<(String, Vec<Arg>)> {
    match expr {
        Expr::Path(p) => p.path.get_ident().map(|i| (i.to_string(), Vec::new())),
        Expr::Call(c) => {
            let Expr::Path(f) = &*c.func else { return None };
            let name = f.path.get_ident()?.to_string();
            let args = c
                .args
                .iter()
                .map(|a| match a {
                    Expr::Assign(asg) => match &*asg.left {
                        Expr::Path(p) if p.path.get_ident().is_some() => Arg {
                            name: p.path.get_ident().cloned(),
                            value: asg.right.to_token_stream(),
                            tokens: a.to_token_stream(),
                        },
                        _ => Arg {
                            name: None,
                            value: a.to_token_stream(),
                            tokens: a.to_token_stream(),
                        },
                    },
                    _ => Arg {
                        name: None,
                        value: a.to_token_stream(),
                        tokens: a.to_token_stream(),
                    },
                })
                .collect();
            Some((name, args))
        }
        _ => None,
    }
}

fn optimizer(arg: &Arg, e: &mut Errors) -> Option<Optimizer> {
    let help = "expected an optimizer like `adam`, `rmsprop(lr = 1e-3)` or `sgd(lr = 0.1, momentum = 0.9)`";
    let Some((name, args)) = syn::parse2::<Expr>(arg.value.clone())
        .ok()
        .as_ref()
        .and_then(call)
    else {
        e.at(&arg.value, help);
        return None;
    };
    if !OPTIMIZERS.contains(&name.as_str()) {
        e.at(
            &arg.value,
            format!(
                "unknown optimizer `{name}`{}\n= note: expected one of {}",
                did_you_mean(&name, OPTIMIZERS),
                list_names(OPTIMIZERS)
            ),
        );
        return None;
    }
    let env = Env::new();
    let mut o = Opts::new(format!("optimizer `{name}`"), arg.value.clone(), args, &env);
    // Defaults are the planner's Keras constants; each option read overrides one field.
    let mut opt = match name.as_str() {
        "sgd" | "momentum" => Optimizer::MOMENTUM,
        "rmsprop" => Optimizer::RMSPROP,
        "adam" => Optimizer::ADAM,
        _ => Optimizer::ADAMW,
    };
    // `lr` (alias `learning_rate`) is also the first positional argument.
    fn num(o: &mut Opts, e: &mut Errors, key: &'static str, x: &mut f32) {
        let (aliases, pos): (&[&'static str], _) = match key {
            "lr" => (&["learning_rate"], Some(0)),
            _ => (&[], None),
        };
        *x = o.read(key, aliases, pos, *x, e, float);
    }
    fn flag(o: &mut Opts, e: &mut Errors, key: &'static str, x: &mut bool) {
        *x = o.read(key, &[], None, *x, e, boolean);
    }
    match &mut opt {
        Optimizer::Momentum {
            lr,
            momentum,
            nesterov,
        } => {
            if name == "sgd" {
                *momentum = 0.0;
            }
            num(&mut o, e, "lr", lr);
            num(&mut o, e, "momentum", momentum);
            flag(&mut o, e, "nesterov", nesterov);
        }
        Optimizer::RmsProp {
            lr,
            rho,
            epsilon,
            momentum,
            centered,
        } => {
            num(&mut o, e, "lr", lr);
            num(&mut o, e, "rho", rho);
            num(&mut o, e, "epsilon", epsilon);
            num(&mut o, e, "momentum", momentum);
            flag(&mut o, e, "centered", centered);
        }
        Optimizer::Adam {
            lr,
            beta_1,
            beta_2,
            epsilon,
        }
        | Optimizer::AdamW {
            lr,
            beta_1,
            beta_2,
            epsilon,
            ..
        } => {
            num(&mut o, e, "lr", lr);
            num(&mut o, e, "beta_1", beta_1);
            num(&mut o, e, "beta_2", beta_2);
            num(&mut o, e, "epsilon", epsilon);
        }
        Optimizer::Sgd { .. } => {}
    }
    if let Optimizer::AdamW { weight_decay, .. } = &mut opt {
        num(&mut o, e, "weight_decay", weight_decay);
    }
    o.finish(e);
    // Keras's SGD(momentum=0.9) is the momentum optimizer.
    Some(match opt {
        Optimizer::Momentum {
            lr,
            momentum,
            nesterov,
        } if !(momentum > 0.0 || nesterov) => Optimizer::Sgd { lr },
        other => other,
    })
}

const LOSS_HELP: &str = "expected a loss like `sparse_categorical_crossentropy`, or a sum of terms like `binary_crossentropy(decoded, pixels, reduction = sum) + kl_normal(z_mean, z_log_var)`";

/// Reads `a + b`, `0.5 * a`, `a(x, y, reduction = sum, weight = 2.0)` into terms.
fn loss(expr: &Expr, weight: f32, out: &mut Vec<LossDecl>, e: &mut Errors) {
    let env = Env::new();
    match expr {
        Expr::Paren(p) => loss(&p.expr, weight, out, e),
        Expr::Binary(b) if matches!(b.op, BinOp::Add(_)) => {
            loss(&b.left, weight, out, e);
            loss(&b.right, weight, out, e);
        }
        Expr::Binary(b) if matches!(b.op, BinOp::Mul(_)) => {
            let (num, term) =
                match (eval_expr(&b.left, &env), eval_expr(&b.right, &env)) {
                    (Ok(l), _) if matches!(l.v, V::Int(_) | V::Float(_)) => (l, &b.right),
                    (_, Ok(r)) if matches!(r.v, V::Int(_) | V::Float(_)) => (r, &b.left),
                    _ => return e.at(
                        expr,
                        "a loss term is weighted by a number: `0.5 * kl_normal(z_mean, z_log_var)`",
                    ),
                };
            let w = e.ok(float(&num, "weight")).unwrap_or(1.0);
            loss(term, weight * w, out, e);
        }
        _ => {
            let Some((name, args)) = call(expr) else {
                return e.at(expr, LOSS_HELP);
            };
            let Some(kind) = LossKind::parse(&name) else {
                let extra = if name == "categorical_crossentropy" {
                    "\n= help: one-hot targets are not supported; use `sparse_categorical_crossentropy` with integer labels".to_string()
                } else {
                    format!("\n= note: expected one of {}", list_names(LOSSES))
                };
                return e.at(
                    expr,
                    format!(
                        "unknown loss `{name}`{}{extra}",
                        did_you_mean(&name, LOSS_SPELLINGS)
                    ),
                );
            };
            let mut term = LossTerm::new(kind);
            let mut o = Opts::new(
                format!("loss `{}`", kind.name()),
                expr.to_token_stream(),
                args,
                &env,
            );
            let default_reduction = term.reduction;
            term.reduction = o.read("reduction", &[], None, default_reduction, e, |v, what| {
                word(v, what, &["mean", "sum"]).map(|w| {
                    if w == "sum" {
                        Reduction::SumOverFeatures
                    } else {
                        Reduction::Mean
                    }
                })
            });
            term.weight = weight * o.read("weight", &[], None, term.weight, e, float);
            let mut inputs = Vec::new();
            for a in o.rest_positional(0, "fields") {
                if let Some(v) = e.ok(eval(&a.value, &env)) {
                    inputs.extend(e.ok(crate::value::refs(&v)).unwrap_or_default());
                }
            }
            o.finish(e);
            let (what, ok) = match kind {
                LossKind::KlNormal => ("`(mean, log_var)`", inputs.len() == 2),
                _ => (
                    "`(prediction, target)`, or none for the last layer and the remaining input",
                    inputs.is_empty() || inputs.len() == 2,
                ),
            };
            if !ok {
                e.at(
                    expr,
                    format!(
                        "loss `{}` reads {what}, found {} field{}",
                        kind.name(),
                        inputs.len(),
                        if inputs.len() == 1 { "" } else { "s" }
                    ),
                );
            }
            out.push(LossDecl { term, inputs });
        }
    }
}
