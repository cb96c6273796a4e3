//! The one error type kernels return: a caller handed slices or dims that do not agree.
use std::fmt;

/// A kernel refused its arguments (a slice shorter than its dims say, a label out of range …).
/// Kernels check before they touch memory, so an `Err` means nothing was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

/// Result of a kernel call.
pub type KResult = Result<(), KernelError>;

/// Checks that `slice_len >= need`, naming the argument in the error.
pub fn check_len(what: &str, slice_len: usize, need: usize) -> KResult {
    check_len_with(|| what.to_string(), slice_len, need)
}

/// [`check_len`], naming the slice only when it is short: a kernel that passes its checks
/// allocates nothing (the GEMM heap model counts the `gemm` crate's buffers alone, and a name
/// formatted on every call would outweigh a small product's).
pub fn check_len_with(what: impl FnOnce() -> String, slice_len: usize, need: usize) -> KResult {
    if slice_len < need {
        Err(KernelError(format!(
            "{}: slice holds {slice_len} elements, the dims need {need}",
            what()
        )))
    } else {
        Ok(())
    }
}
