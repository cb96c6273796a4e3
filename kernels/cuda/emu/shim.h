// Host emulation of the CUDA built-ins the memwise kernels use, so the same .cu sources
// compile as C++ and run on the CPU (tests: kernels/tests/cuda_emulation.rs).
//
// A launch runs its grid one block at a time, in a shuffled order; the block's threads are
// fibers (ucontext) on the calling OS thread, resumed in a shuffled order between barriers
// (runtime.h says why). `__syncthreads` parks a fiber until every live thread of the block has
// reached it, the warp shuffles park it until its 32 lanes have exchanged values, and a fiber
// that returns leaves the block (as an exited CUDA thread does). When no fiber can move — a
// barrier some threads never reach, a shuffle with an exited lane — the launch fails with a
// message instead of hanging. `__shared__` is per-block storage (one block runs at a time on
// a thread; `thread_local`, so tests on several threads do not share it). The build appends
// `mw_emu::shared_decl(&var, sizeof var, "var");` to every `__shared__` declaration, so the
// first thread of a block to reach one fills the variable with 0xFF bytes — NaN as f32, f64,
// f16 and bf16, −1 as an integer — and a kernel reading shared memory it did not write gets
// NaN in its results, as it would get garbage on a GPU, instead of the zeros a fresh
// `thread_local` holds or the values the previous block left.
//
// The library is compiled with GCC's `-fsanitize=thread` instrumentation (kernels/cuda-emu/
// build.rs) and runtime.h defines its hooks: with `MW_EMU_RACES=1` a launch logs every access
// the kernel code makes to global and shared memory and fails on a data race (runtime.h).
// The atomics below are marked MW_EMU_UNLOGGED: many threads updating one address
// atomically is not a race, so they are not logged.
//
// The 16-bit conversions round to nearest even with IEEE subnormals, overflow to infinity and
// NaN kept NaN, exactly like the `half` crate and the PTX `cvt.rn` instructions.

#ifndef MW_EMU_SHIM_H
#define MW_EMU_SHIM_H

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

#define __global__ __attribute__((used))
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
// The registry scan (kernels/cuda-emu/build.rs) reads each kernel's block bound from the
// preprocessed text; compiled, the bound is the registry's and the launch checks it.
#ifdef MW_EMU_SCAN
#define __launch_bounds__(threads) mw_emu_bound(threads)
#else
#define __launch_bounds__(...)
#endif

using std::cos;
using std::erf;
using std::exp;
using std::log;
using std::sin;
using std::sqrt;
using std::tanh;

// A function whose memory accesses the race log does not see (the compiler does not
// instrument it, and it is never inlined into instrumented code).
#define MW_EMU_UNLOGGED __attribute__((no_sanitize("thread")))

namespace mw_emu {
// Implemented in runtime.h.
void sync_block();
void sync_warp();
void exchange(const void* v, unsigned size, int src_lane_xor, int src_lane_down, void* out);
// A `__shared__` variable's storage, reported each time a thread passes its declaration.
void shared_decl(void* p, unsigned long size, const char* name);
} // namespace mw_emu

inline void __syncthreads() { mw_emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { mw_emu::sync_warp(); }

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int = 32) {
    T r;
    mw_emu::exchange(&v, sizeof(T), lane_mask, -1, &r);
    return r;
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
    T r;
    mw_emu::exchange(&v, sizeof(T), -1, (int)delta, &r);
    return r;
}

inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }

// Atomics: fibers of one launch never run at the same time, but tests on several OS threads
// may touch shared buffers, so these are real atomics. Unlogged: concurrent atomics on one
// address are not a race.
MW_EMU_UNLOGGED inline float atomicAdd(float* p, float v) {
    unsigned* u = reinterpret_cast<unsigned*>(p);
    unsigned old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (true) {
        unsigned nw = __float_as_uint(__uint_as_float(old) + v);
        if (__atomic_compare_exchange_n(u, &old, nw, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return __uint_as_float(old);
    }
}
MW_EMU_UNLOGGED inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
MW_EMU_UNLOGGED inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
MW_EMU_UNLOGGED inline int atomicMax(int* p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
    return old;
}

// ---- 16-bit conversions --------------------------------------------------------------------

inline float mw_f16_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000u) << 16;
    unsigned exp = (h >> 10) & 0x1fu;
    unsigned man = h & 0x3ffu;
    unsigned bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            // Subnormal: value = man · 2^-24.
            float f = (float)man * (1.0f / 16777216.0f);
            bits = sign | __float_as_uint(f);
        }
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline unsigned short mw_f32_to_f16(float f) {
    unsigned x = __float_as_uint(f);
    unsigned sign = (x >> 16) & 0x8000u;
    unsigned exp = (x >> 23) & 0xffu;
    unsigned man = x & 0x7fffffu;
    if (exp == 0xff) return (unsigned short)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (unsigned short)(sign | 0x7c00u);
    if (e <= 0) {
        // Subnormal or zero in f16.
        if (e < -10) return (unsigned short)sign;
        unsigned m = man | 0x800000u;
        unsigned shift = (unsigned)(14 - e);
        unsigned half_m = m >> shift;
        unsigned rem = m & ((1u << shift) - 1u);
        unsigned halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (half_m & 1u))) half_m++;
        return (unsigned short)(sign | half_m);
    }
    unsigned h = sign | ((unsigned)e << 10) | (man >> 13);
    unsigned rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; // may carry into the exponent: right
    return (unsigned short)h;
}

inline float mw_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

inline unsigned short mw_f32_to_bf16(float f) {
    unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x0040u);
    unsigned lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return (unsigned short)(x >> 16);
}

#endif // MW_EMU_SHIM_H
