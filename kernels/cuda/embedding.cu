// Embedding lookup (kernels/src/embedding.rs): forward gathers rows of the f32 table,
// backward scatter-adds into the f32 master gradient with atomics (repeated ids add up; the
// order of the additions, and so the last bits, may vary from run to run, unlike the CPU's).
// An id outside 0..vocab cannot raise an error here: its row is left out (zeros forward,
// nothing backward) and sc->bad_index records 1 + its position for the runtime to report.
//
// The positional embedding adds a learned f32 table [len = seq·dim] to every sample of x
// [rows, len]; its table gradient is mw_column_sums of dy (norm.cu), as a bias's.
#include "common.cuh"

// `I` is the index type (MW_BY_INDEX) of y and dy; the table's rows are indexed in 64 bits.
template <typename T, typename I>
MW_DEV void embedding_fwd(const int* ids, const float* w, T* y, u64 tokens, u64 vocab, u64 dim,
                          MwScalars* sc) {
    MW_FOR_I(I, e, tokens * dim) {
        I t = e / (I)dim, j = e % (I)dim;
        long long id = ids[t];
        if (id < 0 || id >= (long long)vocab) {
            y[e] = st<T>(0.0f);
            if (j == 0) atomicMax(&sc->bad_index, (int)t + 1);
        } else {
            y[e] = st<T>(w[(u64)id * dim + j]);
        }
    }
}

template <typename T, typename I>
MW_DEV void embedding_bwd(const int* ids, const T* dy, float* dw, u64 tokens, u64 vocab, u64 dim) {
    MW_FOR_I(I, e, tokens * dim) {
        I t = e / (I)dim, j = e % (I)dim;
        long long id = ids[t];
        if (id >= 0 && id < (long long)vocab) atomicAdd(&dw[(u64)id * dim + j], ld(dy[e]));
    }
}

#define MW_EMBEDDING(S, T)                                                                      \
    MW_KERNEL_1D mw_embedding_fwd_##S(const int* ids, const float* w, T* y,                     \
                                                    u64 tokens, u64 vocab, u64 dim,             \
                                                    MwScalars* sc) {                            \
        MW_BY_INDEX(tokens * dim, embedding_fwd, T, ids, w, y, tokens, vocab, dim, sc);         \
    }                                                                                           \
    MW_KERNEL_1D mw_embedding_bwd_##S(const int* ids, const T* dy, float* dw,                   \
                                                    u64 tokens, u64 vocab, u64 dim) {           \
        MW_BY_INDEX(tokens * dim, embedding_bwd, T, ids, dy, dw, tokens, vocab, dim);           \
    }
MW_FLOATS(MW_EMBEDDING)

// y = x + table per sample; in place when y is x (each element read, then written, by one
// thread).
template <typename T, typename I>
MW_DEV void pos_embedding_fwd(const T* x, const float* table, T* y, u64 rows, u64 len) {
    MW_FOR_I(I, i, rows * len) y[i] = st<T>(ld(x[i]) + table[i % (I)len]);
}
#define MW_POS_EMBEDDING(S, T)                                                                  \
    MW_KERNEL_1D mw_pos_embedding_fwd_##S(const T* x, const float* table, T* y,                 \
                                                        u64 rows, u64 len) {                    \
        MW_BY_INDEX(rows * len, pos_embedding_fwd, T, x, table, y, rows, len);                  \
    }
MW_FLOATS(MW_POS_EMBEDDING)
