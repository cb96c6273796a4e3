// 2-D pooling over NHWC (kernels/src/pool.rs): max pool with a u8 arg-max, average pool
// (TF "same": the average over the valid elements only), global average pool.
//
// One thread per output element in the forwards; the backwards are gathers, one thread per
// input element summing the windows that cover it in the CPU kernel's order (so every dx
// element is written, with one rounding). The dims come as one MwPool struct, whose output
// extent and padding follow TensorFlow's rule (kernels::pool::tf_out_and_pad).
#include "common.cuh"

// Mirrored by `MwPool` in kernels/src/cuda/launch.rs.
struct MwPool {
    int n, h, w, c, kh, kw, sh, sw, oh, ow, pt, pl;
};

// The valid input range [lo, hi) of the window of output o along one axis; `start` may be < 0.
MW_DEV void mw_window(int o, int s, int pad, int k, int extent, int* start, int* lo, int* hi) {
    int st0 = o * s - pad;
    *start = st0;
    *lo = st0 > 0 ? st0 : 0;
    int e = st0 + k;
    e = e > 0 ? e : 0;
    *hi = e < extent ? e : extent;
}

// The outputs [lo, hi) whose window covers input index i along one axis.
MW_DEV void mw_covering(int i, int s, int pad, int k, int out, int* lo, int* hi) {
    int top = i + pad;
    int a = top + 1 - k;
    a = a > 0 ? a : 0;
    int l = (a + s - 1) / s;
    int h = top / s + 1;
    h = h < out ? h : out;
    *lo = l;
    *hi = h > l ? h : l;
}

// The window of output element o: its batch item and channel, and per axis the window's
// start (< 0 in the padding) and valid input range [lo, hi).
struct MwWin {
    int b, ch, hs, ilo, ihi, ws, jlo, jhi;
};

template <typename I> MW_DEV MwWin mw_out_window(I o, MwPool d) {
    MwNhwc<I> p = mw_nhwc(o, d.oh, d.ow, d.c);
    MwWin v;
    v.ch = p.c;
    v.b = (int)p.s;
    mw_window(p.y, d.sh, d.pt, d.kh, d.h, &v.hs, &v.ilo, &v.ihi);
    mw_window(p.x, d.sw, d.pl, d.kw, d.w, &v.ws, &v.jlo, &v.jhi);
    return v;
}

// y = the window's max (a copy of the element), argmax = its position ki·kw + kj in the
// window (padding counted); first max on ties; a NaN wins over numbers. `I` is the index
// type (MW_BY_INDEX), here and below.
template <typename T, typename I>
MW_DEV void maxpool_fwd(const T* x, T* y, unsigned char* argmax, MwPool d) {
    u64 total = (u64)d.n * d.oh * d.ow * d.c;
    MW_FOR_I(I, o, total) {
        MwWin v = mw_out_window(o, d);
        // The window's first element; rows of the image are d.w·d.c apart.
        const T* first = x + (((I)v.b * d.h + v.ilo) * d.w + v.jlo) * d.c + v.ch;
        const I row = (I)d.w * d.c;
        T best = *first;
        float cur = ld(best);
        int idx = (v.ilo - v.hs) * d.kw + (v.jlo - v.ws);
        // Not unrolled: a window has a few taps, and with both index paths in one kernel the
        // unrolled loops spilled registers.
#pragma unroll 1
        for (int i = v.ilo; i < v.ihi; i++)
#pragma unroll 1
            for (int j = v.jlo; j < v.jhi; j++) {
                if (i == v.ilo && j == v.jlo) continue;
                T xv = first[(I)(i - v.ilo) * row + (I)(j - v.jlo) * d.c];
                float val = ld(xv);
                if (val > cur || (mw_isnan(val) && !mw_isnan(cur))) {
                    best = xv;
                    cur = val;
                    idx = (i - v.hs) * d.kw + (j - v.ws);
                }
            }
        y[o] = best;
        argmax[o] = (unsigned char)idx;
    }
}

// The gather both backwards share: dx[e] = what `add(acc, o, oh, ow, ih, iw)` adds into acc
// over the output windows (oh, ow) covering input element e = (b, ih, iw, ch), in the CPU
// kernel's order; o is that window's output offset at channel ch.
template <typename T, typename I, typename F> MW_DEV void mw_pool_bwd(T* dx, MwPool d, F add) {
    u64 total = (u64)d.n * d.h * d.w * d.c;
    MW_FOR_I(I, e, total) {
        MwNhwc<I> p = mw_nhwc(e, d.h, d.w, d.c);
        int ih = p.y, iw = p.x;
        int ohl, ohh, owl, owh;
        mw_covering(ih, d.sh, d.pt, d.kh, d.oh, &ohl, &ohh);
        mw_covering(iw, d.sw, d.pl, d.kw, d.ow, &owl, &owh);
        float acc = 0.0f;
        for (int oh = ohl; oh < ohh; oh++)
            for (int ow = owl; ow < owh; ow++)
                add(acc, ((p.s * d.oh + oh) * d.ow + ow) * d.c + p.c, oh, ow, ih, iw);
        dx[e] = st<T>(acc);
    }
}

// dx[input] = Σ dy over the windows whose recorded arg-max is this input (0 elsewhere).
template <typename T, typename I>
MW_DEV void maxpool_bwd(const unsigned char* argmax, const T* dy, T* dx, MwPool d) {
    mw_pool_bwd<T, I>(dx, d, [=](float& acc, I o, int oh, int ow, int ih, int iw) {
        int ki = ih + d.pt - oh * d.sh;
        int kj = iw + d.pl - ow * d.sw;
        unsigned char want = (unsigned char)(ki * d.kw + kj);
        if (argmax[o] == want) acc += ld(dy[o]);
    });
}

// y = mean of the window's valid elements.
template <typename T, typename I> MW_DEV void avgpool_fwd(const T* x, T* y, MwPool d) {
    u64 total = (u64)d.n * d.oh * d.ow * d.c;
    MW_FOR_I(I, o, total) {
        MwWin v = mw_out_window(o, d);
        float inv = 1.0f / (float)((v.ihi - v.ilo) * (v.jhi - v.jlo));
        const T* img = x + (I)v.b * d.h * d.w * d.c;
        float acc = 0.0f;
        for (int i = v.ilo; i < v.ihi; i++)
            for (int j = v.jlo; j < v.jhi; j++) acc += ld(img[((I)i * d.w + j) * d.c + v.ch]);
        y[o] = st<T>(acc * inv);
    }
}

// dx[input] = Σ over covering windows of dy / (that window's valid count).
template <typename T, typename I> MW_DEV void avgpool_bwd(const T* dy, T* dx, MwPool d) {
    mw_pool_bwd<T, I>(dx, d, [=](float& acc, I o, int oh, int ow, int, int) {
        int hs, ilo, ihi, ws, jlo, jhi;
        mw_window(oh, d.sh, d.pt, d.kh, d.h, &hs, &ilo, &ihi);
        mw_window(ow, d.sw, d.pl, d.kw, d.w, &ws, &jlo, &jhi);
        float inv = 1.0f / (float)((ihi - ilo) * (jhi - jlo));
        acc += ld(dy[o]) * inv;
    });
}

// [n, hw, c] → [n, c], the mean over hw summed in f64.
template <typename T> MW_DEV void gap_fwd(const T* x, T* y, u64 n, u64 hw, u64 c) {
    MW_FOR(o, n * c) {
        u64 b = o / c, ch = o % c;
        double acc = 0.0;
        for (u64 p = 0; p < hw; p++) acc += (double)ld(x[(b * hw + p) * c + ch]);
        y[o] = st<T>((float)(acc * (1.0 / (double)hw)));
    }
}
// dx[b, p, ch] = dy[b, ch] / hw.
template <typename T, typename I> MW_DEV void gap_bwd(const T* dy, T* dx, u64 n, u64 hw, u64 c) {
    float inv = 1.0f / (float)hw;
    MW_FOR_I(I, e, n * hw * c) {
        I ch = e % (I)c, b = e / (I)(hw * c);
        dx[e] = st<T>(ld(dy[b * c + ch]) * inv);
    }
}

// One past the largest index of a pooling's input and output.
MW_DEV u64 mw_pool_largest(MwPool d) {
    return mw_max((u64)d.n * d.h * d.w * d.c, (u64)d.n * d.oh * d.ow * d.c);
}

#define MW_POOL(S, T)                                                                           \
    MW_KERNEL_1D mw_maxpool_fwd_##S(const T* x, T* y, unsigned char* argmax,                    \
                                                  MwPool d) {                                   \
        MW_BY_INDEX(mw_pool_largest(d), maxpool_fwd, T, x, y, argmax, d);                       \
    }                                                                                           \
    MW_KERNEL_1D mw_maxpool_bwd_##S(const unsigned char* argmax, const T* dy,                   \
                                                  T* dx, MwPool d) {                            \
        MW_BY_INDEX(mw_pool_largest(d), maxpool_bwd, T, argmax, dy, dx, d);                     \
    }                                                                                           \
    MW_KERNEL_1D mw_avgpool_fwd_##S(const T* x, T* y, MwPool d) {                               \
        MW_BY_INDEX(mw_pool_largest(d), avgpool_fwd, T, x, y, d);                               \
    }                                                                                           \
    MW_KERNEL_1D mw_avgpool_bwd_##S(const T* dy, T* dx, MwPool d) {                             \
        MW_BY_INDEX(mw_pool_largest(d), avgpool_bwd, T, dy, dx, d);                             \
    }                                                                                           \
    MW_KERNEL_1D mw_gap_fwd_##S(const T* x, T* y, u64 n, u64 hw, u64 c) {                       \
        gap_fwd<T>(x, y, n, hw, c);                                                             \
    }                                                                                           \
    MW_KERNEL_1D mw_gap_bwd_##S(const T* dy, T* dx, u64 n, u64 hw, u64 c) {                     \
        MW_BY_INDEX(n * hw * c, gap_bwd, T, dy, dx, n, hw, c);                                  \
    }
MW_FLOATS(MW_POOL)
