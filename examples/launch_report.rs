//! The launch report: every kernel launch, cuBLAS GEMM and memset of one training step of
//! the examples' models, recorded without a GPU (`memwise::runtime::cuda::trace`), with a
//! roofline model of an H200 for each: the launches that leave most of the GPU idle (fewer
//! blocks than 2 × its 132 SMs while touching over a million elements), the slowest
//! launches, and the modelled step time. A model, not a measurement: launch overhead,
//! caches and cuBLAS's own grid are left out (docs/CUDA.md, "The launch report").
//!
//! `cargo run --release --example launch_report`. Its last line sums the models up:
//! `under-filled launches: K of N; modelled H200 step ms: mnist_mlp a, convnet b, vae c, gpt d`.
// Each example file declares its own `mod common;`: loading four of them here loads it four times.
#![allow(clippy::duplicate_mod)]

use memwise::plan::StaticPlan;
use memwise::runtime::cuda::trace::{
    trace_training_step, LaunchKind, LaunchRecord, H200, UNDER_FILLED_ELEMENTS, UNDER_FILLED_WAVES,
};

// The models, read from their own examples (each file is also its example's `main`; here only
// its model is used), at the batch sizes those examples train with.
#[allow(dead_code)]
#[path = "convnet.rs"]
mod convnet;
#[allow(dead_code)]
#[path = "gpt.rs"]
mod gpt;
#[allow(dead_code)]
#[path = "mnist_mlp.rs"]
mod mnist_mlp;
#[allow(dead_code)]
#[path = "vae.rs"]
mod vae;

/// Launches listed by modelled time, per model.
const TOP: usize = 8;

/// One model's traced step.
struct Traced {
    name: &'static str,
    records: Vec<LaunchRecord>,
    step_ms: f64,
    under_filled: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models: [(&str, StaticPlan); 4] = [
        ("mnist_mlp", mnist_mlp::MnistMlp::PLAN),
        ("convnet", convnet::ConvNet::PLAN),
        ("vae", vae::ConvVae::PLAN),
        ("gpt", gpt::Gpt::PLAN),
    ];
    println!(
        "The launch report: one training step per model, recorded without running, against an \
         {} roofline ({} SMs, {:.1} TB/s, {:.0} TFLOP/s FP32, {:.1} TFLOP/s FP16/BF16 tensor).",
        H200.name,
        H200.sms,
        H200.bytes_per_s / 1e12,
        H200.fp32_flops_per_s / 1e12,
        H200.fp16_flops_per_s / 1e12
    );
    let mut traced = Vec::new();
    for (name, plan) in models {
        let records = trace_training_step(&plan, 0)?;
        let t = Traced {
            name,
            step_ms: H200.step_seconds(&records) * 1e3,
            under_filled: records.iter().filter(|r| H200.under_filled(r)).count(),
            records,
        };
        print_model(&t, plan.batch);
        traced.push(t);
    }
    let k: usize = traced.iter().map(|t| t.under_filled).sum();
    let n: usize = traced.iter().map(|t| t.records.len()).sum();
    let times: Vec<String> = traced
        .iter()
        .map(|t| format!("{} {:.3}", t.name, t.step_ms))
        .collect();
    println!(
        "under-filled launches: {k} of {n}; modelled H200 step ms: {}",
        times.join(", ")
    );
    Ok(())
}

fn print_model(t: &Traced, batch: usize) {
    let count = |f: fn(&LaunchKind) -> bool| t.records.iter().filter(|r| f(&r.kind)).count();
    println!(
        "\n== {} (batch {batch}): {} launches ({} kernels, {} cuBLAS GEMMs, {} memset(s)); \
         modelled {} step {:.3} ms",
        t.name,
        t.records.len(),
        count(|k| *k == LaunchKind::Kernel),
        count(|k| matches!(k, LaunchKind::Gemm(_))),
        count(|k| *k == LaunchKind::Memset),
        H200.name,
        t.step_ms
    );
    println!(
        "under-filled (fewer than {} blocks, over {UNDER_FILLED_ELEMENTS} elements): {}",
        UNDER_FILLED_WAVES * H200.sms as u64,
        if t.under_filled == 0 { "none" } else { "" }
    );
    let mut rows: Vec<Vec<String>> = Vec::new();
    for r in t.records.iter().filter(|r| H200.under_filled(r)) {
        rows.push(vec![
            r.kernel.clone(),
            where_of(r),
            shape(r),
            r.elements.to_string(),
            format!("{:.1}", H200.launch_seconds(r) * 1e6),
        ]);
    }
    if !rows.is_empty() {
        print_table(&["kernel", "step", "grid × block", "elements", "µs"], &rows);
    }
    let mut by_time: Vec<&LaunchRecord> = t.records.iter().collect();
    by_time.sort_by(|a, b| H200.launch_seconds(b).total_cmp(&H200.launch_seconds(a)));
    println!("top {TOP} launches by modelled time:");
    let rows: Vec<Vec<String>> = by_time
        .iter()
        .take(TOP)
        .map(|r| {
            vec![
                format!("{:.1}", H200.launch_seconds(r) * 1e6),
                r.kernel.clone(),
                where_of(r),
                shape(r),
                format!("{:.2}", r.bytes as f64 / 1e6),
                format!("{:.1}", r.flops as f64 / 1e6),
                if H200.under_filled(r) { "yes" } else { "" }.into(),
            ]
        })
        .collect();
    print_table(
        &[
            "µs",
            "kernel",
            "step",
            "grid × block",
            "MB",
            "MFLOP",
            "under-filled",
        ],
        &rows,
    );
}

/// `#12 backward dense (hidden)`, or `step frame` for a launch outside the plan's steps.
fn where_of(r: &LaunchRecord) -> String {
    match &r.step {
        Some(s) => format!("#{} {} {} ({})", s.index, s.phase.name(), s.op, s.layer),
        None => "step frame".into(),
    }
}

fn shape(r: &LaunchRecord) -> String {
    match r.kind {
        LaunchKind::Kernel => {
            let d = |v: [u32; 3]| {
                let used: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                used.join("×")
            };
            format!("{} × {}", d(r.grid), d(r.block))
        }
        LaunchKind::Gemm(_) => "cuBLAS's".into(),
        LaunchKind::Memset => "driver's".into(),
    }
}

/// Left-aligned text columns, numbers right-aligned (a cell that parses as a number).
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&width)
            .map(|(c, &w)| {
                let pad = " ".repeat(w - c.chars().count());
                if c.parse::<f64>().is_ok() {
                    format!("{pad}{c}")
                } else {
                    format!("{c}{pad}")
                }
            })
            .collect();
        println!("  {}", parts.join("  ").trim_end());
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}
