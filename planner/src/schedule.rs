//! `Schedule`: the training step in execution order — forward, loss, backward (with
//! checkpoint segments recomputed just before their backward, and gradients of tensors
//! with several consumers accumulated), then the optimizer update. Every tensor a step
//! touches, gradients, recomputed copies and workspaces included, is created here.

use std::collections::HashMap;

use crate::autodiff::StepGraph;
use crate::data_parallel::Sharding;
use crate::dtype::DType;
use crate::graph::{Graph, TensorId};
use crate::op::Op;
use crate::plan::{Phase, Role, NONE};

/// A tensor of the schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct STensor {
    pub name: String,
    /// Layer index in the spec (for the loss and the model-wide steps: `None`).
    pub layer: Option<usize>,
    pub role: Role,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl STensor {
    pub fn raw_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size()
    }
}

/// A step of the schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct SStep {
    pub phase: Phase,
    pub layer: Option<usize>,
    pub op: Op,
    pub reads: Vec<u32>,
    pub writes: Vec<u32>,
    pub params: Vec<u32>,
    /// `(read slot, write slot)` pairs where the write may take the read's bytes.
    pub in_place: Vec<(usize, usize)>,
}

/// The ordered steps and all their tensors. Tensor ids `0..graph.tensors.len()` are the
/// graph's forward tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub tensors: Vec<STensor>,
    pub steps: Vec<SStep>,
    /// Loss scalar tensors.
    pub losses: Vec<u32>,
    pub prediction: u32,
    pub loss_scaling: bool,
    pub training: bool,
    /// Per graph parameter: it receives a gradient and an update.
    pub updated: Vec<bool>,
    /// Checkpoint segments: `(segment id, layer indices)`.
    pub segments: Vec<Vec<usize>>,
    /// Per layer: its output is recomputed by choice (`LayerSpec::recompute_output`).
    pub recompute_output: Vec<bool>,
}

impl Schedule {
    /// Step `i` recomputes for a checkpoint segment: a recompute step of a checkpointed
    /// layer, not one that redoes a cheap tensor every plan redoes (`redone_in_backward`).
    pub fn checkpoint_recompute(&self, i: usize) -> bool {
        let st = &self.steps[i];
        st.phase == Phase::Recompute
            && st
                .layer
                .is_some_and(|l| self.segments.iter().any(|s| s.contains(&l)))
    }

    /// Step `i` recomputes by the model's choice, which the checkpoint solver prices: a
    /// checkpoint segment's step ([`Schedule::checkpoint_recompute`]), or the norm forward
    /// that remakes the output of a layer marked `recompute_output`.
    pub fn chosen_recompute(&self, i: usize) -> bool {
        let st = &self.steps[i];
        self.checkpoint_recompute(i)
            || (st.phase == Phase::Recompute
                && st.op.recomputes_output_by_choice()
                && st.layer.is_some_and(|l| self.recompute_output[l]))
    }
}

struct Ctx<'a> {
    graph: &'a Graph,
    tensors: Vec<STensor>,
    steps: Vec<SStep>,
    /// Current (accumulated) gradient tensor of each forward tensor.
    grad: HashMap<TensorId, u32>,
    /// Number of contributions so far (names the partial gradients).
    parts: HashMap<TensorId, usize>,
}

impl Ctx<'_> {
    fn new_tensor(
        &mut self,
        name: String,
        layer: Option<usize>,
        role: Role,
        dtype: DType,
        shape: Vec<usize>,
    ) -> u32 {
        self.tensors.push(STensor {
            name,
            layer,
            role,
            dtype,
            shape,
        });
        (self.tensors.len() - 1) as u32
    }

    fn grad_tensor(&mut self, of: TensorId) -> u32 {
        let t = &self.graph.tensors[of];
        let k = self.parts.entry(of).or_insert(0);
        *k += 1;
        let name = if *k == 1 {
            format!("{}.grad", t.name)
        } else {
            format!("{}.grad{}", t.name, k)
        };
        let (layer, dtype, shape) = (Some(t.layer), t.dtype, t.shape.clone());
        self.new_tensor(name, layer, Role::ActivationGrad, dtype, shape)
    }

    /// Records `g` as a gradient contribution to forward tensor `of`, accumulating into
    /// the gradient so far when there is one.
    fn contribute(&mut self, of: TensorId, g: u32) {
        match self.grad.get(&of).copied() {
            None => {
                self.grad.insert(of, g);
            }
            Some(prev) => {
                let sum = self.grad_tensor(of);
                let elems = self.graph.tensors[of].elems();
                let layer = Some(self.graph.tensors[of].layer);
                let op = Op::Accumulate { elems };
                let mut writes = vec![sum];
                self.trailing(
                    &mut writes,
                    layer,
                    &op,
                    true,
                    self.graph.tensors[of].dtype,
                    "",
                );
                self.steps.push(SStep {
                    phase: Phase::Backward,
                    layer,
                    op,
                    reads: vec![prev, g],
                    writes,
                    params: vec![],
                    in_place: vec![(0, 0), (1, 0)],
                });
                self.grad.insert(of, sum);
            }
        }
    }

    /// Appends the `[ws, scratch]` slots every tensor step ends with.
    fn trailing(
        &mut self,
        writes: &mut Vec<u32>,
        layer: Option<usize>,
        op: &Op,
        backward: bool,
        dtype: DType,
        tag: &str,
    ) {
        let lname = layer.map_or("loss".to_string(), |l| self.graph.layers[l].name.clone());
        let ws = op.workspace_elems(backward);
        writes.push(if ws == 0 {
            NONE
        } else {
            self.new_tensor(
                format!("{lname}.workspace{tag}"),
                layer,
                Role::Workspace,
                dtype,
                vec![ws],
            )
        });
        let sc = op.scratch_f32_elems(dtype);
        writes.push(if sc == 0 {
            NONE
        } else {
            self.new_tensor(
                format!("{lname}.scratch{tag}"),
                layer,
                Role::Workspace,
                DType::F32,
                vec![sc],
            )
        });
    }
}

impl Schedule {
    /// Orders the step and creates every tensor it touches: forward, loss, backward (with
    /// each checkpoint segment's recompute steps just before its first backward step), update.
    pub fn build(graph: &Graph, step: &StepGraph) -> Schedule {
        let mut cx = Ctx {
            graph,
            tensors: Vec::new(),
            steps: Vec::new(),
            grad: HashMap::new(),
            parts: HashMap::new(),
        };
        for t in &graph.tensors {
            let role = if t.is_input {
                Role::Input
            } else {
                Role::Activation
            };
            cx.tensors.push(STensor {
                name: t.name.clone(),
                layer: Some(t.layer),
                role,
                dtype: t.dtype,
                shape: t.shape.clone(),
            });
        }
        forward_steps(&mut cx, step);
        let losses = loss_steps(&mut cx, step);
        let prediction = graph.losses.first().map_or(NONE, |l| l.prediction as u32);
        let (segments, seg_of_layer) = checkpoint_segments(graph);
        backward_steps(&mut cx, step, &segments, &seg_of_layer);
        if step.replicas > 1 {
            all_reduce_steps(&mut cx);
        }
        let has_grad = update_steps(&mut cx, step);
        if step.replicas > 1 && step.sharding != Sharding::Replicated {
            all_gather_steps(&mut cx);
        }
        Schedule {
            tensors: cx.tensors,
            steps: cx.steps,
            losses,
            prediction,
            loss_scaling: step.loss_scaling,
            training: step.training,
            updated: has_grad,
            segments,
            recompute_output: graph.layers.iter().map(|l| l.recompute_output).collect(),
        }
    }
}

/// The dtype op `o` computes in (its first output's).
fn op_dtype(graph: &Graph, o: usize) -> DType {
    graph.tensors[graph.ops[o].outputs[0]].dtype
}

fn params_of(graph: &Graph, o: usize) -> Vec<u32> {
    graph.ops[o].params.iter().map(|&p| p as u32).collect()
}

/// One forward step per op: it reads the op's inputs and writes its outputs.
fn forward_steps(cx: &mut Ctx<'_>, step: &StepGraph) {
    let graph = cx.graph;
    for (o, op) in graph.ops.iter().enumerate() {
        let mut writes: Vec<u32> = op.outputs.iter().map(|&t| t as u32).collect();
        cx.trailing(
            &mut writes,
            Some(op.layer),
            &op.op,
            false,
            op_dtype(graph, o),
            "",
        );
        let in_place = match step.forward_in_place[o] {
            Some(k) => vec![(k, 0)],
            None => vec![],
        };
        cx.steps.push(SStep {
            phase: Phase::Forward,
            layer: Some(op.layer),
            op: op.op,
            reads: op.inputs.iter().map(|&t| t as u32).collect(),
            writes,
            params: params_of(graph, o),
            in_place,
        });
    }
}

/// One loss step per term: it writes its value and the gradients it starts. Returns the
/// value tensors.
fn loss_steps(cx: &mut Ctx<'_>, step: &StepGraph) -> Vec<u32> {
    let graph = cx.graph;
    let mut losses = Vec::new();
    for (k, l) in graph.losses.iter().enumerate() {
        let name = if graph.losses.len() == 1 {
            "loss".to_string()
        } else {
            format!("loss.{k}.{}", l.op.name())
        };
        let value = cx.new_tensor(name, None, Role::Activation, DType::F32, vec![1]);
        losses.push(value);
        let mut writes = vec![value];
        let mut grads = Vec::new();
        for &t in &l.grad_of {
            if step.requires_grad[t] {
                let g = cx.grad_tensor(t);
                writes.push(g);
                grads.push((t, g));
            } else {
                writes.push(NONE);
            }
        }
        cx.trailing(&mut writes, None, &l.op, false, DType::F32, "");
        cx.steps.push(SStep {
            phase: Phase::Loss,
            layer: None,
            op: l.op,
            reads: l.reads.iter().map(|&t| t as u32).collect(),
            writes,
            params: vec![],
            in_place: vec![],
        });
        for (t, g) in grads {
            cx.contribute(t, g);
        }
    }
    losses
}

/// Checkpoint segments: maximal runs of consecutive layers with one segment id, and each
/// layer's segment.
fn checkpoint_segments(graph: &Graph) -> (Vec<Vec<usize>>, Vec<Option<usize>>) {
    let mut seg_of_layer: Vec<Option<usize>> = vec![None; graph.layers.len()];
    let mut segments: Vec<Vec<usize>> = Vec::new();
    let mut prev: Option<u32> = None;
    for (i, l) in graph.layers.iter().enumerate() {
        match l.checkpoint {
            Some(id) if prev == Some(id) => {
                segments.last_mut().expect("open segment").push(i);
                seg_of_layer[i] = Some(segments.len() - 1);
            }
            Some(_) => {
                segments.push(vec![i]);
                seg_of_layer[i] = Some(segments.len() - 1);
            }
            None => {}
        }
        prev = l.checkpoint;
    }
    (segments, seg_of_layer)
}

/// Per graph tensor: a backward outside its own segment saves it, so it stays alive anyway
/// and recomputation reuses it.
fn saved_outside_their_segment(
    graph: &Graph,
    step: &StepGraph,
    seg_of_layer: &[Option<usize>],
) -> Vec<bool> {
    let seg_of_op = |o: usize| seg_of_layer[graph.ops[o].layer];
    let mut saved_outside = vec![false; graph.tensors.len()];
    for (o, rule) in step.backward.iter().enumerate() {
        if let Some(r) = rule {
            for &t in &r.saved {
                let producer_seg = graph
                    .ops
                    .iter()
                    .position(|p| p.outputs.contains(&t))
                    .and_then(seg_of_op);
                if producer_seg.is_none() || producer_seg != seg_of_op(o) {
                    saved_outside[t] = true;
                }
            }
        }
    }
    saved_outside
}

/// The backward steps, in reverse op order; a checkpoint segment's recompute steps come just
/// before its first backward step.
fn backward_steps(
    cx: &mut Ctx<'_>,
    step: &StepGraph,
    segments: &[Vec<usize>],
    seg_of_layer: &[Option<usize>],
) {
    let graph = cx.graph;
    let saved_outside = saved_outside_their_segment(graph, step, seg_of_layer);
    let redone = redone_in_backward(graph, step, seg_of_layer);
    let mut recomputed: HashMap<TensorId, u32> = HashMap::new();
    let mut seg_done = vec![false; segments.len()];
    for o in (0..graph.ops.len()).rev() {
        let op = &graph.ops[o];
        if matches!(op.op, Op::Add { .. }) {
            // The sum's gradient is each summand's gradient: shared, no step.
            if let Some(&g) = cx.grad.get(&op.outputs[0]) {
                for &x in &op.inputs {
                    if step.requires_grad[x] {
                        cx.contribute(x, g);
                    }
                }
            }
            continue;
        }
        let Some(rule) = &step.backward[o] else {
            continue;
        };
        let dys: Vec<u32> = rule
            .grad_outputs
            .iter()
            .map(|t| cx.grad.get(t).copied().unwrap_or(NONE))
            .collect();
        if dys.iter().all(|&d| d == NONE) {
            continue; // nothing flows back through this op
        }
        if let Some(s) = seg_of_layer[op.layer] {
            if !seg_done[s] {
                seg_done[s] = true;
                let seg = Segment {
                    layers: &segments[s],
                    id: s,
                    seg_of_layer,
                    saved_outside: &saved_outside,
                    redone: &redone,
                };
                recompute_segment(cx, step, &seg, &mut recomputed);
            }
        }
        for &t in &rule.saved {
            if redone[t] && !recomputed.contains_key(&t) {
                if let Some(p) = graph.ops.iter().position(|p| p.outputs.contains(&t)) {
                    recompute_op(cx, step, p, &redone, &mut recomputed);
                }
            }
        }
        backward_step(cx, o, rule, dys, &recomputed);
    }
}

/// Per graph tensor: redone just before the first backward that reads it (or the checkpoint
/// segment recompute that does, [`recompute_op`]) instead of kept from the forward, because
/// what it is made from is kept anyway and remaking it costs a few operations per element:
///
/// - a widened model input (a u8 image scaled to f32) that the first layer's weight gradient
///   reads: the u8 input is kept instead, at a quarter of the bytes (unless a loss reads the
///   float copy, which then lives up to the backward anyway);
/// - the output of an activation whose own backward keeps its input (GELU, SiLU), where the
///   next layer's weight gradient reads it: the selective recomputation of Korthikanti et
///   al. 2022 applied to the MLP — only the input is kept. Not when the activation's layer is
///   checkpointed: its input is not kept then;
/// - by choice (`LayerSpec::recompute_output`, which `checkpoint = auto` weighs against
///   segments), a norm's output a later backward reads: the norm keeps its input instead
///   (`autodiff.rs`, `rebuild_x_hat_from_kept_inputs`) and its forward runs again. Not in a
///   checkpointed layer.
///
/// What a block keeps then depends only on its own checkpointing, as the checkpoint solver
/// assumes.
fn redone_in_backward(
    graph: &Graph,
    step: &StepGraph,
    seg_of_layer: &[Option<usize>],
) -> Vec<bool> {
    let mut saved = vec![false; graph.tensors.len()];
    for r in step.backward.iter().flatten() {
        for &t in &r.saved {
            saved[t] = true;
        }
    }
    let mut again = vec![false; graph.tensors.len()];
    for (o, op) in graph.ops.iter().enumerate() {
        let (Some(&x), Some(&y)) = (op.inputs.first(), op.outputs.first()) else {
            continue;
        };
        again[y] = match op.op {
            Op::InputCast { .. } => {
                // A loss that reads the float copy (an autoencoder's target) keeps it up to
                // the backward anyway: keeping the u8 input too would add to it.
                let loss_reads = graph.losses.iter().any(|l| l.reads.contains(&y));
                graph.tensors[x].dtype.size() < graph.tensors[y].dtype.size()
                    && saved[y]
                    && !loss_reads
            }
            Op::Activation { act, .. } => {
                let keeps_input = step.backward[o]
                    .as_ref()
                    .is_some_and(|r| r.saved.contains(&x));
                !act.backward_reads_output()
                    && keeps_input
                    && seg_of_layer[op.layer].is_none()
                    && saved[y]
            }
            Op::LayerNorm {
                rebuild_x_hat: true,
                ..
            }
            | Op::BatchNorm {
                rebuild_x_hat: true,
                ..
            } => {
                graph.layers[op.layer].recompute_output
                    && seg_of_layer[op.layer].is_none()
                    && saved[y]
            }
            _ => false,
        };
    }
    again
}

/// Op `o`'s backward step: it reads what the op saved (or its recomputed copy) and the
/// output gradients, and writes one gradient per input that takes one.
fn backward_step(
    cx: &mut Ctx<'_>,
    o: usize,
    rule: &crate::autodiff::BackwardRule,
    dys: Vec<u32>,
    recomputed: &HashMap<TensorId, u32>,
) {
    let graph = cx.graph;
    let op = &graph.ops[o];
    let mut reads: Vec<u32> = rule
        .saved
        .iter()
        .map(|t| recomputed.get(t).copied().unwrap_or(*t as u32))
        .collect();
    let n_saved = reads.len();
    reads.extend(&dys);
    let mut writes = Vec::new();
    let mut contributions = Vec::new();
    for (k, &x) in op.inputs.iter().enumerate() {
        if rule.grad_inputs[k] {
            let g = cx.grad_tensor(x);
            writes.push(g);
            contributions.push((x, g));
        } else {
            writes.push(NONE);
        }
    }
    if matches!(op.op, Op::Embedding { .. }) {
        writes.clear(); // ids take no gradient
        contributions.clear();
    }
    cx.trailing(
        &mut writes,
        Some(op.layer),
        &op.op,
        true,
        op_dtype(graph, o),
        ".bwd",
    );
    let in_place = if rule.in_place {
        vec![(n_saved, 0)]
    } else {
        vec![]
    };
    cx.steps.push(SStep {
        phase: Phase::Backward,
        layer: Some(op.layer),
        op: op.op,
        reads,
        writes,
        params: params_of(graph, o),
        in_place,
    });
    for (x, g) in contributions {
        cx.contribute(x, g);
    }
}

/// The most gradient bytes one data-parallel sum carries: PyTorch DDP's default bucket
/// (`bucket_cap_mb = 25`). A bucket is summed as soon as its last gradient is written.
pub const BUCKET_BYTES: u64 = 25 << 20;

/// Data parallel: inserts the gradient sums among the backward steps ([`gradient_sums`]).
fn all_reduce_steps(cx: &mut Ctx<'_>) {
    let graph = cx.graph;
    let trained = |p: u32| {
        let param = &graph.params[p as usize];
        param.trainable.then(|| param.elems())
    };
    for (at, step) in gradient_sums(&cx.steps, trained, true).into_iter().rev() {
        cx.steps.insert(at + 1, step);
    }
}

/// The gradient sums of data parallelism over `steps`: the trained parameters (those
/// `trained` gives a size in elements) in the order their gradients are finished (the last
/// backward step that writes each), grouped into buckets of up to [`BUCKET_BYTES`]. Each
/// bucket's `AllReduceGradients` step goes right after the step that finishes it, so a
/// device that overlaps communication with compute can start it while backward goes on.
/// Returns each sum with the index of the step it follows, in order; the final one settles
/// the replicas' non-finite flag when `settle_flag`.
pub(crate) fn gradient_sums(
    steps: &[SStep],
    trained: impl Fn(u32) -> Option<usize>,
    settle_flag: bool,
) -> Vec<(usize, SStep)> {
    let mut last_writer: std::collections::BTreeMap<u32, usize> = Default::default();
    for (i, st) in steps.iter().enumerate() {
        if st.phase == Phase::Backward {
            for &p in st.params.iter().filter(|&&p| trained(p).is_some()) {
                last_writer.insert(p, i);
            }
        }
    }
    let mut finished: Vec<(usize, u32)> = last_writer.into_iter().map(|(p, i)| (i, p)).collect();
    finished.sort_unstable();
    // (insert after step, parameters, bytes)
    let mut buckets: Vec<(usize, Vec<u32>, u64)> = Vec::new();
    for (i, p) in finished {
        let bytes = trained(p).unwrap_or(0) as u64 * 4;
        match buckets.last_mut() {
            Some((at, ps, b)) if *b + bytes <= BUCKET_BYTES || ps.is_empty() => {
                *at = i;
                ps.push(p);
                *b += bytes;
            }
            _ => buckets.push((i, vec![p], bytes)),
        }
    }
    let n = buckets.len();
    (buckets.into_iter().enumerate())
        .map(|(k, (at, params, bytes))| {
            let step = SStep {
                phase: Phase::Backward,
                layer: None,
                op: Op::AllReduceGradients {
                    bytes,
                    last: settle_flag && k + 1 == n,
                },
                reads: vec![],
                writes: vec![],
                params,
                in_place: vec![],
            };
            (at, step)
        })
        .collect()
}

/// The update steps: the finite check (with loss scaling), then one optimizer step per
/// layer with trained parameters. Only parameters some backward step writes a gradient for
/// are updated (a dead branch, or a layer that only feeds a loss target, learns nothing).
/// Returns which parameters are updated.
fn update_steps(cx: &mut Ctx<'_>, step: &StepGraph) -> Vec<bool> {
    let graph = cx.graph;
    let mut has_grad = vec![false; graph.params.len()];
    for st in cx.steps.iter().filter(|st| st.phase == Phase::Backward) {
        for &p in &st.params {
            has_grad[p as usize] |= graph.params[p as usize].trainable;
        }
    }
    let trainable: Vec<u32> = (0..graph.params.len())
        .filter(|&i| has_grad[i])
        .map(|i| i as u32)
        .collect();
    if step.loss_scaling && !trainable.is_empty() {
        cx.steps.push(SStep {
            phase: Phase::Update,
            layer: None,
            op: Op::CheckFinite,
            reads: vec![],
            writes: vec![],
            params: trainable.clone(),
            in_place: vec![],
        });
    }
    for (li, _) in graph.layers.iter().enumerate() {
        let ps: Vec<u32> = trainable
            .iter()
            .copied()
            .filter(|&p| graph.params[p as usize].layer == li)
            .collect();
        if !ps.is_empty() {
            cx.steps.push(SStep {
                phase: Phase::Update,
                layer: Some(li),
                op: Op::Update,
                reads: vec![],
                writes: vec![],
                params: ps,
                in_place: vec![],
            });
        }
    }
    has_grad
}

/// ZeRO stage 1: after each update step, an `AllGatherParams` step over the same
/// parameters, which copies every replica's updated shard to the others. Each layer's
/// gather follows its own update, so a device that overlaps communication with compute can
/// send one layer's weights while it updates the next.
fn all_gather_steps(cx: &mut Ctx<'_>) {
    let graph = cx.graph;
    let mut i = 0;
    while i < cx.steps.len() {
        if matches!(cx.steps[i].op, Op::Update) {
            let params = cx.steps[i].params.clone();
            let bytes = params
                .iter()
                .map(|&p| graph.params[p as usize].elems() as u64 * 4)
                .sum();
            cx.steps.insert(
                i + 1,
                SStep {
                    phase: Phase::Update,
                    layer: cx.steps[i].layer,
                    op: Op::AllGatherParams { bytes },
                    reads: vec![],
                    writes: vec![],
                    params,
                    in_place: vec![],
                },
            );
            i += 1;
        }
        i += 1;
    }
}

/// One checkpoint segment, as [`recompute_segment`] needs it.
struct Segment<'a> {
    /// Its layers.
    layers: &'a [usize],
    /// Its index, and every layer's segment.
    id: usize,
    seg_of_layer: &'a [Option<usize>],
    /// Per tensor: a backward outside its own segment keeps it.
    saved_outside: &'a [bool],
    /// Per tensor: redone before its readers ([`redone_in_backward`]).
    redone: &'a [bool],
}

/// Emits the recompute steps of one checkpoint segment: the ops whose outputs the
/// segment's backward reads, and the ops those depend on inside the segment.
fn recompute_segment(
    cx: &mut Ctx<'_>,
    step: &StepGraph,
    seg: &Segment<'_>,
    recomputed: &mut HashMap<TensorId, u32>,
) {
    let graph = cx.graph;
    let (layers, saved_outside) = (seg.layers, seg.saved_outside);
    let in_seg = |o: usize| seg.seg_of_layer[graph.ops[o].layer] == Some(seg.id);
    let ops: Vec<usize> = (0..graph.ops.len())
        .filter(|&o| layers.contains(&graph.ops[o].layer) && in_seg(o))
        .collect();
    let producer = |t: TensorId| {
        ops.iter()
            .copied()
            .find(|&o| graph.ops[o].outputs.contains(&t))
    };
    // Tensors the segment's backward needs that are not kept alive for someone else.
    let mut need: Vec<TensorId> = Vec::new();
    for &o in &ops {
        if let Some(r) = &step.backward[o] {
            for &t in &r.saved {
                if producer(t).is_some() && !saved_outside[t] && !need.contains(&t) {
                    need.push(t);
                }
            }
        }
    }
    // Close over producers inside the segment.
    let mut run = vec![false; graph.ops.len()];
    let mut stack = need.clone();
    while let Some(t) = stack.pop() {
        if let Some(p) = producer(t) {
            if !run[p] {
                run[p] = true;
                for &x in &graph.ops[p].inputs {
                    if producer(x).is_some() && !(saved_outside[x]) {
                        stack.push(x);
                    }
                }
            }
        }
    }
    for &o in &ops {
        if run[o] {
            recompute_op(cx, step, o, seg.redone, recomputed);
        }
    }
}

/// One recompute step of op `o`: its forward again, reading the recomputed copies of its
/// inputs where there are any (an input that is redone is redone first), into fresh
/// tensors its backward readers take instead.
fn recompute_op(
    cx: &mut Ctx<'_>,
    step: &StepGraph,
    o: usize,
    redone: &[bool],
    recomputed: &mut HashMap<TensorId, u32>,
) {
    let graph = cx.graph;
    let op = &graph.ops[o];
    for &t in &op.inputs {
        if redone[t] && !recomputed.contains_key(&t) {
            if let Some(p) = graph.ops.iter().position(|p| p.outputs.contains(&t)) {
                recompute_op(cx, step, p, redone, recomputed);
            }
        }
    }
    let reads: Vec<u32> = op
        .inputs
        .iter()
        .map(|t| recomputed.get(t).copied().unwrap_or(*t as u32))
        .collect();
    let mut writes = Vec::new();
    for &t in &op.outputs {
        let g = &graph.tensors[t];
        let r = cx.new_tensor(
            format!("{}@recompute", g.name),
            Some(g.layer),
            Role::Recomputed,
            g.dtype,
            g.shape.clone(),
        );
        recomputed.insert(t, r);
        writes.push(r);
    }
    let dt = graph.tensors[op.outputs[0]].dtype;
    cx.trailing(&mut writes, Some(op.layer), &op.op, false, dt, ".recompute");
    let in_place = match step.forward_in_place[o] {
        Some(k) => vec![(k, 0)],
        None => vec![],
    };
    cx.steps.push(SStep {
        phase: crate::plan::Phase::Recompute,
        layer: Some(op.layer),
        op: op.op,
        reads,
        writes,
        params: op.params.iter().map(|&p| p as u32).collect(),
        in_place,
    });
}
