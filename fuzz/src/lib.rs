//! Shared by the fuzz targets: the byte decoders (the same file the property tests use, so a
//! crash found here replays in `runtime/tests/robustness.rs`), the fixed models, and the body
//! both file-loader targets run.

#[path = "../../runtime/tests/support/decode.rs"]
pub mod decode;
pub mod loader;
