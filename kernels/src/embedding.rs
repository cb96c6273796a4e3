//! Embedding lookup forward (row gather) and backward (scatter-add into the f32 master gradient).
//!
//! Weight `W[vocab, dim]`; `ids[tokens]` are `i32` (the planner's integer dtype). Every id is
//! checked before anything is written: an id outside `0..vocab` is an `Err` naming it.

use crate::gemm::{add_f32, load_f32, store_f32};
use crate::{check_len, Element, KResult, KernelError};
use rayon::prelude::*;

/// Shape of one embedding call: `tokens` ids into a `[vocab, dim]` table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingDims {
    pub tokens: usize,
    pub vocab: usize,
    pub dim: usize,
}

fn check_ids(what: &str, ids: &[i32], vocab: usize) -> KResult {
    match ids.iter().position(|&id| id < 0 || id as usize >= vocab) {
        Some(pos) => Err(KernelError(format!(
            "{what}: id {} at position {pos} is out of range for vocab {vocab}",
            ids[pos]
        ))),
        None => Ok(()),
    }
}

/// Forward: `y[t, :] = W[ids[t], :]`, `y[tokens, dim]` overwritten. The table may be stored as
/// `W` (the f32 master copy or a half copy) and the output as `T`; values pass through f32.
pub fn embedding_forward<W: Element, T: Element>(
    d: EmbeddingDims,
    ids: &[i32],
    w: &[W],
    y: &mut [T],
) -> KResult {
    let what = "embedding_forward";
    check_len("embedding_forward ids", ids.len(), d.tokens)?;
    check_len("embedding_forward w", w.len(), d.vocab * d.dim)?;
    check_len("embedding_forward y", y.len(), d.tokens * d.dim)?;
    let ids = &ids[..d.tokens];
    check_ids(what, ids, d.vocab)?;
    if d.dim == 0 {
        return Ok(());
    }
    y[..d.tokens * d.dim]
        .par_chunks_mut(d.dim)
        .with_min_len(8)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            let src = &w[id as usize * d.dim..(id as usize + 1) * d.dim];
            // Through a stack buffer: W and T may differ, and nothing is allocated.
            let mut tmp = [0f32; 64];
            for (s, o) in src.chunks(64).zip(row.chunks_mut(64)) {
                load_f32(s, &mut tmp[..s.len()]);
                store_f32(&tmp[..s.len()], o);
            }
        });
    Ok(())
}

/// Backward: `dw[ids[t], :] += dy[t, :]` for every token — f32 master gradient `[vocab, dim]`,
/// **accumulated** (repeated ids add up). Parallel over blocks of vocabulary rows, each block
/// owned by one thread and filled in token order, so the result is deterministic.
pub fn embedding_backward<T: Element>(
    d: EmbeddingDims,
    ids: &[i32],
    dy: &[T],
    dw: &mut [f32],
) -> KResult {
    let what = "embedding_backward";
    check_len("embedding_backward ids", ids.len(), d.tokens)?;
    check_len("embedding_backward dy", dy.len(), d.tokens * d.dim)?;
    check_len("embedding_backward dw", dw.len(), d.vocab * d.dim)?;
    let ids = &ids[..d.tokens];
    check_ids(what, ids, d.vocab)?;
    if d.dim == 0 || d.vocab == 0 {
        return Ok(());
    }
    // A few blocks per thread for balance; every block scans all ids (cheap next to the adds).
    let blocks = (rayon::current_num_threads() * 4).min(d.vocab);
    let rows_per = d.vocab.div_ceil(blocks);
    dw[..d.vocab * d.dim]
        .par_chunks_mut(rows_per * d.dim)
        .enumerate()
        .for_each(|(blk, dwb)| {
            let v0 = blk * rows_per;
            let v1 = v0 + dwb.len() / d.dim;
            for (t, &id) in ids.iter().enumerate() {
                let id = id as usize;
                if (v0..v1).contains(&id) {
                    let r = id - v0;
                    add_f32(
                        &dy[t * d.dim..(t + 1) * d.dim],
                        &mut dwb[r * d.dim..(r + 1) * d.dim],
                    );
                }
            }
        });
    Ok(())
}
