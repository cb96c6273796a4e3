//! Everything a model file and its training code need: the layer handle types, the `Model`
//! trait, the device, the trainer and its options, in-memory datasets and the image folder
//! loader.
pub use crate::layers::*;
pub use crate::runtime::data::dataset::{Column, Dataset, InMemory};
pub use crate::runtime::{
    Device, EpochLog, Evaluation, FitOptions, History, MemoryCallback, RuntimeError, Trainer,
};
pub use crate::Model;
pub use memwise_runtime::data::image_folder::ImageFolder;
