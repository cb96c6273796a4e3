// Elementwise data movement (kernels/src/elementwise.rs): u8 → float input casts, dtype casts,
// n-ary add, gradient accumulation, last-axis concat and its backward, bias add after a GEMM,
// and the finite check of loss scaling. 1-D grid-stride kernels, MW_BLOCK threads.
//
// In place: every kernel here reads element i and writes element i from the same thread, so
// an output may be passed as the buffer of its (same-typed) input: add_n over its first
// input, accumulate, bias_add.
#include "common.cuh"

// y = x · scale + offset (u8 pixels → float; Keras Rescaling).
template <typename T>
MW_DEV void cast_u8(const unsigned char* x, T* y, u64 n, float scale, float offset) {
    MW_FOR(i, n) y[i] = st<T>((float)x[i] * scale + offset);
}
#define MW_CAST_U8(S, T)                                                                        \
    MW_KERNEL_1D mw_cast_u8_##S(const unsigned char* x, T* y, u64 n, float scale,               \
                                              float offset) {                                   \
        cast_u8<T>(x, y, n, scale, offset);                                                     \
    }
MW_FLOATS(MW_CAST_U8)

// Between storage types, round to nearest even (a copy when they are the same).
template <typename S, typename D> MW_DEV void cast(const S* x, D* y, u64 n) {
    MW_FOR(i, n) y[i] = st<D>(ld(x[i]));
}
#define MW_CAST(SA, TA, SB, TB)                                                                 \
    MW_KERNEL_1D mw_cast_##SA##_##SB(const TA* x, TB* y, u64 n) {                               \
        cast<TA, TB>(x, y, n);                                                                  \
    }
MW_FLOAT_PAIRS(MW_CAST)

// y = x0 + x1 + … (arity ≤ 8), summed in f32 in input order, rounded once. In place: pass
// y as x0 (the CPU kernel's add_n_inplace adds the others to the accumulator in order).
template <typename T>
MW_DEV void add_n(T* y, const T* x0, const T* x1, const T* x2, const T* x3, const T* x4,
                  const T* x5, const T* x6, const T* x7, int arity, u64 n) {
    // Unrolled rather than an array of pointers, which would live in local memory.
    MW_FOR(i, n) {
        float a = 0.0f + ld(x0[i]);
        if (arity > 1) a += ld(x1[i]);
        if (arity > 2) a += ld(x2[i]);
        if (arity > 3) a += ld(x3[i]);
        if (arity > 4) a += ld(x4[i]);
        if (arity > 5) a += ld(x5[i]);
        if (arity > 6) a += ld(x6[i]);
        if (arity > 7) a += ld(x7[i]);
        y[i] = st<T>(a);
    }
}
#define MW_ADD_N(S, T)                                                                          \
    MW_KERNEL_1D mw_add_n_##S(T* y, const T* x0, const T* x1, const T* x2,                      \
                                            const T* x3, const T* x4, const T* x5, const T* x6, \
                                            const T* x7, int arity, u64 n) {                    \
        add_n<T>(y, x0, x1, x2, x3, x4, x5, x6, x7, arity, n);                                  \
    }
MW_FLOATS(MW_ADD_N)

// dst = dst + src.
template <typename T> MW_DEV void accumulate(T* dst, const T* src, u64 n) {
    MW_FOR(i, n) dst[i] = st<T>(ld(dst[i]) + ld(src[i]));
}
#define MW_ACCUMULATE(S, T)                                                                     \
    MW_KERNEL_1D mw_accumulate_##S(T* dst, const T* src, u64 n) {                               \
        accumulate<T>(dst, src, n);                                                             \
    }
MW_FLOATS(MW_ACCUMULATE)

// y[r, :] = [a[r, :wa], b[r, :wb]] (a pure copy).
// `I` is the index type (MW_BY_INDEX), here and below.
template <typename T, typename I>
MW_DEV void concat(const T* a, const T* b, T* y, u64 rows, u64 wa, u64 wb) {
    I w = (I)(wa + wb);
    MW_FOR_I(I, i, rows * w) {
        I r = i / w, j = i % w;
        y[i] = j < wa ? a[r * wa + j] : b[r * wb + (j - wa)];
    }
}
// da[r, :] = dy[r, :wa], db[r, :] = dy[r, wa:] (overwritten).
template <typename T, typename I>
MW_DEV void concat_backward(const T* dy, T* da, T* db, u64 rows, u64 wa, u64 wb) {
    I w = (I)(wa + wb);
    MW_FOR_I(I, i, rows * w) {
        I r = i / w, j = i % w;
        if (j < wa)
            da[r * wa + j] = dy[i];
        else
            db[r * wb + (j - wa)] = dy[i];
    }
}
#define MW_CONCAT(S, T)                                                                         \
    MW_KERNEL_1D mw_concat_##S(const T* a, const T* b, T* y, u64 rows, u64 wa,                  \
                                             u64 wb) {                                          \
        MW_BY_INDEX(rows * (wa + wb), concat, T, a, b, y, rows, wa, wb);                        \
    }                                                                                           \
    MW_KERNEL_1D mw_concat_backward_##S(const T* dy, T* da, T* db, u64 rows,                    \
                                                      u64 wa, u64 wb) {                         \
        MW_BY_INDEX(rows * (wa + wb), concat_backward, T, dy, da, db, rows, wa, wb);            \
    }
MW_FLOATS(MW_CONCAT)

// y[r, j] = y[r, j] + bias[j] in f32, rounded once (the bias of a GEMM's output).
template <typename T, typename I>
MW_DEV void bias_add(T* y, const float* bias, u64 rows, u64 cols) {
    MW_FOR_I(I, i, rows * cols) y[i] = st<T>(ld(y[i]) + bias[i % (I)cols]);
}
#define MW_BIAS_ADD(S, T)                                                                       \
    MW_KERNEL_1D mw_bias_add_##S(T* y, const float* bias, u64 rows, u64 cols) {                 \
        MW_BY_INDEX(rows * cols, bias_add, T, y, bias, rows, cols);                             \
    }
MW_FLOATS(MW_BIAS_ADD)

// Loss scaling's overflow check: sets sc->nonfinite when any x[i] is NaN or ±inf. Run over
// the whole gradient range of the persistent region (its padding is zeroed with it).
MW_KERNEL_1D mw_all_finite_f32(const float* x, u64 n, MwScalars* sc) {
    bool bad = false;
    MW_FOR(i, n) bad |= !mw_isfinite(x[i]);
    if (bad) atomicOr(&sc->nonfinite, 1);
}

// Copies of plain bytes (an input batch into its tensor is a host→device copy; this is for
// device→device moves inside a captured step).
MW_KERNEL_1D mw_copy_u8(const unsigned char* x, unsigned char* y, u64 n) {
    MW_FOR(i, n) y[i] = x[i];
}
