//! The cudarc backend of [`CudaKernels`](super::CudaKernels) (feature `cuda`), and the
//! process-wide cache of opened devices that [`crate::Device::cuda`] fills.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use memwise_kernels::cublas_map::{CublasGemm, GemmBuffers};
use memwise_kernels::cuda::device::{CudaDevice, DeviceBuffer, Lane, PinnedStaging};
use memwise_kernels::cuda::KernelCall;
use memwise_plan::StaticPlan;

use memwise_kernels::cuda::device::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use memwise_kernels::cuda::device::cudarc::driver::CudaGraph;

use super::{Backend, GpuExecutor};
use crate::device::{Device, DeviceKind};
use crate::error::{Result, RuntimeError};
use crate::kernels::DeviceTurn;

/// What an executor keeps free beyond its plan on a CUDA device: cuBLAS loads the kernels of
/// a GEMM shape at its first call (CUDA's lazy loading), and a graph's instantiation takes
/// device memory. Measured on an H200 (`GPU_CHECK_PROBE=1 gpu_check`): the MLP's first step
/// +2 MiB, its capture +0; 32 MiB leaves room for larger models' GEMM shapes.
pub const LAZY_ALLOCATION_HEADROOM: u64 = 32 << 20;

/// Opens CUDA device `ordinal` once per process (its context and compiled kernels) and hands
/// out the same one afterwards. An `Err` says what is missing (libraries, driver, device).
/// Every kernel module is loaded at open (compiled, or read from the module cache), so that
/// no executor's step loads one later: module memory is taken before any plan is checked
/// against the free memory.
pub fn open(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap();
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(CudaDevice::open(ordinal).map_err(RuntimeError::Device)?);
    d.load_all().map_err(RuntimeError::Device)?;
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// A [`Backend`] on a CUDA device: plain `cuMemAlloc` buffers owned here, launches and
/// cuBLAS calls on a [`Lane`] (its stream, cuBLAS handle and workspace), and one captured
/// graph. Each trainer has a lane of its own, so two trainers never interleave or catch each
/// other's work in a capture; its inference engines share it (a lane's cuBLAS handle and
/// workspace take about 100 MiB on an H200, measured by the GPU self-check), taking turns a
/// step at a time ([`DeviceTurn`]).
pub struct CudaBackend {
    // The graph and buffers go before the lane whose stream they were made on.
    graph: Option<CudaGraph>,
    buffers: Vec<DeviceBuffer>,
    /// The pinned buffers the inputs are uploaded through (`reserve_input_staging`).
    staging: Option<PinnedStaging>,
    lane: Arc<Lane>,
    turn: Arc<DeviceTurn>,
}

impl CudaBackend {
    /// A backend on `dev` with a new lane.
    pub fn new(dev: Arc<CudaDevice>) -> std::result::Result<CudaBackend, String> {
        Ok(CudaBackend {
            graph: None,
            buffers: Vec::new(),
            staging: None,
            lane: Arc::new(Lane::open(dev)?),
            turn: Arc::default(),
        })
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        self.lane.device()
    }

    pub fn lane(&self) -> &Lane {
        &self.lane
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!(
            "cuda:{} ({})",
            self.device().info().ordinal,
            self.device().info().name
        )
    }

    fn memory(&self) -> Option<(u64, u64)> {
        self.device().mem_get_info().ok()
    }

    fn headroom(&self) -> u64 {
        LAZY_ALLOCATION_HEADROOM
    }

    fn lane_bytes(&self) -> Option<u64> {
        Some(self.lane.device_bytes())
    }

    fn fork_collective(&self) -> std::result::Result<Option<u64>, String> {
        self.lane.fork_collective().map(Some)
    }

    fn join_collectives(&self) -> std::result::Result<(), String> {
        self.lane.join_collectives()
    }

    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String> {
        let b = self.lane.alloc_zeroed(bytes)?;
        let ptr = b.ptr();
        self.buffers.push(b);
        Ok(ptr)
    }

    fn reserve_input_staging(&mut self, bytes: usize) -> std::result::Result<(), String> {
        self.staging = Some(self.lane.pinned_staging(bytes)?);
        Ok(())
    }

    unsafe fn upload_inputs(&mut self, parts: &[(&[u8], u64)]) -> std::result::Result<(), String> {
        match self.staging.as_mut() {
            Some(staging) => self.lane.htod_staged(staging, parts),
            None => parts
                .iter()
                .try_for_each(|&(b, dst)| self.lane.htod(b, dst)),
        }
    }

    unsafe fn upload(&self, src: &[u8], dst: u64) -> std::result::Result<(), String> {
        // From pageable host memory the driver stages the bytes before the call returns, so
        // `src` may go right after (and the copy is ordered before later launches).
        self.lane.htod(src, dst)
    }

    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        self.lane.dtoh(src, dst)
    }

    unsafe fn memset(&self, dst: u64, bytes: usize, value: u8) -> std::result::Result<(), String> {
        self.lane.memset(dst, bytes, value)
    }

    unsafe fn launch(&self, call: &KernelCall) -> std::result::Result<(), String> {
        self.lane.launch(call)
    }

    unsafe fn gemm(&self, g: &CublasGemm, bufs: GemmBuffers) -> std::result::Result<(), String> {
        self.lane.gemm(g, bufs)
    }

    fn synchronize(&self) -> std::result::Result<(), String> {
        self.lane.synchronize()
    }

    fn begin_capture(&mut self) -> std::result::Result<bool, String> {
        // Every module must be loaded before a capture (no compilation inside it).
        self.device().load_all()?;
        self.lane.synchronize()?;
        self.lane
            .stream()
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("beginning the graph capture: {e:?}"))?;
        Ok(true)
    }

    fn end_capture(&mut self) -> std::result::Result<(), String> {
        let g = self
            .lane
            .stream()
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| format!("ending the graph capture: {e:?}"))?;
        self.graph = g;
        Ok(())
    }

    fn replay(&self) -> std::result::Result<(), String> {
        match &self.graph {
            Some(g) => g
                .launch()
                .map_err(|e| format!("launching the graph: {e:?}")),
            None => Err("no captured graph".into()),
        }
    }

    fn clear_graph(&mut self) {
        self.graph = None;
    }

    fn turn(&self) -> Option<&Arc<DeviceTurn>> {
        Some(&self.turn)
    }

    fn open_another(&self) -> std::result::Result<CudaBackend, String> {
        Ok(CudaBackend {
            graph: None,
            buffers: Vec::new(),
            // Its executor reserves its own (its inputs are its plan's).
            staging: None,
            lane: self.lane.clone(),
            turn: self.turn.clone(),
        })
    }
}

/// The CUDA executor: the walk of a plan over [`CudaKernels`](super::CudaKernels) on a
/// [`CudaBackend`].
pub type CudaExecutor = GpuExecutor<CudaBackend>;

impl GpuExecutor<CudaBackend> {
    /// Builds the executor of `plan` on CUDA `device`: checks the plan against the free
    /// device memory, allocates its two regions, initialises the weights like the CPU
    /// executor for `seed`.
    pub fn on_cuda(plan: StaticPlan, device: &Device, seed: u64) -> Result<CudaExecutor> {
        let DeviceKind::Cuda { ordinal, .. } = device.kind else {
            return Err(RuntimeError::Device(format!(
                "{} is not a CUDA device",
                device.name()
            )));
        };
        let backend = CudaBackend::new(open(ordinal)?).map_err(RuntimeError::Device)?;
        GpuExecutor::new(plan, device, backend, seed)
    }
}
