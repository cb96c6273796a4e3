//! Embedding lookup forward (row gather) and backward (scatter-add into the f32 master gradient),
//! and the learned positional embedding added to its output (GPT-2's `wpe`).
//!
//! Weight `W[vocab, dim]`; `ids[tokens]` are `i32` (the planner's integer dtype). Every id is
//! checked before anything is written: an id outside `0..vocab` is an `Err` naming it.

use crate::gemm::{add_f32, load_f32, store_f32};
use crate::{check_len, check_len_with, Element, KResult, KernelError};
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

// ---------------------------------------------------------------------------------------------
// positional embedding
// ---------------------------------------------------------------------------------------------

/// Lengths of a positional embedding over `batch` samples of `len = seq·dim` elements.
fn pos_check(op: &str, batch: usize, len: usize, x: usize, table: usize, y: usize) -> KResult {
    let n = batch.saturating_mul(len);
    check_len_with(|| format!("{op} x"), x, n)?;
    check_len_with(|| format!("{op} table"), table, len)?;
    check_len_with(|| format!("{op} y"), y, n)
}

/// Positional embedding forward: `y[b, i] = x[b, i] + table[i]` for every sample `b` of a
/// `[batch, len]` input (`len = seq·dim`): one learned f32 vector per position, the same for
/// every sample, added to the token vectors. Values pass through f32.
pub fn positional_embedding_forward<T: Element>(
    batch: usize,
    len: usize,
    x: &[T],
    table: &[f32],
    y: &mut [T],
) -> KResult {
    pos_check(
        "positional_embedding_forward",
        batch,
        len,
        x.len(),
        table.len(),
        y.len(),
    )?;
    crate::elementwise::rows(&mut y[..batch * len], len, len, |b, yr| {
        for ((yo, xi), t) in yr.iter_mut().zip(&x[b * len..(b + 1) * len]).zip(table) {
            *yo = T::from_f32(xi.to_f32() + t);
        }
    });
    Ok(())
}

/// [`positional_embedding_forward`] writing `y` over `x` (each element is read, then written).
pub fn positional_embedding_forward_inplace<T: Element>(
    batch: usize,
    len: usize,
    x_y: &mut [T],
    table: &[f32],
) -> KResult {
    let n = x_y.len();
    pos_check(
        "positional_embedding_forward_inplace",
        batch,
        len,
        n,
        table.len(),
        n,
    )?;
    crate::elementwise::rows(&mut x_y[..batch * len], len, len, |_, yr| {
        for (v, t) in yr.iter_mut().zip(table) {
            *v = T::from_f32(v.to_f32() + t);
        }
    });
    Ok(())
}

/// Positional embedding backward of the table: `dtable[i] += Σ_b dy[b, i]` (accumulated, in
/// f32, as a bias gradient). `dx` is `dy` itself, the caller's copy (none when in place).
pub fn positional_embedding_backward<T: Element>(
    batch: usize,
    len: usize,
    dy: &[T],
    dtable: &mut [f32],
) -> KResult {
    let op = "positional_embedding_backward";
    pos_check(op, batch, len, dy.len(), dtable.len(), dy.len())?;
    crate::dense::add_column_sums(dy, batch, len, dtable);
    Ok(())
}
