//! `StaticPlan` and `MemoryReport`: the planner's output, in types that can be `const`
//! (every list is a `Cow<'static, [T]>`), so the macro can bake them into the user's crate.
//! Also their plan-JSON form (`memwise.plan/1`) and their Rust-literal form (for the macro).

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::data_parallel::{shard_elems, shard_range, Sharding};
use crate::dtype::{DType, Precision};
use crate::op::{Op, Window2d};
use crate::pipeline::PipelineSchedule;
use crate::spec::{
    LayerSpec, LossKind, LossTerm, Metric, ModelSpec, Optimizer, Padding, Reduction,
};
use crate::stage::Pipeline;

/// A string that is `&'static str` in a const plan and `String` in a run-time one.
pub type Text = Cow<'static, str>;
/// A list that is `&'static [T]` in a const plan and `Vec<T>` in a run-time one.
pub type List<T> = Cow<'static, [T]>;

/// Marks an absent tensor in a step's positional `reads`/`writes`, or an absent offset.
pub const NONE: u32 = u32::MAX;
/// An absent persistent offset.
pub const NO_OFFSET: u64 = u64::MAX;

/// What a transient tensor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Activation,
    ActivationGrad,
    Workspace,
    Input,
    Recomputed,
}

impl Role {
    pub const fn name(self) -> &'static str {
        match self {
            Role::Activation => "activation",
            Role::ActivationGrad => "activation_grad",
            Role::Workspace => "workspace",
            Role::Input => "input",
            Role::Recomputed => "recomputed",
        }
    }
}

/// The phase a step belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Forward,
    Recompute,
    Loss,
    Backward,
    Update,
}

impl Phase {
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Recompute => "recompute",
            Phase::Loss => "loss",
            Phase::Backward => "backward",
            Phase::Update => "update",
        }
    }
}

/// One transient tensor: where it lives in the arena and when.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanTensor {
    pub id: u32,
    pub name: Text,
    pub layer: Text,
    pub role: Role,
    pub dtype: DType,
    pub shape: List<usize>,
    /// Aligned size in bytes (≥ elements × dtype size).
    pub bytes: u64,
    pub offset: u64,
    pub first: u32,
    pub last: u32,
    /// The tensor whose bytes this one takes over in place, or [`NONE`].
    pub in_place_of: u32,
}

impl PlanTensor {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One step of the training step.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanStep {
    pub index: u32,
    pub phase: Phase,
    pub layer: Text,
    pub op: Op,
    /// Positional, as documented on [`Op`]; [`NONE`] for "not needed".
    pub reads: List<u32>,
    pub writes: List<u32>,
    /// Ids of the persistent parameters this step uses (weights, bias, statistics).
    pub params: List<u32>,
    /// The micro-batch whose tensors the step computes: 0 but in a pipeline stage's plan,
    /// whose forwards and backwards run once per micro-batch ([`crate::stage`]). Its random
    /// streams start where that micro-batch's rows do in the whole batch's.
    pub micro_batch: u32,
}

/// One persistent parameter (or non-trainable statistic) and its place in the persistent
/// region: the f32 master copy, its 16-bit copy for GEMMs (if any), gradient and
/// optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanParam {
    /// Its index among the model's parameters: its index in this plan, but in a pipeline
    /// stage's, which holds some of them ([`crate::stage`]). Initial values are keyed by it.
    pub id: u32,
    /// `layer.weight`, `layer.bias`, `layer.running_mean` …
    pub name: Text,
    pub layer: Text,
    pub shape: List<usize>,
    pub trainable: bool,
    /// Offset of the f32 values.
    pub offset: u64,
    /// 16-bit copy read by half-precision GEMMs, or `None`.
    pub half_copy: Option<DType>,
    pub half_offset: u64,
    /// f32 gradient ([`NO_OFFSET`] when not trainable).
    pub grad_offset: u64,
    /// First of `Optimizer::state_slots()` f32 copies, each `elems × 4` bytes apart.
    pub state_offset: u64,
}

impl PlanParam {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One layer's line of the memory report.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerMemory {
    pub name: Text,
    /// The DSL attribute (`dense`, `conv2d` …).
    pub kind: Text,
    pub output_shape: List<usize>,
    pub dtype: DType,
    /// Parameter count (trainable and not).
    pub params: u64,
    /// Persistent bytes of its parameters, gradients and optimizer state.
    pub persistent_bytes: u64,
    /// Bytes of its forward tensors kept for the backward pass.
    pub saved_bytes: u64,
    /// Bytes of its forward tensors dropped and recomputed (checkpointing).
    pub recomputed_bytes: u64,
    pub checkpointed: bool,
    /// Its output is remade in backward by choice (`LayerSpec::recompute_output`, in effect:
    /// a norm not checkpointed whose output a later backward reads).
    pub recomputes_output: bool,
    /// Some op of the layer writes over its input.
    pub in_place: bool,
    /// Its backward recomputes what the forward did not keep: the memory-efficient
    /// attention's probabilities ([`crate::Op::FlashAttention`]), rebuilt tile by tile;
    /// batch norm's x̂, rebuilt from the input another op keeps ([`crate::Op::BatchNorm`]'s
    /// `rebuild_x_hat`); or, in a recompute step of a layer that is not checkpointed, a u8
    /// input's float copy or a GELU/SiLU output, remade from what is kept.
    pub recomputes_in_backward: bool,
    pub forward_flops: u64,
}

/// Where one training step's memory goes. `total = params + grads + optimizer + arena`;
/// `activations_peak + workspace_peak + inputs = lower_bound` (the live bytes at the
/// peak step), and `arena - lower_bound` is what packing could not avoid.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// f32 parameters and statistics, plus 16-bit copies used by half-precision GEMMs.
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// Activations, recomputed activations and activation gradients live at the peak step.
    pub activations_peak: u64,
    /// Workspace live at the peak step.
    pub workspace_peak: u64,
    /// Input batches live at the peak step.
    pub inputs: u64,
    pub total: u64,
    pub arena: u64,
    pub lower_bound: u64,
    /// The step at which the arena's live bytes peak.
    pub peak_step: u32,
    pub layers: List<LayerMemory>,
}

impl MemoryReport {
    /// Persistent bytes: params + grads + optimizer.
    pub const fn persistent(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// The whole static plan of one training step.
#[derive(Clone, Debug, PartialEq)]
pub struct StaticPlan {
    pub model: Text,
    /// One replica's batch: the model's `batch` divided by `replicas`.
    pub batch: usize,
    /// Data-parallel replicas that each run this plan on their share of the batch, their
    /// gradients summed by the plan's `AllReduceGradients` steps (1: one device). The
    /// memory report is one replica's.
    pub replicas: usize,
    /// What the replicas split among them: with [`Sharding::OptimizerState`] (ZeRO stage 1)
    /// each parameter's optimizer state holds `⌈elems / replicas⌉` elements
    /// ([`StaticPlan::state_elems`]), the replica's shard ([`StaticPlan::shard`]).
    pub sharding: Sharding,
    pub alignment: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// A training step (forward, loss, backward, update), or an inference pass (forward and
    /// loss values only; batch norm from running statistics, no dropout).
    pub training: bool,
    /// Dynamic loss scaling is on (float16 anywhere in the model).
    pub loss_scaling: bool,
    pub arena_bytes: u64,
    pub lower_bound_bytes: u64,
    pub persistent_bytes: u64,
    pub params_count: u64,
    pub trainable_count: u64,
    pub memory: MemoryReport,
    pub tensors: List<PlanTensor>,
    pub steps: List<PlanStep>,
    pub params: List<PlanParam>,
    /// Tensor ids of the model's inputs, in declaration order.
    pub inputs: List<u32>,
    /// Tensor ids of the loss terms' scalar values.
    pub losses: List<u32>,
    /// Tensor id of the prediction the first loss term reads (for metrics), or [`NONE`].
    pub prediction: u32,
    /// Model parallel: this plan is stage `stage` of a pipeline of `stages` (0 of 1: the whole
    /// model), running `micro_batches` micro-batches of `batch` samples each per step.
    pub stage: u32,
    pub stages: u32,
    pub micro_batches: u32,
}

impl StaticPlan {
    /// A plan of nothing: no steps, no tensors, no memory. The model macro gives it to a
    /// struct whose attributes failed, so that the struct's uses type-check and one mistake
    /// reads as one error.
    pub const EMPTY: StaticPlan = StaticPlan {
        model: Cow::Borrowed(""),
        batch: 0,
        replicas: 1,
        sharding: Sharding::Replicated,
        alignment: crate::ALIGNMENT,
        precision: Precision::Float32,
        optimizer: Optimizer::RMSPROP,
        training: true,
        loss_scaling: false,
        arena_bytes: 0,
        lower_bound_bytes: 0,
        persistent_bytes: 0,
        params_count: 0,
        trainable_count: 0,
        memory: MemoryReport {
            params: 0,
            grads: 0,
            optimizer: 0,
            activations_peak: 0,
            workspace_peak: 0,
            inputs: 0,
            total: 0,
            arena: 0,
            lower_bound: 0,
            peak_step: 0,
            layers: Cow::Borrowed(&[]),
        },
        tensors: Cow::Borrowed(&[]),
        steps: Cow::Borrowed(&[]),
        params: Cow::Borrowed(&[]),
        inputs: Cow::Borrowed(&[]),
        losses: Cow::Borrowed(&[]),
        prediction: NONE,
        stage: 0,
        stages: 1,
        micro_batches: 1,
    };

    /// The elements of each of parameter `p`'s optimizer state slots on one replica: its
    /// shard's under ZeRO stage 1, all of them otherwise.
    pub fn state_elems(&self, p: &PlanParam) -> usize {
        match self.sharding {
            Sharding::Replicated => p.elems(),
            Sharding::OptimizerState | Sharding::Gradients => shard_elems(p.elems(), self.replicas),
        }
    }

    /// The elements of parameter `p` that replica `rank` updates: its shard under ZeRO
    /// stage 1, all of them otherwise. The replica's optimizer state holds them from its
    /// start.
    pub fn shard(&self, p: &PlanParam, rank: usize) -> std::ops::Range<usize> {
        match self.sharding {
            Sharding::Replicated => 0..p.elems(),
            Sharding::OptimizerState | Sharding::Gradients => {
                shard_range(p.elems(), rank, self.replicas)
            }
        }
    }

    pub fn tensor(&self, id: u32) -> &PlanTensor {
        &self.tensors[id as usize]
    }

    /// The arena's padding: `(offset, bytes)` ranges that no tensor's elements ever occupy
    /// (alignment gaps, the tail of a tensor's aligned size), in order. No kernel may read or
    /// write them; the poisoned-arena tests fill them with NaN bytes before every step.
    pub fn arena_padding(&self) -> Vec<(u64, u64)> {
        let mut used: Vec<(u64, u64)> = self
            .tensors
            .iter()
            .map(|t| (t.offset, t.offset + t.elems() as u64 * t.dtype.size()))
            .filter(|(a, b)| b > a)
            .collect();
        used.sort_unstable();
        let mut gaps = Vec::new();
        let mut covered = 0;
        for (a, b) in used {
            if a > covered {
                gaps.push((covered, a - covered));
            }
            covered = covered.max(b);
        }
        if self.arena_bytes > covered {
            gaps.push((covered, self.arena_bytes - covered));
        }
        gaps
    }

    /// Forward FLOPs of the steps in `phase` ([`Op::forward_flops`], saturating).
    pub fn phase_flops(&self, phase: Phase) -> u64 {
        self.steps
            .iter()
            .filter(|s| s.phase == phase)
            .fold(0u64, |a, s| a.saturating_add(s.op.forward_flops()))
    }

    /// FLOPs the recompute steps chosen for memory spend: those of checkpointed layers and
    /// the norm forwards that remake a `recompute_output` layer's output — what
    /// checkpointing costs. The recompute steps every plan has (a u8 input cast again, a
    /// GELU output remade from its kept input for the next layer's backward) are the plan's,
    /// not a choice's.
    pub fn checkpoint_recompute_flops(&self) -> u64 {
        let chosen = |s: &PlanStep| {
            self.memory.layers.iter().any(|l| {
                l.name == s.layer
                    && (l.checkpointed
                        || (l.recomputes_output && s.op.recomputes_output_by_choice()))
            })
        };
        self.steps
            .iter()
            .filter(|s| s.phase == Phase::Recompute && chosen(s))
            .fold(0u64, |a, s| a.saturating_add(s.op.forward_flops()))
    }

    /// What checkpointing costs, the one figure the summary and `checkpoint = auto` report:
    /// the FLOPs of the recompute steps as a percentage of the forward pass's.
    pub fn recompute_percent(&self) -> f64 {
        let forward = self.phase_flops(Phase::Forward);
        if forward == 0 {
            0.0
        } else {
            100.0 * self.checkpoint_recompute_flops() as f64 / forward as f64
        }
    }

    /// The byte range `[start, end)` of the persistent region holding every parameter's f32
    /// gradient (the estimate lays them out contiguously, each slot aligned), which a step
    /// zeroes before its backward; `(0, 0)` when nothing is trainable.
    pub fn grads_range(&self) -> (u64, u64) {
        let slots = self
            .params
            .iter()
            .filter(|p| p.grad_offset != NO_OFFSET)
            .map(|p| {
                let end =
                    p.grad_offset + crate::liveness::align_up(p.elems() as u64 * 4, self.alignment);
                (p.grad_offset, end)
            });
        slots
            .reduce(|(a0, a1), (b0, b1)| (a0.min(b0), a1.max(b1)))
            .unwrap_or((0, 0))
    }

    /// The exclusive bound on the integers tensor `id` may hold: the classes of the loss or
    /// the vocabulary of the embedding that reads it (the smallest, when several do); `None`
    /// when no step reads it as an index.
    pub fn index_limit(&self, id: u32) -> Option<usize> {
        self.steps
            .iter()
            .filter(|s| s.reads.contains(&id))
            .filter_map(|s| match s.op {
                Op::Embedding { vocab, .. } => Some(vocab),
                Op::SoftmaxCrossEntropy { classes, .. }
                | Op::SoftmaxCrossEntropyFromLogits { classes, .. } => Some(classes),
                _ => None,
            })
            .min()
    }

    /// The plan as `memwise.plan/1` JSON, the contract other tools read (what `--plan-json`
    /// writes):
    ///
    /// ```json
    /// {"schema": "memwise.plan/1", "model", "batch", "alignment", "arena_bytes",
    ///  "lower_bound_bytes",
    ///  "memory": {"params", "grads", "optimizer", "activations_peak", "workspace_peak",
    ///             "inputs", "total"},
    ///  "tensors": [{"id", "name", "layer", "role", "dtype", "shape", "bytes", "offset",
    ///               "first", "last"}],
    ///  "steps": [{"index", "phase", "layer", "op", "reads", "writes"}]}
    /// ```
    ///
    /// `role` is `activation`, `activation_grad`, `workspace`, `input` or `recomputed`;
    /// `phase` is `forward`, `recompute`, `loss`, `backward` or `update`; a tensor lives in the
    /// arena at `[offset, offset + bytes)` from step `first` to step `last`. The rules a valid
    /// plan satisfies are checked by [`crate::arena::validate`]. Persistent memory
    /// (parameters, gradients, optimizer state) is one separate region, counted in `memory`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_json_value()).unwrap_or_default()
    }

    pub fn to_json_value(&self) -> serde_json::Value {
        use serde_json::json;
        let m = &self.memory;
        let ids = |l: &[u32]| l.iter().copied().filter(|&t| t != NONE).collect::<Vec<_>>();
        let mut plan = json!({
            "schema": "memwise.plan/1",
            "model": self.model,
            "batch": self.batch,
            "alignment": self.alignment,
            "arena_bytes": self.arena_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "memory": {
                "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                "activations_peak": m.activations_peak, "workspace_peak": m.workspace_peak,
                "inputs": m.inputs, "total": m.total,
            },
            "tensors": self.tensors.iter().map(|t| json!({
                "id": t.id, "name": t.name, "layer": t.layer, "role": t.role.name(),
                "dtype": t.dtype.name(), "shape": t.shape, "bytes": t.bytes,
                "offset": t.offset, "first": t.first, "last": t.last,
            })).collect::<Vec<_>>(),
            "steps": self.steps.iter().map(|s| json!({
                "index": s.index, "phase": s.phase.name(), "layer": s.layer,
                "op": s.op.name(), "reads": ids(&s.reads), "writes": ids(&s.writes),
            })).collect::<Vec<_>>(),
        });
        // Written only for data parallelism, so one device's plan reads as it always did.
        if self.replicas > 1 {
            plan["replicas"] = json!(self.replicas);
        }
        if self.sharding != Sharding::Replicated {
            plan["zero_stage"] = json!(self.sharding.zero_stage());
        }
        // Written only for a pipeline stage, the same way.
        if self.stages > 1 || self.micro_batches > 1 {
            plan["stage"] = json!(self.stage);
            plan["stages"] = json!(self.stages);
            plan["micro_batches"] = json!(self.micro_batches);
            for (s, j) in self
                .steps
                .iter()
                .zip(plan["steps"].as_array_mut().into_iter().flatten())
            {
                j["micro_batch"] = json!(s.micro_batch);
            }
        }
        plan
    }

    /// The plan as a Rust expression of type `StaticPlan`, usable in a `const` item.
    /// `krate` is the path of this crate as the generated code sees it (`::memwise::plan`).
    pub fn to_rust(&self, krate: &str) -> String {
        rust_source(self, krate)
    }
}

impl MemoryReport {
    /// The report as a Rust expression of type `MemoryReport`, usable in a `const` item.
    pub fn to_rust(&self, krate: &str) -> String {
        rust_source(self, krate)
    }
}

// ---- Rust-literal emission (for the proc macro) ----

/// `value` as Rust source, its paths prefixed with `krate`.
pub fn rust_source(value: &impl ToRust, krate: &str) -> String {
    let mut out = String::new();
    value.write_rust(&mut RustWriter {
        out: &mut out,
        krate,
    });
    out
}

/// Writes values as Rust source. Paths are prefixed with `krate`.
pub struct RustWriter<'a> {
    out: &'a mut String,
    krate: &'a str,
}

impl<'a> RustWriter<'a> {
    /// A writer appending to `out`, with paths under `krate`.
    pub fn new(out: &'a mut String, krate: &'a str) -> Self {
        RustWriter { out, krate }
    }
    pub fn s(&mut self, s: &str) {
        self.out.push_str(s);
    }
    pub fn path(&mut self, p: &str) {
        let _ = write!(self.out, "{}::{}", self.krate, p);
    }
}

/// A value that can be written as a Rust expression.
pub trait ToRust {
    fn write_rust(&self, w: &mut RustWriter<'_>);
}

macro_rules! int_to_rust {
    ($($t:ty),*) => {$(
        impl ToRust for $t {
            fn write_rust(&self, w: &mut RustWriter<'_>) {
                let _ = write!(w.out, "{}{}", self, stringify!($t));
            }
        }
    )*};
}
int_to_rust!(u32, u64, usize);

impl ToRust for bool {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        w.s(if *self { "true" } else { "false" });
    }
}

impl ToRust for f32 {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        if self.is_finite() {
            let _ = write!(w.out, "{:?}f32", self);
        } else if self.is_nan() {
            w.s("f32::NAN");
        } else if *self > 0.0 {
            w.s("f32::INFINITY");
        } else {
            w.s("f32::NEG_INFINITY");
        }
    }
}

impl ToRust for Text {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        let _ = write!(w.out, "::std::borrow::Cow::Borrowed({:?})", self.as_ref());
    }
}

/// Writes `open`, the items separated by commas, and `close`.
fn write_items<'t, T: ToRust + 't>(
    w: &mut RustWriter<'_>,
    open: &str,
    items: impl IntoIterator<Item = &'t T>,
    close: &str,
) {
    w.s(open);
    for (i, x) in items.into_iter().enumerate() {
        if i > 0 {
            w.s(",");
        }
        x.write_rust(w);
    }
    w.s(close);
}

impl<T: ToRust + Clone> ToRust for List<T> {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        write_items(w, "::std::borrow::Cow::Borrowed(&[", self.iter(), "])");
    }
}

impl<T: ToRust> ToRust for Option<T> {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        match self {
            None => w.s("::core::option::Option::None"),
            Some(x) => {
                w.s("::core::option::Option::Some(");
                x.write_rust(w);
                w.s(")");
            }
        }
    }
}

/// Writes `Path { field: value, … }`.
macro_rules! struct_to_rust {
    ($ty:ident, $path:literal, [$($f:ident),* $(,)?]) => {
        impl ToRust for $ty {
            fn write_rust(&self, w: &mut RustWriter<'_>) {
                w.path($path);
                w.s("{");
                $(
                    w.s(concat!(stringify!($f), ": "));
                    self.$f.write_rust(w);
                    w.s(",");
                )*
                w.s("}");
            }
        }
    };
}

/// Writes a fieldless enum as `Path::Variant`.
macro_rules! unit_enum_to_rust {
    ($ty:ident, $path:literal, [$($v:ident),* $(,)?]) => {
        impl ToRust for $ty {
            fn write_rust(&self, w: &mut RustWriter<'_>) {
                w.path(concat!($path, "::"));
                w.s(match self { $($ty::$v => stringify!($v)),* });
            }
        }
    };
}

unit_enum_to_rust!(DType, "DType", [F32, F16, BF16, U8, I32]);
unit_enum_to_rust!(
    Precision,
    "Precision",
    [Float32, MixedFloat16, MixedBFloat16]
);
unit_enum_to_rust!(
    Role,
    "Role",
    [Activation, ActivationGrad, Workspace, Input, Recomputed]
);
unit_enum_to_rust!(Phase, "Phase", [Forward, Recompute, Loss, Backward, Update]);
unit_enum_to_rust!(Padding, "Padding", [Same, Valid]);
unit_enum_to_rust!(
    Sharding,
    "data_parallel::Sharding",
    [Replicated, OptimizerState, Gradients]
);
unit_enum_to_rust!(Reduction, "Reduction", [Mean, SumOverFeatures]);
unit_enum_to_rust!(
    PipelineSchedule,
    "pipeline::PipelineSchedule",
    [GPipe, OneFOneB]
);
struct_to_rust!(
    Pipeline,
    "stage::Pipeline",
    [boundaries, micro_batches, schedule]
);

struct_to_rust!(
    Window2d,
    "Window2d",
    [n, h, w, c_in, c_out, kh, kw, sh, sw, padding]
);
struct_to_rust!(
    PlanTensor,
    "PlanTensor",
    [
        id,
        name,
        layer,
        role,
        dtype,
        shape,
        bytes,
        offset,
        first,
        last,
        in_place_of
    ]
);
struct_to_rust!(
    PlanStep,
    "PlanStep",
    [index, phase, layer, op, reads, writes, params, micro_batch]
);
struct_to_rust!(
    PlanParam,
    "PlanParam",
    [
        id,
        name,
        layer,
        shape,
        trainable,
        offset,
        half_copy,
        half_offset,
        grad_offset,
        state_offset
    ]
);
struct_to_rust!(
    LayerMemory,
    "LayerMemory",
    [
        name,
        kind,
        output_shape,
        dtype,
        params,
        persistent_bytes,
        saved_bytes,
        recomputed_bytes,
        checkpointed,
        recomputes_output,
        in_place,
        recomputes_in_backward,
        forward_flops
    ]
);
struct_to_rust!(
    MemoryReport,
    "MemoryReport",
    [
        params,
        grads,
        optimizer,
        activations_peak,
        workspace_peak,
        inputs,
        total,
        arena,
        lower_bound,
        peak_step,
        layers
    ]
);
struct_to_rust!(
    StaticPlan,
    "StaticPlan",
    [
        model,
        batch,
        replicas,
        sharding,
        alignment,
        precision,
        optimizer,
        training,
        loss_scaling,
        arena_bytes,
        lower_bound_bytes,
        persistent_bytes,
        params_count,
        trainable_count,
        memory,
        tensors,
        steps,
        params,
        inputs,
        losses,
        prediction,
        stage,
        stages,
        micro_batches
    ]
);

/// Writes an enum as `Path::Variant`, `Path::Variant { field: value, … }` or
/// `Path::Variant(value, …)`; every variant is listed with its fields, so a new variant
/// that is not listed here does not compile.
macro_rules! enum_to_rust {
    ($ty:ident, $path:literal, [$($v:ident $({ $($f:ident),* })? $(( $($t:ident),* ))?),* $(,)?]) => {
        impl ToRust for $ty {
            fn write_rust(&self, w: &mut RustWriter<'_>) {
                match self {
                    $($ty::$v $({ $($f),* })? $(( $($t),* ))? => {
                        w.path(concat!($path, "::", stringify!($v)));
                        $(
                            w.s("{");
                            $( w.s(concat!(stringify!($f), ": ")); $f.write_rust(w); w.s(","); )*
                            w.s("}");
                        )?
                        $(
                            w.s("(");
                            $( $t.write_rust(w); w.s(","); )*
                            w.s(")");
                        )?
                    })*
                }
            }
        }
    };
}
// `Op`'s writer is generated with the op list (`crate::op`).
pub(crate) use enum_to_rust;

enum_to_rust! {
    Optimizer, "Optimizer", [
        Sgd { lr },
        Momentum { lr, momentum, nesterov },
        RmsProp { lr, rho, epsilon, momentum, centered },
        Adam { lr, beta_1, beta_2, epsilon },
        AdamW { lr, beta_1, beta_2, epsilon, weight_decay },
    ]
}

// ---- The model spec as Rust (the macro's `fn spec()`): owned values, built at run time ----

impl ToRust for String {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        let _ = write!(w.out, "::std::string::String::from({:?})", self.as_str());
    }
}

impl<T: ToRust> ToRust for Vec<T> {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        write_items(w, "::std::vec![", self, "]");
    }
}

impl<T: ToRust, const N: usize> ToRust for [T; N] {
    fn write_rust(&self, w: &mut RustWriter<'_>) {
        write_items(w, "[", self, "]");
    }
}

unit_enum_to_rust!(
    LossKind,
    "LossKind",
    [
        SparseCategoricalCrossentropy,
        BinaryCrossentropy,
        MeanSquaredError,
        KlNormal
    ]
);
unit_enum_to_rust!(
    Metric,
    "Metric",
    [Accuracy, BinaryAccuracy, MeanSquaredError]
);

// `LayerKind`'s writer is generated with the layer catalogue (`crate::layers`).

struct_to_rust!(LossTerm, "LossTerm", [kind, inputs, weight, reduction]);
struct_to_rust!(
    LayerSpec,
    "LayerSpec",
    [name, kind, inputs, dtype, checkpoint, recompute_output]
);
struct_to_rust!(
    ModelSpec,
    "ModelSpec",
    [
        name,
        batch,
        precision,
        optimizer,
        loss,
        metrics,
        layers,
        budget,
        replicas,
        sharding,
        replica_range,
        pipeline
    ]
);

impl ModelSpec {
    /// The spec as a Rust expression of type `ModelSpec` (owned strings and vectors: built
    /// at run time). `krate` is the path of this crate as the generated code sees it.
    pub fn to_rust(&self, krate: &str) -> String {
        rust_source(self, krate)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Activation, LayerKind};

    #[test]
    fn a_spec_is_written_as_owned_rust() {
        let mut spec = crate::zoo::conv_vae(4);
        spec.add("act", LayerKind::Activation(Activation::Gelu), &[]);
        let src = spec.to_rust("::m");
        assert!(
            src.starts_with(
                "::m::ModelSpec{name: ::std::string::String::from(\"ConvVae\"),batch: 4usize,"
            ),
            "{src}"
        );
        for part in [
            "optimizer: ::m::Optimizer::Adam{lr: 0.001f32,",
            "kind: ::m::LayerKind::Activation(::m::Activation::Gelu)",
            "kernel: [3usize,3usize]",
            "inputs: ::std::vec![::std::string::String::from(\"z_mean\"),",
            "kind: ::m::LossKind::KlNormal,",
        ] {
            assert!(src.contains(part), "{part} in {src}");
        }
        assert!(
            src.ends_with(
                "budget: ::core::option::Option::None,replicas: 1usize,\
                 sharding: ::m::data_parallel::Sharding::Replicated,\
                 replica_range: ::core::option::Option::None,\
                 pipeline: ::core::option::Option::None,}"
            ),
            "{src}"
        );
        // A split model's pipeline is written too (the macro's `spec()` carries it).
        spec.pipeline = Some(crate::stage::Pipeline::new(
            crate::pipeline::PipelineSchedule::GPipe,
            4,
            &["dec_dense"],
        ));
        let src = spec.to_rust("::m");
        assert!(
            src.ends_with(
                "pipeline: ::core::option::Option::Some(::m::stage::Pipeline{boundaries: \
                 ::std::vec![::std::string::String::from(\"dec_dense\")],micro_batches: 4usize,\
                 schedule: ::m::pipeline::PipelineSchedule::GPipe,}),}"
            ),
            "{src}"
        );
    }
}
