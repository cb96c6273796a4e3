//! NVRTC compilation of one kernel module to a CUBIN for one architecture (feature `cuda`),
//! and the NVRTC and driver versions that key the module cache.
//!
//! cudarc's safe NVRTC wrapper returns PTX only; the device loads CUBIN (see
//! `module_cache.rs` for why), so the program is driven here through cudarc's raw NVRTC calls.
//! Needs libnvrtc, not a GPU.

use std::ffi::{c_char, c_int, CString};

use cudarc::nvrtc::{result as rtc, sys as rtc_sys};

use super::module_cache::fingerprint;
use super::sources;

/// Options every module is compiled with (besides `--gpu-architecture`); kept in sync with
/// `scripts/nvrtc_check.py`, which compiles the same way in CI.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17"];

/// A module as NVRTC made it: the CUBIN the device loads, and the PTX (what the kernels
/// compile to before assembly; the tests read its `.entry` lines).
pub struct CompiledModule {
    pub cubin: Vec<u8>,
    pub ptx: String,
}

fn libnvrtc_present() -> Result<(), String> {
    // SAFETY: only tries to load the library.
    if unsafe { rtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err("libnvrtc could not be loaded; add its folder to LD_LIBRARY_PATH".into())
    }
}

/// The NVRTC library's `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    libnvrtc_present()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { rtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// The fingerprint of every module source and [`NVRTC_OPTIONS`], for the cache key.
pub fn sources_fingerprint() -> u64 {
    let parts = std::iter::once(sources::COMMON)
        .chain(sources::SOURCES.iter().map(|s| s.text))
        .chain(NVRTC_OPTIONS.iter().copied());
    fingerprint(parts)
}

/// Compiles kernel module `module` for `arch` (`sm_90` …), as on first use: the module's
/// source after `common.cuh`, no include path, [`NVRTC_OPTIONS`]. An `Err` (never cudarc's
/// panic) without libnvrtc, with the compile log on a compile error.
pub fn compile_module(module: &str, arch: &str) -> Result<CompiledModule, String> {
    libnvrtc_present()?;
    let src =
        sources::module_source(module).ok_or_else(|| format!("no kernel module `{module}`"))?;
    let src = CString::new(src).map_err(|_| format!("{module}.cu holds a NUL byte"))?;
    let name = CString::new(format!("{module}.cu")).expect("module names hold no NUL");
    let prog = rtc::create_program(&src, Some(&name))
        .map_err(|e| format!("NVRTC creating {module}.cu: {e:?}"))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` was created above and is destroyed once, below; `src` and `name` outlive it.
    let out = unsafe { compiled_outputs(prog, &options) };
    // SAFETY: as above.
    let _ = unsafe { rtc::destroy_program(prog) };
    out.map_err(|e| format!("NVRTC compiling {module}.cu for {arch}: {e}"))
}

/// Compiles `prog` and reads back its CUBIN and PTX.
///
/// # Safety
/// `prog` must be a live program from `create_program`.
unsafe fn compiled_outputs(
    prog: rtc_sys::nvrtcProgram,
    options: &[String],
) -> Result<CompiledModule, String> {
    if let Err(e) = rtc::compile_program(prog, options) {
        let log = rtc::get_program_log(prog)
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        return Err(format!("{e:?}\n{log}"));
    }
    let mut size = 0usize;
    rtc_sys::nvrtcGetCUBINSize(prog, &mut size)
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    if size == 0 {
        return Err("no CUBIN: the architecture must be a real one (sm_XX, not compute_XX)".into());
    }
    let mut cubin = vec![0u8; size];
    rtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    let ptx = rtc::get_ptx(prog).map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
    Ok(CompiledModule {
        cubin,
        ptx: c_chars_to_string(&ptx),
    })
}

/// NVRTC's NUL-terminated text as a `String`.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
