// Activations and their gradients (kernels/src/activation.rs): relu, sigmoid, tanh, gelu
// (exact erf form), silu, leaky relu and elu (their parameter `p` is alpha), linear, and
// softmax over the last axis.
//
// Pointwise kernels take the activation as a code (MW_ACT_*: its position in the list of
// `kernels/src/activation.rs`) and its parameter `p` (0 for those without), a uniform
// branch. In place:
// the forward may write y over x, the backward dx over dy (each element is read and written
// by one thread). Softmax runs one warp per row (MW_ROW_WARPS rows per block); its in-place
// forms are safe too: a lane writes only the elements it read, after the row's reductions.
#include "common.cuh"

#define MW_ACT_LINEAR 0
#define MW_ACT_RELU 1
#define MW_ACT_SIGMOID 2
#define MW_ACT_TANH 3
#define MW_ACT_GELU 4
#define MW_ACT_SILU 5
#define MW_ACT_LEAKY_RELU 6
#define MW_ACT_ELU 7

// Stable logistic: never evaluates exp of a positive number.
MW_DEV float mw_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

MW_DEV float mw_act(int act, float p, float x) {
    switch (act) {
    case MW_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case MW_ACT_SIGMOID: return mw_sigmoid(x);
    case MW_ACT_TANH: return tanhf(x);
    case MW_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case MW_ACT_SILU: return x * mw_sigmoid(x);
    case MW_ACT_LEAKY_RELU: return x > 0.0f ? x : p * x;
    case MW_ACT_ELU: return x > 0.0f ? x : p * expm1f(x);
    default: return x;
    }
}

// dx from what the backward reads (y for relu/sigmoid/tanh, x for gelu/silu) and dy.
MW_DEV float mw_act_grad(int act, float p, float s, float dy) {
    switch (act) {
    case MW_ACT_RELU: return s > 0.0f ? dy : 0.0f;
    case MW_ACT_SIGMOID: return dy * s * (1.0f - s);
    case MW_ACT_TANH: return dy * (1.0f - s * s);
    case MW_ACT_GELU: {
        float cdf = 0.5f * (1.0f + erff(s * 0.70710678118654752f));
        float pdf = 0.3989423f * expf(-0.5f * s * s);
        return dy * (cdf + s * pdf);
    }
    case MW_ACT_SILU: {
        float g = mw_sigmoid(s);
        return dy * (g * (1.0f + s * (1.0f - g)));
    }
    // Both read y: with p ≥ 0, y > 0 exactly where x > 0; below, elu's slope p·eˣ is y + p.
    case MW_ACT_LEAKY_RELU: return s > 0.0f ? dy : p * dy;
    case MW_ACT_ELU: return s > 0.0f ? dy : dy * (s + p);
    default: return dy;
    }
}

template <typename T> MW_DEV void act_fwd(int act, float p, const T* x, T* y, u64 n) {
    MW_FOR(i, n) y[i] = st<T>(mw_act(act, p, ld(x[i])));
}
template <typename T>
MW_DEV void act_bwd(int act, float p, const T* saved, const T* dy, T* dx, u64 n) {
    MW_FOR(i, n) dx[i] = st<T>(mw_act_grad(act, p, ld(saved[i]), ld(dy[i])));
}
#define MW_ACT_KERNELS(S, T)                                                                    \
    MW_KERNEL_1D mw_act_fwd_##S(int act, float p, const T* x, T* y, u64 n) {                    \
        act_fwd<T>(act, p, x, y, n);                                                            \
    }                                                                                           \
    MW_KERNEL_1D mw_act_bwd_##S(int act, float p, const T* saved, const T* dy,                  \
                                              T* dx, u64 n) {                                   \
        act_bwd<T>(act, p, saved, dy, dx, n);                                                   \
    }
MW_FLOATS(MW_ACT_KERNELS)

// ---- softmax over the last axis --------------------------------------------------------------

// y = exp(x − shift) / Σ exp(x − shift); shift = the row max, or 0 when the max is not finite
// (an all −inf row gives zeros, NaN / +inf give NaN); an all-zero sum gives zeros.
template <typename I, typename O> MW_DEV void softmax_row(const I* x, O* y, u64 cols) {
    int lane = threadIdx.x & 31;
    float m = MW_NEG_INF;
    for (u64 j = lane; j < cols; j += 32) m = fmaxf(m, ld(x[j]));
    m = mw_warp_max(m);
    // fmaxf ignores NaN; the CPU's fold with f32::max does too.
    float shift = mw_isfinite(m) ? m : 0.0f;
    float s = 0.0f;
    for (u64 j = lane; j < cols; j += 32) s += expf(ld(x[j]) - shift);
    s = mw_warp_sum(s);
    float inv = s == 0.0f ? 0.0f : 1.0f / s;
    for (u64 j = lane; j < cols; j += 32) y[j] = st<O>(expf(ld(x[j]) - shift) * inv);
}
template <typename I, typename O> MW_DEV void softmax(const I* x, O* y, u64 rows, u64 cols) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r < rows) softmax_row<I, O>(x + r * cols, y + r * cols, cols);
}
#define MW_SOFTMAX(SA, TA, SB, TB)                                                              \
    MW_KERNEL_ROWS mw_softmax_##SA##_##SB(const TA* x, TB* y, u64 rows, u64 cols) {             \
        softmax<TA, TB>(x, y, rows, cols);                                                      \
    }
MW_FLOAT_PAIRS(MW_SOFTMAX)

// dx = y ⊙ (dy − Σ dy·y) per row; dx may be dy (in place, same type). y, dy and dx may each
// have their own storage type (`mw_softmax_bwd_Y_G_D`).
template <typename Y, typename G, typename D>
MW_DEV void softmax_bwd(const Y* y, const G* dy, D* dx, u64 rows, u64 cols) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    const Y* yr = y + r * cols;
    const G* gr = dy + r * cols;
    D* dr = dx + r * cols;
    float dot = 0.0f;
    for (u64 j = lane; j < cols; j += 32) dot += ld(yr[j]) * ld(gr[j]);
    dot = mw_warp_sum(dot);
    for (u64 j = lane; j < cols; j += 32) dr[j] = st<D>(ld(yr[j]) * (ld(gr[j]) - dot));
}
#define MW_SOFTMAX_BWD(SA, TA, SB, TB, SC, TC)                                                  \
    MW_KERNEL_ROWS mw_softmax_bwd_##SA##_##SB##_##SC(const TA* y, const TB* dy,                 \
                                                                 TC* dx, u64 rows, u64 cols) {  \
        softmax_bwd<TA, TB, TC>(y, dy, dx, rows, cols);                                         \
    }
MW_FLOAT_TRIPLES(MW_SOFTMAX_BWD)

// Attention's causal mask: scores[p, i, j] = -1e30 (−inf in f16) for keys after the query.
// `I` is the index type (MW_BY_INDEX).
template <typename T, typename I> MW_DEV void causal_mask(T* scores, u64 pairs, u64 s) {
    MW_FOR_I(I, k, pairs * s * s) {
        I j = k % (I)s, i = (k / (I)s) % (I)s;
        if (j > i) scores[k] = st<T>(-1.0e30f);
    }
}
#define MW_CAUSAL(S, T)                                                                         \
    MW_KERNEL_1D mw_causal_mask_##S(T* scores, u64 pairs, u64 s) {                              \
        MW_BY_INDEX(pairs * s * s, causal_mask, T, scores, pairs, s);                           \
    }
MW_FLOATS(MW_CAUSAL)
