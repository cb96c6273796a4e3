//! Shared by the fuzz targets: the byte decoders (the same file the property tests use, so a
//! crash found here replays in `runtime/tests/robustness.rs`) and the fixed models.

#[path = "../../runtime/tests/support/decode.rs"]
pub mod decode;
