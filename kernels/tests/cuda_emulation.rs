//! Every CUDA kernel (`kernels/cuda/*.cu`), run on the CPU by the host emulation
//! (`memwise-cuda-emu`: the same sources compiled as C++ with a shim for the CUDA built-ins),
//! against the CPU kernels on random inputs — sizes that are not multiples of the block size,
//! grid-stride loops forced onto a few blocks, in-place forms, and f32 / f16 / bf16 storage.
//!
//! Launches go through `KernelCall` (name, launch shape, arguments), exactly as the device
//! executor launches them, and the emulator checks each argument list against the kernel's
//! parameter types. GEMMs run through `cublas_map` and its column-major reference, so conv
//! and conv-transpose are checked end to end (im2col → GEMM → col2im) against the CPU.
//!
//! One test runs the groups on parallel threads and then checks that every kernel in the
//! sources was launched.

use std::collections::BTreeSet;
use std::sync::Mutex;

use half::{bf16, f16};
use memwise_cuda_emu as emu;
use memwise_kernels as k;
use memwise_kernels::cublas_map::{self as cm, RowGemm};
use memwise_kernels::cuda::launch::{
    self as l, name1, name2, Float, KArg, KernelCall, LaunchCfg, MwDepthwise, MwGeom, MwPool,
    MwScalars, MwUpdateChunk,
};
use memwise_kernels::Element;

static LAUNCHED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

// ---------------------------------------------------------------------------------------------
// harness

trait Ty: Element {
    const F: Float;
    /// Relative tolerance between two results that differ only in f32 rounding before the last
    /// store (two ulps of the storage type).
    const REL: f32;
}
impl Ty for f32 {
    const F: Float = Float::F32;
    const REL: f32 = 2e-5;
}
impl Ty for f16 {
    const F: Float = Float::F16;
    const REL: f32 = 2.0 / 1024.0;
}
impl Ty for bf16 {
    const F: Float = Float::Bf16;
    const REL: f32 = 2.0 / 128.0;
}

macro_rules! each {
    ($f:ident, $r:expr) => {
        $f::<f32>($r);
        $f::<f16>($r);
        $f::<bf16>($r);
    };
}
macro_rules! each2 {
    ($f:ident, $r:expr) => {
        $f::<f32, f32>($r);
        $f::<f32, f16>($r);
        $f::<f32, bf16>($r);
        $f::<f16, f32>($r);
        $f::<f16, f16>($r);
        $f::<f16, bf16>($r);
        $f::<bf16, f32>($r);
        $f::<bf16, f16>($r);
        $f::<bf16, bf16>($r);
    };
}

#[track_caller]
fn run(name: &str, cfg: LaunchCfg, args: Vec<KArg>) {
    let call = KernelCall::new(name, cfg, args);
    LAUNCHED.lock().unwrap().insert(call.name.clone());
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
    .unwrap_or_else(|e| panic!("{e}"));
}

fn p<T>(v: &[T]) -> KArg {
    KArg::host(v.as_ptr())
}
fn pm<T>(v: &mut [T]) -> KArg {
    KArg::host(v.as_mut_ptr())
}
fn pat<T>(v: &mut [T], at: usize) -> KArg {
    KArg::host(v[at..].as_mut_ptr())
}
fn scal(s: &mut MwScalars) -> KArg {
    KArg::host(s as *mut MwScalars)
}
const NULL: KArg = KArg::Ptr(0);
fn u(n: usize) -> KArg {
    KArg::U64(n as u64)
}

/// Row parts a column reduction runs in (the planner's `column_parts`): not split, and split
/// into three (grid z) with f64 partial sums.
const SPLITS: [usize; 2] = [1, 3];

/// Room for a split reduction's partial sums, `values` per part, NaN so that a partial no
/// kernel wrote shows in the result.
fn partials(parts: usize, values: usize) -> Vec<f64> {
    vec![f64::NAN; parts * values]
}

/// The kernels' partial-sums argument: NULL when the reduction is not split.
fn parts_arg(v: &mut [f64], parts: usize) -> KArg {
    if parts > 1 {
        pm(v)
    } else {
        NULL
    }
}

/// A split reduction's second pass as the CUDA glue runs it (`mw_add_parts`):
/// `out[i] += Σ_p partials[first + p·stride + i]`; nothing when not split.
fn add_parts(partials: &[f64], parts: usize, first: usize, stride: usize, out: &mut [f32]) {
    if parts == 1 {
        return;
    }
    run(
        "mw_add_parts",
        LaunchCfg::pointwise(out.len() as u64),
        vec![
            p(&partials[first..]),
            u(parts),
            u(stride),
            u(out.len()),
            pm(out),
        ],
    );
}

struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f(lo, hi)).collect()
    }
    fn t<T: Element>(&mut self, n: usize, lo: f32, hi: f32) -> Vec<T> {
        (0..n).map(|_| T::from_f32(self.f(lo, hi))).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn zeros<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f32(0.0); n]
}

#[track_caller]
fn close<T: Element>(what: &str, got: &[T], want: &[T], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= abs + rel * w.abs()
        };
        assert!(ok, "{what}[{i}] ({}): got {g}, want {w}", T::NAME);
    }
}

/// Absolute slack for a result rounded to T twice (a GEMM's output, then the bias added): one
/// ulp of T at magnitude ~1.
fn half_abs<T: Ty>() -> f32 {
    if T::F == Float::F32 {
        1e-5
    } else {
        T::REL
    }
}

#[track_caller]
fn exact<T: Element>(what: &str, got: &[T], want: &[T]) {
    close(what, got, want, 0.0, 0.0)
}

/// Runs row-major GEMM `g` with the mapped cuBLAS arguments on the column-major reference;
/// `a`, `b`, `c` are the buffers of `g.a`, `g.b`, `g.c`.
fn row_gemm<A: Element, B: Element, C: Element>(g: &RowGemm, a: &[A], b: &[B], c: &mut [C]) {
    let cg = cm::to_cublas(g);
    cg.validate().unwrap();
    cm::reference_gemm(&cg, b, a, c);
}

// ---------------------------------------------------------------------------------------------
// elementwise.cu

fn cast_u8_case<T: Ty>(r: &mut Rng) {
    let n = 1000;
    let x: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
    let mut want = zeros::<T>(n);
    k::elementwise::cast_u8(&x, &mut want, 1.0 / 255.0, -0.5).unwrap();
    for cfg in [
        LaunchCfg::pointwise(n as u64),
        LaunchCfg::pointwise(n as u64).with_blocks(2),
    ] {
        let mut y = zeros::<T>(n);
        run(
            &name1("mw_cast_u8", T::F),
            cfg,
            vec![
                p(&x),
                pm(&mut y),
                u(n),
                KArg::F32(1.0 / 255.0),
                KArg::F32(-0.5),
            ],
        );
        exact("cast_u8", &y, &want);
    }
}

fn cast_case<S: Ty, D: Ty>(r: &mut Rng) {
    let mut v = r.vec(600, -70000.0, 70000.0);
    v.extend(r.vec(300, -1e-4, 1e-4));
    v.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65519.0,
        65520.0,
        1e-40,
        -6e-8,
        3e-8,
        2.9802322e-8,
        5.9604645e-8,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        3.4e38,
    ]);
    let x: Vec<S> = v.iter().map(|&f| S::from_f32(f)).collect();
    let mut want = zeros::<D>(x.len());
    k::elementwise::cast(&x, &mut want).unwrap();
    let mut y = zeros::<D>(x.len());
    run(
        &name2("mw_cast", S::F, D::F),
        LaunchCfg::pointwise(x.len() as u64),
        vec![p(&x), pm(&mut y), u(x.len())],
    );
    exact("cast", &y, &want);
}

fn add_n_case<T: Ty>(r: &mut Rng) {
    let n = 777;
    for arity in 1..=8usize {
        let xs: Vec<Vec<T>> = (0..arity).map(|_| r.t(n, -3.0, 3.0)).collect();
        let refs: Vec<&[T]> = xs.iter().map(|v| v.as_slice()).collect();
        let mut want = zeros::<T>(n);
        k::elementwise::add_n(&refs, &mut want).unwrap();
        let mut y = zeros::<T>(n);
        let mut args = vec![pm(&mut y)];
        args.extend((0..8).map(|j| xs.get(j).map_or(NULL, |x| p(x))));
        args.extend([KArg::I32(arity as i32), u(n)]);
        run(
            &name1("mw_add_n", T::F),
            LaunchCfg::pointwise(n as u64),
            args,
        );
        exact("add_n", &y, &want);
        // In place over the first input.
        let mut acc = xs[0].clone();
        let mut want2 = xs[0].clone();
        k::elementwise::add_n_inplace(&mut want2, &refs[1..]).unwrap();
        let mut args = vec![pm(&mut acc), pm(&mut acc)];
        args.extend((1..8).map(|j| xs.get(j).map_or(NULL, |x| p(x))));
        args.extend([KArg::I32(arity as i32), u(n)]);
        run(
            &name1("mw_add_n", T::F),
            LaunchCfg::pointwise(n as u64).with_blocks(1),
            args,
        );
        exact("add_n in place", &acc, &want2);
    }
}

fn accumulate_case<T: Ty>(r: &mut Rng) {
    let n = 1025;
    let src: Vec<T> = r.t(n, -2.0, 2.0);
    let mut dst: Vec<T> = r.t(n, -2.0, 2.0);
    let mut want = dst.clone();
    k::elementwise::accumulate::<T, T>(&mut want, &src).unwrap();
    run(
        &name1("mw_accumulate", T::F),
        LaunchCfg::pointwise(n as u64),
        vec![pm(&mut dst), p(&src), u(n)],
    );
    exact("accumulate", &dst, &want);
}

fn concat_case<T: Ty>(r: &mut Rng) {
    let (rows, wa, wb) = (37, 5, 11);
    let a: Vec<T> = r.t(rows * wa, -1.0, 1.0);
    let b: Vec<T> = r.t(rows * wb, -1.0, 1.0);
    let mut want = zeros::<T>(rows * (wa + wb));
    k::elementwise::concat_last(&[&a, &b], &[wa, wb], rows, &mut want).unwrap();
    let mut y = zeros::<T>(rows * (wa + wb));
    run(
        &name1("mw_concat", T::F),
        LaunchCfg::pointwise(y.len() as u64),
        vec![p(&a), p(&b), pm(&mut y), u(rows), u(wa), u(wb)],
    );
    exact("concat", &y, &want);
    let (mut da, mut db) = (zeros::<T>(rows * wa), zeros::<T>(rows * wb));
    let (mut wa_, mut wb_) = (zeros::<T>(rows * wa), zeros::<T>(rows * wb));
    k::elementwise::concat_last_backward(&y, &[wa, wb], rows, &mut [&mut wa_, &mut wb_]).unwrap();
    run(
        &name1("mw_concat_backward", T::F),
        LaunchCfg::pointwise(y.len() as u64).with_blocks(1),
        vec![p(&y), pm(&mut da), pm(&mut db), u(rows), u(wa), u(wb)],
    );
    exact("concat_backward a", &da, &wa_);
    exact("concat_backward b", &db, &wb_);
}

fn bias_add_case<T: Ty>(r: &mut Rng) {
    let (rows, cols) = (33, 70);
    let mut y: Vec<T> = r.t(rows * cols, -1.0, 1.0);
    let bias = r.vec(cols, -1.0, 1.0);
    let want: Vec<T> = y
        .iter()
        .enumerate()
        .map(|(i, v)| T::from_f32(v.to_f32() + bias[i % cols]))
        .collect();
    run(
        &name1("mw_bias_add", T::F),
        LaunchCfg::pointwise(y.len() as u64),
        vec![pm(&mut y), p(&bias), u(rows), u(cols)],
    );
    exact("bias_add", &y, &want);
}

fn elementwise() {
    let r = &mut Rng::new(1);
    each!(cast_u8_case, r);
    each2!(cast_case, r);
    each!(add_n_case, r);
    each!(accumulate_case, r);
    each!(concat_case, r);
    each!(bias_add_case, r);
    // The finite check, over grids too small for the data (grid-stride).
    let n = 5000;
    let mut g = r.vec(n, -1e30, 1e30);
    for (bad, want) in [
        (None, 0),
        (Some(f32::NAN), 1),
        (Some(f32::INFINITY), 1),
        (Some(f32::NEG_INFINITY), 1),
    ] {
        if let Some(v) = bad {
            g[4321] = v;
        }
        for blocks in [1, 3, 64] {
            let mut sc = MwScalars::default();
            run(
                "mw_all_finite_f32",
                LaunchCfg::pointwise(n as u64).with_blocks(blocks),
                vec![p(&g), u(n), scal(&mut sc)],
            );
            assert_eq!(
                sc.nonfinite, want,
                "all_finite with {bad:?} on {blocks} blocks"
            );
            assert_eq!(want == 0, k::elementwise::all_finite(&g));
        }
    }
    let x: Vec<u8> = (0..1001).map(|_| r.next() as u8).collect();
    let mut y = vec![0u8; 1001];
    run(
        "mw_copy_u8",
        LaunchCfg::pointwise(1001),
        vec![p(&x), pm(&mut y), u(1001)],
    );
    assert_eq!(x, y);
}

// ---------------------------------------------------------------------------------------------
// activation.cu

fn act_case<T: Ty>(r: &mut Rng) {
    use k::activation::{Activation as A, Saved};
    let n = 1003;
    // Every activation the kernels list, found by name as the executors find them; those
    // with a parameter at a value other than their default.
    for &name in A::NAMES {
        let act = A::from_name(name, 0.45).unwrap();
        let (code, param) = (KArg::I32(l::activation_code(act)), KArg::F32(act.param()));
        let x: Vec<T> = r.t(n, -6.0, 6.0);
        let mut want = zeros::<T>(n);
        act.forward(&x, &mut want).unwrap();
        let mut y = zeros::<T>(n);
        run(
            &name1("mw_act_fwd", T::F),
            LaunchCfg::pointwise(n as u64),
            vec![code, param, p(&x), pm(&mut y), u(n)],
        );
        close(&format!("{act:?} forward"), &y, &want, T::REL, 1e-6);
        let mut xy = x.clone();
        run(
            &name1("mw_act_fwd", T::F),
            LaunchCfg::pointwise(n as u64).with_blocks(2),
            vec![code, param, pm(&mut xy), pm(&mut xy), u(n)],
        );
        close(
            &format!("{act:?} forward in place"),
            &xy,
            &want,
            T::REL,
            1e-6,
        );

        let saved = if act.saved() == Saved::Output {
            want.clone()
        } else {
            x.clone()
        };
        let dy: Vec<T> = r.t(n, -1.0, 1.0);
        let mut want_dx = zeros::<T>(n);
        act.backward(&saved, &dy, &mut want_dx).unwrap();
        let mut dx = zeros::<T>(n);
        run(
            &name1("mw_act_bwd", T::F),
            LaunchCfg::pointwise(n as u64),
            vec![code, param, p(&saved), p(&dy), pm(&mut dx), u(n)],
        );
        close(&format!("{act:?} backward"), &dx, &want_dx, T::REL, 1e-6);
        let mut g = dy.clone();
        run(
            &name1("mw_act_bwd", T::F),
            LaunchCfg::pointwise(n as u64),
            vec![code, param, p(&saved), pm(&mut g), pm(&mut g), u(n)],
        );
        close(
            &format!("{act:?} backward in place"),
            &g,
            &want_dx,
            T::REL,
            1e-6,
        );
    }
}

fn softmax_case<I: Ty, O: Ty>(r: &mut Rng) {
    for cols in [1usize, 7, 64, 300] {
        let rows = 19;
        let mut x: Vec<I> = r.t(rows * cols, -8.0, 8.0);
        for j in 0..cols {
            x[3 * cols + j] = I::from_f32(f32::NEG_INFINITY);
            if j % 2 == 1 {
                x[5 * cols + j] = I::from_f32(f32::NEG_INFINITY);
            }
        }
        let mut want = zeros::<O>(rows * cols);
        k::activation::softmax_forward(&x, &mut want, rows, cols).unwrap();
        let mut y = zeros::<O>(rows * cols);
        run(
            &name2("mw_softmax", I::F, O::F),
            LaunchCfg::rows(rows as u64),
            vec![p(&x), pm(&mut y), u(rows), u(cols)],
        );
        close(
            &format!("softmax {cols}"),
            &y,
            &want,
            O::REL.max(I::REL),
            1e-6,
        );
    }
}

fn softmax_inplace_case<T: Ty>(r: &mut Rng) {
    let (rows, cols) = (9, 45);
    let x: Vec<T> = r.t(rows * cols, -5.0, 5.0);
    let mut want = x.clone();
    k::activation::softmax_inplace(&mut want, rows, cols).unwrap();
    let mut y = x.clone();
    run(
        &name2("mw_softmax", T::F, T::F),
        LaunchCfg::rows(rows as u64),
        vec![pm(&mut y), pm(&mut y), u(rows), u(cols)],
    );
    close("softmax in place", &y, &want, T::REL, 1e-6);
}

fn softmax_bwd_case<Y: Ty, G: Ty>(r: &mut Rng) {
    softmax_bwd_to::<Y, G, f32>(r);
    softmax_bwd_to::<Y, G, f16>(r);
    softmax_bwd_to::<Y, G, bf16>(r);
}

fn softmax_bwd_to<Y: Ty, G: Ty, D: Ty>(r: &mut Rng) {
    for cols in [1usize, 33, 200] {
        let rows = 11;
        let logits: Vec<f32> = r.vec(rows * cols, -4.0, 4.0);
        let mut y = zeros::<Y>(rows * cols);
        k::activation::softmax_forward(&logits, &mut y, rows, cols).unwrap();
        let dy: Vec<G> = r.t(rows * cols, -1.0, 1.0);
        let mut want = zeros::<D>(rows * cols);
        k::activation::softmax_backward::<Y, G, D>(&y, &dy, &mut want, rows, cols).unwrap();
        let mut dx = zeros::<D>(rows * cols);
        let name = l::name3("mw_softmax_bwd", Y::F, G::F, D::F);
        run(
            &name,
            LaunchCfg::rows(rows as u64),
            vec![p(&y), p(&dy), pm(&mut dx), u(rows), u(cols)],
        );
        close("softmax backward", &dx, &want, D::REL.max(G::REL), 2e-6);
        if G::F == D::F {
            // In place: dx over dy.
            let mut want2 = dy.clone();
            k::activation::softmax_backward_inplace::<Y, G>(&y, &mut want2, rows, cols).unwrap();
            let mut g = dy.clone();
            run(
                &name,
                LaunchCfg::rows(rows as u64),
                vec![p(&y), pm(&mut g), pm(&mut g), u(rows), u(cols)],
            );
            close("softmax backward in place", &g, &want2, G::REL, 2e-6);
        }
    }
}

fn causal_case<T: Ty>(r: &mut Rng) {
    let (pairs, s) = (3, 5);
    let mut sc: Vec<T> = r.t(pairs * s * s, -1.0, 1.0);
    let want: Vec<T> = sc
        .iter()
        .enumerate()
        .map(|(e, v)| {
            if e % s > (e / s) % s {
                T::from_f32(k::attention::CAUSAL_MASK)
            } else {
                *v
            }
        })
        .collect();
    run(
        &name1("mw_causal_mask", T::F),
        LaunchCfg::pointwise(sc.len() as u64),
        vec![pm(&mut sc), u(pairs), u(s)],
    );
    exact("causal mask", &sc, &want);
}

fn activation() {
    let r = &mut Rng::new(2);
    each!(act_case, r);
    each2!(softmax_case, r);
    each!(softmax_inplace_case, r);
    each2!(softmax_bwd_case, r);
    each!(causal_case, r);
}

// ---------------------------------------------------------------------------------------------
// loss.cu

/// A loss value as the CUDA glue runs it: the value kernel `name` on `args` (the partial sums'
/// argument appended) on one block, or on `parts` blocks followed by `mw_loss_value_parts`
/// adding their results into `loss` as `weight · sum / denom`.
fn loss_value(
    name: &str,
    mut args: Vec<KArg>,
    parts: usize,
    (denom, weight): (f64, f32),
    loss: &mut [f32; 1],
    sc: &mut MwScalars,
) {
    let mut pv = partials(parts, 3);
    args.push(parts_arg(&mut pv, parts));
    run(name, LaunchCfg::single().with_blocks(parts as u32), args);
    if parts > 1 {
        run(
            "mw_loss_value_parts",
            LaunchCfg::pointwise(1),
            vec![
                p(&pv),
                u(parts),
                KArg::F64(denom),
                KArg::F32(weight),
                pm(loss),
                scal(sc),
            ],
        );
    }
}

fn scce_case<P: Ty, G: Ty>(r: &mut Rng) {
    let (weight, scale) = (0.7f32, 8.0f32);
    for classes in [10usize, 130] {
        let rows = 37;
        let logits = r.vec(rows * classes, -3.0, 3.0);
        let mut probs = zeros::<P>(rows * classes);
        k::activation::softmax_forward(&logits, &mut probs, rows, classes).unwrap();
        let mut labels: Vec<i32> = (0..rows).map(|_| r.below(classes) as i32).collect();
        let mut want = zeros::<G>(rows * classes);
        let res = k::loss::sparse_categorical_crossentropy(
            &probs,
            &labels,
            rows,
            classes,
            weight * scale,
            &mut want,
        )
        .unwrap();
        let mut sc = MwScalars {
            loss_scale: scale,
            ..Default::default()
        };
        let mut g = zeros::<G>(rows * classes);
        run(
            &name2("mw_scce", P::F, G::F),
            LaunchCfg::rows(rows as u64),
            vec![
                p(&probs),
                p(&labels),
                pm(&mut g),
                u(rows),
                u(classes),
                KArg::F32(weight),
                scal(&mut sc),
            ],
        );
        close("scce gradient", &g, &want, G::REL, 1e-7);
        for parts in [1, 4] {
            let (mut loss, mut sc) = ([0f32], MwScalars::default());
            let args = vec![
                p(&probs),
                p(&labels),
                u(rows),
                u(classes),
                KArg::F32(weight),
                pm(&mut loss),
                scal(&mut sc),
            ];
            let name = name1("mw_scce_value", P::F);
            loss_value(
                &name,
                args,
                parts,
                (rows as f64, weight),
                &mut loss,
                &mut sc,
            );
            close("scce loss", &loss, &[weight * res.loss], 1e-6, 0.0);
            assert_eq!(
                sc.correct as usize, res.correct,
                "scce correct count, {parts} parts"
            );
            assert_eq!(sc.bad_index, 0);
        }
        // A label out of range: no value, and the first such sample is named, split or not.
        labels[5] = classes as i32;
        labels[30] = -1;
        for parts in [1, 4] {
            let (mut loss, mut sc) = ([0f32], MwScalars::default());
            let args = vec![
                p(&probs),
                p(&labels),
                u(rows),
                u(classes),
                KArg::F32(weight),
                pm(&mut loss),
                scal(&mut sc),
            ];
            let name = name1("mw_scce_value", P::F);
            loss_value(
                &name,
                args,
                parts,
                (rows as f64, weight),
                &mut loss,
                &mut sc,
            );
            assert_eq!(
                sc.bad_index, 6,
                "first bad label is sample 5 ({parts} parts)"
            );
            assert!(loss[0].is_nan());
        }
        labels[9] = -1;
        assert!(
            k::loss::sparse_categorical_crossentropy_eval(&probs, &labels, rows, classes).is_err()
        );
    }
}

fn elem_loss_case<P: Ty, Y: Ty>(r: &mut Rng) {
    use k::loss::Reduction;
    let (rows, features) = (13usize, 29usize);
    let n = rows * features;
    let (weight, scale) = (0.5f32, 4.0f32);
    for kind in [
        l::LOSS_BCE_SIGMOID,
        l::LOSS_BCE,
        l::LOSS_MSE,
        l::LOSS_BCE_LOGITS,
    ] {
        for red in [Reduction::Mean, Reduction::SumOverFeaturesMeanOverBatch] {
            let mut pv = if kind == l::LOSS_BCE_LOGITS {
                // Logits, with the confident extremes where a naive log(σ(x)) breaks.
                let mut v = r.vec(n, -12.0, 12.0);
                v[..5].copy_from_slice(&[-100.0, 100.0, -30.0, 30.0, 0.0]);
                v
            } else {
                r.vec(n, 0.001, 0.999)
            };
            if kind != l::LOSS_BCE_LOGITS {
                pv[0] = 0.0;
                pv[1] = 1.0;
                pv[2] = 1e-9;
                pv[3] = 1.0 - 1e-9;
                pv[4] = 1e-7;
            }
            let pr: Vec<P> = pv.iter().map(|&v| P::from_f32(v)).collect();
            let t: Vec<Y> = r.t(n, 0.0, 1.0);
            let mut want = zeros::<P>(n);
            let lv = match kind {
                l::LOSS_BCE_SIGMOID => k::loss::binary_crossentropy_with_sigmoid(
                    &pr,
                    &t,
                    rows,
                    features,
                    red,
                    weight * scale,
                    &mut want,
                ),
                l::LOSS_BCE_LOGITS => k::loss::binary_crossentropy_from_logits(
                    &pr,
                    &t,
                    rows,
                    features,
                    red,
                    weight * scale,
                    &mut want,
                ),
                l::LOSS_BCE => k::loss::binary_crossentropy(
                    &pr,
                    &t,
                    rows,
                    features,
                    red,
                    weight * scale,
                    &mut want,
                ),
                _ => k::loss::mean_squared_error(
                    &pr,
                    &t,
                    rows,
                    features,
                    red,
                    weight * scale,
                    &mut want,
                ),
            }
            .unwrap();
            let denom = match red {
                Reduction::Mean => n as f64,
                Reduction::SumOverFeaturesMeanOverBatch => rows as f64,
            };
            let mut sc = MwScalars {
                loss_scale: scale,
                ..Default::default()
            };
            let mut g = zeros::<P>(n);
            let names = (
                name2("mw_elem_loss", P::F, Y::F),
                name2("mw_elem_loss_value", P::F, Y::F),
            );
            run(
                &names.0,
                LaunchCfg::pointwise(n as u64).with_blocks(1),
                vec![
                    KArg::I32(kind),
                    p(&pr),
                    p(&t),
                    pm(&mut g),
                    u(n),
                    KArg::F64(denom),
                    KArg::F32(weight),
                    scal(&mut sc),
                ],
            );
            close(&format!("loss {kind} gradient"), &g, &want, P::REL, 1e-7);
            for parts in [1, 5] {
                let mut loss = [0f32];
                let args = vec![
                    KArg::I32(kind),
                    p(&pr),
                    p(&t),
                    u(n),
                    KArg::F64(denom),
                    KArg::F32(weight),
                    pm(&mut loss),
                ];
                loss_value(&names.1, args, parts, (denom, weight), &mut loss, &mut sc);
                let what = format!("loss {kind} value, {parts} parts");
                close(&what, &loss, &[weight * lv], 1e-6, 0.0);
            }
        }
    }
}

fn kl_case<T: Ty>(r: &mut Rng) {
    let (rows, latent) = (11usize, 17usize);
    let n = rows * latent;
    let (w, scale) = (0.3f32, 2.0f32);
    let mean: Vec<T> = r.t(n, -2.0, 2.0);
    let logvar: Vec<T> = r.t(n, -3.0, 1.0);
    let (mut wm, mut wl) = (zeros::<T>(n), zeros::<T>(n));
    let lv = k::loss::kl_divergence_standard_normal(
        &mean,
        &logvar,
        rows,
        latent,
        w * scale,
        &mut wm,
        &mut wl,
    )
    .unwrap();
    let mut sc = MwScalars {
        loss_scale: scale,
        ..Default::default()
    };
    let (mut dm, mut dl) = (zeros::<T>(n), zeros::<T>(n));
    run(
        &name1("mw_kl", T::F),
        LaunchCfg::pointwise(n as u64),
        vec![
            p(&mean),
            p(&logvar),
            pm(&mut dm),
            pm(&mut dl),
            u(n),
            u(rows),
            KArg::F32(w),
            scal(&mut sc),
        ],
    );
    close("kl dmean", &dm, &wm, T::REL, 1e-7);
    close("kl dlogvar", &dl, &wl, T::REL, 1e-7);
    for parts in [1, 3] {
        let (mut loss, mut sc) = ([0f32], MwScalars::default());
        let args = vec![
            p(&mean),
            p(&logvar),
            u(n),
            u(rows),
            KArg::F32(w),
            pm(&mut loss),
        ];
        let name = name1("mw_kl_value", T::F);
        loss_value(&name, args, parts, (rows as f64, w), &mut loss, &mut sc);
        close(
            &format!("kl value, {parts} parts"),
            &loss,
            &[w * lv],
            1e-6,
            0.0,
        );
    }
}

fn loss() {
    let r = &mut Rng::new(3);
    each2!(scce_case, r);
    each2!(elem_loss_case, r);
    each!(kl_case, r);
}

// ---------------------------------------------------------------------------------------------
// norm.cu

fn column_sums_case<T: Ty>(r: &mut Rng) {
    let (rows, cols) = (517usize, 45usize);
    let m: Vec<T> = r.t(rows * cols, -1.0, 1.0);
    let sums0 = r.vec(cols, -1.0, 1.0);
    let want: Vec<f32> = (0..cols)
        .map(|j| {
            sums0[j]
                + (0..rows)
                    .map(|i| m[i * cols + j].to_f32() as f64)
                    .sum::<f64>() as f32
        })
        .collect();
    for parts in SPLITS {
        let (mut sums, mut pv) = (sums0.clone(), partials(parts, cols));
        run(
            &name1("mw_column_sums", T::F),
            LaunchCfg::strip_parts(cols as u64, 1, parts as u32),
            vec![
                p(&m),
                u(rows),
                u(cols),
                pm(&mut sums),
                parts_arg(&mut pv, parts),
            ],
        );
        add_parts(&pv, parts, 0, cols, &mut sums);
        close(
            &format!("column sums in {parts} parts"),
            &sums,
            &want,
            1e-5,
            1e-5,
        );
    }
}

fn bn_case<T: Ty>(r: &mut Rng) {
    use k::norm::*;
    let (rows, c) = (300usize, 45usize);
    let d = NormDims { rows, channels: c };
    let cfg = BatchNormConfig {
        epsilon: 1e-3,
        momentum: 0.9,
    };
    let x: Vec<T> = r.t(rows * c, 1.0, 5.0);
    let gamma = r.vec(c, 0.5, 1.5);
    let beta = r.vec(c, -0.5, 0.5);
    let rm0 = r.vec(c, -1.0, 1.0);
    let rv0 = r.vec(c, 0.5, 2.0);
    let cases = [
        (true, false, 1),
        (false, false, 1),
        (true, true, 1),
        (true, true, 3),
        (false, false, 3),
    ];
    for (running, in_place, parts) in cases {
        let (mut wy, mut wh, mut wmean, mut winv) = (
            zeros::<T>(rows * c),
            zeros::<T>(rows * c),
            vec![0f32; 2 * c],
            vec![0f32; c],
        );
        let (mut wrm, mut wrv) = (rm0.clone(), rv0.clone());
        k::norm::batch_norm_train_forward(
            d,
            cfg,
            &x,
            Affine {
                gamma: &gamma,
                beta: &beta,
            },
            &mut wy,
            BatchNormSaved {
                x_hat: &mut wh,
                mean: &mut wmean,
                inv_std: &mut winv,
            },
            running.then_some(RunningStats {
                mean: &mut wrm,
                var: &mut wrv,
            }),
        )
        .unwrap();
        let mut y = if in_place {
            x.clone()
        } else {
            zeros::<T>(rows * c)
        };
        let xin = if in_place { pm(&mut y) } else { p(&x) };
        let (mut h, mut mean, mut inv) = (zeros::<T>(rows * c), vec![0f32; 2 * c], vec![0f32; c]);
        let (mut rm, mut rv) = (rm0.clone(), rv0.clone());
        let (prm, prv) = if running {
            (pm(&mut rm), pm(&mut rv))
        } else {
            (NULL, NULL)
        };
        // Split: the parts' Σx, then their Σ(x − mean)², as the CUDA glue launches them.
        let (strip, mut pv) = (
            LaunchCfg::strip_parts(c as u64, 1, parts as u32),
            partials(parts, 2 * c),
        );
        let pa = parts_arg(&mut pv, parts);
        if parts > 1 {
            let sums = vec![xin, u(rows), u(c), NULL, pa];
            run(&name1("mw_column_sums", T::F), strip, sums);
            run(
                &name1("mw_bn_var_parts", T::F),
                strip,
                vec![xin, u(rows), u(c), pa],
            );
        }
        run(
            &name1("mw_bn_train_fwd", T::F),
            strip,
            vec![
                xin,
                pm(&mut y),
                pm(&mut h),
                pm(&mut mean),
                pm(&mut inv),
                prm,
                prv,
                p(&gamma),
                p(&beta),
                u(rows),
                u(c),
                KArg::F32(cfg.epsilon),
                KArg::F32(cfg.momentum),
                pa,
            ],
        );
        close("bn y", &y, &wy, T::REL, 1e-5);
        close("bn x_hat", &h, &wh, T::REL, 1e-5);
        close("bn mean", &mean, &wmean, 1e-6, 0.0);
        close("bn inv_std", &inv, &winv, 1e-5, 0.0);
        close("bn running mean", &rm, &wrm, 1e-6, 1e-7);
        close("bn running var", &rv, &wrv, 1e-5, 1e-7);
    }
    // Inference.
    let mut want = zeros::<T>(rows * c);
    k::norm::batch_norm_infer_forward(
        d,
        1e-3,
        &x,
        Affine {
            gamma: &gamma,
            beta: &beta,
        },
        &rm0,
        &rv0,
        &mut want,
    )
    .unwrap();
    let mut y = x.clone();
    run(
        &name1("mw_bn_infer", T::F),
        LaunchCfg::pointwise((rows * c) as u64),
        vec![
            pm(&mut y),
            pm(&mut y),
            p(&gamma),
            p(&beta),
            p(&rm0),
            p(&rv0),
            u(rows),
            u(c),
            KArg::F32(1e-3),
        ],
    );
    close("bn inference (in place)", &y, &want, T::REL, 1e-6);
    // Backward.
    let h: Vec<T> = r.t(rows * c, -2.0, 2.0);
    let inv = r.vec(c, 0.5, 2.0);
    let dy: Vec<T> = r.t(rows * c, -1.0, 1.0);
    let (dg0, db0) = (r.vec(c, -1.0, 1.0), r.vec(c, -1.0, 1.0));
    let (mut wdx, mut wdg, mut wdb) = (zeros::<T>(rows * c), dg0.clone(), db0.clone());
    k::norm::batch_norm_backward(
        d,
        &h,
        &inv,
        &gamma,
        &dy,
        &mut wdx,
        AffineGrads {
            dgamma: &mut wdg,
            dbeta: &mut wdb,
        },
    )
    .unwrap();
    for (in_place, parts) in [(false, 1), (true, 1), (false, 3), (true, 3)] {
        let mut dx = if in_place {
            dy.clone()
        } else {
            zeros::<T>(rows * c)
        };
        let (mut dg, mut db) = (dg0.clone(), db0.clone());
        let dyin = if in_place { pm(&mut dx) } else { p(&dy) };
        let (strip, mut pv) = (
            LaunchCfg::strip_parts(c as u64, 1, parts as u32),
            partials(parts, 2 * c),
        );
        let pa = parts_arg(&mut pv, parts);
        if parts > 1 {
            let sums = vec![p(&h), dyin, u(rows), u(c), pa];
            run(&name1("mw_bn_grad_parts", T::F), strip, sums);
        }
        run(
            &name1("mw_bn_bwd", T::F),
            strip,
            vec![
                p(&h),
                p(&inv),
                p(&gamma),
                dyin,
                pm(&mut dx),
                pm(&mut dg),
                pm(&mut db),
                u(rows),
                u(c),
                pa,
            ],
        );
        close("bn dx", &dx, &wdx, T::REL, 2e-5);
        close("bn dgamma", &dg, &wdg, 1e-5, 1e-4);
        close("bn dbeta", &db, &wdb, 1e-5, 1e-4);
    }
    // Backward rebuilding x̂ from the input and a hi/lo mean (with a large offset, where the
    // lo half matters), against the CPU's rebuild.
    let x: Vec<T> = r.t(rows * c, 40.0, 44.0);
    let mean: Vec<f32> = (0..2 * c)
        .map(|i| if i < c { 42.0 + i as f32 * 1e-3 } else { 3e-7 })
        .collect();
    let (mut wdx, mut wdg, mut wdb) = (zeros::<T>(rows * c), dg0.clone(), db0.clone());
    k::norm::batch_norm_backward_rebuild(
        d,
        &x,
        &mean,
        &inv,
        &gamma,
        &dy,
        &mut wdx,
        AffineGrads {
            dgamma: &mut wdg,
            dbeta: &mut wdb,
        },
    )
    .unwrap();
    for parts in SPLITS {
        let (mut dx, mut dg, mut db) = (zeros::<T>(rows * c), dg0.clone(), db0.clone());
        let (strip, mut pv) = (
            LaunchCfg::strip_parts(c as u64, 1, parts as u32),
            partials(parts, 2 * c),
        );
        let pa = parts_arg(&mut pv, parts);
        if parts > 1 {
            let sums = vec![p(&x), p(&mean), p(&inv), p(&dy), u(rows), u(c), pa];
            run(&name1("mw_bn_grad_parts_rebuild", T::F), strip, sums);
        }
        run(
            &name1("mw_bn_bwd_rebuild", T::F),
            strip,
            vec![
                p(&x),
                p(&mean),
                p(&inv),
                p(&gamma),
                p(&dy),
                pm(&mut dx),
                pm(&mut dg),
                pm(&mut db),
                u(rows),
                u(c),
                pa,
            ],
        );
        close("bn rebuild dx", &dx, &wdx, T::REL, 2e-5);
        close("bn rebuild dgamma", &dg, &wdg, 1e-5, 1e-4);
        close("bn rebuild dbeta", &db, &wdb, 1e-5, 1e-4);
    }
}

fn ln_case<T: Ty>(r: &mut Rng) {
    use k::norm::*;
    for c in [5usize, 64, 300] {
        let rows = 37;
        let d = NormDims { rows, channels: c };
        let x: Vec<T> = r.t(rows * c, -3.0, 4.0);
        let gamma = r.vec(c, 0.5, 1.5);
        let beta = r.vec(c, -0.5, 0.5);
        let (mut wy, mut wh, mut wr) =
            (zeros::<T>(rows * c), zeros::<T>(rows * c), vec![0f32; rows]);
        k::norm::layer_norm_forward(
            d,
            1e-3,
            &x,
            Affine {
                gamma: &gamma,
                beta: &beta,
            },
            &mut wy,
            &mut wh,
            &mut wr,
        )
        .unwrap();
        let (mut y, mut h, mut rs) = (zeros::<T>(rows * c), zeros::<T>(rows * c), vec![0f32; rows]);
        run(
            &name1("mw_ln_fwd", T::F),
            LaunchCfg::rows(rows as u64),
            vec![
                p(&x),
                pm(&mut y),
                pm(&mut h),
                pm(&mut rs),
                p(&gamma),
                p(&beta),
                u(rows),
                u(c),
                KArg::F32(1e-3),
            ],
        );
        close("ln y", &y, &wy, T::REL, 1e-5);
        close("ln x_hat", &h, &wh, T::REL, 1e-5);
        close("ln rstd", &rs, &wr, 1e-6, 0.0);
        let dy: Vec<T> = r.t(rows * c, -1.0, 1.0);
        let (dg0, db0) = (r.vec(c, -1.0, 1.0), r.vec(c, -1.0, 1.0));
        let (mut wdx, mut wdg, mut wdb) = (zeros::<T>(rows * c), dg0.clone(), db0.clone());
        k::norm::layer_norm_backward(
            d,
            &wh,
            &wr,
            &gamma,
            &dy,
            &mut wdx,
            AffineGrads {
                dgamma: &mut wdg,
                dbeta: &mut wdb,
            },
        )
        .unwrap();
        for (in_place, parts) in [(false, 1), (true, 1), (true, 3)] {
            let mut dx = if in_place {
                dy.clone()
            } else {
                zeros::<T>(rows * c)
            };
            let (mut dg, mut db) = (dg0.clone(), db0.clone());
            let dyin = if in_place { pm(&mut dx) } else { p(&dy) };
            let mut pv = partials(parts, 2 * c);
            run(
                &name1("mw_ln_param_grads", T::F),
                LaunchCfg::strip_parts(c as u64, 1, parts as u32),
                vec![
                    p(&wh),
                    dyin,
                    pm(&mut dg),
                    pm(&mut db),
                    u(rows),
                    u(c),
                    parts_arg(&mut pv, parts),
                ],
            );
            add_parts(&pv, parts, 0, 2 * c, &mut db);
            add_parts(&pv, parts, c, 2 * c, &mut dg);
            run(
                &name1("mw_ln_bwd", T::F),
                LaunchCfg::rows(rows as u64),
                vec![p(&wh), p(&wr), p(&gamma), dyin, pm(&mut dx), u(rows), u(c)],
            );
            close("ln dx", &dx, &wdx, T::REL, 2e-5);
            close("ln dgamma", &dg, &wdg, 1e-5, 1e-4);
            close("ln dbeta", &db, &wdb, 1e-5, 1e-4);
        }
        ln_rebuild_case(d, &x, &gamma, &dy, (&wr, &rs), (&dg0, &db0));
    }
}

/// Layer-norm backward rebuilding x̂ from the input (the row means recomputed into scratch),
/// against the CPU's rebuild; each side reads its own forward's `rstd` (`cpu_gpu`).
fn ln_rebuild_case<T: Ty>(
    d: memwise_kernels::norm::NormDims,
    x: &[T],
    gamma: &[f32],
    dy: &[T],
    (cpu_rs, gpu_rs): (&[f32], &[f32]),
    (dg0, db0): (&[f32], &[f32]),
) {
    let (rows, c) = (d.rows, d.channels);
    let (mut wdx, mut wdg, mut wdb) = (zeros::<T>(rows * c), dg0.to_vec(), db0.to_vec());
    let mut wmean = vec![0f32; rows];
    k::norm::layer_norm_backward_rebuild(
        d,
        x,
        cpu_rs,
        gamma,
        dy,
        &mut wdx,
        &mut wmean,
        k::norm::AffineGrads {
            dgamma: &mut wdg,
            dbeta: &mut wdb,
        },
    )
    .unwrap();
    let mut mean = vec![f32::NAN; rows];
    run(
        &name1("mw_ln_mean", T::F),
        LaunchCfg::rows(rows as u64),
        vec![p(x), pm(&mut mean), u(rows), u(c)],
    );
    close("ln rebuild mean", &mean, &wmean, 1e-6, 1e-6);
    let (mut dx, mut dg, mut db) = (zeros::<T>(rows * c), dg0.to_vec(), db0.to_vec());
    let parts = if c == 64 { 3 } else { 1 };
    let mut pv = partials(parts, 2 * c);
    run(
        &name1("mw_ln_param_grads_rebuild", T::F),
        LaunchCfg::strip_parts(c as u64, 1, parts as u32),
        vec![
            p(x),
            p(&mean),
            p(gpu_rs),
            p(dy),
            pm(&mut dg),
            pm(&mut db),
            u(rows),
            u(c),
            parts_arg(&mut pv, parts),
        ],
    );
    add_parts(&pv, parts, 0, 2 * c, &mut db);
    add_parts(&pv, parts, c, 2 * c, &mut dg);
    run(
        &name1("mw_ln_bwd_rebuild", T::F),
        LaunchCfg::rows(rows as u64),
        vec![
            p(x),
            p(&mean),
            p(gpu_rs),
            p(gamma),
            p(dy),
            pm(&mut dx),
            u(rows),
            u(c),
        ],
    );
    close("ln rebuild dx", &dx, &wdx, T::REL, 2e-5);
    close("ln rebuild dgamma", &dg, &wdg, 1e-5, 1e-4);
    close("ln rebuild dbeta", &db, &wdb, 1e-5, 1e-4);
}

/// Group norm and its uncentred, shift-free case RMS norm (one kernel pair): images in groups
/// (one, several, one channel each) and rows of one group, odd sizes; the parameter gradients
/// through `mw_ln_param_grads` over `[samples·spatial, c]` rows, without `dbeta` for RMS norm.
fn gn_case<T: Ty>(r: &mut Rng) {
    use k::norm::*;
    for (samples, spatial, c, groups, center) in [
        (3usize, 35usize, 12usize, 4usize, true),
        (2, 9, 6, 1, true),
        (2, 5, 7, 7, true),
        (37, 1, 300, 1, false),
        (5, 1, 5, 1, false),
    ] {
        let d = GroupNormDims {
            samples,
            spatial,
            channels: c,
            groups,
            center,
        };
        let (n, stats) = (d.len(), d.stats());
        let what = format!("gn {samples}x{spatial}x{c}/{groups} center {center}");
        let x: Vec<T> = r.t(n, -3.0, 4.0);
        let gamma = r.vec(c, 0.5, 1.5);
        let beta = r.vec(c, -0.5, 0.5);
        let beta_cpu = center.then_some(&beta[..]);
        let (mut wy, mut wh, mut wr) = (zeros::<T>(n), zeros::<T>(n), vec![0f32; stats]);
        group_norm_forward(d, 1e-3, &x, &gamma, beta_cpu, &mut wy, &mut wh, &mut wr).unwrap();
        let (mut y, mut h, mut rs) = (zeros::<T>(n), zeros::<T>(n), vec![0f32; stats]);
        let beta_gpu = if center { p(&beta) } else { KArg::Ptr(0) };
        let dims = [
            u(samples),
            u(spatial),
            u(c),
            u(groups),
            KArg::I32(center as i32),
        ];
        let mut args = vec![
            p(&x),
            pm(&mut y),
            pm(&mut h),
            pm(&mut rs),
            p(&gamma),
            beta_gpu,
        ];
        args.extend(dims);
        args.push(KArg::F32(1e-3));
        run(
            &name1("mw_gn_fwd", T::F),
            LaunchCfg::rows(stats as u64),
            args,
        );
        close(&format!("{what} y"), &y, &wy, T::REL, 1e-5);
        close(&format!("{what} x_hat"), &h, &wh, T::REL, 1e-5);
        close(&format!("{what} rstd"), &rs, &wr, 1e-6, 0.0);

        let dy: Vec<T> = r.t(n, -1.0, 1.0);
        let (dg0, db0) = (r.vec(c, -1.0, 1.0), r.vec(c, -1.0, 1.0));
        let (mut wdx, mut wdg, mut wdb) = (zeros::<T>(n), dg0.clone(), db0.clone());
        let wdb_cpu = center.then_some(&mut wdb[..]);
        group_norm_backward(d, &wh, &wr, &gamma, &dy, &mut wdx, &mut wdg, wdb_cpu).unwrap();
        let (mut dx, mut dg, mut db) = (zeros::<T>(n), dg0.clone(), db0.clone());
        let db_gpu = if center { pm(&mut db) } else { KArg::Ptr(0) };
        // Split in the cases with enough rows.
        let parts = if samples * spatial >= 37 { 3 } else { 1 };
        let mut pv = partials(parts, 2 * c);
        run(
            &name1("mw_ln_param_grads", T::F),
            LaunchCfg::strip_parts(c as u64, 1, parts as u32),
            vec![
                p(&wh),
                p(&dy),
                pm(&mut dg),
                db_gpu,
                u(samples * spatial),
                u(c),
                parts_arg(&mut pv, parts),
            ],
        );
        if center {
            add_parts(&pv, parts, 0, 2 * c, &mut db);
        }
        add_parts(&pv, parts, c, 2 * c, &mut dg);
        let mut args = vec![p(&wh), p(&wr), p(&gamma), p(&dy), pm(&mut dx)];
        args.extend(dims);
        run(
            &name1("mw_gn_bwd", T::F),
            LaunchCfg::rows(stats as u64),
            args,
        );
        close(&format!("{what} dx"), &dx, &wdx, T::REL, 2e-5);
        close(&format!("{what} dgamma"), &dg, &wdg, 1e-5, 1e-4);
        // Without a shift nothing may touch dbeta's memory.
        close(&format!("{what} dbeta"), &db, &wdb, 1e-5, 1e-4);
        if !center {
            assert_eq!(db, db0, "{what}: dbeta written without a shift");
        }
    }
}

fn norm() {
    let r = &mut Rng::new(4);
    each!(column_sums_case, r);
    each!(bn_case, r);
    each!(ln_case, r);
    each!(gn_case, r);
}

// ---------------------------------------------------------------------------------------------
// pool.cu

fn pool_case<T: Ty>(r: &mut Rng) {
    use k::pool::{Padding, Pool2d};
    let dims = [
        (2, 7, 9, 5, (3, 2), (2, 2), Padding::Same),
        (3, 6, 6, 3, (2, 2), (2, 2), Padding::Valid),
        (1, 5, 8, 70, (3, 3), (1, 1), Padding::Same),
        (2, 4, 4, 2, (4, 4), (1, 1), Padding::Valid),
        (2, 9, 7, 3, (2, 3), (3, 1), Padding::Same),
    ];
    for (n, h, w, c, pool, strides, pad) in dims {
        let d = Pool2d::new(n, h, w, c, pool, strides, pad).unwrap();
        let md = KArg::Pool(MwPool::from(&d));
        // Quantised values make ties (first wins), and one NaN must win its windows.
        let mut x: Vec<T> = r
            .vec(d.in_len(), -4.0, 4.0)
            .iter()
            .map(|v| T::from_f32((v * 2.0).round() / 2.0))
            .collect();
        if T::F == Float::F32 {
            x[d.in_len() / 2] = T::from_f32(f32::NAN);
        }
        let (mut wy, mut wa) = (zeros::<T>(d.out_len()), vec![0u8; d.out_len()]);
        k::pool::max_pool2d_forward(&d, &x, &mut wy, &mut wa).unwrap();
        let (mut y, mut a) = (zeros::<T>(d.out_len()), vec![0u8; d.out_len()]);
        run(
            &name1("mw_maxpool_fwd", T::F),
            LaunchCfg::pointwise(d.out_len() as u64),
            vec![p(&x), pm(&mut y), pm(&mut a), md],
        );
        exact("max pool y", &y, &wy);
        assert_eq!(a, wa, "max pool argmax");
        let dy: Vec<T> = r.t(d.out_len(), -1.0, 1.0);
        let mut wdx = zeros::<T>(d.in_len());
        k::pool::max_pool2d_backward(&d, &wa, &dy, &mut wdx).unwrap();
        let mut dx = zeros::<T>(d.in_len());
        run(
            &name1("mw_maxpool_bwd", T::F),
            LaunchCfg::pointwise(d.in_len() as u64).with_blocks(3),
            vec![p(&wa), p(&dy), pm(&mut dx), md],
        );
        exact("max pool dx", &dx, &wdx);

        let x: Vec<T> = r.t(d.in_len(), -4.0, 4.0);
        let mut wy = zeros::<T>(d.out_len());
        k::pool::avg_pool2d_forward(&d, &x, &mut wy).unwrap();
        let mut y = zeros::<T>(d.out_len());
        run(
            &name1("mw_avgpool_fwd", T::F),
            LaunchCfg::pointwise(d.out_len() as u64),
            vec![p(&x), pm(&mut y), md],
        );
        close("avg pool y", &y, &wy, T::REL, 1e-6);
        let mut wdx = zeros::<T>(d.in_len());
        k::pool::avg_pool2d_backward(&d, &dy, &mut wdx).unwrap();
        let mut dx = zeros::<T>(d.in_len());
        run(
            &name1("mw_avgpool_bwd", T::F),
            LaunchCfg::pointwise(d.in_len() as u64),
            vec![p(&dy), pm(&mut dx), md],
        );
        close("avg pool dx", &dx, &wdx, T::REL, 1e-6);
    }
    let (n, hw, c) = (3usize, 13usize, 70usize);
    let x: Vec<T> = r.t(n * hw * c, -2.0, 2.0);
    let mut wy = zeros::<T>(n * c);
    k::pool::global_avg_pool_forward(&x, &mut wy, n, hw, c).unwrap();
    let mut y = zeros::<T>(n * c);
    run(
        &name1("mw_gap_fwd", T::F),
        LaunchCfg::pointwise((n * c) as u64),
        vec![p(&x), pm(&mut y), u(n), u(hw), u(c)],
    );
    close("global avg pool", &y, &wy, T::REL, 1e-6);
    let dy: Vec<T> = r.t(n * c, -1.0, 1.0);
    let mut wdx = zeros::<T>(n * hw * c);
    k::pool::global_avg_pool_backward(&dy, &mut wdx, n, hw, c).unwrap();
    let mut dx = zeros::<T>(n * hw * c);
    run(
        &name1("mw_gap_bwd", T::F),
        LaunchCfg::pointwise((n * hw * c) as u64),
        vec![p(&dy), pm(&mut dx), u(n), u(hw), u(c)],
    );
    exact("global avg pool dx", &dx, &wdx);
}

fn pool() {
    let r = &mut Rng::new(5);
    each!(pool_case, r);
}

// ---------------------------------------------------------------------------------------------
// conv.cu (+ the mapped GEMMs)

fn conv2d_case<T: Ty>(r: &mut Rng) {
    use k::conv::{Conv2dDims, Padding};
    let dims = [
        (3, 7, 6, 4, 5, 3, 3, 1, 1, Padding::Same),
        (2, 8, 8, 3, 6, 3, 2, 2, 2, Padding::Valid),
        (2, 5, 5, 2, 3, 1, 1, 2, 2, Padding::Same),
        (2, 4, 5, 3, 4, 1, 1, 1, 1, Padding::Same),
    ];
    for (n, h, w, c_in, c_out, kh, kw, sh, sw, padding) in dims {
        let d = Conv2dDims {
            n,
            h,
            w,
            c_in,
            c_out,
            kh,
            kw,
            sh,
            sw,
            padding,
        };
        let g = MwGeom::conv2d(&d);
        let p_ = d.out_h() * d.out_w();
        let x: Vec<T> = r.t(d.x_len(), -1.0, 1.0);
        let wt: Vec<T> = r.t(d.w_len(), -1.0, 1.0);
        let bias = r.vec(c_out, -0.5, 0.5);
        let dy: Vec<T> = r.t(d.y_len(), -1.0, 1.0);
        for chunk in [1, 2, n] {
            let mut col_cpu = zeros::<T>(k::conv::conv2d_col_len(d, chunk));
            let mut ws = vec![0f32; k::conv::conv2d_ws_len::<T>(d, chunk)];
            let mut wy = zeros::<T>(d.y_len());
            k::conv::conv2d_forward(
                d,
                &x,
                &wt,
                Some(&bias),
                &mut wy,
                &mut col_cpu,
                chunk,
                &mut ws,
            )
            .unwrap();
            let mut y = zeros::<T>(d.y_len());
            let mut col = zeros::<T>(k::conv::conv2d_col_len(d, chunk).max(1));
            if d.is_pointwise() {
                row_gemm(&cm::conv2d_forward_pointwise(&d), &x, &wt, &mut y);
            } else {
                for (n0, cn) in cm::chunks(n, chunk) {
                    let len = cn * p_ * g.k();
                    run(
                        &name1("mw_im2col", T::F),
                        LaunchCfg::pointwise(len as u64),
                        vec![
                            p(&x),
                            pm(&mut col),
                            KArg::Geom(g),
                            KArg::I32(n0 as i32),
                            KArg::I32(cn as i32),
                        ],
                    );
                    row_gemm(&cm::conv2d_forward_chunk(&d, n0, cn), &col, &wt, &mut y);
                }
            }
            run(
                &name1("mw_bias_add", T::F),
                LaunchCfg::pointwise(y.len() as u64),
                vec![pm(&mut y), p(&bias), u(n * p_), u(c_out)],
            );
            // Half storage: the GEMM rounds to T before the bias is added (one more rounding).
            close("conv2d y", &y, &wy, 2.0 * T::REL, half_abs::<T>());

            // Backward.
            let dw0 = r.vec(d.w_len(), -1.0, 1.0);
            let db0 = r.vec(c_out, -1.0, 1.0);
            let (mut wdx, mut wdw, mut wdb) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
            k::conv::conv2d_backward(
                d,
                &x,
                &wt,
                &dy,
                Some(&mut wdx),
                &mut wdw,
                Some(&mut wdb),
                &mut col_cpu,
                chunk,
                &mut ws,
            )
            .unwrap();
            let (mut dx, mut dw, mut db) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
            if d.is_pointwise() {
                let gs = cm::conv2d_backward_pointwise(&d, true);
                row_gemm(&gs[0], &x, &dy, &mut dw);
                row_gemm(&gs[1], &dy, &wt, &mut dx);
            } else {
                let img = h * w * c_in;
                for (n0, cn) in cm::chunks(n, chunk) {
                    let len = cn * p_ * g.k();
                    run(
                        &name1("mw_im2col", T::F),
                        LaunchCfg::pointwise(len as u64),
                        vec![
                            p(&x),
                            pm(&mut col),
                            KArg::Geom(g),
                            KArg::I32(n0 as i32),
                            KArg::I32(cn as i32),
                        ],
                    );
                    let (gw, gx) = cm::conv2d_backward_chunk(&d, n0, cn);
                    row_gemm(&gw, &col, &dy, &mut dw);
                    row_gemm(&gx, &dy, &wt, &mut col);
                    run(
                        &name1("mw_col2im", T::F),
                        LaunchCfg::pointwise((cn * img) as u64),
                        vec![
                            p(&col),
                            pat(&mut dx, n0 * img),
                            KArg::Geom(g),
                            KArg::I32(cn as i32),
                            NULL,
                        ],
                    );
                }
            }
            run(
                &name1("mw_column_sums", T::F),
                LaunchCfg::strip(c_out as u64, 1),
                vec![p(&dy), u(n * p_), u(c_out), pm(&mut db), NULL],
            );
            close("conv2d dx", &dx, &wdx, 2.0 * T::REL, 1e-5);
            close("conv2d dw", &dw, &wdw, 1e-4, 1e-4);
            close("conv2d db", &db, &wdb, 1e-5, 1e-4);
        }
    }
}

fn conv2d_transpose_case<T: Ty>(r: &mut Rng) {
    use k::conv::{ConvTranspose2dDims, Padding};
    let dims = [
        (2, 4, 5, 3, 4, 3, 3, 2, 2, Padding::Same),
        (2, 3, 3, 2, 3, 2, 3, 1, 2, Padding::Valid),
        (3, 3, 4, 4, 2, 1, 1, 1, 1, Padding::Same),
        // Valid, kernel shorter than the stride: output rows and columns no tap reaches.
        (2, 3, 2, 2, 3, 1, 2, 2, 3, Padding::Valid),
    ];
    for (n, h, w, c_in, c_out, kh, kw, sh, sw, padding) in dims {
        let d = ConvTranspose2dDims {
            n,
            h,
            w,
            c_in,
            c_out,
            kh,
            kw,
            sh,
            sw,
            padding,
        };
        let g = MwGeom::conv2d_transpose(&d);
        let (hw, img_out) = (h * w, d.out_h() * d.out_w() * c_out);
        let x: Vec<T> = r.t(d.x_len(), -1.0, 1.0);
        let wt: Vec<T> = r.t(d.w_len(), -1.0, 1.0);
        let bias = r.vec(c_out, -0.5, 0.5);
        let dy: Vec<T> = r.t(d.y_len(), -1.0, 1.0);
        for chunk in [1, n] {
            let mut col_cpu = zeros::<T>(k::conv::conv2d_transpose_col_len(d, chunk));
            let mut ws = vec![0f32; k::conv::conv2d_transpose_ws_len::<T>(d, chunk)];
            let mut wy = zeros::<T>(d.y_len());
            k::conv::conv2d_transpose_forward(
                d,
                &x,
                &wt,
                Some(&bias),
                &mut wy,
                &mut col_cpu,
                chunk,
                &mut ws,
            )
            .unwrap();
            let mut y = zeros::<T>(d.y_len());
            let mut col = zeros::<T>(k::conv::conv2d_transpose_col_len(d, chunk).max(1));
            if d.is_pointwise() {
                row_gemm(&cm::conv2d_transpose_forward_pointwise(&d), &x, &wt, &mut y);
                run(
                    &name1("mw_bias_add", T::F),
                    LaunchCfg::pointwise(y.len() as u64),
                    vec![pm(&mut y), p(&bias), u(n * hw), u(c_out)],
                );
            } else {
                for (n0, cn) in cm::chunks(n, chunk) {
                    row_gemm(
                        &cm::conv2d_transpose_forward_chunk(&d, n0, cn),
                        &x,
                        &wt,
                        &mut col,
                    );
                    run(
                        &name1("mw_col2im", T::F),
                        LaunchCfg::pointwise((cn * img_out) as u64),
                        vec![
                            p(&col),
                            pat(&mut y, n0 * img_out),
                            KArg::Geom(g),
                            KArg::I32(cn as i32),
                            p(&bias),
                        ],
                    );
                }
            }
            close("conv2d_transpose y", &y, &wy, 2.0 * T::REL, half_abs::<T>());

            let dw0 = r.vec(d.w_len(), -1.0, 1.0);
            let db0 = r.vec(c_out, -1.0, 1.0);
            let (mut wdx, mut wdw, mut wdb) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
            k::conv::conv2d_transpose_backward(
                d,
                &x,
                &wt,
                &dy,
                Some(&mut wdx),
                &mut wdw,
                Some(&mut wdb),
                &mut col_cpu,
                chunk,
                &mut ws,
            )
            .unwrap();
            let (mut dx, mut dw, mut db) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
            if d.is_pointwise() {
                let gs = cm::conv2d_transpose_backward_pointwise(&d, true);
                row_gemm(&gs[0], &dy, &x, &mut dw);
                row_gemm(&gs[1], &dy, &wt, &mut dx);
            } else {
                for (n0, cn) in cm::chunks(n, chunk) {
                    let len = cn * hw * g.k();
                    run(
                        &name1("mw_im2col", T::F),
                        LaunchCfg::pointwise(len as u64),
                        vec![
                            p(&dy),
                            pm(&mut col),
                            KArg::Geom(g),
                            KArg::I32(n0 as i32),
                            KArg::I32(cn as i32),
                        ],
                    );
                    let gs = cm::conv2d_transpose_backward_chunk(&d, n0, cn, true);
                    row_gemm(&gs[0], &col, &x, &mut dw);
                    row_gemm(&gs[1], &col, &wt, &mut dx);
                }
            }
            run(
                &name1("mw_column_sums", T::F),
                LaunchCfg::strip(c_out as u64, 1),
                vec![p(&dy), u(d.y_len() / c_out), u(c_out), pm(&mut db), NULL],
            );
            close("conv2d_transpose dx", &dx, &wdx, 2.0 * T::REL, 1e-5);
            close("conv2d_transpose dw", &dw, &wdw, 1e-4, 1e-4);
            close("conv2d_transpose db", &db, &wdb, 1e-5, 1e-4);
        }
    }
}

fn depthwise_case<T: Ty>(r: &mut Rng) {
    use k::conv::{DepthwiseConv2dDims, Padding};
    let dims = [
        (2, 7, 6, 3, 1, 3, 3, 1, 1, Padding::Same),
        (2, 8, 7, 4, 2, 3, 2, 2, 2, Padding::Valid),
        (1, 5, 5, 33, 1, 5, 5, 2, 2, Padding::Same),
    ];
    for (n, h, w, c, multiplier, kh, kw, sh, sw, padding) in dims {
        let d = DepthwiseConv2dDims {
            n,
            h,
            w,
            c,
            multiplier,
            kh,
            kw,
            sh,
            sw,
            padding,
        };
        let md = KArg::Depthwise(MwDepthwise::from(&d));
        let x: Vec<T> = r.t(d.x_len(), -1.0, 1.0);
        let wt: Vec<T> = r.t(d.w_len(), -1.0, 1.0);
        let bias = r.vec(d.c_out(), -0.5, 0.5);
        let mut wy = zeros::<T>(d.y_len());
        k::conv::depthwise_conv2d_forward(d, &x, &wt, Some(&bias), &mut wy).unwrap();
        let mut y = zeros::<T>(d.y_len());
        run(
            &name1("mw_dw_fwd", T::F),
            LaunchCfg::pointwise(d.y_len() as u64),
            vec![p(&x), p(&wt), p(&bias), pm(&mut y), md],
        );
        close("depthwise y", &y, &wy, T::REL, 1e-6);
        let dy: Vec<T> = r.t(d.y_len(), -1.0, 1.0);
        let dw0 = r.vec(d.w_len(), -1.0, 1.0);
        let db0 = r.vec(d.c_out(), -1.0, 1.0);
        let (mut wdx, mut wdw, mut wdb) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
        k::conv::depthwise_conv2d_backward(
            d,
            &x,
            &wt,
            &dy,
            Some(&mut wdx),
            &mut wdw,
            Some(&mut wdb),
        )
        .unwrap();
        let (mut dx, mut dw, mut db) = (zeros::<T>(d.x_len()), dw0.clone(), db0.clone());
        run(
            &name1("mw_dw_bwd_dx", T::F),
            LaunchCfg::pointwise(d.x_len() as u64),
            vec![p(&wt), p(&dy), pm(&mut dx), md],
        );
        // The weight gradient split into row parts in the largest case.
        let parts = if c == 33 { 3 } else { 1 };
        let mut pv = partials(parts, d.w_len());
        run(
            &name1("mw_dw_bwd_dw", T::F),
            LaunchCfg::strip_parts(d.c_out() as u64, (kh * kw) as u32, parts as u32),
            vec![p(&x), p(&dy), pm(&mut dw), md, parts_arg(&mut pv, parts)],
        );
        add_parts(&pv, parts, 0, d.w_len(), &mut dw);
        run(
            &name1("mw_column_sums", T::F),
            LaunchCfg::strip(d.c_out() as u64, 1),
            vec![
                p(&dy),
                u(d.y_len() / d.c_out()),
                u(d.c_out()),
                pm(&mut db),
                NULL,
            ],
        );
        close("depthwise dx", &dx, &wdx, T::REL, 1e-6);
        close("depthwise dw", &dw, &wdw, 1e-5, 1e-5);
        close("depthwise db", &db, &wdb, 1e-5, 1e-5);
    }
}

fn conv() {
    let r = &mut Rng::new(6);
    each!(conv2d_case, r);
    each!(conv2d_transpose_case, r);
    each!(depthwise_case, r);
}

// ---------------------------------------------------------------------------------------------
// random.cu

fn dropout_case<T: Ty>(r: &mut Rng) {
    use k::random::RngKey;
    let key = RngKey {
        seed: 0xDEAD_BEEF_0123_4567,
        layer: 3,
        step: 0x1_0000_0002,
        // A data-parallel replica's stream: block 0 of this tensor is the counter's 17.
        first_block: 17,
    };
    let (n, rate) = (1003usize, 0.3f32);
    let x: Vec<T> = r.t(n, -2.0, 2.0);
    let (mut wy, mut wm) = (zeros::<T>(n), vec![0u8; n]);
    k::random::dropout_forward(key, rate, &x, &mut wy, &mut wm).unwrap();
    let mut sc = MwScalars {
        step: key.step,
        ..Default::default()
    };
    let (mut y, mut m) = (zeros::<T>(n), vec![0u8; n]);
    let name = name1("mw_dropout_fwd", T::F);
    let cfg = LaunchCfg::pointwise(n.div_ceil(4) as u64);
    run(
        &name,
        cfg,
        vec![
            p(&x),
            pm(&mut y),
            pm(&mut m),
            u(n),
            KArg::F32(rate),
            KArg::U64(key.seed),
            KArg::U32(key.layer),
            KArg::U32(key.first_block),
            scal(&mut sc),
        ],
    );
    assert_eq!(m, wm, "dropout mask is bit-identical to the CPU's");
    exact("dropout y", &y, &wy);
    let mut xy = x.clone();
    run(
        &name,
        cfg.with_blocks(1),
        vec![
            pm(&mut xy),
            pm(&mut xy),
            pm(&mut m),
            u(n),
            KArg::F32(rate),
            KArg::U64(key.seed),
            KArg::U32(key.layer),
            KArg::U32(key.first_block),
            scal(&mut sc),
        ],
    );
    exact("dropout y in place", &xy, &wy);
    let dy: Vec<T> = r.t(n, -1.0, 1.0);
    let mut wdx = zeros::<T>(n);
    k::random::dropout_backward(rate, &wm, &dy, &mut wdx).unwrap();
    let mut dx = dy.clone();
    run(
        &name1("mw_dropout_bwd", T::F),
        LaunchCfg::pointwise(n as u64),
        vec![p(&wm), pm(&mut dx), pm(&mut dx), u(n), KArg::F32(rate)],
    );
    exact("dropout dx", &dx, &wdx);
}

fn sample_normal_case<T: Ty>(r: &mut Rng) {
    use k::elementwise::GradWrite;
    use k::random::RngKey;
    let key = RngKey {
        seed: 42,
        layer: 9,
        step: 17,
        first_block: 251,
    };
    let n = 1001;
    let mean: Vec<T> = r.t(n, -1.0, 1.0);
    let logvar: Vec<T> = r.t(n, -2.0, 1.0);
    let mut wz = zeros::<T>(n);
    k::random::sample_normal_forward(key, &mean, &logvar, &mut wz).unwrap();
    let mut sc = MwScalars {
        step: key.step,
        ..Default::default()
    };
    let mut z = zeros::<T>(n);
    let cfg = LaunchCfg::pointwise(n.div_ceil(4) as u64);
    run(
        &name1("mw_sample_normal_fwd", T::F),
        cfg,
        vec![
            p(&mean),
            p(&logvar),
            pm(&mut z),
            u(n),
            KArg::U64(key.seed),
            KArg::U32(key.layer),
            KArg::U32(key.first_block),
            scal(&mut sc),
        ],
    );
    close("sample_normal z", &z, &wz, T::REL, 1e-5);
    let dz: Vec<T> = r.t(n, -1.0, 1.0);
    for (write, acc) in [(GradWrite::Overwrite, 0), (GradWrite::Accumulate, 1)] {
        let (dm0, dl0): (Vec<T>, Vec<T>) = (r.t(n, -1.0, 1.0), r.t(n, -1.0, 1.0));
        let (mut wdm, mut wdl) = (dm0.clone(), dl0.clone());
        k::random::sample_normal_backward(key, &logvar, &dz, &mut wdm, &mut wdl, write).unwrap();
        let (mut dm, mut dl) = (dm0.clone(), dl0.clone());
        run(
            &name1("mw_sample_normal_bwd", T::F),
            cfg.with_blocks(2),
            vec![
                p(&logvar),
                p(&dz),
                pm(&mut dm),
                pm(&mut dl),
                u(n),
                KArg::U64(key.seed),
                KArg::U32(key.layer),
                KArg::U32(key.first_block),
                scal(&mut sc),
                KArg::I32(acc),
            ],
        );
        close("sample_normal dmean", &dm, &wdm, T::REL, 1e-6);
        close("sample_normal dlogvar", &dl, &wdl, T::REL, 1e-5);
    }
}

fn random() {
    use k::random::RngKey;
    let r = &mut Rng::new(7);
    // Raw Philox words, bit for bit, with a step above 2^32 (both counter words used).
    let key = RngKey {
        seed: 0x1234_5678_9ABC_DEF0,
        layer: 7,
        step: 0x1_0000_0003,
        first_block: 0,
    };
    let nb = 1001usize;
    let mut out = vec![0u32; 4 * nb];
    run(
        "mw_philox_words",
        LaunchCfg::pointwise(nb as u64),
        vec![
            pm(&mut out),
            u(nb),
            KArg::U64(key.seed),
            KArg::U32(key.layer),
            KArg::U64(key.step),
        ],
    );
    for b in 0..nb {
        assert_eq!(
            &out[4 * b..4 * b + 4],
            &key.block(b as u32),
            "philox block {b}"
        );
    }
    each!(dropout_case, r);
    each!(sample_normal_case, r);
}

// ---------------------------------------------------------------------------------------------
// optimizer.cu

fn optimizer() {
    use k::optimizer::{Adam, AdamW, Optimizer, RmsProp, Sgd};
    let r = &mut Rng::new(8);
    let n = 1003;
    let unscale = 0.5f32;
    let p0 = r.vec(n, -1.0, 1.0);
    let g = r.vec(n, -2.0, 2.0);
    let s0: Vec<Vec<f32>> = (0..3).map(|_| r.vec(n, 0.0, 0.5)).collect();
    let step = 3u64;

    // Runs the CPU update and the multi-tensor kernel from the same state, the parameter cut
    // into chunks of 300 (4 blocks, the last short), with no 16-bit copy, a float16 or a
    // bfloat16 one; params and state must agree bit for bit (the same f32 operations in the
    // same order; sqrt and division correctly rounded), the copy be the updated values
    // rounded, and a flagged step leave everything as it was. `layout[j]`: the CPU's state
    // slot the kernel's `s[j]` points at.
    let check = |what: &str,
                 opt: &dyn Optimizer,
                 name: &str,
                 hyper: &[KArg],
                 layout: [Option<usize>; 3],
                 alpha: f32| {
        let slots = opt.state_slots();
        let (mut wp, mut ws) = (p0.clone(), s0[..slots].to_vec());
        {
            let mut refs: Vec<&mut [f32]> = ws.iter_mut().map(|v| v.as_mut_slice()).collect();
            opt.update(step, &mut wp, &g, &mut refs, unscale).unwrap();
        }
        let cases = [
            (0, None),
            (0, Some(Float::F16)),
            (0, Some(Float::Bf16)),
            (1, Some(Float::F16)),
        ];
        for (skip, half) in cases {
            let (mut pp, mut ss, mut copy) = (p0.clone(), s0[..slots].to_vec(), vec![0u16; n]);
            let mut sc = MwScalars {
                grad_unscale: unscale,
                adam_alpha: alpha,
                nonfinite: skip,
                ..Default::default()
            };
            let proto = MwUpdateChunk {
                p: pp.as_mut_ptr() as u64,
                g: g.as_ptr() as u64,
                s: layout.map(|slot| slot.map_or(0, |k| ss[k].as_mut_ptr() as u64)),
                half: half.map_or(0, |_| copy.as_mut_ptr() as u64),
                half_kind: MwUpdateChunk::half_kind(half),
                ..Default::default()
            };
            let chunks: Vec<MwUpdateChunk> = MwUpdateChunk::split(proto, n as u64, 300).collect();
            let mut args = vec![p(&chunks)];
            args.extend_from_slice(hyper);
            args.push(scal(&mut sc));
            run(name, LaunchCfg::per_chunk(chunks.len()), args);
            let s0s = s0[..slots].to_vec();
            let (want_p, want_s) = if skip == 1 { (&p0, &s0s) } else { (&wp, &ws) };
            let case = format!("{what}, skip {skip}, copy {half:?}");
            exact(&format!("{case}: params"), &pp, want_p);
            for (k, (a, b)) in ss.iter().zip(want_s.iter()).enumerate() {
                exact(&format!("{case}: state {k}"), a, b);
            }
            let want_copy: Vec<u16> = match half {
                _ if skip == 1 => vec![0; n],
                Some(Float::F16) => wp.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
                Some(Float::Bf16) => wp.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
                _ => vec![0; n],
            };
            assert_eq!(copy, want_copy, "{case}: the 16-bit copy");
        }
    };

    for (mom, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
        let o = Sgd {
            learning_rate: 0.1,
            momentum: mom,
            nesterov,
        };
        let hyper = [KArg::F32(0.1), KArg::F32(mom), KArg::I32(nesterov as i32)];
        let m = (mom != 0.0).then_some(0);
        check(
            &format!("sgd {mom} {nesterov}"),
            &o,
            "mw_sgd",
            &hyper,
            [m, None, None],
            0.0,
        );
    }
    for (mom, centered) in [(0.0, false), (0.5, false), (0.0, true), (0.5, true)] {
        let o = RmsProp {
            learning_rate: 1e-2,
            rho: 0.9,
            momentum: mom,
            epsilon: 1e-7,
            centered,
        };
        let hyper = [
            KArg::F32(1e-2),
            KArg::F32(0.9),
            KArg::F32(mom),
            KArg::F32(1e-7),
        ];
        // The CPU's slots: v, then the momentum's, then the centred average.
        let with_mom = usize::from(mom > 0.0);
        let layout = [
            Some(0),
            (mom > 0.0).then_some(1),
            centered.then_some(1 + with_mom),
        ];
        check(
            &format!("rmsprop {mom} {centered}"),
            &o,
            "mw_rmsprop",
            &hyper,
            layout,
            0.0,
        );
    }
    let adam = Adam {
        learning_rate: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };
    for wd in [0.0f32, 0.004] {
        let alpha = l::adam_alpha(adam.learning_rate, adam.beta_1, adam.beta_2, step);
        let hyper = [
            KArg::F32(0.9),
            KArg::F32(0.999),
            KArg::F32(1e-7),
            KArg::F32(wd * 1e-3),
        ];
        let layout = [Some(0), Some(1), None];
        let adamw = AdamW {
            adam,
            weight_decay: wd,
        };
        let (what, opt): (&str, &dyn Optimizer) = if wd == 0.0 {
            ("adam", &adam)
        } else {
            ("adamw", &adamw)
        };
        check(what, opt, "mw_adam", &hyper, layout, alpha);
    }
}

// ---------------------------------------------------------------------------------------------
// embedding.cu

fn embedding_case<T: Ty>(r: &mut Rng) {
    use k::embedding::EmbeddingDims;
    let (tokens, vocab, dim) = (37usize, 11usize, 70usize);
    let d = EmbeddingDims { tokens, vocab, dim };
    let mut ids: Vec<i32> = (0..tokens).map(|_| r.below(vocab) as i32).collect();
    let w = r.vec(vocab * dim, -1.0, 1.0);
    let mut wy = zeros::<T>(tokens * dim);
    k::embedding::embedding_forward::<f32, T>(d, &ids, &w, &mut wy).unwrap();
    let mut sc = MwScalars::default();
    let mut y = zeros::<T>(tokens * dim);
    let cfg = LaunchCfg::pointwise((tokens * dim) as u64);
    run(
        &name1("mw_embedding_fwd", T::F),
        cfg,
        vec![
            p(&ids),
            p(&w),
            pm(&mut y),
            u(tokens),
            u(vocab),
            u(dim),
            scal(&mut sc),
        ],
    );
    exact("embedding y", &y, &wy);
    assert_eq!(sc.bad_index, 0);
    let dy: Vec<T> = r.t(tokens * dim, -1.0, 1.0);
    let dw0 = r.vec(vocab * dim, -1.0, 1.0);
    let mut wdw = dw0.clone();
    k::embedding::embedding_backward(d, &ids, &dy, &mut wdw).unwrap();
    let mut dw = dw0.clone();
    run(
        &name1("mw_embedding_bwd", T::F),
        cfg.with_blocks(2),
        vec![p(&ids), p(&dy), pm(&mut dw), u(tokens), u(vocab), u(dim)],
    );
    close("embedding dw", &dw, &wdw, 1e-6, 1e-6);
    ids[3] = vocab as i32;
    run(
        &name1("mw_embedding_fwd", T::F),
        cfg,
        vec![
            p(&ids),
            p(&w),
            pm(&mut y),
            u(tokens),
            u(vocab),
            u(dim),
            scal(&mut sc),
        ],
    );
    assert_eq!(sc.bad_index, 4, "token 3's id is out of range");
    assert!(y[3 * dim..4 * dim].iter().all(|v| v.to_f32() == 0.0));
}

/// The positional embedding's forward out of place and in place (its gradient is
/// `mw_column_sums`, covered with the norms, and a cast).
fn pos_embedding_case<T: Ty>(r: &mut Rng) {
    let (rows, len) = (5usize, 37usize * 3);
    let x: Vec<T> = r.t(rows * len, -2.0, 2.0);
    let table = r.vec(len, -1.0, 1.0);
    let mut want = zeros::<T>(rows * len);
    k::embedding::positional_embedding_forward(rows, len, &x, &table, &mut want).unwrap();
    let name = name1("mw_pos_embedding_fwd", T::F);
    let cfg = LaunchCfg::pointwise((rows * len) as u64);
    let mut y = zeros::<T>(rows * len);
    run(
        &name,
        cfg,
        vec![p(&x), p(&table), pm(&mut y), u(rows), u(len)],
    );
    close("pos_embedding y", &y, &want, T::REL, 1e-6);
    let mut xy = x.clone();
    let (a, b) = (pm(&mut xy), pm(&mut xy));
    run(
        &name,
        cfg.with_blocks(2),
        vec![a, p(&table), b, u(rows), u(len)],
    );
    close("pos_embedding in place", &xy, &want, T::REL, 1e-6);
}

fn embedding() {
    let r = &mut Rng::new(9);
    each!(embedding_case, r);
    each!(pos_embedding_case, r);
}

// ---------------------------------------------------------------------------------------------

/// Modules whose kernels another test file runs and checks for coverage the same way:
/// `attention` (the memory-efficient attention) in `cuda_flash_emulation.rs`, against an f64
/// reference.
const TESTED_ELSEWHERE: &[&str] = &["attention"];

/// Every kernel against the CPU, groups on parallel threads; then every kernel in the sources
/// (but those of [`TESTED_ELSEWHERE`]) must have been launched.
#[test]
fn every_cuda_kernel_matches_the_cpu_kernels() {
    let groups: [(&str, fn()); 9] = [
        ("elementwise", elementwise),
        ("activation", activation),
        ("loss", loss),
        ("norm", norm),
        ("pool", pool),
        ("conv", conv),
        ("random", random),
        ("optimizer", optimizer),
        ("embedding", embedding),
    ];
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.iter().map(|(name, f)| (name, s.spawn(f))).collect();
        let mut failed = Vec::new();
        for (name, h) in hs {
            if h.join().is_err() {
                failed.push(*name);
            }
        }
        assert!(failed.is_empty(), "kernel groups that failed: {failed:?}");
    });
    let launched = LAUNCHED.lock().unwrap().clone();
    let missing: Vec<String> = emu::kernels()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !launched.contains(n) && !n.starts_with("mw_emu_"))
        .filter(|n| {
            k::cuda::sources::source_of(n).is_none_or(|s| !TESTED_ELSEWHERE.contains(&s.module))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "kernels never run against the CPU: {missing:?}"
    );
}

/// Every kernel maps to the source module that defines it (what NVRTC compiles on first use).
#[test]
fn every_kernel_has_a_module() {
    for (name, _) in emu::kernels()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("mw_emu_"))
    {
        let src = k::cuda::sources::source_of(&name).unwrap_or_else(|| panic!("{name}: no module"));
        let text = k::cuda::sources::module_source(src.module).unwrap();
        assert!(text.contains("MW_KERNEL"), "{name}");
    }
}

/// The emulator refuses an argument list that does not match the kernel's parameters.
#[test]
fn a_wrong_argument_list_is_refused() {
    let x = vec![0u8; 4];
    let mut y = vec![0f32; 4];
    let call = KernelCall::new(
        "mw_cast_u8_f32",
        LaunchCfg::pointwise(4),
        vec![
            p(&x),
            pm(&mut y),
            KArg::I32(4),
            KArg::F32(1.0),
            KArg::F32(0.0),
        ],
    );
    // SAFETY: the launch is refused before anything runs.
    let e = unsafe {
        emu::launch(
            &call.name,
            call.cfg.grid,
            call.cfg.block,
            &call.params(),
            &call.signature(),
        )
    }
    .unwrap_err();
    assert!(e.contains("takes (p,p,Q,f,f)"), "{e}");
    let e = unsafe { emu::launch("mw_nothing", [1, 1, 1], [32, 1, 1], &[], "") }.unwrap_err();
    assert!(e.contains("no kernel named"), "{e}");
}

/// The emulator itself: barriers and shuffles across a block work, and misuse is reported
/// as an error instead of hanging.
#[test]
fn the_emulator_reports_barrier_misuse() {
    let mut out = vec![0i32; 65];
    let launch = |name: &str, grid: u32, block: u32, out: &mut [i32]| {
        let call = KernelCall::new(
            name,
            LaunchCfg {
                grid: [grid, 1, 1],
                block: [block, 1, 1],
            },
            vec![pm(out)],
        );
        // SAFETY: `out` holds 65 ints, as many as any of these kernels writes.
        unsafe {
            emu::launch(
                &call.name,
                call.cfg.grid,
                call.cfg.block,
                &call.params(),
                &call.signature(),
            )
        }
    };
    launch("mw_emu_selftest_block_sum", 3, 256, &mut out).unwrap();
    assert_eq!(&out[..3], &[255 * 256 / 2; 3]);
    let e = launch("mw_emu_selftest_divergent", 1, 64, &mut out).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
    let e = launch("mw_emu_selftest_exited_lane", 1, 32, &mut out).unwrap_err();
    assert!(e.contains("has exited"), "{e}");
    // Blocks and threads run in a shuffled order (each one once), not in index order, unless
    // MW_EMU_SEED=0 asks for index order.
    let in_order = std::env::var("MW_EMU_SEED").is_ok_and(|s| s == "0");
    for (name, grid, block) in [
        ("mw_emu_selftest_block_order", 64, 32),
        ("mw_emu_selftest_thread_order", 1, 64),
    ] {
        out.fill(0);
        launch(name, grid, block, &mut out).unwrap();
        let ran = out[..64].to_vec();
        let mut sorted = ran.clone();
        sorted.sort();
        assert_eq!(sorted, (0..64).collect::<Vec<i32>>(), "{name}: {ran:?}");
        assert_eq!(
            ran == sorted,
            in_order,
            "{name} ran in index order: {ran:?}"
        );
    }
}
