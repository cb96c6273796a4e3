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
