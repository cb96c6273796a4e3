//! Arena packing on synthetic training steps: lower bound, TFLite's greedy-by-size, and the
//! planner's `pack`, with the time `pack` takes. Run it in release:
//!
//! ```text
//! cargo run --release -p memwise-plan --example packing_bench
//! ```

#[path = "../tests/support/training_step.rs"]
mod training_step;

use std::time::Instant;

use memwise_plan::arena::packing::{greedy_by_size, lower_bound, overlaps, pack};
use training_step::{families, ALIGN};

fn main() {
    const SEEDS: u64 = 4;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{:<12} {:>6} {:>6} {:>11} {:>11} {:>11} {:>9} {:>9} {:>10}",
        "family",
        "target",
        "bufs",
        "LB MiB",
        "greedy MiB",
        "pack MiB",
        "greedy/LB",
        "pack/LB",
        "pack ms"
    );
    for target in [50usize, 500, 3000] {
        let (mut log_sum, mut worst, mut count) = (0.0f64, 0.0f64, 0);
        for seed in 0..SEEDS {
            for (family, reqs) in families(target, seed) {
                let lb = lower_bound(&reqs);
                let greedy = greedy_by_size(&reqs, ALIGN);
                let start = Instant::now();
                let packed = pack(&reqs, ALIGN);
                let ms = start.elapsed().as_secs_f64() * 1e3;
                assert_eq!(overlaps(&reqs, &packed), None, "{family} seed {seed}");
                let ratio = packed.arena_bytes as f64 / lb as f64;
                log_sum += ratio.ln();
                worst = worst.max(ratio);
                count += 1;
                println!(
                    "{:<12} {:>6} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>9.4} {:>9.4} {:>10.2}",
                    format!("{family}#{seed}"),
                    target,
                    reqs.len(),
                    mib(lb),
                    mib(greedy.arena_bytes),
                    mib(packed.arena_bytes),
                    greedy.arena_bytes as f64 / lb as f64,
                    ratio,
                    ms
                );
            }
        }
        println!(
            "-- {target} buffers: pack/LB geometric mean {:.4}, worst {:.4}\n",
            (log_sum / count as f64).exp(),
            worst
        );
    }
}
