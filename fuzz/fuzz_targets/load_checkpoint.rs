//! `Executor::load_checkpoint_from_bytes` on mutated valid files of three models (Adam with
//! batch norm, RMSprop with mixed float16, RMSprop float32): tensors renamed, dropped, re-typed
//! and re-shaped, metadata changed, the checksum kept right or not, then raw damage — and on
//! raw bytes. Every failure is an error with a message and leaves the model bit-identical.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::loader;
use memwise_plan::StaticPlan;

fuzz_target!(|data: &[u8]| {
    static VALID: OnceLock<Vec<(StaticPlan, Vec<u8>)>> = OnceLock::new();
    let valid = VALID.get_or_init(|| loader::valid_files(|ex| ex.checkpoint_to_bytes()));
    loader::fuzz_one(data, valid, |ex, bytes| {
        ex.load_checkpoint_from_bytes(bytes)
    });
});
