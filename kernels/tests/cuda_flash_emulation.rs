//! The memory-efficient attention kernels (`kernels/cuda/attention.cu`), run on the CPU by the
//! host emulation (`memwise-cuda-emu`, blocks and threads in a shuffled order) through the
//! launches `memwise_kernels::cuda::flash` builds, against an f64 reference written here:
//! the S×S scores materialised, softmax, the dropout mask from `RngKey::uniform_at`, the
//! context, and the analytic backward. f32 / f16 / bf16 storage, with and without the causal
//! mask and dropout, sequences that are not multiples of the tiles (1, 7, 33, 70) and head dims
//! 5, 8, 16, 64, 128.
//!
//! Outputs are prefilled with NaN, so an element a kernel does not write fails the
//! comparison (the backward overwrites all of `dqkv`); the scratch past Dr must stay as it
//! was. Every kernel of the `attention` module must have been launched (the check
//! `cuda_emulation.rs` makes for the other modules).

use std::collections::BTreeSet;
use std::sync::Mutex;

use half::{bf16, f16};
use memwise_cuda_emu as emu;
use memwise_kernels::cuda::flash::{self, FlashDims, FlashDropout, FlashLaunch};
use memwise_kernels::cuda::launch::{Float, KernelCall, MwScalars};
use memwise_kernels::random::RngKey;
use memwise_kernels::Element;

static LAUNCHED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

trait Ty: Element {
    const F: Float;
    /// Tolerance relative to the largest magnitude of a result: f32 rounding of the sums, or
    /// for 16-bit storage two ulps of the type (the result is rounded to it once).
    const REL: f64;
}
impl Ty for f32 {
    const F: Float = Float::F32;
    const REL: f64 = 1e-5;
}
impl Ty for f16 {
    const F: Float = Float::F16;
    const REL: f64 = 2.0 / 1024.0;
}
impl Ty for bf16 {
    const F: Float = Float::Bf16;
    const REL: f64 = 2.0 / 128.0;
}

#[track_caller]
fn run(call: &KernelCall) {
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

fn addr<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}
fn addr_mut<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}

struct Rng(u64);
impl Rng {
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
}

fn f64s<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// `got` against `want`: every element within `rel · max mag` (`mag`: the same sums over the
/// terms' magnitudes, which is what rounding errors scale with, also where the terms cancel).
#[track_caller]
fn close<T: Element>(what: &str, got: &[T], want: &[f64], mag: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let big = mag.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let tol = rel * big + 1e-30;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}] ({}): got {g}, want {w} (tolerance {tol:e}, max magnitude {big:e})",
            T::NAME
        );
    }
}

/// What the reference computes of one attention call.
struct Reference {
    ctx: Vec<f64>,
    lse: Vec<f64>,
    dqkv: Vec<f64>,
    /// The sums of `ctx` and `dqkv` over their terms' magnitudes.
    ctx_mag: Vec<f64>,
    dqkv_mag: Vec<f64>,
}

/// The f64 reference: scores materialised per (batch, head), softmax, dropout from
/// `key.uniform_at`, context; the analytic backward with `Dr` from `ctx_stored` (the values
/// the forward stored, as the kernels take them).
fn reference(
    d: &FlashDims,
    rate: f32,
    key: RngKey,
    qkv: &[f64],
    dctx: &[f64],
    ctx_stored: &[f64],
) -> Reference {
    let (b_n, s_n, heads, dh) = (d.batch, d.seq, d.heads, d.head_dim);
    let h = heads * dh;
    let scale = d.scale() as f64;
    let rscale = if rate > 0.0 {
        (1.0f32 / (1.0 - rate)) as f64
    } else {
        1.0
    };
    let mut r = Reference {
        ctx: vec![0.0; b_n * s_n * h],
        lse: vec![0.0; b_n * heads * s_n],
        dqkv: vec![0.0; b_n * s_n * 3 * h],
        ctx_mag: vec![0.0; b_n * s_n * h],
        dqkv_mag: vec![0.0; b_n * s_n * 3 * h],
    };
    for b in 0..b_n {
        for hd in 0..heads {
            let pair = b * heads + hd;
            let at =
                |i: usize, part: usize, c: usize| (b * s_n + i) * 3 * h + part * h + hd * dh + c;
            let ct = |i: usize, c: usize| (b * s_n + i) * h + hd * dh + c;
            let visible = |i: usize, j: usize| !d.causal || j <= i;
            // p[i][j] (0 where masked), kept[i][j].
            let mut p = vec![vec![0.0f64; s_n]; s_n];
            let mut kept = vec![vec![true; s_n]; s_n];
            for i in 0..s_n {
                let mut s = vec![f64::NEG_INFINITY; s_n];
                for (j, sj) in s.iter_mut().enumerate() {
                    if visible(i, j) {
                        *sj = scale
                            * (0..dh)
                                .map(|c| qkv[at(i, 0, c)] * qkv[at(j, 1, c)])
                                .sum::<f64>();
                    }
                }
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|&x| (x - m).exp()).sum();
                r.lse[pair * s_n + i] = m + l.ln();
                for j in 0..s_n {
                    p[i][j] = (s[j] - m).exp() / l;
                    if rate > 0.0 {
                        let e = ((pair * s_n + i) * s_n + j) as u64;
                        kept[i][j] = key.uniform_at(e) >= rate;
                    }
                }
            }
            let pd = |i: usize, j: usize| if kept[i][j] { p[i][j] * rscale } else { 0.0 };
            for i in 0..s_n {
                for c in 0..dh {
                    r.ctx[ct(i, c)] = (0..s_n).map(|j| pd(i, j) * qkv[at(j, 2, c)]).sum();
                    r.ctx_mag[ct(i, c)] =
                        (0..s_n).map(|j| (pd(i, j) * qkv[at(j, 2, c)]).abs()).sum();
                }
            }
            // Backward.
            let dr: Vec<f64> = (0..s_n)
                .map(|i| (0..dh).map(|c| dctx[ct(i, c)] * ctx_stored[ct(i, c)]).sum())
                .collect();
            let dr_mag: Vec<f64> = (0..s_n)
                .map(|i| {
                    (0..dh)
                        .map(|c| (dctx[ct(i, c)] * ctx_stored[ct(i, c)]).abs())
                        .sum()
                })
                .collect();
            let mut ds = vec![vec![0.0f64; s_n]; s_n];
            let mut ds_mag = vec![vec![0.0f64; s_n]; s_n];
            for i in 0..s_n {
                for j in 0..s_n {
                    if !visible(i, j) {
                        continue;
                    }
                    let dpd: f64 = (0..dh).map(|c| dctx[ct(i, c)] * qkv[at(j, 2, c)]).sum();
                    let dp = if kept[i][j] { dpd * rscale } else { 0.0 };
                    ds[i][j] = p[i][j] * (dp - dr[i]);
                    let dpd_mag: f64 = (0..dh)
                        .map(|c| (dctx[ct(i, c)] * qkv[at(j, 2, c)]).abs())
                        .sum();
                    ds_mag[i][j] = p[i][j] * (dpd_mag * rscale + dr_mag[i]);
                }
            }
            for i in 0..s_n {
                for c in 0..dh {
                    r.dqkv[at(i, 0, c)] =
                        scale * (0..s_n).map(|j| ds[i][j] * qkv[at(j, 1, c)]).sum::<f64>();
                    r.dqkv[at(i, 1, c)] =
                        scale * (0..s_n).map(|j| ds[j][i] * qkv[at(j, 0, c)]).sum::<f64>();
                    r.dqkv[at(i, 2, c)] = (0..s_n).map(|j| pd(j, i) * dctx[ct(j, c)]).sum();
                    r.dqkv_mag[at(i, 0, c)] = scale
                        * (0..s_n)
                            .map(|j| ds_mag[i][j] * qkv[at(j, 1, c)].abs())
                            .sum::<f64>();
                    r.dqkv_mag[at(i, 1, c)] = scale
                        * (0..s_n)
                            .map(|j| ds_mag[j][i] * qkv[at(j, 0, c)].abs())
                            .sum::<f64>();
                    r.dqkv_mag[at(i, 2, c)] =
                        (0..s_n).map(|j| (pd(j, i) * dctx[ct(j, c)]).abs()).sum();
                }
            }
        }
    }
    r
}

/// The columns of `part` (0 q, 1 k, 2 v) of a `[rows, 3h]` matrix.
fn part<X: Copy>(m: &[X], h: usize, part: usize) -> Vec<X> {
    m.chunks(3 * h)
        .flat_map(|row| row[part * h..(part + 1) * h].iter().copied())
        .collect()
}

const SCRATCH_SENTINEL: f32 = 12345.0;

fn case<T: Ty>(rng: &mut Rng, seq: usize, head_dim: usize, causal: bool, rate: f32) {
    let d = FlashDims {
        batch: 2,
        seq,
        heads: 3,
        head_dim,
        causal,
    };
    assert!(d.supported());
    let what = format!(
        "{} seq {seq} head_dim {head_dim} causal {causal} rate {rate}",
        T::NAME
    );
    let h = d.heads * head_dim;
    let rows = d.batch * seq;
    let key = RngKey {
        seed: 0xDEAD_BEEF_0123_4567,
        layer: 5,
        step: 0x1_0000_0003,
        // A data-parallel replica's stream starts past block 0 (the causal cases); one
        // device's at 0.
        first_block: if causal { 0xFFFF_FF00 } else { 0 },
    };
    let mut sc = MwScalars {
        step: key.step,
        ..Default::default()
    };
    // With no dropout the kernels get no scalars at all (they must not read them).
    let drop = if rate > 0.0 {
        FlashDropout {
            rate,
            seed: key.seed,
            layer: key.layer,
            first_block: key.first_block,
            scalars: &mut sc as *mut MwScalars as u64,
        }
    } else {
        FlashDropout::NONE
    };
    let qkv: Vec<T> = (0..rows * 3 * h)
        .map(|e| {
            let (lo, hi) = if e % (3 * h) < 2 * h {
                (-2.0, 2.0)
            } else {
                (-1.0, 1.0)
            };
            T::from_f32(rng.f(lo, hi))
        })
        .collect();
    let dctx: Vec<T> = (0..rows * h)
        .map(|_| T::from_f32(rng.f(-1.0, 1.0)))
        .collect();
    let nan = T::from_f32(f32::NAN);

    let mut ctx = vec![nan; rows * h];
    let mut lse = vec![f32::NAN; d.scratch_f32_elems()];
    let launch = FlashLaunch {
        float: T::F,
        dims: d,
        scale: d.scale(),
        dropout: drop,
    };
    run(&launch.forward(addr(&qkv), addr_mut(&mut ctx), addr_mut(&mut lse)));

    let mut scratch = vec![SCRATCH_SENTINEL; d.scratch_f32_elems() + 37];
    let mut dqkv = vec![nan; rows * 3 * h];
    let saved = [addr(&qkv), addr(&ctx), addr(&lse)];
    for call in launch.backward(
        saved,
        addr(&dctx),
        addr_mut(&mut scratch),
        addr_mut(&mut dqkv),
    ) {
        run(&call);
    }

    let want = reference(&d, rate, key, &f64s(&qkv), &f64s(&dctx), &f64s(&ctx));
    close(
        &format!("ctx, {what}"),
        &ctx,
        &want.ctx,
        &want.ctx_mag,
        T::REL,
    );
    // lse is f32 whatever T, from the T inputs: f32 rounding only.
    for (i, (&g, &w)) in lse.iter().zip(&want.lse).enumerate() {
        assert!(
            (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
            "lse[{i}], {what}: got {g}, want {w}"
        );
    }
    // Dr, the pre-kernel's output, from the stored ctx.
    let ctx64 = f64s(&ctx);
    let dctx64 = f64s(&dctx);
    for (row, &g) in scratch[..d.scratch_f32_elems()].iter().enumerate() {
        let (pair, i) = (row / seq, row % seq);
        let (b, hd) = (pair / d.heads, pair % d.heads);
        let at = (b * seq + i) * h + hd * head_dim;
        let w: f64 = (0..head_dim).map(|c| dctx64[at + c] * ctx64[at + c]).sum();
        let mag: f64 = (0..head_dim)
            .map(|c| (dctx64[at + c] * ctx64[at + c]).abs())
            .sum();
        assert!(
            (g as f64 - w).abs() <= 1e-5 * mag + 1e-30,
            "Dr[{row}], {what}: got {g}, want {w}"
        );
    }
    assert!(
        scratch[d.scratch_f32_elems()..]
            .iter()
            .all(|&v| v == SCRATCH_SENTINEL),
        "{what}: the backward wrote scratch past Dr"
    );
    for (p, name) in ["dq", "dk", "dv"].iter().enumerate() {
        close(
            &format!("{name}, {what}"),
            &part(&dqkv, h, p),
            &part(&want.dqkv, h, p),
            &part(&want.dqkv_mag, h, p),
            T::REL,
        );
    }
}

fn all_cases<T: Ty>(seed: u64) {
    let rng = &mut Rng(seed);
    for (seq, head_dim) in [
        (1, 8),
        (7, 16),
        (33, 64),
        (70, 8),
        (17, 128),
        (40, 16),
        (9, 5),
    ] {
        for causal in [false, true] {
            for rate in [0.0, 0.25] {
                case::<T>(rng, seq, head_dim, causal, rate);
            }
        }
    }
}

/// Every case, one storage type per thread; then every kernel of the `attention` module must
/// have been launched.
#[test]
fn flash_attention_kernels_match_the_f64_reference() {
    std::thread::scope(|s| {
        let hs = [
            ("f32", s.spawn(|| all_cases::<f32>(1))),
            ("f16", s.spawn(|| all_cases::<f16>(2))),
            ("bf16", s.spawn(|| all_cases::<bf16>(3))),
        ];
        let failed: Vec<&str> = hs
            .into_iter()
            .filter_map(|(n, h)| h.join().is_err().then_some(n))
            .collect();
        assert!(failed.is_empty(), "storage types that failed: {failed:?}");
    });
    let launched = LAUNCHED.lock().unwrap().clone();
    let ours: Vec<String> = emu::kernels()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| {
            memwise_kernels::cuda::sources::source_of(n).is_some_and(|s| s.module == "attention")
        })
        .collect();
    assert_eq!(ours.len(), 12, "attention kernels: {ours:?}");
    let missing: Vec<&String> = ours.iter().filter(|n| !launched.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "attention kernels never run: {missing:?}"
    );
}

/// A head dim past 128, or another block size, is refused: the kernels return without writing.
#[test]
fn unsupported_launches_write_nothing() {
    let d = FlashDims {
        batch: 1,
        seq: 3,
        heads: 1,
        head_dim: flash::MAX_HEAD_DIM + 1,
        causal: false,
    };
    assert!(!d.supported());
    let qkv = vec![0.5f32; 3 * 3 * d.head_dim];
    let mut ctx = vec![f32::NAN; 3 * d.head_dim];
    let mut lse = vec![f32::NAN; 3];
    let launch = |dims: FlashDims| FlashLaunch {
        float: Float::F32,
        dims,
        scale: dims.scale(),
        dropout: FlashDropout::NONE,
    };
    run(&launch(d).forward(addr(&qkv), addr_mut(&mut ctx), addr_mut(&mut lse)));
    assert!(ctx.iter().chain(&lse).all(|v| v.is_nan()));
    let d = FlashDims { head_dim: 8, ..d };
    let mut call = launch(d).forward(addr(&qkv), addr_mut(&mut ctx), addr_mut(&mut lse));
    call.cfg.block = [64, 1, 1];
    run(&call);
    assert!(ctx.iter().chain(&lse).all(|v| v.is_nan()));
}
