//! `plan` and `plan_inference` on any `ModelSpec` (decoded from the bytes: any layer kinds,
//! options, sizes from 0 to `usize::MAX`, non-finite floats, dangling or duplicate names).
//! Planning returns a validated plan or an error with a message, never a panic; a small plan
//! that planned also builds an executor and runs one step (an error is fine, a panic is not).
#![no_main]

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_runtime::{Batch, Device, Executor};

fuzz_target!(|data: &[u8]| {
    let spec = decode::model_spec(data);
    let trained = match memwise_plan::plan(&spec) {
        Ok(p) => Some(p),
        Err(e) => {
            assert!(!e.to_string().is_empty(), "an error without a message");
            None
        }
    };
    let inferred = match memwise_plan::plan_inference(&spec) {
        Ok(p) => Some(p),
        Err(e) => {
            assert!(!e.to_string().is_empty(), "an error without a message");
            None
        }
    };
    // Run what planned, when it is small enough to run quickly.
    for p in [trained, inferred].into_iter().flatten() {
        if p.arena_bytes + p.persistent_bytes > 4 << 20 || p.steps.len() > 400 {
            continue;
        }
        let training = p.training;
        let Ok(mut ex) = Executor::new(p, &Device::cpu(), 7) else {
            continue;
        };
        let owned = decode::batches(ex.plan(), &mut Bytes::new(&[]));
        let batches: Vec<Batch<'_>> = owned.iter().map(|b| b.as_batch()).collect();
        let r = if training {
            ex.train_step(&batches)
        } else {
            ex.evaluate_step(&batches)
        };
        if let Err(e) = r {
            assert!(!e.to_string().is_empty(), "an error without a message");
        }
    }
});
