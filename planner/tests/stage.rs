//! One plan per pipeline stage (`memwise_plan::stage`): every stage's plan validates; the
//! stages together hold the model's parameters once; each channel's sends and receives
//! match one for one; a stage keeps exactly the micro-batches its schedule has in flight
//! (Megatron-LM's `p` on 1F1B's first stage, `m` under GPipe or when `m < p`); each layer
//! keeps, per micro-batch, what it keeps on one device; and a malformed split is an error
//! that names it.

use memwise_plan::pipeline::{in_flight, stage_work, PipelineSchedule};
use memwise_plan::stage::{plan_pipeline, plan_stage, Pipeline};
use memwise_plan::zoo::{mnist_mlp as mlp, small_gpt as gpt};
use memwise_plan::*;

const SCHEDULES: [PipelineSchedule; 2] = [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB];

/// The splits the issue names: the MLP in 2 stages, the 4-block GPT in 2 and in 4; and the
/// guide's VAE, encoder and decoder (its KL term stays with the encoder, the reconstruction
/// term reads the decoder's output and the pixels the encoder's stage casts).
fn splits() -> Vec<(ModelSpec, Vec<&'static str>)> {
    vec![
        (mlp(64), vec!["logits"]),
        (memwise_plan::zoo::conv_vae(64), vec!["dec_dense"]),
        (gpt(4, 8), vec!["b2_ln1"]),
        (gpt(4, 8), vec!["b1_ln1", "b2_ln1", "b3_ln1"]),
    ]
}

/// The (bytes) of each transfer of `plan` with `peer`: sends, or receives.
fn transfers(plan: &StaticPlan, peer: u32, sends: bool) -> Vec<(Phase, u64)> {
    plan.steps
        .iter()
        .filter_map(|s| match s.op {
            Op::SendTensor { bytes, stage } if sends && stage == peer => Some((s.phase, bytes)),
            Op::RecvTensor { bytes, stage } if !sends && stage == peer => Some((s.phase, bytes)),
            _ => None,
        })
        .collect()
}

#[test]
fn every_stage_plan_validates_and_the_channels_match() {
    for (spec, boundaries) in splits() {
        let one = plan(&spec).unwrap();
        for schedule in SCHEDULES {
            for m in [1, 2, 4, 8] {
                let pipe = Pipeline::new(schedule, m, &boundaries);
                let pp = plan_pipeline(&spec, &pipe).unwrap();
                let p = pp.stages.len();
                assert_eq!(p, boundaries.len() + 1);
                // The stages hold the model's parameters once between them.
                let held: u64 = pp.stages.iter().map(|s| s.params_count).sum();
                assert_eq!(held, one.params_count, "{schedule:?} m={m}");
                let persistent: u64 = pp.stages.iter().map(|s| s.persistent_bytes).sum();
                assert_eq!(persistent, one.persistent_bytes);
                for a in 0..p {
                    for b in (0..p).filter(|&b| b != a) {
                        let sent = transfers(&pp.stages[a], b as u32, true);
                        let received = transfers(&pp.stages[b], a as u32, false);
                        assert_eq!(sent, received, "{} → {}: {schedule:?} m={m}", a, b);
                        // Activations go forward, gradients back.
                        let phase = if a < b {
                            Phase::Forward
                        } else {
                            Phase::Backward
                        };
                        assert!(sent.iter().all(|&(ph, _)| ph == phase));
                    }
                    // Adjacent stages talk every micro-batch, both ways.
                    if a + 1 < p {
                        assert!(transfers(&pp.stages[a], a as u32 + 1, true).len() >= m);
                        assert!(transfers(&pp.stages[a + 1], a as u32, true).len() >= m);
                    }
                }
            }
        }
    }
}

#[test]
fn one_stage_of_one_micro_batch_is_the_one_device_plan() {
    for spec in [mlp(64), gpt(2, 4)] {
        let one = plan(&spec).unwrap();
        let pipe = Pipeline::new(PipelineSchedule::OneFOneB, 1, &[]);
        let stage = plan_stage(&spec, &pipe, 0).unwrap();
        assert_eq!(stage.steps.len(), one.steps.len());
        assert_eq!(stage.memory.total, one.memory.total, "{}", spec.name);
        assert_eq!(stage.arena_bytes, one.arena_bytes);
        for (a, b) in stage.steps.iter().zip(one.steps.iter()) {
            assert_eq!((a.phase, a.op), (b.phase, b.op));
        }
    }
}

/// The most micro-batches any of whose activations (or their gradients) are alive at once;
/// not counting the loss values, which the runtime reads after the step.
fn micro_batches_alive(plan: &StaticPlan) -> usize {
    let micro_batch = |name: &str| -> usize { name.rsplit('@').next().unwrap().parse().unwrap() };
    (0..plan.steps.len() as u32)
        .map(|i| {
            let mut alive: Vec<usize> = (plan.tensors.iter())
                .filter(|t| t.role != Role::Input && !plan.losses.contains(&t.id))
                .filter(|t| t.first <= i && i <= t.last)
                .map(|t| micro_batch(&t.name))
                .collect();
            alive.sort_unstable();
            alive.dedup();
            alive.len()
        })
        .max()
        .unwrap()
}

#[test]
fn a_stage_holds_the_micro_batches_its_schedule_has_in_flight() {
    let spec = gpt(4, 8);
    let boundaries = ["b1_ln1", "b2_ln1", "b3_ln1"];
    for schedule in SCHEDULES {
        for m in [1, 2, 4, 8] {
            let pipe = Pipeline::new(schedule, m, &boundaries);
            for s in 0..4 {
                let stage = plan_stage(&spec, &pipe, s).unwrap();
                let expected = in_flight(&stage_work(schedule, s, 4, m));
                assert_eq!(
                    micro_batches_alive(&stage),
                    expected,
                    "{schedule:?} m={m} s={s}"
                );
                // Megatron-LM's factors: 1F1B's first stage holds p micro-batches (m when
                // there are fewer), GPipe every one.
                if s == 0 {
                    let megatron = match schedule {
                        PipelineSchedule::GPipe => m,
                        PipelineSchedule::OneFOneB => m.min(4),
                    };
                    assert_eq!(expected, megatron);
                }
            }
        }
    }
}

#[test]
fn each_layer_keeps_per_micro_batch_what_it_keeps_on_one_device() {
    let (spec, m) = (gpt(4, 8), 4);
    let one = plan(&spec.with_batch(2)).unwrap();
    let pipe = Pipeline::new(PipelineSchedule::OneFOneB, m, &["b2_ln1"]);
    let pp = plan_pipeline(&spec, &pipe).unwrap();
    let mut rows = 0;
    for stage in &pp.stages {
        for row in stage.memory.layers.iter() {
            let alone = one
                .memory
                .layers
                .iter()
                .find(|r| r.name == row.name)
                .unwrap();
            assert_eq!(
                row.saved_bytes,
                m as u64 * alone.saved_bytes,
                "{}",
                row.name
            );
            assert_eq!(row.params, alone.params);
            rows += 1;
        }
    }
    assert_eq!(
        rows,
        one.memory.layers.len(),
        "every layer is in one stage's rows"
    );
}

#[test]
fn more_micro_batches_shrink_the_bubble() {
    let spec = gpt(4, 16);
    let mut last = 1.0;
    for m in [1, 2, 4, 8, 16] {
        let pipe = Pipeline::new(
            PipelineSchedule::OneFOneB,
            m,
            &["b1_ln1", "b2_ln1", "b3_ln1"],
        );
        let bubble = plan_pipeline(&spec, &pipe).unwrap().bubble_fraction();
        assert!(
            bubble > 0.0 && bubble < last,
            "m={m}: {bubble} after {last}"
        );
        last = bubble;
    }
    let one = Pipeline::new(PipelineSchedule::GPipe, 4, &[]);
    assert_eq!(plan_pipeline(&spec, &one).unwrap().bubble_fraction(), 0.0);
}

#[test]
fn a_malformed_split_is_an_error_that_names_it() {
    let err =
        |spec: &ModelSpec, pipe: Pipeline| plan_stage(spec, &pipe, 0).unwrap_err().to_string();
    let g = PipelineSchedule::GPipe;
    let e = err(&mlp(64), Pipeline::new(g, 2, &["nowhere"]));
    assert!(e.contains("`nowhere` names no layer"), "{e}");
    let e = err(&gpt(2, 4), Pipeline::new(g, 2, &["b1_ln1", "b0_ln2"]));
    assert!(e.contains("follow the layers' order"), "{e}");
    let e = err(&mlp(64), Pipeline::new(g, 3, &["logits"]));
    assert!(e.contains("does not split into 3 micro-batches"), "{e}");
    assert!(e.contains("`batch = 63` or `batch = 66`"), "{e}");
    let mut checkpointed = gpt(2, 4);
    checkpointed.checkpoint(&["b0_mlp1", "b0_mlp2", "b0_res2", "b1_ln1"], 0);
    let e = err(&checkpointed, Pipeline::new(g, 2, &["b1_ln1"]));
    assert!(e.contains("checkpoint segment 0"), "{e}");
    let e = err(&mlp(64).with_replicas(2), Pipeline::new(g, 3, &["logits"]));
    assert!(
        e.contains("does not split into 3 micro-batches and 2 replicas"),
        "{e}"
    );
    assert!(e.contains("`batch = 60` or `batch = 66`"), "{e}");
    let zero = mlp(64)
        .with_replicas(2)
        .with_sharding(memwise_plan::data_parallel::Sharding::OptimizerState);
    let e = err(&zero, Pipeline::new(g, 2, &["logits"]));
    assert!(e.contains("ZeRO sharding within a pipeline"), "{e}");
}

#[test]
fn the_stages_plans_tell_their_pipeline() {
    for (spec, boundaries) in splits() {
        for schedule in SCHEDULES {
            let pipe = Pipeline::new(schedule, 4, &boundaries);
            let pp = plan_pipeline(&spec, &pipe).unwrap();
            let again = memwise_plan::stage::PipelinePlan::of_stages(pp.stages.clone());
            assert_eq!(again.pipeline, pipe, "{}", spec.name);
        }
    }
}

#[test]
fn the_chosen_split_is_no_worse_than_any_single_boundary_and_fits_where_it_says() {
    use memwise_plan::split::{balance, fewest_stages, max_batch};
    let spec = gpt(4, 8);
    let chosen = balance(&spec, 2, 4, PipelineSchedule::OneFOneB).unwrap();
    let best = chosen.largest_stage().1;
    // Every two-stage split: none has a smaller largest stage.
    let layers: Vec<&str> = spec
        .layers
        .iter()
        .skip(2)
        .map(|l| l.name.as_str())
        .collect();
    for at in &layers[1..] {
        let pipe = Pipeline::new(PipelineSchedule::OneFOneB, 4, &[at]);
        if let Ok(pp) = plan_pipeline(&spec, &pipe) {
            assert!(
                pp.largest_stage().1 >= best,
                "a split at `{at}` beats the chosen one"
            );
        }
    }
    // The fewest stages that fit a budget between the 2- and the 1-stage totals: 2.
    let one = balance(&spec, 1, 4, PipelineSchedule::OneFOneB)
        .unwrap()
        .largest_stage()
        .1;
    assert!(best < one);
    let fit = fewest_stages(&spec, (best + one) / 2, 4, PipelineSchedule::OneFOneB).unwrap();
    assert_eq!(fit.stages.len(), 2);
    // The largest batch under a budget: every stage fits there, not one micro-batch round more.
    let budget = best * 3;
    let b = max_batch(&spec, &chosen.pipeline, budget).unwrap();
    assert_eq!(b % 4, 0);
    let at = |batch: usize| plan_pipeline(&spec.with_batch(batch), &chosen.pipeline).unwrap();
    assert!(at(b).largest_stage().1 <= budget);
    assert!(at(b + 4).largest_stage().1 > budget);
}

/// Dynamic loss scaling across stages: each stage with parameters checks its own gradients
/// (and no other stage's), then every stage takes part in the flag sum, and only then
/// update: so a gradient that overflows on one stage skips the step on all.
#[test]
fn with_loss_scaling_each_stage_checks_its_gradients_before_the_stages_agree() {
    for (mut spec, boundaries) in splits() {
        spec.precision = Precision::MixedFloat16;
        let pipe = Pipeline::new(PipelineSchedule::OneFOneB, 4, &boundaries);
        for (k, stage) in plan_pipeline(&spec, &pipe)
            .unwrap()
            .stages
            .iter()
            .enumerate()
        {
            assert!(stage.loss_scaling, "{} stage {k}", spec.name);
            let at = |f: &dyn Fn(&Op) -> bool| stage.steps.iter().position(|s| f(&s.op));
            let check = at(&|op| *op == Op::CheckFinite).expect("a finite check");
            let settle = at(&|op| matches!(op, Op::AllReduceGradients { last: true, .. }));
            let first_update = at(&|op| *op == Op::Update).expect("an update");
            let settle = settle.expect("the stages' flag sum");
            assert!(
                check < settle && settle < first_update,
                "{} stage {k}",
                spec.name
            );
            let checked = &stage.steps[check].params;
            assert_eq!(checked.len(), stage.params.len(), "{} stage {k}", spec.name);
            assert!(checked.iter().all(|&p| (p as usize) < stage.params.len()));
        }
    }
}

/// A replica of a pipeline is the whole pipeline on its share of the batch: each stage's
/// plan over `r` replicas at batch `B` is its plan at batch `B / r`, its memory to the byte,
/// with its gradients summed over its replicas — every trained parameter once, each bucket
/// after the last backward step (of the last micro-batch) that writes its gradients, all
/// before the finite check and the flag sum every rank agrees on.
#[test]
fn a_replicated_pipeline_stage_is_its_share_of_the_batch_with_its_gradients_summed() {
    for (spec, boundaries) in splits() {
        for schedule in SCHEDULES {
            let pipe = Pipeline::new(schedule, 4, &boundaries);
            let mut replicated = spec.with_replicas(2);
            replicated.precision = Precision::MixedFloat16;
            let mut half = spec.with_batch(spec.batch / 2);
            half.precision = Precision::MixedFloat16;
            let alone = plan_pipeline(&half, &pipe).unwrap();
            let both = plan_pipeline(&replicated, &pipe).unwrap();
            for (k, (a, r)) in alone.stages.iter().zip(&both.stages).enumerate() {
                let what = format!("{} {schedule:?} stage {k}", spec.name);
                assert_eq!(r.replicas, 2, "{what}");
                assert_eq!(r.batch, a.batch, "{what}");
                assert_eq!(r.memory.total, a.memory.total, "{what}");
                let sums: Vec<(usize, &PlanStep)> = (r.steps.iter().enumerate())
                    .filter(|(_, s)| matches!(s.op, Op::AllReduceGradients { .. }))
                    .filter(|(_, s)| !s.params.is_empty())
                    .collect();
                let mut summed: Vec<u32> = sums
                    .iter()
                    .flat_map(|(_, s)| s.params.iter().copied())
                    .collect();
                summed.sort_unstable();
                let trained: Vec<u32> = (0..r.params.len() as u32)
                    .filter(|&i| r.params[i as usize].trainable)
                    .collect();
                assert_eq!(
                    summed, trained,
                    "{what}: every trained parameter summed once"
                );
                for &(at, sum) in &sums {
                    let Op::AllReduceGradients { bytes, last } = sum.op else {
                        unreachable!()
                    };
                    assert!(!last, "{what}: the stages settle the flag together");
                    let elems: usize = sum
                        .params
                        .iter()
                        .map(|&p| r.params[p as usize].elems())
                        .sum();
                    assert_eq!(bytes, elems as u64 * 4, "{what}");
                    let last_writer = (r.steps.iter())
                        .rposition(|s| {
                            s.phase == Phase::Backward
                                && !matches!(s.op, Op::AllReduceGradients { .. })
                                && s.params.iter().any(|p| sum.params.contains(p))
                        })
                        .unwrap();
                    assert!(
                        last_writer < at,
                        "{what}: a sum before its gradients are written"
                    );
                    assert_eq!(r.steps[last_writer].micro_batch, 3, "{what}");
                }
                let check = r
                    .steps
                    .iter()
                    .position(|s| s.op == Op::CheckFinite)
                    .unwrap();
                assert!(sums.iter().all(|&(at, _)| at < check), "{what}");
                let settle = (r.steps.iter())
                    .position(|s| {
                        s.params.is_empty()
                            && matches!(s.op, Op::AllReduceGradients { last: true, .. })
                    })
                    .unwrap();
                assert!(check < settle, "{what}");
            }
        }
    }
    for rank in 0..8 {
        let (stage, replica) = memwise_plan::stage::stage_of_rank(rank, 2);
        assert_eq!(memwise_plan::stage::stage_rank(stage, replica, 2), rank);
        assert_eq!((stage, replica), (rank / 2, rank % 2));
    }
}

/// `evaluate` and `predict` of a split model run each stage's inference plan: over a batch
/// of any size (here 11, no multiple of anything), every stage runs one device's inference
/// steps of its own layers, and together exactly one device's; the sends of each channel
/// match its receives; nothing is trained, summed or settled; the prediction is kept to the
/// end on the one stage that makes it; and each stage holds its training plan's parameters.
#[test]
fn an_inference_stage_runs_one_devices_inference_steps_of_its_layers() {
    use memwise_plan::stage::plan_stage_inference;
    let key = |s: &PlanStep| format!("{} {:?}", s.layer, s.op);
    for (spec, boundaries) in splits() {
        let pipe = Pipeline::new(PipelineSchedule::OneFOneB, 4, &boundaries);
        let one = plan_inference(&spec.with_batch(11)).unwrap();
        let stages: Vec<StaticPlan> = (0..pipe.stages())
            .map(|s| plan_stage_inference(&spec, &pipe, s, 11).unwrap())
            .collect();
        let mut ran: Vec<String> = Vec::new();
        for (k, p) in stages.iter().enumerate() {
            assert!(
                !p.training && p.batch == 11 && p.micro_batches == 1,
                "{}",
                spec.name
            );
            let trained = plan_stage(&spec, &pipe, k).unwrap();
            let names = |p: &StaticPlan| -> Vec<String> {
                p.params.iter().map(|q| q.name.to_string()).collect()
            };
            assert_eq!(names(p), names(&trained), "{} stage {k}", spec.name);
            for s in p.steps.iter() {
                assert!(
                    matches!(s.phase, Phase::Forward | Phase::Loss),
                    "{} stage {k}: {:?} {}",
                    spec.name,
                    s.phase,
                    s.op.name()
                );
                if !matches!(s.op, Op::SendTensor { .. } | Op::RecvTensor { .. }) {
                    ran.push(key(s));
                }
            }
            if k + 1 < stages.len() {
                let next = k as u32 + 1;
                assert_eq!(
                    transfers(p, next, true),
                    transfers(&stages[k + 1], k as u32, false),
                    "{} stage {k} to {next}",
                    spec.name
                );
            }
            if p.prediction != NONE {
                assert_eq!(p.tensor(p.prediction).last as usize, p.steps.len() - 1);
                assert_eq!(
                    p.tensor(p.prediction).layer,
                    one.tensor(one.prediction).layer
                );
            }
        }
        let holders = stages.iter().filter(|p| p.prediction != NONE).count();
        assert_eq!(holders, 1, "{}", spec.name);
        let mut all: Vec<String> = one.steps.iter().map(key).collect();
        all.sort();
        ran.sort();
        assert_eq!(ran, all, "{}", spec.name);
    }
}
