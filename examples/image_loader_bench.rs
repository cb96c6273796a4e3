//! Image-folder loader throughput: images per second decoded and resized to `--size`² RGB,
//! through `ImageFolder`'s prefetch pool exactly as `fit` drives it (a seeded shuffled order
//! announced, then every full batch gathered), for each `--workers` count; and the loader's
//! resident growth beside its planned bytes, and the CPU time the pass took (images per
//! CPU-second: what a shared machine's load does not change). One JSON object per line on stdout, for
//! `bench/image_loader.py`, which sets it beside PyTorch's and Keras's loaders.
//!
//! `cargo run --release --example image_loader_bench -- --data DIR --workers 1,2`
//! (`--write-digits DIR` first writes the bundled digits 0 and 1 there as an image folder).

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use memwise::runtime::data::dataset::{Column, Dataset};
use memwise::runtime::data::digits_folder::write_digits_folder;
use memwise::runtime::monitor::MemoryMonitor;
use memwise::ImageFolder;

#[derive(Parser, Debug)]
struct Args {
    /// The image folder (one subfolder per class).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Write the bundled digits 0 and 1 to DIR as an image folder (and use it).
    #[arg(long, value_name = "DIR")]
    write_digits: Option<PathBuf>,
    /// Worker counts to measure, comma-separated (0: decode in the calling thread).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    workers: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Images are resized to SIZE × SIZE × 3.
    #[arg(long, default_value_t = 180)]
    size: u32,
    /// Passes over the folder per worker count (each its own shuffle); the best is reported.
    #[arg(long, default_value_t = 2)]
    passes: usize,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// CPU seconds (user + system) this process has used, all threads (`/proc/self/stat`).
fn cpu_seconds() -> f64 {
    extern "C" {
        fn sysconf(name: i32) -> i64;
    }
    const SC_CLK_TCK: i32 = 2; // Linux
                               // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { sysconf(SC_CLK_TCK) }.max(1) as f64;
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let field = |k: usize| -> f64 {
        after
            .split_whitespace()
            .nth(k)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    (field(11) + field(12)) / hz
}

fn main() -> Res<()> {
    let args = Args::parse();
    let dir = match (&args.write_digits, &args.data) {
        (Some(d), _) => {
            let w = write_digits_folder(d, &[0, 1], 10)?;
            eprintln!(
                "wrote {} PNG and {} JPEG digits to {}",
                w.png,
                w.jpeg,
                d.display()
            );
            d.clone()
        }
        (None, Some(d)) => d.clone(),
        (None, None) => return Err("give --data DIR or --write-digits DIR".into()),
    };
    // As in training: large freed blocks go back to the kernel (the CPU executor sets this).
    memwise::runtime::memory::return_large_frees();
    for &workers in &args.workers {
        let t_open = Instant::now();
        let folder = ImageFolder::options(&dir)
            .image_size(args.size, args.size)
            .channels(3)
            .workers(workers)
            .open()?;
        let open_s = t_open.elapsed().as_secs_f64();
        let n = folder.len() / args.batch * args.batch;
        if n == 0 {
            return Err(format!("{}: fewer images than one batch", dir.display()).into());
        }
        let plan = folder.prefetch_plan(args.batch);
        let monitor = MemoryMonitor::start();
        let mut bufs: Vec<Column> = folder
            .columns()
            .iter()
            .map(|c| c.buffer(args.batch))
            .collect();
        let staging = (args.batch * (folder.shape().bytes() + 4)) as u64;
        let mut order: Vec<usize> = (0..folder.len()).collect();
        let mut rng = 1u64;
        let mut best = f64::INFINITY;
        let mut best_cpu = f64::INFINITY;
        let mut passes_s = Vec::new();
        for _ in 0..args.passes.max(1) {
            for i in (1..order.len()).rev() {
                order.swap(i, (splitmix(&mut rng) % (i as u64 + 1)) as usize);
            }
            let (t0, c0) = (Instant::now(), cpu_seconds());
            folder.will_gather(&order[..n], args.batch);
            for b in order[..n].chunks(args.batch) {
                folder.gather(b, &mut bufs)?;
            }
            let s = t0.elapsed().as_secs_f64();
            passes_s.push(s);
            best = best.min(s);
            best_cpu = best_cpu.min(cpu_seconds() - c0);
        }
        let growth = monitor.growth().map_or(0, |g| g.peak);
        let (stats, synchronous) = folder.stats();
        let estimate = plan.total() + staging;
        println!(
            "{}",
            serde_json::json!({
                "loader": "memwise", "workers": workers, "images": n, "batch": args.batch,
                "size": args.size, "open_s": open_s, "passes_s": passes_s,
                "images_per_s": n as f64 / best,
                "images_per_cpu_s": n as f64 / best_cpu.max(1e-9),
                "peak_rss_growth_bytes": growth, "estimate_bytes": estimate,
                "estimate_error_percent": memwise::runtime::monitor::error_percent(growth, estimate),
                "prefetched": stats.prefetched, "synchronous": synchronous,
                "max_buffers": stats.max_buffers, "skipped": folder.skipped().len(),
            })
        );
    }
    Ok(())
}
