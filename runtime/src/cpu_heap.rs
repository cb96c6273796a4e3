//! The heap the CPU GEMM library (the `gemm` crate) holds inside one call of a plan's steps:
//! its packing buffers, allocated and freed within the call, planned exactly from each step's
//! shapes (`memwise_kernels::gemm_heap`) so the host part of the estimate is not a guess.

use memwise_kernels as k;
use memwise_plan::{DType, Op, Phase, PlanStep, StaticPlan, NONE};

use crate::executor::{attention_dims, conv_dims, convt_dims, match_float};
use crate::memory::LARGE_BLOCK_BYTES;

/// The most heap the GEMM library holds live at once while `plan`'s steps run on the CPU: the
/// largest per-call figure over every GEMM-running step (one step runs at a time, and its
/// calls one after another). What a counting allocator sees (`tests/allocations.rs`).
pub fn gemm_library_heap_bytes(plan: &StaticPlan) -> u64 {
    plan.steps
        .iter()
        .map(|s| step_heap(plan, s))
        .max()
        .unwrap_or(0) as u64
}

/// What the GEMM library's packing costs in resident memory while `plans`' steps run on the
/// CPU: the largest call under [`LARGE_BLOCK_BYTES`] plus the largest from it up — the host
/// estimate's figure.
///
/// Why the sum, where the live peak ([`gemm_library_heap_bytes`]) is a maximum: a call's
/// blocks of 1 MiB or more are mapped for the call and unmapped when freed
/// (`memory::return_large_frees`), so only one large call's are ever resident. A smaller
/// call's come from the heap, whose pages stay resident after they are freed, reused by every
/// later call that fits in them — so the largest small call's pages are resident from its
/// first run on, beside whichever large call is mapped. (Measured on the VAE at batch 128:
/// 1.0 MiB of small-call pages beside a 2.0 MiB large call, which the maximum alone missed.)
/// A step's figure is its largest call's.
pub fn gemm_library_resident_bytes<'a>(plans: impl IntoIterator<Item = &'a StaticPlan>) -> u64 {
    let (mut small, mut large) = (0, 0);
    for plan in plans {
        for s in plan.steps.iter() {
            let call = step_heap(plan, s);
            if call >= LARGE_BLOCK_BYTES {
                large = large.max(call);
            } else {
                small = small.max(call);
            }
        }
    }
    (small + large) as u64
}

/// Runs `$body` with `$T` the element type of float dtype `$dt` (0 for other dtypes).
macro_rules! per_float {
    ($dt:expr, $T:ident, $body:expr) => {
        match_float!($dt, $T, $body, DType::U8 | DType::I32 => 0)
    };
}

fn step_heap(plan: &StaticPlan, s: &PlanStep) -> usize {
    let backward = s.phase == Phase::Backward;
    // The compute dtype the executor dispatches on: the forward's first output, the
    // backward's first read (the saved input; dy when nothing is saved).
    let dtype_of = |id: &u32| (*id != NONE).then(|| plan.tensor(*id).dtype);
    let first = if backward { &s.reads } else { &s.writes };
    let Some(dt) = first
        .first()
        .and_then(dtype_of)
        .or_else(|| s.reads.iter().find_map(dtype_of))
    else {
        return 0;
    };
    let dx = s.writes.first().is_some_and(|&w| w != NONE);
    match s.op {
        Op::Dense {
            rows,
            in_features,
            units,
            ..
        } => {
            let d = k::dense::DenseDims {
                batch: rows,
                in_features,
                out_features: units,
            };
            per_float!(dt, T, {
                if backward {
                    k::dense::dense_backward_heap_bytes::<T>(d, dx)
                } else {
                    k::dense::dense_forward_heap_bytes::<T>(d)
                }
            })
        }
        Op::Conv2d { dims, chunk, .. } => per_float!(dt, T, {
            if backward {
                k::conv::conv2d_backward_heap_bytes::<T>(conv_dims(&dims), chunk, dx)
            } else {
                k::conv::conv2d_forward_heap_bytes::<T>(conv_dims(&dims), chunk)
            }
        }),
        Op::Conv2dTranspose { dims, chunk, .. } => per_float!(dt, T, {
            if backward {
                k::conv::conv2d_transpose_backward_heap_bytes::<T>(convt_dims(&dims), chunk, dx)
            } else {
                k::conv::conv2d_transpose_forward_heap_bytes::<T>(convt_dims(&dims), chunk)
            }
        }),
        Op::Attention { .. } | Op::FlashAttention { .. } => attention_heap_bytes(s, dt, backward),
        _ => 0,
    }
}

/// An attention step's CPU heap: the materialised kernels' per-float GEMM packing, or the
/// flash kernels' f32 tiles (in the lanes whatever the storage: no per-float dispatch).
fn attention_heap_bytes(s: &PlanStep, dt: DType, backward: bool) -> usize {
    let Some(a) = s.op.attention() else {
        return 0;
    };
    let (d, ws) = (attention_dims(&a), s.op.scratch_f32_elems(dt));
    match (a.flash, backward) {
        (true, true) => k::flash_attention::flash_backward_heap_bytes(d, ws),
        (true, false) => k::flash_attention::flash_forward_heap_bytes(d, ws),
        (false, true) => per_float!(dt, T, {
            k::attention::context_backward_heap_bytes::<T>(d, ws)
                .max(k::attention::scores_backward_heap_bytes::<T>(d, ws))
        }),
        (false, false) => per_float!(dt, T, {
            k::attention::scores_forward_heap_bytes::<T>(d, ws)
                .max(k::attention::context_forward_heap_bytes::<T>(d, ws))
        }),
    }
}
