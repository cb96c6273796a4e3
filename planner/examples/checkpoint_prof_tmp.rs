use memwise_plan::checkpoint::Solver;
use memwise_plan::generate::random_dag;
fn segs_all(m: usize) -> Vec<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    fn go(u: usize, m: usize, cur: &mut Vec<(usize, usize)>, out: &mut Vec<Vec<(usize, usize)>>) {
        if u > m { out.push(cur.clone()); return; }
        go(u + 1, m, cur, out);
        cur.push((u, u)); go(u + 1, m, cur, out); cur.pop();
        if cur.last().is_some_and(|&(_, e)| e + 1 == u) { let k = cur.len() - 1; cur[k].1 = u; go(u + 1, m, cur, out); cur[k].1 = u - 1; }
    }
    go(1, m, &mut vec![], &mut out); out
}
fn main() {
    for (seed, b) in [(465u64, 185024u64), (564, 46080), (104, 21632)] {
        let spec = random_dag(seed);
        let s = Solver::new(&spec).unwrap();
        println!("seed {seed}: units {}", s.unit_count());
        for u in 1..=s.unit_count() { println!("  {u}: {:?}", s.unit_layers(u)); }
        for l in &spec.layers { println!("    {} {:?} <- {:?}", l.name, l.kind.name(), l.inputs); }
        let mut table: Vec<_> = segs_all(s.unit_count()).into_iter().map(|sg| { let e = s.evaluate_units(&sg); (e.recompute_flops, e.total, sg) }).collect();
        table.sort();
        let feas: Vec<_> = table.iter().filter(|t| t.1 <= b).take(5).collect();
        println!("  best feasible: {feas:?}");
        println!("  found: {:?} evals {}", s.optimal(b), s.search_evaluations());
        println!("  unchecked {:?} min {:?}", s.unchecked(), table.iter().map(|t| t.1).min());
    }
}
