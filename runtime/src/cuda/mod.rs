//! The CUDA side of the one walk of a plan: [`CudaKernels`] implements
//! [`crate::kernels::Kernels`] with device kernels and cuBLAS GEMMs, and [`GpuExecutor`] is the
//! walk over them ([`crate::walk::PlanExecutor`], the same one the CPU's [`crate::Executor`] is).
//!
//! - [`Backend`] (`backend.rs`): what the kernels need from a device — plain allocations,
//!   copies, kernel launches ([`memwise_kernels::cuda::KernelCall`]), mapped GEMMs
//!   ([`memwise_kernels::cublas_map`]) and graph capture.
//! - [`CudaKernels`] (here): the plan's memory on the device — ONE arena allocation and ONE
//!   persistent allocation, plus 256 bytes after the persistent region for [`MwScalars`] —,
//!   the step's frame (inputs, scalars, flags) and the CUDA graph: `run_steps` launches the
//!   first step eagerly, captures the second as a graph and replays it from then on.
//! - `ops.rs`: one method per op and phase, each the launches and GEMMs of that op at the
//!   planned offsets.
//! - [`trace`]: a backend that records a step's launches without running them, and the
//!   launch report's roofline of them (`examples/launch_report.rs`).
//! - [`device`] (feature `cuda`): the cudarc backend, and the per-process cache of opened
//!   devices behind [`crate::Device::cuda`].
//!
//! Values that change per step (loss scale, Adam's step size, the RNG step) and the step's
//! flags (non-finite, correct predictions, a label out of range) live in device memory
//! ([`MwScalars`]): `begin_step` uploads them, the loss, check and optimizer kernels read and
//! set them, `end_step` reads them back. Nothing a step launches changes between steps, so a
//! captured step replays. The one launch argument that can change is the RNG seed (a
//! checkpoint restores its own): writing the persistent region (loading weights or a
//! checkpoint) drops the graph, and the next step records a new one.
//!
//! The kernels are generic over the backend so that they are tested without a GPU:
//! `tests/cuda_emulated.rs` runs [`GpuExecutor`] over the host emulation of the kernels
//! (`memwise-cuda-emu`) and compares every model it trains with the CPU executor. Only
//! [`device`] needs the feature.
//!
//! Each op runs the same sequence as the CPU kernels (`crate::cpu`), with these documented
//! differences: GEMMs accumulate in f32 in cuBLAS's order; with 16-bit storage a GEMM's output
//! is rounded before its bias is added (the CPU adds the bias first: one more rounding);
//! embedding gradients are summed with atomics (order varies); non-finite losses (float32) and
//! out-of-range labels are found on the device and reported after the step, with the update
//! skipped as on the CPU.

mod backend;
mod ops;
pub mod trace;
mod update_table;

#[cfg(feature = "cuda")]
pub mod device;

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_kernels::cublas_map::{self as cm, GemmBuffers, Operand, RowGemm};
use memwise_kernels::cuda::launch::{Float, KArg, KernelCall, LaunchCfg, MwScalars, MwUpdateChunk};
use memwise_plan::{DType, Optimizer, StaticPlan, NONE, NO_OFFSET};

pub use backend::Backend;

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::executor::Batch;
use crate::kernels::{StepFlags, StepScalars};
use crate::memory::Region;
use crate::walk::PlanExecutor;

/// Runs training steps of one plan on a device: the one walk over [`CudaKernels`].
pub type GpuExecutor<B> = PlanExecutor<CudaKernels<B>>;

impl<B: Backend> PlanExecutor<CudaKernels<B>> {
    /// Allocates the plan's two regions on `backend` — after checking that they fit the
    /// device's free memory and `device.memory_limit` (an `Err` with the numbers, nothing
    /// allocated) — and initialises the weights exactly as the CPU executor does for `seed`.
    pub fn new(plan: StaticPlan, device: &Device, backend: B, seed: u64) -> Result<Self> {
        Ok(PlanExecutor::from_kernels(
            CudaKernels::new(plan, device, backend, seed)?,
            seed,
        ))
    }

    pub fn backend(&self) -> &B {
        self.kernels().backend()
    }
}

fn dev(e: String) -> RuntimeError {
    RuntimeError::Device(e)
}

/// Where the step's loss values are gathered in the scalars block, after [`MwScalars`]: the
/// end of a step copies each loss value there (in the graph when capturing), so that the
/// flags, the correct count and every loss come back in one device-to-host copy, one wait per
/// step.
const LOSSES_AT: u64 = std::mem::size_of::<MwScalars>().next_multiple_of(16) as u64;

/// Where the multi-tensor optimizer's chunk table ([`update_table`]) starts in the scalars
/// block, after the loss values.
pub(crate) fn update_table_at(plan: &StaticPlan) -> u64 {
    (LOSSES_AT + 4 * plan.losses.len() as u64).next_multiple_of(8)
}

/// Bytes an executor of `plan` allocates after its persistent region for [`MwScalars`], the
/// plan's loss values and the optimizer's chunk table: with the two regions, all the device
/// memory it takes.
pub fn scalars_bytes(plan: &StaticPlan) -> u64 {
    scalars_block_bytes(plan, update_table::update_table(plan, 0, 0).chunks.len())
}

/// [`scalars_bytes`] for a chunk table of `chunks` entries.
fn scalars_block_bytes(plan: &StaticPlan, chunks: usize) -> u64 {
    let chunk = std::mem::size_of::<MwUpdateChunk>() as u64;
    (update_table_at(plan) + chunks as u64 * chunk).next_multiple_of(256)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Graph {
    /// No graph: every step launches its kernels (the first step always does).
    Eager,
    /// The step is captured; steps replay it.
    Captured,
    /// The backend cannot capture.
    Unsupported,
    /// A capture failed (its error is kept in `capture_error`): every step runs eagerly from
    /// then on, rather than failing again at each step.
    Failed,
}

/// A plan's memory on a device and the CUDA kernels over it.
pub struct CudaKernels<B: Backend> {
    plan: StaticPlan,
    backend: B,
    arena: u64,
    persistent: u64,
    scalars: u64,
    /// Byte range of the gradients in the persistent region.
    grads_range: (u64, u64),
    /// Each update step's `(first, count)` in the optimizer's chunk table, which starts at
    /// `update_table` (in the scalars block).
    update_steps: std::collections::BTreeMap<u32, (usize, usize)>,
    update_table: u64,
    /// The replica whose shards the chunk table updates (ZeRO stage 1; 0 otherwise).
    update_rank: usize,
    /// The arena's padding, poisoned before each launch once the poisoned-arena test began.
    padding: std::sync::OnceLock<Vec<(u64, u64)>>,
    /// The running step's scalars (set by `begin_step`).
    step: StepScalars,
    graph: Graph,
    use_graph: bool,
    /// Device bytes in use before the model's allocations (for the measured peak).
    used_before: Option<u64>,
    /// Steps whose launches were replayed from the graph.
    graph_replays: u64,
    /// Steps this executor launched eagerly. A capture waits for one: the first launches
    /// load the kernels' functions and cuBLAS's kernels (lazily, with CUDA's lazy loading),
    /// which must not happen inside a capture — also when a checkpoint's step counter says
    /// training is far along.
    eager_steps: u64,
    /// The first capture's error, when one failed.
    capture_error: Option<String>,
    /// Synchronise after every launch and GEMM, so that an asynchronous device error (an
    /// illegal address, which is sticky: every later call fails too) is reported by the
    /// kernel that caused it, with its step, instead of by a later call. Slow; no graph.
    sync_each_launch: bool,
}

/// The environment variable that turns [`CudaKernels::set_sync_each_launch`] on for every
/// engine of the process (`MEMWISE_CUDA_SYNC=1`): the GPU self-check's way to name a failing
/// kernel.
pub const SYNC_ENV: &str = "MEMWISE_CUDA_SYNC";

impl<B: Backend> CudaKernels<B> {
    /// Allocates the plan's two regions on `backend` (see [`GpuExecutor::new`]) and uploads
    /// the weights, initialised on the host exactly as the CPU kernels initialise them.
    pub fn new(plan: StaticPlan, device: &Device, mut backend: B, seed: u64) -> Result<Self> {
        // The optimizer's chunk table: its size counts now (built at address 0, which gives
        // the same chunks), its addresses once the persistent region is allocated. Rank 0's
        // (its shards are the longest): `set_replica` rebuilds it for another.
        let mut table = update_table::update_table(&plan, 0, 0);
        let scalars_bytes = scalars_block_bytes(&plan, table.chunks.len());
        let total = plan.persistent_bytes + scalars_bytes + plan.arena_bytes;
        let mem = backend.memory();
        // What the device has free for the plan: its free memory less the headroom for what
        // the device allocates after this check (so that a model that starts does not run out).
        let free = mem.map(|(free, _)| free.saturating_sub(backend.headroom()));
        let available = match (device.memory_limit, free) {
            (Some(l), Some(free)) => Some(l.min(free)),
            (l, free) => l.or(free),
        };
        if let Some(avail) = available {
            if total > avail {
                return Err(RuntimeError::OutOfMemory {
                    needed: total,
                    available: avail,
                    device: backend.name(),
                });
            }
        }
        let used_before = mem.map(|(free, t)| t - free);
        // Weights: initialised on the host exactly as the CPU executor does, then uploaded.
        let mut host = Region::new(
            plan.persistent_bytes as usize,
            "persistent region (host copy)",
        )?;
        crate::init::initialise(&plan, &mut host, seed)?;
        refresh_half_copies(&plan, &mut host)?;
        let persistent = backend
            .alloc((plan.persistent_bytes + scalars_bytes) as usize)
            .map_err(dev)?;
        let arena = backend.alloc(plan.arena_bytes as usize).map_err(dev)?;
        table = update_table::update_table(&plan, persistent, 0);
        let table_at = persistent + plan.persistent_bytes + update_table_at(&plan);
        // SAFETY: the persistent allocation holds persistent_bytes, then the scalars block,
        // which has room for the table (scalars_bytes).
        unsafe {
            backend.upload(host.bytes(), persistent).map_err(dev)?;
            backend
                .upload(slice_bytes(&table.chunks), table_at)
                .map_err(dev)?;
        }
        let grads_range = plan.grads_range();
        backend
            .reserve_input_staging(Self::input_bytes(&plan))
            .map_err(dev)?;
        backend.synchronize().map_err(dev)?;
        Ok(CudaKernels {
            scalars: persistent + plan.persistent_bytes,
            plan,
            backend,
            arena,
            persistent,
            grads_range,
            update_steps: table.steps,
            update_table: table_at,
            update_rank: 0,
            step: StepScalars {
                step: 0,
                loss_scale: 1.0,
                grad_unscale: 1.0,
                update: 1,
            },
            graph: Graph::Eager,
            use_graph: true,
            used_before,
            graph_replays: 0,
            eager_steps: 0,
            capture_error: None,
            padding: std::sync::OnceLock::new(),
            sync_each_launch: std::env::var(SYNC_ENV).is_ok_and(|v| v == "1"),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether steps after the first are captured once as a CUDA graph and replayed (on by
    /// default). Turning it off drops a captured graph.
    pub fn set_graph(&mut self, on: bool) {
        self.use_graph = on;
        if !on && self.graph == Graph::Captured {
            self.backend.clear_graph();
            self.graph = Graph::Eager;
        }
    }

    /// Whether every launch and GEMM is followed by a synchronisation that names the kernel
    /// in a device error (default: `MEMWISE_CUDA_SYNC=1`). On, steps are never captured (a
    /// capture cannot synchronise), and a captured graph is dropped.
    pub fn set_sync_each_launch(&mut self, on: bool) {
        self.sync_each_launch = on;
        if on {
            self.drop_graph();
        }
    }

    /// Steps whose launches were replayed from the captured graph.
    pub fn graph_replays(&self) -> u64 {
        self.graph_replays
    }

    /// Why graph capture was given up, when a capture failed (the first error; steps run
    /// eagerly since).
    pub fn capture_error(&self) -> Option<&str> {
        self.capture_error.as_deref()
    }

    /// Forgets a captured graph; the next step records a new one.
    fn drop_graph(&mut self) {
        if self.graph == Graph::Captured {
            self.backend.clear_graph();
            self.graph = Graph::Eager;
        }
    }

    // ---- the step's frame ----

    /// Device bytes in use now minus before the model was allocated.
    fn bytes_used(&self) -> Option<u64> {
        let (free, total) = self.backend.memory()?;
        Some((total - free).saturating_sub(self.used_before?))
    }

    /// Copies checked inputs into their tensors, in their stored dtype (u8 pixels stay u8;
    /// the plan's `input_cast` step converts them on the device).
    fn upload_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        let parts: Vec<(&[u8], u64)> = inputs
            .iter()
            .zip(self.plan.inputs.iter())
            .map(|(b, &id)| (b, self.plan.tensor(id)))
            .filter(|(_, t)| t.first <= t.last)
            .map(|(b, t)| (b.bytes(), self.arena + t.offset))
            .collect();
        // SAFETY: each input tensor's bytes are inside the arena.
        unsafe { self.backend.upload_inputs(&parts).map_err(dev) }
    }

    /// The most bytes a step's inputs upload (the pinned staging buffers' size).
    fn input_bytes(plan: &StaticPlan) -> usize {
        plan.inputs
            .iter()
            .map(|&id| plan.tensor(id))
            .filter(|t| t.first <= t.last)
            .map(|t| t.elems() * t.dtype.size() as usize)
            .sum()
    }

    /// Uploads the step's scalars, the flags cleared.
    fn upload_scalars(&mut self, scalars: &StepScalars) -> Result<()> {
        self.step = *scalars;
        let sc = MwScalars {
            step: scalars.step,
            loss_scale: scalars.loss_scale,
            grad_unscale: scalars.grad_unscale,
            adam_alpha: self.adam_alpha(scalars.update),
            nonfinite: 0,
            correct: 0,
            bad_index: 0,
        };
        // SAFETY: the scalars block (scalars_bytes) is at the end of the persistent allocation.
        unsafe {
            self.backend
                .upload(struct_bytes(&sc), self.scalars)
                .map_err(dev)
        }
    }

    /// Adam's bias-corrected step size for update `update` (counted from 1).
    fn adam_alpha(&self, update: u64) -> f32 {
        match self.plan.optimizer {
            Optimizer::Adam {
                lr, beta_1, beta_2, ..
            }
            | Optimizer::AdamW {
                lr, beta_1, beta_2, ..
            } => k::cuda::launch::adam_alpha(lr, beta_1, beta_2, update),
            _ => 0.0,
        }
    }

    /// Runs the step: eagerly, or captured once (after this executor's first eager step, when
    /// graphs are on) and replayed. A failed capture falls back to eager launches for good.
    fn launch_step(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        match self.graph {
            Graph::Captured => {
                self.backend.replay().map_err(dev)?;
                self.graph_replays += 1;
            }
            // A data-parallel step sums its gradients through the host, and a pipeline
            // stage's sends and receives are host calls: nothing to capture.
            Graph::Eager
                if self.use_graph
                    && !self.sync_each_launch
                    && self.eager_steps > 0
                    && self.plan.replicas == 1
                    && self.plan.stages == 1 =>
            {
                self.capture_and_replay(steps)?
            }
            _ => self.run_eagerly(steps)?,
        }
        Ok(())
    }

    /// Captures the step, then replays it; a failed capture runs it eagerly, and every later
    /// step too.
    fn capture_and_replay(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        match self.capture(steps) {
            Ok(true) => {
                self.graph = Graph::Captured;
                self.backend.replay().map_err(dev)?;
                self.graph_replays += 1;
            }
            Ok(false) => {
                self.graph = Graph::Unsupported;
                self.run_eagerly(steps)?;
            }
            Err(e) => {
                // Nothing ran while recording: the step runs now, eagerly, and so do the
                // later ones. Said once; the error is kept for `capture_error`.
                eprintln!(
                    "memwise: capturing the step as a CUDA graph failed ({e}); every step \
                         runs its kernels eagerly from now on"
                );
                self.backend.clear_graph();
                self.capture_error = Some(e);
                self.graph = Graph::Failed;
                self.run_eagerly(steps)?;
            }
        }
        Ok(())
    }

    fn run_eagerly(&mut self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        self.record_step(steps)?;
        self.eager_steps += 1;
        Ok(())
    }

    /// Records the step into a graph: `Ok(false)` when the backend has none, else the first
    /// error of the recording or of ending it (the capture is always ended, so the stream
    /// leaves capture mode).
    fn capture(
        &mut self,
        steps: &mut dyn FnMut(&Self) -> Result<()>,
    ) -> std::result::Result<bool, String> {
        if !self.backend.begin_capture()? {
            return Ok(false);
        }
        let recorded = self.record_step(steps).map_err(|e| e.to_string());
        let ended = self.backend.end_capture();
        recorded.and(ended).map(|()| true)
    }

    /// Zeroes the gradients and launches every step of the plan (recorded into the graph
    /// when capturing).
    fn record_step(&self, steps: &mut dyn FnMut(&Self) -> Result<()>) -> Result<()> {
        let (g0, g1) = self.grads_range;
        if self.plan.training && g1 > g0 {
            // SAFETY: the gradient range is inside the persistent region.
            unsafe {
                self.backend
                    .memset(self.persistent + g0, (g1 - g0) as usize, 0)
                    .map_err(dev)?
            };
        }
        steps(self)?;
        self.gather_losses()
    }

    /// Copies each loss value into the scalars block ([`LOSSES_AT`]) for [`Self::read_flags`].
    fn gather_losses(&self) -> Result<()> {
        for (i, &id) in self.plan.losses.iter().enumerate() {
            let to = self.scalars + LOSSES_AT + 4 * i as u64;
            let from = self.arena + self.plan.tensor(id).offset;
            self.k(
                "mw_copy_u8".into(),
                LaunchCfg::pointwise(4),
                vec![p(from), p(to), u(4)],
            )?;
        }
        Ok(())
    }

    /// Reads back the flags and the loss values, in one copy.
    fn read_flags(&self) -> Result<StepFlags> {
        let mut raw = vec![0u8; (LOSSES_AT + 4 * self.plan.losses.len() as u64) as usize];
        // SAFETY: the scalars block, as above, holds the scalars and the gathered losses.
        unsafe { self.backend.download(self.scalars, &mut raw).map_err(dev)? };
        // SAFETY: MwScalars is plain old data and raw starts with one.
        let after: MwScalars =
            unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const MwScalars) };
        let loss = raw[LOSSES_AT as usize..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .sum::<f32>();
        Ok(StepFlags {
            loss,
            correct: after.correct.max(0) as usize,
            nonfinite: after.nonfinite != 0,
            bad_index: (after.bad_index != 0).then(|| after.bad_index as usize - 1),
        })
    }

    /// Data parallel: the step's non-finite flag, set on every replica when it is on any.
    pub(crate) fn sum_nonfinite_flag(&self, c: &dyn crate::collective::Collective) -> Result<()> {
        let at = self.scalars + std::mem::offset_of!(MwScalars, nonfinite) as u64;
        let mut raw = [0u8; 4];
        // SAFETY: one i32 field of the scalars block.
        unsafe { self.backend.download(at, &mut raw).map_err(dev)? };
        let mut flag = [(i32::from_le_bytes(raw) != 0) as u8 as f64];
        c.all_reduce_sum_f64(&mut flag)?;
        let set = (flag[0] > 0.0) as i32;
        // SAFETY: as above.
        unsafe { self.backend.upload(&set.to_le_bytes(), at).map_err(dev)? };
        Ok(())
    }

    /// `c`'s collectives on device memory and the stream to enqueue them on (forked from
    /// the executor's), when both the collective and the backend have them.
    pub(crate) fn device_collective<'c>(
        &self,
        c: &'c dyn crate::collective::Collective,
    ) -> Result<Option<(&'c dyn crate::collective::DeviceCollective, u64)>> {
        let Some(device) = c.device() else {
            return Ok(None);
        };
        let stream = self.backend.fork_collective().map_err(dev)?;
        Ok(stream.map(|s| (device, s)))
    }

    /// ZeRO's gather on the device: each parameter's f32 values, and its 16-bit copy where
    /// it has one, shard by shard from the replica that updated it (the update kernel
    /// writes both for its own shard).
    pub(crate) fn all_gather_on_device(
        &self,
        params: &[u32],
        device: &dyn crate::collective::DeviceCollective,
        stream: u64,
    ) -> Result<()> {
        for &pid in params {
            let p = &self.plan.params[pid as usize];
            // SAFETY: the values and the 16-bit copy lie inside the persistent region, at
            // the plan's offsets, and only this stream touches them.
            unsafe {
                device.all_gather_shards(self.persistent + p.offset, p.elems() * 4, 4, stream)?;
                if let Some(t) = p.half_copy {
                    let (at, size) = (self.persistent + p.half_offset, t.size() as usize);
                    device.all_gather_shards(at, p.elems() * size, size, stream)?;
                }
            }
        }
        Ok(())
    }

    // ---- state ----

    fn download_f32(&self, addr: u64, n: usize) -> Result<Vec<f32>> {
        let mut raw = vec![0u8; n * 4];
        // SAFETY: callers pass ranges of the persistent region.
        unsafe { self.backend.download(addr, &mut raw).map_err(dev)? };
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Parameter `pid`'s f32 values (or gradient).
    fn param_values(&self, pid: u32, grad: bool) -> Result<Vec<f32>> {
        let p = &self.plan.params[pid as usize];
        let offset = if grad { p.grad_offset } else { p.offset };
        self.download_f32(self.persistent + offset, p.elems())
    }

    /// Overwrites parameter `pid` with `values`, and its 16-bit copy when it has one (rounded
    /// on the host as the CPU rounds it).
    /// Rebuilds the optimizer's chunk table for replica `rank`'s shards (ZeRO stage 1) in
    /// the room rank 0's took: every other replica's shards are as long or shorter.
    fn rebuild_update_table(&mut self, rank: usize) -> Result<()> {
        let table = update_table::update_table(&self.plan, self.persistent, rank);
        let room = update_table::update_table(&self.plan, 0, 0).chunks.len();
        if table.chunks.len() > room {
            return Err(RuntimeError::Memory(format!(
                "replica {rank}'s optimizer chunk table has {} entries, the room made for it {room}",
                table.chunks.len()
            )));
        }
        // SAFETY: the table's room in the scalars block (`scalars_bytes`) holds `room` entries.
        unsafe {
            self.backend
                .upload(slice_bytes(&table.chunks), self.update_table)
                .map_err(dev)?;
        }
        self.update_steps = table.steps;
        self.update_rank = rank;
        Ok(())
    }

    fn upload_param(&self, pid: u32, values: &[f32]) -> Result<()> {
        let p = &self.plan.params[pid as usize];
        let half: Option<Vec<u8>> = match p.half_copy {
            Some(DType::F16) => {
                let mut h = vec![f16::ZERO; values.len()];
                k::elementwise::cast(values, &mut h).map_err(|e| RuntimeError::Memory(e.0))?;
                Some(h.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            Some(DType::BF16) => {
                let mut h = vec![bf16::ZERO; values.len()];
                k::elementwise::cast(values, &mut h).map_err(|e| RuntimeError::Memory(e.0))?;
                Some(h.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            _ => None,
        };
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: the parameter's f32 values and its 16-bit copy lie inside the persistent
        // region, at the plan's offsets.
        unsafe {
            self.backend
                .upload(&bytes, self.persistent + p.offset)
                .map_err(dev)?;
            if let Some(h) = half {
                self.backend
                    .upload(&h, self.persistent + p.half_offset)
                    .map_err(dev)?;
            }
        }
        Ok(())
    }

    /// The first `n` elements of tensor `id`'s bytes, downloaded.
    fn tensor_bytes(&self, id: u32, n: usize) -> Result<Vec<u8>> {
        let t = self.plan.tensor(id);
        let mut raw = vec![0u8; n.min(t.elems()) * t.dtype.size() as usize];
        // SAFETY: the tensor's bytes are inside the arena.
        unsafe {
            self.backend
                .download(self.arena + t.offset, &mut raw)
                .map_err(dev)?
        };
        Ok(raw)
    }

    /// Tensor `id` as f32 values (a prediction, a loss term).
    fn tensor_values(&self, id: u32, out: &mut [f32]) -> Result<()> {
        let t = self.plan.tensor(id);
        let raw = self.tensor_bytes(id, out.len())?;
        for (o, c) in out
            .iter_mut()
            .zip(raw.chunks_exact(t.dtype.size() as usize))
        {
            *o = match t.dtype {
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
                DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
                other => {
                    return Err(RuntimeError::Input(format!(
                        "`{}` is {}, not a float tensor",
                        t.name,
                        other.name()
                    )))
                }
            };
        }
        Ok(())
    }

    /// Whether every value of tensor `id` is finite (integers always are).
    fn finite(&self, id: u32) -> Result<bool> {
        let t = self.plan.tensor(id);
        if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Ok(true);
        }
        let mut v = vec![0f32; t.elems()];
        self.tensor_values(id, &mut v)?;
        Ok(k::elementwise::all_finite(&v))
    }

    fn image(&self) -> Result<Vec<u8>> {
        let mut host = vec![0u8; self.plan.persistent_bytes as usize];
        // SAFETY: the persistent allocation holds persistent_bytes (and the scalars after).
        unsafe {
            self.backend
                .download(self.persistent, &mut host)
                .map_err(dev)?
        };
        Ok(host)
    }

    /// Runs `write` on a host copy of the persistent region, refreshes the 16-bit copies and
    /// uploads it. Drops a captured graph: a checkpoint restores its own seed, which the
    /// graph's launches hold.
    fn rewrite_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        let mut host = Region::new(
            self.plan.persistent_bytes as usize,
            "persistent region (host copy)",
        )?;
        // SAFETY: as above.
        unsafe {
            self.backend
                .download(self.persistent, host.bytes_mut())
                .map_err(dev)?
        };
        write(host.bytes_mut())?;
        refresh_half_copies(&self.plan, &mut host)?;
        // SAFETY: as above.
        unsafe {
            self.backend
                .upload(host.bytes(), self.persistent)
                .map_err(dev)?
        };
        self.drop_graph();
        self.backend.synchronize().map_err(dev)
    }

    // ---- addresses ----

    /// Address of tensor `id`.
    fn t(&self, id: u32) -> Result<u64> {
        if id == NONE {
            return Err(dev("a needed tensor is absent (NONE)".into()));
        }
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| dev(format!("no tensor {id}")))?;
        Ok(self.arena + t.offset)
    }
    /// Address of tensor `id`, or a null pointer for NONE.
    fn t_or_null(&self, id: u32) -> Result<u64> {
        if id == NONE {
            Ok(0)
        } else {
            self.t(id)
        }
    }
    /// The storage type of float tensor `id`.
    fn ft(&self, id: u32) -> Result<Float> {
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| dev(format!("no tensor {id}")))?;
        float(t.dtype)
    }
    fn elems(&self, id: u32) -> Result<usize> {
        self.plan
            .tensors
            .get(id as usize)
            .map(|t| t.elems())
            .ok_or_else(|| dev(format!("no tensor {id}")))
    }
    /// Two tensors share their bytes (an in-place hand-over).
    fn same(&self, a: u32, b: u32) -> bool {
        a != NONE
            && b != NONE
            && self.plan.tensors[a as usize].offset == self.plan.tensors[b as usize].offset
    }
    /// The f32 values of parameter `pid`.
    fn pv(&self, pid: u32) -> u64 {
        self.persistent + self.plan.params[pid as usize].offset
    }
    /// The f32 values of optional parameter `pid` (a bias), or a null pointer for NONE.
    fn pv_or_null(&self, pid: u32) -> u64 {
        if pid == NONE {
            0
        } else {
            self.pv(pid)
        }
    }
    /// The weights a GEMM reads in storage type `t`: the f32 values or their 16-bit copy.
    fn pw(&self, pid: u32, t: Float) -> Result<u64> {
        let p = &self.plan.params[pid as usize];
        let want = match t {
            Float::F32 => return Ok(self.persistent + p.offset),
            Float::F16 => DType::F16,
            Float::Bf16 => DType::BF16,
        };
        if p.half_copy == Some(want) {
            Ok(self.persistent + p.half_offset)
        } else {
            Err(dev(format!(
                "parameter `{}` has no {} copy",
                p.name,
                want.name()
            )))
        }
    }
    /// The f32 gradient of parameter `pid`.
    fn pg(&self, pid: u32) -> Result<u64> {
        let p = &self.plan.params[pid as usize];
        if p.grad_offset == NO_OFFSET {
            return Err(dev(format!("parameter `{}` has no gradient", p.name)));
        }
        Ok(self.persistent + p.grad_offset)
    }
    /// The step's scalars in device memory.
    fn sc(&self) -> KArg {
        p(self.scalars)
    }

    /// Launches kernel `name`.
    fn k(&self, name: String, cfg: LaunchCfg, args: Vec<KArg>) -> Result<()> {
        self.launch(&KernelCall::new(name, cfg, args))
    }

    /// Launches a prepared call (the launch helpers of `kernels::cuda`, e.g. `flash`).
    fn launch(&self, call: &KernelCall) -> Result<()> {
        self.poison_padding()?;
        // SAFETY: every pointer argument is an address inside the two regions, at a tensor's
        // or parameter's planned offset, sized by the plan for the dims passed.
        unsafe { self.backend.launch(call).map_err(dev)? };
        self.sync_after(&call.name)
    }

    /// In the poisoned-arena test ([`Kernels::poison`] was called), fills the arena's padding
    /// with NaN bytes before each launch and GEMM, so a kernel that reads past its tensor
    /// reads NaN even where an earlier launch of the step wrote there out of bounds.
    fn poison_padding(&self) -> Result<()> {
        let Some(padding) = self.padding.get() else {
            return Ok(());
        };
        for &(offset, bytes) in padding {
            // SAFETY: padding inside the arena.
            unsafe {
                self.backend
                    .memset(self.arena + offset, bytes as usize, 0xFF)
                    .map_err(dev)?
            };
        }
        Ok(())
    }

    /// With [`CudaKernels::set_sync_each_launch`] on, waits for the device and names `what`
    /// (the kernel or GEMM just launched) in its error; the walk adds the step.
    fn sync_after(&self, what: &str) -> Result<()> {
        if !self.sync_each_launch {
            return Ok(());
        }
        self.backend.synchronize().map_err(|e| {
            dev(format!(
                "{e} (found by the synchronisation after `{what}`, {SYNC_ENV}=1)"
            ))
        })
    }

    /// Runs row-major GEMM `g`, resolving its operands with `buf` to (address, type).
    fn gemm(&self, g: &RowGemm, buf: &dyn Fn(Operand) -> Result<(u64, Float)>) -> Result<()> {
        let cg = cm::to_cublas(g);
        if cg.m == 0 || cg.n == 0 || cg.batch == 0 {
            return Ok(());
        }
        let (a, ta) = buf(cg.a.0)?;
        let (b, tb) = buf(cg.b.0)?;
        let (c, tc) = buf(cg.c.0)?;
        // SAFETY: the mapping's extents lie inside the planned tensors (tests/cublas_map.rs).
        let types = [ta, tb, tc];
        self.poison_padding()?;
        unsafe {
            self.backend
                .gemm(&cg, GemmBuffers { a, b, c, types })
                .map_err(dev)?
        };
        self.sync_after(&format!(
            "cuBLAS GEMM {}×{}×{} ({types:?})",
            cg.m, cg.n, cg.k
        ))
    }
}

/// The launch storage type of a float dtype.
fn float(dt: DType) -> Result<Float> {
    match dt {
        DType::F32 => Ok(Float::F32),
        DType::F16 => Ok(Float::F16),
        DType::BF16 => Ok(Float::Bf16),
        other => Err(dev(format!(
            "expected a float tensor, found {}",
            other.name()
        ))),
    }
}

fn p(addr: u64) -> KArg {
    KArg::Ptr(addr)
}
fn u(n: usize) -> KArg {
    KArg::U64(n as u64)
}

/// Fills the 16-bit copies of the parameters that have one, from their f32 values.
fn refresh_half_copies(plan: &StaticPlan, region: &mut Region) -> Result<()> {
    for p in plan.params.iter() {
        let Some(h) = p.half_copy else { continue };
        // SAFETY: the f32 values and the 16-bit copy are disjoint ranges of the region.
        unsafe {
            let src = region.view::<f32>(p.offset, p.elems())?;
            match h {
                DType::F16 => {
                    k::elementwise::cast(src, region.view_mut::<f16>(p.half_offset, p.elems())?)
                }
                DType::BF16 => {
                    k::elementwise::cast(src, region.view_mut::<bf16>(p.half_offset, p.elems())?)
                }
                _ => Ok(()),
            }
            .map_err(|e| RuntimeError::Memory(e.0))?;
        }
    }
    Ok(())
}

fn struct_bytes<T>(v: &T) -> &[u8] {
    slice_bytes(std::slice::from_ref(v))
}

/// A slice of plain-old-data structs (`#[repr(C)]`, no padding) as its bytes.
fn slice_bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data structs viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
