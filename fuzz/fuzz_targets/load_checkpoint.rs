//! `Executor::load_checkpoint_from_bytes` on mutated valid files of three models (Adam with
//! batch norm, RMSprop with mixed float16, RMSprop float32): tensors renamed, dropped, re-typed
//! and re-shaped, metadata changed, the checksum kept right or not, then raw damage — and on
//! raw bytes. Every failure is an error with a message and leaves the model bit-identical.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_plan::StaticPlan;
use memwise_runtime::{Batch, Device, Executor};

/// Each model's plan and a valid file of it, saved after two training steps.
fn valid() -> &'static [(StaticPlan, Vec<u8>)] {
    static VALID: OnceLock<Vec<(StaticPlan, Vec<u8>)>> = OnceLock::new();
    VALID.get_or_init(|| {
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
                let file = ex.checkpoint_to_bytes().unwrap();
                (plan, file)
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let valid = valid();
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
    if let Err(e) = ex.load_checkpoint_from_bytes(&bytes) {
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
});
