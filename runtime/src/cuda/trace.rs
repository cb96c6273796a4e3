//! [`TraceBackend`] records the launches of a plan's training step without running them: the
//! launch report's model of a GPU step. It is an analysis tool, not a device: its allocations
//! are address ranges in a fake address space (no memory behind them), uploads are dropped,
//! downloads read zeros, and it has no graphs (`begin_capture` answers `Ok(false)`).
//!
//! [`trace_training_step`] walks every step of a plan through [`CudaKernels`] — the same
//! launches and cuBLAS GEMMs a GPU would get, in the same order, with the walk's own dispatch
//! (`walk::run_step`) — telling the backend which plan step each command belongs to.
//! Each command becomes a [`LaunchRecord`]: its step, kernel, grid and block, bytes, FLOPs
//! and elements. [`GpuModel`] (the [`H200`]) turns a record into a modelled time and says
//! whether the launch leaves most of the GPU idle.
//!
//! What a record counts (a model, not a measurement):
//! - **Bytes** of a kernel: every pointer argument is resolved to the plan tensor (arena) or
//!   persistent slot (a parameter's f32 values, its 16-bit copy, its gradient, one optimizer
//!   state slot; the step scalars) whose byte range holds it, and that tensor's whole size
//!   (elements × dtype size) counts once per launch, however many arguments point into it and
//!   whether it is read, written or both. A kernel that reads and writes one tensor in place
//!   is therefore counted once (an underestimate), a kernel that touches only part of a
//!   tensor counts all of it (an overestimate); caches are not modelled.
//! - **Bytes** of a GEMM: its operands' extents ([`CublasGemm::extents`]) times their storage
//!   size; `C` counts twice when `beta ≠ 0` (read, then written). **FLOPs**: 2·m·n·k per item.
//! - **FLOPs** of a kernel: its step's FLOPs as the planner counts them
//!   ([`StaticPlan::step_cost`], the CPU roofline's numbers) minus the step's GEMM FLOPs,
//!   shared among the step's kernels in proportion to their bytes.
//! - **Elements**: the largest tensor (or slot) the launch touches, in elements.
//!
//! Memsets (the gradients zeroed at the start of a step) are recorded as launches of their
//! own with no grid: the driver chooses it, as cuBLAS chooses a GEMM's.

use std::cell::{Cell, RefCell};

use memwise_kernels::cublas_map::{CublasGemm, GemmBuffers};
use memwise_kernels::cuda::launch::{Float, KArg, KernelCall};
use memwise_plan::liveness::align_up;
use memwise_plan::{Op, Phase, PlanStep, StaticPlan, NO_OFFSET};

use super::{scalars_bytes, update_table_at, Backend, CudaKernels};
use crate::device::Device;
use crate::error::{Result, RuntimeError};

/// One command the traced step issued, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Launch(KernelCall),
    Gemm(CublasGemm, GemmBuffers),
    Memset { dst: u64, bytes: usize },
}

/// A command and the plan step (its index) that issued it, when one was marked.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub step: Option<u32>,
    pub command: Command,
}

/// Device memory the trace pretends to have: an H200's 141 GB, so that a plan that would not
/// fit one is refused as on the device.
const TRACE_MEMORY_BYTES: u64 = 141_000_000_000;
/// First fake address: far from 0, so that a null pointer never resolves.
const TRACE_BASE: u64 = 1 << 40;
/// Allocations are aligned (and separated) to this, as cudaMalloc's are at least to 256.
const TRACE_ALIGN: u64 = 1 << 16;

/// A [`Backend`] that records instead of running (see the module docs).
#[derive(Debug, Default)]
pub struct TraceBackend {
    next: u64,
    used: u64,
    step: Cell<Option<u32>>,
    recorded: RefCell<Vec<Recorded>>,
}

impl TraceBackend {
    pub fn new() -> TraceBackend {
        TraceBackend::default()
    }

    /// Tags the commands that follow with plan step `step` (`None`: not in a step).
    pub fn set_step(&self, step: Option<u32>) {
        self.step.set(step);
    }

    /// The commands recorded so far, in order.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.recorded.borrow().clone()
    }

    /// Takes the commands recorded so far, leaving none.
    pub fn take(&self) -> Vec<Recorded> {
        std::mem::take(&mut *self.recorded.borrow_mut())
    }

    fn record(&self, command: Command) {
        self.recorded.borrow_mut().push(Recorded {
            step: self.step.get(),
            command,
        });
    }
}

impl Backend for TraceBackend {
    fn name(&self) -> String {
        "trace (H200 model)".into()
    }
    fn memory(&self) -> Option<(u64, u64)> {
        Some((
            TRACE_MEMORY_BYTES.saturating_sub(self.used),
            TRACE_MEMORY_BYTES,
        ))
    }
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String> {
        // Rounded up and one alignment unit left free after it, so that no address past an
        // allocation's end falls inside the next one.
        let size = (bytes.max(1) as u64)
            .checked_next_multiple_of(TRACE_ALIGN)
            .and_then(|s| s.checked_add(TRACE_ALIGN))
            .ok_or_else(|| format!("trace: an allocation of {bytes} bytes"))?;
        let addr = TRACE_BASE
            .checked_add(self.next)
            .ok_or("trace: out of fake addresses")?;
        self.next = self
            .next
            .checked_add(size)
            .ok_or("trace: out of addresses")?;
        self.used = self.used.saturating_add(bytes as u64);
        Ok(addr)
    }
    unsafe fn upload(&self, _src: &[u8], _dst: u64) -> std::result::Result<(), String> {
        Ok(())
    }
    unsafe fn download(&self, _src: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        dst.fill(0);
        Ok(())
    }
    unsafe fn memset(&self, dst: u64, bytes: usize, _: u8) -> std::result::Result<(), String> {
        self.record(Command::Memset { dst, bytes });
        Ok(())
    }
    unsafe fn launch(&self, call: &KernelCall) -> std::result::Result<(), String> {
        self.record(Command::Launch(call.clone()));
        Ok(())
    }
    unsafe fn gemm(&self, g: &CublasGemm, bufs: GemmBuffers) -> std::result::Result<(), String> {
        // A call cuBLAS would refuse is an error here too.
        g.validate()?;
        self.record(Command::Gemm(*g, bufs));
        Ok(())
    }
    fn synchronize(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn begin_capture(&mut self) -> std::result::Result<bool, String> {
        // No graphs: every step the executor runs is recorded eagerly, once.
        Ok(false)
    }
    fn end_capture(&mut self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn replay(&self) -> std::result::Result<(), String> {
        Err("the trace backend records no graphs".into())
    }
    fn clear_graph(&mut self) {}
    fn open_another(&self) -> std::result::Result<TraceBackend, String> {
        Ok(TraceBackend::new())
    }
}

// ---- addresses → the plan's tensors and slots ----

/// What a byte range of the plan's two regions holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Arena tensor `id`.
    Tensor(u32),
    /// Parameter `id`'s f32 values.
    Param(u32),
    /// Parameter `id`'s 16-bit copy.
    HalfCopy(u32),
    /// Parameter `id`'s f32 gradient.
    Grad(u32),
    /// Optimizer state slot `.1` of parameter `.0`.
    State(u32, u32),
    /// The step's scalars and flags, and the loss values gathered behind them.
    Scalars,
    /// The multi-tensor optimizer's chunk table (behind the scalars).
    UpdateTable,
}

/// One slot's address range (`start .. start + bytes`).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub start: u64,
    pub bytes: u64,
    pub elems: u64,
    pub slot: Slot,
}

impl Span {
    fn holds(&self, addr: u64) -> bool {
        addr >= self.start && addr - self.start < self.bytes
    }
}

/// The address ranges of a plan's tensors and persistent slots, for regions at `arena`,
/// `persistent` (and its scalars block right after `persistent_bytes`).
#[derive(Clone, Debug, PartialEq)]
pub struct AddressMap {
    spans: Vec<Span>,
}

impl AddressMap {
    pub fn new(plan: &StaticPlan, arena: u64, persistent: u64) -> AddressMap {
        let mut spans = Vec::new();
        for t in plan.tensors.iter() {
            let (elems, size) = (t.elems() as u64, t.dtype.size());
            spans.push(Span {
                start: arena.saturating_add(t.offset),
                bytes: elems.saturating_mul(size),
                elems,
                slot: Slot::Tensor(t.id),
            });
        }
        for (i, p) in plan.params.iter().enumerate() {
            let (id, elems) = (i as u32, p.elems() as u64);
            let mut add = |offset: u64, elems: u64, size: u64, slot: Slot| {
                if offset != NO_OFFSET {
                    spans.push(Span {
                        start: persistent.saturating_add(offset),
                        bytes: elems.saturating_mul(size),
                        elems,
                        slot,
                    });
                }
            };
            add(p.offset, elems, 4, Slot::Param(id));
            if let Some(h) = p.half_copy {
                add(p.half_offset, elems, h.size(), Slot::HalfCopy(id));
            }
            if p.trainable {
                add(p.grad_offset, elems, 4, Slot::Grad(id));
                // Each slot one replica's shard under ZeRO stage 1, aligned as laid out.
                let state_elems = plan.state_elems(p) as u64;
                let stride = align_up(state_elems.saturating_mul(4), plan.alignment);
                for s in 0..plan.optimizer.state_slots() {
                    let off = p.state_offset.saturating_add(s.saturating_mul(stride));
                    add(off, state_elems, 4, Slot::State(id, s as u32));
                }
            }
        }
        let scalars = persistent.saturating_add(plan.persistent_bytes);
        let table = update_table_at(plan);
        spans.push(Span {
            start: scalars,
            bytes: table,
            elems: 1,
            slot: Slot::Scalars,
        });
        spans.push(Span {
            start: scalars + table,
            bytes: scalars_bytes(plan) - table,
            elems: 1,
            slot: Slot::UpdateTable,
        });
        spans.retain(|s| s.bytes > 0);
        AddressMap { spans }
    }

    /// The slot that holds `addr` while `step` runs. Arena tensors share bytes when their
    /// lives do not meet, so among the tensors holding `addr` the one the step reads or
    /// writes wins, then one alive at the step, then the first; persistent slots are
    /// disjoint. `None` for a null pointer or an address in no slot (padding).
    pub fn resolve(&self, addr: u64, step: Option<&PlanStep>, plan: &StaticPlan) -> Option<&Span> {
        let rank = |s: &Span| -> u8 {
            let Slot::Tensor(id) = s.slot else {
                return 0;
            };
            // Outside a step, the step's frame reads back the loss values.
            let Some(step) = step else {
                return u8::from(!plan.losses.contains(&id));
            };
            if step.reads.contains(&id) || step.writes.contains(&id) {
                return 0;
            }
            match plan.tensors.get(id as usize) {
                Some(t) if t.first <= step.index && step.index <= t.last => 1,
                _ => 2,
            }
        };
        self.spans
            .iter()
            .filter(|s| s.holds(addr))
            .min_by_key(|s| rank(s))
    }
}

// ---- records ----

/// The plan step a launch belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTag {
    pub index: u32,
    pub phase: Phase,
    pub op: &'static str,
    pub layer: String,
}

impl StepTag {
    fn of(s: &PlanStep) -> StepTag {
        StepTag {
            index: s.index,
            phase: s.phase,
            op: s.op.name(),
            layer: s.layer.to_string(),
        }
    }
}

/// What issued a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    /// One of memwise's kernels (its grid is memwise's choice).
    Kernel,
    /// A cuBLAS GEMM, with its operands' storage type (its grid is cuBLAS's choice).
    Gemm(Float),
    /// A memset (its grid is the driver's choice).
    Memset,
}

/// One launch of a traced step (see the module docs for what each count means).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchRecord {
    /// The plan step that issued it (`None`: the step's frame, e.g. zeroing the gradients).
    pub step: Option<StepTag>,
    /// The kernel's name, `cublas gemm m×n×k` (`… ×batch` when batched) or `memset`.
    pub kernel: String,
    pub kind: LaunchKind,
    /// Zero for GEMMs and memsets: the library or the driver chooses.
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// `grid[0]·grid[1]·grid[2]`.
    pub blocks: u64,
    /// Bytes read plus written.
    pub bytes: u64,
    pub flops: u64,
    /// The largest tensor touched, in elements.
    pub elements: u64,
}

/// Tags recorded commands with their steps and counts their bytes, FLOPs and elements;
/// `map` holds the addresses the commands were recorded with.
pub fn launch_records(
    plan: &StaticPlan,
    map: &AddressMap,
    recorded: &[Recorded],
) -> Result<Vec<LaunchRecord>> {
    let step_of = |i: u32| -> Result<&PlanStep> {
        plan.steps
            .get(i as usize)
            .filter(|s| s.index == i)
            .or_else(|| plan.steps.iter().find(|s| s.index == i))
            .ok_or_else(|| {
                RuntimeError::Input(format!("the trace names step {i}, not in the plan"))
            })
    };
    let mut records = Vec::with_capacity(recorded.len());
    for r in recorded {
        let step = r.step.map(step_of).transpose()?;
        let mut rec = match &r.command {
            Command::Launch(call) => kernel_record(plan, map, call, step),
            Command::Gemm(g, bufs) => gemm_record(g, bufs),
            Command::Memset { bytes, .. } => LaunchRecord {
                step: None,
                kernel: "memset".into(),
                kind: LaunchKind::Memset,
                grid: [0; 3],
                block: [0; 3],
                blocks: 0,
                bytes: *bytes as u64,
                flops: 0,
                // The gradients it zeroes are f32.
                elements: *bytes as u64 / 4,
            },
        };
        rec.step = step.map(StepTag::of);
        records.push(rec);
    }
    share_step_flops(plan, &mut records);
    Ok(records)
}

fn kernel_record(
    plan: &StaticPlan,
    map: &AddressMap,
    call: &KernelCall,
    step: Option<&PlanStep>,
) -> LaunchRecord {
    let mut touched: Vec<&Span> = Vec::new();
    for a in call.args.iter() {
        if let KArg::Ptr(addr) = *a {
            if let Some(s) = map.resolve(addr, step, plan) {
                if !touched.iter().any(|t| t.slot == s.slot) {
                    touched.push(s);
                }
            }
        }
    }
    // A multi-tensor optimizer launch reaches its parameters through its chunk table (in the
    // scalars block): it touches every slot of its step's parameters.
    if let Some(s) = step.filter(|s| matches!(s.op, Op::Update)) {
        for span in &map.spans {
            let of_step = match span.slot {
                Slot::Param(id) | Slot::HalfCopy(id) | Slot::Grad(id) | Slot::State(id, _) => {
                    s.params.contains(&id)
                }
                Slot::Tensor(_) | Slot::Scalars | Slot::UpdateTable => false,
            };
            if of_step && !touched.iter().any(|t| t.slot == span.slot) {
                touched.push(span);
            }
        }
    }
    let [g, b] = [call.cfg.grid, call.cfg.block];
    LaunchRecord {
        step: None,
        kernel: call.name.clone(),
        kind: LaunchKind::Kernel,
        grid: g,
        block: b,
        blocks: g.iter().map(|&x| x as u64).product(),
        bytes: touched.iter().map(|s| s.bytes).fold(0, u64::saturating_add),
        flops: 0,
        elements: touched.iter().map(|s| s.elems).max().unwrap_or(0),
    }
}

fn gemm_record(g: &CublasGemm, bufs: &GemmBuffers) -> LaunchRecord {
    let e = g.extents();
    let offsets = [g.a.1, g.b.1, g.c.1];
    let elems: Vec<u64> = e
        .iter()
        .zip(offsets)
        .map(|(x, off)| x.1.saturating_sub(off) as u64)
        .collect();
    let mut bytes = 0u64;
    for (n, t) in elems.iter().zip(bufs.types) {
        bytes = bytes.saturating_add(n.saturating_mul(t.size() as u64));
    }
    if g.beta != 0.0 {
        bytes = bytes.saturating_add(elems[2].saturating_mul(bufs.types[2].size() as u64));
    }
    let flops = [2, g.m, g.n, g.k, g.batch]
        .iter()
        .fold(1u64, |a, &x| a.saturating_mul(x as u64));
    let batch = if g.batch > 1 {
        format!(" ×{}", g.batch)
    } else {
        String::new()
    };
    LaunchRecord {
        step: None,
        kernel: format!("cublas gemm {}×{}×{}{batch}", g.m, g.n, g.k),
        kind: LaunchKind::Gemm(bufs.types[0]),
        grid: [0; 3],
        block: [0; 3],
        blocks: 0,
        bytes,
        flops,
        elements: elems.iter().copied().max().unwrap_or(0),
    }
}

/// Gives each step's kernels the step's planned FLOPs beyond its GEMMs', in proportion to
/// their bytes (equally when they move none); the rounding remainder goes to the first.
fn share_step_flops(plan: &StaticPlan, records: &mut [LaunchRecord]) {
    for s in plan.steps.iter() {
        let mine = |r: &LaunchRecord| r.step.as_ref().is_some_and(|t| t.index == s.index);
        let gemm: u64 = records
            .iter()
            .filter(|r| mine(r) && matches!(r.kind, LaunchKind::Gemm(_)))
            .map(|r| r.flops)
            .fold(0, u64::saturating_add);
        let rest = plan.step_cost(s).flops.saturating_sub(gemm);
        let kernels: Vec<usize> = (0..records.len())
            .filter(|&i| mine(&records[i]) && records[i].kind == LaunchKind::Kernel)
            .collect();
        if kernels.is_empty() || rest == 0 {
            continue;
        }
        let total: u128 = kernels.iter().map(|&i| records[i].bytes as u128).sum();
        let mut given = 0u64;
        for &i in &kernels {
            let share = (rest as u128 * records[i].bytes as u128)
                .checked_div(total)
                .unwrap_or(rest as u128 / kernels.len() as u128);
            // share ≤ rest, so it fits a u64.
            records[i].flops = share as u64;
            given += share as u64;
        }
        records[kernels[0]].flops += rest - given;
    }
}

/// Records every launch, GEMM and memset of one training step of `plan` and counts them. No
/// inputs are needed (nothing runs); `seed` is the launch argument of dropout and sampling,
/// as on a device.
pub fn trace_training_step(plan: &StaticPlan, seed: u64) -> Result<Vec<LaunchRecord>> {
    let k = CudaKernels::new(plan.clone(), &Device::cpu(), TraceBackend::new(), seed)?;
    // The walk's own dispatch, step by step, with each step marked on the backend first: the
    // executor's `train_step` issues the same commands, untagged (a test checks that).
    k.record_step(&mut |k: &CudaKernels<TraceBackend>| {
        for s in k.plan.steps.iter() {
            k.backend.set_step(Some(s.index));
            crate::walk::run_step(k, s, &crate::walk::StepCx::one_device(seed, 0))?;
        }
        k.backend.set_step(None);
        Ok(())
    })?;
    let map = AddressMap::new(&k.plan, k.arena, k.persistent);
    launch_records(&k.plan, &map, &k.backend.take())
}

// ---- the roofline of a GPU ----

/// A GPU's peak rates for the launch report's roofline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuModel {
    pub name: &'static str,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Device-memory bandwidth, bytes per second.
    pub bytes_per_s: f64,
    /// FP32 without tensor cores: memwise's kernels, and cuBLAS's f32 GEMMs (run with
    /// `CUBLAS_COMPUTE_32F` in the default math mode, so not on TF32 tensor cores).
    pub fp32_flops_per_s: f64,
    /// Dense TF32 tensor-core rate (unused by today's f32 GEMMs; kept for a TF32 mode).
    pub tf32_flops_per_s: f64,
    /// Dense FP16 and BF16 tensor-core rates (f32 accumulation): the 16-bit GEMMs.
    pub fp16_flops_per_s: f64,
    pub bf16_flops_per_s: f64,
}

/// NVIDIA H200 SXM: 132 SMs (the GH100 configuration of the H100 SXM5, NVIDIA's Hopper
/// architecture whitepaper), HBM3e at 4.8 TB/s, FP32 67 TFLOP/s, and the dense (no
/// sparsity) tensor-core rates of NVIDIA's H200 datasheet — TF32 494.7, FP16 and BF16
/// 989.4 TFLOP/s (the datasheet's 989 / 1,979 are with 2:4 sparsity).
pub const H200: GpuModel = GpuModel {
    name: "H200",
    sms: 132,
    bytes_per_s: 4.8e12,
    fp32_flops_per_s: 67e12,
    tf32_flops_per_s: 494.7e12,
    fp16_flops_per_s: 989.4e12,
    bf16_flops_per_s: 989.4e12,
};

/// A launch is under-filled when it touches more than this many elements on fewer than
/// [`UNDER_FILLED_WAVES`] blocks per SM: work enough for the whole GPU on part of it.
pub const UNDER_FILLED_ELEMENTS: u64 = 1_000_000;
pub const UNDER_FILLED_WAVES: u64 = 2;

impl GpuModel {
    /// The FLOP rate a launch of `kind` runs at.
    pub fn peak_flops_per_s(&self, kind: LaunchKind) -> f64 {
        match kind {
            LaunchKind::Gemm(Float::F16) => self.fp16_flops_per_s,
            LaunchKind::Gemm(Float::Bf16) => self.bf16_flops_per_s,
            LaunchKind::Gemm(Float::F32) | LaunchKind::Kernel | LaunchKind::Memset => {
                self.fp32_flops_per_s
            }
        }
    }

    /// The fraction of the GPU a launch occupies: `min(blocks, SMs) / SMs` for a kernel,
    /// 1 for a GEMM or a memset (their grids are cuBLAS's and the driver's choice).
    pub fn occupied(&self, r: &LaunchRecord) -> f64 {
        match r.kind {
            LaunchKind::Kernel => r.blocks.clamp(1, self.sms as u64) as f64 / self.sms as f64,
            LaunchKind::Gemm(_) | LaunchKind::Memset => 1.0,
        }
    }

    /// Modelled seconds: `max(bytes / bandwidth, FLOPs / peak)` over the share of SMs the
    /// launch occupies. Launch overhead and caches are not modelled.
    pub fn launch_seconds(&self, r: &LaunchRecord) -> f64 {
        let memory = r.bytes as f64 / self.bytes_per_s;
        let compute = r.flops as f64 / self.peak_flops_per_s(r.kind);
        memory.max(compute) / self.occupied(r)
    }

    /// Whether a kernel leaves the GPU mostly idle: fewer than 2 blocks per SM while touching
    /// over a million elements. GEMMs and memsets never are (not memwise's grid).
    pub fn under_filled(&self, r: &LaunchRecord) -> bool {
        r.kind == LaunchKind::Kernel
            && r.blocks < UNDER_FILLED_WAVES * self.sms as u64
            && r.elements > UNDER_FILLED_ELEMENTS
    }

    /// The modelled step: the sum of its launches' times (one stream, no overlap).
    pub fn step_seconds(&self, records: &[LaunchRecord]) -> f64 {
        records.iter().map(|r| self.launch_seconds(r)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memwise_plan::{plan, zoo};

    fn record(
        kind: LaunchKind,
        blocks: u64,
        bytes: u64,
        flops: u64,
        elements: u64,
    ) -> LaunchRecord {
        LaunchRecord {
            step: None,
            kernel: "k".into(),
            kind,
            grid: [blocks as u32, 1, 1],
            block: [256, 1, 1],
            blocks,
            bytes,
            flops,
            elements,
        }
    }

    /// The MLP's step: two dense layers, so five GEMMs — each layer's forward, both weight
    /// gradients, and the output layer's input gradient (the u8 pixels take none) — with
    /// 2·m·n·k FLOPs each, issued by the steps of their layers.
    #[test]
    fn the_mlp_step_has_its_five_gemms() {
        let p = plan(&zoo::mnist_mlp(128)).unwrap();
        let records = trace_training_step(&p, 1).unwrap();
        let gemms: Vec<&LaunchRecord> = records
            .iter()
            .filter(|r| matches!(r.kind, LaunchKind::Gemm(Float::F32)))
            .collect();
        let mut flops: Vec<u64> = gemms.iter().map(|r| r.flops).collect();
        flops.sort();
        let (hidden, out) = (2 * 128 * 784 * 512, 2 * 128 * 512 * 10);
        assert_eq!(flops, vec![out, out, out, hidden, hidden]);
        for g in &gemms {
            let tag = g.step.as_ref().expect("a GEMM belongs to a step");
            assert_eq!(tag.op, "dense", "{}", g.kernel);
            assert!(g.kernel.starts_with("cublas gemm "), "{}", g.kernel);
            assert!(!H200.under_filled(g));
        }
        // The forward GEMM of the hidden layer: C (512 × 128, column-major) from W and x.
        let fwd = gemms
            .iter()
            .find(|r| r.step.as_ref().unwrap().phase == Phase::Forward && r.flops == hidden)
            .unwrap();
        assert_eq!(fwd.kernel, "cublas gemm 512×128×784");
        assert_eq!(fwd.bytes, 4 * (784 * 512 + 128 * 784 + 128 * 512));
        // Only the step's frame is outside a step: the gradients' memset before the steps,
        // the loss value's copy into the scalars block (read back with them) after.
        let untagged: Vec<&str> = records
            .iter()
            .filter(|r| r.step.is_none())
            .map(|r| r.kernel.as_str())
            .collect();
        assert_eq!(untagged, ["memset", "mw_copy_u8"]);
    }

    /// Every step's records carry the planner's FLOPs for it (its GEMMs' when those exceed
    /// the planner's count), and kernels share theirs by bytes.
    #[test]
    fn the_records_carry_the_planned_flops() {
        let p = plan(&zoo::conv_vae(4)).unwrap();
        let records = trace_training_step(&p, 1).unwrap();
        for s in p.steps.iter() {
            let mine: Vec<&LaunchRecord> = records
                .iter()
                .filter(|r| r.step.as_ref().is_some_and(|t| t.index == s.index))
                .collect();
            let gemm: u64 = mine
                .iter()
                .filter(|r| matches!(r.kind, LaunchKind::Gemm(_)))
                .map(|r| r.flops)
                .sum();
            let all: u64 = mine.iter().map(|r| r.flops).sum();
            let kernels = mine.iter().any(|r| r.kind == LaunchKind::Kernel);
            let planned = p.step_cost(s).flops;
            let want = if kernels { planned.max(gemm) } else { gemm };
            assert_eq!(
                all,
                want,
                "step {} ({:?} {})",
                s.index,
                s.phase,
                s.op.name()
            );
        }
    }

    /// The executor's own walk issues the same commands as the traced step (the trace only
    /// adds the step marks).
    #[test]
    fn the_trace_issues_what_the_executor_issues() {
        let p = plan(&zoo::mnist_mlp(8)).unwrap();
        let traced = trace_training_step(&p, 3).unwrap();
        let mut ex =
            super::super::GpuExecutor::new(p.clone(), &Device::cpu(), TraceBackend::new(), 3)
                .unwrap();
        let raw = crate::reference::random_inputs(&p, 1);
        let labels: Vec<i32> = raw[1]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let batch = [crate::Batch::U8(&raw[0]), crate::Batch::I32(&labels)];
        ex.train_step(&batch).unwrap();
        let walked = ex.backend().take();
        let names = |r: &[Recorded]| -> Vec<String> {
            r.iter()
                .map(|c| match &c.command {
                    Command::Launch(k) => k.name.clone(),
                    Command::Gemm(g, _) => format!("gemm {} {} {}", g.m, g.n, g.k),
                    Command::Memset { bytes, .. } => format!("memset {bytes}"),
                })
                .collect()
        };
        let traced_names: Vec<String> = traced
            .iter()
            .map(|r| match r.kind {
                LaunchKind::Kernel => r.kernel.clone(),
                LaunchKind::Gemm(_) => r.kernel.replace("cublas ", "").replace('×', " "),
                LaunchKind::Memset => format!("memset {}", r.bytes),
            })
            .collect();
        assert_eq!(names(&walked), traced_names);
        assert!(walked.iter().all(|r| r.step.is_none()));
    }

    /// An address anywhere inside a tensor or a persistent slot resolves to it; among
    /// tensors sharing bytes, the one the step touches wins; padding and null resolve to none.
    #[test]
    fn a_pointer_into_a_tensor_resolves_to_that_tensor() {
        let p = plan(&zoo::mnist_mlp(16)).unwrap();
        let (arena, persistent) = (1 << 40, 1 << 41);
        let map = AddressMap::new(&p, arena, persistent);
        for s in p.steps.iter() {
            for &id in s.reads.iter().chain(s.writes.iter()) {
                if id == memwise_plan::NONE {
                    continue;
                }
                let t = p.tensor(id);
                let bytes = t.elems() as u64 * t.dtype.size();
                for at in [0, bytes / 2, bytes - 1] {
                    let got = map.resolve(arena + t.offset + at, Some(s), &p).unwrap();
                    // An in-place op's input and output share their bytes: either is right.
                    let Slot::Tensor(g) = got.slot else {
                        panic!("step {}: {:?}", s.index, got.slot)
                    };
                    let other = p.tensor(g);
                    let in_place = other.in_place_of == id || t.in_place_of == g;
                    assert!(g == id || in_place, "step {} +{at}: {g} for {id}", s.index);
                    if g == id {
                        assert_eq!((got.bytes, got.elems), (bytes, t.elems() as u64));
                    }
                }
            }
        }
        let w = &p.params[0];
        let mid = persistent + w.grad_offset + 4 * w.elems() as u64 / 2 + 2;
        assert_eq!(map.resolve(mid, None, &p).unwrap().slot, Slot::Grad(0));
        let scalars = persistent + p.persistent_bytes + 8;
        assert_eq!(map.resolve(scalars, None, &p).unwrap().slot, Slot::Scalars);
        assert!(map.resolve(0, None, &p).is_none());
        assert!(map.resolve(arena + p.arena_bytes + 1, None, &p).is_none());
    }

    #[test]
    fn an_under_filled_launch_is_flagged_and_a_filled_one_is_not() {
        let big = 2_000_000;
        assert!(H200.under_filled(&record(LaunchKind::Kernel, 100, 0, 0, big)));
        assert!(H200.under_filled(&record(LaunchKind::Kernel, 263, 0, 0, big)));
        assert!(!H200.under_filled(&record(LaunchKind::Kernel, 264, 0, 0, big)));
        assert!(!H200.under_filled(&record(LaunchKind::Kernel, 1, 0, 0, 1_000_000)));
        assert!(!H200.under_filled(&record(LaunchKind::Gemm(Float::F32), 0, 0, 0, big)));
        assert!(!H200.under_filled(&record(LaunchKind::Memset, 0, 0, 0, big)));
    }

    /// The formula on numbers worked by hand: 4.8 GB take 1 ms at 4.8 TB/s on ≥ 132 blocks,
    /// 2 ms on 66; 67 GFLOP of f32 take 1 ms; a BF16 GEMM runs at 989.4 TFLOP/s on the whole
    /// GPU whatever its grid.
    #[test]
    fn the_modelled_time_is_the_roofline_over_the_occupied_share() {
        let ms = |r: &LaunchRecord| H200.launch_seconds(r) * 1e3;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.max(1.0);
        assert!(close(
            ms(&record(LaunchKind::Kernel, 132, 4_800_000_000, 0, 1)),
            1.0
        ));
        assert!(close(
            ms(&record(LaunchKind::Kernel, 5000, 4_800_000_000, 0, 1)),
            1.0
        ));
        assert!(close(
            ms(&record(LaunchKind::Kernel, 66, 4_800_000_000, 0, 1)),
            2.0
        ));
        assert!(close(
            ms(&record(LaunchKind::Kernel, 1, 4_800_000_000, 0, 1)),
            132.0
        ));
        // Compute-bound: 67 GFLOP at 67 TFLOP/s, the bytes needing only 0.1 ms.
        let k = record(LaunchKind::Kernel, 264, 480_000_000, 67_000_000_000, 1);
        assert!(close(ms(&k), 1.0));
        let g = record(LaunchKind::Gemm(Float::Bf16), 0, 0, 989_400_000_000, 1);
        assert!(close(ms(&g), 1.0));
        let f = record(LaunchKind::Gemm(Float::F32), 0, 0, 67_000_000_000, 1);
        assert!(close(ms(&f), 1.0));
        assert!(close(H200.step_seconds(&[k, g, f]) * 1e3, 3.0));
    }
}
