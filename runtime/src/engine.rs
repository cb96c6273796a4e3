//! `Engine`: the executor of a static plan as the [`crate::Trainer`] sees it — one generic
//! impl for the one walk ([`PlanExecutor`]) over any [`Kernels`]: the CPU [`Executor`] or a
//! GPU's [`GpuExecutor`](crate::cuda::GpuExecutor) — and [`build_engine`], which picks one for
//! a device.
//!
//! An engine runs training and evaluation steps, reads and writes parameters by name, saves
//! and loads weights and checkpoints, and builds an inference engine of its own kind for
//! another plan (what `evaluate` and `predict` run). Test hooks and what only one kind has
//! stay on the concrete type: the poisoning hook (`enable_poisoning`, on either executor), the
//! GPU kernels' graph switch (`executor.kernels_mut().set_graph(false)`). Reach them by
//! downcasting (`engine.downcast_ref::<Executor>()`) or, for the CPU executor, through
//! [`crate::Trainer::cpu_executor`].

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use memwise_plan::StaticPlan;

use crate::collective::Collective;
use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::executor::{Batch, Executor, StepOutput};
use crate::kernels::Kernels;
use crate::walk::PlanExecutor;
use crate::weights;

/// An executor of one static plan on one device. Object-safe: the trainer holds a
/// `Box<dyn Engine>`.
pub trait Engine: Any {
    /// Where it runs: `cpu`, `cuda:0 (NVIDIA H200)`, `emulated` …
    fn device_name(&self) -> String;
    fn plan(&self) -> &StaticPlan;
    /// The seed the weights were initialised from; it keys dropout and sampling.
    fn seed(&self) -> u64;
    /// Training steps run so far.
    fn step_counter(&self) -> u64;
    /// The dynamic loss scale (1.0 when loss scaling is off).
    fn loss_scale(&self) -> f32;
    /// One training step on `inputs` (one batch per model input, in declaration order).
    fn train_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput>;
    /// The forward and loss steps of an inference plan.
    fn evaluate_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput>;
    /// Turns CUDA graphs (a step recorded once, then replayed) on or off; nothing on the CPU.
    fn set_graphs(&mut self, on: bool);
    /// Starts timing every step of the plan ([`PlanExecutor::enable_profiling`]).
    fn enable_profiling(&mut self);
    /// Seconds spent per `(phase, op)` since profiling started, largest first.
    fn profile(&self) -> Vec<(String, f64)>;
    /// The prediction after the last step of an inference plan, as f32.
    fn read_prediction(&self, out: &mut [f32]) -> Result<()>;
    /// The f32 values of parameter `name` (`hidden.weight` …).
    fn param(&self, name: &str) -> Result<Vec<f32>>;
    /// The f32 gradient of trainable parameter `name` from the last step.
    fn grad(&self, name: &str) -> Result<Vec<f32>>;
    /// Overwrites parameter `name` (and its 16-bit copy, if it has one).
    fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()>;
    /// Copies every parameter (statistics included) from `other`, a model with the same
    /// parameters: names and shapes must match.
    fn copy_params_from(&mut self, other: &dyn Engine) -> Result<()> {
        copy_params(self, other)
    }
    /// A new engine of this kind (the CPU, or the same GPU backend) for `plan` on `device`,
    /// its weights initialised from this engine's seed (callers copy the trained ones in).
    fn inference_engine(&self, plan: StaticPlan, device: &Device) -> Result<Box<dyn Engine>>;
    /// Device memory in use now minus before this engine was built, in bytes: `Some` on a
    /// GPU that reports its memory (`cuMemGetInfo`), `None` on the CPU.
    fn device_bytes_used(&self) -> Option<u64>;
    /// Device memory of the engine's stream and cuBLAS handle and workspace, taken before
    /// the model and shared with its inference engines: `Some` on a GPU, `None` on the CPU.
    fn device_lane_bytes(&self) -> Option<u64>;
    /// Writes the weights as safetensors (see [`crate::weights`]).
    fn save_weights(&self, path: &Path) -> Result<()>;
    /// The bytes [`Engine::save_weights`] would write.
    fn weights_to_bytes(&self) -> Result<Vec<u8>>;
    /// Reads weights written by `save_weights` or `save_checkpoint` (checked first; on error
    /// the model is unchanged).
    fn load_weights(&mut self, path: &Path) -> Result<()>;
    /// Writes a training checkpoint: weights, optimizer state, seed, counters, loss scaler.
    fn save_checkpoint(&self, path: &Path) -> Result<()>;
    /// The bytes [`Engine::save_checkpoint`] would write.
    fn checkpoint_to_bytes(&self) -> Result<Vec<u8>>;
    /// Restores a checkpoint (checked first; on error the model is unchanged).
    fn load_checkpoint(&mut self, path: &Path) -> Result<()>;
    /// [`Engine::load_checkpoint`] from the bytes [`Engine::checkpoint_to_bytes`] gave.
    fn load_checkpoint_from_bytes(&mut self, bytes: &[u8]) -> Result<()>;
    /// Data parallel: makes this engine one replica of `c`'s job
    /// ([`PlanExecutor::set_collective`]).
    fn set_collective(&mut self, c: Arc<dyn Collective>) -> Result<()>;
    /// The data-parallel job this engine is a replica of, if any.
    fn collective(&self) -> Option<&dyn Collective>;
    /// Host bytes its collective holds for a pipeline stage's sends
    /// ([`PlanExecutor::send_buffer_bytes`]).
    fn send_buffer_bytes(&self) -> u64;
}

impl dyn Engine {
    /// The concrete executor, when it is a `T`.
    pub fn downcast_ref<T: Engine>(&self) -> Option<&T> {
        (self as &dyn Any).downcast_ref::<T>()
    }

    /// The concrete executor, when it is a `T`.
    pub fn downcast_mut<T: Engine>(&mut self) -> Option<&mut T> {
        (self as &mut dyn Any).downcast_mut::<T>()
    }
}

/// The engine for `plan` on `device`: the CPU [`Executor`], or on a CUDA device the CUDA
/// executor (feature `cuda`; without it a CUDA device is an `Err`, never a panic).
pub fn build_engine(plan: StaticPlan, device: &Device, seed: u64) -> Result<Box<dyn Engine>> {
    if device.is_cuda() {
        cuda_engine(plan, device, seed)
    } else {
        Ok(Box::new(Executor::new(plan, device, seed)?))
    }
}

#[cfg(feature = "cuda")]
fn cuda_engine(plan: StaticPlan, device: &Device, seed: u64) -> Result<Box<dyn Engine>> {
    Ok(Box::new(crate::cuda::GpuExecutor::on_cuda(
        plan, device, seed,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(_plan: StaticPlan, device: &Device, _seed: u64) -> Result<Box<dyn Engine>> {
    Err(RuntimeError::Device(format!(
        "{}: this build has no CUDA support (build with `--features cuda`)",
        device.name()
    )))
}

/// [`Engine::copy_params_from`] by name: checks that both models have the same parameters
/// (names and shapes, in order), then reads each from `src` and writes it to `dst`.
pub fn copy_params<E: Engine + ?Sized>(dst: &mut E, src: &dyn Engine) -> Result<()> {
    let (a, b) = (&dst.plan().params, &src.plan().params);
    if a.len() != b.len() {
        return Err(RuntimeError::Input(format!(
            "cannot copy weights: {} parameters here, {} there",
            a.len(),
            b.len()
        )));
    }
    for (a, b) in a.iter().zip(b.iter()) {
        if a.name != b.name || a.shape != b.shape {
            return Err(RuntimeError::Input(format!(
                "cannot copy weights: `{}` {:?} here, `{}` {:?} there",
                a.name,
                &a.shape[..],
                b.name,
                &b.shape[..]
            )));
        }
    }
    let names: Vec<String> = dst
        .plan()
        .params
        .iter()
        .map(|p| p.name.to_string())
        .collect();
    for name in names {
        let values = src.param(&name)?;
        dst.set_param(&name, &values)?;
    }
    Ok(())
}

impl<K: Kernels + 'static> Engine for PlanExecutor<K> {
    fn device_name(&self) -> String {
        self.kernels().device_name()
    }
    fn plan(&self) -> &StaticPlan {
        PlanExecutor::plan(self)
    }
    fn seed(&self) -> u64 {
        PlanExecutor::seed(self)
    }
    fn step_counter(&self) -> u64 {
        PlanExecutor::step_counter(self)
    }
    fn loss_scale(&self) -> f32 {
        PlanExecutor::loss_scale(self)
    }
    fn train_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        PlanExecutor::train_step(self, inputs)
    }
    fn set_graphs(&mut self, on: bool) {
        self.kernels_mut().set_graphs(on);
    }
    fn enable_profiling(&mut self) {
        PlanExecutor::enable_profiling(self)
    }
    fn profile(&self) -> Vec<(String, f64)> {
        PlanExecutor::profile(self)
    }
    fn evaluate_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        PlanExecutor::evaluate_step(self, inputs)
    }
    fn read_prediction(&self, out: &mut [f32]) -> Result<()> {
        PlanExecutor::read_prediction(self, out)
    }
    fn param(&self, name: &str) -> Result<Vec<f32>> {
        PlanExecutor::param(self, name)
    }
    fn grad(&self, name: &str) -> Result<Vec<f32>> {
        PlanExecutor::grad(self, name)
    }
    fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        PlanExecutor::set_param(self, name, values)
    }
    fn inference_engine(&self, plan: StaticPlan, device: &Device) -> Result<Box<dyn Engine>> {
        let k = self.kernels().another(plan, device, self.seed())?;
        Ok(Box::new(PlanExecutor::from_kernels(k, self.seed())))
    }
    fn device_bytes_used(&self) -> Option<u64> {
        PlanExecutor::device_bytes_used(self)
    }
    fn device_lane_bytes(&self) -> Option<u64> {
        PlanExecutor::device_lane_bytes(self)
    }
    fn save_weights(&self, path: &Path) -> Result<()> {
        weights::save_weights(self, path)
    }
    fn weights_to_bytes(&self) -> Result<Vec<u8>> {
        weights::weights_to_bytes(self)
    }
    fn load_weights(&mut self, path: &Path) -> Result<()> {
        weights::load_weights(self, path)
    }
    fn save_checkpoint(&self, path: &Path) -> Result<()> {
        weights::save_checkpoint(self, path)
    }
    fn checkpoint_to_bytes(&self) -> Result<Vec<u8>> {
        weights::checkpoint_to_bytes(self)
    }
    fn load_checkpoint(&mut self, path: &Path) -> Result<()> {
        weights::load_checkpoint(self, path)
    }
    fn load_checkpoint_from_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        weights::load_checkpoint_labelled(self, bytes, "checkpoint (in memory)")
    }
    fn set_collective(&mut self, c: Arc<dyn Collective>) -> Result<()> {
        PlanExecutor::set_collective(self, c)
    }
    fn collective(&self) -> Option<&dyn Collective> {
        PlanExecutor::collective(self)
    }
    fn send_buffer_bytes(&self) -> u64 {
        PlanExecutor::send_buffer_bytes(self)
    }
}
