//! A plan's no-reuse twin: every tensor in its own bytes and nothing ever freed. Tests run
//! it beside the planned arena to prove the liveness plan never frees anything too early.

use std::borrow::Cow;

use memwise_plan::liveness::align_up;
use memwise_plan::{StaticPlan, NONE};

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
