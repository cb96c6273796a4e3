// Optimizer updates on f32 master parameters (kernels/src/optimizer.rs): SGD (plain, momentum,
// Nesterov), RMSprop (plain, momentum, centered), Adam and AdamW, with Keras 3's formulas
// operation for operation. One launch per update step over a table of chunks, MW_BLOCK
// threads per chunk.
//
// Everything that changes between steps comes from MwScalars in device memory: the gradient
// unscale factor (1 / loss scale), Adam's bias-corrected step size, and the non-finite flag
// set by mw_all_finite_f32 (or an out-of-range label or id, sc->bad_index) — when it is set
// the update is skipped and params and state stay bit-identical, as on the CPU. So the whole step, update included, replays as one graph.
#include "common.cuh"

// One block's share of a multi-tensor update: elements [begin, end) of one parameter — its
// f32 values p, its gradient g, its optimizer state slots s (null where unused) and its 16-bit
// copy `half` (null when it has none; half_kind 1 float16, 2 bfloat16), rewritten from the
// updated values. A whole update step is one launch, one block per chunk (grid = the chunk
// count), instead of an optimizer kernel and a cast per parameter. Mirrored by
// `MwUpdateChunk` in kernels/src/cuda/launch.rs.
struct MwUpdateChunk {
    float* p;
    const float* g;
    float* s[3];
    void* half;
    u64 begin, end;
    int half_kind;
    int pad;
};

// The 16-bit copy of element i, from its updated f32 value (mw_cast_f32_* rounds the same).
MW_DEV void mw_store_half(const MwUpdateChunk& c, u64 i, float v) {
    if (c.half_kind == 1)
        static_cast<mw_f16*>(c.half)[i] = st<mw_f16>(v);
    else if (c.half_kind == 2)
        static_cast<mw_bf16*>(c.half)[i] = st<mw_bf16>(v);
}

// Block blockIdx.x's chunk; the loop over its elements.
#define MW_CHUNK_FOR(c, i)                                                                      \
    const MwUpdateChunk c = chunks[blockIdx.x];                                                 \
    for (u64 i = c.begin + threadIdx.x; i < c.end; i += blockDim.x)

// Without momentum p −= g·lr; with it m = momentum·m − g·lr, then p += m, or with Nesterov
// p += momentum·m − g·lr. m (s[0]) is null without momentum.
MW_KERNEL_1D mw_sgd(const MwUpdateChunk* chunks, float lr, float momentum, int nesterov,
                    const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    MW_CHUNK_FOR(c, i) {
        float* p = c.p;
        float* m = c.s[0];
        float gi = c.g[i] * unscale;
        if (m == 0) {
            p[i] -= gi * lr;
        } else {
            float mi = m[i] * momentum - gi * lr;
            m[i] = mi;
            p[i] += nesterov ? mi * momentum - gi * lr : mi;
        }
        mw_store_half(c, i, p[i]);
    }
}

// v = rho·v + (1 − rho)·g²; centered: a = rho·a + (1 − rho)·g, den = v − a² + ε, else
// den = v + ε; inc = lr·g / sqrt(den); with momentum mom = momentum·mom + inc, p −= mom,
// else p −= inc. v is s[0]; mom (s[1]) and avg (s[2]) are null when unused.
MW_KERNEL_1D mw_rmsprop(const MwUpdateChunk* chunks, float lr, float rho, float momentum,
                        float eps, const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    MW_CHUNK_FOR(c, i) {
        float *p = c.p, *v = c.s[0], *mom = c.s[1], *avg = c.s[2];
        float gi = c.g[i] * unscale;
        float vi = rho * v[i] + (1.0f - rho) * (gi * gi);
        v[i] = vi;
        float den;
        if (avg != 0) {
            float a = rho * avg[i] + (1.0f - rho) * gi;
            avg[i] = a;
            den = vi - a * a + eps;
        } else {
            den = vi + eps;
        }
        float inc = lr * gi / sqrtf(den);
        if (mom != 0) {
            float mo = momentum * mom[i] + inc;
            mom[i] = mo;
            p[i] -= mo;
        } else {
            p[i] -= inc;
        }
        mw_store_half(c, i, p[i]);
    }
}

// Decoupled weight decay first (p −= p·decay, decay = weight_decay·lr, 0 for Adam), then
// m += (g − m)(1 − β₁), v += (g² − v)(1 − β₂), p −= alpha·m / (sqrt(v) + ε) with
// alpha = sc->adam_alpha = lr·sqrt(1 − β₂ᵗ)/(1 − β₁ᵗ). m is s[0], v s[1].
MW_KERNEL_1D mw_adam(const MwUpdateChunk* chunks, float beta1, float beta2, float eps,
                     float decay, const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    float alpha = sc->adam_alpha;
    MW_CHUNK_FOR(c, i) {
        float *p = c.p, *m = c.s[0], *v = c.s[1];
        float gi = c.g[i] * unscale;
        float pi = p[i];
        if (decay != 0.0f) pi -= pi * decay;
        float mi = m[i] + (gi - m[i]) * (1.0f - beta1);
        float vi = v[i] + (gi * gi - v[i]) * (1.0f - beta2);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - alpha * mi / (sqrtf(vi) + eps);
        mw_store_half(c, i, p[i]);
    }
}
