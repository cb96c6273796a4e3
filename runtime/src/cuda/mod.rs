//! The CUDA executor: the same static plan, run by device kernels and cuBLAS.
//!
//! - [`Backend`]: what the executor needs from a device — plain allocations, copies, kernel
//!   launches ([`memwise_kernels::cuda::KernelCall`]), mapped GEMMs
//!   ([`memwise_kernels::cublas_map`]) and graph capture.
//! - [`GpuExecutor`]: walks the plan like the CPU [`crate::Executor`], turning each step into
//!   kernel launches and GEMMs at the planned offsets of ONE arena allocation and ONE
//!   persistent allocation. Values that change per step (loss scale, Adam's step size, the
//!   RNG step, flags) live in device memory, so after a warm-up step the whole training step is
//!   captured once as a CUDA graph and replayed.
//! - [`device`] (feature `cuda`): the cudarc backend, and the per-process cache of opened
//!   devices behind [`crate::Device::cuda`].
//!
//! `GpuExecutor` is generic so that it is tested without a GPU: `tests/cuda_emulated.rs`
//! runs it over the host emulation of the kernels (`memwise-cuda-emu`) and compares every
//! model it trains with the CPU executor. Only [`device`] needs the feature.

mod executor;

#[cfg(feature = "cuda")]
pub mod device;

pub use executor::{Backend, GpuExecutor};
