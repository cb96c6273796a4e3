//! Lowering: fields (and the blocks they instantiate) into the planner's `ModelSpec` —
//! layer names, resolved inputs, checkpoint segments, precision overrides — plus the tree of
//! handles that `layers()` builds.
use std::collections::HashMap;

use memwise_plan::{DType, LayerKind, LayerSpec, ModelSpec};

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
    let mut l = Lowerer {
        blocks,
        loss_targets: args
            .loss
            .iter()
            .filter(|d| d.term.kind != memwise_plan::LossKind::KlNormal)
            .filter_map(|d| d.inputs.get(1).map(|r| r.name.clone()))
            .collect(),
        layers: Vec::new(),
        owner: Vec::new(),
        next_segment: 0,
        stack: Vec::new(),
        incomplete: false,
        e,
    };
    let (handles, outputs, _) = l.scope(
        fields,
        &Env::new(),
        "",
        None,
        Inherit::default(),
        None,
        name,
    );

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
    let spec = ModelSpec {
        name: name.to_string(),
        batch: args.batch,
        precision: args.precision,
        optimizer: args.optimizer,
        loss,
        metrics: args.metrics.clone(),
        layers: l.layers,
        budget: args.budget.as_ref().map(|b| b.0),
    };
    Lowered {
        spec,
        owner: l.owner,
        handles,
        incomplete: l.incomplete,
    }
}

impl Lowerer<'_> {
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

    /// Lowers the fields of a model or of one block instance. `input` is the block's input
    /// (None for the model); `owner` the model field everything here belongs to (None: each
    /// model field owns itself). Returns the handles, each field's output layer, and the last.
    #[allow(clippy::too_many_arguments)]
    fn scope(
        &mut self,
        fields: &[FieldDecl],
        env: &Env,
        prefix: &str,
        input: Option<String>,
        inherit: Inherit,
        owner: Option<usize>,
        scope_name: &str,
    ) -> (Vec<Handle>, Vec<Option<String>>, Option<String>) {
        let in_block = input.is_some();
        let mut outputs: Vec<Option<String>> = Vec::new();
        let mut handles = Vec::new();
        let mut prev: Option<String> = input.clone();
        // The field above, when it is an `#[input]`: its name and dtype.
        let mut prev_input: Option<(String, DType)> = None;
        let mut run: Option<(RunKey, u32)> = None;
        let mut explicit_used: HashMap<i64, String> = HashMap::new();

        // Names some layer of this scope reads so far.
        let mut read: Vec<String> = Vec::new();
        for (i, f) in fields.iter().enumerate() {
            let above_input = prev_input.take();
            let own = owner.unwrap_or(i);
            let dtype = f.dtype.as_ref().map(|d| d.0).or(inherit.dtype);
            let resolve = |me: &mut Self, r: &FieldRef| -> Option<String> {
                if in_block && r.name == "input" {
                    return input.clone();
                }
                match fields.iter().position(|g| g.name == r.name) {
                    Some(j) if j < i => outputs[j].clone(),
                    Some(j) if j == i => {
                        me.e.at(&r.tokens, format!("field `{}` cannot read itself", f.name));
                        None
                    }
                    Some(_) => {
                        me.e.at(
                            &r.tokens,
                            format!("`{}` is declared after `{}`: a layer reads only fields declared above it", r.name, f.name),
                        );
                        None
                    }
                    None => {
                        let mut names: Vec<&str> =
                            fields[..i].iter().map(|g| g.name.as_str()).collect();
                        if in_block {
                            names.push("input");
                        }
                        me.e.at(
                            &r.tokens,
                            format!(
                                "no field `{}` in `{scope_name}`{}",
                                r.name,
                                did_you_mean(&r.name, names)
                            ),
                        );
                        None
                    }
                }
            };

            match &f.kind {
                FieldKind::Layer { attr, args } => {
                    let args = split_args(args.clone(), self.e);
                    let decl = lower_layer(attr, f.anchor.clone(), args, env, self.e);
                    let is_input = matches!(decl.kind, LayerKind::Input { .. });
                    let mut inputs: Vec<String> = Vec::new();
                    if decl.inputs.is_empty() && !is_input {
                        if let Some((above, dt)) = &above_input {
                            self.check_implicit_input(f, attr, above, *dt, &fields[..i], &read);
                        }
                        match &prev {
                            Some(p) => inputs.push(p.clone()),
                            None => self.e.at(
                                &f.anchor,
                                format!("`{}` reads the field above it, but it is the first field: declare an `#[input(shape = …)]` first, or name its input with `from = …`", f.name),
                            ),
                        }
                    }
                    for r in &decl.inputs {
                        if let Some(n) = resolve(self, r) {
                            inputs.push(n);
                        }
                    }
                    read.extend(inputs.iter().cloned());
                    let segment = match (inherit.segment, &f.checkpoint) {
                        (Some(s), _) => Some(s),
                        (None, None) => {
                            run = None;
                            None
                        }
                        (None, Some(cp)) => {
                            let key = cp.segment.map_or(RunKey::Bare, RunKey::Explicit);
                            match run {
                                Some((k, id)) if k == key => Some(id),
                                _ => {
                                    if let RunKey::Explicit(n) = key {
                                        if let Some(other) = explicit_used.get(&n) {
                                            self.e.at(
                                                &cp.tokens,
                                                format!("checkpoint segment {n} already ended at `{other}`: a segment is a run of consecutive fields; use another number"),
                                            );
                                        }
                                    }
                                    let id = self.new_segment();
                                    run = Some((key, id));
                                    Some(id)
                                }
                            }
                        }
                    };
                    if let (Some(cp), None) = (&f.checkpoint, inherit.segment) {
                        if let Some(n) = cp.segment {
                            explicit_used.insert(n, f.name.clone());
                        }
                    }
                    let handle = layer::info(attr).expect("known").handle;
                    let count = f.repeat.unwrap_or(1);
                    let mut elems = Vec::new();
                    for k in 0..count {
                        let name = match f.repeat {
                            Some(_) => format!("{prefix}{}.{k}", f.name),
                            None => format!("{prefix}{}", f.name),
                        };
                        let layer_inputs = if k == 0 {
                            inputs.clone()
                        } else {
                            vec![prev.clone().unwrap_or_default()]
                        };
                        self.push(
                            LayerSpec {
                                name: name.clone(),
                                kind: decl.kind.clone(),
                                inputs: layer_inputs,
                                dtype,
                                checkpoint: segment,
                            },
                            own,
                        );
                        elems.push(Handle::Layer {
                            handle,
                            name: name.clone(),
                        });
                        prev = Some(name);
                    }
                    prev_input = match &decl.kind {
                        LayerKind::Input { dtype, .. } => Some((f.name.clone(), *dtype)),
                        _ => None,
                    };
                    outputs.push(prev.clone());
                    handles.push(if f.repeat.is_some() {
                        Handle::Array(elems)
                    } else {
                        elems.pop().expect("one")
                    });
                }
                FieldKind::Block { path, key, args } => {
                    run = None;
                    let Some(def) = self.blocks.get(key) else {
                        // Not collected: the callback failed to find it (already an error).
                        self.incomplete = true;
                        outputs.push(None);
                        prev = None;
                        continue;
                    };
                    if !def.valid {
                        self.incomplete = true;
                        outputs.push(None);
                        prev = None;
                        continue;
                    }
                    if self.stack.contains(key) {
                        self.e
                            .at(&f.anchor, format!("block `{}` contains itself", def.name));
                        self.incomplete = true;
                        outputs.push(None);
                        continue;
                    }
                    // Arguments: `from`, and the block's parameters.
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
                        let Some(v) = self.e.ok(eval(&a.value, env)) else {
                            continue;
                        };
                        if n == "from" {
                            match self.e.ok(refs(&v)) {
                                Some(rs) if rs.len() == 1 => from = resolve(self, &rs[0]),
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
                    for p in &def.params {
                        if block_env.contains_key(&p.name) {
                            continue;
                        }
                        match &p.default {
                            Some(d) => {
                                block_env.insert(p.name.clone(), d.clone());
                            }
                            // Misspelt, and reported as such.
                            None if unknown
                                .iter()
                                .any(|u| crate::diag::closest(u, [p.name.as_str()]).is_some()) =>
                            {
                                block_env.insert(
                                    p.name.clone(),
                                    Val {
                                        v: V::Unknown,
                                        tokens: p.tokens.clone(),
                                    },
                                );
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
                                block_env.insert(
                                    p.name.clone(),
                                    Val {
                                        v: V::Unknown,
                                        tokens: p.tokens.clone(),
                                    },
                                );
                            }
                        }
                    }
                    let block_input = from.or_else(|| prev.clone());
                    if block_input.is_none() {
                        self.e.at(&f.anchor, format!("block field `{}` has no input: declare an `#[input(shape = …)]` above it, or name one with `from = …`", f.name));
                        outputs.push(None);
                        continue;
                    }
                    self.stack.push(key.clone());
                    let count = f.repeat.unwrap_or(1);
                    let mut elems = Vec::new();
                    let mut instance_input = block_input;
                    for k in 0..count {
                        let inner_prefix = match f.repeat {
                            Some(_) => format!("{prefix}{}.{k}.", f.name),
                            None => format!("{prefix}{}.", f.name),
                        };
                        // A checkpointed block is one segment per instance.
                        let segment = inherit
                            .segment
                            .or_else(|| f.checkpoint.as_ref().map(|_| self.new_segment()));
                        let inner = Inherit { segment, dtype };
                        let (inner_handles, _, last) = self.scope(
                            &def.fields,
                            &block_env,
                            &inner_prefix,
                            instance_input.clone(),
                            inner,
                            Some(own),
                            &def.name,
                        );
                        elems.push(Handle::Block {
                            path: path.clone(),
                            fields: inner_handles,
                        });
                        instance_input = last;
                    }
                    self.stack.pop();
                    prev = instance_input;
                    outputs.push(prev.clone());
                    handles.push(if f.repeat.is_some() {
                        Handle::Array(elems)
                    } else {
                        elems.pop().expect("one")
                    });
                }
            }
        }
        (handles, outputs, prev)
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
    let mut l = Lowerer {
        blocks: &blocks,
        loss_targets: Vec::new(),
        layers: Vec::new(),
        owner: Vec::new(),
        next_segment: 0,
        stack: Vec::new(),
        incomplete: false,
        e,
    };
    let _ = l.scope(
        &def.fields,
        &env,
        "",
        Some("input".into()),
        Inherit::default(),
        Some(0),
        &def.name,
    );
}
