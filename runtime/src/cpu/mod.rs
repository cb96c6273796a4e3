//! `CpuKernels`: a plan's memory on the host — one arena and one persistent region, each a
//! single allocation made when the model is built — and the CPU kernels the walk calls on
//! typed views of them at the planned offsets (`ops.rs`). Nothing is allocated per step.

mod ops;

use std::borrow::Cow;
use std::cell::Cell;

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_plan::{DType, Optimizer, StaticPlan, NONE, NO_OFFSET};

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::executor::{Batch, Stored};
use crate::init;
use crate::kernels::{StepFlags, StepScalars};
use crate::memory::Region;

/// The optimizer's kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Opt {
    Sgd(k::optimizer::Sgd),
    RmsProp(k::optimizer::RmsProp),
    Adam(k::optimizer::Adam),
    AdamW(k::optimizer::AdamW),
}

impl Opt {
    pub(crate) fn from_plan(o: &Optimizer) -> Opt {
        use k::optimizer as ko;
        match *o {
            Optimizer::Sgd { lr } => Opt::Sgd(ko::Sgd {
                learning_rate: lr,
                momentum: 0.0,
                nesterov: false,
            }),
            Optimizer::Momentum {
                lr,
                momentum,
                nesterov,
            } => Opt::Sgd(ko::Sgd {
                learning_rate: lr,
                momentum,
                nesterov,
            }),
            Optimizer::RmsProp {
                lr: learning_rate,
                rho,
                epsilon,
                momentum,
                centered,
            } => Opt::RmsProp(ko::RmsProp {
                learning_rate,
                rho,
                momentum,
                epsilon,
                centered,
            }),
            Optimizer::Adam {
                lr,
                beta_1,
                beta_2,
                epsilon,
            } => Opt::Adam(ko::Adam {
                learning_rate: lr,
                beta_1,
                beta_2,
                epsilon,
            }),
            Optimizer::AdamW {
                lr,
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => Opt::AdamW(ko::AdamW {
                adam: ko::Adam {
                    learning_rate: lr,
                    beta_1,
                    beta_2,
                    epsilon,
                },
                weight_decay,
            }),
        }
    }

    pub(crate) fn update(
        &self,
        step: u64,
        p: &mut [f32],
        g: &[f32],
        s: &mut [&mut [f32]],
        unscale: f32,
    ) -> k::KResult {
        use k::optimizer::Optimizer as _;
        match self {
            Opt::Sgd(o) => o.update(step, p, g, s, unscale),
            Opt::RmsProp(o) => o.update(step, p, g, s, unscale),
            Opt::Adam(o) => o.update(step, p, g, s, unscale),
            Opt::AdamW(o) => o.update(step, p, g, s, unscale),
        }
    }
}

/// A plan's memory on the host and the CPU kernels over it.
pub struct CpuKernels {
    pub(crate) plan: StaticPlan,
    pub(crate) arena: Region,
    pub(crate) persistent: Region,
    pub(crate) opt: Opt,
    /// Byte range of the gradients in the persistent region (zeroed at each step).
    grads_range: (usize, usize),
    /// This step's scalars (set by `begin_step`).
    pub(crate) scalars: Cell<StepScalars>,
    /// Correct predictions counted by this step's classification losses.
    pub(crate) correct: Cell<usize>,
    /// This step found a non-finite gradient (loss scaling) or loss (float32).
    pub(crate) nonfinite: Cell<bool>,
}

impl CpuKernels {
    /// Allocates the two regions of `plan` (failing with the numbers, before any
    /// allocation, when the plan exceeds what `device` has) and initialises the weights as
    /// Keras does (Glorot-uniform kernels, zero biases, unit norm scales), seeded.
    pub fn new(plan: StaticPlan, device: &Device, seed: u64) -> Result<CpuKernels> {
        if device.is_cuda() {
            // The CPU executor must not pretend to run on a GPU: `engine::build_engine` (what
            // `Trainer` calls) builds the CUDA executor for a CUDA device.
            return Err(RuntimeError::Device(format!(
                "{}: the CPU executor runs on the CPU only; build the CUDA executor \
                 (`memwise_runtime::engine::build_engine`, or `Trainer`) for a CUDA device",
                device.name()
            )));
        }
        // The GEMM library's per-call blocks must not stay resident after they are freed.
        crate::memory::return_large_frees();
        let total = plan.persistent_bytes + plan.arena_bytes;
        if let Some(avail) = device.available_bytes() {
            if total > avail {
                return Err(RuntimeError::OutOfMemory {
                    needed: total,
                    available: avail,
                    device: device.name(),
                });
            }
        }
        let persistent = Region::new(plan.persistent_bytes as usize, "persistent region")?;
        let arena = Region::new(plan.arena_bytes as usize, "arena")?;
        let (g0, g1) = plan.grads_range();
        let opt = Opt::from_plan(&plan.optimizer);
        let mut kernels = CpuKernels {
            plan,
            arena,
            persistent,
            opt,
            grads_range: (g0 as usize, g1 as usize),
            scalars: Cell::new(StepScalars {
                step: 0,
                loss_scale: 1.0,
                grad_unscale: 1.0,
                update: 1,
            }),
            correct: Cell::new(0),
            nonfinite: Cell::new(false),
        };
        init::initialise(&kernels.plan, &mut kernels.persistent, seed)?;
        kernels.refresh_half_copies(None)?;
        Ok(kernels)
    }

    /// The whole persistent region (parameters, 16-bit copies, gradients, optimizer state).
    pub fn persistent_bytes(&self) -> &[u8] {
        self.persistent.bytes()
    }

    /// Parameter `pid`'s f32 values, borrowed.
    pub fn param_values(&self, pid: u32) -> Result<&[f32]> {
        let p = &self.plan.params[pid as usize];
        // SAFETY: shared borrow of self; no mutable views are live between steps.
        unsafe { self.persistent.view::<f32>(p.offset, p.elems()) }
    }

    pub(crate) fn refresh_half_copies(&mut self, only: Option<usize>) -> Result<()> {
        for (i, p) in self.plan.params.iter().enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let Some(h) = p.half_copy else { continue };
            // SAFETY: the f32 values and the 16-bit copy are disjoint ranges of the region.
            unsafe {
                let src = self.persistent.view::<f32>(p.offset, p.elems())?;
                match h {
                    DType::F16 => k::elementwise::cast(
                        src,
                        self.persistent.view_mut::<f16>(p.half_offset, p.elems())?,
                    ),
                    DType::BF16 => k::elementwise::cast(
                        src,
                        self.persistent.view_mut::<bf16>(p.half_offset, p.elems())?,
                    ),
                    _ => Ok(()),
                }
                .map_err(|e| RuntimeError::Memory(e.0))?;
            }
        }
        Ok(())
    }

    /// Copies checked inputs into the arena.
    pub(crate) fn copy_inputs(&mut self, inputs: &[Batch<'_>]) -> Result<()> {
        for (b, &id) in inputs.iter().zip(self.plan.inputs.iter()) {
            let t = self.plan.tensor(id);
            if t.first > t.last {
                continue;
            }
            let bytes = b.bytes();
            // SAFETY: &mut self; input tensors are disjoint from each other at step 0.
            let dst = unsafe { self.arena.view_mut::<u8>(t.offset, bytes.len())? };
            dst.copy_from_slice(bytes);
        }
        Ok(())
    }

    pub(crate) fn zero_grads(&mut self) {
        let (g0, g1) = self.grads_range;
        self.persistent.bytes_mut()[g0..g1].fill(0);
    }

    pub(crate) fn end(&self) -> Result<StepFlags> {
        let mut loss = 0f32;
        for &id in self.plan.losses.iter() {
            let t = self.plan.tensor(id);
            // SAFETY: shared view of one f32 between steps.
            loss += unsafe { self.arena.view::<f32>(t.offset, 1)? }[0];
        }
        Ok(StepFlags {
            loss,
            correct: self.correct.get(),
            nonfinite: self.nonfinite.get(),
            bad_index: None,
        })
    }

    pub(crate) fn finite(&self, id: u32) -> Result<bool> {
        let t = self.plan.tensor(id);
        // SAFETY: shared view between steps.
        unsafe {
            Ok(match t.dtype {
                DType::F32 => {
                    k::elementwise::all_finite(self.arena.view::<f32>(t.offset, t.elems())?)
                }
                DType::F16 => {
                    k::elementwise::all_finite(self.arena.view::<f16>(t.offset, t.elems())?)
                }
                DType::BF16 => {
                    k::elementwise::all_finite(self.arena.view::<bf16>(t.offset, t.elems())?)
                }
                DType::U8 | DType::I32 => true,
            })
        }
    }

    pub(crate) fn poison_tensors(&self, ids: &[u32], padding: &[(u64, u64)]) -> Result<()> {
        for &(offset, bytes) in padding {
            // SAFETY: padding is no tensor's; nothing views it.
            unsafe {
                self.arena
                    .view_mut::<u8>(offset, bytes as usize)?
                    .fill(0xff)
            };
        }
        for &id in ids {
            let t = &self.plan.tensors[id as usize];
            let len = t.elems();
            // SAFETY: the tensor's life ended; nothing else views its bytes now.
            unsafe {
                match t.dtype {
                    DType::F32 => self.arena.view_mut::<f32>(t.offset, len)?.fill(f32::NAN),
                    DType::F16 => self.arena.view_mut::<f16>(t.offset, len)?.fill(f16::NAN),
                    DType::BF16 => self.arena.view_mut::<bf16>(t.offset, len)?.fill(bf16::NAN),
                    DType::U8 => self.arena.view_mut::<u8>(t.offset, len)?.fill(0xA5),
                    DType::I32 => self.arena.view_mut::<i32>(t.offset, len)?.fill(-1),
                }
            }
        }
        Ok(())
    }

    pub(crate) fn grads_finite(&self) -> Result<bool> {
        for p in self
            .plan
            .params
            .iter()
            .filter(|p| p.grad_offset != NO_OFFSET)
        {
            // SAFETY: shared views only.
            let g = unsafe { self.persistent.view::<f32>(p.grad_offset, p.elems())? };
            if !k::elementwise::all_finite(g) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    pub(crate) fn image(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.persistent.bytes())
    }

    // ---- views ----

    /// A read view of tensor `id`.
    ///
    /// # Safety
    /// No mutable view of an overlapping tensor may be live (the plan's rule 3).
    pub(crate) unsafe fn r<T: Stored>(&self, id: u32) -> Result<&[T]> {
        let t = self.tensor_as::<T>(id, "read")?;
        self.arena.view::<T>(t.offset, t.elems())
    }

    /// A write view of tensor `id`.
    ///
    /// # Safety
    /// No other view of an overlapping tensor may be live.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn w<T: Stored>(&self, id: u32) -> Result<&mut [T]> {
        let t = self.tensor_as::<T>(id, "written")?;
        self.arena.view_mut::<T>(t.offset, t.elems())
    }

    /// Tensor `id` of the plan, refused unless it is stored as `T` (`access` names the view
    /// in the error: "read" or "written").
    fn tensor_as<T: Stored>(&self, id: u32, access: &str) -> Result<&memwise_plan::PlanTensor> {
        let t = self
            .plan
            .tensors
            .get(id as usize)
            .ok_or_else(|| RuntimeError::Memory(format!("no tensor {id}")))?;
        if t.dtype != T::DTYPE {
            return Err(RuntimeError::Memory(format!(
                "tensor `{}` is {}, {access} as {}",
                t.name,
                t.dtype.name(),
                T::DTYPE.name()
            )));
        }
        Ok(t)
    }

    /// An optional write view (`NONE` → `None`).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn wo<T: Stored>(&self, id: u32) -> Result<Option<&mut [T]>> {
        if id == NONE {
            Ok(None)
        } else {
            self.w::<T>(id).map(Some)
        }
    }

    /// A workspace view, empty when the slot is `NONE`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn ws<T: Stored>(&self, id: u32) -> Result<&mut [T]> {
        Ok(self.wo::<T>(id)?.unwrap_or(&mut []))
    }

    pub(crate) fn dtype(&self, id: u32) -> DType {
        self.plan.tensors[id as usize].dtype
    }

    /// Two tensors share their bytes (an in-place hand-over).
    pub(crate) fn same(&self, a: u32, b: u32) -> bool {
        a != NONE
            && b != NONE
            && self.plan.tensors[a as usize].offset == self.plan.tensors[b as usize].offset
    }

    /// The weights a GEMM reads: the f32 values, or their 16-bit copy.
    pub(crate) unsafe fn weight<T: Stored>(&self, pid: u32) -> Result<&[T]> {
        let p = &self.plan.params[pid as usize];
        if T::DTYPE == DType::F32 {
            self.persistent.view::<T>(p.offset, p.elems())
        } else if p.half_copy == Some(T::DTYPE) {
            self.persistent.view::<T>(p.half_offset, p.elems())
        } else {
            Err(RuntimeError::Memory(format!(
                "parameter `{}` has no {} copy",
                p.name,
                T::DTYPE.name()
            )))
        }
    }

    pub(crate) unsafe fn pf32(&self, pid: u32) -> Result<&[f32]> {
        let p = &self.plan.params[pid as usize];
        self.persistent.view::<f32>(p.offset, p.elems())
    }

    /// An optional parameter (`NONE` → `None`): a bias.
    pub(crate) unsafe fn pf32_opt(&self, pid: u32) -> Result<Option<&[f32]>> {
        if pid == NONE {
            Ok(None)
        } else {
            self.pf32(pid).map(Some)
        }
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn pf32_mut(&self, pid: u32) -> Result<&mut [f32]> {
        let p = &self.plan.params[pid as usize];
        self.persistent.view_mut::<f32>(p.offset, p.elems())
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn grad_mut(&self, pid: u32) -> Result<&mut [f32]> {
        let p = &self.plan.params[pid as usize];
        if p.grad_offset == NO_OFFSET {
            return Err(RuntimeError::Memory(format!(
                "parameter `{}` has no gradient",
                p.name
            )));
        }
        self.persistent.view_mut::<f32>(p.grad_offset, p.elems())
    }

    /// A norm's γ and β gradients, for its backward kernel to accumulate into.
    pub(crate) unsafe fn affine_grads(
        &self,
        gamma: u32,
        beta: u32,
    ) -> Result<k::norm::AffineGrads<'_>> {
        Ok(k::norm::AffineGrads {
            dgamma: self.grad_mut(gamma)?,
            dbeta: self.grad_mut(beta)?,
        })
    }

    /// An optional gradient (`NONE` → `None`): a bias's.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn grad_opt(&self, pid: u32) -> Result<Option<&mut [f32]>> {
        if pid == NONE {
            Ok(None)
        } else {
            self.grad_mut(pid).map(Some)
        }
    }
}
