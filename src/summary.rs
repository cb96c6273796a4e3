//! The model summary: a Keras-like table of layers (type, output shape, parameters, saved
//! bytes, checkpointed, in-place; dtype, recomputed bytes and FLOPs in the wide mode) and
//! the memory of one training step, from a static plan — with the measured peak beside the
//! estimate once a model has trained.
//!
//! ```
//! use memwise::prelude::*;
//! use memwise::summary::Summary;
//!
//! #[memwise::model(batch = 32, loss = mse(out, x))]
//! struct Tiny {
//!     #[input(shape = [16])]
//!     x: Input,
//!     #[dense(16)]
//!     out: Dense,
//! }
//!
//! # fn main() {
//! println!("{}", Tiny::summary()); // compact: fits 80 columns
//! println!("{}", Summary::of::<Tiny>().wide()); // every column
//! # }
//! ```
use std::borrow::Cow;
use std::fmt;

use crate::plan::advice::format_bytes;
use crate::plan::data_parallel::Sharding;
use crate::plan::{DType, StaticPlan};

/// The widest the compact table gets: an 80-column terminal.
pub const COMPACT_WIDTH: usize = 80;

/// `407050` → `407,050`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn shape(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

/// `3.2e9` FLOPs → `3.20 G`.
fn flops(n: u64) -> String {
    const UNITS: [&str; 5] = ["", " k", " M", " G", " T"];
    let (mut v, mut u) = (n as f64, 0);
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        n.to_string()
    } else {
        format!("{v:.2}{}", UNITS[u])
    }
}

/// Shortens `s` to `max` characters, ending it with `…` when cut.
fn fit(s: String, max: usize) -> String {
    if s.chars().count() <= max {
        return s;
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `text` broken at spaces into lines of at most `width` characters, continuation lines
/// indented by two.
/// What a layer flagged `R` rebuilds for its backward, by its kind.
fn rebuilt_in_backward(kind: &str) -> &'static str {
    match kind {
        k if k.contains("attention") => "attention probabilities in backward",
        "batch_norm" | "layer_norm" => "x̂ from its input in backward",
        "input" => "float copy cast again in backward",
        _ => "activation output again in backward",
    }
}

fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.trim().is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            out += line.trim_end();
            out.push('\n');
            line = "  ".to_string();
        } else if !line.trim().is_empty() {
            line.push(' ');
        }
        line += word;
    }
    out += line.trim_end();
    out
}

/// The rows of the summary's totals, by role: they add up to `m.total` (the arena's packing
/// row holds what packing could not avoid).
pub fn total_rows(m: &crate::plan::MemoryReport) -> [(&'static str, u64); 7] {
    [
        ("parameters", m.params),
        ("gradients", m.grads),
        ("optimizer state", m.optimizer),
        ("activations (peak)", m.activations_peak),
        ("workspace (peak)", m.workspace_peak),
        ("inputs (peak)", m.inputs),
        ("arena packing", m.arena.saturating_sub(m.lower_bound)),
    ]
}

/// The GEMM of a layer's forward step, `(m, n, k)` as cuBLAS sees it (`m` rows of the output,
/// `n` columns, `k` the reduction), for the ops that run one.
fn forward_gemm(op: &crate::plan::Op) -> Option<(usize, usize, usize)> {
    use crate::plan::Op;
    match *op {
        Op::Dense {
            rows,
            in_features,
            units,
            ..
        } => Some((rows, units, in_features)),
        Op::Conv2d { dims: d, .. } => {
            Some((d.n * d.out_h() * d.out_w(), d.c_out, d.kh * d.kw * d.c_in))
        }
        // x · Wᵀ, then a gather (col2im).
        Op::Conv2dTranspose { dims: d, .. } => {
            Some((d.n * d.h * d.w, d.kh * d.kw * d.c_out, d.c_in))
        }
        Op::Attention { seq, head_dim, .. } => Some((seq, seq, head_dim)),
        _ => None,
    }
}

/// Which 16-bit GEMMs have shapes the tensor cores run at full rate: every dimension a
/// multiple of 8 (cuBLAS's rule for float16 and bfloat16 operands; others run, slower).
/// One line, `None` when the model has no 16-bit GEMM.
pub fn tensor_core_note(plan: &StaticPlan) -> Option<String> {
    use crate::plan::Phase;
    let mut half = 0;
    let mut off: Vec<String> = Vec::new();
    for s in plan.steps.iter().filter(|s| s.phase == Phase::Forward) {
        let Some((m, n, k)) = forward_gemm(&s.op) else {
            continue;
        };
        let dtype = s.writes.first().map(|&t| plan.tensor(t).dtype);
        if !matches!(dtype, Some(DType::F16 | DType::BF16)) {
            continue;
        }
        half += 1;
        let bad: Vec<String> = [("m", m), ("n", n), ("k", k)]
            .iter()
            .filter(|(_, v)| v % 8 != 0)
            .map(|(d, v)| format!("{d} = {v}"))
            .collect();
        if !bad.is_empty() {
            off.push(format!("`{}` ({})", s.layer, bad.join(", ")));
        }
    }
    if half == 0 {
        return None;
    }
    Some(if off.is_empty() {
        format!("Tensor cores: all {half} 16-bit GEMMs have every dimension a multiple of 8")
    } else {
        format!(
            "Tensor cores: {} of {half} 16-bit GEMMs have every dimension a multiple of 8; not: {}",
            half - off.len(),
            off.join(", ")
        )
    })
}

/// A model summary, displayed as text. [`Summary::new`] takes a plan; [`Summary::of`] a
/// model, with its budget and its `checkpoint = auto` choice. Compact (80 columns) unless
/// [`Summary::wide`].
#[derive(Clone, Debug)]
pub struct Summary<'a> {
    // Owned for a model's const plan (cheap: its lists borrow 'static data), borrowed for
    // a plan made at run time.
    plan: Cow<'a, StaticPlan>,
    wide: bool,
    budget: Option<u64>,
    auto_checkpoint: Option<&'a str>,
    measured_peak: Option<u64>,
    outside_plan: u64,
    /// A model split into pipeline stages: every stage's plan.
    stages: &'a [StaticPlan],
}

impl<'a> Summary<'a> {
    pub fn new(plan: &'a StaticPlan) -> Summary<'a> {
        Summary {
            plan: Cow::Borrowed(plan),
            wide: false,
            budget: None,
            auto_checkpoint: None,
            measured_peak: None,
            outside_plan: 0,
            stages: &[],
        }
    }

    /// The summary of a `#[memwise::model]`: its compile-time plan, budget and automatic
    /// checkpoint choice.
    pub fn of<M: crate::Model>() -> Summary<'static> {
        Summary {
            plan: Cow::Owned(M::PLAN),
            wide: false,
            budget: M::BUDGET,
            auto_checkpoint: M::AUTO_CHECKPOINT_CHOICE,
            measured_peak: None,
            outside_plan: 0,
            stages: M::STAGES,
        }
    }

    /// The plans of the pipeline stages the model is split into (each stage's memory is
    /// shown after the one-device totals, against the budget).
    pub fn stages(mut self, stages: &'a [StaticPlan]) -> Self {
        self.stages = stages;
        self
    }

    /// Every column: dtype, recomputed bytes, in-place, forward FLOPs, per-layer persistent
    /// bytes; layer names never shortened.
    pub fn wide(mut self) -> Self {
        self.wide = true;
        self
    }

    /// Compact or wide.
    pub fn with_wide(mut self, wide: bool) -> Self {
        self.wide = wide;
        self
    }

    /// The budget the model was declared with (shown against the total).
    pub fn budget(mut self, budget: Option<u64>) -> Self {
        self.budget = budget;
        self
    }

    /// What `checkpoint = auto` chose (the planner's `CheckpointChoice` as text).
    pub fn auto_checkpoint(mut self, choice: Option<&'a str>) -> Self {
        self.auto_checkpoint = choice;
        self
    }

    /// The peak memory measured while training (resident growth on the CPU, device memory
    /// on a GPU), shown beside the estimate with the error between them; `outside_plan` is
    /// what the estimate adds to the plan's total for the host's side (on the CPU the
    /// trainer's staging, GEMM and prefetch buffers, `Trainer::host_bytes`; 0 on a GPU).
    pub fn measured_peak(mut self, bytes: Option<u64>, outside_plan: u64) -> Self {
        self.measured_peak = bytes;
        self.outside_plan = outside_plan;
        self
    }

    fn rows(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        let plan: &StaticPlan = &self.plan;
        let layers = plan.memory.layers.iter();
        if self.wide {
            let header = vec![
                "Layer (type)",
                "Output shape",
                "Param #",
                "DType",
                "Saved",
                "Checkpointed",
                "In-place",
                "Fwd FLOPs",
                "Persistent",
            ];
            let rows = layers
                .map(|l| {
                    vec![
                        format!("{} ({})", l.name, l.kind),
                        shape(&l.output_shape),
                        thousands(l.params),
                        l.dtype.name().to_string(),
                        format_bytes(l.saved_bytes),
                        if l.checkpointed {
                            format!("yes, recomputes {}", format_bytes(l.recomputed_bytes))
                        } else if l.recomputes_output {
                            "x̂ and its output from its input in backward".to_string()
                        } else if l.recomputes_in_backward {
                            rebuilt_in_backward(&l.kind).to_string()
                        } else {
                            String::new()
                        },
                        if l.in_place { "yes" } else { "" }.to_string(),
                        flops(l.forward_flops),
                        format_bytes(l.persistent_bytes),
                    ]
                })
                .collect();
            (header, rows)
        } else {
            // Name ≤ 28, shape ≤ 18, params ≤ 11, saved ≤ 10, flags 5: 72 + 4 gaps of 2 = 80.
            let header = vec!["Layer (type)", "Output shape", "Param #", "Saved", "Flags"];
            let rows = layers
                .map(|l| {
                    let mut flags = String::new();
                    if l.checkpointed {
                        flags.push('C');
                    }
                    if l.in_place {
                        if !flags.is_empty() {
                            flags.push(' ');
                        }
                        flags.push('I');
                    }
                    if matches!(l.dtype, DType::F16 | DType::BF16) {
                        if !flags.is_empty() {
                            flags.push(' ');
                        }
                        flags.push('H');
                    }
                    if l.recomputes_in_backward {
                        if !flags.is_empty() {
                            flags.push(' ');
                        }
                        flags.push('R');
                    }
                    vec![
                        fit(format!("{} ({})", l.name, l.kind), 28),
                        fit(shape(&l.output_shape), 18),
                        thousands(l.params),
                        format_bytes(l.saved_bytes),
                        flags,
                    ]
                })
                .collect();
            (header, rows)
        }
    }

    fn write_table(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (header, rows) = self.rows();
        let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
        for r in &rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let total_width = width.iter().sum::<usize>() + 2 * (width.len() - 1);
        let rule = "━".repeat(total_width);
        let numeric = |i: usize| i == 2 || (self.wide && i == 7);
        let row = |cells: &[String]| {
            let mut s = String::new();
            for (i, (c, &w)) in cells.iter().zip(&width).enumerate() {
                // Numbers right-aligned, text left-aligned (Keras's layout).
                let pad = w - c.chars().count();
                if numeric(i) {
                    s += &" ".repeat(pad);
                    s += c;
                } else {
                    s += c;
                    s += &" ".repeat(pad);
                }
                if i + 1 < cells.len() {
                    s += "  ";
                }
            }
            s.trim_end().to_string()
        };
        let head: Vec<String> = header.iter().map(|h| h.to_string()).collect();
        writeln!(f, "{rule}")?;
        writeln!(f, "{}", row(&head))?;
        writeln!(f, "{rule}")?;
        for r in &rows {
            writeln!(f, "{}", row(r))?;
        }
        writeln!(f, "{rule}")?;
        if !self.wide {
            writeln!(
                f,
                "Saved: kept for backward. Flags: C checkpointed (recomputed), I in-place, H half"
            )?;
            if self
                .plan
                .memory
                .layers
                .iter()
                .any(|l| l.recomputes_in_backward)
            {
                writeln!(
                    f,
                    "       R rebuilt for backward from what is kept: attention probabilities,\n\
                     \x20        a norm's x̂ (and output, `recompute_output`), a u8 input's float\n\
                     \x20        copy, a GELU output"
                )?;
            }
        }
        Ok(())
    }

    /// The totals block alone: parameters, the memory of one step, its measured peak.
    pub fn totals(&self) -> String {
        struct Totals<'b, 'a>(&'b Summary<'a>);
        impl fmt::Display for Totals<'_, '_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.write_totals(f)
            }
        }
        Totals(self).to_string()
    }

    /// A split model's stages: each one's layers and memory, against the budget.
    fn write_stages(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.stages.is_empty() {
            return Ok(());
        }
        let pp = crate::plan::stage::PipelinePlan::of_stages(self.stages.to_vec());
        let (largest, _) = pp.largest_stage();
        writeln!(
            f,
            "Split into {} pipeline stages, each on its own device: {} micro-batches of {} \
             samples, `{}` schedule, {:.1} % of the stages' time idle (the bubble):",
            self.stages.len(),
            pp.pipeline.micro_batches,
            self.stages[0].batch,
            pp.pipeline.schedule.name(),
            100.0 * pp.bubble_fraction()
        )?;
        for (s, plan) in self.stages.iter().enumerate() {
            let rows = &plan.memory.layers;
            let span = match (rows.first(), rows.last()) {
                (Some(a), Some(b)) if rows.len() > 1 => format!("{} … {}", a.name, b.name),
                (Some(a), _) => a.name.to_string(),
                _ => String::new(),
            };
            let m = &plan.memory;
            write!(
                f,
                "  stage {s}  {:<28} params {:>10}  activations {:>10}  total {:>10}",
                fit(span, 28),
                format_bytes(m.params + m.grads + m.optimizer),
                format_bytes(m.activations_peak + m.workspace_peak + m.inputs),
                format_bytes(m.total)
            )?;
            if let Some(b) = self.budget {
                write!(
                    f,
                    "  ({:.1} % of the budget)",
                    100.0 * m.total as f64 / b.max(1) as f64
                )?;
            }
            writeln!(f, "{}", if s == largest { "  ← largest" } else { "" })?;
        }
        Ok(())
    }

    fn write_totals(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan: &StaticPlan = &self.plan;
        let m = &plan.memory;
        writeln!(
            f,
            "Total params: {} ({})  Trainable: {}  Non-trainable: {}",
            thousands(plan.params_count),
            format_bytes(plan.params_count * 4),
            thousands(plan.trainable_count),
            thousands(plan.params_count - plan.trainable_count.min(plan.params_count)),
        )?;
        let what = match (plan.training, plan.replicas) {
            _ if !self.stages.is_empty() => "The whole model's training step on one device (for \
                comparison: the budget applies to each pipeline stage, below)"
                .to_string(),
            (false, _) => "One inference pass".to_string(),
            (true, 1) => "One training step".to_string(),
            (true, n) => format!(
                "One replica's training step ({} of the global batch of {}, on each of {n} data-parallel replicas)",
                plan.batch,
                plan.batch * n
            ),
        };
        writeln!(f, "{what}, planned (binary units: 1 KiB = 1024 B):")?;
        let sharded = plan.replicas > 1 && plan.sharding != Sharding::Replicated;
        for (name, bytes) in total_rows(m) {
            write!(f, "  {name:<20}{:>12}", format_bytes(bytes))?;
            if sharded && name == "optimizer state" {
                write!(
                    f,
                    "  (this replica's 1/{} shard: ZeRO stage {})",
                    plan.replicas,
                    plan.sharding.zero_stage()
                )?;
            }
            writeln!(f)?;
        }
        write!(f, "  {:<20}{:>12}", "total", format_bytes(m.total))?;
        if let (Some(b), true) = (self.budget, self.stages.is_empty()) {
            write!(
                f,
                "  of a {} budget ({:.1} %)",
                format_bytes(b),
                100.0 * m.total as f64 / b.max(1) as f64
            )?;
        }
        writeln!(f)?;
        if plan.replicas > 1 {
            writeln!(
                f,
                "  {:<20}{:>12}  ({} replicas; the gradients are summed in place, no second copy{})",
                "whole job",
                format_bytes(m.total * plan.replicas as u64),
                plan.replicas,
                if sharded {
                    "; the optimizer state is split among them"
                } else {
                    ""
                }
            )?;
        }
        if let Some(peak) = self.measured_peak {
            let estimate = m.total + self.outside_plan;
            if self.outside_plan > 0 {
                let sums = if plan.replicas > 1 {
                    ", gradient sums"
                } else {
                    ""
                };
                writeln!(
                    f,
                    "  {:<20}{:>12}  (besides the plan: staging, GEMM, prefetch, sample order{sums})",
                    "+ host",
                    format_bytes(self.outside_plan)
                )?;
            }
            let err = 100.0 * (peak as f64 - estimate as f64) / estimate.max(1) as f64;
            writeln!(
                f,
                "  {:<20}{:>12}  ({err:+.1} % vs the estimate of {})",
                "measured peak",
                format_bytes(peak),
                format_bytes(estimate)
            )?;
        }
        let efficiency = if m.arena == 0 {
            100.0
        } else {
            100.0 * m.lower_bound as f64 / m.arena as f64
        };
        writeln!(
            f,
            "Arena {} for {} live at the peak step: {efficiency:.1} % efficient",
            format_bytes(m.arena),
            format_bytes(m.lower_bound),
        )?;
        let checkpointed = m.layers.iter().filter(|l| l.checkpointed).count();
        if checkpointed > 0 {
            writeln!(
                f,
                "Checkpointing: {checkpointed} layer{} recomputed, {:.0} % of forward FLOPs again",
                if checkpointed == 1 { "" } else { "s" },
                plan.recompute_percent()
            )?;
        }
        let outputs = m.layers.iter().filter(|l| l.recomputes_output).count();
        if outputs > 0 {
            let cost = match checkpointed {
                0 => format!(", {:.1} % of forward FLOPs again", plan.recompute_percent()),
                _ => String::new(),
            };
            writeln!(
                f,
                "Norm outputs recomputed: {outputs} layer{} keep{} the input instead{cost}",
                if outputs == 1 { "" } else { "s" },
                if outputs == 1 { "s" } else { "" },
            )?;
        }
        if self.wide {
            if let Some(note) = tensor_core_note(plan) {
                writeln!(f, "{note}")?;
            }
        }
        if let Some(choice) = self.auto_checkpoint {
            writeln!(
                f,
                "{}",
                wrap(&format!("checkpoint = auto: {choice}"), COMPACT_WIDTH)
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan: &StaticPlan = &self.plan;
        writeln!(
            f,
            "Model: \"{}\"  (batch {}, {}, {})",
            plan.model,
            plan.batch,
            plan.precision.name(),
            plan.optimizer.name()
        )?;
        self.write_table(f)?;
        self.write_totals(f)?;
        self.write_stages(f)
    }
}

/// The compact table of a plan (what `MyNet::summary()` returns for the model's own plan).
pub fn table(plan: &StaticPlan) -> String {
    Summary::new(plan).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(407050), "407,050");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(shape(&[128, 512]), "(128, 512)");
        assert_eq!(shape(&[10]), "(10,)");
    }

    #[test]
    fn shortens_and_counts() {
        assert_eq!(fit("abcdef".into(), 4), "abc…");
        assert_eq!(fit("abc".into(), 4), "abc");
        assert_eq!(flops(999), "999");
        assert_eq!(flops(3_200_000_000), "3.20 G");
        assert_eq!(wrap("aa bb cc", 5), "aa bb\n  cc");
        assert_eq!(wrap("aa", 5), "aa");
    }

    /// A layer whose backward recomputes the attention probabilities is flagged `R`, with the
    /// legend line; a model without one shows neither.
    #[test]
    fn the_memory_efficient_attention_is_flagged() {
        let gpt = memwise_plan::plan(&memwise_plan::zoo::gpt2_stack(1, 1)).unwrap();
        let text = Summary::new(&gpt).to_string();
        let attn = text.lines().find(|l| l.starts_with("h0_attn (")).unwrap();
        assert!(attn.trim_end().ends_with("H R"), "{attn}");
        assert!(text.contains("R rebuilt for backward"), "{text}");
        let wide = Summary::new(&gpt).wide().to_string();
        assert!(
            wide.contains("attention probabilities in backward"),
            "{wide}"
        );
        // The MLP's u8 input is cast again for its first layer's backward: flagged too.
        let mlp = memwise_plan::plan(&memwise_plan::zoo::mnist_mlp(8)).unwrap();
        let text = Summary::new(&mlp).to_string();
        let pixels = text.lines().find(|l| l.starts_with("pixels (")).unwrap();
        assert!(pixels.trim_end().ends_with('R'), "{pixels}");
        assert!(Summary::new(&mlp)
            .wide()
            .to_string()
            .contains("float copy cast again in backward"));
        // With a float32 input there is nothing to rebuild.
        let mut f32_input = memwise_plan::zoo::mnist_mlp(8);
        if let memwise_plan::LayerKind::Input { dtype, .. } = &mut f32_input.layers[0].kind {
            *dtype = memwise_plan::DType::F32;
        }
        let plain = memwise_plan::plan(&f32_input).unwrap();
        assert!(!Summary::new(&plain).to_string().contains("R rebuilt"));
    }

    /// Layer norms marked `recompute_output`: flagged `R`, named in the wide view, counted.
    #[test]
    fn norms_that_recompute_their_outputs_are_flagged_and_counted() {
        let mut spec = memwise_plan::zoo::gpt2_stack(1, 1);
        spec.recompute_output(&["h0_ln_1", "h0_ln_2"]);
        let gpt = memwise_plan::plan(&spec).unwrap();
        let text = Summary::new(&gpt).to_string();
        let ln = text.lines().find(|l| l.starts_with("h0_ln_1 (")).unwrap();
        assert!(ln.trim_end().ends_with('R'), "{ln}");
        let pct = gpt.recompute_percent();
        let line = format!(
            "Norm outputs recomputed: 2 layers keep the input instead, {pct:.1} % of forward FLOPs again"
        );
        assert!(text.contains(&line), "{text}");
        assert!(pct > 0.0 && pct < 0.1, "{pct}");
        let wide = Summary::new(&gpt).wide().to_string();
        assert!(
            wide.contains("x̂ and its output from its input in backward"),
            "{wide}"
        );
        let plain = memwise_plan::plan(&memwise_plan::zoo::gpt2_stack(1, 1)).unwrap();
        assert!(!Summary::new(&plain).to_string().contains("Norm outputs"));
    }

    /// A batch norm whose input the shortcut convolution keeps rebuilds x̂: flagged `R`.
    #[test]
    fn a_batch_norm_that_rebuilds_x_hat_is_flagged() {
        use memwise_plan::{Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Padding};
        let conv = || LayerKind::conv2d(4, 1, 1, Padding::Valid, Activation::Linear);
        let mut m = ModelSpec::new("Residual", 2);
        m.input("x", &[3, 3, 4], DType::F32, 1.0);
        m.add("pre", conv(), &["x"]);
        m.add("bn", LayerKind::batch_norm(), &["pre"]);
        m.add("shortcut", conv(), &["pre"]);
        m.add("sum", LayerKind::add(), &["bn", "shortcut"]);
        m.input("y", &[3, 3, 4], DType::F32, 1.0);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["sum", "y"]));
        let p = memwise_plan::plan(&m).unwrap();
        let text = Summary::new(&p).to_string();
        let bn = text.lines().find(|l| l.starts_with("bn (")).unwrap();
        assert!(bn.trim_end().ends_with('R'), "{bn}");
        let wide = Summary::new(&p).wide().to_string();
        assert!(wide.contains("x̂ from its input in backward"), "{wide}");
    }
}
