//! Weight initialisation, seeded: each parameter starts as its layer's catalogue entry
//! declares (`memwise_plan::layers`: Keras's Glorot-uniform kernels, zero biases, norm
//! scales 1 and shifts 0, running variance 1, embeddings uniform in ±0.05).

use memwise_kernels::random::uniform;
use memwise_plan::layers::{param_init, Fill};
use memwise_plan::{PlanError, StaticPlan};

use crate::error::{Result, RuntimeError};
use crate::memory::Region;

/// Writes every parameter's initial values. Parameter `id` draws from the stream keyed by
/// `seed` and `id` (its index among the model's parameters), so a model's initial weights
/// depend on nothing but the seed, and a pipeline stage's are the one-device model's.
pub fn initialise(plan: &StaticPlan, persistent: &mut Region, seed: u64) -> Result<()> {
    for p in plan.params.iter() {
        let i = p.id;
        let kind = plan
            .memory
            .layers
            .iter()
            .find(|l| l.name == p.layer)
            .map(|l| l.kind.as_ref())
            .unwrap_or("");
        let init = param_init(kind, &p.layer, &p.name).ok_or_else(|| {
            RuntimeError::Plan(PlanError::internal(format!(
                "parameter `{}` of `{kind}` layer `{}` is not in the layer catalogue, so it \
                 has no initialiser",
                p.name, p.layer
            )))
        })?;
        // SAFETY: &mut region: no other view is live.
        let v = unsafe { persistent.view_mut::<f32>(p.offset, p.elems())? };
        match init.fill(&p.shape) {
            Fill::Constant(c) => v.fill(c),
            Fill::Uniform(limit) => {
                let key = seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1));
                for (j, x) in v.iter_mut().enumerate() {
                    *x = (2.0 * uniform(key, j as u64) - 1.0) * limit;
                }
            }
        }
    }
    Ok(())
}
