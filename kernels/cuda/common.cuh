// memwise CUDA kernels: definitions shared by every .cu file.
//
// Every kernel is plain CUDA C++ with an `extern "C" __global__` entry point named `mw_…`,
// and one entry per storage type where storage can be half (`_f32`, `_f16`, `_bf16`).
// Arithmetic is always f32 (f64 for the sums the CPU kernels take in f64), exactly like the
// CPU kernels in kernels/src, whose numerics these kernels reproduce.
//
// The sources need no header at all: the 16-bit storage types are this file's own
// (`mw_f16`, `mw_bf16`: the bits of IEEE binary16 / bfloat16, converted with the PTX `cvt`
// instructions), so NVRTC compiles them with no include path on any machine, nvcc compiles
// them for `-cubin` checks in CI, and the host emulation (kernels/cuda/emu/shim.h, which
// defines `threadIdx`, `__syncthreads`, the warp shuffles … on the CPU) compiles them as C++.
//
// Sources are compiled one at a time: each .cu starts with `#include "common.cuh"`; the
// runtime prepends this file to each source (and drops that line) before calling NVRTC.

#ifndef MW_COMMON_CUH
#define MW_COMMON_CUH

#if defined(__CUDACC__)
#define MW_DEV __device__ __forceinline__
#else
// Host emulation: kernels/cuda/emu/shim.h is included first by the harness.
#define MW_DEV inline
#endif

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// Threads per block of the 1-D kernels (pointwise, per-element gathers).
#define MW_BLOCK 256
// Warps per block of the row kernels (one warp per row: softmax, layer norm, losses).
#define MW_ROW_WARPS 8
// The channel-strip kernels (per-channel sums over rows: batch norm, bias gradients) run
// blocks of 32 channels × MW_STRIP_Y row lanes.
#define MW_STRIP_Y 32
// Threads of the single-block reductions (loss values).
#define MW_REDUCE_THREADS 1024

// Entry points, by the block they are launched with (kernels/src/cuda/launch.rs's LaunchCfg):
// each declares it as __launch_bounds__, so ptxas keeps the kernel's registers within what a
// block of that size may use of an SM's 65,536 (scripts/compile-cuda.sh fails on any spill),
// and a launch with a larger block is refused (by the emulator too, so the tests catch it).
#define MW_KERNEL(threads) extern "C" __global__ void __launch_bounds__(threads)
#define MW_KERNEL_1D MW_KERNEL(MW_BLOCK)
#define MW_KERNEL_ROWS MW_KERNEL(32 * MW_ROW_WARPS)
#define MW_KERNEL_STRIP MW_KERNEL(32 * MW_STRIP_Y)
#define MW_KERNEL_BLOCK MW_KERNEL(MW_REDUCE_THREADS)

// ---- 16-bit storage ------------------------------------------------------------------------

struct mw_f16 {
    unsigned short bits;
};
struct mw_bf16 {
    unsigned short bits;
};

#if defined(__CUDACC__)
MW_DEV float mw_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
MW_DEV unsigned short mw_f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
MW_DEV float mw_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}
MW_DEV unsigned short mw_f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Load as f32 / store from f32 (round to nearest even), overloaded on the storage type.
MW_DEV float ld(float v) { return v; }
MW_DEV float ld(mw_f16 v) { return mw_f16_to_f32(v.bits); }
MW_DEV float ld(mw_bf16 v) { return mw_bf16_to_f32(v.bits); }

template <typename T> MW_DEV T st(float v);
template <> MW_DEV float st<float>(float v) { return v; }
template <> MW_DEV mw_f16 st<mw_f16>(float v) {
    mw_f16 r;
    r.bits = mw_f32_to_f16(v);
    return r;
}
template <> MW_DEV mw_bf16 st<mw_bf16>(float v) {
    mw_bf16 r;
    r.bits = mw_f32_to_bf16(v);
    return r;
}

#define MW_NEG_INF __uint_as_float(0xff800000u)

MW_DEV bool mw_isfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
MW_DEV bool mw_isnan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

// Instantiates `M(suffix, type)` for the three float storage types.
#define MW_FLOATS(M) M(f32, float) M(f16, mw_f16) M(bf16, mw_bf16)
// `M(suffix_a, type_a, suffix_b, type_b)` for every pair of float storage types.
#define MW_FLOAT_PAIRS(M)                                                                       \
    M(f32, float, f32, float)                                                                   \
    M(f32, float, f16, mw_f16)                                                                  \
    M(f32, float, bf16, mw_bf16)                                                                \
    M(f16, mw_f16, f32, float)                                                                  \
    M(f16, mw_f16, f16, mw_f16)                                                                 \
    M(f16, mw_f16, bf16, mw_bf16)                                                               \
    M(bf16, mw_bf16, f32, float)                                                                \
    M(bf16, mw_bf16, f16, mw_f16)                                                               \
    M(bf16, mw_bf16, bf16, mw_bf16)

// `M(sa, ta, sb, tb, sc, tc)` for every triple of float storage types.
#define MW_FLOAT_TRIPLES_2(M, SA, TA, SB, TB)                                                   \
    M(SA, TA, SB, TB, f32, float) M(SA, TA, SB, TB, f16, mw_f16) M(SA, TA, SB, TB, bf16, mw_bf16)
#define MW_FLOAT_TRIPLES_1(M, SA, TA)                                                           \
    MW_FLOAT_TRIPLES_2(M, SA, TA, f32, float)                                                   \
    MW_FLOAT_TRIPLES_2(M, SA, TA, f16, mw_f16) MW_FLOAT_TRIPLES_2(M, SA, TA, bf16, mw_bf16)
#define MW_FLOAT_TRIPLES(M)                                                                     \
    MW_FLOAT_TRIPLES_1(M, f32, float)                                                           \
    MW_FLOAT_TRIPLES_1(M, f16, mw_f16) MW_FLOAT_TRIPLES_1(M, bf16, mw_bf16)

// ---- per-step values on the device ---------------------------------------------------------

// Values that change from one training step to the next live in device memory, so a captured
// CUDA graph replays every step unchanged. The host writes them before each step and reads
// the flags and counters after it. Mirrored by `MwScalars` in kernels/src/cuda/launch.rs.
struct MwScalars {
    u64 step;           // training steps run so far: keys dropout and sampling
    float loss_scale;   // dynamic loss scale: the loss kernels multiply their gradients by it
    float grad_unscale; // 1 / loss_scale: the optimizer kernels multiply gradients by it
    float adam_alpha;   // lr · sqrt(1 − β₂ᵗ) / (1 − β₁ᵗ) for this update
    int nonfinite;      // set to 1 by mw_all_finite_f32: the optimizers then skip the update
    int correct;        // correct predictions of the classification losses, summed
    int bad_index;      // 1 + position of an out-of-range label or id (0: none)
};

// ---- counter-based random numbers (kernels/src/random.rs) -----------------------------------

// Philox4x32-10 with the CPU's counter layout (random.cu says more): element e of stream
// (seed, layer, step) is word e % 4 of block e / 4, block b's counter [b, step lo, step hi,
// layer], key [seed lo, seed hi]. Shared by random.cu (dropout, sampling) and attention.cu
// (attention dropout), so both draw exactly `RngKey::uniform_at`.
#define MW_PHILOX_M0 0xD2511F53u
#define MW_PHILOX_M1 0xCD9E8D57u
#define MW_PHILOX_W0 0x9E3779B9u
#define MW_PHILOX_W1 0xBB67AE85u

struct MwWords {
    u32 w[4];
};

MW_DEV MwWords mw_philox(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += MW_PHILOX_W0;
            k1 += MW_PHILOX_W1;
        }
        u32 hi0 = __umulhi(MW_PHILOX_M0, c0), lo0 = MW_PHILOX_M0 * c0;
        u32 hi1 = __umulhi(MW_PHILOX_M1, c2), lo1 = MW_PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    MwWords r;
    r.w[0] = c0;
    r.w[1] = c1;
    r.w[2] = c2;
    r.w[3] = c3;
    return r;
}

// The 4 words of block `b` of stream (seed, layer, step).
MW_DEV MwWords mw_rng_block(u64 b, u64 seed, u32 layer, u64 step) {
    return mw_philox((u32)b, (u32)step, (u32)(step >> 32), layer, (u32)seed, (u32)(seed >> 32));
}

MW_DEV float mw_unit(u32 w) { return (float)(w >> 8) * (1.0f / 16777216.0f); }
// ---- indexing ------------------------------------------------------------------------------

MW_DEV u64 mw_tid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
MW_DEV u64 mw_nthreads() { return (u64)gridDim.x * blockDim.x; }

// Grid-stride loop over [0, n).
#define MW_FOR(i, n) for (u64 i = mw_tid(); i < (n); i += mw_nthreads())

// 32-bit index fast paths. A GPU divides 64-bit integers in software (dozens of
// instructions) and 32-bit ones in a few, so the kernels whose per-element index arithmetic
// divides (NHWC coordinates, im2col/col2im, pooling windows, a bias's or a table's column)
// take their index type as a template parameter `I`, and their entry points run them with u32
// when every index the launch computes stays below MW_U32_INDICES, with u64 otherwise (an
// H200 holds tensors of more than 2^31 elements). The limit is 2^31, not 2^32, so that a
// grid-stride step (i + threads, with fewer than 2^31 threads) cannot wrap.
#define MW_U32_INDICES 0x80000000ull
MW_DEV bool mw_u32_fits(u64 largest) { return largest < MW_U32_INDICES; }
MW_DEV u64 mw_max(u64 a, u64 b) { return a > b ? a : b; }
// Grid-stride loop over [0, n) with an index of type I (n must fit I: see MW_BY_INDEX).
#define MW_FOR_I(I, i, n) for (I i = (I)mw_tid(); i < (I)(n); i += (I)mw_nthreads())
// Runs F<T, u32>(args…) when `largest` (one past the largest index the launch computes) fits
// 32 bits, else F<T, u64>(args…).
#define MW_BY_INDEX(largest, F, T, ...)                                                         \
    do {                                                                                        \
        if (mw_u32_fits(largest))                                                               \
            F<T, u32>(__VA_ARGS__);                                                             \
        else                                                                                    \
            F<T, u64>(__VA_ARGS__);                                                             \
    } while (0)

// ---- warp and block reductions ---------------------------------------------------------------

MW_DEV float mw_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
MW_DEV double mw_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
MW_DEV int mw_warp_sum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
MW_DEV float mw_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
MW_DEV int mw_warp_min(int v) {
    for (int o = 16; o > 0; o >>= 1) {
        int w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// A reduction over a 1-D block of MW_REDUCE_THREADS threads, every thread getting the result:
// `warp` reduces within each warp, then across the warps' results (`identity` for the lanes
// past the last warp).
template <typename T, typename W>
MW_DEV T mw_block_reduce(T v, T* sh /* [32] shared */, T identity, W warp) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    T t = lane < nw ? sh[lane] : identity;
    t = warp(t);
    __syncthreads();
    return t;
}

// Sum over a 1-D block of MW_REDUCE_THREADS threads (every thread gets the total).
MW_DEV double mw_block_sum(double v, double* sh /* [32] shared */) {
    return mw_block_reduce(v, sh, 0.0, [](double x) { return mw_warp_sum(x); });
}
MW_DEV int mw_block_sum_int(int v, int* sh /* [32] shared */) {
    return mw_block_reduce(v, sh, 0, [](int x) { return mw_warp_sum(x); });
}
MW_DEV int mw_block_min_int(int v, int* sh /* [32] shared */) {
    return mw_block_reduce(v, sh, 0x7fffffff, [](int x) { return mw_warp_min(x); });
}

// Channel strip: a block of (32, MW_STRIP_Y) threads, x = channel in the strip, y = row lane.
// Sums `v` over the y lanes of each channel; row 0 of the strip gets the totals.
MW_DEV double mw_strip_sum(double v, double (*sh)[33]) {
    sh[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    for (int s = MW_STRIP_Y / 2; s > 0; s >>= 1) {
        if (threadIdx.y < (u32)s) sh[threadIdx.y][threadIdx.x] += sh[threadIdx.y + s][threadIdx.x];
        __syncthreads();
    }
    double t = sh[0][threadIdx.x];
    __syncthreads();
    return t;
}

// A split column reduction (planner: `column_parts`) runs gridDim.z parts of a strip's rows:
// rows [r0, r1) are part blockIdx.z's; all of them when the reduction is not split.
MW_DEV void mw_part_rows(u64 rows, u64& r0, u64& r1) {
    r0 = rows * blockIdx.z / gridDim.z;
    r1 = rows * (blockIdx.z + 1) / gridDim.z;
}

// A strip's total for output i: added to out[i] when the reduction is not split (partials
// null), else kept as this part's f64 partial sum, partials[part·stride + i], for the pass that
// adds the parts (mw_add_parts or the op's own).
MW_DEV void mw_strip_out(double total, float* out, double* partials, u64 stride, u64 i) {
    if (partials)
        partials[(u64)blockIdx.z * stride + i] = total;
    else
        out[i] += (float)total;
}

// Σ_p partials[p·stride + i] over the parts, in part order (deterministic).
MW_DEV double mw_parts_total(const double* partials, u64 parts, u64 stride, u64 i) {
    double t = 0.0;
    for (u64 p = 0; p < parts; p++) t += partials[p * stride + i];
    return t;
}

// The coordinates of flat element e of an NHWC tensor [.., h, w, c]: sample, row, column,
// channel.
// `I` is the index type (MW_BY_INDEX): the divisions are I's.
template <typename I> struct MwNhwc {
    I s;
    int y, x, c;
};

template <typename I> MW_DEV MwNhwc<I> mw_nhwc(I e, int h, int w, int c) {
    MwNhwc<I> p;
    p.c = (int)(e % (I)c);
    I q = e / (I)c;
    p.x = (int)(q % (I)w);
    q /= (I)w;
    p.y = (int)(q % (I)h);
    p.s = q / (I)h;
    return p;
}

#endif // MW_COMMON_CUH
