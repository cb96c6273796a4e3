//! Budget advice: byte-size strings (`"8 GiB"`, `"80GB"`) and the fixes that make a model
//! fit a memory budget — the largest batch, mixed precision, which layers to checkpoint —
//! each one verified by planning it, never guessed.
//!
//! The `#[memwise::model]` macro uses this for its budget error at compile time; the runtime
//! uses it for a budget read from the device. Every search here calls [`crate::plan()`], so
//! every number it returns is a planned total.

use crate::checkpoint::{max_batch_with, Policy};
use crate::data_parallel::Sharding;
use crate::dtype::Precision;
use crate::plan::StaticPlan;
use crate::spec::{LayerKind, ModelSpec};

/// Parses a byte size: a number and an optional unit, binary (`KiB`, `MiB`, `GiB`, `TiB`,
/// `PiB`: powers of 1024) or decimal (`KB`, `MB`, `GB`, `TB`, `PB`: powers of 1000), or
/// `B`/no unit for bytes. Units are case-insensitive; the space between number and unit is
/// optional. `"512 MiB"`, `"8 GiB"`, `"80GB"`, `"1.5 GiB"` and `"1_000_000"` are all understood.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let text = s.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(text.len());
    let (number, unit) = (text[..split].replace('_', ""), text[split..].trim());
    if number.is_empty() {
        return Err(format!(
            "expected a size like \"512 MiB\", \"8 GiB\" or \"80GB\", found \"{s}\""
        ));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{number}` is not a number (expected a size like \"1.5 GiB\")"))?;
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" | "byte" | "bytes" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "pib" => 1 << 50,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "k" | "m" | "g" | "t" | "p" => {
            let u = unit.to_ascii_uppercase();
            return Err(format!(
                "unit `{unit}` is ambiguous: write `{u}iB` (powers of 1024) or `{u}B` (powers of 1000)"
            ));
        }
        _ => {
            return Err(format!(
                "unknown unit `{unit}`: use B, KiB, MiB, GiB, TiB, PiB (powers of 1024) or KB, MB, GB, TB, PB (powers of 1000)"
            ))
        }
    };
    let bytes = (value * multiplier as f64).round();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("\"{s}\" is too large"));
    }
    Ok(bytes as u64)
}

/// Formats bytes with binary units, labelled as such: `512 B`, `1.5 KiB`, `621.41 MiB`,
/// `2 GiB` (at most two decimals, trailing zeros dropped).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let mut text = format!("{value:.2}");
    // Rounding can reach 1024.00 of a unit; say the next unit instead.
    if text == "1024.00" && unit + 1 < UNITS.len() {
        text = "1.00".to_string();
        unit += 1;
    }
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {}", UNITS[unit])
}

/// The planned total of one training step, or `None` when the model cannot be planned.
pub fn total(spec: &ModelSpec) -> Option<u64> {
    crate::plan(spec).ok().map(|p| p.memory.total)
}

/// Something the user can checkpoint with one annotation (a layer, a field, a block).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointUnit {
    /// How the user names it: a field, or a layer.
    pub label: String,
    /// Its place in declaration order. Units at consecutive positions are adjacent: two
    /// checkpointed runs that touch need numbered segments to stay two segments.
    pub position: usize,
    /// The spec layers it holds (its saved bytes are theirs).
    pub layers: Vec<String>,
}

/// How a checkpoint fix is written in the model: plain `#[checkpoint]` on every unit when no
/// two runs touch (a run of marked fields is one segment), numbered segments when some do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Annotation {
    /// `#[checkpoint]` on every unit of every run.
    Plain,
    /// `#[checkpoint(segment = first + r)]` on the units of run `r`.
    Numbered { first: i64 },
}

/// The units a user checkpoints with one annotation each, and the spec they get by writing a
/// fix: `apply(runs, annotation)` returns the spec with each run (unit indices, consecutive,
/// ascending) checkpointed as `annotation` writes it — exactly as the user would, so every
/// figure of the fix is the plan the user would get.
pub struct UserCheckpoints<'a> {
    pub units: Vec<CheckpointUnit>,
    /// The first segment number above any the model already uses (for [`Annotation::Numbered`]).
    pub first_segment: i64,
    pub apply: &'a dyn Fn(&[Vec<usize>], Annotation) -> ModelSpec,
}

impl UserCheckpoints<'_> {
    /// How `runs` (unit indices) are written: numbered when two of them touch.
    pub fn annotation(&self, runs: &[Vec<usize>]) -> Annotation {
        let touch = runs.windows(2).any(|w| match (w[0].last(), w[1].first()) {
            (Some(&a), Some(&b)) => self.units[b].position == self.units[a].position + 1,
            _ => false,
        });
        if touch {
            Annotation::Numbered {
                first: self.first_segment,
            }
        } else {
            Annotation::Plain
        }
    }
}

/// Checkpoint segments which make the model fit: each run is a list of consecutive units
/// recomputed together (one segment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointFix {
    /// Labels of the units of each segment, in declaration order.
    pub runs: Vec<Vec<String>>,
    /// How the runs are written.
    pub annotation: Annotation,
    /// Planned total with them checkpointed.
    pub total: u64,
    /// Forward FLOPs recomputed per step.
    pub recompute_flops: u64,
}

/// Switching the model-wide precision policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionFix {
    pub precision: Precision,
    /// Planned total at the model's batch.
    pub total: u64,
    /// Largest batch that fits with this precision.
    pub max_batch: Option<usize>,
}

/// What would make a model fit its budget, each figure planned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fixes {
    pub budget: u64,
    /// Planned total as declared.
    pub needed: u64,
    /// Largest batch that fits, and its planned total.
    pub max_batch: Option<(usize, u64)>,
    /// `mixed_float16`, when the model is on float32.
    pub precision: Option<PrecisionFix>,
    /// The cheapest checkpointing found that fits (least recomputation), if any.
    pub checkpoint: Option<CheckpointFix>,
    /// The lowest planned total any checkpointing tried reached (shown when none fits).
    pub checkpoint_best: Option<u64>,
}

impl Fixes {
    /// True when at least one fix fits.
    pub fn any(&self) -> bool {
        self.max_batch.is_some()
            || self
                .precision
                .as_ref()
                .is_some_and(|p| p.total <= self.budget)
            || self.checkpoint.is_some()
    }
}

/// Fixes for `spec` under `budget`, with every non-input layer a checkpoint unit. Callers
/// that know a coarser structure (the macro's fields and blocks) use [`fixes_with`].
pub fn fixes(spec: &ModelSpec, budget: u64) -> Fixes {
    let layers: Vec<(usize, &str)> = spec
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| !matches!(l.kind, LayerKind::Input { .. }))
        .map(|(i, l)| (i, l.name.as_str()))
        .collect();
    let units: Vec<CheckpointUnit> = layers
        .iter()
        .map(|&(position, name)| CheckpointUnit {
            label: name.to_string(),
            position,
            layers: vec![name.to_string()],
        })
        .collect();
    // Each run its own segment id, above any the model already uses.
    let apply = |runs: &[Vec<usize>], _: Annotation| {
        let mut s = spec.clone();
        let first = s
            .layers
            .iter()
            .filter_map(|l| l.checkpoint)
            .max()
            .map_or(0, |m| m + 1);
        for (id, run) in (first..).zip(runs) {
            for &i in run {
                if let Some(l) = s.layers.iter_mut().find(|l| l.name == layers[i].1) {
                    l.checkpoint = Some(id);
                }
            }
        }
        s
    };
    let checkpoints = UserCheckpoints {
        units,
        first_segment: 0,
        apply: &apply,
    };
    fixes_with(spec, budget, &checkpoints)
}

/// Fixes for `spec` under `budget`, checkpointing runs of the user's units.
pub fn fixes_with(spec: &ModelSpec, budget: u64, checkpoints: &UserCheckpoints<'_>) -> Fixes {
    let plan = crate::plan(spec).ok();
    let largest = max_batch_with(spec, budget, Policy::Plain);
    fixes_planned(spec, plan.as_ref(), budget, largest, checkpoints)
}

/// [`fixes_with`] given the plan of `spec` and its largest batch under `budget`.
pub(crate) fn fixes_planned(
    spec: &ModelSpec,
    plan: Option<&StaticPlan>,
    budget: u64,
    largest: Option<usize>,
    checkpoints: &UserCheckpoints<'_>,
) -> Fixes {
    let largest = largest
        .filter(|&b| b < spec.batch)
        .and_then(|b| total(&spec.with_batch(b)).map(|t| (b, t)));
    let precision = match spec.precision {
        Precision::Float32 => Some(Precision::MixedFloat16),
        _ => None,
    }
    .and_then(|p| {
        let s = ModelSpec {
            precision: p,
            ..spec.clone()
        };
        total(&s).map(|t| PrecisionFix {
            precision: p,
            total: t,
            max_batch: max_batch_with(spec, budget, Policy::Fp16),
        })
    });
    let (checkpoint, checkpoint_best) = checkpoint_search(plan, budget, checkpoints);
    Fixes {
        budget,
        needed: plan.map_or(u64::MAX, |p| p.memory.total),
        max_batch: largest,
        precision,
        checkpoint,
        checkpoint_best,
    }
}

/// Tries a family of checkpointings, plans each, and keeps the fitting one that recomputes
/// the fewest forward FLOPs:
///
/// - single units, largest saved bytes (in `plan`) first: the fewest that fit (bisection on
///   how many; a unit that is a block is one segment per instance, which saves its insides);
/// - contiguous runs: the units split into k runs of equal length, k = 1 … 12, with and
///   without the last unit (whose recomputation, next to the loss, saves nothing) — a run
///   frees every activation inside it, which single layers cannot (their output is the
///   next layer's input and stays alive).
///
/// Returns the best fit, and the lowest total seen (for the message when nothing fits).
/// This one is only ever exact about what it proposes, never optimal: the optimal choice
/// is `checkpoint = auto`'s solver.
fn checkpoint_search(
    plan: Option<&StaticPlan>,
    budget: u64,
    checkpoints: &UserCheckpoints<'_>,
) -> (Option<CheckpointFix>, Option<u64>) {
    let units = &checkpoints.units;
    let n = units.len();
    if n == 0 {
        return (None, None);
    }
    let mut best: Option<(u64, u64, Vec<Vec<usize>>)> = None; // (flops, total, runs)
    let mut lowest: Option<u64> = None;
    let mut evaluate = |runs: Vec<Vec<usize>>| -> bool {
        let spec = (checkpoints.apply)(&runs, checkpoints.annotation(&runs));
        let Ok(plan) = crate::plan(&spec) else {
            return false;
        };
        let t = plan.memory.total;
        lowest = Some(lowest.map_or(t, |l| l.min(t)));
        if t > budget {
            return false;
        }
        let flops: u64 = plan
            .memory
            .layers
            .iter()
            .filter(|l| l.checkpointed)
            .map(|l| l.forward_flops)
            .sum();
        if best
            .as_ref()
            .is_none_or(|(f, tt, _)| (flops, t) < (*f, *tt))
        {
            best = Some((flops, t, runs));
        }
        true
    };

    // Single units by saved bytes.
    let saved = |u: &CheckpointUnit| -> u64 { u.layers.iter().map(|l| saved_bytes(plan, l)).sum() };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(saved(&units[i])), i));
    let singles = |k: usize| {
        let mut chosen = order[..k].to_vec();
        chosen.sort_unstable();
        chosen.into_iter().map(|i| vec![i]).collect::<Vec<_>>()
    };
    if evaluate(singles(n)) {
        let (mut lo, mut hi) = (0usize, n);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if evaluate(singles(mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
    }

    // Contiguous runs.
    for span in [n, n.saturating_sub(1)] {
        for k in 1..=span.min(12) {
            let runs: Vec<Vec<usize>> = (0..k)
                .map(|r| (r * span / k..(r + 1) * span / k).collect::<Vec<_>>())
                .filter(|r| !r.is_empty())
                .collect();
            evaluate(runs);
        }
    }

    let fix = best.map(|(flops, total, runs)| CheckpointFix {
        annotation: checkpoints.annotation(&runs),
        runs: runs
            .iter()
            .map(|r| r.iter().map(|&i| units[i].label.clone()).collect())
            .collect(),
        total,
        recompute_flops: flops,
    });
    (fix, lowest)
}

/// Saved activation bytes of a layer in `plan` (0 when there is no plan).
fn saved_bytes(plan: Option<&StaticPlan>, layer: &str) -> u64 {
    plan.and_then(|p| p.memory.layers.iter().find(|l| l.name == layer))
        .map_or(0, |l| l.saved_bytes + l.recomputed_bytes)
}

// ---- The budget error's text ----

/// The budget error's text: the headline, the breakdown, and the planned fixes, as rustc
/// writes a diagnostic (`= note:`, `= help:`).
pub fn budget_message(spec: &ModelSpec, plan: &StaticPlan, fixes: &Fixes) -> String {
    let m = &plan.memory;
    let (need, budget) = (m.total, fixes.budget);
    let mut s = format!(
        "model `{}` needs {} but the budget is {} ({} over)",
        spec.name,
        format_bytes(need),
        format_bytes(budget),
        format_bytes(need - budget)
    );
    let packing = m
        .arena
        .saturating_sub(m.activations_peak + m.workspace_peak + m.inputs);
    let packing = if packing > 0 {
        format!(" + arena packing {}", format_bytes(packing))
    } else {
        String::new()
    };
    s += &format!(
        "\n= note: at batch {}, {}: params {} + grads {} + optimizer {} + activations {} + workspace {} + inputs {}{packing} = {} total, budget {}",
        spec.batch,
        spec.precision.name(),
        format_bytes(m.params),
        format_bytes(m.grads),
        format_bytes(m.optimizer),
        format_bytes(m.activations_peak),
        format_bytes(m.workspace_peak),
        format_bytes(m.inputs),
        format_bytes(need),
        format_bytes(budget),
    );
    let (fits, not) = fix_lines(spec, plan, fixes);
    if !fits.is_empty() {
        s += "\n= help: each of these fits (planned):";
        for f in &fits {
            s += &format!("\n        - {f}");
        }
    }
    if !not.is_empty() {
        s += if fits.is_empty() {
            "\n= help: no single change fits:"
        } else {
            "\n= note: these do not fit alone:"
        };
        for f in &not {
            s += &format!("\n        - {f}");
        }
    }
    s
}

/// The fixes that fit and those that do not, one line each.
fn fix_lines(spec: &ModelSpec, plan: &StaticPlan, fixes: &Fixes) -> (Vec<String>, Vec<String>) {
    let budget = fixes.budget;
    let mut fits = Vec::new();
    let mut not = Vec::new();
    match fixes.max_batch {
        Some((b, t)) => fits.push(format!(
            "`batch = {b}` (the largest batch that fits): {}",
            format_bytes(t)
        )),
        None => not.push(match total(&spec.with_batch(1)) {
            Some(t) => format!(
                "a smaller batch: even `batch = 1` needs {}",
                format_bytes(t)
            ),
            None => "a smaller batch: no batch size fits".to_string(),
        }),
    }
    if let Some(p) = &fixes.precision {
        let name = p.precision.name();
        if p.total <= budget {
            fits.push(format!("`precision = {name}`: {}", format_bytes(p.total)));
        } else {
            let with = match p.max_batch {
                Some(b) => format!(" (with it, `batch = {b}` fits)"),
                None => String::new(),
            };
            not.push(format!(
                "`precision = {name}` still needs {}{with}",
                format_bytes(p.total)
            ));
        }
    }
    let forward: u64 = plan.memory.layers.iter().map(|l| l.forward_flops).sum();
    match (&fixes.checkpoint, fixes.checkpoint_best) {
        (Some(c), _) => {
            let share = if forward > 0 {
                format!(
                    ", recomputing {:.0}% of the forward pass",
                    100.0 * c.recompute_flops as f64 / forward as f64
                )
            } else {
                String::new()
            };
            fits.push(format!(
                "{}: {}{share}",
                checkpoint_advice(c),
                format_bytes(c.total)
            ))
        }
        (None, Some(t)) => not.push(format!(
            "checkpointing: the best placement tried still needs {}",
            format_bytes(t)
        )),
        (None, None) => {}
    }
    let replicated = smallest_replicas(spec, budget);
    if let Some((n, t)) = replicated {
        fits.push(format!(
            "`replicas = {n}` (data parallel: {n} devices, each planned for {} of the {} samples): {} per device",
            spec.batch / n,
            spec.batch,
            format_bytes(t)
        ));
    }
    // With the optimizer state sharded too, when that needs fewer devices.
    if spec.sharding == Sharding::Replicated && spec.optimizer.state_slots() > 0 {
        let sharded = smallest_replicas(&spec.with_sharding(Sharding::OptimizerState), budget);
        if let Some((n, t)) = sharded.filter(|s| replicated.is_none_or(|r| s.0 < r.0)) {
            fits.push(format!(
                "`replicas = {n}, zero = 1` (data parallel, each of the {n} devices keeping 1/{n} of the optimizer state): {} per device",
                format_bytes(t)
            ));
        }
    }
    (fits, not)
}

/// The fewest data-parallel replicas, more than `spec`'s, whose share of the batch fits
/// `budget` on each device, and one replica's planned total. Only counts that divide the
/// batch are tried (the global batch stays as declared).
pub fn smallest_replicas(spec: &ModelSpec, budget: u64) -> Option<(usize, u64)> {
    (spec.replicas.max(1) + 1..=spec.batch)
        .filter(|n| spec.batch.is_multiple_of(*n))
        .find_map(|n| {
            total(&spec.with_replicas(n))
                .filter(|&t| t <= budget)
                .map(|t| (n, t))
        })
}

/// The checkpoint fix as the user writes it: `` `#[checkpoint]` on `a`, `b` `` or
/// `` `#[checkpoint(segment = 1)]` on `a`; `#[checkpoint(segment = 2)]` on `b` ``.
fn checkpoint_advice(fix: &CheckpointFix) -> String {
    let names = |run: &[&String]| {
        let n: Vec<String> = run.iter().map(|n| format!("`{n}`")).collect();
        if n.len() > 8 {
            format!(
                "{}, … {} (all {} fields)",
                n[..3].join(", "),
                n[n.len() - 1],
                n.len()
            )
        } else {
            n.join(", ")
        }
    };
    match fix.annotation {
        Annotation::Numbered { first } => fix
            .runs
            .iter()
            .enumerate()
            .map(|(r, run)| {
                let run: Vec<&String> = run.iter().collect();
                format!(
                    "`#[checkpoint(segment = {})]` on {}",
                    first + r as i64,
                    names(&run)
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Annotation::Plain => {
            let all: Vec<&String> = fix.runs.iter().flatten().collect();
            format!("`#[checkpoint]` on {}", names(&all))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("8 GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2 gib"), Ok(2 << 30));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes(" 1_000 B "), Ok(1000));
        assert_eq!(parse_bytes("3 KB"), Ok(3000));
        assert_eq!(parse_bytes("1 TiB"), Ok(1 << 40));
    }

    #[test]
    fn rejects_malformed_sizes() {
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("2 G").unwrap_err().contains("ambiguous"));
        assert!(parse_bytes("2 gigs").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("1.2.3 GiB").is_err());
        assert!(parse_bytes("-1 GiB").is_err());
    }

    /// Every fix proposed is a plan that fits: re-planned here from the fix alone.
    #[test]
    fn proposed_fixes_fit() {
        let spec = crate::zoo::mnist_mlp(8192);
        let needed = total(&spec).unwrap();
        let budget = needed * 3 / 4;
        let f = fixes(&spec, budget);
        assert_eq!(f.needed, needed);
        let (b, t) = f.max_batch.expect("a smaller batch fits");
        assert!(t <= budget && total(&spec.with_batch(b + 1)).unwrap() > budget);
        assert_eq!(max_batch_with(&spec, budget, Policy::Plain), Some(b));
        if let Some(p) = &f.precision {
            let s = ModelSpec {
                precision: p.precision,
                ..spec.clone()
            };
            assert_eq!(total(&s), Some(p.total));
        }
        if let Some(c) = &f.checkpoint {
            let mut s = spec.clone();
            for (id, run) in (100..).zip(&c.runs) {
                for name in run {
                    s.layers
                        .iter_mut()
                        .find(|l| &l.name == name)
                        .unwrap()
                        .checkpoint = Some(id);
                }
            }
            assert_eq!(total(&s), Some(c.total));
            assert!(c.total <= budget);
        }
        assert!(f.any());
        assert_eq!(max_batch_with(&spec, 1, Policy::Plain), None);
    }

    #[test]
    fn formats_with_binary_labels() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(2 << 30), "2 GiB");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
        assert_eq!(format_bytes((1 << 20) - 1), "1 MiB");
        assert_eq!(format_bytes(651_598_643), "621.41 MiB");
    }
}
