//! Reference material for tests and self-checks: a plan's no-reuse twin (every tensor in its
//! own bytes, nothing ever freed), run beside the planned arena to prove the liveness plan
//! never frees anything too early; and random valid inputs for any plan.

use std::borrow::Cow;

use memwise_plan::liveness::align_up;
use memwise_plan::{DType, StaticPlan, NONE};

/// `plan` with every tensor at its own offset (no in-place hand-overs, no sharing).
/// The executor then calls out-of-place kernels everywhere.
pub fn without_reuse(plan: &StaticPlan) -> StaticPlan {
    let mut p = plan.clone();
    let mut at = 0u64;
    let mut tensors = p.tensors.to_vec();
    for t in tensors.iter_mut() {
        t.offset = at;
        t.in_place_of = NONE;
        at += align_up(t.bytes, plan.alignment);
    }
    p.tensors = Cow::Owned(tensors);
    p.arena_bytes = at;
    p
}

/// One batch of every input of `plan`, as bytes in its dtype, from a xorshift stream seeded
/// with `seed`: pixels of any value, floats in [0, 1), labels and token ids in the range the
/// step that reads them accepts.
pub fn random_inputs(plan: &StaticPlan, seed: u64) -> Vec<Vec<u8>> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    plan.inputs
        .iter()
        .map(|&id| {
            let t = plan.tensor(id);
            let n = t.elems();
            match t.dtype {
                DType::U8 => (0..n).map(|_| next() as u8).collect(),
                DType::I32 => {
                    // Labels or token ids: the range is what the reading step accepts.
                    let range = plan.index_limit(id).unwrap_or(2).max(1);
                    (0..n)
                        .flat_map(|_| ((next() % range as u64) as i32).to_le_bytes())
                        .collect()
                }
                DType::F32 => (0..n)
                    .flat_map(|_| ((next() % 1000) as f32 / 1000.0).to_le_bytes())
                    .collect(),
                DType::F16 => (0..n)
                    .flat_map(|_| {
                        half::f16::from_f32((next() % 1000) as f32 / 1000.0).to_le_bytes()
                    })
                    .collect(),
                DType::BF16 => (0..n)
                    .flat_map(|_| {
                        half::bf16::from_f32((next() % 1000) as f32 / 1000.0).to_le_bytes()
                    })
                    .collect(),
            }
        })
        .collect()
}
