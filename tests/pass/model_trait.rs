//! The generated items in const and generic contexts.
use memwise::prelude::*;

#[memwise::model(batch = 16, loss = sparse_categorical_crossentropy, budget = "64 MiB")]
pub struct Tiny {
    /// Doc comments on fields stay.
    #[input(shape = [10])]
    pub x: Input,
    #[input(shape = [], dtype = i32)]
    pub y: Input,
    #[dense(3, activation = softmax, from = x)]
    pub probs: Dense,
}

const _: () = assert!(Tiny::MEMORY.total <= 4 << 30);
const TOTAL: u64 = Tiny::PLAN.memory.total;
const PARAMS: u64 = Tiny::PARAMS;
const LAYERS: Tiny = Tiny::layers();

fn describe<M: Model>() -> (u64, usize, String) {
    (M::MEMORY.total, M::spec().layers.len(), M::summary())
}

fn main() {
    assert_eq!(TOTAL, Tiny::MEMORY.total);
    assert_eq!(PARAMS, 33);
    assert_eq!(LAYERS.probs.params().len(), 2);
    let (total, layers, summary) = describe::<Tiny>();
    assert_eq!((total, layers), (TOTAL, 3));
    assert!(summary.contains("probs (dense)"));
    assert_eq!(Tiny::plan_for_batch(16).unwrap(), Tiny::PLAN);
    assert!(Tiny::plan_for_batch(32).unwrap().memory.total > TOTAL);
    assert_eq!(Tiny::spec().budget, Some(64 << 20));
    assert_eq!(<Tiny as Model>::PARAMS, 33);
}
