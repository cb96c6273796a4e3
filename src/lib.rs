//! memwise: declare a model as an annotated struct; the compiler plans its memory.
pub mod layers;
pub mod prelude;
pub mod summary;

pub use memwise_macros::{block, model};
pub use memwise_plan as plan;
pub use memwise_runtime as runtime;

#[doc(hidden)]
pub use memwise_macros::__model_continue;

use plan::{MemoryReport, ModelSpec, PlanError, StaticPlan};

/// What `#[memwise::model]` implements for a model struct (the same items are inherent, so
/// `MyNet::MEMORY` needs no import). The runtime is generic over it.
pub trait Model: Sized {
    /// The static plan of one training step.
    const PLAN: StaticPlan;
    /// Where its memory goes.
    const MEMORY: MemoryReport;
    /// Number of parameters.
    const PARAMS: u64;
    /// The model as declared.
    fn spec() -> ModelSpec;
    /// The layer handles.
    fn layers() -> Self;
    /// The plan at another batch size.
    fn plan_for_batch(batch: usize) -> Result<StaticPlan, PlanError> {
        plan::plan(&Self::spec().with_batch(batch))
    }
    /// The Keras-like summary table.
    fn summary() -> String {
        summary::table(&Self::PLAN)
    }
}

#[doc(hidden)]
pub mod __private {
    //! Helpers for generated code (not a public API).
    use crate::plan::{DType, LayerKind, LayerSpec};

    pub fn layer(name: &str, kind: LayerKind, inputs: &[&str], dtype: Option<DType>, checkpoint: Option<u32>) -> LayerSpec {
        LayerSpec {
            name: name.to_string(),
            kind,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            dtype,
            checkpoint,
        }
    }
}
