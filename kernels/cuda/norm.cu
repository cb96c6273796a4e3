// Normalisation (kernels/src/norm.rs) and the per-channel sums that bias gradients need.
//
// Batch norm and the column sums run "channel strips": one block of 32 channels ×
// MW_STRIP_Y row lanes per 32 channels; each lane sums its rows in f64, then the lanes are
// combined in shared memory in a fixed order (deterministic, no atomics). A strip block first
// takes its statistics, then writes its channels, so y may be x and dx may be dy (in place).
// When a reduction has few strips and many rows, the planner splits its rows into parts
// (`column_parts`, gridDim.z): each part's block writes f64 partial sums into the op's scratch,
// and the next kernel adds the parts in order (mw_add_parts, or batch norm's own passes).
// Layer norm runs one warp per row (MW_ROW_WARPS rows per block).
//
// Parameter gradients (dgamma, dbeta, bias gradients) are f32 and ACCUMULATED (+=); activation
// gradients are overwritten.
#include "common.cuh"

// ---- per-channel sums --------------------------------------------------------------------------

// sums[j] += Σ_r m[r, j] over a row-major [rows, cols] matrix (bias gradients); split, each
// part's sums go to partials [parts, cols] instead (sums unused).
template <typename T>
MW_DEV void column_sums(const T* m, u64 rows, u64 cols, float* sums, double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    u64 j = (u64)blockIdx.x * 32 + threadIdx.x;
    u64 r0, r1;
    mw_part_rows(rows, r0, r1);
    double acc = 0.0;
    if (j < cols)
        for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y)
            acc += (double)ld(m[r * cols + j]);
    acc = mw_strip_sum(acc, sh);
    if (threadIdx.y == 0 && j < cols) mw_strip_out(acc, sums, partials, cols, j);
}
#define MW_COLUMN_SUMS(S, T)                                                                    \
    MW_KERNEL_STRIP mw_column_sums_##S(const T* m, u64 rows, u64 cols, float* sums,             \
                                                  double* partials) {                           \
        column_sums<T>(m, rows, cols, sums, partials);                                          \
    }
MW_FLOATS(MW_COLUMN_SUMS)

// out[i] += Σ_p partials[p·stride + i] for i < n: the second pass of a split column reduction.
MW_KERNEL_1D mw_add_parts(const double* partials, u64 parts, u64 stride, u64 n,
                                        float* out) {
    MW_FOR(i, n) out[i] += (float)mw_parts_total(partials, parts, stride, i);
}

// ---- batch norm --------------------------------------------------------------------------------

// Training forward over x [rows, c]: batch mean and biased variance per channel (two f64
// passes), x_hat = (x − mean_hi − mean_lo)·inv_std (the mean applied as an f32 hi/lo pair, as
// on the CPU), y = gamma·x_hat + beta; saves mean ([2, c]: hi, then lo) and inv_std; moves the running
// statistics unless they are null (a recompute must not move them twice).
// Σ (x − mean)² down channel `ch` over the rows [r0, r1) of the block's strip (f64).
template <typename T>
MW_DEV double bn_sq_dev(const T* x, u64 r0, u64 r1, u64 c, u64 ch, bool ok, double mu,
                        double (*sh)[33]) {
    double v = 0.0;
    if (ok)
        for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y) {
            double t = (double)ld(x[r * c + ch]) - mu;
            v += t * t;
        }
    return mw_strip_sum(v, sh);
}

// Split statistics, second pass: with the parts' column sums of x in partials [parts, c]
// (mw_column_sums), each part's Σ (x − mean)² into partials [parts + part, c].
template <typename T> MW_DEV void bn_var_parts(const T* x, u64 rows, u64 c, double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    u64 ch = (u64)blockIdx.x * 32 + threadIdx.x;
    bool ok = ch < c;
    u64 r0, r1, parts = gridDim.z;
    mw_part_rows(rows, r0, r1);
    double mu = ok ? mw_parts_total(partials, parts, c, ch) / (double)rows : 0.0;
    double v = bn_sq_dev(x, r0, r1, c, ch, ok, mu, sh);
    if (ok && threadIdx.y == 0) partials[(parts + blockIdx.z) * c + ch] = v;
}

template <typename T>
MW_DEV void bn_train_fwd(const T* x, T* y, T* x_hat, float* mean, float* inv_std,
                         float* run_mean, float* run_var, const float* gamma, const float* beta,
                         u64 rows, u64 c, float eps, float momentum, const double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    u64 ch = (u64)blockIdx.x * 32 + threadIdx.x;
    bool ok = ch < c;
    u64 r0, r1;
    mw_part_rows(rows, r0, r1);
    double mu, var;
    if (partials) { // split: the statistics are the parts' sums (mw_column_sums, bn_var_parts)
        u64 parts = gridDim.z;
        mu = ok ? mw_parts_total(partials, parts, c, ch) / (double)rows : 0.0;
        var = ok ? mw_parts_total(partials + parts * c, parts, c, ch) / (double)rows : 0.0;
    } else {
        double s = 0.0;
        if (ok)
            for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y) s += (double)ld(x[r * c + ch]);
        mu = mw_strip_sum(s, sh) / (double)rows;
        var = bn_sq_dev(x, r0, r1, c, ch, ok, mu, sh) / (double)rows;
    }
    if (!ok) return;
    float hi = (float)mu;
    float lo = (float)(mu - (double)hi);
    float inv = (float)(1.0 / sqrt(var + (double)eps));
    if (threadIdx.y == 0 && blockIdx.z == 0) {
        mean[ch] = hi;
        mean[c + ch] = lo;
        inv_std[ch] = inv;
        if (run_mean) {
            run_mean[ch] = run_mean[ch] * momentum + (float)mu * (1.0f - momentum);
            run_var[ch] = run_var[ch] * momentum + (float)var * (1.0f - momentum);
        }
    }
    float g = gamma[ch], b = beta[ch];
    for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y) {
        float h = (ld(x[r * c + ch]) - hi - lo) * inv;
        x_hat[r * c + ch] = st<T>(h);
        y[r * c + ch] = st<T>(g * h + b);
    }
}

// Inference: y = gamma·(x − running_mean)·(1/sqrt(running_var + eps)) + beta (pointwise).
// `I` is the index type (MW_BY_INDEX).
template <typename T, typename I>
MW_DEV void bn_infer(const T* x, T* y, const float* gamma, const float* beta, const float* rm,
                     const float* rv, u64 rows, u64 c, float eps) {
    MW_FOR_I(I, i, rows * c) {
        I ch = i % (I)c;
        float inv = 1.0f / sqrtf(rv[ch] + eps);
        y[i] = st<T>(gamma[ch] * (ld(x[i]) - rm[ch]) * inv + beta[ch]);
    }
}

// Σ dy and Σ dy·x_hat down channel `ch` of `[rows, c]` tensors, summed in f64 over the block's
// channel strip (`ok`: the channel exists). Every thread of the block calls it: the strip sums
// synchronise.
// `hat(i)` is x̂ at element i (MwKeptHat or MwRebuiltHat below).
// Split (gridDim.z parts), the sums are over the block's part of the rows.
template <typename T, typename H>
MW_DEV void mw_channel_grad_sums(H hat, const T* dy, u64 rows, u64 c, u64 ch, bool ok,
                                 double (*sh)[33], double& sum_dy, double& sum_dyh) {
    u64 r0, r1;
    mw_part_rows(rows, r0, r1);
    double s1 = 0.0, s2 = 0.0;
    if (ok)
        for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y) {
            double g = (double)ld(dy[r * c + ch]);
            s1 += g;
            s2 += g * (double)hat(r * c + ch);
        }
    sum_dy = mw_strip_sum(s1, sh);
    sum_dyh = mw_strip_sum(s2, sh);
}

// A channel's Σ dy and Σ dy·x̂: this strip's own (partials null), or the parts' sums that
// ln_param_grads left in partials [parts, 2c] (Σ dy, then Σ dy·x̂, per part).
template <typename T, typename H>
MW_DEV void mw_channel_grad_totals(H hat, const T* dy, u64 rows, u64 c, u64 ch, bool ok,
                                   const double* partials, double (*sh)[33], float& sum_dy,
                                   float& sum_dyh) {
    double a = 0.0, b = 0.0;
    if (partials) {
        if (ok) {
            a = mw_parts_total(partials, gridDim.z, 2 * c, ch);
            b = mw_parts_total(partials + c, gridDim.z, 2 * c, ch);
        }
    } else {
        mw_channel_grad_sums(hat, dy, rows, c, ch, ok, sh, a, b);
    }
    sum_dy = (float)a;
    sum_dyh = (float)b;
}

// dgamma += Σ_rows dy·x_hat, dbeta += Σ_rows dy (a channel strip; dbeta may be null). Run it
// before mw_ln_bwd when dx is written over dy. Group and RMS norm use it too.
// `hat(i)` is x̂ at element i (MwKeptHat, or MwRowRebuiltHat below). Split (partials
// non-null), each part's sums go to partials [parts, 2c] instead (dbeta's, then dgamma's), for
// mw_add_parts or batch norm's backward.
template <typename T, typename H>
MW_DEV void ln_param_grads(H hat, const T* dy, float* dgamma, float* dbeta, u64 rows, u64 c,
                           double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    u64 ch = (u64)blockIdx.x * 32 + threadIdx.x;
    bool ok = ch < c;
    double a, b;
    mw_channel_grad_sums(hat, dy, rows, c, ch, ok, sh, a, b);
    if (!ok || threadIdx.y != 0) return;
    if (dbeta || partials) mw_strip_out(a, dbeta, partials, 2 * c, ch); // no dbeta: RMS norm
    mw_strip_out(b, dgamma, partials ? partials + c : partials, 2 * c, ch);
}

// x̂ as the forward kept it.
template <typename T> struct MwKeptHat {
    const T* x_hat;
    MW_DEV float operator()(u64 i) const { return ld(x_hat[i]); }
};

// x̂ rebuilt from batch norm's input exactly as its forward computed it: (x − hi − lo)·inv_std,
// rounded to T (kernels/src/norm.rs, batch_norm_backward_rebuild).
template <typename T> struct MwRebuiltHat {
    const T* x;
    const float* mean; // [2, c]: hi, then lo
    const float* inv_std;
    u64 c;
    MW_DEV float operator()(u64 i) const {
        u64 ch = i % c;
        return ld(st<T>((ld(x[i]) - mean[ch] - mean[c + ch]) * inv_std[ch]));
    }
};

// Backward: dx = gamma·inv_std·(dy − (Σdy + x_hat·Σ(dy·x_hat))/rows) (overwritten),
// dgamma += Σ dy·x_hat, dbeta += Σ dy; `hat(i)` is x̂ at element i.
// Split, the sums are the parts' (partials from ln_param_grads) and each part's block
// writes its rows' dx.
template <typename T, typename H>
MW_DEV void bn_bwd(H hat, const float* inv_std, const float* gamma, const T* dy, T* dx,
                   float* dgamma, float* dbeta, u64 rows, u64 c, const double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    u64 ch = (u64)blockIdx.x * 32 + threadIdx.x;
    bool ok = ch < c;
    float sum_dy, sum_dyh;
    mw_channel_grad_totals(hat, dy, rows, c, ch, ok, partials, sh, sum_dy, sum_dyh);
    if (!ok) return;
    if (threadIdx.y == 0 && blockIdx.z == 0) {
        dbeta[ch] += sum_dy;
        dgamma[ch] += sum_dyh;
    }
    float coef = gamma[ch] * inv_std[ch];
    float inv_m = 1.0f / (float)rows;
    u64 r0, r1;
    mw_part_rows(rows, r0, r1);
    for (u64 r = r0 + threadIdx.y; r < r1; r += MW_STRIP_Y) {
        float g = ld(dy[r * c + ch]);
        float h = hat(r * c + ch);
        dx[r * c + ch] = st<T>(coef * (g - (sum_dy + h * sum_dyh) * inv_m));
    }
}

#define MW_BN(S, T)                                                                             \
    MW_KERNEL_STRIP mw_bn_train_fwd_##S(                                                        \
        const T* x, T* y, T* x_hat, float* mean, float* inv_std, float* run_mean,               \
        float* run_var, const float* gamma, const float* beta, u64 rows, u64 c, float eps,      \
        float momentum, const double* partials) {                                               \
        bn_train_fwd<T>(x, y, x_hat, mean, inv_std, run_mean, run_var, gamma, beta, rows, c,    \
                        eps, momentum, partials);                                               \
    }                                                                                           \
    MW_KERNEL_STRIP mw_bn_var_parts_##S(const T* x, u64 rows, u64 c,                            \
                                                   double* partials) {                          \
        bn_var_parts<T>(x, rows, c, partials);                                                  \
    }                                                                                           \
    MW_KERNEL_1D mw_bn_infer_##S(const T* x, T* y, const float* gamma,                          \
                                               const float* beta, const float* rm,              \
                                               const float* rv, u64 rows, u64 c, float eps) {   \
        MW_BY_INDEX(rows * c, bn_infer, T, x, y, gamma, beta, rm, rv, rows, c, eps);            \
    }                                                                                           \
    MW_KERNEL_STRIP mw_bn_bwd_##S(const T* x_hat, const float* inv_std,                         \
                                             const float* gamma, const T* dy, T* dx,            \
                                             float* dgamma, float* dbeta, u64 rows, u64 c,      \
                                             const double* partials) {                          \
        bn_bwd<T>(MwKeptHat<T>{x_hat}, inv_std, gamma, dy, dx, dgamma, dbeta, rows, c,          \
                  partials);                                                                    \
    }                                                                                           \
    MW_KERNEL_STRIP mw_bn_bwd_rebuild_##S(                                                      \
        const T* x, const float* mean, const float* inv_std, const float* gamma, const T* dy,   \
        T* dx, float* dgamma, float* dbeta, u64 rows, u64 c, const double* partials) {          \
        bn_bwd<T>(MwRebuiltHat<T>{x, mean, inv_std, c}, inv_std, gamma, dy, dx, dgamma, dbeta,  \
                  rows, c, partials);                                                           \
    }                                                                                           \
    MW_KERNEL_STRIP mw_bn_grad_parts_##S(const T* x_hat, const T* dy, u64 rows,                 \
                                                    u64 c, double* partials) {                  \
        ln_param_grads<T>(MwKeptHat<T>{x_hat}, dy, 0, 0, rows, c, partials);                    \
    }                                                                                           \
    MW_KERNEL_STRIP mw_bn_grad_parts_rebuild_##S(                                               \
        const T* x, const float* mean, const float* inv_std, const T* dy, u64 rows, u64 c,      \
        double* partials) {                                                                     \
        ln_param_grads<T>(MwRebuiltHat<T>{x, mean, inv_std, c}, dy, 0, 0, rows, c,              \
                          partials);                                                            \
    }
MW_FLOATS(MW_BN)

// ---- layer norm --------------------------------------------------------------------------------

// A row's mean in f64 over the warp's lanes: the forward's, and the one a rebuilding backward
// recomputes (mw_ln_mean: the same sums in the same order, so the same bits).
template <typename T> MW_DEV double ln_row_mean(const T* xr, u64 c, int lane) {
    double s = 0.0;
    for (u64 j = lane; j < c; j += 32) s += (double)ld(xr[j]);
    return mw_warp_sum(s) / (double)c;
}

// Forward per row: mean and biased variance in f64, rstd = 1/sqrt(var + eps),
// x_hat = (x − mean)·rstd, y = gamma·x_hat + beta; saves x_hat and rstd.
template <typename T>
MW_DEV void ln_fwd(const T* x, T* y, T* x_hat, float* rstd, const float* gamma,
                   const float* beta, u64 rows, u64 c, float eps) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    const T* xr = x + r * c;
    double mean = ln_row_mean(xr, c, lane);
    double v = 0.0;
    for (u64 j = lane; j < c; j += 32) {
        double t = (double)ld(xr[j]) - mean;
        v += t * t;
    }
    double var = mw_warp_sum(v) / (double)c;
    float m = (float)mean;
    float rs = (float)(1.0 / sqrt(var + (double)eps));
    if (lane == 0) rstd[r] = rs;
    for (u64 j = lane; j < c; j += 32) {
        float h = (ld(xr[j]) - m) * rs;
        x_hat[r * c + j] = st<T>(h);
        y[r * c + j] = st<T>(gamma[j] * h + beta[j]);
    }
}

// x̂ rebuilt from layer norm's input exactly as its forward computed it: (x − mean)·rstd per
// row, rounded to T, from the means mw_ln_mean recomputed (kernels/src/norm.rs,
// layer_norm_backward_rebuild).
template <typename T> struct MwRowRebuiltHat {
    const T* x;
    const float* mean; // [rows]
    const float* rstd; // [rows]
    u64 c;
    MW_DEV float operator()(u64 i) const {
        u64 r = i / c;
        return ld(st<T>((ld(x[i]) - mean[r]) * rstd[r]));
    }
};

// One warp per row: the row's mean as the forward computed it, for MwRowRebuiltHat.
template <typename T> MW_DEV void ln_mean(const T* x, float* mean, u64 rows, u64 c) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    float m = (float)ln_row_mean(x + r * c, c, lane);
    if (lane == 0) mean[r] = m;
}

// dx = rstd·(g − mean(g) − x_hat·mean(g·x_hat)) per row, g = dy·gamma (overwritten; dx may be dy);
// `hat(i)` is x̂ at element i.
template <typename T, typename H>
MW_DEV void ln_bwd(H hat, const float* rstd, const float* gamma, const T* dy, T* dx, u64 rows,
                   u64 c) {
    u64 r = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    float s1 = 0.0f, s2 = 0.0f;
    for (u64 j = lane; j < c; j += 32) {
        float g = ld(dy[r * c + j]) * gamma[j];
        s1 += g;
        s2 += g * hat(r * c + j);
    }
    float inv_c = 1.0f / (float)c;
    float m1 = mw_warp_sum(s1) * inv_c, m2 = mw_warp_sum(s2) * inv_c;
    float rs = rstd[r];
    for (u64 j = lane; j < c; j += 32) {
        float g = ld(dy[r * c + j]) * gamma[j];
        dx[r * c + j] = st<T>(rs * (g - m1 - hat(r * c + j) * m2));
    }
}

#define MW_LN(S, T)                                                                             \
    MW_KERNEL_ROWS mw_ln_fwd_##S(const T* x, T* y, T* x_hat, float* rstd,                       \
                                             const float* gamma, const float* beta, u64 rows,   \
                                             u64 c, float eps) {                                \
        ln_fwd<T>(x, y, x_hat, rstd, gamma, beta, rows, c, eps);                                \
    }                                                                                           \
    MW_KERNEL_STRIP mw_ln_param_grads_##S(const T* x_hat, const T* dy, float* dgamma,           \
                                                     float* dbeta, u64 rows, u64 c,             \
                                                     double* partials) {                        \
        ln_param_grads<T>(MwKeptHat<T>{x_hat}, dy, dgamma, dbeta, rows, c, partials);           \
    }                                                                                           \
    MW_KERNEL_ROWS mw_ln_bwd_##S(const T* x_hat, const float* rstd,                             \
                                             const float* gamma, const T* dy, T* dx, u64 rows,  \
                                             u64 c) {                                           \
        ln_bwd<T>(MwKeptHat<T>{x_hat}, rstd, gamma, dy, dx, rows, c);                           \
    }                                                                                           \
    MW_KERNEL_ROWS mw_ln_mean_##S(const T* x, float* mean, u64 rows, u64 c) {                   \
        ln_mean<T>(x, mean, rows, c);                                                           \
    }                                                                                           \
    MW_KERNEL_STRIP mw_ln_param_grads_rebuild_##S(                                              \
        const T* x, const float* mean, const float* rstd, const T* dy, float* dgamma,           \
        float* dbeta, u64 rows, u64 c, double* partials) {                                      \
        ln_param_grads<T>(MwRowRebuiltHat<T>{x, mean, rstd, c}, dy, dgamma, dbeta, rows, c,     \
                          partials);                                                            \
    }                                                                                           \
    MW_KERNEL_ROWS mw_ln_bwd_rebuild_##S(const T* x, const float* mean,                         \
                                                     const float* rstd, const float* gamma,     \
                                                     const T* dy, T* dx, u64 rows, u64 c) {     \
        ln_bwd<T>(MwRowRebuiltHat<T>{x, mean, rstd, c}, rstd, gamma, dy, dx, rows, c);          \
    }
MW_FLOATS(MW_LN)

// ---- group norm and RMS norm -------------------------------------------------------------------

// One warp per (sample, group) of x [samples, spatial, c] with groups of cg = c / groups
// consecutive channels (kernels/src/norm.rs, GroupNormDims). Element e of a group sits at
// (e / cg)·c + e % cg within its sample. RMS norm is groups = 1, spatial = 1, center = 0 and
// beta null: one kernel pair for both, as on the CPU.
MW_DEV u64 gn_at(u64 e, u64 cg, u64 c, u64 g) { return (e / cg) * c + g * cg + e % cg; }

// Forward: mean (when centring) and variance in f64, rstd = 1/sqrt(var + eps),
// x_hat = (x − mean)·rstd, y = gamma·x_hat + beta (beta may be null); saves x_hat and rstd.
template <typename T>
MW_DEV void gn_fwd(const T* x, T* y, T* x_hat, float* rstd, const float* gamma,
                   const float* beta, u64 samples, u64 spatial, u64 c, u64 groups, int center,
                   float eps) {
    u64 sg = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (sg >= samples * groups) return; // whole warps: sg is the warp's
    int lane = threadIdx.x & 31;
    u64 g = sg % groups, cg = c / groups, len = spatial * cg;
    u64 base = (sg / groups) * spatial * c;
    double s = 0.0;
    for (u64 e = lane; e < len; e += 32) s += (double)ld(x[base + gn_at(e, cg, c, g)]);
    // `center` is the same for every warp: the reductions stay warp-uniform.
    double mean = center ? mw_warp_sum(s) / (double)len : 0.0;
    double v = 0.0;
    for (u64 e = lane; e < len; e += 32) {
        double t = (double)ld(x[base + gn_at(e, cg, c, g)]) - mean;
        v += t * t;
    }
    double var = mw_warp_sum(v) / (double)len;
    float m = (float)mean;
    float rs = (float)(1.0 / sqrt(var + (double)eps));
    if (lane == 0) rstd[sg] = rs;
    for (u64 e = lane; e < len; e += 32) {
        u64 i = base + gn_at(e, cg, c, g), ch = g * cg + e % cg;
        float h = (ld(x[i]) - m) * rs;
        x_hat[i] = st<T>(h);
        y[i] = st<T>(gamma[ch] * h + (beta ? beta[ch] : 0.0f));
    }
}

// dx = rstd·(g − mean(g) − x_hat·mean(g·x_hat)) per (sample, group), g = dy·gamma, without
// mean(g) when uncentred; sums in f64. The parameter gradients are mw_ln_param_grads over
// [samples·spatial, c] rows (dbeta null without a shift).
template <typename T>
MW_DEV void gn_bwd(const T* x_hat, const float* rstd, const float* gamma, const T* dy, T* dx,
                   u64 samples, u64 spatial, u64 c, u64 groups, int center) {
    u64 sg = (u64)blockIdx.x * MW_ROW_WARPS + (threadIdx.x >> 5);
    if (sg >= samples * groups) return;
    int lane = threadIdx.x & 31;
    u64 g = sg % groups, cg = c / groups, len = spatial * cg;
    u64 base = (sg / groups) * spatial * c;
    double s1 = 0.0, s2 = 0.0;
    for (u64 e = lane; e < len; e += 32) {
        u64 i = base + gn_at(e, cg, c, g);
        float gv = ld(dy[i]) * gamma[g * cg + e % cg];
        s1 += (double)gv;
        s2 += (double)(gv * ld(x_hat[i]));
    }
    double t1 = mw_warp_sum(s1), t2 = mw_warp_sum(s2);
    float m1 = center ? (float)(t1 / (double)len) : 0.0f;
    float m2 = (float)(t2 / (double)len);
    float rs = rstd[sg];
    for (u64 e = lane; e < len; e += 32) {
        u64 i = base + gn_at(e, cg, c, g);
        float gv = ld(dy[i]) * gamma[g * cg + e % cg];
        dx[i] = st<T>(rs * (gv - m1 - ld(x_hat[i]) * m2));
    }
}

#define MW_GN(S, T)                                                                             \
    MW_KERNEL_ROWS mw_gn_fwd_##S(const T* x, T* y, T* x_hat, float* rstd,                       \
                                             const float* gamma, const float* beta,             \
                                             u64 samples, u64 spatial, u64 c, u64 groups,       \
                                             int center, float eps) {                           \
        gn_fwd<T>(x, y, x_hat, rstd, gamma, beta, samples, spatial, c, groups, center, eps);    \
    }                                                                                           \
    MW_KERNEL_ROWS mw_gn_bwd_##S(const T* x_hat, const float* rstd,                             \
                                             const float* gamma, const T* dy, T* dx,            \
                                             u64 samples, u64 spatial, u64 c, u64 groups,       \
                                             int center) {                                      \
        gn_bwd<T>(x_hat, rstd, gamma, dy, dx, samples, spatial, c, groups, center);             \
    }
MW_FLOATS(MW_GN)
