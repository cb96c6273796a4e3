//! Launches of the memory-efficient attention kernels (`kernels/cuda/attention.cu`): the
//! forward `mw_flash_fwd_T`, and the backward's three kernels (`mw_flash_bwd_dot_T` → Dr in
//! the f32 scratch, then `mw_flash_bwd_dkv_T` and `mw_flash_bwd_dq_T`, which between them
//! overwrite all of `dqkv`). The contract (layouts, masking, dropout stream) is in the `.cu`
//! file's header and `kernels/src/attention.rs`.

use super::launch::{name1, Float, KArg, KernelCall, LaunchCfg};

/// Threads per block of the forward, dK/dV and dQ kernels (`MW_FA_THREADS`).
pub const THREADS: u32 = 128;
/// Largest head dim the kernels handle (`MW_FA_DMAX`).
pub const MAX_HEAD_DIM: usize = 128;
/// Query rows per forward block (`MW_FA_FWD_BQ`).
pub const FWD_QUERY_TILE: usize = 32;
/// Query and key rows per backward tile (`MW_FA_BWD_B`).
pub const BWD_TILE: usize = 16;

/// The attention's dims: `qkv [batch, seq, 3·heads·head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashDims {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub causal: bool,
}

impl FlashDims {
    /// Whether the kernels handle these dims (a head dim of 1 to [`MAX_HEAD_DIM`], a grid
    /// that fits CUDA's limits).
    pub fn supported(&self) -> bool {
        (1..=MAX_HEAD_DIM).contains(&self.head_dim)
            && self.seq >= 1
            && self.batch >= 1
            && self.heads >= 1
            && ((self.batch * self.heads) as u64) < (1 << 31)
            && self.seq.div_ceil(BWD_TILE) <= 65535
    }

    /// f32 elements of scratch the backward needs: Dr, `batch·heads·seq`.
    pub fn scratch_f32_elems(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// `1/sqrt(head_dim)` in f32.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    fn dim_args(&self) -> [KArg; 4] {
        let i = |v: usize| KArg::I32(v as i32);
        [i(self.batch), i(self.seq), i(self.heads), i(self.head_dim)]
    }

    fn grid(&self, tile: usize) -> LaunchCfg {
        LaunchCfg {
            grid: [
                (self.batch * self.heads) as u32,
                self.seq.div_ceil(tile) as u32,
                1,
            ],
            block: [THREADS, 1, 1],
        }
    }
}

/// Attention dropout: `rate` 0 is none (then `scalars` may be null); the stream is
/// `RngKey { seed, layer, step: scalars.step }`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashDropout {
    pub rate: f32,
    pub seed: u64,
    pub layer: u32,
    /// The stream's first block (`RngKey::first_block`): a data-parallel replica's offset.
    pub first_block: u32,
    /// Address of the `MwScalars` (its `step` keys the stream).
    pub scalars: u64,
}

impl FlashDropout {
    pub const NONE: FlashDropout = FlashDropout {
        rate: 0.0,
        seed: 0,
        layer: 0,
        first_block: 0,
        scalars: 0,
    };

    fn args(&self) -> [KArg; 5] {
        [
            KArg::F32(self.rate),
            KArg::U64(self.seed),
            KArg::U32(self.layer),
            KArg::U32(self.first_block),
            KArg::Ptr(self.scalars),
        ]
    }
}

/// One flash-attention step's launch settings: the storage float of `qkv`, `ctx` and `dqkv`,
/// the geometry, the score scale and the dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashLaunch {
    pub float: Float,
    pub dims: FlashDims,
    pub scale: f32,
    pub dropout: FlashDropout,
}

impl FlashLaunch {
    /// What follows the pointers in the forward and the two backward kernels: the dims,
    /// `causal`, `scale`, then the dropout's `rate, seed, layer, first_block, scalars`.
    fn settings_args(&self) -> Vec<KArg> {
        let d = &self.dims;
        let mut args = d.dim_args().to_vec();
        args.extend([KArg::I32(d.causal as i32), KArg::F32(self.scale)]);
        args.extend(self.dropout.args());
        args
    }

    /// `mw_flash_fwd_T(qkv, ctx, lse, batch, seq, heads, head_dim, causal, scale, rate, seed,
    /// layer, first_block, scalars)`: grid `(batch·heads, ceil(seq / 32))`, 128 threads. Writes `ctx` (T)
    /// and `lse` (f32, `[batch, heads, seq]`).
    pub fn forward(&self, qkv: u64, ctx: u64, lse: u64) -> KernelCall {
        let mut args = vec![KArg::Ptr(qkv), KArg::Ptr(ctx), KArg::Ptr(lse)];
        args.extend(self.settings_args());
        let grid = self.dims.grid(FWD_QUERY_TILE);
        KernelCall::new(name1("mw_flash_fwd", self.float), grid, args)
    }

    /// The backward's three launches, in order:
    /// 1. `mw_flash_bwd_dot_T(dctx, ctx, dr, batch, seq, heads, head_dim)`, one warp per row
    ///    ([`LaunchCfg::rows`] of `batch·heads·seq`): `dr` = the first
    ///    [`FlashDims::scratch_f32_elems`] floats of `scratch`;
    /// 2. `mw_flash_bwd_dkv_T(qkv, dctx, lse, dr, dqkv, batch, seq, heads, head_dim, causal,
    ///    scale, rate, seed, layer, first_block, scalars)`, grid
    ///    `(batch·heads, ceil(seq / 16))`: the k and v columns of `dqkv`;
    /// 3. `mw_flash_bwd_dq_T(…the same…)`, the same grid: the q columns.
    ///
    /// `saved` is the forward's `[qkv, ctx, lse]`.
    pub fn backward(&self, saved: [u64; 3], dctx: u64, scratch: u64, dqkv: u64) -> [KernelCall; 3] {
        let ([qkv, ctx, lse], d, t) = (saved, &self.dims, self.float);
        let mut dot = vec![KArg::Ptr(dctx), KArg::Ptr(ctx), KArg::Ptr(scratch)];
        dot.extend(d.dim_args());
        let mut args = vec![
            KArg::Ptr(qkv),
            KArg::Ptr(dctx),
            KArg::Ptr(lse),
            KArg::Ptr(scratch),
            KArg::Ptr(dqkv),
        ];
        args.extend(self.settings_args());
        [
            KernelCall::new(
                name1("mw_flash_bwd_dot", t),
                LaunchCfg::rows(d.scratch_f32_elems() as u64),
                dot,
            ),
            KernelCall::new(name1("mw_flash_bwd_dkv", t), d.grid(BWD_TILE), args.clone()),
            KernelCall::new(name1("mw_flash_bwd_dq", t), d.grid(BWD_TILE), args),
        ]
    }
}
