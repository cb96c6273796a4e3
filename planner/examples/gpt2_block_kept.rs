//! What one GPT-2 block keeps for its backward, per tensor, in float32: the planner's count
//! that `bench/attention.py` sets beside PyTorch's saved tensors for the same block
//! (docs/BENCHMARKS.md, "Attention at sequence 1024").
//!
//! `cargo run --release -p memwise-plan --features test-models --example gpt2_block_kept -- [batch [dropout]]`
//! (GPT-2's dropout 0.1 by default) prints one JSON object: the batch, the attention op the planner chose, and every tensor of
//! the block alive from the forward into the backward (read by a backward step), with its bytes.

use memwise_plan::{plan, zoo, DType, LayerKind, Op, Phase, Precision, Role};

fn main() {
    let batch: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the batch is a whole number"))
        .unwrap_or(2);
    let rate: f32 = std::env::args()
        .nth(2)
        .map(|a| a.parse().expect("the dropout is a number"))
        .unwrap_or(0.1);
    let mut spec = zoo::gpt2_stack(batch, 1);
    spec.precision = Precision::Float32;
    for layer in spec.layers.iter_mut() {
        match &mut layer.kind {
            LayerKind::Input { dtype, .. } => *dtype = DType::F32,
            LayerKind::Dropout { rate: r } | LayerKind::Attention { dropout: r, .. } => *r = rate,
            _ => {}
        }
    }
    let p = plan(&spec).expect("the GPT-2 block plans");
    let backward = |id: u32| {
        p.steps
            .iter()
            .any(|s| s.phase == Phase::Backward && s.reads.contains(&id))
    };
    let kept: Vec<String> = p
        .tensors
        .iter()
        .filter(|t| t.layer.starts_with("h0_"))
        .filter(|t| matches!(t.role, Role::Activation | Role::Input) && backward(t.id))
        .map(|t| format!("{{\"name\": \"{}\", \"bytes\": {}}}", t.name, t.bytes))
        .collect();
    let attention = p
        .steps
        .iter()
        .find(|s| matches!(s.op, Op::Attention { .. } | Op::FlashAttention { .. }))
        .map_or("none", |s| s.op.name());
    println!(
        "{{\"batch\": {batch}, \"attention\": \"{attention}\", \"kept\": [{}]}}",
        kept.join(", ")
    );
}
