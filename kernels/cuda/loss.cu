// Losses fused with their gradients (kernels/src/loss.rs): sparse categorical cross-entropy
// on softmax probabilities, binary cross-entropy (fused with the sigmoid, on logits, or on
// probabilities), mean squared error, and the VAE's KL divergence to N(0, 1).
//
// Each loss is two kernels: the gradient (grid-wide; overwritten, multiplied by the dynamic
// loss scale read from MwScalars) and the value (blocks of MW_REDUCE_THREADS threads: sums in
// f64 in a fixed order, so the value is deterministic; it writes `w · loss` to the loss
// tensor). A large loss's value is split over several blocks (planner: loss_value_parts), each
// leaving its sums in the step's scratch, and mw_loss_value_parts adds them in block order. Labels out of range cannot raise an error on the device: the value kernel records
// 1 + the first offending sample in sc->bad_index (the runtime turns it into an Err) and the
// gradient kernel treats such a row as having no true class.
#include "common.cuh"

#define MW_EPSILON 1e-7f

// Items [a, b) of n that block blockIdx.x of a split loss value takes (all of them unsplit).
MW_DEV void mw_block_part(u64 n, u64& a, u64& b) {
    a = n * blockIdx.x / gridDim.x;
    b = n * (blockIdx.x + 1) / gridDim.x;
}

// A split loss value's block result: its sum, correct predictions and first out-of-range row
// (+1; 0 for none), as f64 at partials[3·block].
MW_DEV void mw_loss_part_out(double* partials, double sum, int correct, int bad) {
    double* out = partials + 3 * (u64)blockIdx.x;
    out[0] = sum;
    out[1] = (double)correct;
    out[2] = bad == 0x7fffffff ? 0.0 : (double)bad + 1.0;
}

// The second pass of a split loss value (one thread): the blocks' sums added in block order,
// then as the unsplit kernels finish: *loss = weight · sum / denom and sc->correct += correct,
// or, with an out-of-range label, sc->bad_index = the first one + 1 and a NaN loss.
MW_KERNEL_1D mw_loss_value_parts(const double* partials, u64 parts, double denom,
                                               float weight, float* loss, MwScalars* sc) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double sum = 0.0, correct = 0.0, bad = 0.0;
    for (u64 p = 0; p < parts; p++) {
        sum += partials[3 * p];
        correct += partials[3 * p + 1];
        double b = partials[3 * p + 2];
        if (b > 0.0 && (bad == 0.0 || b < bad)) bad = b;
    }
    if (bad > 0.0) {
        sc->bad_index = (int)bad;
        *loss = __uint_as_float(0x7fc00000u);
    } else {
        *loss = weight * (float)(sum / denom);
        sc->correct += (int)correct;
    }
}

MW_DEV float mw_clip_prob(float p) {
    // Written with comparisons so a NaN stays NaN (like f32::clamp).
    return p < MW_EPSILON ? MW_EPSILON : (p > 1.0f - MW_EPSILON ? 1.0f - MW_EPSILON : p);
}

// ---- sparse categorical cross-entropy ----------------------------------------------------------

// dlogits = (weight · loss_scale / rows) · (p − onehot(label)), one warp per row.
template <typename P, typename G>
MW_DEV void scce(const P* probs, const int* labels, G* dlogits, u64 rows, u64 classes,
                 float weight, const MwScalars* sc) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    float coef = (weight * sc->loss_scale) / (float)rows;
    long long label = labels[r];
    for (u64 j = lane; j < classes; j += 32) {
        float t = (long long)j == label ? 1.0f : 0.0f;
        dlogits[r * classes + j] = st<G>((ld(probs[r * classes + j]) - t) * coef);
    }
}
#define MW_SCCE(SA, TA, SB, TB)                                                                 \
    MW_KERNEL_ROWS mw_scce_##SA##_##SB(const TA* probs, const int* labels,                      \
                                                   TB* dlogits, u64 rows, u64 classes,          \
                                                   float weight, const MwScalars* sc) {         \
        scce<TA, TB>(probs, labels, dlogits, rows, classes, weight, sc);                        \
    }
MW_FLOAT_PAIRS(MW_SCCE)

// *loss = weight · mean_r −ln clip(p[r, label_r]); sc->correct += rows whose arg-max (first
// on ties) is the label. Each warp of a block takes its rows r ≡ warp (mod warps); split
// (partials non-null), each block its part of the rows, its sums to partials.
template <typename P>
MW_DEV void scce_value(const P* probs, const int* labels, u64 rows, u64 classes, float weight,
                       float* loss, MwScalars* sc, double* partials) {
    __shared__ double sh_d[32];
    __shared__ int sh_i[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double sum = 0.0;
    int correct = 0;
    int bad = 0x7fffffff;
    u64 r0, r1;
    mw_block_part(rows, r0, r1);
    for (u64 r = r0 + warp; r < r1; r += nw) {
        const P* pr = probs + r * classes;
        // Arg-max: the smallest index among the largest values (NaN never wins, as `v > best`).
        float best = MW_NEG_INF;
        long long arg = 0x7fffffffffffffffLL;
        for (u64 j = lane; j < classes; j += 32) {
            float v = ld(pr[j]);
            if (v > best) {
                best = v;
                arg = (long long)j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            long long oa = __shfl_xor_sync(0xffffffffu, arg, o);
            if (ob > best || (ob == best && oa < arg)) {
                best = ob;
                arg = oa;
            }
        }
        if (arg == 0x7fffffffffffffffLL) arg = 0;
        long long label = labels[r];
        if (label < 0 || label >= (long long)classes) {
            if (lane == 0 && (int)r < bad) bad = (int)r;
            continue;
        }
        if (lane == 0) {
            float pl = mw_clip_prob(ld(pr[label]));
            sum += -(double)logf(pl);
            correct += arg == label ? 1 : 0;
        }
    }
    sum = mw_block_sum(sum, sh_d);
    correct = mw_block_sum_int(correct, sh_i);
    bad = mw_block_min_int(bad, sh_i);
    if (threadIdx.x == 0 && partials) {
        mw_loss_part_out(partials, sum, correct, bad);
    } else if (threadIdx.x == 0) {
        if (bad != 0x7fffffff) {
            sc->bad_index = bad + 1;
            *loss = __uint_as_float(0x7fc00000u);
        } else {
            *loss = weight * (float)(sum / (double)rows);
            sc->correct += correct;
        }
    }
}
#define MW_SCCE_VALUE(S, T)                                                                     \
    MW_KERNEL_BLOCK mw_scce_value_##S(const T* probs, const int* labels, u64 rows,              \
                                                 u64 classes, float weight, float* loss,        \
                                                 MwScalars* sc, double* partials) {             \
        scce_value<T>(probs, labels, rows, classes, weight, loss, sc, partials);                \
    }
MW_FLOATS(MW_SCCE_VALUE)

// ---- elementwise losses ----------------------------------------------------------------------

#define MW_LOSS_BCE_SIGMOID 0
#define MW_LOSS_BCE 1
#define MW_LOSS_MSE 2
#define MW_LOSS_BCE_LOGITS 3

// Keras's BCE on a probability (TF backend): clip, then −(t·ln(p + ε) + (1 − t)·ln(1 − p + ε)).
MW_DEV float mw_bce_value(float p, float t) {
    float pc = mw_clip_prob(p);
    return -(t * logf(pc + MW_EPSILON) + (1.0f - t) * logf(1.0f - pc + MW_EPSILON));
}
// BCE of a logit x, without forming σ(x): max(x, 0) − x·t + ln(1 + e^(−|x|)).
MW_DEV float mw_bce_logits_value(float x, float t) {
    return fmaxf(x, 0.0f) - x * t + log1pf(expf(-fabsf(x)));
}
// σ(x) with neither branch overflowing.
MW_DEV float mw_sigmoid_stable(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}
MW_DEV float mw_elem_loss(int kind, float p, float t) {
    if (kind == MW_LOSS_MSE) {
        float e = p - t;
        return e * e;
    }
    if (kind == MW_LOSS_BCE_LOGITS) return mw_bce_logits_value(p, t);
    return mw_bce_value(p, t);
}
MW_DEV float mw_elem_loss_grad(int kind, float p, float t) {
    switch (kind) {
    case MW_LOSS_BCE_SIGMOID: return p - t;
    case MW_LOSS_BCE_LOGITS: return mw_sigmoid_stable(p) - t;
    case MW_LOSS_BCE:
        return (p >= MW_EPSILON && p <= 1.0f - MW_EPSILON)
                   ? -t / (p + MW_EPSILON) + (1.0f - t) / (1.0f - p + MW_EPSILON)
                   : 0.0f;
    default: return 2.0f * (p - t);
    }
}

// grad = (weight · loss_scale / denom) · dℓ/dinput, denom = elements (mean) or rows (sum
// over features, mean over the batch).
template <typename P, typename Y>
MW_DEV void elem_loss(int kind, const P* p, const Y* t, P* grad, u64 n, double denom,
                      float weight, const MwScalars* sc) {
    float coef = (float)((double)(weight * sc->loss_scale) / denom);
    MW_FOR(i, n) grad[i] = st<P>(mw_elem_loss_grad(kind, ld(p[i]), ld(t[i])) * coef);
}
// *loss = weight · Σ ℓ / denom; split, each block's part of the sum to partials.
template <typename P, typename Y>
MW_DEV void elem_loss_value(int kind, const P* p, const Y* t, u64 n, double denom, float weight,
                            float* loss, double* partials) {
    __shared__ double sh[32];
    double sum = 0.0;
    u64 a, b;
    mw_block_part(n, a, b);
    for (u64 i = a + threadIdx.x; i < b; i += blockDim.x)
        sum += (double)mw_elem_loss(kind, ld(p[i]), ld(t[i]));
    sum = mw_block_sum(sum, sh);
    if (threadIdx.x != 0) return;
    if (partials)
        mw_loss_part_out(partials, sum, 0, 0x7fffffff);
    else
        *loss = weight * (float)(sum / denom);
}
#define MW_ELEM_LOSS(SA, TA, SB, TB)                                                            \
    MW_KERNEL_1D mw_elem_loss_##SA##_##SB(int kind, const TA* p, const TB* t,                   \
                                                        TA* grad, u64 n, double denom,          \
                                                        float weight, const MwScalars* sc) {    \
        elem_loss<TA, TB>(kind, p, t, grad, n, denom, weight, sc);                              \
    }                                                                                           \
    MW_KERNEL_BLOCK mw_elem_loss_value_##SA##_##SB(                                             \
        int kind, const TA* p, const TB* t, u64 n, double denom, float weight, float* loss,     \
        double* partials) {                                                                     \
        elem_loss_value<TA, TB>(kind, p, t, n, denom, weight, loss, partials);                  \
    }
MW_FLOAT_PAIRS(MW_ELEM_LOSS)

// ---- KL divergence of N(mean, exp(logvar)) from N(0, 1) ----------------------------------------

// dmean = c·mean, dlogvar = c·0.5·(exp(logvar) − 1), c = weight · loss_scale / rows.
template <typename T>
MW_DEV void kl(const T* mean, const T* logvar, T* dmean, T* dlogvar, u64 n, u64 rows,
               float weight, const MwScalars* sc) {
    float coef = (weight * sc->loss_scale) / (float)rows;
    MW_FOR(i, n) {
        dmean[i] = st<T>(ld(mean[i]) * coef);
        dlogvar[i] = st<T>(0.5f * (expf(ld(logvar[i])) - 1.0f) * coef);
    }
}
// *loss = weight · Σ −0.5·(1 + logvar − mean² − exp(logvar)) / rows; split, each block's part
// of the sum to partials.
template <typename T>
MW_DEV void kl_value(const T* mean, const T* logvar, u64 n, u64 rows, float weight, float* loss,
                     double* partials) {
    __shared__ double sh[32];
    double sum = 0.0;
    u64 a, b;
    mw_block_part(n, a, b);
    for (u64 i = a + threadIdx.x; i < b; i += blockDim.x) {
        float m = ld(mean[i]), lv = ld(logvar[i]);
        sum += (double)(-0.5f * (1.0f + lv - m * m - expf(lv)));
    }
    sum = mw_block_sum(sum, sh);
    if (threadIdx.x != 0) return;
    if (partials)
        mw_loss_part_out(partials, sum, 0, 0x7fffffff);
    else
        *loss = weight * (float)(sum / (double)rows);
}
#define MW_KL(S, T)                                                                             \
    MW_KERNEL_1D mw_kl_##S(const T* mean, const T* logvar, T* dmean, T* dlogvar,                \
                                         u64 n, u64 rows, float weight, const MwScalars* sc) {  \
        kl<T>(mean, logvar, dmean, dlogvar, n, rows, weight, sc);                               \
    }                                                                                           \
    MW_KERNEL_BLOCK mw_kl_value_##S(const T* mean, const T* logvar, u64 n, u64 rows,            \
                                               float weight, float* loss, double* partials) {   \
        kl_value<T>(mean, logvar, n, rows, weight, loss, partials);                             \
    }
MW_FLOATS(MW_KL)
