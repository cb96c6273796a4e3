//! `RuntimeError`: everything that can go wrong once a model runs, each with a message that
//! names what was wrong and the numbers.

use std::fmt;

use memwise_kernels::KernelError;
use memwise_plan::PlanError;

#[derive(Debug)]
pub enum RuntimeError {
    /// Re-planning failed (another batch size, a budget search).
    Plan(PlanError),
    /// A kernel refused its arguments.
    Kernel {
        step: u32,
        op: &'static str,
        layer: String,
        error: KernelError,
    },
    /// An input batch does not match the model's inputs.
    Input(String),
    /// One sample of an input batch is invalid (a non-finite value, a label out of range).
    /// `sample` counts in the batch given to a step; `fit`, `evaluate` and `predict` turn it
    /// into the dataset's index and say where in `context`.
    InputSample {
        input: String,
        sample: usize,
        problem: String,
        context: String,
    },
    /// The plan does not fit the device (or its memory limit).
    OutOfMemory {
        needed: u64,
        available: u64,
        device: String,
    },
    /// An allocation or view failed.
    Memory(String),
    /// Training produced a non-finite value.
    NonFinite(String),
    /// Weights or checkpoints could not be read or written.
    Io(String),
    /// The device is not usable (no CUDA library, no GPU …).
    Device(String),
}

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuntimeError::Plan(e) => write!(f, "planning failed: {e}"),
            RuntimeError::Kernel { step, op, layer, error } => {
                write!(f, "step {step} ({op} of layer `{layer}`): {error}")
            }
            RuntimeError::Input(m) | RuntimeError::Memory(m) | RuntimeError::NonFinite(m) => f.write_str(m),
            RuntimeError::InputSample { input, sample, problem, context } => {
                write!(f, "input `{input}`: sample {sample} {problem}{context}")
            }
            RuntimeError::Io(m) => write!(f, "i/o: {m}"),
            RuntimeError::Device(m) => write!(f, "device: {m}"),
            RuntimeError::OutOfMemory { needed, available, device } => write!(
                f,
                "the model needs {} but {device} has {} available ({} short); nothing was allocated",
                memwise_plan::advice::format_bytes(*needed),
                memwise_plan::advice::format_bytes(*available),
                memwise_plan::advice::format_bytes(needed.saturating_sub(*available)),
            ),
        }
    }
}

impl RuntimeError {
    /// The input given was refused (before anything ran or changed).
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            RuntimeError::Input(_) | RuntimeError::InputSample { .. }
        )
    }
}

impl std::error::Error for RuntimeError {}

impl From<PlanError> for RuntimeError {
    fn from(e: PlanError) -> Self {
        RuntimeError::Plan(e)
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
