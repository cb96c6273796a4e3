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

// y = the window's max (a copy of the element), argmax = its position ki·kw + kj in the
// window (padding counted); first max on ties; a NaN wins over numbers.
template <typename T> MW_DEV void maxpool_fwd(const T* x, T* y, unsigned char* argmax, MwPool d) {
    u64 total = (u64)d.n * d.oh * d.ow * d.c;
    MW_FOR(o, total) {
        int ch = (int)(o % d.c);
        u64 q = o / d.c;
        int ow = (int)(q % d.ow);
        q /= d.ow;
        int oh = (int)(q % d.oh);
        int b = (int)(q / d.oh);
        int hs, ilo, ihi, ws, jlo, jhi;
        mw_window(oh, d.sh, d.pt, d.kh, d.h, &hs, &ilo, &ihi);
        mw_window(ow, d.sw, d.pl, d.kw, d.w, &ws, &jlo, &jhi);
        const T* img = x + (u64)b * d.h * d.w * d.c;
        T best = img[((u64)ilo * d.w + jlo) * d.c + ch];
        float cur = ld(best);
        int idx = (ilo - hs) * d.kw + (jlo - ws);
        for (int i = ilo; i < ihi; i++)
            for (int j = jlo; j < jhi; j++) {
                if (i == ilo && j == jlo) continue;
                T xv = img[((u64)i * d.w + j) * d.c + ch];
                float v = ld(xv);
                if (v > cur || (mw_isnan(v) && !mw_isnan(cur))) {
                    best = xv;
                    cur = v;
                    idx = (i - hs) * d.kw + (j - ws);
                }
            }
        y[o] = best;
        argmax[o] = (unsigned char)idx;
    }
}

// dx[input] = Σ dy over the windows whose recorded arg-max is this input (0 elsewhere).
template <typename T>
MW_DEV void maxpool_bwd(const unsigned char* argmax, const T* dy, T* dx, MwPool d) {
    u64 total = (u64)d.n * d.h * d.w * d.c;
    MW_FOR(e, total) {
        int ch = (int)(e % d.c);
        u64 q = e / d.c;
        int iw = (int)(q % d.w);
        q /= d.w;
        int ih = (int)(q % d.h);
        int b = (int)(q / d.h);
        int ohl, ohh, owl, owh;
        mw_covering(ih, d.sh, d.pt, d.kh, d.oh, &ohl, &ohh);
        mw_covering(iw, d.sw, d.pl, d.kw, d.ow, &owl, &owh);
        float acc = 0.0f;
        for (int oh = ohl; oh < ohh; oh++) {
            int ki = ih + d.pt - oh * d.sh;
            for (int ow = owl; ow < owh; ow++) {
                int kj = iw + d.pl - ow * d.sw;
                unsigned char want = (unsigned char)(ki * d.kw + kj);
                u64 o = (((u64)b * d.oh + oh) * d.ow + ow) * d.c + ch;
                if (argmax[o] == want) acc += ld(dy[o]);
            }
        }
        dx[e] = st<T>(acc);
    }
}

// y = mean of the window's valid elements.
template <typename T> MW_DEV void avgpool_fwd(const T* x, T* y, MwPool d) {
    u64 total = (u64)d.n * d.oh * d.ow * d.c;
    MW_FOR(o, total) {
        int ch = (int)(o % d.c);
        u64 q = o / d.c;
        int ow = (int)(q % d.ow);
        q /= d.ow;
        int oh = (int)(q % d.oh);
        int b = (int)(q / d.oh);
        int hs, ilo, ihi, ws, jlo, jhi;
        mw_window(oh, d.sh, d.pt, d.kh, d.h, &hs, &ilo, &ihi);
        mw_window(ow, d.sw, d.pl, d.kw, d.w, &ws, &jlo, &jhi);
        float inv = 1.0f / (float)((ihi - ilo) * (jhi - jlo));
        const T* img = x + (u64)b * d.h * d.w * d.c;
        float acc = 0.0f;
        for (int i = ilo; i < ihi; i++)
            for (int j = jlo; j < jhi; j++) acc += ld(img[((u64)i * d.w + j) * d.c + ch]);
        y[o] = st<T>(acc * inv);
    }
}

// dx[input] = Σ over covering windows of dy / (that window's valid count).
template <typename T> MW_DEV void avgpool_bwd(const T* dy, T* dx, MwPool d) {
    u64 total = (u64)d.n * d.h * d.w * d.c;
    MW_FOR(e, total) {
        int ch = (int)(e % d.c);
        u64 q = e / d.c;
        int iw = (int)(q % d.w);
        q /= d.w;
        int ih = (int)(q % d.h);
        int b = (int)(q / d.h);
        int ohl, ohh, owl, owh;
        mw_covering(ih, d.sh, d.pt, d.kh, d.oh, &ohl, &ohh);
        mw_covering(iw, d.sw, d.pl, d.kw, d.ow, &owl, &owh);
        float acc = 0.0f;
        for (int oh = ohl; oh < ohh; oh++) {
            int hs, ilo, ihi;
            mw_window(oh, d.sh, d.pt, d.kh, d.h, &hs, &ilo, &ihi);
            for (int ow = owl; ow < owh; ow++) {
                int ws, jlo, jhi;
                mw_window(ow, d.sw, d.pl, d.kw, d.w, &ws, &jlo, &jhi);
                float inv = 1.0f / (float)((ihi - ilo) * (jhi - jlo));
                acc += ld(dy[(((u64)b * d.oh + oh) * d.ow + ow) * d.c + ch]) * inv;
            }
        }
        dx[e] = st<T>(acc);
    }
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
template <typename T> MW_DEV void gap_bwd(const T* dy, T* dx, u64 n, u64 hw, u64 c) {
    float inv = 1.0f / (float)hw;
    MW_FOR(e, n * hw * c) {
        u64 ch = e % c, b = e / (hw * c);
        dx[e] = st<T>(ld(dy[b * c + ch]) * inv);
    }
}

#define MW_POOL(S, T)                                                                           \
    extern "C" __global__ void mw_maxpool_fwd_##S(const T* x, T* y, unsigned char* argmax,      \
                                                  MwPool d) {                                   \
        maxpool_fwd<T>(x, y, argmax, d);                                                        \
    }                                                                                           \
    extern "C" __global__ void mw_maxpool_bwd_##S(const unsigned char* argmax, const T* dy,     \
                                                  T* dx, MwPool d) {                            \
        maxpool_bwd<T>(argmax, dy, dx, d);                                                      \
    }                                                                                           \
    extern "C" __global__ void mw_avgpool_fwd_##S(const T* x, T* y, MwPool d) {                 \
        avgpool_fwd<T>(x, y, d);                                                                \
    }                                                                                           \
    extern "C" __global__ void mw_avgpool_bwd_##S(const T* dy, T* dx, MwPool d) {               \
        avgpool_bwd<T>(dy, dx, d);                                                              \
    }                                                                                           \
    extern "C" __global__ void mw_gap_fwd_##S(const T* x, T* y, u64 n, u64 hw, u64 c) {         \
        gap_fwd<T>(x, y, n, hw, c);                                                             \
    }                                                                                           \
    extern "C" __global__ void mw_gap_bwd_##S(const T* dy, T* dx, u64 n, u64 hw, u64 c) {       \
        gap_bwd<T>(dy, dx, n, hw, c);                                                           \
    }
MW_FLOATS(MW_POOL)
