//! Weight initialisation as Keras does it, seeded: Glorot-uniform kernels, zero biases,
//! norm scales 1 and shifts 0, running variance 1, embeddings uniform in ±0.05.

use memwise_kernels::random::uniform;
use memwise_plan::StaticPlan;

use crate::error::Result;
use crate::memory::Region;

/// How one parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Uniform in `[-limit, limit]`.
    Uniform(f32),
}

/// Keras's initialiser for a parameter, from its name, shape and layer kind.
pub fn initializer(name: &str, shape: &[usize], layer_kind: &str) -> Init {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    match (layer_kind, leaf) {
        (_, "bias") | (_, "running_mean") => Init::Zeros,
        (_, "running_var") => Init::Ones,
        ("batch_norm" | "layer_norm", "weight") => Init::Ones,
        ("embedding", _) => Init::Uniform(0.05),
        _ => Init::Uniform(glorot_limit(shape)),
    }
}

/// `sqrt(6 / (fan_in + fan_out))` with Keras's fans: the last two axes times the
/// receptive field (the product of the others).
pub fn glorot_limit(shape: &[usize]) -> f32 {
    let (fan_in, fan_out) = match shape.len() {
        0 => (1, 1),
        1 => (shape[0], shape[0]),
        n => {
            let rf: usize = shape[..n - 2].iter().product();
            (shape[n - 2] * rf, shape[n - 1] * rf)
        }
    };
    (6.0 / (fan_in + fan_out).max(1) as f32).sqrt()
}

/// Writes every parameter's initial values. Parameter `i` draws from the stream keyed by
/// `seed` and `i`, so a model's initial weights depend on nothing but the seed.
pub fn initialise(plan: &StaticPlan, persistent: &mut Region, seed: u64) -> Result<()> {
    for (i, p) in plan.params.iter().enumerate() {
        let kind = plan
            .memory
            .layers
            .iter()
            .find(|l| l.name == p.layer)
            .map(|l| l.kind.as_ref())
            .unwrap_or("");
        let init = initializer(&p.name, &p.shape, kind);
        // SAFETY: &mut region: no other view is live.
        let v = unsafe { persistent.view_mut::<f32>(p.offset, p.elems())? };
        match init {
            Init::Zeros => v.fill(0.0),
            Init::Ones => v.fill(1.0),
            Init::Uniform(limit) => {
                let key = seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1));
                for (j, x) in v.iter_mut().enumerate() {
                    *x = (2.0 * uniform(key, j as u64) - 1.0) * limit;
                }
            }
        }
    }
    Ok(())
}
