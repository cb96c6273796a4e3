//! The `gemm` crate's heap inside our GEMMs, measured, against `memwise_kernels::gemm_heap`'s
//! model and the kernels' `*_heap_bytes` functions.
//!
//! A counting global allocator tracks the bytes live (allocated minus freed) and their peak,
//! while `WATCH` is set, on rayon worker threads and on the thread marked as measuring — the
//! only threads a GEMM runs on. Other threads (libtest's own) are not counted, and the tests
//! take `SERIAL` so one measurement runs at a time. Every measurement runs *inside* a rayon
//! pool (`install`): a call from outside also makes rayon's global job queue allocate a block
//! now and then, which is rayon's bookkeeping, not the `gemm` crate's (see
//! `calls_from_outside_the_pool`). Before measuring, every thread's `gemm` slab is claimed with
//! `touch_thread_slab`, and each measured call follows one warm-up call.
//!
//! Heavy shapes (4096 rows and such) run only in release builds:
//! `cargo test -p memwise-kernels --release --test gemm_heap -- --nocapture` prints the table.

use gemm::Parallelism;
use half::{bf16, f16};
use memwise_kernels::attention::*;
use memwise_kernels::conv::*;
use memwise_kernels::dense::*;
use memwise_kernels::gemm::*;
use memwise_kernels::gemm_heap::*;
use memwise_kernels::Element;
use rayon::ThreadPool;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard, OnceLock};

// ---------------------------------------------------------------------------------------------
// Measuring

struct Counting;
static WATCH: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
}

fn counted() -> bool {
    WATCH.load(SeqCst)
        && (rayon::current_thread_index().is_some()
            || MEASURING.try_with(Cell::get).unwrap_or(false))
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counted() {
            let size = layout.size() as isize;
            PEAK.fetch_max(LIVE.fetch_add(size, SeqCst) + size, SeqCst);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counted() {
            LIVE.fetch_sub(layout.size() as isize, SeqCst);
        }
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

/// One test at a time; the global pool's workers and this thread have their slabs.
fn serial() -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    rayon::broadcast(|_| touch_thread_slab());
    touch_thread_slab();
    guard
}

/// A pool of `threads` workers (built once, slabs claimed).
fn pool(threads: usize) -> &'static ThreadPool {
    static POOLS: [OnceLock<ThreadPool>; 4] = [const { OnceLock::new() }; 4];
    POOLS[threads].get_or_init(|| {
        let p = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        p.broadcast(|_| touch_thread_slab());
        p
    })
}

/// Peak bytes live during `call` on this thread and rayon's workers, after one warm-up call.
fn peak_of(call: &mut dyn FnMut()) -> usize {
    call();
    LIVE.store(0, SeqCst);
    PEAK.store(0, SeqCst);
    MEASURING.set(true);
    WATCH.store(true, SeqCst);
    call();
    WATCH.store(false, SeqCst);
    MEASURING.set(false);
    PEAK.load(SeqCst).max(0) as usize
}

/// `(model, measured)` with both evaluated on a thread of `pool` (the model reads the current
/// pool's thread count, as the GEMM does).
fn on_pool(
    pool: &ThreadPool,
    model: impl FnOnce() -> usize + Send,
    mut call: impl FnMut() + Send,
) -> (usize, usize) {
    pool.install(|| (model(), peak_of(&mut call)))
}

fn row(case: &str, model: usize, measured: usize) {
    eprintln!("{case:<64} model {model:>9} B  measured {measured:>9} B");
}

/// Asserts the measured peak equals the model, on the global pool. A call whose GEMM runs on
/// both threads (the gemm crate's blocks, a deep product's parts) holds both threads' buffers
/// at once only when the second thread takes its share before the first is done, which a busy
/// machine may delay: so each measurement must stay within the model and repeated measurement
/// (up to two seconds) must reach it.
fn exact(
    case: &str,
    model: impl Fn() -> usize + Send + Sync,
    mut call: impl FnMut() + Send,
) -> usize {
    let (mut best, start) = (0, std::time::Instant::now());
    let model_value = loop {
        let (m, measured) = pool_global(&model, &mut call);
        assert!(measured <= m, "{case}: measured {measured} > model {m}");
        best = best.max(measured);
        if best == m || start.elapsed().as_secs() >= 2 {
            break m;
        }
    };
    row(case, model_value, best);
    assert_eq!(best, model_value, "{case}: measured ≠ model");
    model_value
}

/// [`on_pool`] for rayon's global pool (`rayon::scope` runs its body on one of its workers).
fn pool_global(
    model: impl FnOnce() -> usize + Send,
    mut call: impl FnMut() + Send,
) -> (usize, usize) {
    rayon::scope(|_| (model(), peak_of(&mut call)))
}

/// A model that is not a constant: the values asserted over a test must differ.
fn assert_varied(what: &str, values: &BTreeSet<usize>, at_least: usize) {
    assert!(
        values.len() >= at_least,
        "{what}: only {} distinct model values {values:?}; the test would not catch a constant",
        values.len()
    );
}

const HEAVY: bool = !cfg!(debug_assertions);

fn fill<T: Element>(len: usize) -> Vec<T> {
    vec![T::from_f32(0.5); len]
}

// ---------------------------------------------------------------------------------------------
// The raw rule: one gemm::gemm call as sgemm_raw makes it.

/// Elements a `rows×cols` view with strides `s` reaches.
fn span(rows: usize, cols: usize, s: Strides) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * s.rs + (cols - 1) * s.cs + 1
    }
}

/// One `gemm::gemm::<f32>` call exactly as `memwise_kernels::gemm`'s `sgemm_raw` makes it:
/// `c = a·b (+ c when read_dst)`, strides passed column stride first.
struct Raw {
    m: usize,
    n: usize,
    k: usize,
    a: Strides,
    b: Strides,
    c: Strides,
    read_dst: bool,
    par: Parallelism,
}

impl Raw {
    fn model(&self) -> usize {
        library_heap_bytes(
            self.m,
            self.n,
            self.k,
            self.a,
            self.b,
            self.read_dst,
            self.c,
            self.par,
        )
    }
    fn call(&self) -> impl FnMut() + Send + '_ {
        let a = fill::<f32>(span(self.m, self.k, self.a));
        let b = fill::<f32>(span(self.k, self.n, self.b));
        let mut c = fill::<f32>(span(self.m, self.n, self.c));
        move || unsafe {
            // SAFETY: each buffer spans its view.
            gemm::gemm(
                self.m,
                self.n,
                self.k,
                c.as_mut_ptr(),
                self.c.cs as isize,
                self.c.rs as isize,
                self.read_dst,
                a.as_ptr(),
                self.a.cs as isize,
                self.a.rs as isize,
                b.as_ptr(),
                self.b.cs as isize,
                self.b.rs as isize,
                if self.read_dst { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                self.par,
            )
        }
    }
    fn case(&self) -> String {
        format!(
            "gemm {}x{}x{} a{:?} b{:?} c{:?} read={} {:?}",
            self.m,
            self.n,
            self.k,
            (self.a.rs, self.a.cs),
            (self.b.rs, self.b.cs),
            (self.c.rs, self.c.cs),
            self.read_dst,
            self.par
        )
    }
}

/// Shapes covering every branch of the rule: empty, tiny, k ≤ 2, the horizontal kernels
/// (m·n ≤ 256), the GEMV layouts (m or n = 1), the `m, n ≤ 64` blocking, rhs packing on either
/// side of `2·MR`, lhs pre-packing, threaded and not.
fn raw_shapes() -> Vec<(usize, usize, usize)> {
    let mut shapes = vec![
        (0, 5, 5),
        (5, 5, 0),
        (1, 1, 1),
        (2, 3, 4),
        (7, 5, 3),
        (100, 100, 2),
        (16, 16, 100),
        (17, 16, 100),
        (1, 300, 200),
        (300, 1, 200),
        (2, 300, 200),
        (64, 64, 300),
        (10, 60, 1000),
        (33, 47, 600),
        (65, 65, 65),
        (128, 10, 512),
        (10, 128, 512),
        (128, 64, 64),
        (256, 256, 256),
        (200, 100, 64),
    ];
    if HEAVY {
        shapes.extend([
            (2048, 64, 288),
            (128, 512, 784),
            (512, 128, 784),
            (4096, 512, 784),
            (784, 512, 4096),
            (4096, 3, 64),
            (3000, 40, 50),
        ]);
    }
    shapes
}

#[test]
fn one_gemm_call_matches_the_model() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    for (m, n, k) in raw_shapes() {
        for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
            // c row-major as the kernels make it, and column-major (gemm swaps nothing then).
            for c in [Strides::row_major(n), Strides::new(1, m.max(1))] {
                for par in [Parallelism::None, Parallelism::Rayon(0)] {
                    let raw = Raw {
                        m,
                        n,
                        k,
                        a: Strides::dense(m, k, a_trans),
                        b: Strides::dense(k, n, b_trans),
                        c,
                        read_dst: a_trans,
                        par,
                    };
                    values.insert(exact(&raw.case(), || raw.model(), raw.call()));
                }
            }
        }
    }
    // Padded and sub-matrix views (neither stride 1 on one side), as the kernels' blocks are.
    for (m, n, k) in [(40, 70, 90), (300, 20, 100), (90, 300, 33)] {
        for par in [Parallelism::None, Parallelism::Rayon(0)] {
            let raw = Raw {
                m,
                n,
                k,
                a: Strides::new(3 * k, 1),
                b: Strides::new(2, 2 * k + 1),
                c: Strides::row_major(n + 5),
                read_dst: true,
                par,
            };
            values.insert(exact(&raw.case(), || raw.model(), raw.call()));
        }
    }
    assert_varied("gemm::gemm", &values, 8);
}

#[test]
fn the_thread_count_enters_as_one_flag_vector_per_extra_thread() {
    let _serial = serial();
    // Threaded shapes (m·n·k well above the threading threshold).
    let shapes: &[(usize, usize, usize)] = if HEAVY {
        &[(256, 256, 256), (1024, 200, 300), (100, 600, 400)]
    } else {
        &[(256, 256, 256)]
    };
    for &(m, n, k) in shapes {
        for a_trans in [false, true] {
            let raw = Raw {
                m,
                n,
                k,
                a: Strides::dense(m, k, a_trans),
                b: Strides::dense(k, n, false),
                c: Strides::row_major(n),
                read_dst: false,
                par: Parallelism::Rayon(0),
            };
            let one = on_pool(pool(1), || raw.model(), raw.call());
            row(&format!("{} on 1 thread", raw.case()), one.0, one.1);
            assert_eq!(one.0, one.1, "1 thread");
            let three = on_pool(pool(3), || raw.model(), raw.call());
            row(&format!("{} on 3 threads", raw.case()), three.0, three.1);
            // With 3 threads the two extra threads' flag vectors (mc/MR bytes each) are
            // allocated and freed by those threads as they start and finish: live together
            // at worst (the model), at best one at a time. The slack is one vector.
            let flags = three.0 - one.0;
            assert!(flags > 0 && flags % 2 == 0, "two extra vectors: {flags}");
            assert!(three.1 <= three.0, "measured above the model");
            assert!(
                three.0 - three.1 <= flags / 2,
                "more than one flag vector short"
            );
            // Explicit thread counts mean the same.
            let explicit = Raw {
                par: Parallelism::Rayon(3),
                ..raw
            };
            assert_eq!(explicit.model(), three.0);
        }
    }
}

#[test]
fn the_thread_slab_is_allocated_once_per_thread() {
    let _serial = serial();
    assert_eq!(
        thread_slab_bytes(),
        gemm_common::cache::CACHE_INFO[1].cache_bytes
    );
    let (first, second, len) = std::thread::spawn(|| {
        // No warm-up here: the first touch on a fresh thread is what is measured.
        LIVE.store(0, SeqCst);
        PEAK.store(0, SeqCst);
        MEASURING.set(true);
        WATCH.store(true, SeqCst);
        touch_thread_slab();
        WATCH.store(false, SeqCst);
        let first = PEAK.load(SeqCst) as usize;
        let second = peak_of(&mut touch_thread_slab);
        let len = gemm_common::gemm::L2_SLAB.with(|s| s.borrow().len());
        (first, second, len)
    })
    .join()
    .unwrap();
    row(
        "first touch_thread_slab on a new thread",
        thread_slab_bytes(),
        first,
    );
    assert_eq!(first, thread_slab_bytes());
    assert_eq!(second, 0, "a second touch allocates nothing");
    assert_eq!(len, thread_slab_bytes());
}

// ---------------------------------------------------------------------------------------------
// gemm_core through matmul / matmul_mixed: the f32 path and the 256-blocked path.

fn check_matmul<A: Element, B: Element, C: Element>(
    values: &mut BTreeSet<usize>,
    (m, n, k): (usize, usize, usize),
) {
    let ws_len = matmul_mixed_ws_len::<A, B, C>(m, n, k);
    for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
        let (a, b, mut c, mut ws) = (
            fill::<A>(m * k),
            fill::<B>(k * n),
            fill::<C>(m * n),
            vec![0f32; ws_len],
        );
        let case = format!(
            "matmul<{},{},{}> {m}x{n}x{k} a_trans={a_trans} b_trans={b_trans}",
            A::NAME,
            B::NAME,
            C::NAME
        );
        values.insert(exact(
            &case,
            || matmul_mixed_heap_bytes::<A, B, C>(m, n, k, a_trans, b_trans),
            || matmul_mixed(m, n, k, &a, a_trans, &b, b_trans, &mut c, 1.0, 0.5, &mut ws).unwrap(),
        ));
    }
}

#[test]
fn gemm_core_matches_the_model_for_every_storage() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    let mut shapes = vec![
        (7, 5, 3),
        (128, 10, 512),
        (300, 300, 300),
        (257, 1, 513),
        (600, 70, 40),
        // Deep against its output: the depth cut into 8 parts (`depth_parts`).
        (16, 24, 4096),
    ];
    if HEAVY {
        shapes.extend([
            (32, 64, 36864),
            (128, 512, 784),
            (4096, 512, 784),
            (784, 512, 4096),
            (2048, 64, 288),
        ]);
    }
    for &shape in &shapes {
        check_matmul::<f32, f32, f32>(&mut values, shape);
        check_matmul::<f16, f16, f16>(&mut values, shape);
        check_matmul::<bf16, bf16, bf16>(&mut values, shape);
        check_matmul::<f16, f16, f32>(&mut values, shape);
        check_matmul::<f32, bf16, f16>(&mut values, shape);
    }
    assert_varied("gemm_core", &values, 8);
}

#[test]
fn strided_batches_count_their_parallel_lanes() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    // Small items run in lanes (single-threaded GEMMs, several live at once); large ones one
    // after another.
    // (batch, m, n, k, whether the lanes' GEMMs are long enough to be seen overlapping)
    for (batch, m, n, k, reach) in [
        (6, 40, 50, 60, false),
        (8, 80, 80, 90, true),
        (3, 300, 200, 100, true),
        (1, 50, 60, 70, true),
    ] {
        values.insert(batched::<f32>(batch, m, n, k, 0, reach));
        let per = matmul_strided_batched_ws_len::<f16>(m, n, k);
        values.insert(batched::<f16>(batch, m, n, k, per, reach));
        values.insert(batched::<bf16>(batch, m, n, k, 3 * per, reach));
    }
    assert_varied("matmul_strided_batched", &values, 4);
}

fn batched<T: Element>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    ws_len: usize,
    reach: bool,
) -> usize {
    let (a, b, mut c, mut ws) = (
        fill::<T>(batch * m * k),
        fill::<T>(batch * k * n),
        fill::<T>(batch * m * n),
        vec![0f32; ws_len],
    );
    let case = format!(
        "matmul_strided_batched<{}> {batch}×{m}x{n}x{k} ws={ws_len}",
        T::NAME
    );
    let model = || matmul_strided_batched_heap_bytes::<T>(batch, m, n, k, true, false, ws_len);
    let call = || {
        matmul_strided_batched(
            batch,
            m,
            n,
            k,
            &a,
            true,
            m * k,
            &b,
            false,
            k * n,
            &mut c,
            m * n,
            1.0,
            0.0,
            &mut ws,
        )
        .unwrap()
    };
    lanes(&case, reach, model, call)
}

/// For calls whose items run in parallel lanes (single-threaded GEMMs): the model counts every
/// lane that can run at once as holding its item's peak at the same moment — the worst case.
///
/// On a 1-thread pool one lane runs at a time and the measurement must equal the model. On the
/// 2-thread global pool whether the two lanes' buffers are live at the same instant is up to the
/// scheduler (with tiny GEMMs the first lane is often done before the second thread wakes), so
/// each measurement must lie between one lane's peak (the 1-thread value) and the model — the
/// stated slack is the other lane's peak — and, when `reach`, repeated measurement (up to two
/// seconds) must reach the model, showing the lanes do overlap exactly as counted.
fn lanes(
    case: &str,
    reach: bool,
    model: impl Fn() -> usize + Send + Sync,
    mut call: impl FnMut() + Send,
) -> usize {
    let (one_model, one) = on_pool(pool(1), &model, &mut call);
    row(&format!("{case} [1 thread]"), one_model, one);
    assert_eq!(one, one_model, "{case}: on 1 thread");
    let (mut best, mut model_value) = (0, 0);
    let start = std::time::Instant::now();
    while start.elapsed().as_secs() < 2 {
        let (m, measured) = pool_global(&model, &mut call);
        assert!(measured <= m, "{case}: measured {measured} > model {m}");
        assert!(
            measured >= one_model.min(m),
            "{case}: measured {measured} below one lane's peak {one_model}"
        );
        (best, model_value) = (best.max(measured), m);
        if best == m || !reach {
            break;
        }
    }
    row(case, model_value, best);
    if reach {
        assert_eq!(best, model_value, "{case}: the lanes never overlapped");
    }
    model_value
}

// ---------------------------------------------------------------------------------------------
// The kernels

fn dense_case<T: Element>(values: &mut BTreeSet<usize>, d: DenseDims) {
    let ws_len = dense_ws_len::<T>(d);
    let (x, w, dy) = (
        fill::<T>(d.x_len()),
        fill::<T>(d.w_len()),
        fill::<T>(d.y_len()),
    );
    let bias = vec![0.1f32; d.out_features];
    let (mut y, mut dx, mut dw, mut db, mut ws) = (
        fill::<T>(d.y_len()),
        fill::<T>(d.x_len()),
        vec![0f32; d.w_len()],
        vec![0f32; d.out_features],
        vec![0f32; ws_len],
    );
    let name = format!("dense<{}> {d:?}", T::NAME);
    values.insert(exact(
        &format!("{name} forward"),
        || dense_forward_heap_bytes::<T>(d),
        || dense_forward(d, &x, &w, Some(&bias), &mut y, &mut ws).unwrap(),
    ));
    values.insert(exact(
        &format!("{name} backward"),
        || dense_backward_heap_bytes::<T>(d, true),
        || {
            dense_backward(
                d,
                &x,
                &w,
                &dy,
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &mut ws,
            )
            .unwrap()
        },
    ));
    values.insert(exact(
        &format!("{name} backward, no dx"),
        || dense_backward_heap_bytes::<T>(d, false),
        || dense_backward(d, &x, &w, &dy, None, &mut dw, None, &mut ws).unwrap(),
    ));
}

#[test]
fn dense_matches_its_heap_functions() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    let mut dims = vec![
        (128, 784, 512),
        (128, 512, 10),
        (3, 20, 1),
        (64, 64, 64),
        (300, 70, 260),
    ];
    if HEAVY {
        dims.push((4096, 512, 784));
    }
    for (batch, in_features, out_features) in dims {
        let d = DenseDims {
            batch,
            in_features,
            out_features,
        };
        dense_case::<f32>(&mut values, d);
        dense_case::<f16>(&mut values, d);
        dense_case::<bf16>(&mut values, d);
    }
    assert_varied("dense", &values, 6);
}

fn conv_dims() -> Vec<Conv2dDims> {
    let conv = |n, h, w, c_in, c_out, k, s, padding| Conv2dDims {
        n,
        h,
        w,
        c_in,
        c_out,
        kh: k,
        kw: k,
        sh: s,
        sw: s,
        padding,
    };
    let mut dims = vec![
        conv(4, 12, 12, 3, 16, 3, 1, Padding::Same),
        conv(5, 9, 7, 8, 4, 3, 2, Padding::Valid),
        conv(3, 8, 8, 16, 24, 1, 1, Padding::Same),
        conv(2, 6, 6, 1, 1, 2, 1, Padding::Valid),
        // More than 2·MR output channels: the packing decisions depend on every stride.
        conv(2, 6, 6, 4, 40, 3, 1, Padding::Same),
        conv(2, 5, 5, 36, 40, 1, 1, Padding::Same),
    ];
    if HEAVY {
        dims.push(conv(16, 28, 28, 32, 64, 3, 1, Padding::Same));
    }
    dims
}

fn conv2d_case<T: Element>(values: &mut BTreeSet<usize>, d: Conv2dDims, chunk: usize) {
    let (x, w, dy) = (
        fill::<T>(d.x_len()),
        fill::<T>(d.w_len()),
        fill::<T>(d.y_len()),
    );
    let bias = vec![0.1f32; d.c_out];
    let (mut y, mut dx, mut dw, mut db) = (
        fill::<T>(d.y_len()),
        fill::<T>(d.x_len()),
        vec![0f32; d.w_len()],
        vec![0f32; d.c_out],
    );
    let mut col = fill::<T>(conv2d_col_len(d, chunk));
    let mut ws = vec![0f32; conv2d_ws_len::<T>(d, chunk)];
    let name = format!("conv2d<{}> {d:?} chunk {chunk}", T::NAME);
    values.insert(exact(
        &format!("{name} forward"),
        || conv2d_forward_heap_bytes::<T>(d, chunk),
        || conv2d_forward(d, &x, &w, Some(&bias), &mut y, &mut col, chunk, &mut ws).unwrap(),
    ));
    for with_dx in [true, false] {
        values.insert(exact(
            &format!("{name} backward dx={with_dx}"),
            || conv2d_backward_heap_bytes::<T>(d, chunk, with_dx),
            || {
                let dx = with_dx.then_some(&mut dx[..]);
                conv2d_backward(
                    d,
                    &x,
                    &w,
                    &dy,
                    dx,
                    &mut dw,
                    Some(&mut db),
                    &mut col,
                    chunk,
                    &mut ws,
                )
                .unwrap()
            },
        ));
    }
}

#[test]
fn conv2d_matches_its_heap_functions() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    for d in conv_dims() {
        for chunk in [1, 3, d.n] {
            conv2d_case::<f32>(&mut values, d, chunk);
            conv2d_case::<f16>(&mut values, d, chunk);
        }
        conv2d_case::<bf16>(&mut values, d, 2);
    }
    assert_varied("conv2d", &values, 6);
}

fn transpose_case<T: Element>(values: &mut BTreeSet<usize>, c: Conv2dDims, chunk: usize) {
    let d = ConvTranspose2dDims {
        n: c.n,
        h: c.h,
        w: c.w,
        c_in: c.c_in,
        c_out: c.c_out,
        kh: c.kh,
        kw: c.kw,
        sh: c.sh,
        sw: c.sw,
        padding: c.padding,
    };
    let (x, w, dy) = (
        fill::<T>(d.x_len()),
        fill::<T>(d.w_len()),
        fill::<T>(d.y_len()),
    );
    let bias = vec![0.1f32; d.c_out];
    let (mut y, mut dx, mut dw, mut db) = (
        fill::<T>(d.y_len()),
        fill::<T>(d.x_len()),
        vec![0f32; d.w_len()],
        vec![0f32; d.c_out],
    );
    let mut col = fill::<T>(conv2d_transpose_col_len(d, chunk));
    let mut ws = vec![0f32; conv2d_transpose_ws_len::<T>(d, chunk)];
    let name = format!("conv2d_transpose<{}> {d:?} chunk {chunk}", T::NAME);
    values.insert(exact(
        &format!("{name} forward"),
        || conv2d_transpose_forward_heap_bytes::<T>(d, chunk),
        || {
            conv2d_transpose_forward(d, &x, &w, Some(&bias), &mut y, &mut col, chunk, &mut ws)
                .unwrap()
        },
    ));
    for with_dx in [true, false] {
        values.insert(exact(
            &format!("{name} backward dx={with_dx}"),
            || conv2d_transpose_backward_heap_bytes::<T>(d, chunk, with_dx),
            || {
                let dx = with_dx.then_some(&mut dx[..]);
                conv2d_transpose_backward(
                    d,
                    &x,
                    &w,
                    &dy,
                    dx,
                    &mut dw,
                    Some(&mut db),
                    &mut col,
                    chunk,
                    &mut ws,
                )
                .unwrap()
            },
        ));
    }
}

#[test]
fn conv2d_transpose_matches_its_heap_functions() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    for d in conv_dims() {
        for chunk in [1, 3, d.n] {
            transpose_case::<f32>(&mut values, d, chunk);
            transpose_case::<bf16>(&mut values, d, chunk);
        }
        transpose_case::<f16>(&mut values, d, 2);
    }
    assert_varied("conv2d_transpose", &values, 6);
}

fn attention_case<T: Element>(
    values: &mut BTreeSet<usize>,
    d: AttentionDims,
    ws_len: usize,
    reach: bool,
) {
    let qkv = fill::<T>(d.qkv_len());
    let (sc, ctx) = (fill::<T>(d.scores_len()), fill::<T>(d.ctx_len()));
    let (mut out_sc, mut out_ctx, mut dqkv) = (
        fill::<T>(d.scores_len()),
        fill::<T>(d.ctx_len()),
        fill::<T>(d.qkv_len()),
    );
    let mut ws = vec![0f32; ws_len];
    let name = format!("attention<{}> {d:?} ws={ws_len}", T::NAME);
    let mut run =
        |what: &str, model: &(dyn Fn() -> usize + Sync), call: &mut (dyn FnMut() + Send)| {
            values.insert(lanes(&format!("{name} {what}"), reach, model, call));
        };
    run(
        "scores_forward",
        &|| scores_forward_heap_bytes::<T>(d, ws_len),
        &mut || scores_forward(d, &qkv, &mut out_sc, 0.3, true, &mut ws).unwrap(),
    );
    run(
        "scores_backward",
        &|| scores_backward_heap_bytes::<T>(d, ws_len),
        &mut || scores_backward(d, &sc, &qkv, &mut dqkv, 0.3, &mut ws).unwrap(),
    );
    run(
        "context_forward",
        &|| context_forward_heap_bytes::<T>(d, ws_len),
        &mut || context_forward(d, &sc, &qkv, &mut out_ctx, &mut ws).unwrap(),
    );
    run(
        "context_backward",
        &|| context_backward_heap_bytes::<T>(d, ws_len),
        &mut || context_backward(d, &ctx, &sc, &qkv, &mut out_sc, &mut dqkv, &mut ws).unwrap(),
    );
}

#[test]
fn attention_matches_its_heap_functions() {
    let _serial = serial();
    let mut values = BTreeSet::new();
    let att = |batch, seq, hidden, heads| AttentionDims {
        batch,
        seq,
        hidden,
        heads,
    };
    // (dims, whether each pair's GEMMs are long enough for the lanes to be seen overlapping)
    let mut dims = vec![
        (att(2, 16, 32, 4), false),
        (att(2, 96, 64, 2), true),
        (att(1, 80, 96, 1), true),
        (att(1, 70, 48, 3), false),
        (att(4, 128, 128, 4), true),
        // Heads wider than 2·MR, keys longer than heads: the `Pᵀ·dctx` GEMM packs and dominates.
        (att(1, 128, 64, 1), true),
        // Pairs above gemm's threading threshold: single-threaded only because they are lanes.
        (att(2, 160, 64, 2), true),
    ];
    if HEAVY {
        dims.push((att(4, 300, 256, 4), true));
    }
    for (d, reach) in dims {
        attention_case::<f32>(&mut values, d, 0, reach);
        // Half storage: the planner's lanes; then one lane only (pairs one after another,
        // each GEMM threaded).
        let planned = attention_ws_len::<f16>(d);
        attention_case::<f16>(&mut values, d, planned, reach);
        let one_lane = attention_ws_len::<bf16>(d) / (d.batch * d.heads).min(ATTENTION_LANES);
        attention_case::<bf16>(&mut values, d, one_lane, reach);
    }
    assert_varied("attention", &values, 6);
}

/// The memory-efficient attention: f32 tile GEMMs in lanes, whatever the storage.
#[test]
fn flash_attention_matches_its_heap_functions() {
    use memwise_kernels::flash_attention::*;
    let _serial = serial();
    let att = |batch, seq, hidden, heads| AttentionDims {
        batch,
        seq,
        hidden,
        heads,
    };
    for (d, reach) in [
        (att(2, 16, 32, 4), false),
        (att(1, 70, 48, 3), false),
        // At 200 and 130 rows only the last query tile's units meet the short tiles whose
        // GEMMs hold the most, so two lanes seldom hold it at once: 1 thread checks the peak
        // there, and whole tiles (192, 128 rows) check that the lanes overlap as counted.
        (att(2, 200, 128, 2), false),
        (att(2, 192, 128, 2), true),
        (att(1, 130, 256, 2), false),
        (att(1, 128, 256, 2), true),
    ] {
        let qkv = fill::<f16>(d.qkv_len());
        let (dctx, mut ctx, mut dqkv) = (
            fill::<f16>(d.ctx_len()),
            fill::<f16>(d.ctx_len()),
            fill::<f16>(d.qkv_len()),
        );
        let mut lse = vec![0f32; d.batch * d.heads * d.seq];
        let ws_len = flash_scratch_len(d);
        let mut ws = vec![0f32; ws_len];
        let name = format!("flash_attention {d:?}");
        lanes(
            &format!("{name} forward"),
            reach,
            || flash_forward_heap_bytes(d, ws_len),
            || {
                flash_attention_forward(d, &qkv, &mut ctx, &mut lse, 0.3, true, None, &mut ws)
                    .unwrap()
            },
        );
        let lse_in = lse.clone();
        let ctx_in = ctx.clone();
        lanes(
            &format!("{name} backward"),
            reach,
            || flash_backward_heap_bytes(d, ws_len),
            || {
                flash_attention_backward(
                    d, &qkv, &ctx_in, &lse_in, &dctx, &mut dqkv, 0.3, true, None, &mut ws,
                )
                .unwrap()
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Outside the pool

#[test]
fn calls_from_outside_the_pool() {
    let _serial = serial();
    // From a thread outside rayon's pool every threaded step is injected into rayon's global
    // queue, a linked list of blocks of 63 jobs (crossbeam-deque's Injector): now and then a
    // call allocates the next block or frees a used one. That is rayon's, not the gemm crate's,
    // so the model leaves it out and the measurement may differ by one block either way.
    const INJECTOR_BLOCK: usize = 63 * 24 + 8;
    let (m, n, k) = (256, 256, 256);
    let (a, b, mut c) = (fill::<f32>(m * k), fill::<f32>(k * n), fill::<f32>(m * n));
    let model = matmul_heap_bytes::<f32>(m, n, k, true, false);
    for _ in 0..5 {
        let measured = peak_of(&mut || {
            matmul(m, n, k, &a, true, &b, false, &mut c, 1.0, 0.0, &mut []).unwrap()
        });
        row(
            "matmul<f32> 256x256x256 a_trans from outside the pool",
            model,
            measured,
        );
        assert!(
            measured.abs_diff(model) <= INJECTOR_BLOCK,
            "{measured} vs {model}"
        );
    }
}
