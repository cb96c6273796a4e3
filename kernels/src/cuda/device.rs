//! One CUDA device through cudarc (feature `cuda`): its context and stream, plain device
//! allocations, the kernels compiled with NVRTC to CUBIN on first use of their module (cached in
//! memory and on disk, `module_cache.rs`), launches of [`KernelCall`]s, and cuBLAS GEMMs of
//! mapped [`CublasGemm`]s.
//!
//! cudarc is built with dynamic loading: nothing about CUDA is needed to build or to run
//! without a GPU. [`CudaDevice::open`] first checks that libcuda, libnvrtc and libcublas can
//! be loaded (cudarc would panic on a missing library), that the driver is new enough for the
//! bindings and for this NVRTC, and that the device exists, and says what is missing as an
//! `Err`.
//!
//! Memory is raw: [`DeviceBuffer`] is one `cuMemAlloc` (never managed memory); kernels and
//! GEMMs take `u64` device addresses (a buffer's base plus a planned offset), so the
//! executor's views are integer arithmetic and nothing is allocated per step.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule, CudaStream,
};
use cudarc::nvrtc::Ptx;

/// The cudarc this crate was built with, for the runtime's graph and stream types.
pub use cudarc;

use super::compile::sources_fingerprint;
pub use super::compile::{compile_module, nvrtc_version, CompiledModule, NVRTC_OPTIONS};
use super::launch::{Float, KernelCall};
use super::module_cache::{check_versions, ModuleCache, ModuleKey};
use super::sources;
use crate::cublas_map::CublasGemm;

/// cuBLAS workspace set on the handle (NVIDIA's recommendation for Hopper), so captured
/// graphs never allocate.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A device error, as a message.
pub type DeviceResult<T> = Result<T, String>;

fn err(what: &str) -> impl Fn(drv::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// Checks that the three libraries can be loaded, naming the first that cannot.
pub fn libraries_present() -> DeviceResult<()> {
    // SAFETY: these only try to dlopen the libraries.
    let (cuda, rtc, blas) = unsafe {
        (
            drv_sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            blas_sys::is_culib_present(),
        )
    };
    let missing = |lib: &str, hint: &str| {
        Err(format!(
            "{lib} could not be loaded ({hint}); add its folder to LD_LIBRARY_PATH"
        ))
    };
    if !cuda {
        return missing(
            "libcuda (the NVIDIA driver)",
            "no NVIDIA driver on this machine?",
        );
    }
    if !rtc {
        return missing(
            "libnvrtc.so.13",
            "the CUDA 13 toolkit, or the nvidia-cuda-nvrtc wheel, provides it",
        );
    }
    if !blas {
        return missing(
            "libcublas.so.13",
            "the CUDA 13 toolkit, or the nvidia-cublas wheel, provides it",
        );
    }
    Ok(())
}

/// What a device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability `(major, minor)`; 9.0 on an H100/H200.
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
}

/// One plain device allocation, freed on drop.
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// The device address of byte 0 (0 for an empty buffer).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by cuMemAlloc in this context and freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// The element type of a GEMM operand.
fn data_type(f: Float) -> blas_sys::cudaDataType {
    match f {
        Float::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        Float::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        Float::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
    }
}

/// One CUDA device, ready to launch.
pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_workspace: DeviceBuffer,
    arch: &'static str,
    /// As `cuDriverGetVersion` reports it, and NVRTC's `(major, minor)`: part of the cache key.
    driver_version: i32,
    nvrtc_version: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    cache: Option<ModuleCache>,
}

/// The CUDA version the driver supports, as `cuDriverGetVersion` encodes it (13020 = 13.2).
pub fn driver_version() -> DeviceResult<i32> {
    let mut v: c_int = 0;
    // SAFETY: one out-parameter; the library was checked to load.
    unsafe { drv_sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(err("cuDriverGetVersion"))?;
    Ok(v)
}

impl CudaDevice {
    /// Opens device `ordinal`: checks the libraries and the device first (an `Err` with the
    /// reason, never a panic), then makes its context, a stream, and a cuBLAS handle.
    pub fn open(ordinal: usize) -> DeviceResult<CudaDevice> {
        libraries_present()?;
        let (driver_version, nvrtc_version) = (driver_version()?, nvrtc_version()?);
        check_versions(driver_version, nvrtc_version)?;
        let count = CudaContext::device_count().map_err(err("the CUDA driver did not start"))?;
        if ordinal as i32 >= count {
            return Err(format!("no CUDA device {ordinal}: the driver sees {count}"));
        }
        let ctx = CudaContext::new(ordinal).map_err(err("creating the CUDA context"))?;
        // Raw device addresses and one stream: the executor orders everything itself.
        // SAFETY: no cudarc slice is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| format!("creating the cuBLAS handle: {e:?}"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(err("reading the compute capability"))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(err("reading the device name"))?,
            compute_capability: (major, minor),
            total_bytes: ctx.total_mem().map_err(err("reading the memory size"))? as u64,
        };
        let ws = alloc_raw(&ctx, CUBLAS_WORKSPACE_BYTES)?;
        // SAFETY: the workspace outlives the handle (both owned by self; fields drop in order
        // blas first).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), ws.ptr as *mut c_void, ws.bytes)
                .result()
                .map_err(|e| format!("setting the cuBLAS workspace: {e:?}"))?
        };
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        Ok(CudaDevice {
            info,
            ctx,
            stream,
            blas,
            _blas_workspace: ws,
            arch,
            driver_version,
            nvrtc_version,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            cache: ModuleCache::from_env(),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_get_info(&self) -> DeviceResult<(u64, u64)> {
        let (f, t) = self.ctx.mem_get_info().map_err(err("cuMemGetInfo"))?;
        Ok((f as u64, t as u64))
    }

    /// One plain allocation of `bytes`, zeroed.
    pub fn alloc_zeroed(&self, bytes: usize) -> DeviceResult<DeviceBuffer> {
        let b = alloc_raw(&self.ctx, bytes)?;
        if bytes > 0 {
            // SAFETY: b is a fresh allocation of `bytes`.
            unsafe { drv::memset_d8_async(b.ptr, 0, bytes, self.stream.cu_stream()) }
                .map_err(err("cuMemsetD8"))?;
        }
        Ok(b)
    }

    /// Host → device copy of `src` to address `dst` (asynchronous on the stream; `src` must
    /// stay alive until the next [`CudaDevice::synchronize`]).
    ///
    /// # Safety
    /// `dst` must be a device address with room for `src`.
    pub unsafe fn htod<T>(&self, src: &[T], dst: u64) -> DeviceResult<()> {
        drv::memcpy_htod_async(dst, src, self.stream.cu_stream()).map_err(err("cuMemcpyHtoDAsync"))
    }

    /// Device → host copy into `dst` (waits for the stream first).
    ///
    /// # Safety
    /// `src` must be a device address holding `dst.len()` elements.
    pub unsafe fn dtoh<T>(&self, src: u64, dst: &mut [T]) -> DeviceResult<()> {
        drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
            .map_err(err("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Sets `bytes` bytes at `dst` to zero, on the stream.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be device memory.
    pub unsafe fn memset_zero(&self, dst: u64, bytes: usize) -> DeviceResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()).map_err(err("cuMemsetD8Async"))
    }

    pub fn synchronize(&self) -> DeviceResult<()> {
        self.stream
            .synchronize()
            .map_err(err("synchronising the stream"))
    }

    /// Compiles (or loads from the module cache) every module, so a later capture never
    /// compiles.
    pub fn load_all(&self) -> DeviceResult<()> {
        for s in sources::SOURCES {
            self.module(s.module)?;
        }
        Ok(())
    }

    fn module(&self, module: &'static str) -> DeviceResult<Arc<CudaModule>> {
        if let Some(m) = self.modules.lock().unwrap().get(module) {
            return Ok(m.clone());
        }
        let key = ModuleKey {
            module: module.to_string(),
            arch: self.arch.to_string(),
            nvrtc: self.nvrtc_version,
            driver: self.driver_version,
            fingerprint: sources_fingerprint(),
        };
        let cached = self.cache.as_ref().and_then(|c| c.load(&key));
        let m = match cached.map(|cubin| self.ctx.load_module(Ptx::from_binary(cubin))) {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                // A damaged or foreign file: compile again, and replace it.
                let cache = self.cache.as_ref().expect("read from the cache");
                eprintln!(
                    "memwise: the cached kernel module {} did not load ({e:?}); compiling it again",
                    cache.path(&key).display()
                );
                cache.discard(&key);
                self.compile_and_load(&key)?
            }
            None => self.compile_and_load(&key)?,
        };
        self.modules.lock().unwrap().insert(module, m.clone());
        Ok(m)
    }

    /// Compiles `key`'s module, loads it, and only then caches it (a CUBIN the driver refused
    /// is never written).
    fn compile_and_load(&self, key: &ModuleKey) -> DeviceResult<Arc<CudaModule>> {
        let compiled = compile_module(&key.module, self.arch)?;
        let m = self
            .ctx
            .load_module(Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| format!("loading the CUBIN of {}.cu: {e:?}", key.module))?;
        if let Some(cache) = &self.cache {
            if let Err(e) = cache.store(key, &compiled.cubin) {
                // Only costs a compile next time.
                eprintln!(
                    "memwise: could not cache kernel module {} ({e})",
                    cache.path(key).display()
                );
            }
        }
        Ok(m)
    }

    fn function(&self, name: &str) -> DeviceResult<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap().get(name) {
            return Ok(f.clone());
        }
        let src =
            sources::source_of(name).ok_or_else(|| format!("no module defines kernel `{name}`"))?;
        let f = self
            .module(src.module)?
            .load_function(name)
            .map_err(err("cuModuleGetFunction"))?;
        self.functions
            .lock()
            .unwrap()
            .insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Launches `call` on the stream.
    ///
    /// # Safety
    /// Every pointer argument must be a device address valid for what the kernel touches.
    pub unsafe fn launch(&self, call: &KernelCall) -> DeviceResult<()> {
        let f = self.function(&call.name)?;
        let mut params = call.params();
        let g = call.cfg.grid;
        let b = call.cfg.block;
        drv::launch_kernel(
            f.cu_function(),
            (g[0], g[1], g[2]),
            (b[0], b[1], b[2]),
            0,
            self.stream.cu_stream(),
            &mut params,
        )
        .map_err(|e| format!("launching {}: {e:?}", call.name))
    }

    /// Runs one mapped GEMM on cuBLAS (`cublasGemmStridedBatchedEx`, or `cublasGemmEx` for a
    /// single item) with f32 accumulation: `a`, `b`, `c` are the device addresses of the
    /// buffers `g.a.0`, `g.b.0`, `g.c.0` (element offsets are added here), of element types
    /// `types` (f16/bf16 operands with an f32 result is the master-gradient case).
    ///
    /// # Safety
    /// The addresses must hold what [`CublasGemm::extents`] says the call touches.
    pub unsafe fn gemm(
        &self,
        g: &CublasGemm,
        a: u64,
        b: u64,
        c: u64,
        types: [Float; 3],
    ) -> DeviceResult<()> {
        g.validate()?;
        let [ta, tb, tc] = types;
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (g.alpha, g.beta);
        let pa = (a + (g.a.1 * ta.size()) as u64) as *const c_void;
        let pb = (b + (g.b.1 * tb.size()) as u64) as *const c_void;
        let pc = (c + (g.c.1 * tc.size()) as u64) as *mut c_void;
        let h = *self.blas.handle();
        let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let r = if g.batch == 1 {
            blas_result::gemm_ex(
                h,
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                pa,
                data_type(ta),
                g.lda as i32,
                pb,
                data_type(tb),
                g.ldb as i32,
                &beta as *const f32 as *const c_void,
                pc,
                data_type(tc),
                g.ldc as i32,
                compute,
                algo,
            )
        } else {
            blas_result::gemm_strided_batched_ex(
                h,
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                pa,
                data_type(ta),
                g.lda as i32,
                g.stride_a as i64,
                pb,
                data_type(tb),
                g.ldb as i32,
                g.stride_b as i64,
                &beta as *const f32 as *const c_void,
                pc,
                data_type(tc),
                g.ldc as i32,
                g.stride_c as i64,
                g.batch as i32,
                compute,
                algo,
            )
        };
        r.map_err(|e| {
            format!(
                "cuBLAS GEMM {}x{}x{} (batch {}): {e:?}",
                g.m, g.n, g.k, g.batch
            )
        })
    }
}

fn alloc_raw(ctx: &Arc<CudaContext>, bytes: usize) -> DeviceResult<DeviceBuffer> {
    ctx.bind_to_thread().map_err(err("binding the context"))?;
    let ptr = if bytes == 0 {
        0
    } else {
        // SAFETY: a plain allocation; freed by DeviceBuffer's Drop.
        unsafe { drv::malloc_sync(bytes) }
            .map_err(|e| format!("cuMemAlloc of {bytes} bytes: {e:?}"))?
    };
    Ok(DeviceBuffer {
        ptr,
        bytes,
        ctx: ctx.clone(),
    })
}
