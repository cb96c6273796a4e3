//! The planner on the benchmark graphs of `memwise_plan::zoo`: for each model, the steps and
//! tensors of one training step, the lower bound (peak of live bytes), our arena, TFLite's
//! greedy-by-size arena on the same buffers, both ratios to the lower bound, and the time
//! `plan()` takes (median of 5). Prints a Markdown table (the one in `docs/BENCHMARKS.md`).
//!
//! ```text
//! cargo run --release -p memwise-plan --example plan_bench
//! ```
//!
//! Targets (issue 2): geometric mean of arena / lower bound ≤ 1.02, worst ≤ 1.05, ResNet-50
//! planned well under a second.

use std::time::Instant;

use memwise_plan::{arena, autodiff, graph, liveness, plan, schedule, zoo, ModelSpec, ALIGNMENT};

const RUNS: usize = 5;

struct Row {
    name: String,
    batch: usize,
    steps: usize,
    tensors: usize,
    buffers: usize,
    lower_bound: u64,
    arena: u64,
    greedy: u64,
    ms: f64,
}

fn measure(name: &str, spec: &ModelSpec) -> Row {
    let mut times = Vec::with_capacity(RUNS);
    let mut last = None;
    for _ in 0..RUNS {
        let start = Instant::now();
        let p = plan(spec).unwrap_or_else(|e| panic!("{name}: {e}"));
        times.push(start.elapsed().as_secs_f64() * 1e3);
        last = Some(p);
    }
    times.sort_by(f64::total_cmp);
    let p = last.expect("planned");
    // The same buffers, for the greedy-by-size baseline and the buffer count.
    let mut g = graph::Graph::build(spec).expect("planned");
    let sg = autodiff::StepGraph::build(&mut g, spec).expect("planned");
    let s = schedule::Schedule::build(&g, &sg);
    let life = liveness::Lifetimes::compute(&s, ALIGNMENT);
    let a = arena::ArenaPlan::build(&s, &life, ALIGNMENT);
    assert_eq!(
        (a.packing.arena_bytes, a.lower_bound),
        (p.arena_bytes, p.lower_bound_bytes)
    );
    Row {
        name: name.to_string(),
        batch: spec.batch,
        steps: p.steps.len(),
        tensors: p.tensors.len(),
        buffers: a.requests.len(),
        lower_bound: p.lower_bound_bytes,
        arena: p.arena_bytes,
        greedy: a.greedy_bytes,
        ms: times[RUNS / 2],
    }
}

fn print(rows: &[Row]) {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!("| model | batch | steps | tensors | buffers | lower bound MiB | arena MiB | greedy MiB | arena/LB | greedy/LB | plan ms |");
    println!("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.4} | {:.4} | {:.2} |",
            r.name,
            r.batch,
            r.steps,
            r.tensors,
            r.buffers,
            mib(r.lower_bound),
            mib(r.arena),
            mib(r.greedy),
            r.arena as f64 / r.lower_bound as f64,
            r.greedy as f64 / r.lower_bound as f64,
            r.ms
        );
    }
}

fn summary(what: &str, rows: &[Row]) {
    let ratio = |r: &Row, x: u64| x as f64 / r.lower_bound as f64;
    let geo = |f: &dyn Fn(&Row) -> f64| {
        (rows.iter().map(|r| f(r).ln()).sum::<f64>() / rows.len() as f64).exp()
    };
    let worst = rows.iter().map(|r| ratio(r, r.arena)).fold(0.0, f64::max);
    println!(
        "{what}: arena/LB geometric mean {:.4}, worst {:.4}; greedy/LB geometric mean {:.4}, worst {:.4}",
        geo(&|r| ratio(r, r.arena)),
        worst,
        geo(&|r| ratio(r, r.greedy)),
        rows.iter().map(|r| ratio(r, r.greedy)).fold(0.0, f64::max),
    );
}

fn main() {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("machine: {cpu}, {threads} hardware threads; plan time is the median of {RUNS} runs of plan()\n");

    let mut rows: Vec<Row> = zoo::all(1.0)
        .iter()
        .map(|(name, spec)| measure(name, spec))
        .collect();
    print(&rows);
    println!();
    summary("benchmark graphs", &rows);

    // The same graphs under checkpointing: recompute steps make lifetimes less nested.
    let mut resnet = zoo::resnet50(32);
    zoo::checkpoint_blocks(&mut resnet, |n| {
        n.get(..12)
            .filter(|p| p.contains("_block"))
            .map(str::to_string)
    });
    let mut gpt2 = zoo::gpt2_stack(8, zoo::GPT2_LAYERS);
    zoo::checkpoint_blocks(&mut gpt2, |n| {
        n.starts_with('h')
            .then(|| n.split('_').next().unwrap_or(n).to_string())
    });
    let mut vgg = zoo::vgg19(32);
    zoo::checkpoint_blocks(&mut vgg, |n| {
        n.starts_with("block")
            .then(|| n.get(..6).unwrap_or(n).to_string())
    });
    let extra = vec![
        measure("resnet50, every bottleneck checkpointed", &resnet),
        measure("gpt2_stack, every block checkpointed", &gpt2),
        measure("vgg19, every conv block checkpointed", &vgg),
    ];
    println!();
    print(&extra);
    println!();
    summary("checkpointed variants", &extra);
    rows.extend(extra);
    summary("all", &rows);
}
