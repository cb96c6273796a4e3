#[path = "../tests/support/training_step.rs"]
mod training_step;
use std::time::Instant;
use memwise_plan::arena::packing::{greedy_by_size, lower_bound, pack};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let target: usize = args[1].parse().unwrap();
    let seed: u64 = args[2].parse().unwrap();
    let fam = &args[3];
    for (name, reqs) in training_step::families(target, seed) {
        if name != fam { continue; }
        let lb = lower_bound(&reqs);
        let t = Instant::now();
        let g = greedy_by_size(&reqs, 256);
        let tg = t.elapsed();
        let t = Instant::now();
        let p = pack(&reqs, 256);
        println!("{name} n={} lb={lb} greedy={} ({:?}) pack={} ratio={:.5} ({:?})", reqs.len(), g.arena_bytes, tg, p.arena_bytes, p.arena_bytes as f64 / lb as f64, t.elapsed());
    }
}
