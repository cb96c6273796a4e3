//! The plan of one zoo model as `memwise.plan/1` JSON, the file the examples write with
//! `--plan-json`, for the zoo models no example trains: `bench/kept.py` reads ResNet-50's
//! from here (docs/BENCHMARKS.md, "Kept for backward against PyTorch, whole models").
//!
//! `cargo run --release -p memwise-plan --example zoo_plan_json -- MODEL [BATCH]` prints the
//! plan of `zoo::all`'s `MODEL` (`resnet50`, `unet`, …) at `BATCH` (its benchmark batch by
//! default), as the planner makes it for a model without a budget or `checkpoint = auto`.

use memwise_plan::{plan, zoo};

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| usage("no model named"));
    let batch: Option<usize> = args.next().map(|a| {
        a.parse()
            .unwrap_or_else(|_| usage("the batch is a whole number"))
    });
    let models = zoo::all(1.0);
    let Some((_, mut spec)) = models.into_iter().find(|(n, _)| *n == name) else {
        usage(&format!("no zoo model `{name}`"))
    };
    if let Some(b) = batch {
        spec.batch = b;
    }
    let p = plan(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    println!("{}", p.to_json());
}

fn usage(why: &str) -> ! {
    let names: Vec<_> = zoo::BATCHES.iter().map(|(n, _)| *n).collect();
    eprintln!(
        "zoo_plan_json: {why}\nusage: zoo_plan_json MODEL [BATCH], MODEL one of {}",
        names.join(", ")
    );
    std::process::exit(2)
}
