//! positional_embedding after a token embedding, as GPT-2 adds `wpe` to `wte`: its table is
//! `[seq, dim]` of the input, it plans in place, and it needs no options.
use memwise::prelude::*;

#[memwise::model(batch = 4, optimizer = adamw, loss = sparse_categorical_crossentropy(logits, next))]
struct Positions {
    #[input(shape = [16], dtype = i32)]
    ids: Input,
    #[input(shape = [16], dtype = i32)]
    next: Input,
    #[embedding(input_dim = 100, output_dim = 32, from = ids)]
    tokens: Embedding,
    #[positional_embedding]
    positions: PositionalEmbedding,
    #[rms_norm]
    norm: RmsNorm,
    #[dense(100)]
    logits: Dense,
}

fn main() {
    use memwise::plan::{LayerKind, Op};
    let spec = Positions::spec();
    assert_eq!(spec.layer("positions").unwrap().kind, LayerKind::PositionalEmbedding);
    let table = Positions::PLAN.params.iter().find(|p| p.name == "positions.weight").unwrap();
    assert_eq!(&table.shape[..], &[16, 32]);
    let step = Positions::PLAN.steps.iter().find(|s| s.layer == "positions").unwrap();
    assert_eq!(step.op, Op::PositionalEmbedding { batch: 4, seq: 16, dim: 32 });
    assert_eq!(Positions::plan_for_batch(4).unwrap(), Positions::PLAN);
}
