//! Launch shapes and arguments of the CUDA kernels, shared by the device executor and the host
//! emulation so both launch the kernels identically.
//!
//! A kernel's arguments are a list of [`KArg`]s, packed the way `cuLaunchKernel` takes them
//! (one pointer per parameter, to a value of the parameter's C type). Device pointers are plain
//! `u64` addresses (`CUdeviceptr`): the arena's base plus a planned offset. The structs here
//! are `#[repr(C)]` mirrors of the ones in the `.cu` sources.

use std::ffi::c_void;

use crate::conv::{Conv2dDims, ConvTranspose2dDims, DepthwiseConv2dDims};
use crate::pool::Pool2d;

/// Threads per block of the 1-D kernels (`MW_BLOCK`).
pub const BLOCK: u32 = 256;
/// Warps (rows) per block of the one-warp-per-row kernels (`MW_ROW_WARPS`).
pub const ROW_WARPS: u32 = 8;
/// Row lanes of a channel-strip block, which is `32 × STRIP_Y` threads (`MW_STRIP_Y`).
pub const STRIP_Y: u32 = 32;
/// Threads of the single-block reductions (`MW_REDUCE_THREADS`).
pub const REDUCE_THREADS: u32 = 1024;
/// Most blocks a grid-stride kernel is launched with (about 8 resident blocks per SM on a
/// 132-SM H200; more only adds scheduling).
pub const MAX_BLOCKS: u64 = 2048;

/// A float storage type, as the kernels' name suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Float {
    F32,
    F16,
    Bf16,
}

impl Float {
    pub const ALL: [Float; 3] = [Float::F32, Float::F16, Float::Bf16];

    /// `f32`, `f16` or `bf16`: the suffix of the kernel names.
    pub fn suffix(self) -> &'static str {
        match self {
            Float::F32 => "f32",
            Float::F16 => "f16",
            Float::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Float::F32 => 4,
            _ => 2,
        }
    }
}

/// `base_T` (e.g. `mw_relu_f16`).
pub fn name1(base: &str, t: Float) -> String {
    format!("{base}_{}", t.suffix())
}

/// `base_A_B` (e.g. `mw_cast_f32_bf16`).
pub fn name2(base: &str, a: Float, b: Float) -> String {
    format!("{base}_{}_{}", a.suffix(), b.suffix())
}

/// `base_A_B_C` (e.g. `mw_softmax_bwd_f16_f16_f32`).
pub fn name3(base: &str, a: Float, b: Float, c: Float) -> String {
    format!("{base}_{}_{}_{}", a.suffix(), b.suffix(), c.suffix())
}

/// Per-step values in device memory (`MwScalars` in common.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MwScalars {
    /// Training steps run so far (keys dropout and sampling).
    pub step: u64,
    /// The dynamic loss scale the loss kernels multiply their gradients by.
    pub loss_scale: f32,
    /// `1 / loss_scale`, applied by the optimizer kernels.
    pub grad_unscale: f32,
    /// Adam's bias-corrected step size for this update.
    pub adam_alpha: f32,
    /// Set by `mw_all_finite_f32` when a gradient is NaN or infinite.
    pub nonfinite: i32,
    /// Correct predictions counted by the classification losses.
    pub correct: i32,
    /// 1 + the position of an out-of-range label or id, 0 when none.
    pub bad_index: i32,
}

/// One block's share of a multi-tensor optimizer update (`MwUpdateChunk` in optimizer.cu):
/// elements `begin..end` of one parameter — its f32 values, gradient, optimizer state slots
/// (0 where unused), and 16-bit copy (0 when none) rewritten from the updated values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MwUpdateChunk {
    pub p: u64,
    pub g: u64,
    pub s: [u64; 3],
    pub half: u64,
    pub begin: u64,
    pub end: u64,
    /// 0: no 16-bit copy, 1: float16, 2: bfloat16.
    pub half_kind: i32,
    pub pad: i32,
}

impl MwUpdateChunk {
    /// The `half_kind` of a 16-bit copy stored as `t` (`None`: no copy).
    pub fn half_kind(t: Option<Float>) -> i32 {
        match t {
            None | Some(Float::F32) => 0,
            Some(Float::F16) => 1,
            Some(Float::Bf16) => 2,
        }
    }

    /// Elements per chunk of an update over `total` elements: at least 512 (two per thread
    /// of a block, so a small parameter still spreads over many blocks), and at most about
    /// 2048 chunks in all, so that a large model's table stays small (72 bytes a chunk).
    pub fn chunk_elems(total: u64) -> u64 {
        total.div_ceil(2048).max(512).next_multiple_of(BLOCK as u64)
    }

    /// The chunks of `n` elements of one parameter, `chunk` elements each but the last, with
    /// every other field copied from `proto`.
    pub fn split(proto: MwUpdateChunk, n: u64, chunk: u64) -> impl Iterator<Item = MwUpdateChunk> {
        (0..n)
            .step_by(chunk.max(1) as usize)
            .map(move |begin| MwUpdateChunk {
                begin,
                end: (begin + chunk).min(n),
                ..proto
            })
    }
}

/// Pooling dims (`MwPool` in pool.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MwPool {
    pub n: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub kh: i32,
    pub kw: i32,
    pub sh: i32,
    pub sw: i32,
    pub oh: i32,
    pub ow: i32,
    pub pt: i32,
    pub pl: i32,
}

impl From<&Pool2d> for MwPool {
    fn from(d: &Pool2d) -> MwPool {
        let i = |v: usize| v as i32;
        MwPool {
            n: i(d.n),
            h: i(d.h),
            w: i(d.w),
            c: i(d.c),
            kh: i(d.kh),
            kw: i(d.kw),
            sh: i(d.sh),
            sw: i(d.sw),
            oh: i(d.out_h),
            ow: i(d.out_w),
            pt: i(d.pad_top),
            pl: i(d.pad_left),
        }
    }
}

/// im2col / col2im geometry (`MwGeom` in conv.cu): an image `[h, w, c]` and `oh × ow` windows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MwGeom {
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub oh: i32,
    pub ow: i32,
    pub kh: i32,
    pub kw: i32,
    pub sh: i32,
    pub sw: i32,
    pub pt: i32,
    pub pl: i32,
}

impl MwGeom {
    /// Columns of the im2col matrix, `kh·kw·c`.
    pub fn k(&self) -> usize {
        (self.kh * self.kw * self.c) as usize
    }

    /// The geometry of a conv2d: windows over the input.
    pub fn conv2d(d: &Conv2dDims) -> MwGeom {
        let i = |v: usize| v as i32;
        MwGeom {
            h: i(d.h),
            w: i(d.w),
            c: i(d.c_in),
            oh: i(d.out_h()),
            ow: i(d.out_w()),
            kh: i(d.kh),
            kw: i(d.kw),
            sh: i(d.sh),
            sw: i(d.sw),
            pt: i(d.pad_top()),
            pl: i(d.pad_left()),
        }
    }

    /// The geometry of a conv2d_transpose: the conv2d from the output's shape to the input's.
    pub fn conv2d_transpose(d: &ConvTranspose2dDims) -> MwGeom {
        let i = |v: usize| v as i32;
        MwGeom {
            h: i(d.out_h()),
            w: i(d.out_w()),
            c: i(d.c_out),
            oh: i(d.h),
            ow: i(d.w),
            kh: i(d.kh),
            kw: i(d.kw),
            sh: i(d.sh),
            sw: i(d.sw),
            pt: i(d.pad_top()),
            pl: i(d.pad_left()),
        }
    }
}

/// Depthwise conv dims (`MwDepthwise` in conv.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MwDepthwise {
    pub n: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub m: i32,
    pub kh: i32,
    pub kw: i32,
    pub sh: i32,
    pub sw: i32,
    pub oh: i32,
    pub ow: i32,
    pub pt: i32,
    pub pl: i32,
}

impl From<&DepthwiseConv2dDims> for MwDepthwise {
    fn from(d: &DepthwiseConv2dDims) -> MwDepthwise {
        let i = |v: usize| v as i32;
        MwDepthwise {
            n: i(d.n),
            h: i(d.h),
            w: i(d.w),
            c: i(d.c),
            m: i(d.multiplier),
            kh: i(d.kh),
            kw: i(d.kw),
            sh: i(d.sh),
            sw: i(d.sw),
            oh: i(d.out_h()),
            ow: i(d.out_w()),
            pt: i(d.pad_top()),
            pl: i(d.pad_left()),
        }
    }
}

/// One kernel argument, by value, in the parameter's C type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KArg {
    /// A device (or, emulated, host) address; `Ptr(0)` is a null pointer.
    Ptr(u64),
    U64(u64),
    I32(i32),
    U32(u32),
    F32(f32),
    F64(f64),
    Pool(MwPool),
    Geom(MwGeom),
    Depthwise(MwDepthwise),
}

impl KArg {
    /// A host pointer as an argument (the emulation's "device" memory).
    pub fn host<T>(p: *const T) -> KArg {
        KArg::Ptr(p as u64)
    }

    /// The parameter's code in a kernel signature (see `memwise_cuda_emu::kernels`).
    pub fn code(&self) -> String {
        match self {
            KArg::Ptr(_) => "p".into(),
            KArg::U64(_) => "Q".into(),
            KArg::I32(_) => "i".into(),
            KArg::U32(_) => "u".into(),
            KArg::F32(_) => "f".into(),
            KArg::F64(_) => "d".into(),
            KArg::Pool(_) => format!("s{}", std::mem::size_of::<MwPool>()),
            KArg::Geom(_) => format!("s{}", std::mem::size_of::<MwGeom>()),
            KArg::Depthwise(_) => format!("s{}", std::mem::size_of::<MwDepthwise>()),
        }
    }

    /// A pointer to the value, as `cuLaunchKernel`'s `kernelParams` entry (valid while `self`
    /// lives and does not move).
    pub fn as_param(&self) -> *mut c_void {
        match self {
            KArg::Ptr(v) | KArg::U64(v) => v as *const u64 as *mut c_void,
            KArg::I32(v) => v as *const i32 as *mut c_void,
            KArg::U32(v) => v as *const u32 as *mut c_void,
            KArg::F32(v) => v as *const f32 as *mut c_void,
            KArg::F64(v) => v as *const f64 as *mut c_void,
            KArg::Pool(v) => v as *const MwPool as *mut c_void,
            KArg::Geom(v) => v as *const MwGeom as *mut c_void,
            KArg::Depthwise(v) => v as *const MwDepthwise as *mut c_void,
        }
    }
}

/// The signature string of an argument list (`p,Q,f,s48` …).
pub fn signature(args: &[KArg]) -> String {
    args.iter().map(KArg::code).collect::<Vec<_>>().join(",")
}

/// Grid and block dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchCfg {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl LaunchCfg {
    /// A grid-stride 1-D kernel over `n` items: `BLOCK` threads, at most [`MAX_BLOCKS`] blocks.
    pub fn pointwise(n: u64) -> LaunchCfg {
        let blocks = n.div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32;
        LaunchCfg {
            grid: [blocks, 1, 1],
            block: [BLOCK, 1, 1],
        }
    }

    /// One warp per row, [`ROW_WARPS`] rows per block.
    pub fn rows(rows: u64) -> LaunchCfg {
        let blocks = rows.div_ceil(ROW_WARPS as u64).max(1) as u32;
        LaunchCfg {
            grid: [blocks, 1, 1],
            block: [32 * ROW_WARPS, 1, 1],
        }
    }

    /// Channel strips: one block of `32 × STRIP_Y` threads per 32 columns, `ys` blocks along y.
    pub fn strip(cols: u64, ys: u32) -> LaunchCfg {
        LaunchCfg::strip_parts(cols, ys, 1)
    }

    /// Channel strips whose rows are split into `parts` along z (the planner's
    /// `column_parts`): each part's blocks sum their share of the rows (`mw_part_rows`).
    pub fn strip_parts(cols: u64, ys: u32, parts: u32) -> LaunchCfg {
        let blocks = cols.div_ceil(32).max(1) as u32;
        LaunchCfg {
            grid: [blocks, ys.max(1), parts.max(1)],
            block: [32, STRIP_Y, 1],
        }
    }

    /// One block of [`BLOCK`] threads per entry of a table of `chunks` (the multi-tensor
    /// optimizer updates: [`MwUpdateChunk`]).
    pub fn per_chunk(chunks: usize) -> LaunchCfg {
        LaunchCfg {
            grid: [chunks.max(1) as u32, 1, 1],
            block: [BLOCK, 1, 1],
        }
    }

    /// One block of [`REDUCE_THREADS`] threads (the loss values).
    pub fn single() -> LaunchCfg {
        LaunchCfg {
            grid: [1, 1, 1],
            block: [REDUCE_THREADS, 1, 1],
        }
    }

    /// A grid-stride kernel forced onto `blocks` blocks (tests of the stride loop).
    pub fn with_blocks(self, blocks: u32) -> LaunchCfg {
        LaunchCfg {
            grid: [blocks.max(1), self.grid[1], self.grid[2]],
            ..self
        }
    }
}

/// One kernel launch: the kernel's name, its shape and its arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCall {
    pub name: String,
    pub cfg: LaunchCfg,
    pub args: Vec<KArg>,
}

impl KernelCall {
    pub fn new(name: impl Into<String>, cfg: LaunchCfg, args: Vec<KArg>) -> KernelCall {
        KernelCall {
            name: name.into(),
            cfg,
            args,
        }
    }

    /// The arguments' signature, which must equal the kernel's.
    pub fn signature(&self) -> String {
        signature(&self.args)
    }

    /// `kernelParams` for `cuLaunchKernel`: pointers into `self.args`.
    pub fn params(&self) -> Vec<*mut c_void> {
        self.args.iter().map(KArg::as_param).collect()
    }
}

/// The activation code the pointwise activation kernels take (`MW_ACT_*` in activation.cu):
/// [`crate::activation::Activation::code`]. Its parameter is the kernels' next argument.
pub fn activation_code(a: crate::activation::Activation) -> i32 {
    a.code()
}

/// Adam's bias-corrected step size `lr·sqrt(1 − β₂ᵗ)/(1 − β₁ᵗ)` for update `step` (1-based),
/// computed as the CPU optimizer does (powers in f64). The host writes it to
/// [`MwScalars::adam_alpha`] before each step.
pub fn adam_alpha(lr: f32, beta_1: f32, beta_2: f32, step: u64) -> f32 {
    let t = step.clamp(1, i32::MAX as u64) as i32;
    let b1 = 1.0 - (beta_1 as f64).powi(t);
    let b2 = 1.0 - (beta_2 as f64).powi(t);
    (lr as f64 * b2.sqrt() / b1) as f32
}

/// Elementwise loss codes (`MW_LOSS_*` in loss.cu).
pub const LOSS_BCE_SIGMOID: i32 = 0;
pub const LOSS_BCE: i32 = 1;
pub const LOSS_MSE: i32 = 2;
pub const LOSS_BCE_LOGITS: i32 = 3;
