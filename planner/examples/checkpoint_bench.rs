//! Automatic checkpointing on the benchmark graphs (`docs/BENCHMARKS.md`, "Automatic
//! checkpointing"): for each graph of `memwise_plan::zoo`, a budget sweep from the unchecked
//! total down to the smallest total any checkpointing reaches, with the recomputation of
//! memwise's choice beside PyTorch's `checkpoint_sequential` with √n even segments (Chen et
//! al. 2016) and beside checkpointing every unit; then the largest batch each policy fits in
//! 16 GiB and 80 GiB.
//!
//! `cargo run --release -p memwise-plan --example checkpoint_bench` (add `-- --no-batch` to
//! skip the batch search).
//!
//! Every total is a full `plan()`'s (`memory.total`, packed arena included); recomputation is
//! the forward FLOPs of the plan's `recompute` steps, as a percentage of one forward pass.

use std::time::Instant;

use memwise_plan::advice::format_bytes;
use memwise_plan::checkpoint::{max_batch_with, with_choice, with_segments, Policy, Solver};
use memwise_plan::{plan, zoo, ModelSpec, Phase};

/// Budgets per sweep, from the unchecked total down to the smallest feasible.
const SWEEP: usize = 8;

fn bytes(b: u64) -> String {
    format_bytes(b)
}

/// Planned total and recompute FLOPs of `spec`.
fn planned(spec: &ModelSpec) -> (u64, u64) {
    let p = plan(spec).expect("the zoo plans");
    let flops = p
        .steps
        .iter()
        .filter(|s| s.phase == Phase::Recompute)
        .map(|s| s.op.forward_flops())
        .sum();
    (p.memory.total, flops)
}

fn pct(flops: u64, forward: u64) -> String {
    format!("{:.1}", 100.0 * flops as f64 / forward.max(1) as f64)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let batch_search = !std::env::args().any(|a| a == "--no-batch");
    let mut facts = Vec::new();
    let mut firsts = Vec::new();
    let mut sweeps = Vec::new();
    let mut violations = 0;
    for (name, spec) in zoo::all(1.0) {
        let t = Instant::now();
        let solver = Solver::new(&spec).expect("the zoo plans");
        let build_ms = t.elapsed().as_secs_f64() * 1e3;
        let forward = solver.forward_flops();
        let (unchecked, _) = planned(&spec);
        let t = Instant::now();
        let (_, smallest_selection) = solver.smallest_total();
        let smallest_ms = t.elapsed().as_secs_f64() * 1e3;
        let (smallest, _) = planned(&with_choice(
            &spec,
            &solver.segment_names(&smallest_selection.segments),
            &solver.output_names(&smallest_selection.outputs),
        ));
        let baselines: Vec<(&str, u64, u64)> = solver
            .baselines()
            .into_iter()
            .map(|(label, segs)| {
                let (total, flops) = planned(&with_segments(&spec, &solver.segment_names(&segs)));
                (label, total, flops)
            })
            .collect();
        let mut solve_ms: Vec<f64> = Vec::new();
        let mut rows = Vec::new();
        for k in (0..SWEEP).rev() {
            let budget = smallest + (unchecked - smallest) * k as u64 / (SWEEP as u64 - 1);
            let t = Instant::now();
            let choice = solver.solve(budget);
            solve_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let mut cells = vec![bytes(budget)];
            let ours = match &choice {
                Ok(c) => {
                    assert!(c.total <= budget, "{name}: the choice does not fit");
                    let outputs = match c.recompute_outputs.len() {
                        0 => String::new(),
                        n => format!(", {n} norm out."),
                    };
                    cells.push(format!(
                        "{} ({} seg.{outputs})",
                        pct(c.recompute_flops, forward),
                        c.segments.len()
                    ));
                    Some(c.recompute_flops)
                }
                Err(_) => {
                    cells.push("no fit".into());
                    None
                }
            };
            let mut never_worse = true;
            for &(_, total, flops) in &baselines {
                if total <= budget {
                    cells.push(pct(flops, forward));
                    never_worse &= ours.is_some_and(|o| o <= flops);
                } else {
                    cells.push("—".into());
                }
            }
            if !never_worse {
                violations += 1;
            }
            cells.push(if never_worse { "yes" } else { "**no**" }.into());
            rows.push(cells);
        }
        firsts.push(format!(
            "{name}: solver built in {build_ms:.0} ms, then {:.1} ms per budget (median) — {:.0} ms for a first answer",
            median(solve_ms.clone()),
            build_ms + solve_ms.get(1).copied().unwrap_or(0.0)
        ));
        facts.push(format!(
            "| {name} | {} | {} | {} | {} | {:.0} | {:.0} | {:.1} | {} | {} | {} |",
            spec.batch,
            solver.unit_count(),
            if solver.is_chain() {
                "chain DP"
            } else {
                "graph search"
            },
            solver.probes(),
            build_ms,
            smallest_ms,
            median(solve_ms),
            bytes(unchecked),
            bytes(smallest),
            baselines
                .iter()
                .map(|(l, total, flops)| format!(
                    "{l} {} / {}%",
                    bytes(*total),
                    pct(*flops, forward)
                ))
                .collect::<Vec<_>>()
                .join("; "),
        ));
        sweeps.push((name, spec.batch, rows));
    }

    println!("### Solver\n");
    println!("| model | batch | units | method | probes | solver build ms | smallest total ms | solve ms (median) | unchecked | smallest | baselines (total / recompute %) |");
    println!("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|---|");
    for f in &facts {
        println!("{f}");
    }
    println!();
    for f in &firsts {
        println!("- {f}");
    }
    println!("\n### Budget sweeps: recompute as % of forward FLOPs\n");
    for (name, batch, rows) in &sweeps {
        println!("**{name}** (batch {batch})\n");
        println!("| budget | memwise | √n segments | every unit | memwise ≤ both |");
        println!("|--:|--:|--:|--:|:-:|");
        for r in rows {
            println!("| {} |", r.join(" | "));
        }
        println!();
    }
    println!("Budgets where memwise lost to a fitting baseline: {violations}\n");

    if !batch_search {
        return;
    }
    println!("### Largest batch per policy\n");
    println!(
        "| model | budget | plain | fp16 | auto-checkpoint | fp16 + auto-checkpoint | search s |"
    );
    println!("|---|--:|--:|--:|--:|--:|--:|");
    for (name, spec) in zoo::all(1.0) {
        for budget in [16u64 << 30, 80 << 30] {
            let t = Instant::now();
            let cells: Vec<String> = Policy::ALL
                .iter()
                .map(|&p| max_batch_with(&spec, budget, p).map_or("—".into(), |b| b.to_string()))
                .collect();
            println!(
                "| {name} | {} | {} | {:.1} |",
                format_bytes(budget),
                cells.join(" | "),
                t.elapsed().as_secs_f64()
            );
        }
    }
}
