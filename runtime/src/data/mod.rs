//! Datasets: where training batches come from.
//!
//! [`idx`] reads the IDX format MNIST ships in (plain or gzipped) and embeds a
//! small real MNIST subset, so examples train out of the box with no download;
//! [`image_folder`] streams a folder of JPEG and PNG images, one subfolder per class, decoded
//! ([`image`]) by a pool of background workers ([`prefetch`]).

pub mod dataset;
pub mod digits_folder;
pub mod idx;
pub mod image;
pub mod image_folder;
pub mod prefetch;
