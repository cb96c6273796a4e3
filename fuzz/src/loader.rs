//! The one fuzz body behind both file loaders (weights and full checkpoints): mutated valid
//! files of three models, and raw bytes; every failure must be an error with a message that
//! leaves the model bit-identical.

use memwise_plan::StaticPlan;
use memwise_runtime::{Batch, Device, Executor, RuntimeError};

use crate::decode::{self, Bytes};

/// Writes a model's file of the kind under test.
pub type Save = fn(&Executor) -> Result<Vec<u8>, RuntimeError>;
/// Loads a file of the kind under test into a model.
pub type Load = fn(&mut Executor, &[u8]) -> Result<(), RuntimeError>;

/// Each model's plan (Adam with batch norm, RMSprop with mixed float16, RMSprop float32) and
/// a valid file of it, written by `save` after two training steps.
pub fn valid_files(save: Save) -> Vec<(StaticPlan, Vec<u8>)> {
    let models = decode::train_models();
    [1, 2, 0]
        .iter()
        .map(|&k| {
            let plan = memwise_plan::plan(&models[k]).unwrap();
            let mut ex = Executor::new(plan.clone(), &Device::cpu(), 5).unwrap();
            let owned = decode::batches(ex.plan(), &mut Bytes::new(&[]));
            let batches: Vec<Batch<'_>> = owned.iter().map(|o| o.as_batch()).collect();
            ex.train_step(&batches).unwrap();
            ex.train_step(&batches).unwrap();
            let file = save(&ex).unwrap();
            (plan, file)
        })
        .collect()
}

/// One fuzz case: picks a model, mutates its valid file (or takes the raw bytes), loads it
/// into a fresh model and checks that a failure changed nothing.
pub fn fuzz_one(data: &[u8], valid: &[(StaticPlan, Vec<u8>)], load: Load) {
    let mut b = Bytes::new(data);
    let (plan, file) = &valid[b.below(valid.len())];
    let bytes = if b.u8() < 24 {
        b.rest().to_vec()
    } else {
        decode::mutate_safetensors(file, &mut b)
    };
    let mut ex = Executor::new(plan.clone(), &Device::cpu(), 9).expect("a fixed model builds");
    let (before, step, scale) = (
        ex.persistent_bytes().to_vec(),
        ex.step_counter(),
        ex.loss_scale(),
    );
    if let Err(e) = load(&mut ex, &bytes) {
        assert!(!e.to_string().is_empty(), "an error without a message");
        assert!(
            ex.persistent_bytes() == &before[..],
            "a failed load changed the model: {e}"
        );
        assert_eq!(
            (ex.step_counter(), ex.loss_scale().to_bits()),
            (step, scale.to_bits()),
            "a failed load changed the counters: {e}"
        );
    }
}
