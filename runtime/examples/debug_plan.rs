//! Prints a random model's plan (developer aid): `cargo run -p memwise-runtime --example debug_plan -- dag 62`.
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let seed: u64 = a[2].parse().unwrap();
    let spec = if a[1] == "dag" {
        memwise_plan::generate::random_dag(seed)
    } else {
        memwise_plan::generate::random_chain(seed)
    };
    for l in &spec.layers {
        println!(
            "{:14} {:?} <- {:?} dt {:?} ck {:?}",
            l.name, l.kind, l.inputs, l.dtype, l.checkpoint
        );
    }
    println!("{:?} {:?}", spec.precision, spec.loss);
    let p = memwise_plan::plan(&spec).unwrap();
    for t in p.tensors.iter() {
        println!(
            "{:3} {:28} {:15} {:5} {:?} off {:>8} [{},{}] ip {}",
            t.id,
            t.name,
            t.role.name(),
            t.dtype.name(),
            &t.shape[..],
            t.offset,
            t.first,
            t.last,
            t.in_place_of as i64
        );
    }
    for s in p.steps.iter() {
        println!(
            "{:3} {:9} {:14} {:24} r{:?} w{:?}",
            s.index,
            s.phase.name(),
            s.layer,
            s.op.name(),
            s.reads.iter().map(|&x| x as i64).collect::<Vec<_>>(),
            s.writes.iter().map(|&x| x as i64).collect::<Vec<_>>()
        );
    }
}
