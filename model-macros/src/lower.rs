//! Lowering: fields (and the blocks they instantiate) into the planner's `ModelSpec` —
//! layer names, resolved inputs, checkpoint segments, precision overrides — plus the tree of
//! handles that `layers()` builds.
use std::collections::HashMap;

use memwise_plan::{DType, LayerKind, LayerSpec, ModelSpec};
use proc_macro2::TokenStream;

use crate::diag::{did_you_mean, Errors};
use crate::fields::{BlockParam, FieldDecl, FieldKind};
use crate::layer::{self, lower_layer};
use crate::model_args::ModelArgs;
use crate::value::{eval, refs, split_args, Env, FieldRef, Val, V};

/// A `#[memwise::block]` definition, as read from its tokens.
pub struct BlockDef {
    pub name: String,
    pub params: Vec<BlockParam>,
    pub fields: Vec<FieldDecl>,
    /// False when the definition has errors (reported where it is declared).
    pub valid: bool,
}

/// What `layers()` builds for one field.
pub enum Handle {
    Layer {
        handle: &'static str,
        name: String,
    },
    Array(Vec<Handle>),
    Block {
        path: syn::Path,
        fields: Vec<Handle>,
    },
}

/// The result of lowering a model.
pub struct Lowered {
    pub spec: ModelSpec,
    /// For each spec layer, the index of the model field it comes from.
    pub owner: Vec<usize>,
    pub handles: Vec<Handle>,
    /// Some block it uses is invalid (its errors were reported at its definition).
    pub incomplete: bool,
}

/// Inherited from an enclosing block field.
#[derive(Clone, Copy, Default)]
struct Inherit {
    segment: Option<u32>,
    dtype: Option<DType>,
}

struct Lowerer<'a> {
    blocks: &'a HashMap<String, BlockDef>,
    /// Fields the loss names as its targets (`mse(out, target)` → `target`).
    loss_targets: Vec<String>,
    layers: Vec<LayerSpec>,
    owner: Vec<usize>,
    next_segment: u32,
    stack: Vec<String>,
    incomplete: bool,
    e: &'a mut Errors,
}

/// The fields of a model or of one block instance, and what they inherit.
struct Scope<'s> {
    fields: &'s [FieldDecl],
    env: &'s Env,
    /// Prefix of the layer names (`blocks.3.`).
    prefix: &'s str,
    /// The block's input (None for the model).
    input: Option<String>,
    inherit: Inherit,
    /// The model field everything here belongs to (None: each model field owns itself).
    owner: Option<usize>,
    /// The model's or block's name, for messages.
    name: &'s str,
}

/// What the fields of a scope lowered so far leave for the next ones.
#[derive(Default)]
struct Progress {
    /// Each field's output layer.
    outputs: Vec<Option<String>>,
    handles: Vec<Handle>,
    /// The layer the next field reads by default.
    prev: Option<String>,
    /// The field above, when it is an `#[input]`: its name and dtype.
    prev_input: Option<(String, DType)>,
    /// The current run of `#[checkpoint]` fields and its segment.
    run: Option<(RunKey, u32)>,
    /// Explicit segment numbers used, and the field where each ended.
    explicit_used: HashMap<i64, String>,
    /// Names some layer of this scope reads so far.
    read: Vec<String>,
}

impl Handle {
    /// A field's handle: an array for `[T; N]`, else its one element.
    fn of(f: &FieldDecl, mut elems: Vec<Handle>) -> Handle {
        if f.repeat.is_some() {
            Handle::Array(elems)
        } else {
            elems.pop().expect("one")
        }
    }
}

/// A run of `#[checkpoint]` fields: bare, or `segment = N`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RunKey {
    Bare,
    Explicit(i64),
}

pub fn lower(
    name: &str,
    args: &ModelArgs,
    fields: &[FieldDecl],
    blocks: &HashMap<String, BlockDef>,
    e: &mut Errors,
) -> Lowered {
    let loss_targets = args
        .loss
        .iter()
        .filter(|d| d.term.kind != memwise_plan::LossKind::KlNormal)
        .filter_map(|d| d.inputs.get(1).map(|r| r.name.clone()))
        .collect();
    let mut l = Lowerer::new(blocks, loss_targets, e);
    let (handles, outputs, _) = l.scope(&Scope {
        fields,
        env: &Env::new(),
        prefix: "",
        input: None,
        inherit: Inherit::default(),
        owner: None,
        name,
    });

    // Loss terms read any field (the loss runs after every layer).
    let mut loss = Vec::new();
    for decl in &args.loss {
        let mut term = decl.term.clone();
        for r in &decl.inputs {
            match fields.iter().position(|f| f.name == r.name) {
                Some(i) => {
                    if let Some(out) = &outputs[i] {
                        term.inputs.push(out.clone());
                    }
                }
                None => l.e.at(
                    &r.tokens,
                    format!(
                        "no field `{}` in `{name}`{}",
                        r.name,
                        did_you_mean(&r.name, fields.iter().map(|f| f.name.as_str()))
                    ),
                ),
            }
        }
        loss.push(term);
    }
    let pipeline = pipeline(args, fields, &l.layers, &l.owner, l.e);
    let spec = ModelSpec {
        name: name.to_string(),
        batch: args.batch,
        precision: args.precision,
        optimizer: args.optimizer,
        loss,
        metrics: args.metrics.clone(),
        layers: l.layers,
        budget: args.budget.as_ref().map(|b| b.0),
        replicas: args.replicas,
        sharding: args.sharding,
        replica_range: args.replica_range,
        pipeline,
    };
    Lowered {
        spec,
        owner: l.owner,
        handles,
        incomplete: l.incomplete,
    }
}

/// The model's pipeline: the first layer of each field marked `#[stage(k)]` begins stage k
/// (stages numbered in field order from 0), with the attribute's micro-batches and schedule;
/// `None` for a model declared on one device.
fn pipeline(
    args: &ModelArgs,
    fields: &[FieldDecl],
    layers: &[LayerSpec],
    owner: &[usize],
    e: &mut Errors,
) -> Option<memwise_plan::stage::Pipeline> {
    let mut boundaries = Vec::new();
    let mut current = 0usize;
    for (i, f) in fields.iter().enumerate() {
        let Some((k, tokens)) = &f.stage else {
            continue;
        };
        if let Some((_, stages)) = &args.pipeline.stages {
            e.at(stages, "the split is declared twice: `stages = …` chooses it, `#[stage(k)]` on fields says it; keep one");
            return None;
        }
        if *k == current {
            continue;
        }
        if *k != current + 1 {
            e.at(tokens, format!("stages are numbered in field order from 0: after stage {current}, the next `#[stage]` is `#[stage({})]`", current + 1));
            return None;
        }
        current = *k;
        let Some(first) = owner.iter().position(|&o| o == i) else {
            continue;
        };
        boundaries.push(layers[first].name.as_str());
    }
    let declared = !boundaries.is_empty()
        || args.pipeline.micro_batches.is_some()
        || args.pipeline.schedule.is_some();
    (declared || args.pipeline.stages.is_some()).then(|| {
        memwise_plan::stage::Pipeline::new(
            args.pipeline
                .schedule
                .unwrap_or(memwise_plan::pipeline::PipelineSchedule::OneFOneB),
            args.pipeline.micro_batches.as_ref().map_or(1, |m| m.0),
            &boundaries,
        )
    })
}

impl<'a> Lowerer<'a> {
    fn new(
        blocks: &'a HashMap<String, BlockDef>,
        loss_targets: Vec<String>,
        e: &'a mut Errors,
    ) -> Self {
        Lowerer {
            blocks,
            loss_targets,
            layers: Vec::new(),
            owner: Vec::new(),
            next_segment: 0,
            stack: Vec::new(),
            incomplete: false,
            e,
        }
    }

    /// A layer that reads the field above it implicitly, when that field is an integer input
    /// (labels, token ids: only an embedding reads those), or the loss's target while another
    /// input above is read by nothing (an autoencoder's input is its target, and is read),
    /// almost certainly meant another input: say so, and which `from = …` to write.
    fn check_implicit_input(
        &mut self,
        f: &FieldDecl,
        attr: &str,
        above: &str,
        dtype: DType,
        earlier: &[FieldDecl],
        read: &[String],
    ) {
        let unread = |g: &&FieldDecl| {
            g.is_input()
                && g.name != above
                && !self.loss_targets.contains(&g.name)
                && !read.contains(&g.name)
        };
        let what = if dtype == DType::I32 && attr != "embedding" {
            "an integer input (labels or token ids, which only an `embedding` reads)"
        } else if self.loss_targets.iter().any(|t| t == above) && earlier.iter().any(|g| unread(&g))
        {
            "the loss's target"
        } else {
            return;
        };
        let other = earlier.iter().rev().find(unread).map_or_else(
            || "name the input it reads with `from = …`".to_string(),
            |g| format!("add `from = {}` (or name another field)", g.name),
        );
        self.e.at(
            &f.anchor,
            format!(
                "`{}` reads the field above it, `{above}`, which is {what}: {other}",
                f.name
            ),
        );
    }

    /// Lowers the fields of a model or of one block instance. Returns the handles, each
    /// field's output layer, and the last.
    fn scope(&mut self, sc: &Scope<'_>) -> (Vec<Handle>, Vec<Option<String>>, Option<String>) {
        let mut p = Progress {
            prev: sc.input.clone(),
            ..Progress::default()
        };
        for (i, f) in sc.fields.iter().enumerate() {
            let above_input = p.prev_input.take();
            let dtype = f.dtype.as_ref().map(|d| d.0).or(sc.inherit.dtype);
            match &f.kind {
                FieldKind::Layer { attr, args } => {
                    self.layer_field(sc, &mut p, i, (attr.as_str(), args), dtype, above_input)
                }
                FieldKind::Block { path, key, args } => {
                    p.run = None;
                    self.block_field(sc, &mut p, i, (path, key, args), dtype)
                }
            }
        }
        (p.handles, p.outputs, p.prev)
    }

    /// The layer that field `i` of the scope names with `r`: a field above it, or the
    /// block's `input`.
    fn resolve(&mut self, sc: &Scope<'_>, p: &Progress, i: usize, r: &FieldRef) -> Option<String> {
        let f = &sc.fields[i];
        if sc.input.is_some() && r.name == "input" {
            return sc.input.clone();
        }
        match sc.fields.iter().position(|g| g.name == r.name) {
            Some(j) if j < i => p.outputs[j].clone(),
            Some(j) if j == i => {
                self.e
                    .at(&r.tokens, format!("field `{}` cannot read itself", f.name));
                None
            }
            Some(_) => {
                self.e.at(
                    &r.tokens,
                    format!(
                        "`{}` is declared after `{}`: a layer reads only fields declared above it",
                        r.name, f.name
                    ),
                );
                None
            }
            None => {
                let mut names: Vec<&str> = sc.fields[..i].iter().map(|g| g.name.as_str()).collect();
                if sc.input.is_some() {
                    names.push("input");
                }
                self.e.at(
                    &r.tokens,
                    format!(
                        "no field `{}` in `{}`{}",
                        r.name,
                        sc.name,
                        did_you_mean(&r.name, names)
                    ),
                );
                None
            }
        }
    }

    /// Field `i`, a layer attribute (or an array of layers).
    fn layer_field(
        &mut self,
        sc: &Scope<'_>,
        p: &mut Progress,
        i: usize,
        (attr, args): (&str, &TokenStream),
        dtype: Option<DType>,
        above_input: Option<(String, DType)>,
    ) {
        let f = &sc.fields[i];
        let args = split_args(args.clone(), self.e);
        let decl = lower_layer(attr, f.anchor.clone(), args, sc.env, self.e);
        let is_input = matches!(decl.kind, LayerKind::Input { .. });
        let mut inputs: Vec<String> = Vec::new();
        if decl.inputs.is_empty() && !is_input {
            if let Some((above, dt)) = &above_input {
                self.check_implicit_input(f, attr, above, *dt, &sc.fields[..i], &p.read);
            }
            match &p.prev {
                Some(prev) => inputs.push(prev.clone()),
                None => self.e.at(
                    &f.anchor,
                    format!("`{}` reads the field above it, but it is the first field: declare an `#[input(shape = …)]` first, or name its input with `from = …`", f.name),
                ),
            }
        }
        for r in &decl.inputs {
            if let Some(n) = self.resolve(sc, p, i, r) {
                inputs.push(n);
            }
        }
        p.read.extend(inputs.iter().cloned());
        let segment = self.field_segment(sc, p, f);
        let handle = layer::info(attr).expect("known").handle;
        let own = sc.owner.unwrap_or(i);
        let mut elems = Vec::new();
        for k in 0..f.repeat.unwrap_or(1) {
            let name = match f.repeat {
                Some(_) => format!("{}{}.{k}", sc.prefix, f.name),
                None => format!("{}{}", sc.prefix, f.name),
            };
            let layer_inputs = if k == 0 {
                inputs.clone()
            } else {
                vec![p.prev.clone().unwrap_or_default()]
            };
            self.push(
                LayerSpec {
                    name: name.clone(),
                    kind: decl.kind.clone(),
                    inputs: layer_inputs,
                    dtype,
                    checkpoint: segment,
                    recompute_output: f.recompute_output.is_some(),
                },
                own,
            );
            elems.push(Handle::Layer {
                handle,
                name: name.clone(),
            });
            p.prev = Some(name);
        }
        p.prev_input = match &decl.kind {
            LayerKind::Input { dtype, .. } => Some((f.name.clone(), *dtype)),
            _ => None,
        };
        p.outputs.push(p.prev.clone());
        p.handles.push(Handle::of(f, elems));
    }

    /// The checkpoint segment of a layer field: the enclosing block's, or its own run's
    /// (consecutive `#[checkpoint]` fields with the same key share one).
    fn field_segment(&mut self, sc: &Scope<'_>, p: &mut Progress, f: &FieldDecl) -> Option<u32> {
        if let Some(s) = sc.inherit.segment {
            return Some(s);
        }
        let Some(cp) = &f.checkpoint else {
            p.run = None;
            return None;
        };
        let key = cp.segment.map_or(RunKey::Bare, RunKey::Explicit);
        let segment = match p.run {
            Some((k, id)) if k == key => id,
            _ => {
                if let RunKey::Explicit(n) = key {
                    if let Some(other) = p.explicit_used.get(&n) {
                        self.e.at(
                            &cp.tokens,
                            format!("checkpoint segment {n} already ended at `{other}`: a segment is a run of consecutive fields; use another number"),
                        );
                    }
                }
                let id = self.new_segment();
                p.run = Some((key, id));
                id
            }
        };
        if let Some(n) = cp.segment {
            p.explicit_used.insert(n, f.name.clone());
        }
        Some(segment)
    }

    /// Field `i`, a `#[block]` (or an array of block instances).
    fn block_field(
        &mut self,
        sc: &Scope<'_>,
        p: &mut Progress,
        i: usize,
        (path, key, args): (&syn::Path, &String, &TokenStream),
        dtype: Option<DType>,
    ) {
        let f = &sc.fields[i];
        let def = match self.blocks.get(key) {
            // Not collected (the callback failed to find it: already an error), or with
            // errors reported at its definition.
            None => None,
            Some(def) if !def.valid => None,
            Some(def) => Some(def),
        };
        let Some(def) = def else {
            self.incomplete = true;
            p.outputs.push(None);
            p.prev = None;
            return;
        };
        if self.stack.contains(key) {
            self.e
                .at(&f.anchor, format!("block `{}` contains itself", def.name));
            self.incomplete = true;
            p.outputs.push(None);
            return;
        }
        let (from, block_env) = self.block_args(sc, p, i, def, args);
        let Some(block_input) = from.or_else(|| p.prev.clone()) else {
            self.e.at(&f.anchor, format!("block field `{}` has no input: declare an `#[input(shape = …)]` above it, or name one with `from = …`", f.name));
            p.outputs.push(None);
            return;
        };
        self.stack.push(key.clone());
        let mut elems = Vec::new();
        let mut instance_input = Some(block_input);
        for k in 0..f.repeat.unwrap_or(1) {
            let prefix = match f.repeat {
                Some(_) => format!("{}{}.{k}.", sc.prefix, f.name),
                None => format!("{}{}.", sc.prefix, f.name),
            };
            // A checkpointed block is one segment per instance.
            let segment = sc
                .inherit
                .segment
                .or_else(|| f.checkpoint.as_ref().map(|_| self.new_segment()));
            let inner = Scope {
                fields: &def.fields,
                env: &block_env,
                prefix: &prefix,
                input: instance_input.clone(),
                inherit: Inherit { segment, dtype },
                owner: Some(sc.owner.unwrap_or(i)),
                name: &def.name,
            };
            let (inner_handles, _, last) = self.scope(&inner);
            elems.push(Handle::Block {
                path: path.clone(),
                fields: inner_handles,
            });
            instance_input = last;
        }
        self.stack.pop();
        p.prev = instance_input;
        p.outputs.push(p.prev.clone());
        p.handles.push(Handle::of(f, elems));
    }

    /// A block field's arguments: its `from`, and the environment of the block's
    /// parameters (given, defaulted, or unknown after an error).
    fn block_args(
        &mut self,
        sc: &Scope<'_>,
        p: &Progress,
        i: usize,
        def: &BlockDef,
        args: &TokenStream,
    ) -> (Option<String>, Env) {
        let mut from: Option<String> = None;
        let mut block_env = Env::new();
        let mut given: Vec<String> = Vec::new();
        let mut unknown: Vec<String> = Vec::new();
        for a in split_args(args.clone(), self.e) {
            let Some(n) = a.name() else {
                self.e.at(
                    &a.tokens,
                    format!(
                        "block arguments are named: `#[block({})]`",
                        example_args(&def.params)
                    ),
                );
                continue;
            };
            if given.contains(&n) {
                self.e.at(&a.tokens, format!("`{n}` is given twice"));
                continue;
            }
            given.push(n.clone());
            let Some(v) = self.e.ok(eval(&a.value, sc.env)) else {
                continue;
            };
            if n == "from" {
                match self.e.ok(refs(&v)) {
                    Some(rs) if rs.len() == 1 => from = self.resolve(sc, p, i, &rs[0]),
                    Some(_) => self
                        .e
                        .at(&v.tokens, "a block reads one field: `from = stem`"),
                    None => {}
                }
            } else if def.params.iter().any(|p| p.name == n) {
                block_env.insert(n, v);
            } else {
                unknown.push(n.clone());
                let names: Vec<&str> = def
                    .params
                    .iter()
                    .map(|p| p.name.as_str())
                    .chain(["from"])
                    .collect();
                self.e.at(
                    a.name.as_ref().expect("named"),
                    format!(
                        "block `{}` has no parameter `{n}`{}",
                        def.name,
                        did_you_mean(&n, names.iter().copied())
                    ),
                );
            }
        }
        self.default_params(&sc.fields[i], def, &unknown, &mut block_env);
        (from, block_env)
    }

    /// Gives every parameter of `def` not in `env` its default; one without is missing (an
    /// error) unless it was misspelt (already reported as such).
    fn default_params(&mut self, f: &FieldDecl, def: &BlockDef, unknown: &[String], env: &mut Env) {
        for p in &def.params {
            if env.contains_key(&p.name) {
                continue;
            }
            let unknown_value = Val {
                v: V::Unknown,
                tokens: p.tokens.clone(),
            };
            match &p.default {
                Some(d) => {
                    env.insert(p.name.clone(), d.clone());
                }
                // Misspelt, and reported as such.
                None if unknown
                    .iter()
                    .any(|u| crate::diag::closest(u, [p.name.as_str()]).is_some()) =>
                {
                    env.insert(p.name.clone(), unknown_value);
                }
                None => {
                    self.e.at(
                        &f.anchor,
                        format!(
                            "block `{}` needs `{}`: `#[block({})]`",
                            def.name,
                            p.name,
                            example_args(&def.params)
                        ),
                    );
                    env.insert(p.name.clone(), unknown_value);
                }
            }
        }
    }

    fn new_segment(&mut self) -> u32 {
        self.next_segment += 1;
        self.next_segment - 1
    }

    fn push(&mut self, l: LayerSpec, owner: usize) {
        self.layers.push(l);
        self.owner.push(owner);
    }
}

fn example_args(params: &[BlockParam]) -> String {
    params
        .iter()
        .map(|p| match &p.default {
            Some(d) => format!("{} = {}", p.name, d.tokens),
            None => format!("{} = …", p.name),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Checks a block definition on its own: every option that does not depend on a parameter
/// without default, every reference. Parameters without defaults are unknown here.
pub fn check_block(def: &BlockDef, e: &mut Errors) {
    let mut env = Env::new();
    for p in &def.params {
        let v = p.default.clone().unwrap_or(Val {
            v: V::Unknown,
            tokens: p.tokens.clone(),
        });
        env.insert(p.name.clone(), v);
    }
    let blocks = HashMap::new();
    let mut l = Lowerer::new(&blocks, Vec::new(), e);
    let _ = l.scope(&Scope {
        fields: &def.fields,
        env: &env,
        prefix: "",
        input: Some("input".into()),
        inherit: Inherit::default(),
        owner: Some(0),
        name: &def.name,
    });
}
