//! The emulator's strict checks (`memwise-cuda-emu`; docs/CUDA.md, "Emulation"):
//!
//! - every block's `__shared__` memory starts as NaN, so a kernel that reads shared memory it
//!   did not write gets NaN, not the zeros of a fresh variable or what the previous block left;
//! - with the race check on, a launch fails when two of its threads access one byte of global
//!   or shared memory, one of them writing, with nothing ordering them;
//! - every kernel declares its block size as `__launch_bounds__`, and a launch with a larger
//!   block is refused, as a GPU refuses it.
//!
//! First on deliberately wrong kernels (`kernels/cuda/emu/selftest.cu`), which the checks must
//! flag, and correct ones, which they must pass; then on a representative set of the real
//! kernels (channel strips split over grid z with f64 partials, the pass that adds them,
//! softmax, a loss value over several blocks, pooling, layer norm), which must show no race.
//! Each test turns the race check on for its own thread (`emu::check_races`), whatever
//! `MW_EMU_RACES` says.

use half::{bf16, f16};
use memwise_cuda_emu as emu;
use memwise_kernels as k;
use memwise_kernels::cuda::launch::{
    self as l, name1, name2, Float, KArg, KernelCall, LaunchCfg, MwPool, MwScalars,
};
use memwise_kernels::Element;

/// Launches `name` as the device executor would; the emulator's error, if any.
fn launch(name: &str, cfg: LaunchCfg, args: Vec<KArg>) -> Result<(), String> {
    let call = KernelCall::new(name, cfg, args);
    // SAFETY: every pointer argument is a live host buffer sized for the kernel's dims.
    unsafe {
        emu::launch(
            &call.name,
            call.cfg.grid,
            call.cfg.block,
            &call.params(),
            &call.signature(),
        )
    }
}

#[track_caller]
fn run(name: &str, cfg: LaunchCfg, args: Vec<KArg>) {
    launch(name, cfg, args).unwrap_or_else(|e| panic!("{e}"));
}

fn p<T>(v: &[T]) -> KArg {
    KArg::host(v.as_ptr())
}
fn pm<T>(v: &mut [T]) -> KArg {
    KArg::host(v.as_mut_ptr())
}
fn u(n: usize) -> KArg {
    KArg::U64(n as u64)
}
fn scal(s: &mut MwScalars) -> KArg {
    KArg::host(s as *mut MwScalars)
}
const NULL: KArg = KArg::Ptr(0);

fn shape(grid: u32, block: u32) -> LaunchCfg {
    LaunchCfg {
        grid: [grid, 1, 1],
        block: [block, 1, 1],
    }
}

/// Deterministic inputs (an LCG: the values only need to be varied).
struct Rng(u64);
impl Rng {
    fn f(&mut self, lo: f32, hi: f32) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn vec<T: Element>(&mut self, n: usize, lo: f32, hi: f32) -> Vec<T> {
        (0..n).map(|_| T::from_f32(self.f(lo, hi))).collect()
    }
}

fn races_on() {
    assert!(
        emu::races_available(),
        "the emulator was built without its race hooks (it needs GCC)"
    );
    emu::check_races(Some(true));
}

// ---------------------------------------------------------------------------------------------
// the checks flag wrong kernels and pass correct ones

#[test]
fn unwritten_shared_memory_reads_as_nan() {
    // Not a race (every read comes after the barrier): only the NaN fill shows it, so it is
    // seen with the race check off too.
    emu::check_races(Some(false));
    let (blocks, n) = (3usize, 64usize);
    let mut out = vec![0f32; blocks * n];
    run(
        "mw_emu_selftest_unwritten_shared",
        shape(blocks as u32, n as u32),
        vec![pm(&mut out)],
    );
    for b in 0..blocks {
        for t in 0..n {
            let v = out[b * n + t];
            if b == 0 || t == 0 {
                assert_eq!(v, 1.0, "block {b} thread {t} wrote sh[{t}] itself");
            } else {
                // Not 0 (a fresh thread_local) nor 1 (what block 0 left in it).
                assert!(v.is_nan(), "block {b} thread {t} read {v}, not NaN");
            }
        }
    }
}

#[test]
fn a_write_write_race_between_blocks_is_flagged() {
    races_on();
    let mut out = vec![0f32; 4];
    let e = launch(
        "mw_emu_selftest_cross_block_write",
        shape(4, 32),
        vec![pm(&mut out)],
    )
    .unwrap_err();
    assert!(
        e.contains("data race on global memory at parameter 0 + 0 bytes"),
        "{e}"
    );
    assert!(e.contains("writes it after thread (0,0,0) of block"), "{e}");
    assert!(e.contains("blocks of one launch never synchronise"), "{e}");
    // The check is opt-in: off, the same launch runs (and one block's write wins).
    emu::check_races(Some(false));
    run(
        "mw_emu_selftest_cross_block_write",
        shape(4, 32),
        vec![pm(&mut out)],
    );
}

#[test]
fn a_read_after_write_race_in_a_block_is_flagged_and_a_barrier_orders_it() {
    races_on();
    let (blocks, n) = (2usize, 64usize);
    let mut out = vec![0f32; blocks + blocks * n];
    let e = launch(
        "mw_emu_selftest_unsynced_read",
        shape(blocks as u32, n as u32),
        vec![pm(&mut out)],
    )
    .unwrap_err();
    assert!(
        e.contains("data race on global memory at parameter 0"),
        "{e}"
    );
    assert!(e.contains("with no __syncthreads between them"), "{e}");

    out.fill(0.0);
    run(
        "mw_emu_selftest_synced_read",
        shape(blocks as u32, n as u32),
        vec![pm(&mut out)],
    );
    for b in 0..blocks {
        assert!(out[blocks + b * n..blocks + (b + 1) * n]
            .iter()
            .all(|&v| v == 1.0 + b as f32));
    }
}

#[test]
fn a_race_on_shared_memory_is_flagged() {
    races_on();
    let mut out = vec![0f32; 64];
    let e = launch(
        "mw_emu_selftest_shared_race",
        shape(1, 64),
        vec![pm(&mut out)],
    )
    .unwrap_err();
    assert!(e.contains("data race on shared memory `sh`"), "{e}");
    // A __syncwarp orders the lanes of a warp (a memory barrier among them in CUDA).
    run(
        "mw_emu_selftest_warp_synced",
        shape(1, 64),
        vec![pm(&mut out)],
    );
    assert!((0..64).all(|t| out[t] == (t ^ 1) as f32));
}

#[test]
fn correct_kernels_pass_the_race_check() {
    races_on();
    // Atomics on one address from every thread are exempt; a thread reads its own writes.
    let (blocks, n) = (3usize, 128usize);
    let mut out = vec![0f32; 1 + blocks * n];
    run(
        "mw_emu_selftest_atomic_count",
        shape(blocks as u32, n as u32),
        vec![pm(&mut out)],
    );
    assert_eq!(out[0], (blocks * n) as f32);
    assert!(out[1..].iter().all(|&v| v == 3.0));
    // A block sum through shared memory and barriers; shared memory is reused by each block.
    let mut sums = vec![0i32; 3];
    run(
        "mw_emu_selftest_block_sum",
        shape(3, 256),
        vec![pm(&mut sums)],
    );
    assert_eq!(sums, [255 * 256 / 2; 3]);
}

// ---------------------------------------------------------------------------------------------
// real kernels: no race

/// Channel strips, not split and split over grid z with f64 partials, and the pass that adds
/// the parts: `mw_column_sums_f32` on grid (2, 1, 3), `mw_add_parts`, batch norm's split
/// statistics and its forward pass.
#[test]
fn norm_strips_have_no_race() {
    races_on();
    let r = &mut Rng(1);
    let (rows, cols) = (517usize, 45usize);
    let m: Vec<f32> = r.vec(rows * cols, -1.0, 1.0);
    let want: Vec<f64> = (0..cols)
        .map(|j| (0..rows).map(|i| m[i * cols + j] as f64).sum())
        .collect();
    for parts in [1usize, 3] {
        let mut sums = vec![0f32; cols];
        let mut pv = vec![f64::NAN; parts * cols];
        let cfg = LaunchCfg::strip_parts(cols as u64, 1, parts as u32);
        if parts == 3 {
            assert_eq!(cfg.grid, [2, 1, 3]);
        }
        let pa = if parts > 1 { pm(&mut pv) } else { NULL };
        run(
            "mw_column_sums_f32",
            cfg,
            vec![p(&m), u(rows), u(cols), pm(&mut sums), pa],
        );
        if parts > 1 {
            run(
                "mw_add_parts",
                LaunchCfg::pointwise(cols as u64),
                vec![p(&pv), u(parts), u(cols), u(cols), pm(&mut sums)],
            );
        }
        for j in 0..cols {
            assert!(
                (sums[j] as f64 - want[j]).abs() < 1e-4,
                "column {j} in {parts} parts: {} vs {}",
                sums[j],
                want[j]
            );
        }
    }

    // Batch norm in training, split in three: Σx, Σ(x − mean)², then the forward pass.
    let (rows, c) = (300usize, 45usize);
    let x: Vec<bf16> = r.vec(rows * c, 1.0, 5.0);
    let (gamma, beta): (Vec<f32>, Vec<f32>) = (r.vec(c, 0.5, 1.5), r.vec(c, -0.5, 0.5));
    for parts in [1usize, 3] {
        let strip = LaunchCfg::strip_parts(c as u64, 1, parts as u32);
        let mut pv = vec![f64::NAN; parts * 2 * c];
        let pa = if parts > 1 { pm(&mut pv) } else { NULL };
        if parts > 1 {
            run(
                "mw_column_sums_bf16",
                strip,
                vec![p(&x), u(rows), u(c), NULL, pa],
            );
            run(
                "mw_bn_var_parts_bf16",
                strip,
                vec![p(&x), u(rows), u(c), pa],
            );
        }
        let mut y = vec![bf16::ZERO; rows * c];
        let mut h = vec![bf16::ZERO; rows * c];
        let (mut mean, mut inv) = (vec![0f32; 2 * c], vec![0f32; c]);
        let (mut rm, mut rv) = (vec![0f32; c], vec![1f32; c]);
        run(
            "mw_bn_train_fwd_bf16",
            strip,
            vec![
                p(&x),
                pm(&mut y),
                pm(&mut h),
                pm(&mut mean),
                pm(&mut inv),
                pm(&mut rm),
                pm(&mut rv),
                p(&gamma),
                p(&beta),
                u(rows),
                u(c),
                KArg::F32(1e-3),
                KArg::F32(0.9),
                pa,
            ],
        );
        // The saved means are the columns' means (the kernels' numerics are checked against
        // the CPU in cuda_emulation.rs; this only shows the split ran to the end).
        for j in 0..c {
            let m: f64 = (0..rows).map(|i| x[i * c + j].to_f32() as f64).sum::<f64>() / rows as f64;
            assert!(
                (mean[j] as f64 - m).abs() < 1e-3,
                "bn mean {j}, {parts} parts"
            );
        }
    }
}

/// Layer norm (one warp per row) and its parameter gradients (a channel strip, split).
#[test]
fn layer_norm_has_no_race() {
    races_on();
    let r = &mut Rng(2);
    let (rows, c) = (37usize, 70usize);
    let x: Vec<f16> = r.vec(rows * c, -2.0, 2.0);
    let (gamma, beta): (Vec<f32>, Vec<f32>) = (r.vec(c, 0.5, 1.5), r.vec(c, -0.5, 0.5));
    let mut y = vec![f16::ZERO; rows * c];
    let mut h = vec![f16::ZERO; rows * c];
    let mut inv = vec![0f32; rows];
    run(
        "mw_ln_fwd_f16",
        LaunchCfg::rows(rows as u64),
        vec![
            p(&x),
            pm(&mut y),
            pm(&mut h),
            pm(&mut inv),
            p(&gamma),
            p(&beta),
            u(rows),
            u(c),
            KArg::F32(1e-5),
        ],
    );
    assert!(inv.iter().all(|v| v.is_finite() && *v > 0.0));
    let dy: Vec<f16> = r.vec(rows * c, -1.0, 1.0);
    for parts in [1usize, 3] {
        let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
        let mut pv = vec![f64::NAN; parts * 2 * c];
        let pa = if parts > 1 { pm(&mut pv) } else { NULL };
        run(
            "mw_ln_param_grads_f16",
            LaunchCfg::strip_parts(c as u64, 1, parts as u32),
            vec![p(&h), p(&dy), pm(&mut dg), pm(&mut db), u(rows), u(c), pa],
        );
    }
}

#[test]
fn softmax_has_no_race() {
    races_on();
    let r = &mut Rng(3);
    for cols in [7usize, 300] {
        let rows = 19;
        let x: Vec<f32> = r.vec(rows * cols, -8.0, 8.0);
        let mut want = vec![f16::ZERO; rows * cols];
        k::activation::softmax_forward(&x, &mut want, rows, cols).unwrap();
        let mut y = vec![f16::ZERO; rows * cols];
        run(
            &name2("mw_softmax", Float::F32, Float::F16),
            LaunchCfg::rows(rows as u64),
            vec![p(&x), pm(&mut y), u(rows), u(cols)],
        );
        for (g, w) in y.iter().zip(&want) {
            // Two f16 ulps: the kernel and the CPU round the f32 result differently.
            assert!((g.to_f32() - w.to_f32()).abs() <= 2.0 / 1024.0 * w.to_f32().abs() + 1e-7);
        }
    }
}

/// A loss value over several blocks (each a part of the rows, with f64 partials), the pass that
/// adds the parts, and the loss gradient over a grid-stride loop on few blocks.
#[test]
fn a_loss_over_several_blocks_has_no_race() {
    races_on();
    let r = &mut Rng(4);
    let (rows, features) = (13usize, 29usize);
    let n = rows * features;
    let pr: Vec<f32> = r.vec(n, 0.01, 0.99);
    let t: Vec<f32> = r.vec(n, 0.0, 1.0);
    let names = (
        name2("mw_elem_loss", Float::F32, Float::F32),
        name2("mw_elem_loss_value", Float::F32, Float::F32),
    );
    let mut sc = MwScalars {
        loss_scale: 4.0,
        ..Default::default()
    };
    let mut g = vec![0f32; n];
    run(
        &names.0,
        LaunchCfg::pointwise(n as u64).with_blocks(2),
        vec![
            KArg::I32(l::LOSS_BCE),
            p(&pr),
            p(&t),
            pm(&mut g),
            u(n),
            KArg::F64(n as f64),
            KArg::F32(0.5),
            scal(&mut sc),
        ],
    );
    let mut values = Vec::new();
    for parts in [1usize, 5] {
        let mut loss = [0f32];
        let mut pv = vec![f64::NAN; parts * 3];
        run(
            &names.1,
            LaunchCfg::single().with_blocks(parts as u32),
            vec![
                KArg::I32(l::LOSS_BCE),
                p(&pr),
                p(&t),
                u(n),
                KArg::F64(n as f64),
                KArg::F32(0.5),
                pm(&mut loss),
                if parts > 1 { pm(&mut pv) } else { NULL },
            ],
        );
        if parts > 1 {
            run(
                "mw_loss_value_parts",
                LaunchCfg::pointwise(1),
                vec![
                    p(&pv),
                    u(parts),
                    KArg::F64(n as f64),
                    KArg::F32(0.5),
                    pm(&mut loss),
                    scal(&mut sc),
                ],
            );
        }
        values.push(loss[0]);
    }
    assert!(values[0].is_finite());
    assert!(
        (values[0] - values[1]).abs() <= 1e-6 * values[0].abs(),
        "{values:?}"
    );
}

#[test]
fn pooling_has_no_race() {
    use k::pool::{Padding, Pool2d};
    races_on();
    let r = &mut Rng(5);
    for (n, h, w, c, pool, strides, pad) in [
        (2, 7, 9, 5, (3, 2), (2, 2), Padding::Same),
        (1, 5, 8, 70, (3, 3), (1, 1), Padding::Same),
        (2, 9, 7, 3, (2, 3), (3, 1), Padding::Same),
    ] {
        let d = Pool2d::new(n, h, w, c, pool, strides, pad).unwrap();
        let md = KArg::Pool(MwPool::from(&d));
        let x: Vec<f32> = r.vec(d.in_len(), -4.0, 4.0);
        let (mut y, mut a) = (vec![0f32; d.out_len()], vec![0u8; d.out_len()]);
        run(
            &name1("mw_maxpool_fwd", Float::F32),
            LaunchCfg::pointwise(d.out_len() as u64),
            vec![p(&x), pm(&mut y), pm(&mut a), md],
        );
        let dy: Vec<f32> = r.vec(d.out_len(), -1.0, 1.0);
        let mut dx = vec![0f32; d.in_len()];
        // Overlapping windows (stride < pool) send several outputs' gradients to one input:
        // each input gathers them itself, which the race check confirms.
        run(
            &name1("mw_maxpool_bwd", Float::F32),
            LaunchCfg::pointwise(d.in_len() as u64).with_blocks(3),
            vec![p(&a), p(&dy), pm(&mut dx), md],
        );
        let mut wdx = vec![0f32; d.in_len()];
        k::pool::max_pool2d_backward(&d, &a, &dy, &mut wdx).unwrap();
        assert_eq!(dx, wdx);
        let mut dx = vec![0f32; d.in_len()];
        run(
            &name1("mw_avgpool_bwd", Float::F32),
            LaunchCfg::pointwise(d.in_len() as u64),
            vec![p(&dy), pm(&mut dx), md],
        );
    }
}

/// Every kernel of the sources declares `__launch_bounds__` (through `MW_KERNEL_*` in
/// common.cuh: the block its launch shape uses), and the emulator refuses a launch over it as
/// a GPU would; the launch shapes of `LaunchCfg` are within their kernels' bounds (the other
/// emulation tests launch every kernel through them).
#[test]
fn every_kernel_declares_its_launch_bound_and_a_larger_block_is_refused() {
    let bounds = emu::launch_bounds();
    let missing: Vec<&str> = bounds
        .iter()
        .filter(|(name, b)| *b == 0 && !name.starts_with("mw_emu_selftest"))
        .map(|(name, _)| name.as_str())
        .collect();
    assert!(missing.is_empty(), "no __launch_bounds__: {missing:?}");
    let bound = |name: &str| bounds.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(bound("mw_copy_u8"), l::BLOCK);
    assert_eq!(bound("mw_softmax_f32_f32"), 32 * l::ROW_WARPS);
    assert_eq!(bound("mw_column_sums_f32"), 32 * l::STRIP_Y);
    assert_eq!(bound("mw_scce_value_f32"), l::REDUCE_THREADS);
    assert_eq!(bound("mw_flash_fwd_f32"), k::cuda::flash::THREADS);

    let x = vec![7u8; 600];
    let mut y = vec![0u8; 600];
    let err = launch(
        "mw_copy_u8",
        shape(1, 2 * l::BLOCK),
        vec![p(&x), pm(&mut y), u(600)],
    )
    .unwrap_err();
    assert!(err.contains("__launch_bounds__(256)"), "{err}");
    assert!(y.iter().all(|&v| v == 0), "a refused launch ran");
    run(
        "mw_copy_u8",
        shape(3, l::BLOCK),
        vec![p(&x), pm(&mut y), u(600)],
    );
    assert_eq!(x, y);
}
