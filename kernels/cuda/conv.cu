// Convolution helpers (kernels/src/conv.rs): im2col and its adjoint col2im (conv2d and
// conv2d_transpose are im2col/col2im plus cuBLAS GEMMs), and the direct depthwise conv2d.
//
// Layouts (Keras): activations NHWC, conv2d weight [kh, kw, c_in, c_out], depthwise weight
// [kh, kw, c, multiplier] with output channel ci·multiplier + mi. Padding follows TensorFlow.
// Gathers everywhere (one thread per output element, summing in the CPU kernel's order), so
// no output needs zeroing and nothing races. The depthwise weight gradient is a channel strip
// (see norm.cu), accumulated into the f32 master gradient.
#include "common.cuh"

// The im2col geometry: an image [h, w, c] and a grid of oh × ow windows of kh × kw taps,
// stride sh × sw, padded by pt rows / pl columns before. Mirrored by `MwGeom` in
// kernels/src/cuda/launch.rs.
struct MwGeom {
    int h, w, c, oh, ow, kh, kw, sh, sw, pt, pl;
};

// Depthwise conv dims (m = multiplier). Mirrored by `MwDepthwise` in launch.rs.
struct MwDepthwise {
    int n, h, w, c, m, kh, kw, sh, sw, oh, ow, pt, pl;
};

// col[(s, oy, ox), (ki, kj, ci)] for samples n0 .. n0+cn of img [n, h, w, c]; padding taps are 0.
// `I` is the index type (MW_BY_INDEX, over im2col_largest).
template <typename T, typename I>
MW_DEV void im2col(const T* img, T* col, MwGeom g, int n0, int cn) {
    I k = (I)g.kh * g.kw * g.c;
    I p = (I)g.oh * g.ow;
    MW_FOR_I(I, e, (u64)cn * p * k) {
        I r = e / k, kk = e % k;
        int ci = (int)(kk % (I)g.c);
        int tap = (int)(kk / (I)g.c);
        int ki = tap / g.kw, kj = tap % g.kw;
        I s = (I)n0 + r / p, q = r % p;
        int oy = (int)(q / (I)g.ow), ox = (int)(q % (I)g.ow);
        int iy = oy * g.sh + ki - g.pt, ix = ox * g.sw + kj - g.pl;
        col[e] = (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w)
                     ? st<T>(0.0f)
                     : img[((s * g.h + iy) * g.w + ix) * g.c + ci];
    }
}

// The output o with o·stride + k − pad = i, or −1.
MW_DEV int mw_origin(int i, int k, int pad, int stride, int out) {
    int t = i + pad - k;
    if (t < 0 || t % stride != 0) return -1;
    int o = t / stride;
    return o < out ? o : -1;
}

// Calls f(ki, kj, oy, ox) for every tap (ki, kj), in order, whose window (oy, ox) covers input
// pixel (iy, ix), over the window grid `g` (any of the dims structs: kh, kw, sh, sw, pt, pl,
// oh, ow).
template <typename G, typename F> MW_DEV void mw_for_origins(const G& g, int iy, int ix, F f) {
    for (int ki = 0; ki < g.kh; ki++) {
        int oy = mw_origin(iy, ki, g.pt, g.sh, g.oh);
        if (oy < 0) continue;
        for (int kj = 0; kj < g.kw; kj++) {
            int ox = mw_origin(ix, kj, g.pl, g.sw, g.ow);
            if (ox < 0) continue;
            f(ki, kj, oy, ox);
        }
    }
}

// img[s, iy, ix, ci] = bias[ci] + Σ col over the windows covering (iy, ix), for cn samples
// (img points at the first); overwritten. bias may be null.
template <typename T, typename I>
MW_DEV void col2im(const T* col, T* img, MwGeom g, int cn, const float* bias) {
    I k = (I)g.kh * g.kw * g.c;
    MW_FOR_I(I, e, (u64)cn * g.h * g.w * g.c) {
        MwNhwc<I> p = mw_nhwc(e, g.h, g.w, g.c);
        I s = p.s;
        int ci = p.c;
        float acc = bias ? bias[ci] : 0.0f;
        mw_for_origins(g, p.y, p.x, [&](int ki, int kj, int oy, int ox) {
            acc += ld(col[((s * g.oh + oy) * g.ow + ox) * k + (I)(ki * g.kw + kj) * g.c + ci]);
        });
        img[e] = st<T>(acc);
    }
}

// y[s, oy, ox, o] = bias[o] + Σ_{ki,kj} x[s, iy, ix, o / m] · w[ki, kj, o].
template <typename T, typename I>
MW_DEV void dw_fwd(const T* x, const T* w, const float* bias, T* y, MwDepthwise d) {
    int co = d.c * d.m;
    MW_FOR_I(I, e, (u64)d.n * d.oh * d.ow * co) {
        MwNhwc<I> p = mw_nhwc(e, d.oh, d.ow, co);
        I s = p.s;
        int o = p.c, ox = p.x, oy = p.y;
        int ci = o / d.m;
        float acc = bias ? bias[o] : 0.0f;
        for (int ki = 0; ki < d.kh; ki++) {
            int iy = oy * d.sh + ki - d.pt;
            if (iy < 0 || iy >= d.h) continue;
            for (int kj = 0; kj < d.kw; kj++) {
                int ix = ox * d.sw + kj - d.pl;
                if (ix < 0 || ix >= d.w) continue;
                acc += ld(x[((s * d.h + iy) * d.w + ix) * d.c + ci]) *
                       ld(w[(I)(ki * d.kw + kj) * co + o]);
            }
        }
        y[e] = st<T>(acc);
    }
}

// dx[s, iy, ix, ci] = Σ over covering windows and multipliers of dy · w (overwritten).
template <typename T, typename I>
MW_DEV void dw_bwd_dx(const T* w, const T* dy, T* dx, MwDepthwise d) {
    int co = d.c * d.m;
    MW_FOR_I(I, e, (u64)d.n * d.h * d.w * d.c) {
        MwNhwc<I> p = mw_nhwc(e, d.h, d.w, d.c);
        I s = p.s;
        int ci = p.c;
        float acc = 0.0f;
        mw_for_origins(d, p.y, p.x, [&](int ki, int kj, int oy, int ox) {
            I g = ((s * d.oh + oy) * d.ow + ox) * co;
            I wt = (I)(ki * d.kw + kj) * co;
            for (int mi = 0; mi < d.m; mi++) {
                int o = ci * d.m + mi;
                acc += ld(dy[g + o]) * ld(w[wt + o]);
            }
        });
        dx[e] = st<T>(acc);
    }
}

// One past the largest index of each kernel's tensors: its index type (MW_BY_INDEX).
MW_DEV u64 mw_geom_largest(MwGeom g, u64 samples) {
    u64 col = samples * g.oh * g.ow * ((u64)g.kh * g.kw * g.c);
    return mw_max(col, samples * g.h * g.w * g.c);
}
MW_DEV u64 mw_depthwise_largest(MwDepthwise d) {
    u64 co = (u64)d.c * d.m;
    u64 y = (u64)d.n * d.oh * d.ow * co;
    return mw_max(mw_max(y, (u64)d.n * d.h * d.w * d.c), (u64)d.kh * d.kw * co);
}

// Thread (threadIdx.y) of output channel o's sum at tap (ki, kj) over its block's part of
// the output positions, with index type I.
template <typename T, typename I>
MW_DEV float dw_tap_sum(const T* x, const T* dy, MwDepthwise d, int o, int ki, int kj) {
    int co = d.c * d.m, ci = o / d.m;
    u64 p0, p1;
    mw_part_rows((u64)d.n * d.oh * d.ow, p0, p1);
    float acc = 0.0f;
    for (I p = (I)p0 + threadIdx.y; p < (I)p1; p += MW_STRIP_Y) {
        int ox = (int)(p % (I)d.ow);
        int oy = (int)((p / (I)d.ow) % (I)d.oh);
        I s = p / ((I)d.ow * d.oh);
        int iy = oy * d.sh + ki - d.pt, ix = ox * d.sw + kj - d.pl;
        if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
        acc += ld(x[((s * d.h + iy) * d.w + ix) * d.c + ci]) * ld(dy[p * co + o]);
    }
    return acc;
}

// dw[tap, o] += Σ_{s, oy, ox} x[s, iy, ix, o / m] · dy[s, oy, ox, o]: grid (⌈co/32⌉, kh·kw,
// parts), block (32, MW_STRIP_Y). Split into parts (planner: column_parts over the output
// positions), each part's sums go to partials [parts, kh·kw·co] for mw_add_parts instead.
template <typename T>
MW_DEV void dw_bwd_dw(const T* x, const T* dy, float* dw, MwDepthwise d, double* partials) {
    __shared__ double sh[MW_STRIP_Y][33];
    int co = d.c * d.m;
    int o = blockIdx.x * 32 + threadIdx.x;
    int tap = blockIdx.y;
    int ki = tap / d.kw, kj = tap % d.kw;
    float acc = 0.0f;
    if (o < co)
        acc = mw_u32_fits(mw_depthwise_largest(d)) ? dw_tap_sum<T, u32>(x, dy, d, o, ki, kj)
                                                   : dw_tap_sum<T, u64>(x, dy, d, o, ki, kj);
    double t = mw_strip_sum((double)acc, sh);
    if (o < co && threadIdx.y == 0)
        mw_strip_out(t, dw, partials, (u64)d.kh * d.kw * co, (u64)tap * co + o);
}

#define MW_CONV(S, T)                                                                           \
    MW_KERNEL_1D mw_im2col_##S(const T* img, T* col, MwGeom g, int n0, int cn) {                \
        MW_BY_INDEX(mw_geom_largest(g, (u64)n0 + cn), im2col, T, img, col, g, n0, cn);          \
    }                                                                                           \
    MW_KERNEL_1D mw_col2im_##S(const T* col, T* img, MwGeom g, int cn,                          \
                                             const float* bias) {                               \
        MW_BY_INDEX(mw_geom_largest(g, cn), col2im, T, col, img, g, cn, bias);                  \
    }                                                                                           \
    MW_KERNEL_1D mw_dw_fwd_##S(const T* x, const T* w, const float* bias, T* y,                 \
                                             MwDepthwise d) {                                   \
        MW_BY_INDEX(mw_depthwise_largest(d), dw_fwd, T, x, w, bias, y, d);                      \
    }                                                                                           \
    MW_KERNEL_1D mw_dw_bwd_dx_##S(const T* w, const T* dy, T* dx,                               \
                                                MwDepthwise d) {                                \
        MW_BY_INDEX(mw_depthwise_largest(d), dw_bwd_dx, T, w, dy, dx, d);                       \
    }                                                                                           \
    MW_KERNEL_STRIP mw_dw_bwd_dw_##S(const T* x, const T* dy, float* dw,                        \
                                                MwDepthwise d, double* partials) {              \
        dw_bwd_dw<T>(x, dy, dw, d, partials);                                                   \
    }
MW_FLOATS(MW_CONV)
