//! TEMPORARY probe (bench work): where a training step's resident memory goes.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use memwise_runtime::data::dataset::{Dataset, InMemory};
use memwise_runtime::data::idx::load_bundled_digits;
use memwise_runtime::monitor::{rss, reset_peak, MemoryMonitor};
use memwise_runtime::*;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static BIG: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(live, Relaxed);
        if l.size() >= BIG.load(Relaxed) && BIG.load(Relaxed) > 0 { eprintln!("  alloc {} B", l.size()); }
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(live, Relaxed);
        if l.size() >= BIG.load(Relaxed) && BIG.load(Relaxed) > 0 { eprintln!("  alloc_zeroed {} B", l.size()); }
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        System.dealloc(p, l)
    }
}
#[global_allocator]
static A: Counting = Counting;

fn mib(b: usize) -> f64 { b as f64 / 1048576.0 }

fn main() -> Result<()> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "mlp".into());
    let b: usize = std::env::args().nth(2).map_or(4096, |s| s.parse().unwrap());
    let big: usize = std::env::args().nth(3).map_or(1 << 20, |s| s.parse().unwrap());
    let spec = if which == "mlp" { memwise_plan::zoo::mnist_mlp(b) } else { memwise_plan::zoo::conv_vae(b) };
    let (tr, te) = load_bundled_digits()?;
    let (train, test) = if which == "mlp" { (InMemory::mnist(&tr), InMemory::mnist(&te)) } else { (InMemory::mnist_images(&tr), InMemory::mnist_images(&te)) };
    drop((tr, te));
    let p = memwise_plan::plan(&spec)?;
    let m = p.memory;
    println!("plan: total {:.2} MiB (params {:.2} grads {:.2} opt {:.2} act {:.2} ws {:.2} inputs {:.2}); arena {:.2} persistent {:.2}",
        mib(m.total as usize), mib(m.params as usize), mib(m.grads as usize), mib(m.optimizer as usize), mib(m.activations_peak as usize), mib(m.workspace_peak as usize), mib(m.inputs as usize), mib(p.arena_bytes as usize), mib(p.persistent_bytes as usize));
    reset_peak();
    let base_live = LIVE.load(Relaxed);
    PEAK.store(base_live, Relaxed);
    BIG.store(big, Relaxed);
    let mon = MemoryMonitor::start();
    let show = |what: &str| {
        let g = mon.growth().unwrap();
        println!("{what:28} rss growth now {:8.2} peak {:8.2} MiB | heap live +{:8.2} peak +{:8.2} MiB", mib(g.current as usize), mib(g.peak as usize),
            mib(LIVE.load(Relaxed) - base_live), mib(PEAK.load(Relaxed) - base_live));
    };
    show("baseline");
    let mut t = Trainer::from_plan(&spec, p, &Device::cpu(), 1, mon)?;
    show("built");
    let opts = FitOptions { epochs: 1, max_steps: Some(1), shuffle: false, verbose: false, ..Default::default() };
    t.fit(&train, None, &opts, &mut [])?;
    show("after step 1");
    let opts = FitOptions { epochs: 1, max_steps: Some(2), shuffle: false, verbose: false, ..Default::default() };
    t.fit(&train, None, &opts, &mut [])?;
    show("after steps 2-3");
    let _ = t.evaluate(&test)?;
    show("after evaluate");
    let _ = rss();
    let _ = train.len();
    Ok(())
}
