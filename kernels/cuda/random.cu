// Counter-based random numbers (kernels/src/random.rs): Philox4x32-10 with the same counter
// layout as the CPU, so a dropout mask drawn here is bit-identical to the CPU's, and a
// recomputed (checkpointed) forward or a backward regenerates exactly the same numbers.
//
//   key     = [seed lo, seed hi]
//   counter = [first + element / 4, step lo, step hi, layer]
//   word    = philox4x32_10(counter, key)[element % 4]
//
// `first` is the stream's first block (RngKey::first_block): 0 on one device; a data-parallel
// replica r draws from r·⌈n/4⌉ on, so the replicas together draw one device's whole batch.
//
// Uniforms are (word >> 8)·2⁻²⁴ (exact in f32). Normals use Box–Muller on the word pairs
// (0, 1) and (2, 3); logf/sqrtf/sincos here match the CPU's libm to a few ulp (a tensor's
// forward and backward always run on the same device). One thread per block of 4 elements.
// The step comes from MwScalars (device memory), so a captured graph draws fresh masks on
// every replay.
#include "common.cuh"

// Philox4x32-10 (`mw_philox`, `mw_rng_block`) and `mw_unit` are in common.cuh, shared with
// the attention dropout (attention.cu).

MW_DEV float mw_unit_open0(u32 w) { return (float)((w >> 8) + 1) * (1.0f / 16777216.0f); }

MW_DEV void mw_box_muller(u32 w1, u32 w2, float* a, float* b) {
    float r = sqrtf(-2.0f * logf(mw_unit_open0(w1)));
    float theta = (2.0f * 3.14159265358979323846f) * mw_unit(w2);
    *a = r * cosf(theta);
    *b = r * sinf(theta);
}

// Raw words, for the bit-exactness test against the CPU: out[4b + j] = word j of block b.
MW_KERNEL_1D mw_philox_words(u32* out, u64 nblocks, u64 seed, u32 layer, u64 step) {
    MW_FOR(b, nblocks) {
        MwWords w = mw_rng_block(b, seed, layer, step);
        #pragma unroll
        for (int j = 0; j < 4; j++) out[4 * b + j] = w.w[j];
    }
}

// mask[i] = uniform(i) >= rate; y = mask ? x / (1 − rate) : 0 (y may be x).
template <typename T>
MW_DEV void dropout_fwd(const T* x, T* y, unsigned char* mask, u64 n, float rate, u64 seed,
                        u32 layer, u32 first, const MwScalars* sc) {
    u64 step = sc->step;
    float scale = 1.0f / (1.0f - rate);
    MW_FOR(b, (n + 3) / 4) {
        MwWords w = mw_rng_block((u32)b + first, seed, layer, step);
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            u64 i = 4 * b + j;
            if (i >= n) break;
            bool kept = mw_unit(w.w[j]) >= rate;
            mask[i] = kept ? 1 : 0;
            y[i] = st<T>(kept ? ld(x[i]) * scale : 0.0f);
        }
    }
}

// dx = mask ? dy / (1 − rate) : 0 (dx may be dy).
template <typename T>
MW_DEV void dropout_bwd(const unsigned char* mask, const T* dy, T* dx, u64 n, float rate) {
    float scale = 1.0f / (1.0f - rate);
    MW_FOR(i, n) dx[i] = st<T>(mask[i] != 0 ? ld(dy[i]) * scale : 0.0f);
}

// The 4 standard normals of block b.
MW_DEV void mw_normals(u64 b, u64 seed, u32 layer, u64 step, float e[4]) {
    MwWords w = mw_rng_block(b, seed, layer, step);
    mw_box_muller(w.w[0], w.w[1], &e[0], &e[1]);
    mw_box_muller(w.w[2], w.w[3], &e[2], &e[3]);
}

// Runs `f(i, ε)` for every i < n, ε the i-th standard normal of stream (seed, layer, step)
// from block `first` on: grid-stride over the RNG blocks, 4 normals each.
template <typename F>
MW_DEV void mw_for_normals(u64 n, u64 seed, u32 layer, u32 first, const MwScalars* sc, F f) {
    u64 step = sc->step;
    MW_FOR(b, (n + 3) / 4) {
        float e[4];
        mw_normals((u32)b + first, seed, layer, step, e);
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            u64 i = 4 * b + j;
            if (i >= n) break;
            f(i, e[j]);
        }
    }
}

// z = mean + exp(0.5·logvar)·ε, ε ~ N(0, 1) from stream (seed, layer, step).
template <typename T>
MW_DEV void sample_normal_fwd(const T* mean, const T* logvar, T* z, u64 n, u64 seed, u32 layer,
                              u32 first, const MwScalars* sc) {
    mw_for_normals(n, seed, layer, first, sc, [=](u64 i, float e) {
        z[i] = st<T>(ld(mean[i]) + expf(0.5f * ld(logvar[i])) * e);
    });
}

// dmean = dz, dlogvar = dz·0.5·exp(0.5·logvar)·ε (ε regenerated); overwritten, or added to
// what is there when `accumulate` (the KL loss wrote its share first).
template <typename T>
MW_DEV void sample_normal_bwd(const T* logvar, const T* dz, T* dmean, T* dlogvar, u64 n,
                              u64 seed, u32 layer, u32 first, const MwScalars* sc,
                              int accumulate) {
    mw_for_normals(n, seed, layer, first, sc, [=](u64 i, float e) {
        float g = ld(dz[i]);
        float dl = g * 0.5f * expf(0.5f * ld(logvar[i])) * e;
        if (accumulate) {
            dlogvar[i] = st<T>(ld(dlogvar[i]) + dl);
            dmean[i] = st<T>(ld(dmean[i]) + g);
        } else {
            dlogvar[i] = st<T>(dl);
            dmean[i] = st<T>(g);
        }
    });
}

#define MW_RANDOM(S, T)                                                                         \
    MW_KERNEL_1D mw_dropout_fwd_##S(const T* x, T* y, unsigned char* mask, u64 n,               \
                                                  float rate, u64 seed, u32 layer, u32 first,   \
                                                  const MwScalars* sc) {                        \
        dropout_fwd<T>(x, y, mask, n, rate, seed, layer, first, sc);                            \
    }                                                                                           \
    MW_KERNEL_1D mw_dropout_bwd_##S(const unsigned char* mask, const T* dy, T* dx,              \
                                                  u64 n, float rate) {                          \
        dropout_bwd<T>(mask, dy, dx, n, rate);                                                  \
    }                                                                                           \
    MW_KERNEL_1D mw_sample_normal_fwd_##S(const T* mean, const T* logvar, T* z,                 \
                                                        u64 n, u64 seed, u32 layer, u32 first,  \
                                                        const MwScalars* sc) {                  \
        sample_normal_fwd<T>(mean, logvar, z, n, seed, layer, first, sc);                       \
    }                                                                                           \
    MW_KERNEL_1D mw_sample_normal_bwd_##S(                                                      \
        const T* logvar, const T* dz, T* dmean, T* dlogvar, u64 n, u64 seed, u32 layer,         \
        u32 first, const MwScalars* sc, int accumulate) {                                       \
        sample_normal_bwd<T>(logvar, dz, dmean, dlogvar, n, seed, layer, first, sc, accumulate); \
    }
MW_FLOATS(MW_RANDOM)
