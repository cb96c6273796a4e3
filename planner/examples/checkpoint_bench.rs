use memwise_plan::*;
use std::time::Instant;
fn main() {
    for (name, spec) in zoo::all(1.0) {
        let t0 = Instant::now();
        let n = 20;
        let mut lb = 0;
        for _ in 0..n {
            let g = graph::Graph::build(&spec).unwrap();
            let st = autodiff::StepGraph::build(&g, &spec).unwrap();
            let s = schedule::Schedule::build(&g, &st);
            let l = liveness::Lifetimes::compute(&s, ALIGNMENT);
            let reqs: Vec<_> = l.buffers.iter().map(|&(b, f, la)| arena::packing::BufferRequest { bytes: b, first: f as usize, last: la as usize }).collect();
            lb = arena::packing::lower_bound(&reqs);
        }
        let dt = t0.elapsed().as_secs_f64() / n as f64 * 1e3;
        let g = graph::Graph::build(&spec).unwrap();
        let st = autodiff::StepGraph::build(&g, &spec).unwrap();
        let t1 = Instant::now();
        for _ in 0..n {
            let s = schedule::Schedule::build(&g, &st);
            let _l = liveness::Lifetimes::compute(&s, ALIGNMENT);
        }
        let dt2 = t1.elapsed().as_secs_f64() / n as f64 * 1e3;
        let t2 = Instant::now();
        for _ in 0..5 { let _ = plan(&spec).unwrap(); }
        let dt3 = t2.elapsed().as_secs_f64() / 5.0 * 1e3;
        println!("{name}: layers {} ops {} lb {lb} full-pipe {dt:.3} ms sched+life {dt2:.3} ms plan {dt3:.3} ms", spec.layers.len(), g.ops.len());
    }
}
