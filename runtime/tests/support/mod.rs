//! Helpers shared by the integration tests (and, through `#[path]`, by the fuzz targets).

pub mod decode;
pub mod replicas;
