//! The runtime: devices, memory regions, the executor that walks a static plan, weight
//! initialisation, and datasets.

pub mod collective;
pub mod cpu;
pub mod cpu_heap;
pub mod cuda;
pub mod data;
pub mod device;
pub mod engine;
pub mod error;
pub mod executor;
pub mod fit_device;
pub mod init;
pub mod kernels;
pub mod memory;
pub mod monitor;
pub mod plot;
pub mod reference;
pub mod report;
pub mod roofline;
pub mod stage;
pub mod train;
pub mod walk;
pub mod warm_up;
pub mod weights;

pub use device::Device;
pub use engine::Engine;
pub use error::{Result, RuntimeError};
pub use executor::{Batch, Executor, StepOutput};
pub use train::{
    Callback, EpochLog, Evaluation, FitOptions, History, HostBytes, MemoryCallback, Trainer,
};
