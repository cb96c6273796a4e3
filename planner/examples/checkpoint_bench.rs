use memwise_plan::checkpoint::Solver;
use memwise_plan::generate::{random_dag, SplitMix64};
use memwise_plan::*;
use std::time::Instant;
fn main() {
    for (name, spec) in zoo::all(1.0) {
        let t0 = Instant::now();
        let s = Solver::new(&spec).unwrap();
        let dt = t0.elapsed().as_secs_f64();
        let m = s.unit_count();
        let mut rng = SplitMix64::new(7);
        let (mut ok, mut bad) = (0, 0);
        for _ in 0..20 {
            let mut segs = vec![];
            let mut u = 1;
            while u <= m {
                if rng.chance(0.5) { let e = (u + rng.below(4)).min(m); segs.push((u, e)); u = e + 1; } else { u += 1; }
            }
            let real = s.evaluate_units(&segs).total;
            let model = s.model_total(&segs);
            if Some(real) == model { ok += 1 } else { bad += 1; if bad < 4 { println!("  {segs:?} real {real} model {model:?}"); } }
        }
        let t1 = Instant::now();
        let (minimal, _) = s.smallest_total();
        let dt1 = t1.elapsed().as_secs_f64();
        println!("{name}: chain {} units {m} probes {} incons {} new {dt:.3}s min {minimal} ({dt1:.3}s) unchecked {} model ok {ok} bad {bad}", s.is_chain(), s.probes(), s.inconsistent(), s.unchecked().total);
    }
    let (mut ok, mut bad, mut chains) = (0, 0, 0);
    for seed in 0..300u64 {
        let spec = random_dag(seed);
        let Ok(s) = Solver::new(&spec) else { continue };
        if !s.is_chain() { continue; }
        chains += 1;
        let m = s.unit_count();
        let mut rng = SplitMix64::new(seed);
        for _ in 0..20 {
            let mut segs = vec![];
            let mut u = 1;
            while u <= m {
                if rng.chance(0.5) { let e = (u + rng.below(3)).min(m); segs.push((u, e)); u = e + 1; } else { u += 1; }
            }
            let real = s.evaluate_units(&segs).total;
            let model = s.model_total(&segs);
            if Some(real) == model { ok += 1 } else { bad += 1; if bad < 6 { println!("dag {seed} m {m} {segs:?} real {real} model {model:?} incons {}", s.inconsistent()); } }
        }
    }
    println!("dags as chains {chains}: ok {ok} bad {bad}");
}
