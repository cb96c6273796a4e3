//! What the `gemm` crate (0.19) allocates: the heap held inside each GEMM call, as a pure
//! function of the call, and the slab each thread keeps.
//!
//! Every other kernel in this crate allocates nothing; the `gemm` crate does, inside each call
//! (freed before it returns): one packing buffer sized by its cache blocking, a `Vec<bool>` of
//! "panel already packed" flags, and one more such `Vec` on every extra thread of a threaded
//! call. Besides, every thread that has ever run a packing GEMM keeps a thread-local slab
//! (`gemm_common::gemm::L2_SLAB`, the size of one core's L2 cache), allocated on first use and
//! never freed. This module pins both down:
//!
//! - [`library_heap_bytes`]: the peak heap of one `gemm::gemm` call as `sgemm_raw` makes it,
//!   from its arguments — gemm 0.19's rule (`gemm::gemm`, then
//!   `gemm_common::gemm::gemm_basic_generic` for the f32 kernel it dispatches to on this CPU),
//!   restated here. The cache blocking is not re-derived: it comes from `gemm_common`'s own
//!   `cache::kernel_params` and `cache::CACHE_INFO`.
//! - [`gemm_core_heap_bytes`]: the peak over the `sgemm_raw` calls one `gemm_core` makes.
//! - [`thread_slab_bytes`] / [`touch_thread_slab`]: the slab, so a process can claim it once per
//!   thread up front instead of at some thread's first GEMM.
//!
//! The kernels' own `*_heap_bytes` functions (beside their `*_ws_len` twins) combine these.
//! `tests/gemm_heap.rs` measures every rule here with a counting allocator, so a `gemm`
//! release that allocates differently fails there rather than silently here.
//!
//! Scope: the `gemm` crate's allocations only. Rayon's own bookkeeping (its global job queue
//! allocates a block now and then when work is injected from outside the pool) is not the
//! `gemm` crate's and is not modelled.

use crate::gemm::{depth_parts, is_f32, BLOCK_K, BLOCK_M, BLOCK_N};
use crate::Element;
use gemm::Parallelism;
use gemm_common::cache::{kernel_params, KernelParams, CACHE_INFO};
use gemm_common::gemm::{
    get_rhs_packing_threshold, get_threading_threshold, CACHELINE_ALIGN, L2_SLAB,
};
use std::mem::{size_of, MaybeUninit};

/// Strides of a matrix view, in elements: element `(i, j)` at `i·rs + j·cs` (the crate's
/// internal `Mat`/`MatMut` views, without the pointer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    pub rs: usize,
    pub cs: usize,
}

impl Strides {
    pub const fn new(rs: usize, cs: usize) -> Self {
        Strides { rs, cs }
    }
    /// Rows `ld` elements apart, columns contiguous (`MatMut::row_major`).
    pub const fn row_major(ld: usize) -> Self {
        Strides { rs: ld, cs: 1 }
    }
    /// `op(x)` of a contiguous row-major matrix with `rows×cols` *after* `op`: `x[rows, cols]`,
    /// or `x[cols, rows]` read transposed when `trans` (`Mat::dense`).
    pub const fn dense(rows: usize, cols: usize, trans: bool) -> Self {
        if trans {
            Strides { rs: 1, cs: rows }
        } else {
            Strides { rs: cols, cs: 1 }
        }
    }
    /// The transposed view (`Mat::t`).
    pub const fn t(self) -> Self {
        Strides {
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// Geometry of the f32 kernel `gemm_f32` 0.19 dispatches to (its `init_gemm_fn`): vector
/// width `n`, micro-tile `mr × nr`, and whether it has the small-product "horizontal" kernels
/// (`H_M > 0 && H_N > 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct F32Kernel {
    pub n: usize,
    pub mr: usize,
    pub nr: usize,
    pub horizontal: bool,
}

impl F32Kernel {
    /// The kernel of vector width `n`, micro-tile `mr × nr`, with or without the horizontal
    /// kernels.
    pub const fn new(n: usize, mr: usize, nr: usize, horizontal: bool) -> Self {
        F32Kernel {
            n,
            mr,
            nr,
            horizontal,
        }
    }
}

/// The f32 kernel gemm 0.19 picks on this CPU. x86-64: the AVX-512 kernel when the CPU has
/// AVX-512F (`N = 16`, `MR = 64`, `NR = 6`, horizontal 4×4; gemm's `x86-v4` feature, which
/// this workspace enables), else the FMA (AVX2) kernel when it has FMA (`N = 8`, `MR = 16`,
/// `NR = 6`, horizontal 2×2), else the scalar one (`N = 1`, `MR = 2`, `NR = 4`, none).
/// aarch64: the NEON kernel (`N = 4`, `MR = 16`, `NR = 4`).
/// Elsewhere the scalar kernel (wasm's optional simd128 kernel is not modelled).
pub fn f32_kernel() -> F32Kernel {
    const SCALAR: F32Kernel = F32Kernel::new(1, 2, 4, false);
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return F32Kernel::new(16, 64, 6, true);
    }
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if std::arch::is_x86_feature_detected!("fma") {
        return F32Kernel::new(8, 16, 6, true);
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return F32Kernel::new(4, 16, 4, false);
    }
    SCALAR
}

/// Bytes of the L2-sized slab (`gemm_common::gemm::L2_SLAB`) that every thread running a
/// packing GEMM allocates once and keeps until it exits: `CACHE_INFO[1].cache_bytes`.
pub fn thread_slab_bytes() -> usize {
    CACHE_INFO[1].cache_bytes
}

/// Allocates the calling thread's `gemm` slab if it does not exist yet and writes every byte of
/// it, so that its pages are resident from now on rather than from some later GEMM. Call it on
/// each thread that will run GEMMs (every rayon worker and the calling thread) before
/// measuring or budgeting; afterwards no GEMM allocates a slab.
///
/// Panics if called from inside a `gemm` call on the same thread (the slab is borrowed then).
pub fn touch_thread_slab() {
    L2_SLAB.with(|slab| {
        let mut slab = slab.borrow_mut();
        slab.fill(MaybeUninit::new(0));
        std::hint::black_box(&mut *slab);
    });
}

/// `len` rounded up to a multiple of `align` (a power of two).
fn round_up(len: usize, align: usize) -> usize {
    len.div_ceil(align) * align
}

/// True when `gemm_basic_generic` (gemm-common 0.19) returns before allocating: an empty
/// product, the horizontal kernels (`lhs_cs == 1`, `rhs_rs == 1`, `m·n ≤ 256`), a depth of at
/// most 2 (`gevv`), or one of the four GEMV layouts.
fn no_alloc_path(
    m: usize,
    n: usize,
    k: usize,
    lhs: Strides,
    rhs: Strides,
    dst: Strides,
    kern: F32Kernel,
) -> bool {
    m == 0
        || n == 0
        || k == 0
        || (kern.horizontal && lhs.cs == 1 && rhs.rs == 1 && m * n <= 16 * 16)
        || k <= 2
        || (n <= 1 && lhs.rs == 1 && dst.rs == 1)
        || (n <= 1 && lhs.cs == 1 && rhs.rs == 1)
        || (m <= 1 && rhs.cs == 1 && dst.cs == 1)
        || (m <= 1 && rhs.rs == 1 && lhs.cs == 1)
}

/// Peak heap bytes the `gemm` crate (0.19) holds during one call of the crate's private
/// `sgemm_raw`, i.e. `gemm::gemm::<f32>` for `c[m×n] = a[m×k]·b[k×n]` (+ `c` when `read_dst`)
/// with views of these strides (never negative here), on `par`.
///
/// Mirrors gemm 0.19 step by step: `gemm::gemm` computes a destination with `c.cs < c.rs` as
/// its transpose (`m`/`n` and the operands swap); `gemm_basic_generic` then allocates nothing on
/// its early paths (see the private `no_alloc_path`), and otherwise takes its blocking `kc, mc,
/// nc` from its small-size rule (`m, n ≤ 64`) or `kernel_params`, and allocates
///
/// 1. the packing buffer, when it packs the rhs (`rhs_rs ≠ 1 && m > 2·MR`, or `rhs_rs == 1 &&
///    m > rhs_packing_threshold·MR`; aarch64: `m > rhs_packing_threshold·MR`) or pre-packs the
///    lhs (`m ≤ 2·mc && (m % N ≠ 0 || lhs_rs ≠ 1)`): `4·kc·NR·(nc/NR)` and
///    `4·kc·MR·⌈m/MR⌉` bytes, each rounded up to 128 (`CACHELINE_ALIGN`, `StackReq::and`);
/// 2. `mc/MR` bytes of packed-panel flags (`vec![false; mc / MR]`);
/// 3. on each of threads `1..T` of a threaded block, another `mc/MR` bytes. A block is
///    threaded when `par` is rayon with `T > 1` threads (`Rayon(0)`: the current pool's) and
///    `m·n_chunk·k_chunk ≥ get_threading_threshold()` for its largest chunk.
///
/// Item 3 counts all `T-1` flag vectors as live at once: exact with 2 threads, an upper bound by
/// at most `(T-2)·mc/MR` bytes beyond (they are allocated and freed by the threads as they
/// start and finish). `read_dst` changes no allocation in 0.19 (it only zeroes alpha); it is an
/// argument so that the model's inputs are exactly the call's.
#[allow(clippy::too_many_arguments)]
pub fn library_heap_bytes(
    m: usize,
    n: usize,
    k: usize,
    a: Strides,
    b: Strides,
    read_dst: bool,
    c: Strides,
    par: Parallelism,
) -> usize {
    let _ = read_dst;
    // gemm::gemm: "transpose if the destination is column-oriented".
    let (m, n, lhs, rhs, dst) = if c.cs < c.rs {
        (n, m, b.t(), a.t(), c.t())
    } else {
        (m, n, a, b, c)
    };
    let kern = f32_kernel();
    if no_alloc_path(m, n, k, lhs, rhs, dst, kern) {
        return 0;
    }
    let (mr, nr, f32_bytes) = (kern.mr, kern.nr, size_of::<f32>());
    let KernelParams { kc, mc, nc } = if m <= 64 && n <= 64 {
        let kc = k.min(512);
        let mc = (CACHE_INFO[1].cache_bytes / f32_bytes / kc) / mr * mr;
        KernelParams {
            kc,
            mc,
            nc: n.next_multiple_of(nr),
        }
    } else {
        kernel_params(m, n, k, mr, nr, f32_bytes)
    };
    let nc = match (nc, par) {
        (0, Parallelism::None) => 128 * nr,
        (0, Parallelism::Rayon(_)) => n.next_multiple_of(nr),
        (nc, _) => nc,
    };
    let pack_rhs = if cfg!(target_arch = "aarch64") {
        m > get_rhs_packing_threshold() * mr
    } else {
        (rhs.rs != 1 && m > 2 * mr) || (rhs.rs == 1 && m > get_rhs_packing_threshold() * mr)
    };
    let prepack_lhs = m <= 2 * mc && (!m.is_multiple_of(kern.n) || lhs.rs != 1);
    let rhs_bytes = if pack_rhs {
        kc * nr * (nc / nr) * f32_bytes
    } else {
        0
    };
    let lhs_bytes = if prepack_lhs {
        kc * mr * m.div_ceil(mr) * f32_bytes
    } else {
        0
    };
    let packing = round_up(rhs_bytes, CACHELINE_ALIGN) + round_up(lhs_bytes, CACHELINE_ALIGN);
    let flags = mc / mr;
    let threads = match par {
        Parallelism::None => 1,
        Parallelism::Rayon(0) => rayon::current_num_threads(),
        Parallelism::Rayon(t) => t,
    };
    let threaded =
        threads > 1 && (m * nc.min(n)).saturating_mul(kc.min(k)) >= get_threading_threshold();
    let per_thread_flags = if threaded { (threads - 1) * flags } else { 0 };
    packing + flags + per_thread_flags
}

/// The distinct sizes of the `block`-long pieces `0..len` is cut into, each with whether it is
/// the first piece: `(min(len, block), true)`, then `(block, false)` if there are two full
/// pieces or more, then `(len % block, false)` for a short last piece.
pub(crate) fn pieces(len: usize, block: usize) -> impl Iterator<Item = (usize, bool)> {
    let later_full = len >= 2 * block;
    let short_last = (len > block && !len.is_multiple_of(block)).then_some((len % block, false));
    std::iter::once((len.min(block), true))
        .chain(later_full.then_some((block, false)))
        .chain(short_last)
}

/// Strides of the f32 view `f32_block` gives a `rows×cols` block of `src` with storage `S`:
/// `src`'s own when `S` is f32, else the converted copy's, laid out along `src`'s contiguous
/// direction (`(cols, 1)` when `src.cs == 1`, `(1, rows)` when only `src.rs == 1`, else
/// `(cols, 1)`).
fn f32_block_strides<S: Element>(src: Strides, rows: usize, cols: usize) -> Strides {
    if is_f32::<S>() {
        src
    } else if src.cs == 1 {
        Strides::row_major(cols)
    } else if src.rs == 1 {
        Strides::new(1, rows)
    } else {
        Strides::row_major(cols)
    }
}

/// The heap of `sgemm_depth_split` (an all-f32 product): with one depth part, the library
/// call's; with more, the buffer of the later parts' products plus the library heap of the
/// parts that run at once — each part single-threaded, as many at once as the pool has
/// threads (exact on one thread, a bound on more).
#[allow(clippy::too_many_arguments)]
fn depth_split_heap_bytes(
    m: usize,
    n: usize,
    k: usize,
    a: Strides,
    b: Strides,
    read_dst: bool,
    c: Strides,
    par: Parallelism,
) -> usize {
    let (parts, per) = depth_parts(m, n, k);
    if parts == 1 {
        return library_heap_bytes(m, n, k, a, b, read_dst, c, par);
    }
    let part = |p: usize| {
        let kb = per.min(k - p * per);
        let (read, dst) = if p == 0 {
            (read_dst, c)
        } else {
            (false, Strides::row_major(n))
        };
        library_heap_bytes(m, n, kb, a, b, read, dst, Parallelism::None)
    };
    let largest = (0..parts).map(part).max().unwrap_or(0);
    let at_once = match par {
        Parallelism::None => 1,
        _ => rayon::current_num_threads().clamp(1, parts),
    };
    (parts - 1) * m * n * size_of::<f32>() + at_once * largest
}

/// Peak heap bytes the `gemm` crate holds during one call of the crate's `gemm_core::<A, B, C>`
/// with these dims, view strides, `beta`, bias presence and parallelism: the largest
/// [`library_heap_bytes`] over the `sgemm_raw` calls it makes (they run one after another).
///
/// All-f32 operands: one call on the views themselves (`c` is read when `beta ≠ 0` or when a
/// bias was folded into it). Otherwise the blocked path: one call per `256×256×256` block, on the
/// strides `f32_block` gives each converted block and, for a non-f32 `c`, on the row-major
/// `f32` accumulator of `nb` columns. `0` when `m`, `n` or `k` is `0` (no call).
#[allow(clippy::too_many_arguments)]
pub fn gemm_core_heap_bytes<A: Element, B: Element, C: Element>(
    m: usize,
    n: usize,
    k: usize,
    a: Strides,
    b: Strides,
    beta: f32,
    c: Strides,
    bias: bool,
    par: Parallelism,
) -> usize {
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    let c_is_f32 = is_f32::<C>();
    // gemm_core folds beta and the bias into an f32 destination first, then adds with beta = 1.
    let beta = if c_is_f32 && bias { 1.0 } else { beta };
    if is_f32::<A>() && is_f32::<B>() && c_is_f32 {
        return depth_split_heap_bytes(m, n, k, a, b, beta != 0.0, c, par);
    }
    let mut peak = 0;
    for (mb, _) in pieces(m, BLOCK_M) {
        for (nb, _) in pieces(n, BLOCK_N) {
            let dst = if c_is_f32 { c } else { Strides::row_major(nb) };
            for (kb, first) in pieces(k, BLOCK_K) {
                let ap = f32_block_strides::<A>(a, mb, kb);
                let bp = f32_block_strides::<B>(b, kb, nb);
                // The first depth block writes (f32 c: scales by beta), later ones accumulate.
                let read = !first || (c_is_f32 && beta != 0.0);
                peak = peak.max(library_heap_bytes(mb, nb, kb, ap, bp, read, dst, par));
            }
        }
    }
    peak
}
