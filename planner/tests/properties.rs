//! Property tests of the whole planner over random models from `memwise_plan::generate`:
//! every plan validates, `lower bound ≤ arena ≤ greedy-by-size`, the memory report's
//! identities hold, the plan JSON keeps the contract; and two directed properties —
//! checkpointing the blocks of a long uniform chain lowers the activation peak, and fp16 on
//! a layer halves exactly the bytes of its tensors.
//!
//! The seeded loops (`CHAINS` chains, `DAGS` DAGs) are the same on every run; the proptest
//! block adds fresh seeds each run (a failing seed is saved by proptest and printed).

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};

use memwise_plan::arena::packing::{greedy_by_size, lower_bound, overlaps, BufferRequest};
use memwise_plan::generate::{random_chain, random_dag, MAX_ELEMS};
use memwise_plan::liveness::align_up;
use memwise_plan::{
    arena, autodiff, graph, liveness, plan, schedule, Activation, DType, LayerKind, LossKind,
    LossTerm, ModelSpec, Op, Padding, Phase, Precision, Role, StaticPlan, ALIGNMENT, NONE,
};
use proptest::prelude::*;

/// Seeds the fixed sweeps try; `MEMWISE_SEEDS=N` tries `N` of each instead (a deeper run:
/// `MEMWISE_SEEDS=20000 cargo test --release -p memwise-plan --test properties`).
const CHAINS: u64 = 400;
const DAGS: u64 = 400;

fn seeds(default: u64) -> u64 {
    std::env::var("MEMWISE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Everything the planner promises about one model; `Err` says what broke.
fn check(spec: &ModelSpec) -> Result<StaticPlan, String> {
    check_with_greedy(spec).map(|(p, _)| p)
}

/// [`check`], also returning the greedy-by-size arena of the same buffers.
fn check_with_greedy(spec: &ModelSpec) -> Result<(StaticPlan, u64), String> {
    let p = plan(spec).map_err(|e| format!("plan() failed: {e}"))?;
    arena::validate(&p).map_err(|e| format!("validate: {e}"))?;
    let greedy = check_stages(spec, &p)?;
    check_memory(spec, &p)?;
    check_completeness(&p)?;
    check_json(&p)?;
    let again = plan(spec).map_err(|e| format!("second plan() failed: {e}"))?;
    if again != p {
        return Err("planning the same spec twice gave two different plans".into());
    }
    Ok((p, greedy))
}

/// Runs the pipeline stage by stage: the arena is between the lower bound and TFLite's
/// greedy-by-size on the same buffers, and the plan's tensors regroup into those buffers.
fn check_stages(spec: &ModelSpec, p: &StaticPlan) -> Result<u64, String> {
    let mut g = graph::Graph::build(spec).map_err(|e| format!("Graph::build: {e}"))?;
    let sg =
        autodiff::StepGraph::build(&mut g, spec).map_err(|e| format!("StepGraph::build: {e}"))?;
    let s = schedule::Schedule::build(&g, &sg);
    let life = liveness::Lifetimes::compute(&s, ALIGNMENT);
    let a = arena::ArenaPlan::build(&s, &life, ALIGNMENT);
    let (lb, ours, greedy) = (a.lower_bound, a.packing.arena_bytes, a.greedy_bytes);
    if lb != lower_bound(&a.requests) {
        return Err(format!(
            "ArenaPlan.lower_bound {lb} != packing::lower_bound {}",
            lower_bound(&a.requests)
        ));
    }
    if !(lb <= ours && ours <= greedy) {
        return Err(format!(
            "not lower bound {lb} <= arena {ours} <= greedy {greedy}"
        ));
    }
    // No gradient is dropped: every gradient of a tensor the loss needs a gradient of
    // (`StepGraph::requires_grad`) is read by a later step. (Kernels that always write every
    // input's gradient may write one for a tensor that needs none; nothing reads that.)
    let mut read = vec![false; p.tensors.len()];
    for st in p.steps.iter() {
        for &r in st.reads.iter().filter(|&&r| r != NONE) {
            read[r as usize] = true;
        }
    }
    // Forward tensors by name; a layer that casts several inputs names each cast alike, so
    // a gradient is only known to be needed when every tensor of its name needs one.
    let mut forward: std::collections::HashMap<&str, Vec<usize>> = std::collections::HashMap::new();
    for (i, t) in g.tensors.iter().enumerate() {
        forward.entry(t.name.as_str()).or_default().push(i);
    }
    for t in p
        .tensors
        .iter()
        .filter(|t| t.role == Role::ActivationGrad && !read[t.id as usize])
    {
        let of = t
            .name
            .rsplit_once(".grad")
            .map_or(t.name.as_ref(), |(base, _)| base);
        let Some(ids) = forward.get(of) else {
            return Err(format!("gradient `{}` of no forward tensor", t.name));
        };
        if ids.iter().all(|&f| sg.requires_grad[f]) {
            return Err(format!("gradient `{}` is written but never read", t.name));
        }
    }
    let tflite = greedy_by_size(&a.requests, ALIGNMENT);
    if tflite.arena_bytes != greedy {
        return Err(format!(
            "greedy_by_size gives {} but ArenaPlan says {greedy}",
            tflite.arena_bytes
        ));
    }
    if let Some((i, j)) = overlaps(&a.requests, &a.packing) {
        return Err(format!("pack: buffers {i} and {j} overlap"));
    }
    if let Some((i, j)) = overlaps(&a.requests, &tflite) {
        return Err(format!("greedy_by_size: buffers {i} and {j} overlap"));
    }
    if p.arena_bytes != ours || p.lower_bound_bytes != lb {
        return Err(format!(
            "plan says arena {} / lower bound {}, the stages {ours} / {lb}",
            p.arena_bytes, p.lower_bound_bytes
        ));
    }
    // Rebuild the buffers from the plan: tensors grouped by their in-place root share one
    // offset; the group's bytes are its largest member's, its life the union of theirs.
    let mut groups: BTreeMap<usize, (u64, u32, u32, u64)> = BTreeMap::new();
    for (i, t) in p.tensors.iter().enumerate() {
        let mut root = i;
        for _ in 0..=p.tensors.len() {
            if p.tensors[root].in_place_of == NONE {
                break;
            }
            root = p.tensors[root].in_place_of as usize;
        }
        if p.tensors[root].in_place_of != NONE {
            return Err(format!("tensor `{}`: in-place chain has a cycle", t.name));
        }
        let e = groups.entry(root).or_insert((0, u32::MAX, 0, t.offset));
        if e.3 != t.offset {
            return Err(format!(
                "tensor `{}` at {} but its in-place root at {}",
                t.name, t.offset, e.3
            ));
        }
        e.0 = e.0.max(t.bytes);
        e.1 = e.1.min(t.first);
        e.2 = e.2.max(t.last);
    }
    let mut rebuilt: Vec<BufferRequest> = groups
        .values()
        .map(|&(bytes, first, last, _)| BufferRequest {
            bytes,
            first: first as usize,
            last: last as usize,
        })
        .collect();
    let mut requests = a.requests.clone();
    let key = |r: &BufferRequest| (r.first, r.last, r.bytes);
    rebuilt.sort_by_key(key);
    requests.sort_by_key(key);
    if rebuilt != requests {
        return Err(format!(
            "the plan's tensors regroup into {} buffers that differ from the arena's {}",
            rebuilt.len(),
            requests.len()
        ));
    }
    Ok(greedy)
}

/// The report's identities and its agreement with the plan's parameters.
fn check_memory(spec: &ModelSpec, p: &StaticPlan) -> Result<(), String> {
    let m = &p.memory;
    let ident = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!("{what}: {m:?}"))
        }
    };
    ident(
        m.total == m.params + m.grads + m.optimizer + m.arena,
        "total != params + grads + optimizer + arena",
    )?;
    ident(m.arena == p.arena_bytes, "memory.arena != arena_bytes")?;
    ident(
        m.lower_bound == p.lower_bound_bytes,
        "memory.lower_bound != lower_bound_bytes",
    )?;
    ident(
        m.activations_peak + m.workspace_peak + m.inputs == m.lower_bound,
        "activations_peak + workspace_peak + inputs != lower_bound",
    )?;
    ident(
        p.persistent_bytes == m.params + m.grads + m.optimizer,
        "persistent_bytes != params + grads + optimizer",
    )?;
    ident(
        m.optimizer == spec.optimizer.state_slots() * m.grads,
        "optimizer != state slots × grads",
    )?;
    let f32_bytes = |e: usize| align_up(e as u64 * 4, ALIGNMENT);
    let grads: u64 = p
        .params
        .iter()
        .filter(|q| q.trainable)
        .map(|q| f32_bytes(q.elems()))
        .sum();
    ident(
        m.grads == grads,
        "grads != Σ aligned f32 trainable parameters",
    )?;
    let values: u64 = p.params.iter().map(|q| f32_bytes(q.elems())).sum::<u64>()
        + p.params
            .iter()
            .filter_map(|q| {
                q.half_copy
                    .map(|h| align_up(q.elems() as u64 * h.size(), ALIGNMENT))
            })
            .sum::<u64>();
    ident(
        m.params == values,
        "params != Σ aligned f32 values + 16-bit copies",
    )?;
    let count: u64 = p.params.iter().map(|q| q.elems() as u64).sum();
    let trainable: u64 = p
        .params
        .iter()
        .filter(|q| q.trainable)
        .map(|q| q.elems() as u64)
        .sum();
    if p.params_count != count || p.trainable_count != trainable {
        return Err(format!(
            "params_count {} / trainable {} but the parameters hold {count} / {trainable}",
            p.params_count, p.trainable_count
        ));
    }
    let names: Vec<&str> = m.layers.iter().map(|l| l.name.as_ref()).collect();
    let want: Vec<&str> = spec.layers.iter().map(|l| l.name.as_str()).collect();
    if names != want {
        return Err(format!("memory.layers {names:?} != spec layers {want:?}"));
    }
    let by_layer: u64 = m.layers.iter().map(|l| l.params).sum();
    if by_layer != count {
        return Err(format!("Σ layer params {by_layer} != {count}"));
    }
    for l in m.layers.iter() {
        let ls = spec.layer(&l.name).expect("same names");
        if l.checkpointed != ls.checkpoint.is_some() {
            return Err(format!(
                "layer `{}`: checkpointed {} but the spec says {:?}",
                l.name, l.checkpointed, ls.checkpoint
            ));
        }
        // Unchecked layers recompute only what every plan redoes (schedule.rs,
        // `redone_in_backward`): an input cast, a GELU or SiLU output; and the norm forward
        // of a layer marked `recompute_output`.
        let redoes_only = p
            .steps
            .iter()
            .filter(|s| s.phase == Phase::Recompute && s.layer == l.name)
            .all(|s| match s.op {
                Op::InputCast { .. } => true,
                Op::Activation { act, .. } => !act.backward_reads_output(),
                Op::LayerNorm { .. } | Op::BatchNorm { .. } => {
                    ls.recompute_output && l.recomputes_output
                }
                _ => false,
            });
        if l.recomputes_output != (ls.recompute_output && !l.checkpointed && !redoes_nothing(p, l))
        {
            return Err(format!(
                "layer `{}`: recomputes its output {} but the spec marks it {}",
                l.name, l.recomputes_output, ls.recompute_output
            ));
        }
        if !l.checkpointed && !redoes_only && l.recomputed_bytes != 0 {
            return Err(format!(
                "layer `{}` is not checkpointed but recomputes {} bytes",
                l.name, l.recomputed_bytes
            ));
        }
    }
    Ok(())
}

/// Every trainable parameter gets a gradient (some backward step uses it) and exactly one
/// update; float16 anywhere means a finiteness check before the updates.
fn check_completeness(p: &StaticPlan) -> Result<(), String> {
    let mut backward = vec![false; p.params.len()];
    let mut updates = vec![0usize; p.params.len()];
    for s in p.steps.iter() {
        for &q in s.params.iter() {
            match s.phase {
                Phase::Backward => backward[q as usize] = true,
                Phase::Update if matches!(s.op, Op::Update) => updates[q as usize] += 1,
                _ => {}
            }
        }
    }
    for (q, param) in p.params.iter().enumerate() {
        if param.trainable && (!backward[q] || updates[q] != 1) {
            return Err(format!(
                "parameter `{}`: used by a backward step {}, updated {} times",
                param.name, backward[q], updates[q]
            ));
        }
    }
    let mut read = vec![false; p.tensors.len()];
    for s in p.steps.iter() {
        for &r in s.reads.iter().filter(|&&r| r != NONE) {
            read[r as usize] = true;
        }
    }
    // Checkpointing drops what it recomputes: a recomputed copy that some step reads is made
    // after its original died (the original may outlive the forward pass as a prediction the
    // loss reads, or as another segment's input). A copy nobody reads is a multi-output
    // op's other output (batch norm's `out` recomputed for `x_hat`).
    let by_name: std::collections::HashMap<&str, usize> = p
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_ref(), i))
        .collect();
    for t in p
        .tensors
        .iter()
        .filter(|t| t.role == Role::Recomputed && read[t.id as usize])
    {
        let name = t.name.trim_end_matches("@recompute");
        let Some(&o) = by_name.get(name) else {
            return Err(format!("recomputed `{}` has no original", t.name));
        };
        if p.tensors[o].last >= t.first {
            return Err(format!(
                "`{name}` is recomputed at step {} but the original lives until {}",
                t.first, p.tensors[o].last
            ));
        }
    }
    let checks = p
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::CheckFinite))
        .count();
    if checks != usize::from(p.loss_scaling && p.trainable_count > 0) {
        return Err(format!(
            "loss scaling {} but {checks} check_finite steps",
            p.loss_scaling
        ));
    }
    Ok(())
}

/// The `memwise.plan/1` JSON: parses, has the contract's keys, agrees with the plan.
fn check_json(p: &StaticPlan) -> Result<(), String> {
    let v: serde_json::Value =
        serde_json::from_str(&p.to_json()).map_err(|e| format!("plan JSON: {e}"))?;
    let keys = |v: &serde_json::Value, keys: &[&str], what: &str| -> Result<(), String> {
        for k in keys {
            if v.get(k).is_none() {
                return Err(format!("plan JSON: {what} has no `{k}`"));
            }
        }
        Ok(())
    };
    keys(
        &v,
        &[
            "schema",
            "model",
            "batch",
            "alignment",
            "arena_bytes",
            "lower_bound_bytes",
            "memory",
            "tensors",
            "steps",
        ],
        "the plan",
    )?;
    keys(
        &v["memory"],
        &[
            "params",
            "grads",
            "optimizer",
            "activations_peak",
            "workspace_peak",
            "inputs",
            "total",
        ],
        "memory",
    )?;
    let eq = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!("plan JSON: {what} disagrees with the plan"))
        }
    };
    eq(v["schema"] == "memwise.plan/1", "schema")?;
    eq(v["model"] == p.model.as_ref(), "model")?;
    eq(v["batch"] == p.batch, "batch")?;
    eq(v["alignment"] == p.alignment, "alignment")?;
    eq(v["arena_bytes"] == p.arena_bytes, "arena_bytes")?;
    eq(
        v["lower_bound_bytes"] == p.lower_bound_bytes,
        "lower_bound_bytes",
    )?;
    eq(v["memory"]["total"] == p.memory.total, "memory.total")?;
    eq(
        v["memory"]["activations_peak"] == p.memory.activations_peak,
        "memory.activations_peak",
    )?;
    let tensors = v["tensors"]
        .as_array()
        .ok_or("plan JSON: tensors is not an array")?;
    let steps = v["steps"]
        .as_array()
        .ok_or("plan JSON: steps is not an array")?;
    eq(tensors.len() == p.tensors.len(), "tensor count")?;
    eq(steps.len() == p.steps.len(), "step count")?;
    let roles = [
        "activation",
        "activation_grad",
        "workspace",
        "input",
        "recomputed",
    ];
    let dtypes = ["f32", "f16", "bf16", "u8", "i32"];
    for (jt, t) in tensors.iter().zip(p.tensors.iter()) {
        keys(
            jt,
            &[
                "id", "name", "layer", "role", "dtype", "shape", "bytes", "offset", "first", "last",
            ],
            "a tensor",
        )?;
        eq(
            jt["id"] == t.id && jt["name"] == t.name.as_ref() && jt["bytes"] == t.bytes,
            "a tensor's id, name, bytes",
        )?;
        eq(
            jt["offset"] == t.offset && jt["first"] == t.first && jt["last"] == t.last,
            "a tensor's offset and life",
        )?;
        eq(
            roles.iter().any(|r| jt["role"] == *r) && dtypes.iter().any(|d| jt["dtype"] == *d),
            "a tensor's role or dtype",
        )?;
        let shape: Vec<u64> = jt["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        eq(
            shape
                .iter()
                .map(|&d| d as usize)
                .eq(t.shape.iter().copied()),
            "a tensor's shape",
        )?;
    }
    let phases = ["forward", "recompute", "loss", "backward", "update"];
    for (i, js) in steps.iter().enumerate() {
        keys(
            js,
            &["index", "phase", "layer", "op", "reads", "writes"],
            "a step",
        )?;
        eq(
            js["index"] == i && phases.iter().any(|ph| js["phase"] == *ph),
            "a step's index or phase",
        )?;
        for list in ["reads", "writes"] {
            let ids = js[list]
                .as_array()
                .ok_or("plan JSON: reads/writes not an array")?;
            eq(
                ids.iter().all(|id| {
                    id.as_u64()
                        .is_some_and(|id| (id as usize) < p.tensors.len())
                }),
                "a step's tensor ids",
            )?;
        }
    }
    Ok(())
}

/// Checks `count` models from `make`; one line per failure (seed, what broke, the spec).
fn sweep(what: &str, count: u64, make: fn(u64) -> ModelSpec) {
    let mut failures = Vec::new();
    let (mut below_greedy, mut at_bound, mut recompute) = (0, 0, 0);
    for seed in 0..count {
        let spec = make(seed);
        match catch_unwind(AssertUnwindSafe(|| check_with_greedy(&spec))) {
            Ok(Ok((p, greedy))) => {
                let biggest = p.tensors.iter().map(|t| t.elems()).max().unwrap_or(0);
                assert!(
                    biggest <= MAX_ELEMS,
                    "{what} {seed}: a tensor of {biggest} elements"
                );
                below_greedy += usize::from(greedy > p.arena_bytes);
                at_bound += usize::from(p.arena_bytes == p.lower_bound_bytes);
                recompute += usize::from(p.steps.iter().any(|s| s.phase == Phase::Recompute));
            }
            Ok(Err(e)) => failures.push(format!("{what} seed {seed}: {e}\n{spec:#?}")),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("{what} seed {seed}: panicked: {msg}\n{spec:#?}"));
            }
        }
    }
    eprintln!(
        "{what}: {count} models, {} failed; arena at the lower bound {at_bound}, below greedy-by-size {below_greedy}; {recompute} recompute",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {count} {what} failed; the first:\n{}",
        failures.len(),
        failures[0]
    );
}

#[test]
fn random_chains_plan_validate_and_pack_between_the_bounds() {
    sweep("chains", seeds(CHAINS), random_chain);
}

#[test]
fn random_dags_plan_validate_and_pack_between_the_bounds() {
    sweep("DAGs", seeds(DAGS), random_dag);
}

#[test]
fn generators_are_deterministic_and_cover_the_layer_mix() {
    let mut kinds = HashSet::new();
    let (mut batches, mut precisions, mut optimizers) =
        (HashSet::new(), HashSet::new(), HashSet::new());
    let (mut checkpointed, mut overridden, mut multi_loss) = (0, 0, 0);
    for seed in 0..200 {
        for spec in [random_chain(seed), random_dag(seed)] {
            kinds.extend(spec.layers.iter().map(|l| l.kind.name()));
            batches.insert(spec.batch);
            precisions.insert(spec.precision.name());
            optimizers.insert(format!("{:?}", spec.optimizer));
            checkpointed += usize::from(spec.layers.iter().any(|l| l.checkpoint.is_some()));
            overridden += usize::from(spec.layers.iter().any(|l| l.dtype.is_some()));
            multi_loss += usize::from(spec.loss.len() > 1);
        }
        assert_eq!(random_chain(seed), random_chain(seed));
        assert_eq!(random_dag(seed), random_dag(seed));
        // A chain reads only its previous layer.
        assert!(random_chain(seed)
            .layers
            .iter()
            .all(|l| l.inputs.len() <= 1));
    }
    let all = [
        "input",
        "dense",
        "conv2d",
        "depthwise_conv2d",
        "separable_conv2d",
        "conv2d_transpose",
        "max_pool2d",
        "avg_pool2d",
        "global_avg_pool",
        "batch_norm",
        "layer_norm",
        "dropout",
        "flatten",
        "reshape",
        "add",
        "concat",
        "embedding",
        "attention",
        "activation",
        "sample_normal",
    ];
    for k in all {
        assert!(kinds.contains(k), "no generated model has a `{k}` layer");
    }
    for b in [1, 3, 7, 13, 17, 23] {
        assert!(batches.contains(&b), "no generated model has batch {b}");
    }
    assert_eq!(precisions.len(), 3);
    assert_eq!(optimizers.len(), 6);
    assert!(
        checkpointed > 100 && overridden > 100 && multi_loss > 20,
        "{checkpointed} {overridden} {multi_loss}"
    );
}

proptest! {
    // A failure prints its seed (`minimal failing input`); there is no lib.rs beside an
    // integration test to persist it next to.
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Fresh seeds on every run, beyond the fixed sweep.
    #[test]
    fn any_seed_plans_and_validates(seed in any::<u64>(), dag in any::<bool>()) {
        let spec = if dag { random_dag(seed) } else { random_chain(seed) };
        let result = check(&spec);
        prop_assert!(result.is_ok(), "{} seed {}: {}", if dag { "dag" } else { "chain" }, seed, result.err().unwrap_or_default());
    }
}

// ---- Checkpointing a long uniform chain -------------------------------------------------

/// `layers` dense 1024 layers with `act` at batch 256 (f32: one layer output is 1 MiB),
/// a 10-class head; layer `i` gets checkpoint segment `segment(i)`.
fn deep_mlp(act: Activation, layers: usize, segment: impl Fn(usize) -> Option<u32>) -> ModelSpec {
    let mut m = ModelSpec::new("DeepMlp", 256);
    m.input("x", &[1024], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    for i in 0..layers {
        let name = format!("d{i}");
        m.add(
            &name,
            LayerKind::dense(1024, act),
            if i == 0 { &["x"] } else { &[] },
        );
        m.layers.last_mut().expect("just added").checkpoint = segment(i);
    }
    m.add("head", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["head", "labels"]));
    m
}

const MIB: u64 = 1 << 20;

#[test]
fn checkpointing_blocks_of_a_deep_relu_mlp_lowers_the_activation_peak() {
    let base = check(&deep_mlp(Activation::Relu, 24, |_| None)).expect("plans");
    // Every relu output is read by its own backward and by the next dense's: all 24 are
    // alive when the backward starts.
    assert!(
        base.memory.activations_peak >= 24 * MIB,
        "{}",
        base.memory.activations_peak
    );
    // Blocks of two layers: each block keeps its input (12 MiB in all) and recomputes its
    // inner output before its backward.
    let pairs = check(&deep_mlp(Activation::Relu, 24, |i| Some((i / 2) as u32))).expect("plans");
    assert!(
        pairs.memory.activations_peak <= 16 * MIB,
        "{}",
        pairs.memory.activations_peak
    );
    // √n segments (5 layers each) keep ~5 inputs and recompute ~5 layers at a time.
    let sqrt = check(&deep_mlp(Activation::Relu, 24, |i| Some((i / 5) as u32))).expect("plans");
    assert!(sqrt.memory.activations_peak < pairs.memory.activations_peak);
    assert!(
        sqrt.memory.activations_peak <= 10 * MIB,
        "{}",
        sqrt.memory.activations_peak
    );
    for p in [&pairs, &sqrt] {
        assert!(p.steps.iter().any(|s| s.phase == Phase::Recompute));
        assert!(p.memory.layers.iter().any(|l| l.recomputed_bytes > 0));
    }
}

#[test]
fn checkpointing_each_dense_relu_layer_alone_saves_nothing() {
    // With PyTorch's semantics a segment keeps its input. A dense+relu layer saves only its
    // output (the relu writes over the GEMM output in place), and that output is the next
    // segment's input: there is nothing inside a one-layer segment to drop.
    let base = check(&deep_mlp(Activation::Relu, 24, |_| None)).expect("plans");
    let each = check(&deep_mlp(Activation::Relu, 24, |i| Some(i as u32))).expect("plans");
    assert_eq!(each.memory.activations_peak, base.memory.activations_peak);
    assert!(each.steps.iter().all(|s| s.phase != Phase::Recompute));
}

#[test]
fn checkpointing_each_dense_gelu_layer_drops_its_gemm_output() {
    // gelu's backward reads its input (the GEMM output): inside a one-layer segment, that
    // tensor is dropped after forward and recomputed before the layer's backward. Unchecked,
    // the plan keeps the GEMM outputs and remakes each GELU output for the next layer's
    // backward instead (schedule.rs, `redone_in_backward`): one of the two either way.
    let base = check(&deep_mlp(Activation::Gelu, 24, |_| None)).expect("plans");
    let each = check(&deep_mlp(Activation::Gelu, 24, |i| Some(i as u32))).expect("plans");
    assert!(
        (24 * MIB..=28 * MIB).contains(&base.memory.activations_peak),
        "{}",
        base.memory.activations_peak
    );
    assert_eq!(base.checkpoint_recompute_flops(), 0);
    assert!(
        each.memory.activations_peak <= 28 * MIB,
        "{}",
        each.memory.activations_peak
    );
    for l in each
        .memory
        .layers
        .iter()
        .filter(|l| l.name.starts_with('d'))
    {
        assert_eq!(
            l.recomputed_bytes, MIB,
            "layer {} recomputes its GEMM output",
            l.name
        );
    }
}

/// `blocks` conv 3×3 (32) → batch norm → relu blocks on 32×32×32 images, batch 16
/// (one f32 feature map: 2 MiB); block `b` gets segment `segment(b)`.
fn conv_chain(blocks: usize, segment: impl Fn(usize) -> Option<u32>) -> ModelSpec {
    let mut m = ModelSpec::new("ConvChain", 16);
    m.input("image", &[32, 32, 32], DType::F32, 1.0);
    m.input("target", &[32, 32, 32], DType::F32, 1.0);
    let mut x = "image".to_string();
    for b in 0..blocks {
        m.add(
            &format!("conv{b}"),
            LayerKind::conv2d(32, 3, 1, Padding::Same, Activation::Linear),
            &[&x],
        );
        m.add(&format!("bn{b}"), LayerKind::batch_norm(), &[]);
        x = m.add(
            &format!("relu{b}"),
            LayerKind::Activation(Activation::Relu),
            &[],
        );
        for l in m.layers.iter_mut().rev().take(3) {
            l.checkpoint = segment(b);
        }
    }
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&[&x, "target"]));
    m
}

#[test]
fn checkpointing_conv_blocks_lowers_the_activation_peak() {
    const MAP: u64 = 2 * MIB;
    let base = check(&conv_chain(16, |_| None)).expect("plans");
    // Each block keeps batch norm's normalised input and the relu output.
    assert!(
        base.memory.activations_peak >= 32 * MAP,
        "{}",
        base.memory.activations_peak
    );
    let each = check(&conv_chain(16, |b| Some(b as u32))).expect("plans");
    // A segment keeps its input (the previous relu output) and drops x_hat.
    assert!(
        each.memory.activations_peak <= 20 * MAP,
        "{}",
        each.memory.activations_peak
    );
    let bn_recomputed: u64 = each
        .memory
        .layers
        .iter()
        .filter(|l| l.name.starts_with("bn"))
        .map(|l| l.recomputed_bytes)
        .sum();
    assert!(
        bn_recomputed >= 16 * MAP,
        "x_hat of every block is recomputed: {bn_recomputed}"
    );
}

// ---- Precision -------------------------------------------------------------------------

/// u8 pixels → dense 512 relu → dense 512 gelu → dense 256 tanh → logits 10, batch 64:
/// every activation is a multiple of 512 bytes, so halving is exact after alignment.
fn mlp(precision: Precision, fp16: Option<&str>) -> ModelSpec {
    let mut m = ModelSpec::new("Mlp", 64);
    m.precision = precision;
    m.input("pixels", &[784], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("d0", LayerKind::dense(512, Activation::Relu), &["pixels"]);
    m.add("d1", LayerKind::dense(512, Activation::Gelu), &[]);
    m.add("d2", LayerKind::dense(256, Activation::Tanh), &[]);
    m.add("logits", LayerKind::dense(10, Activation::Linear), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    if let Some(l) = fp16 {
        m.set_dtype(l, DType::F16);
    }
    m
}

fn layer_row<'a>(p: &'a StaticPlan, name: &str) -> &'a memwise_plan::LayerMemory {
    p.memory
        .layers
        .iter()
        .find(|l| l.name == name)
        .expect("layer row")
}

#[test]
fn fp16_on_one_layer_halves_exactly_the_bytes_of_its_tensors() {
    let f32_plan = check(&mlp(Precision::Float32, None)).expect("plans");
    let half = check(&mlp(Precision::Float32, Some("d1"))).expect("plans");
    // Activations and their gradients (workspaces are the kernels' business).
    let by_name = |p: &StaticPlan| -> BTreeMap<String, (DType, u64)> {
        // (The f32 plan remakes d1's GELU output for d2's backward; in the f16 one, d2 keeps
        // its f32 cast of it instead.)
        p.tensors
            .iter()
            .filter(|t| t.role != Role::Workspace && !t.name.ends_with("@recompute"))
            .map(|t| (t.name.to_string(), (t.dtype, t.bytes)))
            .collect()
    };
    let (a, b) = (by_name(&f32_plan), by_name(&half));
    // Every tensor of d1 (activations and their gradients) is f16 and exactly half as big.
    let mut d1 = 0;
    for (name, &(dt, bytes)) in a.iter().filter(|(n, _)| n.starts_with("d1.")) {
        let (dt16, bytes16) = b[name];
        assert_eq!((dt, dt16), (DType::F32, DType::F16), "{name}");
        assert_eq!(2 * bytes16, bytes, "{name}");
        d1 += 1;
    }
    assert_eq!(d1, 4, "d1.linear, d1.out and their gradients");
    // Every other tensor is unchanged …
    for (name, v) in a.iter().filter(|(n, _)| !n.starts_with("d1.")) {
        assert_eq!(b[name], *v, "{name}");
    }
    // … and the only new ones are the casts at d1's two precision boundaries.
    let mut new: Vec<&str> = b
        .keys()
        .filter(|n| !a.contains_key(*n))
        .map(|n| n.as_str())
        .collect();
    new.sort_unstable();
    assert_eq!(
        new,
        [
            "d1.cast_f16",
            "d1.cast_f16.grad",
            "d2.cast_f32",
            "d2.cast_f32.grad"
        ]
    );
    // Saved bytes, term by term (64 rows): in f32 d1 keeps its GEMM output (gelu's backward),
    // 128 KiB, and remakes its own output (d2's dW) from it; in f16 it keeps its GEMM output
    // and the f16 cast of its input (its dW), 2 × 64 KiB. d2 now keeps the f32 cast of d1's
    // output for its dW (128 KiB) besides its own output (64 KiB).
    let kib = 1024;
    assert_eq!(layer_row(&f32_plan, "d1").saved_bytes, 128 * kib);
    assert_eq!(layer_row(&half, "d1").saved_bytes, 128 * kib);
    assert_eq!(layer_row(&half, "d1").dtype, DType::F16);
    assert_eq!(layer_row(&f32_plan, "d2").saved_bytes, 64 * kib);
    assert_eq!(layer_row(&half, "d2").saved_bytes, 192 * kib);
    for l in ["pixels", "d0", "logits"] {
        assert_eq!(
            layer_row(&half, l).saved_bytes,
            layer_row(&f32_plan, l).saved_bytes,
            "{l}"
        );
    }
    // Master weights stay f32; the f16 copy of d1's weight that its GEMM reads is counted.
    assert_eq!(half.memory.params - f32_plan.memory.params, 512 * 512 * 2);
    assert_eq!(half.memory.grads, f32_plan.memory.grads);
    assert!(half.loss_scaling && !f32_plan.loss_scaling);
}

#[test]
fn mixed_float16_halves_every_layers_saved_bytes() {
    let f32_plan = check(&mlp(Precision::Float32, None)).expect("plans");
    let mixed = check(&mlp(Precision::MixedFloat16, None)).expect("plans");
    for (a, b) in f32_plan
        .memory
        .layers
        .iter()
        .zip(mixed.memory.layers.iter())
    {
        if a.name == "pixels" {
            // The u8 input itself is kept (its cast is redone for the first backward).
            assert_eq!(b.saved_bytes, a.saved_bytes, "layer {}", a.name);
        } else {
            assert_eq!(2 * b.saved_bytes, a.saved_bytes, "layer {}", a.name);
        }
    }
    for t in mixed
        .tensors
        .iter()
        .filter(|t| !matches!(t.role, Role::Input | Role::Workspace) && t.name != "loss")
    {
        assert_eq!(t.dtype, DType::F16, "{}", t.name);
    }
    // Only the f32 loss scalar (256 aligned bytes) stays: the peak halves up to it.
    assert_eq!(
        2 * mixed.memory.activations_peak - 256,
        f32_plan.memory.activations_peak
    );
}

// ---- Planner bugs these properties found (minimal reproductions, now fixed) ------------

/// x f32 [8] and t f32 [8], batch 4; `a` = dense 8 sigmoid (x); loss = bce(a, t) + mse(a, t).
fn two_losses_on_one_prediction(act: Activation) -> ModelSpec {
    let mut m = ModelSpec::new("TwoLosses", 4);
    m.input("x", &[8], DType::F32, 1.0);
    m.input("t", &[8], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("a", LayerKind::dense(8, act), &["x"]);
    let first = if act == Activation::Sigmoid {
        LossTerm::new(LossKind::BinaryCrossentropy).on(&["a", "t"])
    } else {
        LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["a", "labels"])
    };
    m.loss.push(first);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["a", "t"]));
    m
}

#[test]
fn a_second_loss_term_on_a_fused_sigmoid_or_softmax_keeps_its_gradient() {
    // A loss fuses into the sigmoid (or softmax) only when it is the output's one reader.
    // With a second loss term, binary cross-entropy runs on the probabilities and the
    // sigmoid keeps its own backward; sparse cross-entropy (which has no form on
    // probabilities) is refused with a message naming the layer.
    let result = check(&two_losses_on_one_prediction(Activation::Sigmoid));
    assert!(
        result.is_ok(),
        "sigmoid: {}",
        result.err().unwrap_or_default()
    );
    let e = plan(&two_losses_on_one_prediction(Activation::Softmax)).unwrap_err();
    assert_eq!(e.layer.as_deref(), Some("a"));
    assert!(e.message.contains("also read elsewhere"), "{e}");
}

#[test]
fn sparse_ce_on_a_softmax_that_a_layer_also_reads_is_refused() {
    // `a` = dense 8 softmax (x), `b` = dense 5 softmax (a); losses: sce(a, labels) and
    // sce(b, labels). `a` has a consumer, so the loss cannot fold `a`'s softmax into its
    // gradient; it used to fall back to cross-entropy from logits on the probabilities
    // (softmax twice). Now it is a planning error naming `a`.
    let mut m = ModelSpec::new("SoftmaxTwice", 4);
    m.input("x", &[8], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("a", LayerKind::dense(8, Activation::Softmax), &["x"]);
    m.add("b", LayerKind::dense(5, Activation::Softmax), &["a"]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["a", "labels"]));
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["b", "labels"]));
    let e = plan(&m).unwrap_err();
    assert_eq!(e.layer.as_deref(), Some("a"), "{e}");
}

#[test]
fn parameters_without_a_gradient_are_not_updated() {
    // 1. `dead` reads x but nothing reads `dead`; 2. `b` only feeds the target of mse(a, b)
    //    (a target takes no gradient). Both get `update` steps whose gradient no step wrote:
    //    the runtime would apply momentum/Adam/weight decay with a stale or zero gradient
    //    (PyTorch skips such parameters; Keras warns). Either drop their update (and their
    //    gradient and state bytes) or reject the model naming the layer.
    let mut dead = ModelSpec::new("DeadBranch", 4);
    dead.input("x", &[8], DType::F32, 1.0);
    dead.input("t", &[8], DType::F32, 1.0);
    dead.add("a", LayerKind::dense(8, Activation::Linear), &["x"]);
    dead.add("dead", LayerKind::dense(8, Activation::Relu), &["x"]);
    dead.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["a", "t"]));
    let mut target = ModelSpec::new("LayerAsTarget", 4);
    target.input("x", &[8], DType::F32, 1.0);
    target.input("t", &[8], DType::F32, 1.0);
    target.add("a", LayerKind::dense(8, Activation::Linear), &["x"]);
    target.add("b", LayerKind::dense(8, Activation::Linear), &["t"]);
    target
        .loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["a", "b"]));
    for spec in [dead, target] {
        if let Ok(p) = plan(&spec) {
            assert_eq!(check_completeness(&p), Ok(()), "{}", spec.name);
        }
    }
}

/// Layer `l` has no recompute step at all (a `recompute_output` mark whose output no later
/// backward keeps changes nothing).
fn redoes_nothing(p: &StaticPlan, l: &memwise_plan::LayerMemory) -> bool {
    !p.steps
        .iter()
        .any(|s| s.phase == Phase::Recompute && s.layer == l.name)
}
