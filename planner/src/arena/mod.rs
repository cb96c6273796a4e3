//! Offsets for transient tensors in one arena, and the validator of a plan's four rules.

pub mod packing;

use crate::liveness::Lifetimes;
use crate::plan::{StaticPlan, NONE};
use crate::schedule::Schedule;
use packing::{BufferRequest, Packing};

/// Every buffer's offset in the one arena.
#[derive(Clone, Debug, PartialEq)]
pub struct ArenaPlan {
    pub requests: Vec<BufferRequest>,
    pub packing: Packing,
    /// The same buffers packed by greedy-by-size alone (the baseline reported beside ours).
    pub greedy_bytes: u64,
    pub lower_bound: u64,
    pub alignment: u64,
}

impl ArenaPlan {
    /// Places the buffers of `lifetimes` in one arena.
    pub fn build(_schedule: &Schedule, lifetimes: &Lifetimes, alignment: u64) -> ArenaPlan {
        let requests = requests(lifetimes);
        let packing = packing::pack(&requests, alignment);
        let greedy_bytes = packing::greedy_by_size(&requests, alignment).arena_bytes;
        let lower_bound = packing::lower_bound(&requests);
        ArenaPlan {
            requests,
            packing,
            greedy_bytes,
            lower_bound,
            alignment,
        }
    }

    /// Offset of buffer `b`.
    pub fn offset(&self, b: usize) -> u64 {
        self.packing.offsets[b]
    }
}

/// The buffers of `lifetimes` as packing requests.
pub fn requests(lifetimes: &Lifetimes) -> Vec<BufferRequest> {
    lifetimes
        .buffers
        .iter()
        .map(|&(bytes, first, last)| BufferRequest {
            bytes,
            first: first as usize,
            last: last as usize,
        })
        .collect()
}

/// Checks the plan contract's four rules; the error says which rule and which tensors.
pub fn validate(plan: &StaticPlan) -> Result<(), String> {
    let ts = &plan.tensors;
    let align = plan.alignment.max(1);
    // Rule 1: sizes and alignment.
    for t in ts.iter() {
        let need = t.elems() as u64 * t.dtype.size();
        if t.bytes < need {
            return Err(format!(
                "rule 1: tensor {} `{}` has {} bytes, needs {need}",
                t.id, t.name, t.bytes
            ));
        }
        if t.offset % align != 0 {
            return Err(format!(
                "rule 1: tensor {} `{}` offset {} is not a multiple of {align}",
                t.id, t.name, t.offset
            ));
        }
        if t.first > t.last {
            return Err(format!(
                "tensor {} `{}` has first {} > last {}",
                t.id, t.name, t.first, t.last
            ));
        }
    }
    // Rule 2: reads inside lifetimes and after a write; writes at first.
    let mut written = vec![false; ts.len()];
    for (i, t) in ts.iter().enumerate() {
        if t.role == crate::plan::Role::Input {
            written[i] = true;
        }
    }
    for s in plan.steps.iter() {
        let idx = s.index;
        for &r in s.reads.iter().filter(|&&r| r != NONE) {
            let t = ts
                .get(r as usize)
                .ok_or_else(|| format!("rule 2: step {idx} reads unknown tensor {r}"))?;
            if !(t.first <= idx && idx <= t.last) {
                return Err(format!(
                    "rule 2: step {idx} ({} {}) reads `{}` outside its life [{}, {}]",
                    s.phase.name(),
                    s.op.name(),
                    t.name,
                    t.first,
                    t.last
                ));
            }
            if !written[r as usize] {
                return Err(format!(
                    "rule 2: step {idx} reads `{}` before any step wrote it",
                    t.name
                ));
            }
        }
        for &w in s.writes.iter().filter(|&&w| w != NONE) {
            let t = ts
                .get(w as usize)
                .ok_or_else(|| format!("rule 2: step {idx} writes unknown tensor {w}"))?;
            if t.first != idx {
                return Err(format!(
                    "rule 2: step {idx} writes `{}` whose first step is {}",
                    t.name, t.first
                ));
            }
        }
        for &w in s.writes.iter().filter(|&&w| w != NONE) {
            written[w as usize] = true;
        }
    }
    // Rule 3: tensors alive together occupy disjoint bytes, except in-place hand-overs.
    // Sweep by first step so only overlapping lifetimes are compared.
    let mut order: Vec<usize> = (0..ts.len()).collect();
    order.sort_by_key(|&i| (ts[i].first, ts[i].last));
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        let a = &ts[i];
        active.retain(|&j| ts[j].last >= a.first);
        for &j in &active {
            let b = &ts[j];
            let bytes_meet = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
            if !bytes_meet {
                continue;
            }
            if in_place_pair(plan, j, i) || in_place_pair(plan, i, j) {
                continue;
            }
            return Err(format!(
                "rule 3: `{}` [{}, {}] at {}+{} and `{}` [{}, {}] at {}+{} are alive together and share bytes",
                b.name, b.first, b.last, b.offset, b.bytes, a.name, a.first, a.last, a.offset, a.bytes
            ));
        }
        active.push(i);
    }
    // Rule 4: the arena holds everything; the lower bound is the peak of live bytes.
    let end = ts.iter().map(|t| t.offset + t.bytes).max().unwrap_or(0);
    if plan.arena_bytes < end {
        return Err(format!(
            "rule 4: arena_bytes {} < highest tensor end {end}",
            plan.arena_bytes
        ));
    }
    let lb = live_peak(plan).0;
    if lb != plan.lower_bound_bytes {
        return Err(format!(
            "rule 4: lower_bound_bytes {} but the live peak is {lb}",
            plan.lower_bound_bytes
        ));
    }
    if plan.lower_bound_bytes > plan.arena_bytes {
        return Err(format!(
            "rule 4: lower bound {} above arena {}",
            plan.lower_bound_bytes, plan.arena_bytes
        ));
    }
    Ok(())
}

/// `b` takes over `a`'s bytes in place: `a` dies where `b` is born, at a step that reads
/// `a` and writes `b` (directly, or through a chain of such hand-overs at that step).
fn in_place_pair(plan: &StaticPlan, a: usize, b: usize) -> bool {
    let (ta, tb) = (&plan.tensors[a], &plan.tensors[b]);
    if ta.last != tb.first || tb.in_place_of != a as u32 {
        return false;
    }
    plan.steps
        .get(tb.first as usize)
        .is_some_and(|s| s.reads.contains(&(a as u32)) && s.writes.contains(&(b as u32)))
}

/// The peak over steps of live bytes, a buffer shared in place counted once (its size is
/// its largest member's, its life the union of theirs), and the step where it occurs.
pub fn live_peak(plan: &StaticPlan) -> (u64, u32) {
    let ts = &plan.tensors;
    let mut buf: std::collections::HashMap<usize, (u64, u32, u32)> =
        std::collections::HashMap::new();
    for (i, t) in ts.iter().enumerate() {
        let mut root = i;
        let mut hops = 0;
        while ts[root].in_place_of != NONE && hops <= ts.len() {
            root = ts[root].in_place_of as usize;
            hops += 1;
        }
        let e = buf.entry(root).or_insert((0, u32::MAX, 0));
        e.0 = e.0.max(t.bytes);
        e.1 = e.1.min(t.first);
        e.2 = e.2.max(t.last);
    }
    let n_steps = plan.steps.len().max(1);
    let mut delta = vec![0i128; n_steps + 1];
    for &(bytes, first, last) in buf.values() {
        let (s, e) = (
            (first as usize).min(n_steps),
            (last as usize + 1).min(n_steps),
        );
        delta[s] += bytes as i128;
        delta[e] -= bytes as i128;
    }
    let (mut cur, mut best, mut at) = (0i128, 0i128, 0u32);
    for (i, d) in delta.iter().take(n_steps).enumerate() {
        cur += d;
        if cur > best {
            best = cur;
            at = i as u32;
        }
    }
    (best as u64, at)
}
