//! Host emulation of memwise's CUDA kernels, for tests on machines without a GPU.
//!
//! `build.rs` compiles every `kernels/cuda/*.cu` as C++ with `kernels/cuda/emu/shim.h` (thread
//! and block indices, `__syncthreads` as a barrier across the block's threads, per-block
//! `__shared__` storage, the warp shuffles, the 16-bit conversions) into one static library.
//! [`launch`] runs a kernel's grid on the calling thread — blocks one after another, each
//! block's threads as fibers — taking its arguments the way `cuLaunchKernel` does (one pointer
//! per parameter) plus the caller's signature string, which must match the kernel's.
//!
//! Nothing here knows the kernels' meaning: `kernels/tests/cuda_emulation.rs` compares every
//! kernel against the CPU kernels.
//!
//! Two checks are stricter than a GPU's luck (docs/CUDA.md, "Emulation"): every block's
//! `__shared__` variables start as NaN (0xFF bytes), always; and a launch can log every
//! global and shared memory access of the kernel code and fail on a data race — with
//! `MW_EMU_RACES=1`, or [`check_races`] on the calling thread. That check is slow (a hash
//! lookup per byte accessed), so it is off by default.

use std::ffi::{c_char, c_void, CStr, CString};

extern "C" {
    fn mw_emu_kernel_count() -> u32;
    fn mw_emu_kernel_name(i: u32) -> *const c_char;
    fn mw_emu_kernel_bound(i: u32) -> u32;
    fn mw_emu_kernel_sig(i: u32, out: *mut c_char, len: usize) -> i32;
    fn mw_emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        args: *mut *mut c_void,
        sig: *const c_char,
        err: *mut c_char,
        errlen: usize,
        only: *const u32,
        n_only: u32,
    ) -> i32;
    fn mw_emu_check_races(on: i32);
    fn mw_emu_races_available() -> i32;
}

/// Race checks for the launches made on the calling OS thread: `Some(true)` on, `Some(false)`
/// off, `None` as the `MW_EMU_RACES` environment variable says (`1`: on). A checked launch
/// fails with an error naming the memory (`parameter k + n bytes`, or the shared variable) and
/// the two threads when two threads of the launch access one byte, at least one of them
/// writing, and no `__syncthreads` of one block orders them (blocks are never ordered).
/// Atomics are exempt.
pub fn check_races(on: Option<bool>) {
    // SAFETY: sets a thread-local flag.
    unsafe { mw_emu_check_races(on.map_or(-1, i32::from)) }
}

/// Whether this build of the emulator can check for races: it needs GCC's `-fsanitize=thread`
/// instrumentation, whose hooks the emulator defines (kernels/cuda-emu/build.rs).
pub fn races_available() -> bool {
    // SAFETY: reads a constant.
    unsafe { mw_emu_races_available() != 0 }
}

/// Every kernel in the sources, with its parameter signature (`p` pointer, `f` f32, `d` f64,
/// `i` i32, `u` u32, `q` i64, `Q` u64, `sN` an N-byte struct; comma-separated).
pub fn kernels() -> Vec<(String, String)> {
    // SAFETY: the registry is a static table.
    unsafe {
        (0..mw_emu_kernel_count())
            .map(|i| {
                let mut buf = vec![0u8; 512];
                mw_emu_kernel_sig(i, buf.as_mut_ptr() as *mut c_char, buf.len());
                let sig = CStr::from_ptr(buf.as_ptr() as *const c_char)
                    .to_string_lossy()
                    .into_owned();
                (kernel_name(i), sig)
            })
            .collect()
    }
}

/// The name of registry entry `i` (below `mw_emu_kernel_count()`).
fn kernel_name(i: u32) -> String {
    // SAFETY: `i` is in the static registry, whose names are NUL-terminated literals.
    unsafe { CStr::from_ptr(mw_emu_kernel_name(i)) }
        .to_string_lossy()
        .into_owned()
}

/// Every kernel with its `__launch_bounds__` (the most threads a block may have; 0 where it
/// declares none). A launch with a larger block is refused, as a GPU refuses it.
pub fn launch_bounds() -> Vec<(String, u32)> {
    // SAFETY: the registry is a static table.
    (0..unsafe { mw_emu_kernel_count() })
        .map(|i| (kernel_name(i), unsafe { mw_emu_kernel_bound(i) }))
        .collect()
}

/// Runs kernel `name` over `grid` × `block` threads on the CPU.
///
/// # Safety
/// `args` holds one pointer per kernel parameter, each to a value of the parameter's type
/// (checked against `sig`); pointer parameters must point at host memory large enough for
/// what the kernel touches — exactly the contract of `cuLaunchKernel` with device memory.
pub unsafe fn launch(
    name: &str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &[*mut c_void],
    sig: &str,
) -> Result<(), String> {
    launch_blocks(name, grid, block, args, sig, None)
}

/// [`launch`], running only the blocks in `only` (`None`: the whole grid). For launches too
/// large to run whole: a test of indices past 2³² over sparse memory runs the few blocks it
/// checks, each exactly as it runs in the whole grid.
///
/// # Safety
/// As [`launch`], for the memory the listed blocks touch.
pub unsafe fn launch_blocks(
    name: &str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &[*mut c_void],
    sig: &str,
    only: Option<&[[u32; 3]]>,
) -> Result<(), String> {
    let only_flat: Vec<u32> = only.unwrap_or(&[]).iter().flatten().copied().collect();
    let n_only = u32::try_from(only.map_or(0, <[_]>::len)).map_err(|e| e.to_string())?;
    let cname = CString::new(name).map_err(|e| e.to_string())?;
    let csig = CString::new(sig).map_err(|e| e.to_string())?;
    let mut args = args.to_vec();
    let mut err = vec![0u8; 4096];
    let rc = mw_emu_launch(
        cname.as_ptr(),
        grid.as_ptr(),
        block.as_ptr(),
        args.as_mut_ptr(),
        csig.as_ptr(),
        err.as_mut_ptr() as *mut c_char,
        err.len(),
        if only.is_some() {
            only_flat.as_ptr()
        } else {
            std::ptr::null()
        },
        n_only,
    );
    if rc == 0 {
        Ok(())
    } else {
        Err(CStr::from_ptr(err.as_ptr() as *const c_char)
            .to_string_lossy()
            .into_owned())
    }
}
