//! `Executor::train_step` / `evaluate_step` on a few fixed models (u8, i32, f32, f16 and bf16
//! inputs; dense, conv, batch norm, pooling, dropout, embedding, attention, sampling, add,
//! concat; float32 and mixed precision) with batches of any count, dtype, length and values.
//! Every refusal is an error with a message, and an input error leaves the model untouched.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_plan::StaticPlan;
use memwise_runtime::{Batch, Device, Executor};

fn plans() -> &'static [(StaticPlan, StaticPlan)] {
    static PLANS: OnceLock<Vec<(StaticPlan, StaticPlan)>> = OnceLock::new();
    PLANS.get_or_init(|| {
        decode::train_models()
            .iter()
            .map(|m| {
                (
                    memwise_plan::plan(m).unwrap(),
                    memwise_plan::plan_inference(m).unwrap(),
                )
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let plans = plans();
    let (train, infer) = &plans[b.below(plans.len())];
    let inference = b.u8() > 200;
    let plan = if inference { infer } else { train };
    let mut ex =
        Executor::new(plan.clone(), &Device::cpu(), b.u8() as u64).expect("a fixed model builds");
    for _ in 0..1 + b.below(3) {
        let before = ex.persistent_bytes().to_vec();
        let owned = decode::batches(ex.plan(), &mut b);
        let batches: Vec<Batch<'_>> = owned.iter().map(|o| o.as_batch()).collect();
        let r = if inference {
            ex.evaluate_step(&batches)
        } else {
            ex.train_step(&batches)
        };
        match r {
            Ok(_) if inference => {
                let n = ex.plan().tensor(ex.plan().prediction).elems();
                let mut out = vec![0.0; n];
                ex.read_prediction(&mut out)
                    .expect("a prediction after a step");
            }
            Ok(_) => {}
            Err(e) => {
                assert!(!e.to_string().is_empty(), "an error without a message");
                if e.is_input() {
                    let m = &e;
                    assert!(
                        ex.persistent_bytes() == &before[..],
                        "a refused input changed the model: {m}"
                    );
                }
            }
        }
    }
});
