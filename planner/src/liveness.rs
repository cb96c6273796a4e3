//! `Lifetimes`: the `[first, last]` step of every tensor, the in-place decisions they allow,
//! and the buffers (tensors sharing bytes) the arena must place.

use crate::plan::{Role, NONE};
use crate::schedule::Schedule;

/// Lifetimes and buffers of a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Lifetimes {
    pub first: Vec<u32>,
    pub last: Vec<u32>,
    /// For each tensor, the tensor whose bytes it takes over in place, or `NONE`.
    pub in_place_of: Vec<u32>,
    /// For each tensor, its buffer index.
    pub buffer_of: Vec<usize>,
    /// Buffers: `(aligned bytes, first, last)`.
    pub buffers: Vec<(u64, u32, u32)>,
}

/// Rounds `bytes` up to a multiple of `alignment` (at least one unit).
pub const fn align_up(bytes: u64, alignment: u64) -> u64 {
    let b = if bytes == 0 { 1 } else { bytes };
    b.div_ceil(alignment) * alignment
}

impl Lifetimes {
    /// Computes lifetimes; then, for each step that may work in place, lets its output take
    /// the input's bytes when the input dies at that step (contract rule 3).
    pub fn compute(s: &Schedule, alignment: u64) -> Lifetimes {
        let n = s.tensors.len();
        let end = s.steps.len().saturating_sub(1) as u32;
        let mut first = vec![u32::MAX; n];
        let mut last = vec![0u32; n];
        for (t, st) in s.tensors.iter().enumerate() {
            if st.role == Role::Input {
                first[t] = 0;
            }
        }
        for (i, step) in s.steps.iter().enumerate() {
            let i = i as u32;
            for &w in &step.writes {
                if w != NONE && first[w as usize] == u32::MAX {
                    first[w as usize] = i;
                }
            }
            for &r in &step.reads {
                if r != NONE {
                    last[r as usize] = last[r as usize].max(i);
                }
            }
        }
        for t in 0..n {
            if first[t] == u32::MAX {
                // Never written nor an input (a forward tensor no step touches): no life.
                first[t] = 0;
            }
            last[t] = last[t].max(first[t]);
        }
        for &l in &s.losses {
            last[l as usize] = end; // the runtime reads loss values after the step
        }
        if s.prediction != NONE {
            // Metrics read the prediction after the loss step.
            let p = s.prediction as usize;
            let loss_end = s
                .steps
                .iter()
                .rposition(|st| st.phase == crate::plan::Phase::Loss)
                .unwrap_or(0) as u32;
            last[p] = last[p].max(loss_end);
        }
        let bytes: Vec<u64> = s
            .tensors
            .iter()
            .map(|t| align_up(t.raw_bytes(), alignment))
            .collect();
        let mut in_place_of = vec![NONE; n];
        let mut donated = vec![false; n];
        for (i, step) in s.steps.iter().enumerate() {
            for &(r, w) in &step.in_place {
                let (Some(&rt), Some(&wt)) = (step.reads.get(r), step.writes.get(w)) else {
                    continue;
                };
                if rt == NONE || wt == NONE {
                    continue;
                }
                let (ru, wu) = (rt as usize, wt as usize);
                if donated[ru]
                    || in_place_of[wu] != NONE
                    || last[ru] != i as u32
                    || first[wu] != i as u32
                {
                    continue;
                }
                if s.tensors[ru].dtype != s.tensors[wu].dtype
                    || bytes[wu] > bytes[ru]
                    || s.tensors[ru].role == Role::Input
                {
                    continue;
                }
                if s.losses.contains(&rt) || rt == s.prediction {
                    continue;
                }
                // A donor read through two slots (add(x, x)) cannot be overwritten by one.
                if step.reads.iter().filter(|&&x| x == rt).count() != 1 {
                    continue;
                }
                donated[ru] = true;
                in_place_of[wu] = rt;
            }
        }
        // Buffers: follow in-place chains to their root.
        let mut buffer_of = vec![usize::MAX; n];
        let mut buffers: Vec<(u64, u32, u32)> = Vec::new();
        for t in 0..n {
            let mut root = t;
            while in_place_of[root] != NONE {
                root = in_place_of[root] as usize;
            }
            if buffer_of[root] == usize::MAX {
                buffer_of[root] = buffers.len();
                buffers.push((bytes[root], first[root], last[root]));
            }
            let b = buffer_of[root];
            buffer_of[t] = b;
            let e = &mut buffers[b];
            e.0 = e.0.max(bytes[t]);
            e.1 = e.1.min(first[t]);
            e.2 = e.2.max(last[t]);
        }
        Lifetimes {
            first,
            last,
            in_place_of,
            buffer_of,
            buffers,
        }
    }
}
