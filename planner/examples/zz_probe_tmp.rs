use memwise_plan::*;
fn main() {
    let seed: u64 = std::env::args().nth(1).unwrap().parse().unwrap();
    let spec = if std::env::args().nth(2).as_deref() == Some("dag") { generate::random_dag(seed) } else { generate::random_chain(seed) };
    for l in &spec.layers { println!("{} {:?} in {:?} dt {:?} ck {:?}", l.name, l.kind, l.inputs, l.dtype, l.checkpoint); }
    println!("{:?}", spec.loss);
    let p = plan(&spec).unwrap();
    for t in p.tensors.iter() { println!("  t{} {} {:?} {:?} {:?} [{},{}]", t.id, t.name, t.role, t.dtype, t.shape, t.first, t.last); }
    for s in p.steps.iter() { println!("  {} {:9} {:6} {:32} r{:?} w{:?}", s.index, s.phase.name(), s.layer, s.op.name(), s.reads.iter().map(|&r| r as i64).collect::<Vec<_>>(), s.writes.iter().map(|&r| r as i64).collect::<Vec<_>>()); }
}
