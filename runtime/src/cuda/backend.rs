//! `Backend`: what the CUDA kernels need from a device — plain allocations, copies, kernel
//! launches ([`memwise_kernels::cuda::KernelCall`]), mapped GEMMs
//! ([`memwise_kernels::cublas_map`]) and graph capture. The cudarc one is
//! [`super::device::CudaBackend`] (feature `cuda`); `tests/cuda_emulated.rs` has one over the
//! host emulation of the kernels.

use memwise_kernels::cublas_map::{CublasGemm, GemmBuffers};
use memwise_kernels::cuda::launch::KernelCall;

/// What [`super::CudaKernels`] needs from a device. Addresses are `u64` device pointers.
pub trait Backend {
    /// A short description (`cuda:0 (NVIDIA H200)`, `emulated` …).
    fn name(&self) -> String;
    /// `(free, total)` device memory in bytes, when the device knows it.
    fn memory(&self) -> Option<(u64, u64)>;
    /// Device memory an executor keeps free beyond its plan: what the device allocates after
    /// the executor is built (GEMM kernels the library loads lazily at the first step, the
    /// captured graph's instantiation).
    fn headroom(&self) -> u64 {
        0
    }
    /// Device memory the backend's stream and GEMM library took before any executor
    /// allocation (not in `device_bytes_used`), where measured.
    fn lane_bytes(&self) -> Option<u64> {
        None
    }
    /// One zeroed allocation of `bytes`, owned by the backend; returns its address.
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String>;
    /// Host → device copy (ordered with the launches).
    ///
    /// # Safety
    /// `dst` must have room for `src`.
    unsafe fn upload(&self, src: &[u8], dst: u64) -> std::result::Result<(), String>;
    /// Prepares the uploads of a step's inputs, at most `bytes` per step: a CUDA device
    /// allocates its two pinned staging buffers here, once. The default needs nothing.
    fn reserve_input_staging(&mut self, bytes: usize) -> std::result::Result<(), String> {
        let _ = bytes;
        Ok(())
    }
    /// Host → device copies of a step's inputs, `(bytes, device address)` each (ordered with
    /// the launches). The default is one [`Backend::upload`] each.
    ///
    /// # Safety
    /// Each address must have room for its bytes.
    unsafe fn upload_inputs(&mut self, parts: &[(&[u8], u64)]) -> std::result::Result<(), String> {
        for &(bytes, dst) in parts {
            self.upload(bytes, dst)?;
        }
        Ok(())
    }
    /// Device → host copy; returns when the data is there.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes.
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> std::result::Result<(), String>;
    /// Sets `bytes` bytes at `dst` to `value` (capturable): 0 for gradients, 0xFF for the
    /// poisoned-arena tests' NaN.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory.
    unsafe fn memset(&self, dst: u64, bytes: usize, value: u8) -> std::result::Result<(), String>;
    /// Launches a kernel.
    ///
    /// # Safety
    /// The call's pointers must be valid for what the kernel touches.
    unsafe fn launch(&self, call: &KernelCall) -> std::result::Result<(), String>;
    /// Runs a mapped GEMM on the buffers `bufs`.
    ///
    /// # Safety
    /// The addresses must hold what `g.extents()` says the call touches.
    unsafe fn gemm(&self, g: &CublasGemm, bufs: GemmBuffers) -> std::result::Result<(), String>;
    fn synchronize(&self) -> std::result::Result<(), String>;
    /// Starts recording the launches that follow into a graph; `false` when this backend
    /// has no graphs (then nothing is recorded and launches run as usual).
    fn begin_capture(&mut self) -> std::result::Result<bool, String>;
    /// Ends the recording and instantiates the graph.
    fn end_capture(&mut self) -> std::result::Result<(), String>;
    /// Replays the recorded graph.
    fn replay(&self) -> std::result::Result<(), String>;
    /// Forgets the recorded graph.
    fn clear_graph(&mut self);
    /// The stream (a raw `CUstream`) to enqueue device collectives ([`DeviceCollective`])
    /// on, made to wait for everything this backend has enqueued so far: the collective
    /// sees finished values and runs while the launches that follow do (the gradient sums
    /// overlap the rest of backward). `Ok(None)` (the default) where the backend has none:
    /// the executor then sums and gathers through the host.
    ///
    /// [`DeviceCollective`]: crate::collective::DeviceCollective
    fn fork_collective(&self) -> std::result::Result<Option<u64>, String> {
        Ok(None)
    }
    /// Makes this backend's later launches wait for every collective enqueued on the
    /// stream [`Backend::fork_collective`] gave.
    fn join_collectives(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// The turns on this backend's stream, where other backends share it.
    fn turn(&self) -> Option<&std::sync::Arc<crate::kernels::DeviceTurn>> {
        None
    }
    /// A new backend on the same device, holding no allocations and no graph: for the
    /// inference executors a trainer builds beside its training executor.
    fn open_another(&self) -> std::result::Result<Self, String>
    where
        Self: Sized;
}
