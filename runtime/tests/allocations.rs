//! A steady-state training step makes no heap allocation in memwise's own code. The one
//! dependency that allocates per call, the `gemm` crate (its packing buffers, freed before
//! it returns), is measured here and bounded.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use memwise_plan::{plan, zoo};
use memwise_runtime::{Batch, Device, Executor};

struct Counting;
static ON: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if ON.load(Relaxed) {
            COUNT.fetch_add(1, Relaxed);
            let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
            PEAK.fetch_max(live, Relaxed);
        }
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if ON.load(Relaxed) {
            LIVE.fetch_sub(l.size().min(LIVE.load(Relaxed)), Relaxed);
        }
        System.dealloc(p, l)
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The counters are global: tests measure one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `(allocations, peak live bytes, dense steps, the planned GEMM library heap)` over 5
/// steps of `spec`, after two warm-up steps.
fn measure(spec: &memwise_plan::ModelSpec, inputs: &[Batch<'_>]) -> (usize, usize, usize, u64) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = plan(spec).unwrap();
    let planned = memwise_runtime::cpu_heap::gemm_library_heap_bytes(&p);
    let mut ex = Executor::new(p, &Device::cpu(), 1).unwrap();
    ex.train_step(inputs).unwrap(); // warm-up: thread pools start, caches fill
    ex.train_step(inputs).unwrap();
    COUNT.store(0, Relaxed);
    LIVE.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    ON.store(true, Relaxed);
    let steps = 5;
    for _ in 0..steps {
        ex.train_step(inputs).unwrap();
    }
    ON.store(false, Relaxed);
    let gemm_calls = ex
        .plan()
        .steps
        .iter()
        .filter(|s| matches!(s.op, memwise_plan::Op::Dense { .. }))
        .count()
        * steps;
    (COUNT.load(Relaxed), PEAK.load(Relaxed), gemm_calls, planned)
}

/// The planned GEMM library heap is what was live at the peak: rayon's work queue may add
/// a block of about 1.5 KiB now and then (`kernels/tests/gemm_heap.rs` pins the library's
/// own figure exactly).
fn assert_planned(peak: usize, planned: u64) {
    let slack = 4096;
    assert!(
        (peak as u64).abs_diff(planned) <= slack,
        "peak live {peak} B in the steps, planned {planned} B"
    );
}

/// The most heap allocations one GEMM makes inside the `gemm` crate over a few shapes, after
/// a warm-up call: a handful that depends on the CPU and thread count (3 on the development
/// machine, 5 on the CI machine), never on the sizes.
fn gemm_allocations_per_call() -> usize {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut most = 0;
    for (m, n, k) in [(128, 512, 784), (784, 512, 128), (128, 10, 512), (7, 5, 3)] {
        let (a, b, mut c) = (vec![1f32; m * k], vec![1f32; k * n], vec![0f32; m * n]);
        let mut call = || {
            memwise_kernels::gemm::matmul(m, n, k, &a, false, &b, false, &mut c, 1.0, 0.0, &mut [])
                .unwrap()
        };
        call();
        COUNT.store(0, Relaxed);
        ON.store(true, Relaxed);
        call();
        ON.store(false, Relaxed);
        most = most.max(COUNT.load(Relaxed));
    }
    most
}

#[test]
fn training_step_allocations_are_bounded_to_the_gemm_crate() {
    let per_call = gemm_allocations_per_call();
    assert!(
        per_call <= 8,
        "the gemm crate allocates {per_call} times per call"
    );
    let spec = zoo::mnist_mlp(128);
    let pixels = vec![7u8; 128 * 784];
    let labels: Vec<i32> = (0..128).map(|i| i % 10).collect();
    let (count, peak, gemm_calls, planned) =
        measure(&spec, &[Batch::U8(&pixels), Batch::I32(&labels)]);
    println!(
        "5 MNIST MLP steps: {count} allocations ({gemm_calls} dense steps, each 1–2 GEMM calls \
         of at most {per_call} allocations), peak live {peak} bytes, planned {planned}"
    );
    // The gemm crate's per-call blocks (a dense backward is 2 GEMMs), plus rayon's occasional
    // queue growth; memwise itself allocates nothing.
    assert!(
        count <= gemm_calls * 2 * per_call + 8,
        "{count} allocations for {gemm_calls} dense steps"
    );
    // What the estimate counts as the GEMM library's heap is what was live at once.
    assert_planned(peak, planned);
}

#[test]
fn convnet_step_allocations_are_bounded_too() {
    let mut m = memwise_plan::ModelSpec::new("Conv", 32);
    use memwise_plan::*;
    m.input("pixels", &[28, 28, 1], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "c1",
        LayerKind::conv2d(32, 3, 1, Padding::Same, Activation::Relu),
        &["pixels"],
    );
    m.add("p1", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add(
        "c2",
        LayerKind::separable_conv2d(64, 3, 1, Padding::Same, Activation::Relu),
        &[],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    m.add("gap", LayerKind::GlobalAvgPool, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    let pixels = vec![7u8; 32 * 784];
    let labels: Vec<i32> = (0..32).map(|i| i % 10).collect();
    let (count, peak, _, planned) = measure(&m, &[Batch::U8(&pixels), Batch::I32(&labels)]);
    println!("5 convnet steps: {count} allocations, peak live {peak} bytes, planned {planned}");
    assert_planned(peak, planned);
}

#[test]
fn a_step_without_gemm_allocates_nothing_at_all() {
    use memwise_plan::*;
    // Every op here runs memwise's own kernels (no GEMM crate): the count must be zero.
    let mut m = ModelSpec::new("NoGemm", 4);
    m.input("x", &[8, 8, 4], DType::F32, 1.0);
    m.input("target", &[4, 4, 4], DType::F32, 1.0);
    m.add(
        "dw",
        LayerKind::depthwise_conv2d(3, 1, Padding::Same, Activation::Linear),
        &["x"],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    m.add("act", LayerKind::Activation(Activation::Relu), &[]);
    m.add("pool", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add("ln", LayerKind::layer_norm(), &[]);
    m.add("drop", LayerKind::Dropout { rate: 0.25 }, &[]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["drop", "target"]));
    let x: Vec<f32> = (0..4 * 256).map(|i| (i % 17) as f32 / 17.0).collect();
    let t: Vec<f32> = (0..4 * 64).map(|i| (i % 5) as f32 / 5.0).collect();
    let (count, peak, _, planned) = measure(&m, &[Batch::F32(&x), Batch::F32(&t)]);
    assert_eq!(planned, 0, "no GEMM, no library heap");
    println!("5 GEMM-free steps: {count} allocations, peak live {peak} bytes");
    // memwise's own code allocates nothing; rayon's work-stealing deques (a dependency)
    // occasionally grow by one block when a parallel kernel runs. A per-step or per-op
    // allocation in memwise would show up as at least 5 here (5 steps × 6 ops).
    assert!(
        count <= 2,
        "{count} allocations in 5 steps: memwise's executor or kernels allocated"
    );
}
