//! Everything a model file and its training code need: the layer handle types, the `Model`
//! trait, the device, the trainer and its options, and in-memory datasets.
pub use crate::layers::*;
pub use crate::runtime::data::dataset::{Column, Dataset, InMemory};
pub use crate::runtime::{
    Device, EpochLog, Evaluation, FitOptions, History, MemoryCallback, RuntimeError, Trainer,
};
pub use crate::Model;
