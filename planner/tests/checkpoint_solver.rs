//! The checkpointing solver (`memwise_plan::checkpoint`) against exhaustive search.
//!
//! Every segmentation of a model's units is planned with the real schedule (persistent bytes
//! plus the arena's lower bound, and the FLOPs of the recompute steps); at several budgets
//! between the smallest feasible total and the unchecked one, the solver must find:
//! - on chains (random chains; random DAGs that are chains of residual/concat blocks): the
//!   exhaustive minimum recomputation, exactly;
//! - on general graphs (random DAGs with skips across many layers): a fitting segmentation
//!   within 5 % of the exhaustive minimum.
//!
//! Debug builds try fewer and smaller models (an exhaustive search plans thousands of
//! schedules); `cargo test --release -p memwise-plan --test checkpoint_solver` runs the deep
//! sweep (chains of up to 12 units, general graphs of up to 11). `MEMWISE_SEEDS=N` and
//! `MEMWISE_MAX_UNITS=K` override the number of seeds and the size limit.

use memwise_plan::checkpoint::{
    self, max_batch_with, with_choice, Evaluation, Method, Policy, Selection, Solver,
};
use memwise_plan::generate::{random_chain, random_dag, SplitMix64};
use memwise_plan::{plan, zoo, ModelSpec, Op, Phase};

/// `name` from the environment, else `debug` in a debug build and `release` in a release one
/// (an exhaustive search plans thousands of schedules per model).
fn env(name: &str, debug: usize, release: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) {
            debug
        } else {
            release
        })
}

/// Every segmentation of `m` units: each unit is unchecked, starts a segment, or (after a
/// checkpointed unit) continues its segment. F(2m+1) of them: 10,946 for 10 units.
fn segmentations(m: usize) -> Vec<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut cur: Vec<(usize, usize)> = Vec::new();
    fn go(u: usize, m: usize, cur: &mut Vec<(usize, usize)>, out: &mut Vec<Vec<(usize, usize)>>) {
        if u > m {
            out.push(cur.clone());
            return;
        }
        go(u + 1, m, cur, out);
        cur.push((u, u));
        go(u + 1, m, cur, out);
        cur.pop();
        if cur.last().is_some_and(|&(_, e)| e + 1 == u) {
            let k = cur.len() - 1;
            cur[k].1 = u;
            go(u + 1, m, cur, out);
            cur[k].1 = u - 1;
        }
    }
    go(1, m, &mut cur, &mut out);
    out
}

/// Every selection: each segmentation with each subset of the units outside its segments
/// that can recompute their norms' outputs.
fn selections(s: &Solver) -> Vec<Selection> {
    let selectable = s.output_units();
    let mut out = Vec::new();
    for segments in segmentations(s.unit_count()) {
        let free: Vec<usize> = (selectable.iter().copied())
            .filter(|&u| !segments.iter().any(|&(a, b)| a <= u && u <= b))
            .collect();
        for mask in 0..1usize << free.len() {
            let outputs = (0..free.len())
                .filter(|k| mask >> k & 1 == 1)
                .map(|k| free[k])
                .collect();
            out.push(Selection {
                segments: segments.clone(),
                outputs,
            });
        }
    }
    out
}

/// The exhaustive table: every selection's real evaluation.
fn exhaustive(s: &Solver) -> Vec<(Selection, Evaluation)> {
    selections(s)
        .into_iter()
        .map(|sel| {
            let e = s.evaluate(&sel);
            (sel, e)
        })
        .collect()
}

/// Budgets from the smallest feasible total to the unchecked one: both ends, the quartiles
/// between, and two totals some segmentation reaches exactly (the edge of feasibility).
fn budgets(table: &[(Selection, Evaluation)], seed: u64) -> Vec<u64> {
    let mut totals: Vec<u64> = table.iter().map(|(_, e)| e.total).collect();
    totals.sort_unstable();
    totals.dedup();
    let (lo, hi) = (totals[0], table[0].1.total.max(totals[0]));
    let mut out = vec![lo, hi];
    for q in 1..4 {
        out.push(lo + (hi - lo) * q / 4);
    }
    let mut rng = SplitMix64::new(seed);
    for _ in 0..2 {
        let t = totals[rng.below(totals.len())];
        if t <= hi {
            out.push(t);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The exhaustive minimum recomputation within `budget`.
fn best_cost(table: &[(Selection, Evaluation)], budget: u64) -> Option<u64> {
    table
        .iter()
        .filter(|(_, e)| e.total <= budget)
        .map(|(_, e)| e.recompute_flops)
        .min()
}

struct Tally {
    models: usize,
    budgets: usize,
    skipped: usize,
    largest: usize,
    /// Models with units that can recompute their norms' outputs (the program's third
    /// choice per unit, against the exhaustive table's every subset of them).
    with_outputs: usize,
    /// Segmentations the exhaustive search planned, and the solver's search evaluated.
    space: usize,
    searched: usize,
    failures: Vec<String>,
}

impl Tally {
    fn assert_clean(&self) {
        assert!(
            self.failures.is_empty(),
            "{} failures:\n{}",
            self.failures.len(),
            self.failures.join("\n")
        );
    }
}

/// Checks the solver against exhaustive search on each model `specs` yields whose kind
/// (`chain`) matches, with at most `max_units` units; `check(opt, found)` judges one budget.
fn versus_exhaustive(
    specs: impl Iterator<Item = (u64, ModelSpec)>,
    chain: bool,
    max_units: usize,
    check: impl Fn(u64, Option<u64>, Option<(Selection, Evaluation)>) -> Result<(), String>,
) -> Tally {
    let mut t = Tally {
        models: 0,
        budgets: 0,
        skipped: 0,
        largest: 0,
        with_outputs: 0,
        space: 0,
        searched: 0,
        failures: Vec::new(),
    };
    let mut failures = Vec::new();
    for (seed, spec) in specs {
        let Ok(s) = Solver::new(&spec) else { continue };
        if s.is_chain() != chain {
            continue;
        }
        if s.unit_count() > max_units {
            t.skipped += 1;
            continue;
        }
        t.models += 1;
        t.with_outputs += !s.output_units().is_empty() as usize;
        t.largest = t.largest.max(s.unit_count());
        let table = exhaustive(&s);
        let bs = budgets(&table, seed);
        t.space += table.len() * bs.len();
        for b in bs {
            t.budgets += 1;
            let before = s.search_evaluations();
            let found = s.optimal(b);
            t.searched += s.search_evaluations() - before;
            if let Some((_, e)) = &found {
                if e.total > b {
                    failures.push(format!(
                        "seed {seed}: budget {b}: the choice needs {}",
                        e.total
                    ));
                    continue;
                }
            }
            if let Err(msg) = check(b, best_cost(&table, b), found) {
                failures.push(format!(
                    "seed {seed} ({} units): budget {b}: {msg}",
                    s.unit_count()
                ));
            }
        }
    }
    t.failures = failures;
    t
}

#[test]
fn chain_program_equals_exhaustive_search() {
    let seeds = env("MEMWISE_SEEDS", 60, 400) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 10, 12);
    let t = versus_exhaustive(
        (0..seeds).map(|s| (s, random_chain(s))),
        true,
        max_units,
        |_, best, found| {
            let got = found.map(|(_, e)| e.recompute_flops);
            if got == best {
                Ok(())
            } else {
                Err(format!("exhaustive {best:?}, program {got:?}"))
            }
        },
    );
    eprintln!(
        "chains: {} models (up to {} units, {} with norms that can recompute their outputs), {} budgets, {} skipped as larger than {max_units} units",
        t.models, t.largest, t.with_outputs, t.budgets, t.skipped
    );
    t.assert_clean();
    assert!(t.models >= seeds as usize / 3);
    assert!(
        t.with_outputs >= t.models / 10,
        "too few models exercise recompute_output"
    );
}

#[test]
fn chains_of_blocks_equal_exhaustive_search() {
    // Random DAGs whose residual, projection, inception and U-Net steps are single-entry
    // single-exit blocks between cut points: the program is exact over whole blocks.
    let seeds = env("MEMWISE_SEEDS", 150, 600) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 10, 12);
    let t = versus_exhaustive(
        (0..seeds).map(|s| (s, random_dag(s))),
        true,
        max_units,
        |_, best, found| {
            let got = found.map(|(_, e)| e.recompute_flops);
            if got == best {
                Ok(())
            } else {
                Err(format!("exhaustive {best:?}, program {got:?}"))
            }
        },
    );
    eprintln!(
        "chains of blocks: {} models (up to {} units), {} budgets, {} skipped",
        t.models, t.largest, t.budgets, t.skipped
    );
    t.assert_clean();
    assert!(t.models >= 5);
}

#[test]
fn general_graphs_within_five_percent_of_exhaustive_search() {
    let seeds = env("MEMWISE_SEEDS", 50, 600) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 9, 11);
    let gaps = std::cell::RefCell::new(Vec::new());
    let t = versus_exhaustive(
        (0..seeds).map(|s| (s, random_dag(s))),
        false,
        max_units,
        |_, best, found| match (best, found) {
            (None, None) => Ok(()),
            (None, Some(_)) => Err("found a fit exhaustive search did not".into()),
            (Some(_), None) => Err("found nothing; exhaustive search fits".into()),
            (Some(best), Some((_, e))) => {
                let gap = (e.recompute_flops - best) as f64 / best.max(1) as f64;
                gaps.borrow_mut().push(gap);
                if e.recompute_flops as f64 <= best as f64 * 1.05 {
                    Ok(())
                } else {
                    Err(format!(
                        "recomputes {} FLOPs, exhaustive {best} (+{:.1}%)",
                        e.recompute_flops,
                        100.0 * gap
                    ))
                }
            }
        },
    );
    let gaps = gaps.into_inner();
    let exact = gaps.iter().filter(|&&g| g == 0.0).count();
    eprintln!(
        "general graphs: {} models (up to {} units), {} budgets, {} skipped; optimal at {exact} of {} fitting budgets, worst gap {:.2}%; the search planned {:.1}% as many segmentations as exhaustive search",
        t.models,
        t.largest,
        t.budgets,
        t.skipped,
        gaps.len(),
        100.0 * gaps.iter().copied().fold(0.0, f64::max),
        100.0 * t.searched as f64 / t.space.max(1) as f64
    );
    t.assert_clean();
    assert!(t.models >= 5);
}

/// A random segmentation of `m` units.
fn random_segments(rng: &mut SplitMix64, m: usize) -> Vec<(usize, usize)> {
    let mut segs = Vec::new();
    let mut u = 1;
    while u <= m {
        if rng.chance(0.5) {
            let e = (u + rng.below(4)).min(m);
            segs.push((u, e));
            u = e + 1;
        } else {
            u += 1;
        }
    }
    segs
}

#[test]
fn chain_live_bytes_decompose_into_block_terms() {
    // The program's memory for a segmentation — kept bytes summed block by block, each
    // block's peak read off probes — equals the real schedule's, on random chains and on
    // the residual blocks of ResNet-50 and the GPT-2 stack (at small batches: the schedule
    // does not depend on the batch).
    let mut models: Vec<(String, ModelSpec)> = (0..env("MEMWISE_SEEDS", 60, 400) as u64)
        .map(|s| (format!("chain {s}"), random_chain(s)))
        .collect();
    models.push(("resnet50".into(), zoo::resnet50(2)));
    models.push(("gpt2_stack".into(), zoo::gpt2_stack(1, 3)));
    models.push(("vgg19".into(), zoo::vgg19(1)));
    let mut checked = 0;
    for (name, spec) in models {
        let s = Solver::new(&spec).unwrap();
        assert!(s.is_chain(), "{name} is a chain of units");
        assert!(
            !s.inconsistent(),
            "{name}: two probes read one block differently"
        );
        let mut rng = SplitMix64::new(checked as u64);
        for _ in 0..12 {
            let segs = random_segments(&mut rng, s.unit_count());
            let real = s.evaluate_units(&segs).total;
            assert_eq!(s.model_total(&segs), Some(real), "{name}: {segs:?}");
            checked += 1;
        }
    }
    eprintln!("{checked} segmentations: model memory = real memory");
}

#[test]
fn resnet_units_are_its_bottlenecks() {
    let s = Solver::new(&zoo::resnet50(1)).unwrap();
    // conv1_conv, conv1_bn, conv1_relu, pool1_pool, 16 bottlenecks, avg_pool, predictions.
    assert_eq!(s.unit_count(), 22);
    assert_eq!(s.unit_layers(5)[0], "conv2_block1_0_conv");
    assert_eq!(s.unit_layers(5).last().unwrap(), "conv2_block1_out");
    let g = Solver::new(&zoo::gpt2_stack(1, 4)).unwrap();
    // Each block splits at its first residual sum; then ln_f.
    assert!(g.is_chain());
    assert_eq!(g.unit_count(), 9);
    assert_eq!(g.unit_layers(1).last().unwrap(), "h0_add_1");
    assert_eq!(g.unit_layers(2).last().unwrap(), "h0_add_2");
    // Two blocks: one half-block would be a quarter of the model; the search works on layers.
    let small = Solver::new(&zoo::gpt2_stack(1, 2)).unwrap();
    assert!(!small.is_chain());
    assert_eq!(small.unit_count(), 19);
}

/// Planned total and recompute FLOPs of `spec`.
fn planned(spec: &ModelSpec) -> (u64, u64) {
    let p = plan(spec).unwrap();
    // The recompute steps of checkpointed layers and the norm forwards of layers that
    // recompute their outputs: not the ones every plan has.
    let chosen = |s: &memwise_plan::PlanStep| {
        spec.layer(&s.layer).is_some_and(|l| {
            l.checkpoint.is_some()
                || (l.recompute_output
                    && matches!(s.op, Op::LayerNorm { .. } | Op::BatchNorm { .. }))
        })
    };
    let flops = p
        .steps
        .iter()
        .filter(|s| s.phase == Phase::Recompute && chosen(s))
        .map(|s| s.op.forward_flops())
        .sum();
    assert_eq!(flops, p.checkpoint_recompute_flops());
    (p.memory.total, flops)
}

#[test]
fn solve_fits_every_budget_and_reports_its_cost() {
    for spec in [
        zoo::mnist_mlp(128),
        zoo::conv_vae(32),
        zoo::gpt2_stack(1, 2),
        zoo::resnet50(2),
    ] {
        let s = Solver::new(&spec).unwrap();
        let (smallest, selection) = s.smallest_total();
        let unchecked = planned(&spec).0;
        assert!(smallest <= unchecked);
        let floor = planned(&with_choice(
            &spec,
            &s.segment_names(&selection.segments),
            &s.output_names(&selection.outputs),
        ))
        .0;
        let mut last_cost = 0u64;
        for k in 0..=4u64 {
            let budget = unchecked - (unchecked - floor) * k / 4;
            let c = s
                .solve(budget)
                .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            assert!(c.total <= budget, "{}: {} > {budget}", spec.name, c.total);
            assert_eq!(c.unchecked_total, unchecked);
            // The choice is exactly what the user would get by writing it down.
            assert_eq!(planned(&c.apply(&spec)), (c.total, c.recompute_flops));
            // Tighter budgets never recompute less.
            assert!(
                c.recompute_flops >= last_cost,
                "{}: cost fell as the budget shrank",
                spec.name
            );
            last_cost = c.recompute_flops;
            assert_eq!(c.method == Method::ChainOptimal, s.is_chain());
            let text = c.to_string();
            if c.segments.is_empty() {
                assert!(text.starts_with("no checkpointing needed"), "{text}");
            } else {
                assert!(text.contains("% of forward FLOPs"), "{text}");
                let pct = 100.0 * c.recompute_flops as f64 / c.forward_flops as f64;
                assert!((c.recompute_percent() - pct).abs() < 1e-9);
            }
        }
        assert_eq!(s.solve(unchecked).unwrap().recompute_flops, 0);
    }
}

#[test]
fn no_fit_names_the_smallest_reachable_total() {
    let spec = zoo::gpt2_stack(1, 2);
    let s = Solver::new(&spec).unwrap();
    let (smallest, _) = s.smallest_total();
    let err = checkpoint::solve(&spec, smallest - 1).unwrap_err();
    assert!(
        err.message
            .contains("smallest total any checkpointing reaches"),
        "{err}"
    );
    assert!(
        err.message
            .contains(&memwise_plan::advice::format_bytes(smallest)),
        "{err}"
    );
}

#[test]
fn solve_ignores_checkpoints_already_declared() {
    let mut spec = zoo::mnist_mlp(64);
    let unchecked = planned(&spec).0;
    spec.checkpoint(&["hidden", "logits"], 7);
    let c = checkpoint::solve(&spec, unchecked).unwrap();
    assert!(c.segments.is_empty());
    assert_eq!(c.total, unchecked);
}

#[test]
fn max_batch_per_policy() {
    for (spec, budget) in [
        (zoo::mnist_mlp(1), 8u64 << 20),
        (zoo::conv_vae(1), 24 << 20),
        (zoo::gpt2_stack(1, 2), 3 << 30),
    ] {
        let b: Vec<Option<usize>> = Policy::ALL
            .iter()
            .map(|&p| max_batch_with(&spec, budget, p))
            .collect();
        let [plain, fp16, auto, both] = [b[0], b[1], b[2], b[3]];
        assert!(plain <= auto && fp16 <= both, "{}: {b:?}", spec.name);
        // The plain answer is exact too (one search serves every policy): that batch's
        // plan fits, the next one's does not.
        let total = |b: usize| memwise_plan::advice::total(&spec.with_batch(b)).unwrap();
        let p = plain.expect("batch 1 fits");
        assert!(total(p) <= budget && total(p + 1) > budget, "{}", spec.name);
        // The checkpointed answers are exact: that batch solves, the next does not.
        for (policy, found) in [
            (Policy::AutoCheckpoint, auto),
            (Policy::Fp16AndAutoCheckpoint, both),
        ] {
            let base = policy.spec(&spec);
            let n = found.expect("batch 1 fits");
            assert!(checkpoint::solve(&base.with_batch(n), budget).is_ok());
            assert!(
                checkpoint::solve(&base.with_batch(n + 1), budget).is_err(),
                "{}: {policy:?} {n}",
                spec.name
            );
        }
    }
    assert_eq!(
        max_batch_with(&zoo::mnist_mlp(1), 1 << 10, Policy::AutoCheckpoint),
        None
    );
    // Past the search's limit, every policy says the limit.
    for p in Policy::ALL {
        assert_eq!(
            max_batch_with(&zoo::mnist_mlp(1), 1 << 50, p),
            Some(checkpoint::BATCH_LIMIT)
        );
    }
}

/// A chain of exactly `n` layers with ops and random widths: dense layers (4–96 units) or
/// convolutions (2–12 filters, 1×1 or 3×3, stride 1 or 2) with random activations, between
/// batch and layer norms, dropouts, activations and pools, then a softmax head.
fn twelve_layer_chain(seed: u64, n: usize) -> ModelSpec {
    use memwise_plan::{Activation as A, DType, LayerKind as K, LossKind, LossTerm, Padding};
    let mut r = SplitMix64::new(seed);
    let mut m = ModelSpec::new("Chain", r.range(1, 16));
    let conv = r.chance(0.5);
    if conv {
        m.input(
            "x",
            &[r.range(8, 16), r.range(8, 16), r.range(1, 3)],
            DType::U8,
            1.0 / 255.0,
        );
    } else {
        m.input("x", &[r.range(4, 64)], DType::F32, 1.0);
    }
    let acts = [A::Linear, A::Relu, A::Gelu, A::Tanh, A::Sigmoid, A::Silu];
    let mut side = 16usize;
    // The head, and for images the global pool, are layers too.
    for i in 0..n - 1 - conv as usize {
        let name = format!("l{i}");
        let kind = match r.below(6) {
            0 | 1 if conv => {
                let stride = if side > 4 && r.chance(0.3) { 2 } else { 1 };
                side = side.div_ceil(stride);
                K::conv2d(
                    r.range(2, 12),
                    r.pick(&[1, 3]),
                    stride,
                    Padding::Same,
                    r.pick(&acts),
                )
            }
            0 | 1 => K::dense(r.range(4, 96), r.pick(&acts)),
            2 if conv => K::batch_norm(),
            2 => K::layer_norm(),
            3 => K::Dropout {
                rate: r.pick(&[0.1, 0.5]),
            },
            4 if conv && side > 4 => {
                side = side.div_ceil(2);
                K::max_pool2d(2, 2, Padding::Same)
            }
            _ => K::Activation(r.pick(&[A::Relu, A::Gelu, A::Tanh, A::Sigmoid])),
        };
        m.add(&name, kind, &[]);
    }
    if conv {
        m.add("gap", K::GlobalAvgPool, &[]);
    }
    m.add("head", K::dense(r.range(2, 10), A::Softmax), &[]);
    m.input("labels", &[], DType::I32, 1.0);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["head", "labels"]));
    m
}

#[test]
fn twelve_layer_chains_equal_exhaustive_search() {
    // 75,025 segmentations each (F(25)): a few in debug, more in release.
    let seeds = env("MEMWISE_SEEDS", 2, 24) as u64;
    let t = versus_exhaustive(
        (0..seeds).map(|s| (s, twelve_layer_chain(s, 12))),
        true,
        12,
        |_, best, found| {
            let got = found.map(|(_, e)| e.recompute_flops);
            if got == best {
                Ok(())
            } else {
                Err(format!("exhaustive {best:?}, program {got:?}"))
            }
        },
    );
    eprintln!(
        "12-layer dense and conv chains: {} models (up to {} units), {} budgets, {} skipped",
        t.models, t.largest, t.budgets, t.skipped
    );
    t.assert_clean();
    assert!(t.models >= seeds as usize / 2);
}

#[test]
fn the_solver_recomputes_norm_outputs_before_it_checkpoints_a_segment() {
    // GPT-2's layer norms feed projections that keep their inputs: recomputing a norm's
    // output costs a norm's forward, far less than a checkpointed block's. With a budget
    // that all of them fit and nothing less does, the solver picks exactly those — per unit
    // on a chain (4 blocks), all or none in the general search (2 blocks).
    for (blocks, chain) in [(4, true), (2, false)] {
        let spec = zoo::gpt2_stack(1, blocks);
        let s = Solver::new(&spec).unwrap();
        assert_eq!(s.is_chain(), chain);
        let norms: Vec<String> = (spec.layers.iter())
            .filter(|l| l.name.contains("_ln_"))
            .map(|l| l.name.clone())
            .collect();
        if chain {
            assert_eq!(s.output_names(&s.output_units()), norms);
        } else {
            assert!(
                s.output_units().is_empty(),
                "the program's option is for chains"
            );
        }
        let names: Vec<&str> = norms.iter().map(String::as_str).collect();
        let mut all = spec.clone();
        all.recompute_output(&names);
        let (budget, cost) = planned(&all);
        assert!(budget < planned(&spec).0);
        let c = s.solve(budget).unwrap();
        assert!(c.segments.is_empty(), "{c}");
        assert_eq!(c.recompute_outputs, norms, "{c}");
        assert_eq!((c.total, c.recompute_flops), (budget, cost));
        assert_eq!(c.unchecked_total, planned(&spec).0);
        let text = format!("recomputes {} norm outputs", norms.len());
        assert!(c.to_string().starts_with(&text), "{c}");
        // A little less costs a segment on top.
        let t = s.solve(budget - (1 << 20)).unwrap();
        assert!(!t.segments.is_empty() && t.recompute_flops > cost, "{t}");
        assert_eq!(planned(&t.apply(&spec)), (t.total, t.recompute_flops));
    }
}
