//! The memory timeline of one training step: what occupies which bytes of the arena at
//! which step ([`svg`], PyTorch's "active memory timeline" for a plan that has not run yet),
//! and how many bytes of each role are live per step ([`stacked_svg`]).
//!
//! Live bytes are counted the way the planner counts its lower bound
//! (`planner::arena::live_peak`): tensors that hand their bytes over in place form one buffer,
//! counted once, so the peak a picture labels is `plan.lower_bound_bytes` at
//! `plan.memory.peak_step` exactly, not a near miss.

use std::collections::HashMap;
use std::fmt::Write as _;

use memwise_plan::{Phase, PlanTensor, Role, StaticPlan, NONE};

use super::{esc, format_bytes, layer_colour, text_width, Anchor, Font, Svg, NO_LAYER_COLOUR};

/// Width of every timeline picture, px.
pub const WIDTH: f64 = 1200.0;

/// Roles in stacking order, bottom to top: what lives longest at the bottom.
pub const ROLES: [Role; 5] = [
    Role::Input,
    Role::Activation,
    Role::Recomputed,
    Role::ActivationGrad,
    Role::Workspace,
];

/// How a role is called in a legend.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Input => "inputs",
        Role::Activation => "activations",
        Role::Recomputed => "recomputed",
        Role::ActivationGrad => "activation gradients",
        Role::Workspace => "workspace",
    }
}

fn role_slot(role: Role) -> usize {
    ROLES.iter().position(|&r| r == role).unwrap_or(0)
}

/// Fill colours of the stacked view, in [`ROLES`] order.
const ROLE_COLOURS: [&str; 5] = ["#9e9e9e", "#4e79a7", "#f28e2b", "#e15759", "#76b7b2"];

/// Background tint of the plot and the colour of the phase strip, per phase.
fn phase_colours(p: Phase) -> (&'static str, &'static str) {
    match p {
        Phase::Forward => ("#eef4fb", "#c6dbef"),
        Phase::Recompute => ("#fdf3e4", "#fdd0a2"),
        Phase::Loss => ("#f3eff8", "#dadaeb"),
        Phase::Backward => ("#fcefed", "#fcbba1"),
        Phase::Update => ("#eef7ec", "#c7e9c0"),
    }
}

const PHASES: [Phase; 5] = [
    Phase::Forward,
    Phase::Recompute,
    Phase::Loss,
    Phase::Backward,
    Phase::Update,
];

/// What is live at every step of a plan, each buffer (a tensor and the tensors that take its
/// bytes over in place) counted once with its largest member's bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveMemory {
    /// Live bytes at each step.
    pub total: Vec<u64>,
    /// Live bytes at each step by role, in [`ROLES`] order; a buffer counts under the role
    /// of its newest member live at that step (as `MemoryReport`'s breakdown does).
    pub by_role: Vec<[u64; 5]>,
    /// The first step with the most live bytes.
    pub peak_step: u32,
    pub peak_bytes: u64,
    /// One tensor per buffer live at the peak (its newest member there), biggest first.
    pub at_peak: Vec<u32>,
}

/// For each tensor, the first tensor of its in-place chain. The hop limit guards against a
/// malformed plan with a cycle; the validator rejects those, but a picture should not hang.
fn roots(ts: &[PlanTensor]) -> Vec<usize> {
    (0..ts.len())
        .map(|i| {
            let mut r = i;
            let mut hops = 0;
            while ts[r].in_place_of != NONE && (ts[r].in_place_of as usize) < ts.len() {
                r = ts[r].in_place_of as usize;
                hops += 1;
                if hops > ts.len() {
                    break;
                }
            }
            r
        })
        .collect()
}

/// In-place chains: members of each buffer sorted by `first`, buffers in tensor order of
/// their roots.
fn chains(plan: &StaticPlan) -> Vec<Vec<usize>> {
    let root = roots(&plan.tensors);
    let mut slot: HashMap<usize, usize> = HashMap::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, &r) in root.iter().enumerate() {
        let k = *slot.entry(r).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[k].push(i);
    }
    for c in &mut out {
        c.sort_by_key(|&i| (plan.tensors[i].first, i));
    }
    out
}

/// Root tensor of each buffer → the buffer's bytes (its largest member).
fn buffer_bytes(plan: &StaticPlan) -> HashMap<usize, u64> {
    let root = roots(&plan.tensors);
    let mut out: HashMap<usize, u64> = HashMap::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        let e = out.entry(root[i]).or_insert(0);
        *e = (*e).max(t.bytes);
    }
    out
}

/// Computes [`LiveMemory`] of `plan`.
pub fn live_memory(plan: &StaticPlan) -> LiveMemory {
    let n = plan.steps.len().max(1);
    let ts = &plan.tensors;
    let mut total = vec![0u64; n];
    let mut by_role = vec![[0u64; 5]; n];
    let mut newest: Vec<Vec<u32>> = vec![Vec::new(); n];
    for chain in chains(plan) {
        let bytes = chain.iter().map(|&i| ts[i].bytes).max().unwrap_or(0);
        let first = chain.iter().map(|&i| ts[i].first).min().unwrap_or(0) as usize;
        let last = chain.iter().map(|&i| ts[i].last).max().unwrap_or(0) as usize;
        for s in first.min(n)..(last + 1).min(n) {
            total[s] += bytes;
            // The newest member that has started by `s` (chains are contiguous, so it is
            // live there).
            let m = chain
                .iter()
                .rev()
                .find(|&&i| ts[i].first as usize <= s)
                .copied()
                .unwrap_or(chain[0]);
            by_role[s][role_slot(ts[m].role)] += bytes;
            newest[s].push(m as u32);
        }
    }
    let (mut peak_step, mut peak_bytes) = (0u32, 0u64);
    for (s, &b) in total.iter().enumerate() {
        if b > peak_bytes {
            peak_bytes = b;
            peak_step = s as u32;
        }
    }
    let bytes_of = buffer_bytes(plan);
    let root = roots(ts);
    let mut at_peak = std::mem::take(&mut newest[peak_step as usize]);
    // Biggest buffer first: the peak counts a buffer's bytes, which a member may be below.
    at_peak.sort_by(|&a, &b| {
        let (ba, bb) = (bytes_of[&root[a as usize]], bytes_of[&root[b as usize]]);
        bb.cmp(&ba).then(a.cmp(&b))
    });
    LiveMemory {
        total,
        by_role,
        peak_step,
        peak_bytes,
        at_peak,
    }
}

/// Layer name → colour, in `plan.memory.layers` order (the graph picture uses the same).
fn layer_colours(plan: &StaticPlan) -> HashMap<&str, String> {
    plan.memory
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| (l.name.as_ref(), layer_colour(i)))
        .collect()
}

fn colour_of<'a>(colours: &'a HashMap<&str, String>, layer: &str) -> &'a str {
    colours
        .get(layer)
        .map(String::as_str)
        .unwrap_or(NO_LAYER_COLOUR)
}

/// Runs of consecutive steps of one phase: `(phase, first step, one past the last)`.
fn phase_runs(plan: &StaticPlan) -> Vec<(Phase, usize, usize)> {
    let mut runs: Vec<(Phase, usize, usize)> = Vec::new();
    for (i, s) in plan.steps.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.0 == s.phase => r.2 = i + 1,
            _ => runs.push((s.phase, i, i + 1)),
        }
    }
    runs
}

fn shape_text(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// "backward conv2d_transpose · decoded": what the step does.
fn step_text(plan: &StaticPlan, step: u32) -> String {
    match plan.steps.get(step as usize) {
        Some(s) => format!("{} {} · {}", s.phase.name(), s.op.name(), s.layer),
        None => "no steps".to_string(),
    }
}

/// One row of the peak callout.
enum Row {
    Head(String),
    Item {
        marker: Option<usize>,
        swatch: String,
        name: String,
        bytes: String,
        note: String,
    },
    Note(String),
}

/// The picture's frame: geometry shared by both views.
struct Frame<'a> {
    plan: &'a StaticPlan,
    live: &'a LiveMemory,
    budget: Option<u64>,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    /// Bytes at the top of the plot.
    y_max: f64,
    steps: usize,
    callout_top: f64,
    callout_h: f64,
}

const LEFT: f64 = 86.0;
const RIGHT_MARGIN: f64 = 178.0;
const PLOT_H: f64 = 440.0;
const ROW_H: f64 = 17.0;

impl<'a> Frame<'a> {
    fn new(
        plan: &'a StaticPlan,
        live: &'a LiveMemory,
        budget: Option<u64>,
        callout_rows: usize,
    ) -> Self {
        let callout_top = 76.0;
        let callout_h = callout_rows as f64 * ROW_H + 12.0;
        let top = callout_top + callout_h + 16.0 + 22.0;
        let content = plan
            .arena_bytes
            .max(plan.lower_bound_bytes)
            .max(live.peak_bytes)
            .max(1) as f64;
        // A budget close above the content is drawn to scale; one far above would squash
        // the picture into a sliver, so it is labelled as off the scale instead.
        let y_max = match budget {
            Some(b) if (b as f64) <= content * 1.6 => (b as f64).max(content) * 1.06,
            _ => content * 1.06,
        };
        Frame {
            plan,
            live,
            budget,
            left: LEFT,
            right: WIDTH - RIGHT_MARGIN,
            top,
            bottom: top + PLOT_H,
            y_max,
            steps: plan.steps.len().max(1),
            callout_top,
            callout_h,
        }
    }

    fn col(&self) -> f64 {
        (self.right - self.left) / self.steps as f64
    }

    fn x(&self, step: f64) -> f64 {
        self.left + step * self.col()
    }

    fn y(&self, bytes: f64) -> f64 {
        self.bottom - bytes / self.y_max * (self.bottom - self.top)
    }

    /// SVG path commands tracing `values` (one per step) left to right as a step function:
    /// each step's value held flat across its whole column.
    fn step_path(&self, values: &[u64]) -> String {
        let mut d = String::new();
        for (s, &b) in values.iter().enumerate() {
            let y = self.y(b as f64);
            let cmd = if s == 0 { 'M' } else { 'L' };
            let _ = write!(
                d,
                "{cmd}{:.2} {y:.2} L{:.2} {y:.2} ",
                self.x(s as f64),
                self.x(s as f64 + 1.0)
            );
        }
        d
    }

    fn peak_x(&self) -> f64 {
        self.x(self.live.peak_step as f64 + 0.5)
    }

    /// Title and the one-line summary under it.
    fn header(&self, svg: &mut Svg, view: &str) {
        let p = self.plan;
        let kind = if p.training {
            "training step"
        } else {
            "inference pass"
        };
        svg.text(
            16.0,
            26.0,
            Font::new(17.0).bold(),
            &format!("{} · batch {} · {kind} · {view}", p.model, p.batch),
        );
        let efficiency = if p.arena_bytes > 0 {
            100.0 * p.lower_bound_bytes as f64 / p.arena_bytes as f64
        } else {
            100.0
        };
        let line1 = format!(
            "{} steps · {} tensors · arena {} · lower bound {} (packing {efficiency:.1} %)",
            p.steps.len(),
            p.tensors.len(),
            format_bytes(p.arena_bytes),
            format_bytes(p.lower_bound_bytes),
        );
        let mut line2 = format!(
            "+ {} persistent (params, gradients, optimizer state) outside the arena",
            format_bytes(p.memory.persistent()),
        );
        if let Some(b) = self.budget {
            let total = p.memory.total;
            let verdict = if total <= b {
                format!("fits the {} budget", format_bytes(b))
            } else {
                format!("exceeds the {} budget", format_bytes(b))
            };
            let _ = write!(line2, " · total {} {verdict}", format_bytes(total));
        }
        svg.text(16.0, 46.0, Font::new(12.0).fill("#444"), &line1);
        svg.text(16.0, 62.0, Font::new(12.0).fill("#444"), &line2);
    }

    /// Background tints per phase and the labelled phase strip above the plot.
    fn phases(&self, svg: &mut Svg) {
        let strip_y = self.top - 22.0;
        for (phase, a, b) in phase_runs(self.plan) {
            let (tint, strong) = phase_colours(phase);
            let (x0, x1) = (self.x(a as f64), self.x(b as f64));
            svg.rect(
                x0,
                self.top,
                x1 - x0,
                self.bottom - self.top,
                &format!(r#"fill="{tint}""#),
            );
            svg.raw(&format!(
                r#"<g class="phase" data-phase="{}">"#,
                phase.name()
            ));
            svg.rect(
                x0,
                strip_y,
                x1 - x0,
                18.0,
                &format!(r##"fill="{strong}" stroke="#ffffff" stroke-width="1""##),
            );
            let label = phase.name();
            // Narrow runs (one loss step of a deep model) stay unlabelled in the strip:
            // the phase key under the plot names their colour.
            if text_width(label, 11.0, false) + 6.0 <= x1 - x0 {
                svg.text(
                    (x0 + x1) / 2.0,
                    strip_y + 13.0,
                    Font::new(11.0).anchor(Anchor::Middle).fill("#333"),
                    label,
                );
            }
            svg.raw(&format!(
                "<title>{} steps {}–{}</title></g>",
                phase.name(),
                a,
                b - 1
            ));
        }
    }

    /// Axes, grid and tick labels.
    fn axes(&self, svg: &mut Svg, y_title: &str) {
        let (unit, name) = unit_for(self.y_max);
        let step = nice_step(self.y_max / unit / 6.0);
        let mut v = 0.0;
        while v * unit <= self.y_max + 1e-9 {
            let y = self.y(v * unit);
            svg.line(
                self.left,
                y,
                self.right,
                y,
                r##"stroke="#000000" stroke-opacity="0.08" stroke-width="1""##,
            );
            svg.text(
                self.left - 6.0,
                y + 4.0,
                Font::new(11.0).anchor(Anchor::End).fill("#444"),
                &format!("{} {name}", trim_num(v)),
            );
            v += step;
        }
        // X ticks: step indices.
        let xs = nice_step(self.steps as f64 / 12.0).max(1.0) as usize;
        for s in (0..self.steps).step_by(xs) {
            let x = self.x(s as f64 + 0.5);
            svg.line(
                x,
                self.bottom,
                x,
                self.bottom + 4.0,
                r##"stroke="#666666" stroke-width="1""##,
            );
            svg.text(
                x,
                self.bottom + 16.0,
                Font::new(11.0).anchor(Anchor::Middle).fill("#444"),
                &s.to_string(),
            );
        }
        svg.rect(
            self.left,
            self.top,
            self.right - self.left,
            self.bottom - self.top,
            r##"fill="none" stroke="#888888" stroke-width="1""##,
        );
        svg.text(
            (self.left + self.right) / 2.0,
            self.bottom + 34.0,
            Font::new(12.0).anchor(Anchor::Middle).fill("#333"),
            "step of the training step's schedule",
        );
        let cy = (self.top + self.bottom) / 2.0;
        svg.raw(&format!(
            r##"<text x="20" y="{cy:.1}" font-size="12" fill="#333" text-anchor="middle" transform="rotate(-90 20 {cy:.1})">{}</text>"##,
            esc(&format!("{y_title} ({name}, binary units)"))
        ));
    }

    /// The lower-bound, arena and budget lines, labelled in the right margin (name, then
    /// value, on two lines: the margin is narrow and the plot should keep the width).
    fn lines(&self, svg: &mut Svg) {
        let p = self.plan;
        let lx = self.right + 8.0;
        struct Mark {
            y: f64,
            name: String,
            value: String,
            colour: &'static str,
            dash: &'static str,
            id: &'static str,
            /// Drawn as a line (false: a budget above the chart, label only).
            drawn: bool,
        }
        let mut marks: Vec<Mark> = Vec::new();
        let (arena_name, arena_id) = if p.arena_bytes == p.lower_bound_bytes {
            ("arena = lower bound", "arena-line")
        } else {
            ("arena", "arena-line")
        };
        marks.push(Mark {
            y: self.y(p.arena_bytes as f64),
            name: arena_name.to_string(),
            value: format_bytes(p.arena_bytes),
            colour: "#111111",
            dash: "",
            id: arena_id,
            drawn: true,
        });
        if p.arena_bytes != p.lower_bound_bytes {
            marks.push(Mark {
                y: self.y(p.lower_bound_bytes as f64),
                name: "lower bound".to_string(),
                value: format_bytes(p.lower_bound_bytes),
                colour: "#555555",
                dash: r#" stroke-dasharray="6 4""#,
                id: "lower-bound-line",
                drawn: true,
            });
        }
        if let Some(b) = self.budget {
            let on_scale = (b as f64) <= self.y_max;
            marks.push(Mark {
                y: if on_scale { self.y(b as f64) } else { self.top },
                name: if on_scale {
                    "budget".to_string()
                } else {
                    "budget ↑ (off the chart)".to_string()
                },
                value: format_bytes(b),
                colour: "#c62828",
                dash: r#" stroke-dasharray="10 5""#,
                id: "budget-line",
                drawn: on_scale,
            });
        }
        // Labels sit at their line's height, pushed apart when lines are close.
        marks.sort_by(|a, b| a.y.total_cmp(&b.y));
        let mut last_y = f64::NEG_INFINITY;
        for m in &marks {
            let ly = (m.y + 4.0).max(self.top + 12.0).max(last_y + 32.0);
            last_y = ly;
            svg.raw(&format!(r#"<g id="{}">"#, m.id));
            if m.drawn {
                svg.line(
                    self.left,
                    m.y,
                    self.right + 4.0,
                    m.y,
                    &format!(r#"stroke="{}" stroke-width="1.6"{}"#, m.colour, m.dash),
                );
            }
            svg.text(lx, ly, Font::new(11.0).bold().fill(m.colour), &m.name);
            svg.text(lx, ly + 14.0, Font::new(11.0).fill(m.colour), &m.value);
            svg.raw("</g>");
        }
    }

    /// The peak: a vertical line through the plot up to the callout that lists what is
    /// alive there.
    fn peak(&self, svg: &mut Svg, rows: &[Row]) {
        let f = Font::new(11.0);
        // Column positions of item rows: marker, swatch, name, bytes (right-aligned), note.
        // The widest text of one column over the item rows (0 without any).
        let column_w = |column: fn(&Row) -> Option<&String>| {
            rows.iter()
                .filter_map(column)
                .map(|s| text_width(s, 11.0, false))
                .fold(0.0, f64::max)
        };
        let name_w = column_w(|r| match r {
            Row::Item { name, .. } => Some(name),
            _ => None,
        });
        let bytes_w = column_w(|r| match r {
            Row::Item { bytes, .. } => Some(bytes),
            _ => None,
        });
        let note_w = column_w(|r| match r {
            Row::Item { note, .. } => Some(note),
            _ => None,
        });
        let item_w = 44.0 + name_w + 14.0 + bytes_w + 14.0 + note_w;
        let other_w = rows
            .iter()
            .map(|r| match r {
                Row::Head(s) => text_width(s, 12.0, true),
                Row::Note(s) => text_width(s, 11.0, false),
                _ => 0.0,
            })
            .fold(0.0, f64::max);
        let w = item_w.max(other_w) + 20.0;
        let px = self.peak_x();
        let bx = (px - 40.0).clamp(8.0, (WIDTH - 8.0 - w).max(8.0));
        let by = self.callout_top;
        let h = self.callout_h;
        svg.raw(r#"<g id="peak">"#);
        svg.line(
            px,
            self.bottom,
            px,
            by + h,
            r##"stroke="#b2182b" stroke-width="1.8""##,
        );
        svg.rect(
            bx,
            by,
            w,
            h,
            r##"rx="5" fill="#fff8f6" stroke="#b2182b" stroke-width="1.2""##,
        );
        let mut y = by + 6.0 + 12.0;
        for r in rows {
            match r {
                Row::Head(s) => {
                    svg.text_attrs(
                        bx + 10.0,
                        y,
                        Font::new(12.0).bold().fill("#b2182b"),
                        &format!(
                            r#"id="peak-label" data-peak-bytes="{}" data-peak-step="{}""#,
                            self.live.peak_bytes, self.live.peak_step
                        ),
                        s,
                    );
                }
                Row::Note(s) => svg.text(bx + 10.0, y, f.fill("#444"), s),
                Row::Item {
                    marker,
                    swatch,
                    name,
                    bytes,
                    note,
                } => {
                    if let Some(m) = marker {
                        marker_at(svg, bx + 18.0, y - 4.0, *m);
                    }
                    svg.rect(
                        bx + 30.0,
                        y - 10.0,
                        10.0,
                        11.0,
                        &format!(r#"fill="{swatch}""#),
                    );
                    svg.text(bx + 44.0, y, f, name);
                    svg.text(
                        bx + 44.0 + name_w + 14.0 + bytes_w,
                        y,
                        f.anchor(Anchor::End).bold(),
                        bytes,
                    );
                    svg.text(bx + 44.0 + name_w + 28.0 + bytes_w, y, f.fill("#555"), note);
                }
            }
            y += ROW_H;
        }
        svg.raw("</g>");
    }

    fn bottom_of_axes(&self) -> f64 {
        self.bottom + 46.0
    }
}

/// A numbered marker: a white disc with a dark ring.
fn marker_at(svg: &mut Svg, x: f64, y: f64, n: usize) {
    svg.raw(&format!(
        r##"<circle cx="{x:.2}" cy="{y:.2}" r="8" fill="#ffffff" stroke="#b2182b" stroke-width="1.6"/>"##
    ));
    svg.text(
        x,
        y + 4.0,
        Font::new(11.0)
            .bold()
            .anchor(Anchor::Middle)
            .fill("#b2182b"),
        &n.to_string(),
    );
}

/// The largest binary unit not above `max` (so tick labels read "10 MiB", not "0.01 GiB").
fn unit_for(max: f64) -> (f64, &'static str) {
    const K: f64 = 1024.0;
    if max >= K * K * K {
        (K * K * K, "GiB")
    } else if max >= K * K {
        (K * K, "MiB")
    } else if max >= K {
        (K, "KiB")
    } else {
        (1.0, "B")
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn trim_num(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// Patterns that mark a band's role over its layer colour.
fn role_patterns(svg: &mut Svg) {
    // Gradients: dark diagonal hatching; recomputed: white dots; inputs: horizontal lines.
    svg.def(
        r##"<pattern id="hatch-grad" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><rect x="0" y="0" width="2.2" height="6" fill="#000000" fill-opacity="0.35"/></pattern>"##,
    );
    svg.def(
        r##"<pattern id="dots-recomputed" patternUnits="userSpaceOnUse" width="6" height="6"><circle cx="3" cy="3" r="1.4" fill="#ffffff" fill-opacity="0.85"/></pattern>"##,
    );
    svg.def(
        r##"<pattern id="lines-input" patternUnits="userSpaceOnUse" width="6" height="4"><rect x="0" y="0" width="6" height="1.4" fill="#000000" fill-opacity="0.3"/></pattern>"##,
    );
}

/// Fill opacity and overlay pattern of a band of `role`.
fn role_style(role: Role) -> (f64, Option<&'static str>) {
    match role {
        Role::Activation => (0.92, None),
        Role::ActivationGrad => (0.92, Some("hatch-grad")),
        Role::Recomputed => (0.92, Some("dots-recomputed")),
        Role::Workspace => (0.42, None),
        Role::Input => (0.92, Some("lines-input")),
    }
}

/// A role swatch as it appears in the bands (layer colour `colour`).
fn role_swatch(svg: &mut Svg, x: f64, y: f64, role: Role, colour: &str) {
    let (op, pat) = role_style(role);
    svg.rect(
        x,
        y,
        22.0,
        12.0,
        &format!(r#"fill="{colour}" fill-opacity="{op}""#),
    );
    if let Some(p) = pat {
        svg.rect(x, y, 22.0, 12.0, &format!(r#"fill="url(#{p})""#));
    }
    if role == Role::Workspace {
        svg.rect(
            x,
            y,
            22.0,
            12.0,
            &format!(r#"fill="none" stroke="{colour}" stroke-dasharray="2 2""#),
        );
    }
}

/// Lays out legend entries (`swatch width`, text) in columns from `y`; returns the y below.
/// `draw` draws one swatch at (x, y-top).
fn legend_grid<F: FnMut(&mut Svg, usize, f64, f64)>(
    svg: &mut Svg,
    y: f64,
    labels: &[String],
    mut draw: F,
) -> f64 {
    if labels.is_empty() {
        return y;
    }
    let widest = labels
        .iter()
        .map(|l| text_width(l, 11.0, false))
        .fold(0.0, f64::max);
    let col_w = widest + 36.0;
    let avail = WIDTH - 32.0;
    let cols = ((avail / col_w).floor() as usize).clamp(1, labels.len());
    let rows = labels.len().div_ceil(cols);
    for (i, l) in labels.iter().enumerate() {
        // Column-major, so a model's layers read top to bottom like its declaration.
        let (c, r) = (i / rows, i % rows);
        let x = 16.0 + c as f64 * col_w;
        let yy = y + r as f64 * 16.0;
        draw(svg, i, x, yy);
        svg.text(x + 18.0, yy + 10.0, Font::new(11.0), l);
    }
    y + rows as f64 * 16.0
}

/// Phase key: one swatch per phase present.
fn phase_key(svg: &mut Svg, plan: &StaticPlan, mut x: f64, y: f64) {
    svg.text(x, y + 10.0, Font::new(11.0).bold(), "phases:");
    x += 56.0;
    for p in PHASES {
        if !plan.steps.iter().any(|s| s.phase == p) {
            continue;
        }
        let (_, strong) = phase_colours(p);
        svg.rect(x, y, 22.0, 12.0, &format!(r#"fill="{strong}""#));
        svg.text(x + 26.0, y + 10.0, Font::new(11.0), p.name());
        x += 32.0 + text_width(p.name(), 11.0, false) + 12.0;
    }
}

/// The timeline: every transient tensor as a band at its arena offset over `[first, last]`,
/// coloured by layer (patterned by role), on a background marking the phases; lines for the
/// lower bound, the arena size and `budget` (bytes for the whole step, compared with the
/// plan's total); the peak step marked and the biggest tensors alive there listed and
/// numbered on their bands. Every band carries a `<title>` (hover text) with the tensor's
/// name, layer, role, dtype, shape, bytes, offset and lifetime.
pub fn svg(plan: &StaticPlan, budget: Option<u64>) -> String {
    let live = live_memory(plan);
    let colours = layer_colours(plan);
    let (rows, peak_rank) = callout_rows(plan, &live, &colours);
    let f = Frame::new(plan, &live, budget, rows.len());
    let mut svg = Svg::new();
    role_patterns(&mut svg);
    f.header(&mut svg, "arena timeline");
    f.phases(&mut svg);
    f.axes(&mut svg, "arena offset");
    draw_bands(&mut svg, &f, plan, &colours);
    f.lines(&mut svg);
    f.peak(&mut svg, &rows);
    draw_peak_markers(&mut svg, &f, plan, &peak_rank);
    let y = draw_legends(&mut svg, &f, plan, &colours);
    svg.finish(
        WIDTH,
        y,
        &format!("{}: memory timeline of one training step", plan.model),
    )
}

/// How many of the buffers alive at the peak the callout names, biggest first.
const TOP_N: usize = 5;

/// The callout's rows (what is alive at the peak, biggest first) and the markers' numbers
/// by tensor.
fn callout_rows(
    plan: &StaticPlan,
    live: &LiveMemory,
    colours: &HashMap<&str, String>,
) -> (Vec<Row>, HashMap<u32, usize>) {
    let ts = &plan.tensors;
    let mut rows = vec![Row::Head(format!(
        "peak {} at step {} ({}) — {} buffers alive:",
        format_bytes(live.peak_bytes),
        live.peak_step,
        step_text(plan, live.peak_step),
        live.at_peak.len()
    ))];
    let peak_rank: HashMap<u32, usize> = live
        .at_peak
        .iter()
        .take(TOP_N)
        .enumerate()
        .map(|(i, &id)| (id, i + 1))
        .collect();
    let root = roots(ts);
    let buffer_bytes = buffer_bytes(plan);
    for (k, &id) in live.at_peak.iter().take(TOP_N).enumerate() {
        let t = &ts[id as usize];
        let bb = buffer_bytes[&root[id as usize]];
        rows.push(Row::Item {
            marker: Some(k + 1),
            swatch: colour_of(colours, &t.layer).to_string(),
            name: t.name.to_string(),
            bytes: format_bytes(bb),
            note: format!(
                "{} · {} {} · steps {}–{}",
                role_label(t.role),
                t.dtype.name(),
                shape_text(&t.shape),
                t.first,
                t.last
            ),
        });
    }
    if live.at_peak.len() > TOP_N {
        let rest: u64 = live.at_peak[TOP_N..]
            .iter()
            .map(|&id| buffer_bytes[&root[id as usize]])
            .sum();
        rows.push(Row::Note(format!(
            "+ {} smaller buffers, {} in all",
            live.at_peak.len() - TOP_N,
            format_bytes(rest)
        )));
    }
    (rows, peak_rank)
}

/// The bands, one group per in-place chain so that a hand-over reads as one continuous band.
fn draw_bands(svg: &mut Svg, f: &Frame<'_>, plan: &StaticPlan, colours: &HashMap<&str, String>) {
    let ts = &plan.tensors;
    svg.raw(r#"<g id="bands">"#);
    for chain in &chains(plan) {
        let maxb = chain.iter().map(|&i| ts[i].bytes).max().unwrap_or(0);
        let t0 = &ts[chain[0]];
        let last = chain.iter().map(|&i| ts[i].last).max().unwrap_or(t0.last);
        for (k, &i) in chain.iter().enumerate() {
            let t = &ts[i];
            // A member hands over in the middle of the step that reads the one and writes
            // the other: the predecessor ends and the successor starts there.
            let xa = if k == 0 {
                f.x(t.first as f64)
            } else {
                f.x(t.first as f64 + 0.5)
            };
            let xb = match chain.get(k + 1) {
                Some(&n) => f.x(ts[n].first as f64 + 0.5),
                None => f.x(t.last as f64 + 1.0),
            };
            let y1 = f.y(t.offset as f64);
            let y0 = f.y((t.offset + t.bytes) as f64);
            // Tiny tensors (a loss value in a GiB arena) stay visible as hairlines.
            let h = (y1 - y0).max(1.0);
            let colour = colour_of(colours, &t.layer);
            let (op, pat) = role_style(t.role);
            let mut title = format!(
                "{}\nlayer {} · {} · {} {}\n{} ({} bytes) at offset {}\nsteps [{}, {}]",
                t.name,
                t.layer,
                role_label(t.role),
                t.dtype.name(),
                shape_text(&t.shape),
                format_bytes(t.bytes),
                t.bytes,
                t.offset,
                t.first,
                t.last
            );
            if t.in_place_of != NONE {
                if let Some(src) = ts.get(t.in_place_of as usize) {
                    let _ = write!(title, "\nin place of {}", src.name);
                }
            }
            svg.raw(&format!(
                r#"<g class="band" data-tensor="{}"><title>{}</title>"#,
                t.id,
                esc(&title)
            ));
            svg.rect(
                xa,
                y1 - h,
                xb - xa,
                h,
                &format!(r#"fill="{colour}" fill-opacity="{op}""#),
            );
            if let Some(p) = pat {
                svg.rect(xa, y1 - h, xb - xa, h, &format!(r#"fill="url(#{p})""#));
            }
            if k > 0 {
                // The hand-over: a faint tick inside the band, which stays unbroken.
                svg.line(
                    xa,
                    y1 - h,
                    xa,
                    y1,
                    r##"stroke="#000000" stroke-opacity="0.35" stroke-width="1" stroke-dasharray="2 2""##,
                );
            }
            svg.raw("</g>");
        }
        // One outline per buffer: separate tensors show a seam, a chain shows none.
        let y1 = f.y(t0.offset as f64);
        let y0 = f.y((t0.offset + maxb) as f64);
        let (xa, xb) = (f.x(t0.first as f64), f.x(last as f64 + 1.0));
        svg.rect(
            xa,
            y0.min(y1 - 1.0),
            xb - xa,
            (y1 - y0).max(1.0),
            r##"fill="none" stroke="#ffffff" stroke-opacity="0.9" stroke-width="0.6""##,
        );
    }
    svg.raw("</g>");
}

/// Numbers the biggest buffers where the peak line crosses them.
fn draw_peak_markers(
    svg: &mut Svg,
    f: &Frame<'_>,
    plan: &StaticPlan,
    peak_rank: &HashMap<u32, usize>,
) {
    let ts = &plan.tensors;
    let root = roots(ts);
    let buffer_bytes = buffer_bytes(plan);
    let px = f.peak_x();
    // In rank order, so the SVG is the same bytes on every run.
    let mut ranked: Vec<(u32, usize)> = peak_rank.iter().map(|(&id, &n)| (id, n)).collect();
    ranked.sort_by_key(|&(_, n)| n);
    for (id, n) in ranked {
        let t = &ts[id as usize];
        let bb = buffer_bytes[&root[id as usize]];
        let c = f.y(t.offset as f64 + bb as f64 / 2.0);
        if f.y(t.offset as f64) - f.y((t.offset + bb) as f64) >= 12.0 {
            marker_at(svg, px, c, n);
        }
    }
}

/// The legends: layers (every layer with a live tensor, in model order), then roles and
/// phases. Returns the height drawn to.
fn draw_legends(
    svg: &mut Svg,
    f: &Frame<'_>,
    plan: &StaticPlan,
    colours: &HashMap<&str, String>,
) -> f64 {
    let ts = &plan.tensors;
    let mut y = f.bottom_of_axes() + 8.0;
    svg.text(
        16.0,
        y + 10.0,
        Font::new(12.0).bold(),
        "layers (band colour):",
    );
    y += 18.0;
    let mut layers: Vec<(usize, String)> = Vec::new();
    for t in ts.iter() {
        if layers.iter().any(|(_, n)| n == t.layer.as_ref()) {
            continue;
        }
        let idx = plan
            .memory
            .layers
            .iter()
            .position(|l| l.name == t.layer)
            .unwrap_or(usize::MAX);
        layers.push((idx, t.layer.to_string()));
    }
    layers.sort();
    let labels: Vec<String> = layers.iter().map(|(_, n)| n.clone()).collect();
    svg.raw(r#"<g id="legend">"#);
    y = legend_grid(svg, y, &labels, |svg, i, x, yy| {
        let c = colour_of(colours, &labels[i]).to_string();
        svg.rect(
            x,
            yy,
            14.0,
            12.0,
            &format!(r##"fill="{c}" stroke="#ffffff" stroke-width="0.5""##),
        );
    });
    svg.raw("</g>");
    y += 10.0;
    svg.text(16.0, y + 10.0, Font::new(11.0).bold(), "roles:");
    let mut x = 62.0;
    for role in ROLES {
        role_swatch(svg, x, y, role, "#5b7fa8");
        svg.text(x + 26.0, y + 10.0, Font::new(11.0), role_label(role));
        x += 26.0 + text_width(role_label(role), 11.0, false) + 16.0;
    }
    svg.line(
        x + 4.0,
        y,
        x + 4.0,
        y + 12.0,
        r##"stroke="#000000" stroke-opacity="0.6" stroke-dasharray="2 2""##,
    );
    svg.text(x + 10.0, y + 10.0, Font::new(11.0), "in-place hand-over");
    y += 20.0;
    phase_key(svg, plan, 16.0, y);
    y += 26.0;
    y
}

/// The stacked view: bytes live per step by role ([`ROLES`]: inputs, activations,
/// recomputed activations, activation gradients, workspace) as an area chart, with the same
/// phases, lines and peak as [`svg`]. Its top edge is the live total, whose maximum is the
/// plan's lower bound.
pub fn stacked_svg(plan: &StaticPlan, budget: Option<u64>) -> String {
    let live = live_memory(plan);
    let ts = &plan.tensors;
    let root = roots(ts);
    let buffer_bytes = buffer_bytes(plan);
    let ps = live.peak_step as usize;
    let at = live.by_role.get(ps).copied().unwrap_or([0; 5]);
    let mut rows = vec![Row::Head(format!(
        "peak {} at step {} ({}):",
        format_bytes(live.peak_bytes),
        live.peak_step,
        step_text(plan, live.peak_step),
    ))];
    for (k, role) in ROLES.iter().enumerate().rev() {
        if at[k] == 0 {
            continue;
        }
        let biggest = live
            .at_peak
            .iter()
            .filter(|&&id| ts[id as usize].role == *role)
            .take(3)
            .map(|&id| {
                format!(
                    "{} {}",
                    ts[id as usize].name,
                    format_bytes(buffer_bytes[&root[id as usize]])
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let share = 100.0 * at[k] as f64 / live.peak_bytes.max(1) as f64;
        rows.push(Row::Item {
            marker: None,
            swatch: ROLE_COLOURS[k].to_string(),
            name: format!("{} ({share:.0} %)", role_label(*role)),
            bytes: format_bytes(at[k]),
            note: biggest,
        });
    }
    let f = Frame::new(plan, &live, budget, rows.len());
    let mut svg = Svg::new();
    f.header(&mut svg, "live bytes by role");
    f.phases(&mut svg);
    f.axes(&mut svg, "live bytes");

    // Areas, bottom to top, as step functions: a step's bytes are live for its whole column.
    let n = f.steps;
    let mut below = vec![0u64; n];
    svg.raw(r#"<g id="areas">"#);
    for (k, role) in ROLES.iter().enumerate() {
        let above: Vec<u64> = (0..n)
            .map(|s| below[s] + live.by_role.get(s).map_or(0, |r| r[k]))
            .collect();
        if above != below {
            let mut d = f.step_path(&above);
            for (s, &b) in below.iter().enumerate().rev() {
                let y = f.y(b as f64);
                let _ = write!(
                    d,
                    "L{:.2} {y:.2} L{:.2} {y:.2} ",
                    f.x(s as f64 + 1.0),
                    f.x(s as f64)
                );
            }
            d.push('Z');
            let role_max = (0..n)
                .map(|s| live.by_role.get(s).map_or(0, |r| r[k]))
                .max()
                .unwrap_or(0);
            svg.raw(&format!(
                r#"<path class="area" d="{d}" fill="{}" fill-opacity="0.88"><title>{}</title></path>"#,
                ROLE_COLOURS[k],
                esc(&format!(
                    "{}: up to {}; {} at the peak step {}",
                    role_label(*role),
                    format_bytes(role_max),
                    format_bytes(at[k]),
                    live.peak_step
                ))
            ));
        }
        below = above;
    }
    // The live total's outline.
    let d = f.step_path(&live.total);
    svg.raw(&format!(
        r##"<path d="{d}" fill="none" stroke="#222222" stroke-width="1"/>"##
    ));
    svg.raw("</g>");
    f.lines(&mut svg);
    f.peak(&mut svg, &rows);

    let mut y = f.bottom_of_axes() + 8.0;
    svg.text(16.0, y + 10.0, Font::new(11.0).bold(), "roles:");
    let mut x = 62.0;
    for (k, role) in ROLES.iter().enumerate() {
        svg.rect(x, y, 22.0, 12.0, &format!(r#"fill="{}""#, ROLE_COLOURS[k]));
        svg.text(x + 26.0, y + 10.0, Font::new(11.0), role_label(*role));
        x += 26.0 + text_width(role_label(*role), 11.0, false) + 16.0;
    }
    y += 20.0;
    phase_key(&mut svg, plan, 16.0, y);
    y += 26.0;
    svg.finish(
        WIDTH,
        y,
        &format!("{}: live bytes by role over one training step", plan.model),
    )
}
