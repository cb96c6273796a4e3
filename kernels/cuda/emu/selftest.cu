// Kernels that misuse barriers, for the emulator's own tests: it must report them, not hang.
// Compiled into the emulation library only (not one of the kernel sources).
#include "../common.cuh"

// Half of warp 0 waits at __syncthreads, the other half at a warp barrier: a deadlock.
extern "C" __global__ void mw_emu_selftest_divergent(int* out) {
    if (threadIdx.x < 16)
        __syncthreads();
    else
        __syncwarp();
    out[threadIdx.x] = 1;
}

// Lanes 8.. exit, then lane 0 reads lane 16 in a shuffle.
extern "C" __global__ void mw_emu_selftest_exited_lane(int* out) {
    if (threadIdx.x >= 8) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 16);
}

// A block-wide sum through shared memory and barriers: out[b] = Σ threadIdx.x over the block.
extern "C" __global__ void mw_emu_selftest_block_sum(int* out) {
    __shared__ int sh[32];
    int v = mw_warp_sum((int)threadIdx.x);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        for (unsigned w = 0; w < blockDim.x / 32; w++) t += sh[w];
        out[blockIdx.x] = t;
    }
}

// Record the order the grid's blocks, and a block's threads, ran in: out[k] is the k-th to run
// (out[64] counts). A GPU keeps no order; the emulator must not either (runtime.h).
extern "C" __global__ void mw_emu_selftest_block_order(int* out) {
    if (threadIdx.x == 0) out[atomicAdd(&out[64], 1)] = (int)blockIdx.x;
}
extern "C" __global__ void mw_emu_selftest_thread_order(int* out) {
    out[atomicAdd(&out[64], 1)] = (int)threadIdx.x;
}

// ---- the strict checks (kernels/tests/cuda_emulation_strict.rs) ------------------------------

// Reads shared memory that only block 0 (all of it) and thread 0 of the other blocks wrote:
// out[b·n + t] = sh[t]. The emulator fills shared memory with NaN in every block, so the other
// blocks' threads t > 0 get NaN — not 0 (a fresh variable) nor 1 (what block 0 left there).
extern "C" __global__ void mw_emu_selftest_unwritten_shared(float* out) {
    __shared__ float sh[256];
    if (blockIdx.x == 0 || threadIdx.x == 0) sh[threadIdx.x] = 1.0f;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = sh[threadIdx.x];
}

// Thread 0 of every block writes out[0]: a write-write race between blocks.
extern "C" __global__ void mw_emu_selftest_cross_block_write(float* out) {
    if (threadIdx.x == 0) out[0] = (float)blockIdx.x;
}

// Thread 0 writes out[b], and every thread of the block reads it back with no barrier
// between: a read-after-write race inside one block. out[grid + b·n + t] gets what was read.
extern "C" __global__ void mw_emu_selftest_unsynced_read(float* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = 1.0f + blockIdx.x;
    float v = out[blockIdx.x];
    out[gridDim.x + blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// The same with a __syncthreads between the write and the reads: correct.
extern "C" __global__ void mw_emu_selftest_synced_read(float* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = 1.0f + blockIdx.x;
    __syncthreads();
    float v = out[blockIdx.x];
    out[gridDim.x + blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// Each thread writes sh[t] and reads its neighbour's sh[t ^ 1] with no barrier: a race on
// shared memory. out[b·n + t] gets what was read.
extern "C" __global__ void mw_emu_selftest_shared_race(float* out) {
    __shared__ float sh[256];
    sh[threadIdx.x] = (float)threadIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = sh[threadIdx.x ^ 1u];
}

// Every thread of every block adds 1 to out[0] atomically, and reads out[1 + b·n + t] that
// only it wrote: no race (atomics are exempt, a thread may read its own writes).
extern "C" __global__ void mw_emu_selftest_atomic_count(float* out) {
    atomicAdd(&out[0], 1.0f);
    u64 i = 1 + (u64)blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = 2.0f;
    out[i] += 1.0f;
}

// mw_emu_selftest_shared_race with a __syncwarp between the write and the read, which orders
// the lanes of a warp: correct.
extern "C" __global__ void mw_emu_selftest_warp_synced(float* out) {
    __shared__ float sh[256];
    sh[threadIdx.x] = (float)threadIdx.x;
    __syncwarp();
    out[blockIdx.x * blockDim.x + threadIdx.x] = sh[threadIdx.x ^ 1u];
}
