//! Reference material for tests and self-checks: a plan's no-reuse twin (every tensor in its
//! own bytes, nothing ever freed), run beside the planned arena to prove the liveness plan
//! never frees anything too early; random valid inputs for any plan; and a synthetic
//! MNIST-shaped dataset for trainer checks that need no files.

use std::borrow::Cow;

use memwise_plan::liveness::align_up;
use memwise_plan::{DType, StaticPlan, NONE};

use crate::data::dataset::{Column, InMemory};
use crate::executor::Batch;

/// A xorshift64 stream from `seed`: cheap, seeded and the same on every machine.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

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
    let mut next = xorshift(seed);
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

/// The buffers of [`random_inputs`] as one [`Batch`] per input of `plan`, each in its dtype.
/// `None` if a buffer is not aligned for its element type (an allocator may in principle
/// return a `Vec<u8>` aligned to 1; the system allocators this runs on align to 16).
pub fn batches<'a>(plan: &StaticPlan, raw: &'a [Vec<u8>]) -> Option<Vec<Batch<'a>>> {
    fn cast<T>(r: &[u8]) -> Option<&[T]> {
        // SAFETY: the element types are plain old data; `align_to` only hands out the aligned
        // middle, and an unaligned head (a non-empty prefix) is refused.
        let (head, body, tail) = unsafe { r.align_to::<T>() };
        (head.is_empty() && tail.is_empty()).then_some(body)
    }
    plan.inputs
        .iter()
        .zip(raw)
        .map(|(&id, r)| {
            Some(match plan.tensor(id).dtype {
                DType::U8 => Batch::U8(r),
                DType::I32 => Batch::I32(cast(r)?),
                DType::F32 => Batch::F32(cast(r)?),
                DType::F16 => Batch::F16(cast(r)?),
                DType::BF16 => Batch::BF16(cast(r)?),
            })
        })
        .collect()
}

/// `n` synthetic MNIST-shaped samples from a xorshift stream seeded with `seed`: 784 pixels
/// (u8, any value) and a label in 0..10 (i32), the columns of `zoo::mnist_mlp`'s inputs.
pub fn random_digits(n: usize, seed: u64) -> InMemory {
    let mut next = xorshift(seed);
    let pixels: Vec<u8> = (0..n * 784).map(|_| next() as u8).collect();
    let labels: Vec<i32> = (0..n).map(|_| (next() % 10) as i32).collect();
    digits_dataset(pixels, labels)
}

/// MNIST-shaped samples from their columns: 784 u8 pixels and one i32 label per sample, the
/// inputs of `zoo::mnist_mlp`.
pub fn digits_dataset(pixels: Vec<u8>, labels: Vec<i32>) -> InMemory {
    InMemory::new(vec![
        Column::U8 {
            data: pixels,
            per_sample: 784,
        },
        Column::I32 {
            data: labels,
            per_sample: 1,
        },
    ])
    .expect("two columns of n samples each")
}
