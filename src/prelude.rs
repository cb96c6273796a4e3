//! Everything a model file needs: the layer handle types, the `Model` trait, and the image
//! folder loader.
pub use crate::layers::*;
pub use crate::Model;
pub use memwise_runtime::data::image_folder::ImageFolder;
