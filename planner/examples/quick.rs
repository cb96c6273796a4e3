use memwise_plan::*;
fn main() {
    let mut m = ModelSpec::new("MnistMlp", 128);
    m.input("pixels", &[784], DType::U8, 1.0 / 255.0);
    m.input("label", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(512, Activation::Relu),
        &["pixels"],
    );
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy));
    let p = plan(&m).unwrap();
    for t in p.tensors.iter() {
        println!(
            "{:3} {:24} {:15} {:?} {:>8} off {:>8} [{},{}] ip {}",
            t.id,
            t.name,
            t.role.name(),
            t.shape,
            t.bytes,
            t.offset,
            t.first,
            t.last,
            t.in_place_of as i64
        );
    }
    for s in p.steps.iter() {
        println!(
            "{:3} {:9} {:8} {:24} r{:?} w{:?}",
            s.index,
            s.phase.name(),
            s.layer,
            s.op.name(),
            s.reads,
            s.writes
        );
    }
    println!(
        "{:#?}",
        MemoryReport {
            layers: Default::default(),
            ..p.memory.clone()
        }
    );
    println!("params {}", p.params_count);
}
