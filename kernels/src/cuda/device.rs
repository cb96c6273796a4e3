//! One CUDA device through cudarc (feature `cuda`): its context, plain device allocations, and
//! the kernels compiled with NVRTC to CUBIN on first use of their module (cached in memory and
//! on disk, `module_cache.rs`; the runtime loads every module when it opens the device). What
//! launches on it — a stream, a cuBLAS handle and its workspace — is a [`Lane`], one per
//! trainer, shared by its inference engines (`lane.rs`).
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
use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

/// The cudarc this crate was built with, for the runtime's graph and stream types.
pub use cudarc;

use super::compile::sources_fingerprint;
pub use super::compile::{compile_module, nvrtc_version, CompiledModule, NVRTC_OPTIONS};
pub use super::lane::{Lane, PinnedStaging, CUBLAS_WORKSPACE_BYTES};
use super::module_cache::{check_versions, ModuleCache, ModuleKey};
use super::sources;

/// A device error, as a message.
pub type DeviceResult<T> = Result<T, String>;

pub(super) fn err(what: &str) -> impl Fn(drv::DriverError) -> String + '_ {
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

/// One CUDA device: its context and the kernels compiled for it, shared by every [`Lane`]
/// on it.
pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
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
    /// Opens device `ordinal`: checks the libraries, the driver's version and the device first
    /// (an `Err` with the reason, never a panic), then makes its context.
    pub fn open(ordinal: usize) -> DeviceResult<CudaDevice> {
        libraries_present()?;
        let (driver_version, nvrtc_version) = (driver_version()?, nvrtc_version()?);
        check_versions(driver_version, nvrtc_version)?;
        let count = CudaContext::device_count().map_err(err("the CUDA driver did not start"))?;
        if ordinal as i32 >= count {
            return Err(format!("no CUDA device {ordinal}: the driver sees {count}"));
        }
        let ctx = CudaContext::new(ordinal).map_err(err("creating the CUDA context"))?;
        // Raw device addresses, and each engine on a stream of its own that it orders itself.
        // SAFETY: no cudarc slice is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(err("reading the compute capability"))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(err("reading the device name"))?,
            compute_capability: (major, minor),
            total_bytes: ctx.total_mem().map_err(err("reading the memory size"))? as u64,
        };
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        Ok(CudaDevice {
            info,
            ctx,
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

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the device's context current on the calling thread: every raw driver call does
    /// it first, so engines on several threads each find their context.
    pub(super) fn bind(&self) -> DeviceResult<()> {
        self.ctx
            .bind_to_thread()
            .map_err(err("binding the CUDA context"))
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_get_info(&self) -> DeviceResult<(u64, u64)> {
        self.bind()?;
        let (f, t) = self.ctx.mem_get_info().map_err(err("cuMemGetInfo"))?;
        Ok((f as u64, t as u64))
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

    pub(super) fn function(&self, name: &str) -> DeviceResult<CudaFunction> {
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
}

pub(super) fn alloc_raw(ctx: &Arc<CudaContext>, bytes: usize) -> DeviceResult<DeviceBuffer> {
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
