//! CUDA kernels over tensors of more than 2³² elements, emulated on the CPU over sparse memory.
//!
//! The kernels whose index arithmetic divides run it in 32 bits when every index of a launch
//! stays below 2³¹ and in 64 bits otherwise (`MW_BY_INDEX` in `kernels/cuda/common.cuh`); the
//! column strips split their rows into parts (`mw_part_rows`). The ordinary emulation tests
//! (`cuda_emulation.rs`) run the 32-bit paths; these run the 64-bit ones where they matter: an
//! index past 2³² that a 32-bit path would wrap, so a wrong path reads or writes the wrong
//! element and the check fails.
//!
//! The tensors (up to 9 GiB) are anonymous mappings that reserve no memory: only the pages a
//! test writes, and those the launched blocks touch, become resident. A grid-stride launch over
//! 4·10⁹ elements runs only a few of its blocks (`memwise_cuda_emu::launch_blocks`), each
//! exactly as in the whole grid, and the test checks every element those blocks write.
#![cfg(target_os = "linux")]

use std::ffi::c_void;

use half::f16;
use memwise_cuda_emu as emu;
use memwise_kernels::cuda::launch::{name1, Float, KArg, KernelCall, LaunchCfg, MwGeom, MwPool};

const TWO_32: usize = 1 << 32;

/// An anonymous private mapping of `len` zeroed `T`s that commits only the pages touched.
struct Sparse<T> {
    ptr: *mut T,
    len: usize,
}

extern "C" {
    fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64)
        -> *mut c_void;
    fn munmap(addr: *mut c_void, len: usize) -> i32;
}
const PROT_READ_WRITE: i32 = 0x1 | 0x2;
const MAP_PRIVATE_ANONYMOUS_NORESERVE: i32 = 0x02 | 0x20 | 0x4000;

impl<T: Copy> Sparse<T> {
    /// `Err` (the reason) when the address space refuses the mapping.
    fn new(len: usize) -> Result<Sparse<T>, String> {
        let bytes = len * std::mem::size_of::<T>();
        // SAFETY: a fresh anonymous mapping; no existing memory is involved.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                bytes,
                PROT_READ_WRITE,
                MAP_PRIVATE_ANONYMOUS_NORESERVE,
                -1,
                0,
            )
        };
        if p as isize == -1 {
            return Err(format!(
                "mmap of {bytes} bytes failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Sparse {
            ptr: p as *mut T,
            len,
        })
    }
    fn arg(&self) -> KArg {
        KArg::host(self.ptr)
    }
    fn get(&self, i: usize) -> T {
        assert!(i < self.len);
        // SAFETY: in bounds of the mapping; an untouched page reads as zeros, a valid T here
        // (f16 and u8).
        unsafe { *self.ptr.add(i) }
    }
    fn set(&mut self, i: usize, v: T) {
        assert!(i < self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { *self.ptr.add(i) = v }
    }
}

impl<T> Drop for Sparse<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { munmap(self.ptr as *mut c_void, self.len * std::mem::size_of::<T>()) };
    }
}

/// The peak resident set of this process so far, in bytes.
fn peak_resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn launch(name: &str, cfg: LaunchCfg, args: Vec<KArg>, only: Option<&[[u32; 3]]>) {
    let call = KernelCall::new(name, cfg, args);
    // SAFETY: every pointer argument is a mapping or buffer as large as the kernel's dims say,
    // and the blocks run touch only it.
    unsafe {
        emu::launch_blocks(
            &call.name,
            call.cfg.grid,
            call.cfg.block,
            &call.params(),
            &call.signature(),
            only,
        )
    }
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The elements a 1-D grid-stride launch's block `b` visits, over `n` elements.
fn grid_stride(cfg: LaunchCfg, b: u32, n: usize) -> impl Iterator<Item = usize> {
    let (threads, block) = (
        cfg.grid[0] as usize * cfg.block[0] as usize,
        cfg.block[0] as usize,
    );
    let first = b as usize * block;
    (first..first + block).flat_map(move |t| (t..n).step_by(threads))
}

/// A value exactly representable in f16, from an element's index.
fn pattern(i: usize) -> f16 {
    f16::from_f32(((i % 61) as f32 - 30.0) * 0.25 + ((i / 61) % 13) as f32 * 0.03125)
}

/// `y[i] += bias[i % cols]` over rows·cols > 2³² (item 8's `i % cols`).
fn bias_add_past_2_32() -> Result<(), String> {
    let cols = 4099; // not a power of 2: a wrapped index lands on another column
    let rows = (TWO_32 + (1 << 20)).div_ceil(cols);
    let n = rows * cols;
    let mut y = Sparse::<f16>::new(n)?;
    let bias: Vec<f32> = (0..cols).map(|j| (j % 7) as f32 * 0.5).collect();
    let cfg = LaunchCfg::pointwise(n as u64);
    let blocks = [0, cfg.grid[0] / 2, cfg.grid[0] - 1];
    for &b in &blocks {
        for i in grid_stride(cfg, b, n) {
            y.set(i, pattern(i));
        }
    }
    let only: Vec<[u32; 3]> = blocks.iter().map(|&b| [b, 0, 0]).collect();
    launch(
        &name1("mw_bias_add", Float::F16),
        cfg,
        vec![
            y.arg(),
            KArg::host(bias.as_ptr()),
            KArg::U64(rows as u64),
            KArg::U64(cols as u64),
        ],
        Some(&only),
    );
    let mut past = 0;
    for &b in &blocks {
        for i in grid_stride(cfg, b, n) {
            let want = f16::from_f32(pattern(i).to_f32() + bias[i % cols]);
            assert_eq!(y.get(i), want, "bias_add element {i} (of {n})");
            past += usize::from(i >= TWO_32);
        }
    }
    assert!(past > 0, "no element past 2^32 was checked");
    println!("bias_add: {n} elements, {past} checked past 2^32");
    Ok(())
}

/// im2col of the last sample of a batch whose image tensor holds more than 2³² elements: every
/// read is past 2³² (item 8's im2col offsets), the column buffer is small.
fn im2col_past_2_32() -> Result<(), String> {
    let (h, w, c) = (64usize, 64usize, 4usize);
    let n = TWO_32 / (h * w * c) + 2;
    let mut img = Sparse::<f16>::new(n * h * w * c)?;
    let n0 = n - 1;
    let base = n0 * h * w * c;
    assert!(base > TWO_32);
    for e in 0..h * w * c {
        img.set(base + e, pattern(e));
    }
    // 3×3, stride 1, padding 1: the output grid is the image's.
    let g = MwGeom {
        h: h as i32,
        w: w as i32,
        c: c as i32,
        oh: h as i32,
        ow: w as i32,
        kh: 3,
        kw: 3,
        sh: 1,
        sw: 1,
        pt: 1,
        pl: 1,
    };
    let k = 9 * c;
    let mut col = vec![f16::from_f32(f32::NAN); h * w * k];
    launch(
        &name1("mw_im2col", Float::F16),
        LaunchCfg::pointwise(col.len() as u64),
        vec![
            img.arg(),
            KArg::host(col.as_mut_ptr()),
            KArg::Geom(g),
            KArg::I32(n0 as i32),
            KArg::I32(1),
        ],
        None,
    );
    for (e, got) in col.iter().enumerate() {
        let (r, kk) = (e / k, e % k);
        let (oy, ox, tap, ci) = (r / w, r % w, kk / c, kk % c);
        let (iy, ix) = ((oy + tap / 3) as isize - 1, (ox + tap % 3) as isize - 1);
        let inside = (0..h as isize).contains(&iy) && (0..w as isize).contains(&ix);
        let want = if inside {
            pattern((iy as usize * w + ix as usize) * c + ci)
        } else {
            f16::ZERO
        };
        assert_eq!(got.to_bits(), want.to_bits(), "im2col element {e}");
    }
    println!("im2col: sample {n0} of {n}, image offsets from {base}");
    Ok(())
}

/// 2×2/2 max pooling over an input of more than 2³² elements (item 8's pooling windows).
fn max_pool_past_2_32() -> Result<(), String> {
    let (h, w, c) = (32usize, 32usize, 4usize);
    let n = TWO_32 / (h * w * c) + 16;
    let (oh, ow) = (h / 2, w / 2);
    let (ins, outs) = (n * h * w * c, n * oh * ow * c);
    let mut x = Sparse::<f16>::new(ins)?;
    let y = Sparse::<f16>::new(outs)?;
    let argmax = Sparse::<u8>::new(outs)?;
    let cfg = LaunchCfg::pointwise(outs as u64);
    let blocks = [0, cfg.grid[0] - 1];
    // The input element of output o's window tap (ki, kj).
    let at = |o: usize, ki: usize, kj: usize| {
        let (ch, p) = (o % c, o / c);
        let (ox, oy, s) = (p % ow, (p / ow) % oh, p / (ow * oh));
        ((s * h + 2 * oy + ki) * w + 2 * ox + kj) * c + ch
    };
    for &b in &blocks {
        for o in grid_stride(cfg, b, outs) {
            for t in 0..4 {
                let i = at(o, t / 2, t % 2);
                x.set(i, pattern(i.wrapping_mul(0x9E37_79B9) >> 7));
            }
        }
    }
    let d = MwPool {
        n: n as i32,
        h: h as i32,
        w: w as i32,
        c: c as i32,
        kh: 2,
        kw: 2,
        sh: 2,
        sw: 2,
        oh: oh as i32,
        ow: ow as i32,
        pt: 0,
        pl: 0,
    };
    let only: Vec<[u32; 3]> = blocks.iter().map(|&b| [b, 0, 0]).collect();
    launch(
        &name1("mw_maxpool_fwd", Float::F16),
        cfg,
        vec![x.arg(), y.arg(), argmax.arg(), KArg::Pool(d)],
        Some(&only),
    );
    let mut past = 0;
    for &b in &blocks {
        for o in grid_stride(cfg, b, outs) {
            let (mut best, mut idx) = (x.get(at(o, 0, 0)), 0u8);
            for t in 1..4 {
                let v = x.get(at(o, t / 2, t % 2));
                if v.to_f32() > best.to_f32() {
                    (best, idx) = (v, t as u8);
                }
            }
            assert_eq!(y.get(o), best, "max pool output {o}");
            assert_eq!(argmax.get(o), idx, "max pool argmax {o}");
            past += usize::from(at(o, 1, 1) >= TWO_32);
        }
    }
    assert!(past > 0, "no window past 2^32 was checked");
    println!("max pool: {ins} input elements, {past} windows checked past 2^32");
    Ok(())
}

/// Column sums (a bias gradient) of a [rows, 33] matrix of more than 2³² elements, its rows
/// split into parts (item 6's strips): the last part's rows all lie past 2³².
fn column_sums_past_2_32() -> Result<(), String> {
    let cols = 33;
    // 2 % more than 2³² elements: the last of the 1024 parts starts past 2³².
    let rows = TWO_32 / cols * 51 / 50;
    let parts = 1024usize;
    let mut m = Sparse::<f16>::new(rows * cols)?;
    // The rows of part p, as mw_part_rows splits them.
    let part = |p: usize| (rows * p / parts, rows * (p + 1) / parts);
    let mut want = vec![0.0f64; parts * cols];
    for p in [0, parts - 1] {
        let (r0, r1) = part(p);
        let written = (r0..r1 - 100).step_by(997).chain(r1 - 100..r1);
        for r in written {
            for j in 0..cols {
                let v = pattern(r * cols + j);
                m.set(r * cols + j, v);
                want[p * cols + j] += v.to_f64();
            }
        }
    }
    assert!(part(parts - 1).0 * cols > TWO_32);
    let mut sums = vec![0.0f32; cols];
    let mut partials = vec![f64::NAN; parts * cols];
    let only = [
        [0, 0, 0],
        [1, 0, 0],
        [0, 0, parts as u32 - 1],
        [1, 0, parts as u32 - 1],
    ];
    launch(
        &name1("mw_column_sums", Float::F16),
        LaunchCfg::strip_parts(cols as u64, 1, parts as u32),
        vec![
            m.arg(),
            KArg::U64(rows as u64),
            KArg::U64(cols as u64),
            KArg::host(sums.as_mut_ptr()),
            KArg::host(partials.as_mut_ptr()),
        ],
        Some(&only),
    );
    for p in [0, parts - 1] {
        for j in 0..cols {
            let (got, w) = (partials[p * cols + j], want[p * cols + j]);
            assert!(
                (got - w).abs() <= 1e-9 * w.abs().max(1.0),
                "column sum of part {p}, column {j}: {got} != {w}"
            );
        }
    }
    println!(
        "column sums: {} elements, parts 0 and {} checked",
        rows * cols,
        parts - 1
    );
    Ok(())
}

/// One check: `Err` (the reason) when its mappings were refused.
type Case = fn() -> Result<(), String>;

#[test]
fn kernels_index_past_2_32_elements_on_sparse_memory() {
    let before = peak_resident();
    let cases: [(&str, Case); 4] = [
        ("bias_add", bias_add_past_2_32),
        ("im2col", im2col_past_2_32),
        ("max pool", max_pool_past_2_32),
        ("column sums", column_sums_past_2_32),
    ];
    for (name, case) in cases {
        if let Err(why) = case() {
            // The mappings reserve no memory, but an address-space limit (ulimit -v) can
            // refuse them.
            println!("SKIPPED {name}: {why}");
            continue;
        }
        let grown = peak_resident().saturating_sub(before);
        println!("  peak resident growth so far: {} MiB", grown >> 20);
        assert!(
            grown < 2 << 30,
            "{name}: {} MiB became resident: the sparse tensors were touched whole",
            grown >> 20
        );
    }
}
