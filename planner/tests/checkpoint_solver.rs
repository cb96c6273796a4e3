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
//! `MEMWISE_SEEDS=N` tries `N` seeds instead of the default; `MEMWISE_MAX_UNITS=K` raises
//! the size limit of the exhaustive search (debug builds are slow: a deeper run is
//! `MEMWISE_SEEDS=400 MEMWISE_MAX_UNITS=12 cargo test --release -p memwise-plan --test
//! checkpoint_solver`).

use memwise_plan::checkpoint::{self, max_batch_with, Evaluation, Policy, Solver};
use memwise_plan::generate::{random_chain, random_dag, SplitMix64};
use memwise_plan::{plan, zoo, ModelSpec};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
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

/// The exhaustive table: every segmentation's real evaluation.
fn exhaustive(s: &Solver) -> Vec<(Vec<(usize, usize)>, Evaluation)> {
    segmentations(s.unit_count())
        .into_iter()
        .map(|segs| {
            let e = s.evaluate_units(&segs);
            (segs, e)
        })
        .collect()
}

/// Budgets from the smallest feasible total to the unchecked one: both ends, the quartiles
/// between, and two totals some segmentation reaches exactly (the edge of feasibility).
fn budgets(table: &[(Vec<(usize, usize)>, Evaluation)], seed: u64) -> Vec<u64> {
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
fn best_cost(table: &[(Vec<(usize, usize)>, Evaluation)], budget: u64) -> Option<u64> {
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
    /// Segmentations the exhaustive search planned, and the solver's search evaluated.
    space: usize,
    searched: usize,
}

/// Checks the solver against exhaustive search on each model `specs` yields whose kind
/// (`chain`) matches, with at most `max_units` units; `check(opt, found)` judges one budget.
fn versus_exhaustive(
    specs: impl Iterator<Item = (u64, ModelSpec)>,
    chain: bool,
    max_units: usize,
    check: impl Fn(u64, Option<u64>, Option<(Vec<(usize, usize)>, Evaluation)>) -> Result<(), String>,
) -> Tally {
    let mut t = Tally {
        models: 0,
        budgets: 0,
        skipped: 0,
        largest: 0,
        space: 0,
        searched: 0,
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
                    failures.push(format!("seed {seed}: budget {b}: the choice needs {}", e.total));
                    continue;
                }
            }
            if let Err(msg) = check(b, best_cost(&table, b), found) {
                failures.push(format!("seed {seed} ({} units): budget {b}: {msg}", s.unit_count()));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    t
}

#[test]
fn chain_program_equals_exhaustive_search() {
    let seeds = env("MEMWISE_SEEDS", 120) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 10);
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
        "chains: {} models (up to {} units), {} budgets, {} skipped as larger than {max_units} units",
        t.models, t.largest, t.budgets, t.skipped
    );
    assert!(t.models >= seeds as usize / 2);
}

#[test]
fn chains_of_blocks_equal_exhaustive_search() {
    // Random DAGs whose residual, projection, inception and U-Net steps are single-entry
    // single-exit blocks between cut points: the program is exact over whole blocks.
    let seeds = env("MEMWISE_SEEDS", 300) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 10);
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
    assert!(t.models >= 10);
}

#[test]
fn general_graphs_within_five_percent_of_exhaustive_search() {
    let seeds = env("MEMWISE_SEEDS", 300) as u64;
    let max_units = env("MEMWISE_MAX_UNITS", 9);
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
    assert!(t.models >= 10);
}
