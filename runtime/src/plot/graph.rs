//! The model graph (Keras's `plot_model`, for a plan): one box per layer with its kind,
//! output shape, dtype, parameters and the bytes it keeps for the backward pass; an edge per
//! input, skip edges (residual shortcuts, the VAE's branches) drawn around the layers they
//! skip; checkpoint segments shaded. Laid out in pure Rust ([`svg`], a small Sugiyama
//! layout) and also written as Graphviz DOT ([`dot`]) for people who prefer `dot -Tpdf`.
//!
//! The layout: longest-path layering (an input sits just above its first reader, not at the
//! top of the picture), virtual nodes on edges that span several ranks, barycentre ordering
//! sweeps that keep the ordering with the fewest crossings, and x positions averaged from
//! neighbours under a minimum separation.

use std::collections::HashMap;
use std::fmt::Write as _;

use memwise_plan::{LayerKind, LayerMemory, ModelSpec, StaticPlan};

use super::{esc, format_bytes, layer_colour, text_width, Anchor, Font, Svg, NO_LAYER_COLOUR};

/// What a box stands for.
#[derive(Clone, Debug, PartialEq)]
enum What {
    Layer(usize),
    Loss(usize),
}

/// One box of the picture.
struct Node {
    id: String,
    what: What,
    title: String,
    lines: Vec<String>,
    colour: String,
    checkpoint: Option<u32>,
    hover: String,
    /// Some reader of this layer is not drawn (a head picture).
    continues: bool,
}

/// The graph to draw: boxes and one edge per input (`from`, `to` index boxes).
struct Model {
    name: String,
    subtitle: String,
    nodes: Vec<Node>,
    edges: Vec<(usize, usize)>,
}

fn thousands(n: u64) -> String {
    // Groups of three from the right: "25,557,032".
    let digits: Vec<char> = n.to_string().chars().collect();
    let groups: Vec<String> = digits
        .rchunks(3)
        .rev()
        .map(|g| g.iter().collect())
        .collect();
    groups.join(",")
}

fn shape_text(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// The activation a layer applies, if it names one.
fn activation(kind: &LayerKind) -> Option<&'static str> {
    let a = match kind {
        LayerKind::Dense { activation, .. }
        | LayerKind::Conv2d { activation, .. }
        | LayerKind::DepthwiseConv2d { activation, .. }
        | LayerKind::SeparableConv2d { activation, .. }
        | LayerKind::Conv2dTranspose { activation, .. }
        | LayerKind::Add { activation }
        | LayerKind::Activation(activation) => *activation,
        _ => return None,
    };
    (a.name() != "linear").then_some(a.name())
}

/// The edges of `spec` as `(reader, read)` layer indices plus each loss term's inputs, as the
/// planner resolves them: a layer with no named inputs reads the layer above it; a loss term
/// with none reads the last layer and the one input nothing else reads.
fn spec_edges(spec: &ModelSpec) -> (Vec<(usize, usize)>, Vec<Vec<usize>>) {
    let index: HashMap<&str, usize> = spec
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| (l.name.as_str(), i))
        .collect();
    let mut edges = Vec::new();
    for (i, l) in spec.layers.iter().enumerate() {
        if matches!(l.kind, LayerKind::Input { .. }) {
            continue;
        }
        if l.inputs.is_empty() {
            if i > 0 {
                edges.push((i - 1, i));
            }
        } else {
            for src in &l.inputs {
                if let Some(&j) = index.get(src.as_str()) {
                    edges.push((j, i));
                }
            }
        }
    }
    let is_input = |j: usize| matches!(spec.layers[j].kind, LayerKind::Input { .. });
    let last = (0..spec.layers.len()).rev().find(|&j| !is_input(j));
    let unread: Vec<usize> = (0..spec.layers.len())
        .filter(|&j| is_input(j) && !edges.iter().any(|e| e.0 == j))
        .collect();
    let losses = spec
        .loss
        .iter()
        .map(|t| {
            if t.inputs.is_empty() {
                let mut v: Vec<usize> = last.into_iter().collect();
                if unread.len() == 1 {
                    v.push(unread[0]);
                }
                v
            } else {
                t.inputs
                    .iter()
                    .filter_map(|n| index.get(n.as_str()).copied())
                    .collect()
            }
        })
        .collect();
    (edges, losses)
}

impl Model {
    /// The first `limit` layers of `spec` (all when `None`); loss terms only when every
    /// layer is drawn.
    fn new(spec: &ModelSpec, plan: &StaticPlan, limit: Option<usize>) -> Model {
        let n = limit.unwrap_or(spec.layers.len()).min(spec.layers.len());
        let rows: HashMap<&str, (usize, &LayerMemory)> = plan
            .memory
            .layers
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_ref(), (i, r)))
            .collect();
        let (all_edges, losses) = spec_edges(spec);
        let mut nodes = Vec::new();
        for (i, l) in spec.layers.iter().take(n).enumerate() {
            let row = rows.get(l.name.as_str());
            let kind = row.map_or(l.kind.name(), |(_, r)| r.kind.as_ref());
            let mut kind_line = kind.to_string();
            if let Some(a) = activation(&l.kind) {
                if kind != "activation" {
                    kind_line.push_str(" · ");
                }
                kind_line.push_str(a);
                if kind == "activation" {
                    kind_line = format!("activation · {a}");
                }
            }
            let mut shape_line = match row {
                Some((_, r)) => format!("{} {}", shape_text(&r.output_shape), r.dtype.name()),
                None => "(not planned)".to_string(),
            };
            if let (LayerKind::Input { dtype, .. }, Some((_, r))) = (&l.kind, row) {
                if *dtype != r.dtype {
                    shape_line = format!(
                        "{} {} → {}",
                        shape_text(&r.output_shape),
                        dtype.name(),
                        r.dtype.name()
                    );
                }
            }
            let mut facts = Vec::new();
            let mut hover = format!("{}\nkind {kind_line}\noutput {shape_line}", l.name);
            if let Some((_, r)) = row {
                if r.params > 0 {
                    facts.push(format!("{} params", thousands(r.params)));
                }
                if r.saved_bytes > 0 {
                    facts.push(format!("keeps {}", format_bytes(r.saved_bytes)));
                }
                if r.recomputed_bytes > 0 {
                    facts.push(format!("recomputes {}", format_bytes(r.recomputed_bytes)));
                }
                if r.in_place {
                    facts.push("in place".to_string());
                }
                let _ = write!(
                    hover,
                    "\nparams {} ({} persistent)\nkept for backward {}\nrecomputed {}\ncheckpointed {}\nin place {}\nforward {} FLOP",
                    thousands(r.params),
                    format_bytes(r.persistent_bytes),
                    format_bytes(r.saved_bytes),
                    format_bytes(r.recomputed_bytes),
                    r.checkpointed,
                    r.in_place,
                    thousands(r.forward_flops)
                );
            }
            if facts.is_empty() {
                facts.push("no params".to_string());
            }
            nodes.push(Node {
                id: l.name.clone(),
                what: What::Layer(i),
                title: l.name.clone(),
                lines: vec![kind_line, shape_line, facts.join(" · ")],
                colour: row.map_or(NO_LAYER_COLOUR.to_string(), |(k, _)| layer_colour(*k)),
                checkpoint: l.checkpoint,
                hover,
                continues: all_edges.iter().any(|&(a, b)| a == i && b >= n),
            });
        }
        let mut edges: Vec<(usize, usize)> = all_edges
            .into_iter()
            .filter(|&(a, b)| a < n && b < n)
            .collect();
        if n == spec.layers.len() {
            for (k, (term, ins)) in spec.loss.iter().zip(&losses).enumerate() {
                let me = nodes.len();
                let mut detail = format!("reduction {}", term.reduction.name());
                if term.weight != 1.0 {
                    let _ = write!(detail, " · weight {}", term.weight);
                }
                nodes.push(Node {
                    id: format!("loss:{k}"),
                    what: What::Loss(k),
                    title: format!("loss {k}"),
                    lines: vec![term.kind.name().to_string(), detail],
                    colour: NO_LAYER_COLOUR.to_string(),
                    checkpoint: None,
                    hover: format!("loss term {k}: {}", term.kind.name()),
                    continues: false,
                });
                for &j in ins {
                    edges.push((j, me));
                }
            }
        } else {
            for node in nodes.iter_mut() {
                // A layer a loss term reads continues too (to the loss, not drawn).
                if let What::Layer(i) = node.what {
                    node.continues |= losses.iter().any(|ins| ins.contains(&i));
                }
            }
        }
        let trainable = plan.trainable_count;
        let mut subtitle = format!(
            "batch {} · {} params ({} trainable) · boxes: layer, kind, output shape and dtype, \
             params and bytes kept for backward",
            spec.batch,
            thousands(plan.params_count),
            thousands(trainable)
        );
        if n < spec.layers.len() {
            let _ = write!(subtitle, " · first {n} of {} layers", spec.layers.len());
        }
        Model {
            name: spec.name.clone(),
            subtitle,
            nodes,
            edges,
        }
    }
}

/// The model graph of `spec` as planned in `plan`, as SVG.
pub fn svg(spec: &ModelSpec, plan: &StaticPlan) -> String {
    render(&Model::new(spec, plan, None))
}

/// The first `layers` layers of `spec` (a deep model's head: its stem and first blocks);
/// layers whose readers are not drawn get a dashed stub.
pub fn svg_head(spec: &ModelSpec, plan: &StaticPlan, layers: usize) -> String {
    render(&Model::new(spec, plan, Some(layers)))
}

/// DOT quoting: `"`, `\` and line breaks.
fn dq(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The same graph as Graphviz DOT: one node per layer (and per loss term, id `loss:K`), one
/// edge per input, a cluster per checkpoint segment.
pub fn dot(spec: &ModelSpec, plan: &StaticPlan) -> String {
    let m = Model::new(spec, plan, None);
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", dq(&m.name));
    let _ = writeln!(
        out,
        "  graph [rankdir=TB, fontname=\"DejaVu Sans\", labelloc=t, label={}];",
        dq(&format!("{}\n{}", m.name, m.subtitle))
    );
    out.push_str(
        "  node [shape=box, style=\"rounded,filled\", fillcolor=\"#f8f9fb\", \
         fontname=\"DejaVu Sans\", fontsize=11, penwidth=1.2];\n",
    );
    out.push_str("  edge [color=\"#555555\", arrowsize=0.7];\n");
    let mut segments: Vec<u32> = m.nodes.iter().filter_map(|n| n.checkpoint).collect();
    segments.sort_unstable();
    segments.dedup();
    let node_line = |n: &Node| {
        let label = std::iter::once(n.title.as_str())
            .chain(n.lines.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("\n");
        let extra = match n.what {
            What::Loss(_) => ", shape=note, fillcolor=\"#f6eef6\"",
            What::Layer(_) => "",
        };
        format!(
            "{} [label={}, color={}, tooltip={}{extra}];\n",
            dq(&n.id),
            dq(&label),
            dq(&n.colour),
            dq(&n.hover)
        )
    };
    for s in &segments {
        let _ = writeln!(
            out,
            "  subgraph {} {{",
            dq(&format!("cluster_checkpoint_{s}"))
        );
        let _ = writeln!(
            out,
            "    label={}; style=\"rounded,filled,dashed\"; fillcolor=\"#fff3d6\"; color=\"#e0a030\";",
            dq(&format!("checkpoint segment {s}"))
        );
        for n in m.nodes.iter().filter(|n| n.checkpoint == Some(*s)) {
            out.push_str("    ");
            out.push_str(&node_line(n));
        }
        out.push_str("  }\n");
    }
    for n in m.nodes.iter().filter(|n| n.checkpoint.is_none()) {
        out.push_str("  ");
        out.push_str(&node_line(n));
    }
    for &(a, b) in &m.edges {
        let _ = writeln!(out, "  {} -> {};", dq(&m.nodes[a].id), dq(&m.nodes[b].id));
    }
    out.push_str("}\n");
    out
}

// ---- layout ----

const NODE_H: f64 = 66.0;
const RANK_GAP: f64 = 42.0;
const NODE_GAP: f64 = 26.0;
const VIRTUAL_W: f64 = 12.0;
const MARGIN: f64 = 24.0;
const TOP: f64 = 78.0;

/// A laid-out graph: `rank`/`x` per vertex (boxes first, then virtual vertices), and the
/// vertex path of every edge.
struct Layout {
    rank: Vec<usize>,
    x: Vec<f64>,
    w: Vec<f64>,
    paths: Vec<Vec<usize>>,
    ranks: usize,
}

fn node_width(n: &Node) -> f64 {
    let t = text_width(&n.title, 12.0, true);
    let l = n
        .lines
        .iter()
        .map(|s| text_width(s, 11.0, false))
        .fold(0.0, f64::max);
    t.max(l) + 28.0
}

/// The layered graph a layout places: real vertices (the model's boxes) and virtual ones on
/// edges spanning several ranks.
struct Layered {
    /// Vertex widths (virtual vertices are [`VIRTUAL_W`] wide).
    w: Vec<f64>,
    /// Vertex ranks.
    vrank: Vec<usize>,
    /// Per model edge, its vertices from source to target.
    paths: Vec<Vec<usize>>,
    ranks: usize,
    up: Vec<Vec<usize>>,
    down: Vec<Vec<usize>>,
}

/// Longest-path ranks (boxes are in declaration order, which is topological: a layer reads
/// only fields above it; loss terms come last), sources moved down to just above their
/// first reader, and virtual vertices on long edges.
fn layered(m: &Model) -> Layered {
    let nn = m.nodes.len();
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); nn];
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); nn];
    for &(a, b) in &m.edges {
        preds[b].push(a);
        succs[a].push(b);
    }
    let mut rank = vec![0usize; nn];
    for v in 0..nn {
        rank[v] = preds[v].iter().map(|&p| rank[p] + 1).max().unwrap_or(0);
    }
    for v in 0..nn {
        if preds[v].is_empty() {
            if let Some(r) = succs[v].iter().map(|&s| rank[s]).min() {
                rank[v] = r.saturating_sub(1);
            }
        }
    }
    let mut w: Vec<f64> = m.nodes.iter().map(node_width).collect();
    let mut vrank = rank.clone();
    let mut paths = Vec::with_capacity(m.edges.len());
    for &(a, b) in &m.edges {
        let mut path = vec![a];
        for r in rank[a] + 1..rank[b] {
            vrank.push(r);
            w.push(VIRTUAL_W);
            path.push(vrank.len() - 1);
        }
        path.push(b);
        paths.push(path);
    }
    let nv = vrank.len();
    let ranks = vrank.iter().copied().max().map_or(0, |r| r + 1);
    let mut up: Vec<Vec<usize>> = vec![Vec::new(); nv];
    let mut down: Vec<Vec<usize>> = vec![Vec::new(); nv];
    for p in &paths {
        for s in p.windows(2) {
            down[s[0]].push(s[1]);
            up[s[1]].push(s[0]);
        }
    }
    Layered {
        w,
        vrank,
        paths,
        ranks,
        up,
        down,
    }
}

/// Edge crossings between consecutive ranks of `order`.
fn crossings(g: &Layered, order: &[Vec<usize>]) -> usize {
    let mut pos = vec![0usize; g.vrank.len()];
    for o in order {
        for (i, &v) in o.iter().enumerate() {
            pos[v] = i;
        }
    }
    let mut total = 0;
    for o in order.iter() {
        let segs: Vec<(usize, usize)> = o
            .iter()
            .flat_map(|&a| g.down[a].iter().map(move |&b| (a, b)))
            .map(|(a, b)| (pos[a], pos[b]))
            .collect();
        for i in 0..segs.len() {
            for j in i + 1..segs.len() {
                let (a, b) = (segs[i], segs[j]);
                if (a.0 < b.0 && a.1 > b.1) || (a.0 > b.0 && a.1 < b.1) {
                    total += 1;
                }
            }
        }
    }
    total
}

/// Orders each rank: declaration order first (virtual vertices next to their edge's
/// source), then barycentre sweeps down and up, keeping the order with fewest crossings.
fn order_ranks(g: &Layered, nn: usize) -> Vec<Vec<usize>> {
    let nv = g.vrank.len();
    let mut key0: Vec<f64> = (0..nv)
        .map(|v| if v < nn { v as f64 } else { f64::NAN })
        .collect();
    for p in &g.paths {
        for &v in &p[1..p.len() - 1] {
            key0[v] = p[0] as f64 + 0.5;
        }
    }
    let mut order: Vec<Vec<usize>> = vec![Vec::new(); g.ranks];
    for v in 0..nv {
        order[g.vrank[v]].push(v);
    }
    for o in &mut order {
        o.sort_by(|&a, &b| key0[a].total_cmp(&key0[b]));
    }
    let mut best = order.clone();
    let mut best_c = crossings(g, &order);
    for iter in 0..16 {
        let mut pos = vec![0f64; nv];
        for o in &order {
            for (i, &v) in o.iter().enumerate() {
                pos[v] = i as f64;
            }
        }
        let downward = iter % 2 == 0;
        let rs: Vec<usize> = if downward {
            (1..g.ranks).collect()
        } else {
            (0..g.ranks.saturating_sub(1)).rev().collect()
        };
        for r in rs {
            let nb = if downward { &g.up } else { &g.down };
            let mut keyed: Vec<(f64, usize)> = order[r]
                .iter()
                .map(|&v| {
                    let k = if nb[v].is_empty() {
                        pos[v]
                    } else {
                        nb[v].iter().map(|&u| pos[u]).sum::<f64>() / nb[v].len() as f64
                    };
                    (k, v)
                })
                .collect();
            // Stable: ties keep the current order.
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
            order[r] = keyed.into_iter().map(|(_, v)| v).collect();
            for (i, &v) in order[r].iter().enumerate() {
                pos[v] = i as f64;
            }
        }
        let c = crossings(g, &order);
        if c < best_c {
            best_c = c;
            best = order.clone();
        }
    }
    best
}

/// Horizontal placement: pack each rank, then pull every vertex towards its neighbours'
/// mean under the separation constraints, sweeping down and up.
fn place_x(g: &Layered, order: &[Vec<usize>]) -> Vec<f64> {
    let w = &g.w;
    let mut x = vec![0f64; g.vrank.len()];
    for o in order {
        let mut cur = 0.0;
        for &v in o {
            x[v] = cur + w[v] / 2.0;
            cur += w[v] + NODE_GAP;
        }
        let shift = cur / 2.0;
        for &v in o {
            x[v] -= shift;
        }
    }
    let sep = |a: usize, b: usize| (w[a] + w[b]) / 2.0 + NODE_GAP;
    for iter in 0..24 {
        let downward = iter % 2 == 0;
        let rs: Vec<usize> = if downward {
            (0..g.ranks).collect()
        } else {
            (0..g.ranks).rev().collect()
        };
        for r in rs {
            let o = &order[r];
            if o.is_empty() {
                continue;
            }
            let desired: Vec<f64> = o
                .iter()
                .map(|&v| {
                    // Both neighbours count, the sweep's side twice: chains straighten
                    // while a box still sits between what it reads and what reads it.
                    let (a, b) = if downward {
                        (&g.up[v], &g.down[v])
                    } else {
                        (&g.down[v], &g.up[v])
                    };
                    let (mut s, mut k) = (0.0, 0.0);
                    for &u in a.iter() {
                        s += 2.0 * x[u];
                        k += 2.0;
                    }
                    for &u in b.iter() {
                        s += x[u];
                        k += 1.0;
                    }
                    if k > 0.0 {
                        s / k
                    } else {
                        x[v]
                    }
                })
                .collect();
            // Left-packed and right-packed feasible placements; their mean is feasible too
            // (the constraints are convex) and treats both sides alike.
            let mut l = desired.clone();
            for i in 1..o.len() {
                l[i] = l[i].max(l[i - 1] + sep(o[i - 1], o[i]));
            }
            let mut rr = desired.clone();
            for i in (0..o.len().saturating_sub(1)).rev() {
                rr[i] = rr[i].min(rr[i + 1] - sep(o[i], o[i + 1]));
            }
            for (i, &v) in o.iter().enumerate() {
                x[v] = (l[i] + rr[i]) / 2.0;
            }
        }
    }
    x
}

/// Straightens long edges: all virtual vertices of an edge on one vertical, where every
/// rank it crosses leaves room for it, so a skip reads as one line beside the boxes.
fn straighten(g: &Layered, order: &[Vec<usize>], x: &mut [f64]) {
    let w = &g.w;
    let sep = |a: usize, b: usize| (w[a] + w[b]) / 2.0 + NODE_GAP;
    let mut index_in_rank = vec![0usize; g.vrank.len()];
    for o in order {
        for (i, &v) in o.iter().enumerate() {
            index_in_rank[v] = i;
        }
    }
    for p in &g.paths {
        let inner = &p[1..p.len() - 1];
        if inner.is_empty() {
            continue;
        }
        let (mut lo, mut hi) = (f64::NEG_INFINITY, f64::INFINITY);
        for &v in inner {
            let o = &order[g.vrank[v]];
            let i = index_in_rank[v];
            if i > 0 {
                lo = lo.max(x[o[i - 1]] + sep(o[i - 1], v));
            }
            if i + 1 < o.len() {
                hi = hi.min(x[o[i + 1]] - sep(v, o[i + 1]));
            }
        }
        if lo <= hi {
            let mean = inner.iter().map(|&v| x[v]).sum::<f64>() / inner.len() as f64;
            for &v in inner {
                x[v] = mean.clamp(lo, hi);
            }
        }
    }
}

/// A layered layout of the model (Sugiyama's steps: ranks, order, placement).
fn layout(m: &Model) -> Layout {
    let g = layered(m);
    let order = order_ranks(&g, m.nodes.len());
    let mut x = place_x(&g, &order);
    straighten(&g, &order, &mut x);
    let min_x = (0..x.len())
        .map(|v| x[v] - g.w[v] / 2.0)
        .fold(f64::INFINITY, f64::min);
    for xv in &mut x {
        *xv += MARGIN - min_x;
    }
    Layout {
        rank: g.vrank,
        x,
        w: g.w,
        paths: g.paths,
        ranks: g.ranks,
    }
}

fn rank_top(r: usize) -> f64 {
    TOP + r as f64 * (NODE_H + RANK_GAP)
}

fn render(m: &Model) -> String {
    let lay = layout(m);
    let mut width = (0..lay.x.len())
        .map(|v| lay.x[v] + lay.w[v] / 2.0)
        .fold(0.0, f64::max)
        + MARGIN;
    let title = format!("{} · model graph", m.name);
    width = width
        .max(text_width(&title, 17.0, true) + 2.0 * MARGIN)
        .max(text_width(&m.subtitle, 12.0, false) + 2.0 * MARGIN);
    let height = rank_top(lay.ranks) - RANK_GAP + 40.0;
    let mut svg = Svg::new();
    svg.def(
        r##"<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0 0 L10 5 L0 10 Z" fill="#555555"/></marker><marker id="arrow-skip" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0 0 L10 5 L0 10 Z" fill="#d95f02"/></marker>"##,
    );
    draw_header(&mut svg, m, &title);
    draw_segments(&mut svg, m, &lay);
    let (in_port, out_port) = ports(m, &lay);
    draw_edges(&mut svg, m, &lay, &in_port, &out_port);
    draw_nodes(&mut svg, m, &lay);
    svg.finish(width, height, &title)
}

/// The title, the subtitle and the key.
fn draw_header(svg: &mut Svg, m: &Model, title: &str) {
    svg.text(MARGIN, 28.0, Font::new(17.0).bold(), title);
    svg.text(MARGIN, 48.0, Font::new(12.0).fill("#444"), &m.subtitle);
    let mut key_x = MARGIN;
    let key_y = 60.0;
    svg.line(
        key_x,
        key_y,
        key_x + 26.0,
        key_y,
        r##"stroke="#d95f02" stroke-width="1.8""##,
    );
    key_x += 32.0;
    let k1 = "edge that skips layers (residual, branch)";
    svg.text(key_x, key_y + 4.0, Font::new(11.0), k1);
    key_x += text_width(k1, 11.0, false) + 20.0;
    if m.nodes.iter().any(|n| n.checkpoint.is_some()) {
        svg.rect(
            key_x,
            key_y - 6.0,
            26.0,
            12.0,
            r##"rx="4" fill="#fff3d6" stroke="#e0a030" stroke-dasharray="4 3""##,
        );
        svg.text(
            key_x + 32.0,
            key_y + 4.0,
            Font::new(11.0),
            "checkpoint segment: dropped after forward, recomputed before its backward",
        );
    }
}

/// Checkpoint segments: one rounded background per segment, behind everything.
fn draw_segments(svg: &mut Svg, m: &Model, lay: &Layout) {
    let nn = m.nodes.len();
    let top_of = |v: usize| rank_top(lay.rank[v]);
    let mut segments: Vec<u32> = m.nodes.iter().filter_map(|n| n.checkpoint).collect();
    segments.sort_unstable();
    segments.dedup();
    for s in segments {
        let members: Vec<usize> = (0..nn)
            .filter(|&v| m.nodes[v].checkpoint == Some(s))
            .collect();
        let x0 = members
            .iter()
            .map(|&v| lay.x[v] - lay.w[v] / 2.0)
            .fold(f64::INFINITY, f64::min);
        let x1 = members
            .iter()
            .map(|&v| lay.x[v] + lay.w[v] / 2.0)
            .fold(0.0, f64::max);
        let y0 = members
            .iter()
            .map(|&v| top_of(v))
            .fold(f64::INFINITY, f64::min);
        let y1 = members
            .iter()
            .map(|&v| top_of(v) + NODE_H)
            .fold(0.0, f64::max);
        svg.raw(&format!(r#"<g class="segment" data-segment="{s}">"#));
        svg.rect(
            x0 - 12.0,
            y0 - 22.0,
            x1 - x0 + 24.0,
            y1 - y0 + 32.0,
            r##"rx="12" fill="#fff3d6" stroke="#e0a030" stroke-width="1.2" stroke-dasharray="6 4""##,
        );
        // Top right: edges into a segment mostly arrive from the top left.
        svg.text(
            x1 + 4.0,
            y0 - 8.0,
            Font::new(11.0).bold().fill("#a06000").anchor(Anchor::End),
            &format!("checkpoint segment {s}"),
        );
        svg.raw("</g>");
    }
}

/// Where each edge meets its boxes, as offsets from the box's centre: `(in, out)` by
/// `(box, edge)`.
type Ports = HashMap<(usize, usize), f64>;

/// A box's incoming edges spread over its top edge in the order of where they come from,
/// its outgoing ones over its bottom edge in the order of where they go.
fn ports(m: &Model, lay: &Layout) -> (Ports, Ports) {
    let nn = m.nodes.len();
    let mut in_port: HashMap<(usize, usize), f64> = HashMap::new();
    let mut out_port: HashMap<(usize, usize), f64> = HashMap::new();
    for v in 0..nn {
        let spread = |list: &mut Vec<(f64, usize)>, w: f64| -> Vec<(usize, f64)> {
            list.sort_by(|a, b| a.0.total_cmp(&b.0));
            let k = list.len();
            let span = (18.0 * (k as f64 - 1.0)).min(w - 30.0).max(0.0);
            list.iter()
                .enumerate()
                .map(|(i, &(_, e))| {
                    let off = if k > 1 {
                        -span / 2.0 + span * i as f64 / (k - 1) as f64
                    } else {
                        0.0
                    };
                    (e, off)
                })
                .collect()
        };
        let mut ins: Vec<(f64, usize)> = Vec::new();
        let mut outs: Vec<(f64, usize)> = Vec::new();
        for (e, p) in lay.paths.iter().enumerate() {
            if p[p.len() - 1] == v {
                ins.push((lay.x[p[p.len() - 2]], e));
            }
            if p[0] == v {
                outs.push((lay.x[p[1]], e));
            }
        }
        for (e, off) in spread(&mut ins, lay.w[v]) {
            in_port.insert((v, e), off);
        }
        for (e, off) in spread(&mut outs, lay.w[v]) {
            out_port.insert((v, e), off);
        }
    }
    (in_port, out_port)
}

fn draw_edges(svg: &mut Svg, m: &Model, lay: &Layout, in_port: &Ports, out_port: &Ports) {
    let top_of = |v: usize| rank_top(lay.rank[v]);
    svg.raw(r#"<g id="edges">"#);
    for (e, p) in lay.paths.iter().enumerate() {
        let (a, b) = (p[0], p[p.len() - 1]);
        let mut pts: Vec<(f64, f64)> = Vec::new();
        pts.push((lay.x[a] + out_port[&(a, e)], top_of(a) + NODE_H));
        for &v in &p[1..p.len() - 1] {
            pts.push((lay.x[v], top_of(v)));
            pts.push((lay.x[v], top_of(v) + NODE_H));
        }
        pts.push((lay.x[b] + in_port[&(b, e)], top_of(b) - 1.0));
        let mut d = format!("M{:.2} {:.2}", pts[0].0, pts[0].1);
        for (i, pair) in pts.windows(2).enumerate() {
            let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
            if i % 2 == 0 {
                // Between ranks: a vertical-tangent curve.
                let my = (y0 + y1) / 2.0;
                let _ = write!(d, " C{x0:.2} {my:.2} {x1:.2} {my:.2} {x1:.2} {y1:.2}");
            } else {
                // Through a virtual vertex: straight down the gap beside the boxes.
                let _ = write!(d, " L{x1:.2} {y1:.2}");
            }
        }
        let skip = p.len() > 2;
        let to_loss = matches!(m.nodes[b].what, What::Loss(_));
        let style = if skip {
            r##"stroke="#d95f02" stroke-width="1.8" marker-end="url(#arrow-skip)""##
        } else {
            r##"stroke="#555555" stroke-width="1.3" marker-end="url(#arrow)""##
        };
        let dash = if to_loss {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        svg.raw(&format!(
            r#"<path class="edge" d="{d}" fill="none" {style}{dash}><title>{}</title></path>"#,
            esc(&format!("{} → {}", m.nodes[a].id, m.nodes[b].id))
        ));
    }
    svg.raw("</g>");
}

fn draw_nodes(svg: &mut Svg, m: &Model, lay: &Layout) {
    let top_of = |v: usize| rank_top(lay.rank[v]);
    svg.raw(r#"<g id="nodes">"#);
    for (v, n) in m.nodes.iter().enumerate() {
        let (x, y, w) = (lay.x[v] - lay.w[v] / 2.0, top_of(v), lay.w[v]);
        let (fill, stroke, dash) = match n.what {
            What::Loss(_) => ("#f6eef6", "#8a5a8a", r#" stroke-dasharray="4 2""#),
            What::Layer(_) if n.lines[0].starts_with("input") => ("#eef3f8", "#5a6e85", ""),
            What::Layer(_) => ("#fbfbfc", "#5c5c5c", ""),
        };
        svg.raw(&format!(
            r#"<g class="node" data-layer="{}"><title>{}</title>"#,
            esc(&n.id),
            esc(&n.hover)
        ));
        svg.rect(
            x,
            y,
            w,
            NODE_H,
            &format!(r#"rx="6" fill="{fill}" stroke="{stroke}" stroke-width="1.2"{dash}"#),
        );
        // The layer's colour, as in the timeline's bands.
        svg.rect(
            x,
            y + 6.0,
            6.0,
            NODE_H - 12.0,
            &format!(r#"fill="{}""#, n.colour),
        );
        let cx = x + w / 2.0 + 3.0;
        svg.text(
            cx,
            y + 17.0,
            Font::new(12.0).bold().anchor(Anchor::Middle),
            &n.title,
        );
        for (i, l) in n.lines.iter().enumerate() {
            let f =
                Font::new(11.0)
                    .anchor(Anchor::Middle)
                    .fill(if i == 0 { "#333" } else { "#555" });
            svg.text(cx, y + 32.0 + 14.0 * i as f64, f, l);
        }
        if n.continues {
            let bx = x + w / 2.0;
            svg.line(
                bx,
                y + NODE_H,
                bx,
                y + NODE_H + 26.0,
                r##"stroke="#999999" stroke-width="1.3" stroke-dasharray="3 3""##,
            );
            svg.text(
                bx + 6.0,
                y + NODE_H + 22.0,
                Font::new(11.0).fill("#888"),
                "… (not drawn)",
            );
        }
        svg.raw("</g>");
    }
    svg.raw("</g>");
}
