//! Everything a model file needs: the layer handle types and the `Model` trait.
pub use crate::layers::*;
pub use crate::Model;
