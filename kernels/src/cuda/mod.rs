//! The CUDA side of the kernels: the `.cu` sources (`kernels/cuda/`), their launch shapes and
//! argument packing, the on-disk module cache, and — with the `cuda` feature — the device:
//! NVRTC compilation to CUBIN on first use, kernel launches and cuBLAS GEMMs through cudarc.
//!
//! [`launch`] and [`sources`] are plain Rust, always built and tested: the host emulation
//! (`kernels/cuda-emu`, `tests/cuda_emulation.rs`) runs every kernel through exactly the
//! [`launch::KernelCall`]s a device would get, on the CPU, against the CPU kernels.

pub mod flash;
pub mod launch;
pub mod module_cache;
pub mod sources;

#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod lane;

pub use launch::{Float, KArg, KernelCall, LaunchCfg, MwDepthwise, MwGeom, MwPool, MwScalars};
