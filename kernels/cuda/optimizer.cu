// Optimizer updates on f32 master parameters (kernels/src/optimizer.rs): SGD (plain, momentum,
// Nesterov), RMSprop (plain, momentum, centered), Adam and AdamW, with Keras 3's formulas
// operation for operation. Pointwise, MW_BLOCK threads.
//
// Everything that changes between steps comes from MwScalars in device memory: the gradient
// unscale factor (1 / loss scale), Adam's bias-corrected step size, and the non-finite flag
// set by mw_all_finite_f32 (or an out-of-range label or id, sc->bad_index) — when it is set
// the update is skipped and params and state stay bit-identical, as on the CPU. So the whole step, update included, replays as one graph.
#include "common.cuh"

// Without momentum p −= g·lr; with it m = momentum·m − g·lr, then p += m, or with Nesterov
// p += momentum·m − g·lr. m is null without momentum.
MW_KERNEL_1D mw_sgd(float* p, const float* g, float* m, u64 n, float lr,
                                  float momentum, int nesterov, const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    MW_FOR(i, n) {
        float gi = g[i] * unscale;
        if (m == 0) {
            p[i] -= gi * lr;
        } else {
            float mi = m[i] * momentum - gi * lr;
            m[i] = mi;
            p[i] += nesterov ? mi * momentum - gi * lr : mi;
        }
    }
}

// v = rho·v + (1 − rho)·g²; centered: a = rho·a + (1 − rho)·g, den = v − a² + ε, else
// den = v + ε; inc = lr·g / sqrt(den); with momentum mom = momentum·mom + inc, p −= mom,
// else p −= inc. mom and avg are null when unused.
MW_KERNEL_1D mw_rmsprop(float* p, const float* g, float* v, float* mom, float* avg,
                                      u64 n, float lr, float rho, float momentum, float eps,
                                      const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    MW_FOR(i, n) {
        float gi = g[i] * unscale;
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
    }
}

// Decoupled weight decay first (p −= p·decay, decay = weight_decay·lr, 0 for Adam), then
// m += (g − m)(1 − β₁), v += (g² − v)(1 − β₂), p −= alpha·m / (sqrt(v) + ε) with
// alpha = sc->adam_alpha = lr·sqrt(1 − β₂ᵗ)/(1 − β₁ᵗ).
MW_KERNEL_1D mw_adam(float* p, const float* g, float* m, float* v, u64 n,
                                   float beta1, float beta2, float eps, float decay,
                                   const MwScalars* sc) {
    if (sc->nonfinite || sc->bad_index) return;
    float unscale = sc->grad_unscale;
    float alpha = sc->adam_alpha;
    MW_FOR(i, n) {
        float gi = g[i] * unscale;
        float pi = p[i];
        if (decay != 0.0f) pi -= pi * decay;
        float mi = m[i] + (gi - m[i]) * (1.0f - beta1);
        float vi = v[i] + (gi * gi - v[i]) * (1.0f - beta2);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - alpha * mi / (sqrtf(vi) + eps);
    }
}
