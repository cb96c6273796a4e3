//! Renders the documentation's plan pictures (SVG, and PNG through resvg for review):
//! `cargo run -p memwise-runtime --example render_plots -- [OUT_DIR] [--extra]` (default
//! `docs/img`; `--extra` adds pictures for review that the docs do not use: ResNet-50's
//! timeline and the checkpointed GPT-2 stack's graph and timeline).
//! `scripts/render-docs.sh` runs it, so the committed pictures are always the code's.
//!
//! - `mnist_timeline`: the MNIST MLP at batch 128 under the DSL sketch's 2 GiB budget
//!   (far above the chart: labelled as off the scale);
//! - `vae_timeline`, `vae_timeline_stacked`: the seed's convolutional VAE at batch 128, with
//!   an illustrative 48 MiB budget that it fits;
//! - `vae_graph`: its graph (the encoder's two heads and the pixels → loss branch);
//! - `resnet50_graph_head`: ResNet-50's stem and first two bottleneck blocks.

use std::path::{Path, PathBuf};

use memwise_plan::{zoo, ModelSpec, StaticPlan};
use memwise_runtime::plot::{graph, timeline};
use resvg::{tiny_skia, usvg};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn plan(spec: &ModelSpec) -> StaticPlan {
    memwise_plan::plan(spec).unwrap_or_else(|e| panic!("{} does not plan: {e}", spec.name))
}

/// Writes `name.svg` and `name.png` (rasterised at 1×, fonts from the system).
fn write(dir: &Path, name: &str, svg: &str, fonts: &usvg::Options<'_>) -> Result<(), String> {
    let svg_path = dir.join(format!("{name}.svg"));
    std::fs::write(&svg_path, svg).map_err(|e| format!("{}: {e}", svg_path.display()))?;
    let tree = usvg::Tree::from_str(svg, fonts).map_err(|e| format!("{name}: {e}"))?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| format!("{name}: empty picture"))?;
    resvg::render(
        &tree,
        tiny_skia::Transform::identity(),
        &mut pixmap.as_mut(),
    );
    let png_path = dir.join(format!("{name}.png"));
    pixmap
        .save_png(&png_path)
        .map_err(|e| format!("{}: {e}", png_path.display()))?;
    println!(
        "{:<28} {:>5}×{:<5} {}",
        name,
        size.width(),
        size.height(),
        svg_path.display()
    );
    Ok(())
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let extra = args.iter().any(|a| a == "--extra");
    let dir: PathBuf = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("docs/img"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut fonts = usvg::Options::default();
    fonts.fontdb_mut().load_system_fonts();

    let mnist = zoo::mnist_mlp(128);
    let mnist_plan = plan(&mnist);
    write(
        &dir,
        "mnist_timeline",
        &timeline::svg(&mnist_plan, Some(2 * GIB)),
        &fonts,
    )?;

    let vae = zoo::conv_vae(128);
    let vae_plan = plan(&vae);
    let budget = Some(48 * MIB);
    write(
        &dir,
        "vae_timeline",
        &timeline::svg(&vae_plan, budget),
        &fonts,
    )?;
    write(
        &dir,
        "vae_timeline_stacked",
        &timeline::stacked_svg(&vae_plan, budget),
        &fonts,
    )?;
    write(&dir, "vae_graph", &graph::svg(&vae, &vae_plan), &fonts)?;
    // The same VAE under `checkpoint = auto` at 90 % of its float32 total (the budget of
    // `vae --compare`): a recompute phase in the timeline, segments shaded in the graph.
    let auto_budget = vae_plan.memory.total * 9 / 10;
    let choice = memwise_plan::checkpoint::solve(&vae, auto_budget)
        .map_err(|e| format!("conv_vae under {auto_budget} bytes: {e}"))?;
    let vae_auto = choice.apply(&vae);
    let vae_auto_plan = plan(&vae_auto);
    write(
        &dir,
        "vae_auto_timeline",
        &timeline::svg(&vae_auto_plan, Some(auto_budget)),
        &fonts,
    )?;
    write(
        &dir,
        "vae_auto_graph",
        &graph::svg(&vae_auto, &vae_auto_plan),
        &fonts,
    )?;

    let resnet = zoo::resnet50(32);
    let resnet_plan = plan(&resnet);
    // Stem (with both inputs), conv2_block1 (with its projection shortcut), conv2_block2
    // (identity shortcut): 26 layers.
    write(
        &dir,
        "resnet50_graph_head",
        &graph::svg_head(&resnet, &resnet_plan, 26),
        &fonts,
    )?;
    if extra {
        write(
            &dir,
            "resnet50_timeline",
            &timeline::svg(&resnet_plan, None),
            &fonts,
        )?;
        // Two GPT-2 blocks at batch 2, each its own checkpoint segment.
        let mut gpt2 = zoo::gpt2_stack(2, 2);
        zoo::checkpoint_blocks(&mut gpt2, |n: &str| {
            n.starts_with('h')
                .then(|| n.split('_').next().unwrap_or(n).to_string())
        });
        let gpt2_plan = plan(&gpt2);
        write(
            &dir,
            "gpt2_ckpt_graph",
            &graph::svg(&gpt2, &gpt2_plan),
            &fonts,
        )?;
        write(
            &dir,
            "gpt2_ckpt_timeline",
            &timeline::svg(&gpt2_plan, None),
            &fonts,
        )?;
        write(
            &dir,
            "gpt2_ckpt_timeline_stacked",
            &timeline::stacked_svg(&gpt2_plan, None),
            &fonts,
        )?;
    }
    Ok(())
}
