//! `#[recompute_output]`: a norm keeps its input instead of x̂ and its output, and its output
//! is remade before the backward that reads it — less kept, a norm's forward more.
use memwise::prelude::*;

#[memwise::model(batch = 32, optimizer = sgd(lr = 0.1), loss = mse(head, x))]
struct Remade {
    #[input(shape = [64])]
    x: Input,
    #[dense(64)]
    stem: Dense,
    #[recompute_output]
    #[layer_norm]
    norm: LayerNorm,
    #[dense(64)]
    head: Dense,
}

#[memwise::model(batch = 32, optimizer = sgd(lr = 0.1), loss = mse(head, x))]
struct Kept {
    #[input(shape = [64])]
    x: Input,
    #[dense(64)]
    stem: Dense,
    #[layer_norm]
    norm: LayerNorm,
    #[dense(64)]
    head: Dense,
}

fn main() {
    assert!(Remade::spec().layer("norm").unwrap().recompute_output);
    let row = |m: &memwise::plan::MemoryReport| {
        m.layers.iter().find(|l| l.name == "norm").unwrap().clone()
    };
    assert!(row(&Remade::MEMORY).recomputes_output);
    assert!(!row(&Kept::MEMORY).recomputes_output);
    // x̂ and the output (32 × 64 f32 each) give way to the input, which is the stem's.
    assert!(row(&Remade::MEMORY).saved_bytes + 2 * 32 * 64 * 4 <= row(&Kept::MEMORY).saved_bytes);
    assert!(Remade::PLAN.checkpoint_recompute_flops() > 0);
    assert_eq!(Kept::PLAN.checkpoint_recompute_flops(), 0);
}
