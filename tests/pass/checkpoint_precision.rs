//! `#[checkpoint]` runs and numbered segments, checkpointed blocks, and the precision
//! modifiers under a mixed_bfloat16 policy.
use memwise::prelude::*;

#[memwise::block]
struct Pair {
    #[dense(64, activation = relu)]
    a: Dense,
    #[dense(64, activation = relu)]
    b: Dense,
}

#[memwise::model(batch = 32, precision = mixed_bfloat16, loss = mse(out, x))]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[checkpoint]
    #[dense(64, activation = relu)]
    a: Dense,
    #[checkpoint]
    #[dense(64, activation = relu)]
    b: Dense,
    #[checkpoint(segment = 7)]
    #[dense(64, activation = relu)]
    c: Dense,
    #[dense(64, activation = relu)]
    d: Dense,
    #[checkpoint]
    #[block]
    pairs: [Pair; 2],
    #[f32]
    #[dense(64)]
    wide: Dense,
    #[fp16]
    #[dense(64)]
    half: Dense,
    #[bf16]
    #[dense(64)]
    out: Dense,
}

fn main() {
    use memwise::plan::{DType, Precision};
    let spec = Net::spec();
    let seg = |n: &str| spec.layer(n).unwrap().checkpoint;
    assert!(seg("a").is_some());
    assert_eq!(
        seg("a"),
        seg("b"),
        "a run of #[checkpoint] fields is one segment"
    );
    assert!(
        seg("c").is_some() && seg("c") != seg("b"),
        "a numbered segment starts a new run"
    );
    assert_eq!(seg("d"), None);
    assert_eq!(
        seg("pairs.0.a"),
        seg("pairs.0.b"),
        "a checkpointed block instance is one segment"
    );
    assert_ne!(
        seg("pairs.0.b"),
        seg("pairs.1.a"),
        "each instance its own segment"
    );
    assert_eq!(spec.precision, Precision::MixedBFloat16);
    assert_eq!(spec.layer("wide").unwrap().dtype, Some(DType::F32));
    assert_eq!(spec.layer("half").unwrap().dtype, Some(DType::F16));
    assert_eq!(spec.layer("out").unwrap().dtype, Some(DType::BF16));
    assert!(Net::MEMORY.layers.iter().any(|l| l.checkpointed));
}
