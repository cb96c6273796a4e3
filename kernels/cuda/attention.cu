// Memory-efficient multi-head attention (FlashAttention-2 style): the S×S scores are never
// stored; each block keeps tiles of q, k, v in shared memory and runs an online softmax over
// the key tiles. The CPU kernel (kernels/src/attention.rs) implements the same contract, and
// kernels/tests/cuda_flash_emulation.rs checks these kernels against an f64 reference.
//
// Dims: batch B, seq S, heads H, head_dim Dh ≤ MW_FA_DMAX (128), hidden h = H·Dh. Storage T
// (f32 / f16 / bf16), arithmetic f32.
//   qkv  [B, S, 3h]  q of head hd in columns hd·Dh.., k in h + hd·Dh.., v in 2h + hd·Dh..
//   ctx  [B, S, h]   head hd's output in columns hd·Dh..
//   lse  [B, H, S]   f32 (whatever T): m_i + ln l_i
// Forward, pair (b, hd), query row i: s_ij = scale·q_i·k_j over j < S (j ≤ i when causal),
// m_i = max_j s_ij, l_i = Σ_j exp(s_ij − m_i), p_ij = exp(s_ij − m_i)/l_i. Dropout rate r
// (0 ≤ r < 1; r = 0: none, no RNG): element e = ((b·H + hd)·S + i)·S + j is kept iff
// uniform(e) ≥ r, uniform = `RngKey{seed, layer, step, first_block}.uniform_at(e)` (Philox,
// common.cuh; first_block: a data-parallel replica's offset, 0 on one device; the step from
// MwScalars, so a captured graph draws fresh masks); pd_ij = kept ? p_ij·rscale
// : 0 with rscale = 1/(1 − r); ctx_i = Σ_j pd_ij·v_j. l_i sums the undropped probabilities.
// Backward, given dctx: Dr_i = Σ_c dctx_ic·ctx_ic (a pre-kernel, into the first B·H·S floats
// of an f32 scratch buffer); per unmasked (i, j): p_ij = exp(s_ij − lse_i), dpd_ij =
// dctx_i·v_j, dp_ij = kept ? dpd_ij·rscale : 0, ds_ij = p_ij·(dp_ij − Dr_i); dq_i +=
// scale·ds_ij·k_j, dk_j += scale·ds_ij·q_i, dv_j += pd_ij·dctx_i. The backward OVERWRITES all
// of dqkv [B, S, 3h] (T): the dK/dV kernel writes the k and v columns, the dQ kernel the q
// columns. No atomics: every output element is summed by one thread in a fixed order, so
// results do not depend on block order; tiles entirely above the causal diagonal are skipped.
//
// Launches (kernels/src/cuda/flash.rs builds them), MW_FA_THREADS threads per block:
//   mw_flash_fwd_T      grid (B·H, ceil(S / MW_FA_FWD_BQ)): a block per pair and query tile
//   mw_flash_bwd_dot_T  one warp per row of Dr (LaunchCfg::rows(B·H·S))
//   mw_flash_bwd_dkv_T  grid (B·H, ceil(S / MW_FA_BWD_B)): a block per pair and key tile
//   mw_flash_bwd_dq_T   grid (B·H, ceil(S / MW_FA_BWD_B)): a block per pair and query tile
// A head_dim outside 1..=MW_FA_DMAX, or another block size, makes a kernel return at once.
#include "common.cuh"

#define MW_FA_DMAX 128
#define MW_FA_PAD (MW_FA_DMAX + 1) // shared row stride: rows start in different banks
#define MW_FA_THREADS 128
#define MW_FA_FWD_BQ 32 // forward: query rows per block
#define MW_FA_FWD_BK 16 // forward: key rows per tile
#define MW_FA_BWD_B 16  // backward: query and key rows per tile

// What every attention kernel knows of its launch.
struct MwFa {
    int seq, heads, dh;
    u64 pair;  // b·H + hd
    u64 h;     // H·Dh
    int causal;
    float scale;
    bool drop;
    float rate, rscale;
    u64 seed, step;
    u32 layer;
    u32 first;  // the stream's first block (RngKey::first_block: a replica's offset)
};

MW_DEV MwFa mw_fa(int seq, int heads, int dh, int causal, float scale, float rate, u64 seed,
                  u32 layer, u32 first, const MwScalars* sc) {
    MwFa f;
    f.seq = seq;
    f.heads = heads;
    f.dh = dh;
    f.pair = blockIdx.x;
    f.h = (u64)heads * dh;
    f.causal = causal;
    f.scale = scale;
    f.drop = rate > 0.0f;
    f.rate = rate;
    f.rscale = f.drop ? 1.0f / (1.0f - rate) : 1.0f;
    f.seed = seed;
    f.step = f.drop ? sc->step : 0;
    f.layer = layer;
    f.first = first;
    return f;
}

// A launch these kernels do not handle (they return at once): another block shape, a head
// dim outside 1..=MW_FA_DMAX, a block past the batch's pairs.
MW_DEV bool mw_fa_bad_launch(int batch, int heads, int dh) {
    return blockDim.x != MW_FA_THREADS || blockDim.y != 1 || dh < 1 || dh > MW_FA_DMAX ||
           (u64)blockIdx.x >= (u64)batch * (u64)heads;
}

MW_DEV int mw_fa_min(int a, int b) { return a < b ? a : b; }

// Word q (0..3) of w, without indexing a register array (which would put it in local memory).
MW_DEV u32 mw_fa_word(const MwWords& w, u32 q) {
    return q == 0 ? w.w[0] : q == 1 ? w.w[1] : q == 2 ? w.w[2] : w.w[3];
}

// Whether dropout keeps element e; `blk`/`w` cache the last Philox block (consecutive elements
// share one).
MW_DEV bool mw_fa_kept(const MwFa& f, u64 e, u64& blk, MwWords& w) {
    u64 b = e >> 2;
    if (b != blk) {
        w = mw_rng_block(b + f.first, f.seed, f.layer, f.step);
        blk = b;
    }
    return mw_unit(mw_fa_word(w, (u32)(e & 3))) >= f.rate;
}

// Rows r0 .. r0 + R of a [S, stride] matrix (p: row 0, first column) into sh as f32, Dh
// columns; rows past the sequence are zeros (so masked products are 0, never NaN).
template <typename T, int R>
MW_DEV void mw_fa_load(float (*sh)[MW_FA_PAD], const T* p, u64 stride, int r0, int seq, int dh) {
    for (int e = threadIdx.x; e < R * dh; e += MW_FA_THREADS) {
        int r = e / dh, c = e - r * dh;
        int i = r0 + r;
        sh[r][c] = i < seq ? ld(p[(u64)i * stride + c]) : 0.0f;
    }
}

MW_DEV float mw_fa_dot(const float* a, const float* b, int n) {
    float d = 0.0f;
    for (int c = 0; c < n; c++) d += a[c] * b[c];
    return d;
}

// ---- forward -----------------------------------------------------------------------------------

// A block per (pair, query tile of BQ rows); LPR lanes per query row (adjacent lanes of one
// warp, so the row's max and sum are warp shuffles), each with KPT consecutive keys of a key
// tile and the columns g, g + LPR, … of the row's output accumulator.
template <typename T>
MW_DEV void flash_fwd(const T* qkv, T* ctx, float* lse, int batch, int seq, int heads, int dh,
                      int causal, float scale, float rate, u64 seed, u32 layer, u32 first,
                      const MwScalars* sc) {
    constexpr int BQ = MW_FA_FWD_BQ, BK = MW_FA_FWD_BK;
    constexpr int LPR = MW_FA_THREADS / BQ;
    constexpr int KPT = BK / LPR;
    constexpr int CPT = MW_FA_DMAX / LPR;
    static_assert(LPR * BQ == MW_FA_THREADS && KPT * LPR == BK && (32 % LPR) == 0, "tiles");
    __shared__ float qs[BQ][MW_FA_PAD];
    __shared__ float ks[BK][MW_FA_PAD];
    __shared__ float vs[BK][MW_FA_PAD];
    __shared__ float ps[BQ][BK + 1];
    if (mw_fa_bad_launch(batch, heads, dh)) return;
    const MwFa f = mw_fa(seq, heads, dh, causal, scale, rate, seed, layer, first, sc);
    const u64 b = f.pair / (u64)heads, hd = f.pair % (u64)heads;
    const u64 row3 = 3 * f.h;
    const T* qb = qkv + b * (u64)seq * row3 + hd * (u64)dh;
    const int q0 = blockIdx.y * BQ;
    if (q0 >= seq) return;
    const int r = threadIdx.x / LPR, g = threadIdx.x % LPR;
    const int i = q0 + r;

    mw_fa_load<T, BQ>(qs, qb, row3, q0, seq, dh);
    float acc[CPT];
#pragma unroll
    for (int k = 0; k < CPT; k++) acc[k] = 0.0f;
    float m = MW_NEG_INF, l = 0.0f;
    u64 blk = ~0ull;
    MwWords w;
    const int kend = causal ? mw_fa_min(seq, q0 + BQ) : seq;
    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads(); // the previous tile's ks, vs, ps are read
        mw_fa_load<T, BK>(ks, qb + f.h, row3, k0, seq, dh);
        mw_fa_load<T, BK>(vs, qb + 2 * f.h, row3, k0, seq, dh);
        __syncthreads();
        float s[KPT];
        float tmax = MW_NEG_INF;
#pragma unroll
        for (int kk = 0; kk < KPT; kk++) {
            int jr = g * KPT + kk, j = k0 + jr;
            float d = mw_fa_dot(qs[r], ks[jr], dh) * scale;
            s[kk] = j < seq && (!causal || j <= i) ? d : MW_NEG_INF;
            tmax = fmaxf(tmax, s[kk]);
        }
#pragma unroll
        for (int o = 1; o < LPR; o <<= 1)
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
        float mn = fmaxf(m, tmax);
        float base = mn == MW_NEG_INF ? 0.0f : mn; // a row with no key yet: all its p are 0
        float alpha = expf(m - base);
        float ts = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KPT; kk++) {
            int jr = g * KPT + kk;
            float pk = expf(s[kk] - base);
            ts += pk;
            if (f.drop && pk != 0.0f) {
                u64 e = (f.pair * (u64)seq + (u64)i) * (u64)seq + (u64)(k0 + jr);
                if (!mw_fa_kept(f, e, blk, w)) pk = 0.0f;
            }
            ps[r][jr] = pk;
        }
#pragma unroll
        for (int o = 1; o < LPR; o <<= 1) ts += __shfl_xor_sync(0xffffffffu, ts, o);
        l = l * alpha + ts;
        m = mn;
#pragma unroll
        for (int k = 0; k < CPT; k++) acc[k] *= alpha;
        __syncwarp(); // row r's ps is written (by lanes of this warp)
        for (int jr = 0; jr < BK; jr++) {
            float pj = ps[r][jr];
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                int c = g + LPR * k;
                if (c < dh) acc[k] += pj * vs[jr][c];
            }
        }
    }
    if (i < seq) {
        float inv = f.rscale / l;
        T* out = ctx + (b * (u64)seq + (u64)i) * f.h + hd * (u64)dh;
#pragma unroll
        for (int k = 0; k < CPT; k++) {
            int c = g + LPR * k;
            if (c < dh) out[c] = st<T>(acc[k] * inv);
        }
        if (g == 0) lse[f.pair * (u64)seq + (u64)i] = m + logf(l);
    }
}

// ---- backward ----------------------------------------------------------------------------------

// dr[(b·H + hd)·S + i] = Σ_c dctx_ic·ctx_ic: one warp per row, MW_ROW_WARPS rows per block.
template <typename T>
MW_DEV void flash_bwd_dot(const T* dctx, const T* ctx, float* dr, int batch, int seq,
                          int heads, int dh) {
    u64 rows = (u64)batch * heads * seq;
    u64 row = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return; // the whole warp
    int lane = threadIdx.x & 31;
    u64 pair = row / (u64)seq, i = row % (u64)seq;
    u64 b = pair / (u64)heads, hd = pair % (u64)heads;
    u64 at = (b * (u64)seq + i) * ((u64)heads * dh) + hd * (u64)dh;
    float s = 0.0f;
    for (int c = lane; c < dh; c += 32) s += ld(dctx[at + c]) * ld(ctx[at + c]);
    s = mw_warp_sum(s);
    if (lane == 0) dr[row] = s;
}

// The tiles one backward block holds: a query tile (q, dctx, its lse and Dr) and a key tile
// (k, v), and the ds (and pd) of their (query, key) pairs.
struct MwFaBwdTiles {
    float qs[MW_FA_BWD_B][MW_FA_PAD];
    float dos[MW_FA_BWD_B][MW_FA_PAD];
    float ks[MW_FA_BWD_B][MW_FA_PAD];
    float vs[MW_FA_BWD_B][MW_FA_PAD];
    float pds[MW_FA_BWD_B][MW_FA_BWD_B + 1]; // [query][key]
    float dss[MW_FA_BWD_B][MW_FA_BWD_B + 1];
    float lses[MW_FA_BWD_B];
    float drs[MW_FA_BWD_B];
};

static_assert(sizeof(MwFaBwdTiles) <= 48 * 1024, "static shared memory of a backward block");
static_assert(sizeof(float) * (MW_FA_FWD_BQ * MW_FA_PAD + 2 * MW_FA_FWD_BK * MW_FA_PAD +
                               MW_FA_FWD_BQ * (MW_FA_FWD_BK + 1)) <=
                  48 * 1024,
              "static shared memory of a forward block");

template <typename T>
MW_DEV void mw_fa_load_queries(MwFaBwdTiles& t, const MwFa& f, const T* qb, const T* dob,
                               const float* lse, const float* dr, int q0) {
    mw_fa_load<T, MW_FA_BWD_B>(t.qs, qb, 3 * f.h, q0, f.seq, f.dh);
    mw_fa_load<T, MW_FA_BWD_B>(t.dos, dob, f.h, q0, f.seq, f.dh);
    if (threadIdx.x < MW_FA_BWD_B) {
        int i = q0 + threadIdx.x;
        u64 at = f.pair * (u64)f.seq + (u64)i;
        t.lses[threadIdx.x] = i < f.seq ? lse[at] : 0.0f;
        t.drs[threadIdx.x] = i < f.seq ? dr[at] : 0.0f;
    }
}

template <typename T>
MW_DEV void mw_fa_load_keys(MwFaBwdTiles& t, const MwFa& f, const T* qb, int k0) {
    mw_fa_load<T, MW_FA_BWD_B>(t.ks, qb + f.h, 3 * f.h, k0, f.seq, f.dh);
    mw_fa_load<T, MW_FA_BWD_B>(t.vs, qb + 2 * f.h, 3 * f.h, k0, f.seq, f.dh);
}

// ds (and, when PD, pd) of query tile q0 × key tile k0 from the tiles in shared memory: thread
// (row ir, lane g) takes KPT consecutive keys of query row ir (so dropout's consecutive
// elements share Philox blocks). Masked pairs (past the sequence, above the diagonal) are 0.
template <bool PD> MW_DEV void mw_fa_bwd_scores(MwFaBwdTiles& t, const MwFa& f, int q0, int k0) {
    constexpr int B = MW_FA_BWD_B;
    constexpr int LPR = MW_FA_THREADS / B;
    constexpr int KPT = B / LPR;
    static_assert(LPR * B == MW_FA_THREADS && KPT * LPR == B, "tiles");
    const int ir = threadIdx.x / LPR, g = threadIdx.x % LPR;
    const int i = q0 + ir;
    u64 blk = ~0ull;
    MwWords w;
#pragma unroll
    for (int kk = 0; kk < KPT; kk++) {
        int jr = g * KPT + kk, j = k0 + jr;
        float p = 0.0f, pd = 0.0f, ds = 0.0f;
        if (i < f.seq && j < f.seq && (!f.causal || j <= i)) {
            float s = mw_fa_dot(t.qs[ir], t.ks[jr], f.dh) * f.scale;
            p = expf(s - t.lses[ir]);
            float dp = mw_fa_dot(t.dos[ir], t.vs[jr], f.dh);
            bool kept = true;
            if (f.drop) {
                u64 e = (f.pair * (u64)f.seq + (u64)i) * (u64)f.seq + (u64)j;
                kept = mw_fa_kept(f, e, blk, w);
            }
            pd = kept ? p * f.rscale : 0.0f;
            dp = kept ? dp * f.rscale : 0.0f;
            ds = p * (dp - t.drs[ir]);
        }
        if (PD) t.pds[ir][jr] = pd;
        t.dss[ir][jr] = ds;
    }
}

// dK, dV: a block per (pair, key tile); loops over the query tiles that see the key tile.
// Thread (key row jr, lane g) sums dk and dv of its key in columns g, g + LPR, ….
template <typename T>
MW_DEV void flash_bwd_dkv(const T* qkv, const T* dctx, const float* lse, const float* dr,
                          T* dqkv, int batch, int seq, int heads, int dh, int causal,
                          float scale, float rate, u64 seed, u32 layer, u32 first,
                          const MwScalars* sc) {
    constexpr int B = MW_FA_BWD_B;
    constexpr int LPR = MW_FA_THREADS / B;
    constexpr int CPT = MW_FA_DMAX / LPR;
    __shared__ MwFaBwdTiles t;
    if (mw_fa_bad_launch(batch, heads, dh)) return;
    const MwFa f = mw_fa(seq, heads, dh, causal, scale, rate, seed, layer, first, sc);
    const u64 b = f.pair / (u64)heads, hd = f.pair % (u64)heads;
    const u64 row3 = 3 * f.h;
    const T* qb = qkv + b * (u64)seq * row3 + hd * (u64)dh;
    const T* dob = dctx + b * (u64)seq * f.h + hd * (u64)dh;
    const int k0 = blockIdx.y * B;
    if (k0 >= seq) return;
    const int jr = threadIdx.x / LPR, g = threadIdx.x % LPR;
    mw_fa_load_keys<T>(t, f, qb, k0);
    float dk[CPT], dv[CPT];
#pragma unroll
    for (int k = 0; k < CPT; k++) dk[k] = dv[k] = 0.0f;
    // Causal: query rows below k0 see none of these keys.
    for (int q0 = causal ? k0 / B * B : 0; q0 < seq; q0 += B) {
        __syncthreads(); // the previous tile is read
        mw_fa_load_queries<T>(t, f, qb, dob, lse, dr, q0);
        __syncthreads();
        mw_fa_bwd_scores<true>(t, f, q0, k0);
        __syncthreads();
        for (int ir = 0; ir < B; ir++) {
            float pd = t.pds[ir][jr], ds = t.dss[ir][jr];
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                int c = g + LPR * k;
                if (c < dh) {
                    dv[k] += pd * t.dos[ir][c];
                    dk[k] += ds * t.qs[ir][c];
                }
            }
        }
    }
    int j = k0 + jr;
    if (j < seq) {
        T* out = dqkv + (b * (u64)seq + (u64)j) * row3 + hd * (u64)dh;
#pragma unroll
        for (int k = 0; k < CPT; k++) {
            int c = g + LPR * k;
            if (c < dh) {
                out[f.h + c] = st<T>(dk[k] * scale);
                out[2 * f.h + c] = st<T>(dv[k]);
            }
        }
    }
}

// dQ: a block per (pair, query tile); loops over the key tiles the query tile sees. Thread
// (query row ir, lane g) sums dq of its row in columns g, g + LPR, ….
template <typename T>
MW_DEV void flash_bwd_dq(const T* qkv, const T* dctx, const float* lse, const float* dr,
                         T* dqkv, int batch, int seq, int heads, int dh, int causal,
                         float scale, float rate, u64 seed, u32 layer, u32 first,
                         const MwScalars* sc) {
    constexpr int B = MW_FA_BWD_B;
    constexpr int LPR = MW_FA_THREADS / B;
    constexpr int CPT = MW_FA_DMAX / LPR;
    __shared__ MwFaBwdTiles t;
    if (mw_fa_bad_launch(batch, heads, dh)) return;
    const MwFa f = mw_fa(seq, heads, dh, causal, scale, rate, seed, layer, first, sc);
    const u64 b = f.pair / (u64)heads, hd = f.pair % (u64)heads;
    const u64 row3 = 3 * f.h;
    const T* qb = qkv + b * (u64)seq * row3 + hd * (u64)dh;
    const T* dob = dctx + b * (u64)seq * f.h + hd * (u64)dh;
    const int q0 = blockIdx.y * B;
    if (q0 >= seq) return;
    const int ir = threadIdx.x / LPR, g = threadIdx.x % LPR;
    mw_fa_load_queries<T>(t, f, qb, dob, lse, dr, q0);
    float dq[CPT];
#pragma unroll
    for (int k = 0; k < CPT; k++) dq[k] = 0.0f;
    const int kend = causal ? mw_fa_min(seq, q0 + B) : seq;
    for (int k0 = 0; k0 < kend; k0 += B) {
        __syncthreads(); // the previous tile is read
        mw_fa_load_keys<T>(t, f, qb, k0);
        __syncthreads();
        mw_fa_bwd_scores<false>(t, f, q0, k0);
        __syncthreads();
        for (int jr = 0; jr < B; jr++) {
            float ds = t.dss[ir][jr];
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                int c = g + LPR * k;
                if (c < dh) dq[k] += ds * t.ks[jr][c];
            }
        }
    }
    int i = q0 + ir;
    if (i < seq) {
        T* out = dqkv + (b * (u64)seq + (u64)i) * row3 + hd * (u64)dh;
#pragma unroll
        for (int k = 0; k < CPT; k++) {
            int c = g + LPR * k;
            if (c < dh) out[c] = st<T>(dq[k] * scale);
        }
    }
}

#define MW_FLASH(S, T)                                                                          \
    MW_KERNEL(MW_FA_THREADS) mw_flash_fwd_##S(                                                  \
        const T* qkv, T* ctx, float* lse, int batch, int seq, int heads, int head_dim,          \
        int causal, float scale, float rate, u64 seed, u32 layer, u32 first,                    \
        const MwScalars* sc) {                                                                  \
        flash_fwd<T>(qkv, ctx, lse, batch, seq, heads, head_dim, causal, scale, rate, seed,     \
                     layer, first, sc);                                                         \
    }                                                                                           \
    MW_KERNEL_ROWS mw_flash_bwd_dot_##S(const T* dctx, const T* ctx, float* dr,                 \
                                                    int batch, int seq, int heads,              \
                                                    int head_dim) {                             \
        flash_bwd_dot<T>(dctx, ctx, dr, batch, seq, heads, head_dim);                           \
    }                                                                                           \
    MW_KERNEL(MW_FA_THREADS) mw_flash_bwd_dkv_##S(                                              \
        const T* qkv, const T* dctx, const float* lse, const float* dr, T* dqkv, int batch,     \
        int seq, int heads, int head_dim, int causal, float scale, float rate, u64 seed,        \
        u32 layer, u32 first, const MwScalars* sc) {                                            \
        flash_bwd_dkv<T>(qkv, dctx, lse, dr, dqkv, batch, seq, heads, head_dim, causal, scale,  \
                         rate, seed, layer, first, sc);                                         \
    }                                                                                           \
    MW_KERNEL(MW_FA_THREADS) mw_flash_bwd_dq_##S(                                               \
        const T* qkv, const T* dctx, const float* lse, const float* dr, T* dqkv, int batch,     \
        int seq, int heads, int head_dim, int causal, float scale, float rate, u64 seed,        \
        u32 layer, u32 first, const MwScalars* sc) {                                            \
        flash_bwd_dq<T>(qkv, dctx, lse, dr, dqkv, batch, seq, heads, head_dim, causal, scale,   \
                        rate, seed, layer, first, sc);                                          \
    }
MW_FLOATS(MW_FLASH)
