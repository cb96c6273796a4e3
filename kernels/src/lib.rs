//! CPU kernels (and later CUDA sources) for every op the planner emits; they know nothing of plans.
//!
//! Every kernel is a plain function over slices: inputs, outputs and any scratch it needs are
//! handed in by the caller (the runtime's executor, which cuts them out of the arena at the
//! planned offsets). A kernel never allocates. Storage may be `f32`, `half::f16` or
//! `half::bf16` (see [`element::Element`]); arithmetic is always `f32`.
//!
//! Layouts follow Keras: activations are row-major NHWC, dense weights `[in, out]`,
//! conv weights `[kh, kw, c_in, c_out]`, depthwise `[kh, kw, c, multiplier]`,
//! transposed-conv weights `[kh, kw, c_out, c_in]`.

pub mod element;
pub mod error;
// GEMM-based ops
pub mod attention;
pub mod conv;
pub mod dense;
pub mod embedding;
pub mod fastmath;
pub mod flash_attention;
pub mod gemm;
pub mod gemm_heap;
// everything else
pub mod activation;
pub mod elementwise;
pub mod loss;
pub mod norm;
pub mod optimizer;
pub mod pool;
pub mod random;
// the CUDA side: sources, launch shapes, the cuBLAS mapping (device code with feature `cuda`)
pub mod cublas_map;
pub mod cuda;

pub use element::Element;

/// The optimisation level these kernels were compiled at (`"0"` in a debug build, where a
/// training step runs about 100× slower than at `"3"`).
pub const OPT_LEVEL: &str = env!("MEMWISE_KERNELS_OPT_LEVEL");
pub use error::{check_len, check_len_with, KResult, KernelError};
