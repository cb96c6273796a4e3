//! The plan pictures: every SVG parses (usvg, as resvg and browsers would read it), names
//! what it must name, and the timeline labels the planner's own peak; the DOT graph has one
//! node per layer and one edge per input.

use memwise_plan::{zoo, LayerKind, ModelSpec, StaticPlan};
use memwise_runtime::plot::{self, format_bytes, graph, timeline};
use resvg::usvg;

fn planned(spec: &ModelSpec) -> StaticPlan {
    memwise_plan::plan(spec).expect("zoo models plan")
}

/// A GPT-2 stack with every block in its own checkpoint segment.
fn gpt2_checkpointed() -> ModelSpec {
    let mut spec = zoo::gpt2_stack(2, 2);
    zoo::checkpoint_blocks(&mut spec, |n: &str| {
        n.starts_with('h')
            .then(|| n.split('_').next().unwrap_or(n).to_string())
    });
    spec
}

fn parses(svg: &str) -> usvg::Tree {
    // Default options carry no fonts: this checks the document, not the text rendering.
    usvg::Tree::from_str(svg, &usvg::Options::default())
        .unwrap_or_else(|e| panic!("SVG does not parse: {e}\n{}", &svg[..svg.len().min(400)]))
}

/// The text content of every `<text>` element (unescaped enough for names and numbers).
fn texts(svg: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = svg;
    while let Some(i) = rest.find("<text") {
        rest = &rest[i..];
        let Some(open_end) = rest.find('>') else {
            break;
        };
        let Some(close) = rest.find("</text>") else {
            break;
        };
        out.push(
            rest[open_end + 1..close]
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&#39;", "'")
                .replace("&amp;", "&"),
        );
        rest = &rest[close..];
    }
    out
}

/// The value of attribute `name` on the element whose `id` is `id`.
fn attr_of(svg: &str, id: &str, name: &str) -> Option<String> {
    let at = svg.find(&format!(r#"id="{id}""#))?;
    let start = svg[..at].rfind('<')?;
    let end = at + svg[at..].find('>')?;
    let tag = &svg[start..end];
    let key = format!(r#"{name}=""#);
    let v = tag.find(&key)? + key.len();
    Some(tag[v..v + tag[v..].find('"')?].to_string())
}

fn models() -> Vec<(&'static str, ModelSpec)> {
    vec![
        ("mnist", zoo::mnist_mlp(128)),
        ("vae", zoo::conv_vae(128)),
        ("resnet50", zoo::resnet50(32)),
        ("gpt2_ckpt", gpt2_checkpointed()),
    ]
}

#[test]
fn timelines_parse_and_legend_names_every_layer_with_a_tensor() {
    for (name, spec) in models() {
        let plan = planned(&spec);
        for budget in [
            None,
            Some(plan.memory.total + plan.memory.total / 5),
            Some(1 << 40),
        ] {
            let svg = timeline::svg(&plan, budget);
            parses(&svg);
            let t = texts(&svg);
            for tensor in plan.tensors.iter() {
                assert!(
                    t.iter().any(|s| s == tensor.layer.as_ref()),
                    "{name}: legend lacks layer `{}`",
                    tensor.layer
                );
            }
            // Every band has hover text naming its tensor and lifetime.
            assert_eq!(
                svg.matches(r#"<g class="band""#).count(),
                plan.tensors.len(),
                "{name}: one band per tensor"
            );
            for tensor in plan.tensors.iter() {
                let hover = format!(
                    "<title>{}\nlayer {} ",
                    tensor.name.replace('&', "&amp;"),
                    tensor.layer
                );
                assert!(svg.contains(&hover), "{name}: no hover for {}", tensor.name);
                assert!(svg.contains(&format!("steps [{}, {}]", tensor.first, tensor.last)));
            }
            assert!(
                t.iter().any(|s| s.starts_with("arena")),
                "{name}: arena line"
            );
            if budget.is_some() {
                assert!(
                    t.iter().any(|s| s.starts_with("budget")),
                    "{name}: budget line"
                );
            }
            let stacked = timeline::stacked_svg(&plan, budget);
            parses(&stacked);
            assert!(texts(&stacked).iter().any(|s| s.starts_with("peak ")));
        }
    }
}

#[test]
fn labelled_peak_is_the_planners_lower_bound_at_its_peak_step() {
    for (name, spec) in [
        ("vae", zoo::conv_vae(128)),
        ("resnet50", zoo::resnet50(32)),
        ("gpt2_ckpt", gpt2_checkpointed()),
    ] {
        let plan = planned(&spec);
        let live = timeline::live_memory(&plan);
        assert_eq!(live.peak_bytes, plan.lower_bound_bytes, "{name}");
        assert_eq!(live.peak_step, plan.memory.peak_step, "{name}");
        assert_eq!(
            live.total.iter().copied().max(),
            Some(plan.lower_bound_bytes),
            "{name}"
        );
        // The stacked roles add up to the total at every step.
        for (s, roles) in live.by_role.iter().enumerate() {
            assert_eq!(roles.iter().sum::<u64>(), live.total[s], "{name} step {s}");
        }
        // And the breakdown at the peak is the memory report's.
        let r = &live.by_role[live.peak_step as usize];
        assert_eq!(r[0], plan.memory.inputs, "{name}: inputs at peak");
        assert_eq!(
            r[4], plan.memory.workspace_peak,
            "{name}: workspace at peak"
        );
        assert_eq!(r[1] + r[2] + r[3], plan.memory.activations_peak, "{name}");

        for svg in [
            timeline::svg(&plan, None),
            timeline::stacked_svg(&plan, None),
        ] {
            assert_eq!(
                attr_of(&svg, "peak-label", "data-peak-bytes").as_deref(),
                Some(plan.lower_bound_bytes.to_string().as_str()),
                "{name}"
            );
            assert_eq!(
                attr_of(&svg, "peak-label", "data-peak-step").as_deref(),
                Some(plan.memory.peak_step.to_string().as_str()),
                "{name}"
            );
            // What a reader sees says the same.
            let label = format!(
                "peak {} at step {} (",
                format_bytes(plan.lower_bound_bytes),
                plan.memory.peak_step
            );
            assert!(
                texts(&svg).iter().any(|s| s.starts_with(&label)),
                "{name}: no `{label}` label"
            );
        }
        // The biggest buffer alive at the peak is listed first in the callout.
        let svg = timeline::svg(&plan, None);
        let first = &plan.tensors[live.at_peak[0] as usize];
        assert!(
            texts(&svg).iter().any(|s| s == first.name.as_ref()),
            "{name}"
        );
    }
}

#[test]
fn vae_peak_lists_its_biggest_tensors() {
    let plan = planned(&zoo::conv_vae(128));
    let svg = timeline::svg(&plan, None);
    let t = texts(&svg);
    let label = t.iter().find(|s| s.starts_with("peak ")).unwrap();
    assert!(label.contains("backward"), "{label}");
    // Two 12.25 MiB decoder tensors (the deconv2 output and its gradient) dominate the peak.
    assert!(t.iter().any(|s| s == "dec_deconv2.out"));
    let big = format_bytes(128 * 28 * 28 * 32 * 4);
    assert!(t.iter().filter(|s| **s == big).count() >= 2, "{big}");
}

fn expected_edges(spec: &ModelSpec) -> usize {
    let layer_inputs: usize = spec
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| !matches!(l.kind, LayerKind::Input { .. }))
        .map(|(i, l)| {
            if l.inputs.is_empty() {
                usize::from(i > 0)
            } else {
                l.inputs.len()
            }
        })
        .sum();
    let loss_inputs: usize = spec.loss.iter().map(|t| t.inputs.len()).sum();
    layer_inputs + loss_inputs
}

#[test]
fn graphs_parse_and_name_every_layer() {
    for (name, spec) in models() {
        let plan = planned(&spec);
        let svg = graph::svg(&spec, &plan);
        parses(&svg);
        let t = texts(&svg);
        for l in &spec.layers {
            assert!(
                t.iter().any(|s| s == &l.name),
                "{name}: no box for `{}`",
                l.name
            );
            assert!(svg.contains(&format!(r#"data-layer="{}""#, l.name)));
        }
        for row in plan.memory.layers.iter() {
            // Inputs read "[128, 784] u8 → f32": stored and computed dtype.
            let shape = format!(
                "[{}] ",
                row.output_shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            assert!(
                t.iter()
                    .any(|s| s.starts_with(&shape) && s.ends_with(row.dtype.name())),
                "{name}: `{}` lacks `{shape}{}`",
                row.name,
                row.dtype.name()
            );
        }
        assert_eq!(
            svg.matches(r#"<path class="edge""#).count(),
            expected_edges(&spec),
            "{name}: one drawn edge per input"
        );
    }
}

#[test]
fn graph_shades_checkpoint_segments_and_draws_skips() {
    let spec = gpt2_checkpointed();
    let svg = graph::svg(&spec, &planned(&spec));
    assert_eq!(svg.matches(r#"<g class="segment""#).count(), 2);
    assert!(texts(&svg).iter().any(|s| s == "checkpoint segment 1"));
    // Residual adds read a tensor two ranks up or more: drawn as skip edges.
    assert!(svg.contains("url(#arrow-skip)"));
    let vae = zoo::conv_vae(128);
    let vsvg = graph::svg(&vae, &planned(&vae));
    assert!(
        vsvg.contains("url(#arrow-skip)"),
        "the VAE's pixels → loss branch skips"
    );
    assert!(!vsvg.contains(r#"class="segment""#));
}

#[test]
fn graph_head_draws_only_the_first_layers() {
    let spec = zoo::resnet50(32);
    let plan = planned(&spec);
    // The stem (6 with the inputs), conv2_block1 (11, with its projection) and conv2_block2 (9).
    let svg = graph::svg_head(&spec, &plan, 26);
    parses(&svg);
    assert_eq!(svg.matches(r#"<g class="node""#).count(), 26);
    assert!(svg.contains(r#"data-layer="conv2_block2_out""#));
    assert!(!svg.contains(r#"data-layer="conv2_block3_1_conv""#));
    assert!(texts(&svg).iter().any(|s| s == "… (not drawn)"));
}

#[test]
fn dot_has_one_node_per_layer_and_one_edge_per_input() {
    for (name, spec) in models() {
        let plan = planned(&spec);
        let dot = graph::dot(&spec, &plan);
        assert!(dot.starts_with("digraph "), "{name}");
        assert!(dot.trim_end().ends_with('}'));
        let node_lines: Vec<&str> = dot
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with('"') && l.contains(" [label=") && !l.contains("->"))
            .collect();
        for l in &spec.layers {
            let n = node_lines
                .iter()
                .filter(|x| x.starts_with(&format!("\"{}\" [", l.name)))
                .count();
            assert_eq!(n, 1, "{name}: node `{}`", l.name);
        }
        let loss_nodes = node_lines
            .iter()
            .filter(|x| x.starts_with("\"loss:"))
            .count();
        assert_eq!(loss_nodes, spec.loss.len(), "{name}");
        assert_eq!(
            node_lines.len(),
            spec.layers.len() + spec.loss.len(),
            "{name}"
        );
        let edges = dot.lines().filter(|l| l.contains(" -> ")).count();
        assert_eq!(edges, expected_edges(&spec), "{name}: edges");
        let clusters = dot.matches("subgraph \"cluster_checkpoint_").count();
        let segments = {
            let mut s: Vec<u32> = spec.layers.iter().filter_map(|l| l.checkpoint).collect();
            s.dedup();
            s.len()
        };
        assert_eq!(clusters, segments, "{name}");
    }
}

#[test]
fn text_is_legible() {
    // No text below 11 px anywhere.
    let spec = zoo::conv_vae(128);
    let plan = planned(&spec);
    for svg in [
        timeline::svg(&plan, Some(48 << 20)),
        timeline::stacked_svg(&plan, None),
        graph::svg(&spec, &plan),
    ] {
        for part in svg.split("font-size=\"").skip(1) {
            let size: f64 = part[..part.find('"').unwrap()].parse().unwrap();
            assert!(size >= 11.0, "font-size {size}");
        }
        let tree = parses(&svg);
        assert!(tree.size().width() >= 1000.0 || svg.contains("model graph"));
    }
    assert_eq!(plot::layer_colour(3), plot::layer_colour(3));
}
