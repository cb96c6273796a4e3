//! Datasets: where training batches come from.
//!
//! [`idx`] reads the IDX format MNIST ships in (plain or gzipped) and embeds a
//! small real MNIST subset, so examples train out of the box with no download.

pub mod dataset;
pub mod idx;
