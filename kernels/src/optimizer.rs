//! Optimizer updates (SGD, SGD + momentum/Nesterov, RMSprop, Adam, AdamW) on f32 master
//! parameters, and the dynamic loss scaler's state machine.
//!
//! Every update is in place on `params` and its state slices, reads f32 gradients multiplied by
//! `grad_unscale` (= `1 / loss_scale`, or 1), and follows Keras 3's `update_step` formulas and
//! defaults operation for operation (cited per optimizer). State slots are passed in
//! (`Optimizer::state_slots()` of them, each as long as `params`) and start at zero.
//!
//! Skipped steps: when any gradient of a step is non-finite, the runtime must not call
//! `update` at all (check every gradient with [`crate::elementwise::all_finite`], tell
//! [`LossScaler::update`], and obey its [`StepDecision`]). Params and state then stay
//! bit-identical, and the `step` passed to Adam counts applied updates only, as Keras's inner
//! optimizer's `iterations` does under `LossScaleOptimizer`.

use rayon::prelude::*;

use crate::elementwise::{PAR_CHUNK, PAR_MIN};
use crate::{KResult, KernelError};

/// One optimizer: how many state slices per parameter, and the update.
pub trait Optimizer {
    /// State slices per parameter tensor (each `params.len()` long, zero-initialised).
    fn state_slots(&self) -> usize;

    /// Applies one update in place. `step` is the 1-based number of this update (Keras's
    /// `iterations + 1`; only Adam-family optimizers read it). `grads` are multiplied by
    /// `grad_unscale` before use.
    fn update(
        &self,
        step: u64,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [&mut [f32]],
        grad_unscale: f32,
    ) -> KResult;
}

fn check_args(
    op: &str,
    slots: usize,
    params: &[f32],
    grads: &[f32],
    state: &[&mut [f32]],
) -> KResult {
    if grads.len() != params.len() {
        return Err(KernelError(format!(
            "{op}: {} gradients for {} parameters",
            grads.len(),
            params.len()
        )));
    }
    if state.len() != slots {
        return Err(KernelError(format!(
            "{op}: needs {slots} state slices, got {}",
            state.len()
        )));
    }
    for (k, s) in state.iter().enumerate() {
        if s.len() != params.len() {
            return Err(KernelError(format!(
                "{op}: state slot {k} holds {} values for {} parameters",
                s.len(),
                params.len()
            )));
        }
    }
    Ok(())
}

/// An optimizer as one rule per parameter element, from which its [`Optimizer`] impl comes:
/// the update checks the slices, then runs the rule of this step on every element.
trait ElementwiseUpdate {
    /// The optimizer's name in errors.
    const NAME: &'static str;

    /// [`Optimizer::state_slots`].
    fn slots(&self) -> usize;

    /// The rule of update number `step` on one parameter, its gradient (not yet multiplied by
    /// `grad_unscale`) and its state slots; an error refuses the whole update.
    fn rule(&self, step: u64, grad_unscale: f32) -> Result<impl Rule, KernelError>;
}

/// The update of one parameter element `p` from its gradient `g` and its state slots (the
/// missing ones dummies the rule does not use).
trait Rule: Fn(&mut f32, f32, &mut [f32; 3]) + Sync + Send {}

impl<F: Fn(&mut f32, f32, &mut [f32; 3]) + Sync + Send> Rule for F {}

impl<O: ElementwiseUpdate> Optimizer for O {
    fn state_slots(&self) -> usize {
        self.slots()
    }

    fn update(
        &self,
        step: u64,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [&mut [f32]],
        grad_unscale: f32,
    ) -> KResult {
        check_args(O::NAME, self.slots(), params, grads, state)?;
        for_each_param(params, grads, state, self.rule(step, grad_unscale)?);
        Ok(())
    }
}

/// `Default` is Keras's defaults, `Self::KERAS`.
macro_rules! keras_default {
    ($($ty:ty),*) => {$(
        impl Default for $ty {
            fn default() -> Self {
                Self::KERAS
            }
        }
    )*};
}

/// Runs `f(p, g, s0, s1, s2)` on each element, in parallel chunks for large tensors. Missing
/// slots get a dummy that `f` must not use.
fn for_each_param(
    params: &mut [f32],
    grads: &[f32],
    state: &mut [&mut [f32]],
    f: impl Fn(&mut f32, f32, &mut [f32; 3]) + Sync + Send,
) {
    // One loop per slot count, over zipped slices: the per-element state array is then a
    // local the compiler keeps in registers, and the loop vectorises (a gather over a
    // runtime number of slots, with indexed access, did not: 4× slower on the MLP's update).
    // Same arithmetic per element, so the results are bit-identical either way.
    let body = |base: usize, p: &mut [f32], s: &mut [&mut [f32]]| {
        let g = &grads[base..base + p.len()];
        match s {
            [] => {
                for (pv, &gv) in p.iter_mut().zip(g) {
                    let mut st = [0f32; 3];
                    f(pv, gv, &mut st);
                }
            }
            [a] => {
                for ((pv, &gv), av) in p.iter_mut().zip(g).zip(a.iter_mut()) {
                    let mut st = [*av, 0.0, 0.0];
                    f(pv, gv, &mut st);
                    *av = st[0];
                }
            }
            [a, b] => {
                for (((pv, &gv), av), bv) in p.iter_mut().zip(g).zip(a.iter_mut()).zip(b.iter_mut())
                {
                    let mut st = [*av, *bv, 0.0];
                    f(pv, gv, &mut st);
                    (*av, *bv) = (st[0], st[1]);
                }
            }
            [a, b, c, ..] => {
                let abc = a.iter_mut().zip(b.iter_mut()).zip(c.iter_mut());
                for ((pv, &gv), ((av, bv), cv)) in p.iter_mut().zip(g).zip(abc) {
                    let mut st = [*av, *bv, *cv];
                    f(pv, gv, &mut st);
                    (*av, *bv, *cv) = (st[0], st[1], st[2]);
                }
            }
        }
    };
    if params.len() >= PAR_MIN {
        par_chunked(params, state, &body);
    } else {
        body(0, params, state);
    }
}

/// Parallel driver: cuts params and each (up to 3) state slice into the same chunks.
fn par_chunked(
    params: &mut [f32],
    state: &mut [&mut [f32]],
    body: &(impl Fn(usize, &mut [f32], &mut [&mut [f32]]) + Sync),
) {
    match state {
        [] => params
            .par_chunks_mut(PAR_CHUNK)
            .enumerate()
            .for_each(|(k, p)| body(k * PAR_CHUNK, p, &mut [])),
        [a] => params
            .par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks_mut(PAR_CHUNK))
            .enumerate()
            .for_each(|(k, (p, a))| body(k * PAR_CHUNK, p, &mut [a])),
        [a, b] => params
            .par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks_mut(PAR_CHUNK))
            .zip(b.par_chunks_mut(PAR_CHUNK))
            .enumerate()
            .for_each(|(k, ((p, a), b))| body(k * PAR_CHUNK, p, &mut [a, b])),
        [a, b, c] => params
            .par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks_mut(PAR_CHUNK))
            .zip(b.par_chunks_mut(PAR_CHUNK))
            .zip(c.par_chunks_mut(PAR_CHUNK))
            .enumerate()
            .for_each(|(k, (((p, a), b), c))| body(k * PAR_CHUNK, p, &mut [a, b, c])),
        _ => unreachable!("at most 3 state slots (checked by every caller)"),
    }
}

// ---------------------------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------------------------

/// Keras `SGD` (keras/src/optimizers/sgd.py):
/// without momentum `p −= lr·g`; with momentum `m = momentum·m − lr·g`, then `p += m`, or with
/// Nesterov `p += momentum·m − lr·g` (using the new `m`). 1 state slot (`m`) when
/// `momentum != 0`, else 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    pub learning_rate: f32,
    pub momentum: f32,
    pub nesterov: bool,
}

impl Sgd {
    /// Keras default learning rate.
    pub const DEFAULT_LEARNING_RATE: f32 = 0.01;
    /// The momentum used when a model asks for "SGD with momentum" without a value. (Keras's
    /// own default momentum is 0.0, i.e. plain SGD.)
    pub const DEFAULT_MOMENTUM: f32 = 0.9;

    /// `SGD()` as Keras builds it: lr 0.01, no momentum.
    pub fn keras_default() -> Self {
        Sgd {
            learning_rate: Self::DEFAULT_LEARNING_RATE,
            momentum: 0.0,
            nesterov: false,
        }
    }

    /// SGD with momentum 0.9 (lr 0.01), optionally Nesterov.
    pub fn with_momentum(nesterov: bool) -> Self {
        Sgd {
            momentum: Self::DEFAULT_MOMENTUM,
            nesterov,
            ..Self::keras_default()
        }
    }
}

impl Default for Sgd {
    fn default() -> Self {
        Self::keras_default()
    }
}

impl ElementwiseUpdate for Sgd {
    const NAME: &'static str = "sgd";

    fn slots(&self) -> usize {
        (self.momentum != 0.0) as usize
    }

    fn rule(&self, _step: u64, grad_unscale: f32) -> Result<impl Rule, KernelError> {
        let (lr, mom, nesterov) = (self.learning_rate, self.momentum, self.nesterov);
        Ok(move |p: &mut f32, g: f32, s: &mut [f32; 3]| {
            // Every value computed, then chosen, so that the loop vectorises (as RMSprop's).
            let g = g * grad_unscale;
            let v = s[0] * mom - g * lr;
            s[0] = if mom == 0.0 { s[0] } else { v };
            *p = if mom == 0.0 {
                *p - g * lr
            } else if nesterov {
                *p + (v * mom - g * lr)
            } else {
                *p + v
            };
        })
    }
}

// ---------------------------------------------------------------------------------------------
// RMSprop
// ---------------------------------------------------------------------------------------------

/// Keras `RMSprop` (keras/src/optimizers/rmsprop.py):
/// `v = rho·v + (1 − rho)·g²`; centered: `a = rho·a + (1 − rho)·g`, `den = v − a² + ε`,
/// else `den = v + ε` (ε *inside* the square root, unlike Adam); `inc = lr·g / sqrt(den)`;
/// with momentum `mom = momentum·mom + inc`, `p −= mom`, else `p −= inc`.
/// State slots, in order: `v`, then `mom` if `momentum > 0`, then `a` if `centered`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsProp {
    pub learning_rate: f32,
    pub rho: f32,
    pub momentum: f32,
    pub epsilon: f32,
    pub centered: bool,
}

impl RmsProp {
    /// Keras defaults: lr 1e-3, rho 0.9, momentum 0, epsilon 1e-7, centered false.
    pub const KERAS: RmsProp = RmsProp {
        learning_rate: 1e-3,
        rho: 0.9,
        momentum: 0.0,
        epsilon: 1e-7,
        centered: false,
    };
}

keras_default!(RmsProp, Adam, AdamW);

impl ElementwiseUpdate for RmsProp {
    const NAME: &'static str = "rmsprop";

    fn slots(&self) -> usize {
        1 + (self.momentum > 0.0) as usize + self.centered as usize
    }

    fn rule(&self, _step: u64, grad_unscale: f32) -> Result<impl Rule, KernelError> {
        let o = *self;
        let use_mom = o.momentum > 0.0;
        Ok(move |p: &mut f32, g: f32, s: &mut [f32; 3]| {
            let g = g * grad_unscale;
            s[0] = o.rho * s[0] + (1.0 - o.rho) * (g * g);
            // Every value computed, then chosen: branches here kept the loop scalar, 4× slower
            // than Adam's (the slots a variant does not use are dummies or left as they were).
            // The gradient average's slot is 2 after a momentum, else 1.
            let avg = o.rho * (if use_mom { s[2] } else { s[1] }) + (1.0 - o.rho) * g;
            let den = if o.centered {
                s[0] - avg * avg + o.epsilon
            } else {
                s[0] + o.epsilon
            };
            let inc = o.learning_rate * g / den.sqrt();
            let mom = o.momentum * s[1] + inc;
            s[2] = if use_mom && o.centered { avg } else { s[2] };
            s[1] = match (use_mom, o.centered) {
                (true, _) => mom,
                (false, true) => avg,
                (false, false) => s[1],
            };
            *p -= if use_mom { mom } else { inc };
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW
// ---------------------------------------------------------------------------------------------

/// Keras `Adam` (keras/src/optimizers/adam.py), with `t = step`:
/// `alpha = lr · sqrt(1 − beta_2^t) / (1 − beta_1^t)`, `m += (g − m)(1 − beta_1)`,
/// `v += (g² − v)(1 − beta_2)`, `p −= alpha · m / (sqrt(v) + ε)` — the bias correction folded
/// into the step size, and ε added to the *uncorrected* `sqrt(v)` ("epsilon hat").
/// State slots: `m`, `v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adam {
    pub learning_rate: f32,
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
}

impl Adam {
    /// Keras defaults: lr 1e-3, beta_1 0.9, beta_2 0.999, epsilon 1e-7.
    pub const KERAS: Adam = Adam {
        learning_rate: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };

    fn alpha(&self, op: &str, step: u64) -> Result<f32, KernelError> {
        if step == 0 {
            return Err(KernelError(format!(
                "{op}: step is 1-based (Keras iterations + 1); got 0"
            )));
        }
        // Powers in f64: beta_2^t for large t is where f32 would lose digits.
        let t = step.min(i32::MAX as u64) as i32;
        let b1 = 1.0 - (self.beta_1 as f64).powi(t);
        let b2 = 1.0 - (self.beta_2 as f64).powi(t);
        Ok((self.learning_rate as f64 * b2.sqrt() / b1) as f32)
    }

    /// The element rule of Adam update number `step` (`name` in its errors), after the
    /// decoupled weight decay `p −= p·decay` (`decay = wd·lr`; 0 for plain Adam).
    fn decayed_rule(
        &self,
        name: &str,
        step: u64,
        grad_unscale: f32,
        decay: f32,
    ) -> Result<impl Rule, KernelError> {
        let o = *self;
        let alpha = self.alpha(name, step)?;
        Ok(move |p: &mut f32, g: f32, s: &mut [f32; 3]| {
            let g = g * grad_unscale;
            // Decoupled weight decay first, as Keras's base optimizer applies it before
            // update_step: p = p − p·wd·lr.
            if decay != 0.0 {
                *p -= *p * decay;
            }
            s[0] += (g - s[0]) * (1.0 - o.beta_1);
            s[1] += (g * g - s[1]) * (1.0 - o.beta_2);
            *p -= alpha * s[0] / (s[1].sqrt() + o.epsilon);
        })
    }
}

impl ElementwiseUpdate for Adam {
    const NAME: &'static str = "adam";

    fn slots(&self) -> usize {
        2
    }

    fn rule(&self, step: u64, grad_unscale: f32) -> Result<impl Rule, KernelError> {
        self.decayed_rule(Self::NAME, step, grad_unscale, 0.0)
    }
}

/// Keras `AdamW`: [`Adam`] plus decoupled weight decay `p −= p · weight_decay · lr`, applied
/// before the Adam step (Keras's `_apply_weight_decay` runs before `update_step`).
/// Default weight decay 0.004. State slots: `m`, `v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub adam: Adam,
    pub weight_decay: f32,
}

impl AdamW {
    /// Keras defaults: Adam's, plus weight_decay 0.004.
    pub const KERAS: AdamW = AdamW {
        adam: Adam::KERAS,
        weight_decay: 0.004,
    };
}

impl ElementwiseUpdate for AdamW {
    const NAME: &'static str = "adamw";

    fn slots(&self) -> usize {
        self.adam.slots()
    }

    fn rule(&self, step: u64, grad_unscale: f32) -> Result<impl Rule, KernelError> {
        let decay = self.weight_decay * self.adam.learning_rate;
        self.adam
            .decayed_rule(Self::NAME, step, grad_unscale, decay)
    }
}

// ---------------------------------------------------------------------------------------------
// dynamic loss scaling
// ---------------------------------------------------------------------------------------------

/// What to do with the step whose gradients were just checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepDecision {
    /// Gradients are finite: run the optimizer with this `grad_unscale` (= 1 / the scale the
    /// step's loss was multiplied by).
    Apply { grad_unscale: f32 },
    /// Some gradient overflowed: do not touch params or optimizer state; the scale was halved.
    Skip,
}

/// Dynamic loss scaling, Keras 3 `LossScaleOptimizer` semantics: multiply the loss gradient by
/// [`LossScaler::scale`] (pass it as the loss kernels' `grad_scale`); after the backward, call
/// [`LossScaler::update`] with whether any gradient is non-finite.
///
/// - finite: apply with `1/scale`; count a good step; after `growth_interval` consecutive good
///   steps, `scale *= growth` (unless that overflows f32) and the count restarts;
/// - non-finite: skip, `scale *= backoff`, count restarts.
///
/// Initial scale 2^15 = 32768, Keras's `initial_scale` (PyTorch's `GradScaler` starts at
/// 2^16). Why 2^15: it is the largest power of two below f16's max (65504), so a loss gradient
/// of magnitude ~1 (e.g. `p − onehot` on an unreduced element) times the scale is still
/// representable in f16, whereas at 2^16 it is already inf and the first step is always
/// skipped. Starting high is still right — a too-high scale costs one skipped step per halving,
/// a too-low one costs `growth_interval` steps per doubling — and this matches the Keras
/// reference we test against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaler {
    pub scale: f32,
    pub growth_interval: u32,
    pub growth: f32,
    pub backoff: f32,
    /// Consecutive finite steps since the last change of scale.
    pub good_steps: u32,
    /// Consecutive skipped steps (a run that never stops skipping has a real NaN, not an
    /// overflow; the runtime can abort on it).
    pub skipped_in_a_row: u32,
}

impl LossScaler {
    /// Keras `LossScaleOptimizer.initial_scale`.
    pub const INITIAL_SCALE: f32 = 32768.0;
    /// Keras `dynamic_growth_steps` (= PyTorch `growth_interval`).
    pub const GROWTH_INTERVAL: u32 = 2000;
    /// Smallest scale the backoff goes to: halving past it would reach 0 and make the unscale
    /// factor infinite.
    pub const MIN_SCALE: f32 = f32::MIN_POSITIVE;

    /// Keras defaults: scale 2^15, interval 2000, growth 2, backoff 0.5.
    pub fn new() -> Self {
        LossScaler {
            scale: Self::INITIAL_SCALE,
            growth_interval: Self::GROWTH_INTERVAL,
            growth: 2.0,
            backoff: 0.5,
            good_steps: 0,
            skipped_in_a_row: 0,
        }
    }

    /// A scaler that never scales (f32 and bf16 training): scale 1, never grows; a non-finite
    /// step is still reported as `Skip` (and still backs off, which is harmless information).
    pub fn disabled() -> Self {
        LossScaler {
            scale: 1.0,
            growth_interval: u32::MAX,
            growth: 1.0,
            backoff: 1.0,
            ..Self::new()
        }
    }

    /// The factor for this step's loss gradient (`grad_scale` of the loss kernels).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Records the outcome of the step whose loss was scaled by the current scale.
    pub fn update(&mut self, found_inf: bool) -> StepDecision {
        if found_inf {
            self.scale = (self.scale * self.backoff).max(Self::MIN_SCALE);
            self.good_steps = 0;
            self.skipped_in_a_row = self.skipped_in_a_row.saturating_add(1);
            return StepDecision::Skip;
        }
        let grad_unscale = 1.0 / self.scale;
        self.skipped_in_a_row = 0;
        self.good_steps = self.good_steps.saturating_add(1);
        if self.good_steps >= self.growth_interval {
            let grown = self.scale * self.growth;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.good_steps = 0;
        }
        StepDecision::Apply { grad_unscale }
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new()
    }
}
