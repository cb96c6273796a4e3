//! memwise: declare a model as an annotated struct; the compiler plans its memory.
pub use memwise_macros::model;
pub use memwise_plan as plan;
pub use memwise_runtime as runtime;
