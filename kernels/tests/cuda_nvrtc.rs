//! With the `cuda` feature: every kernel module compiles through NVRTC exactly as the device
//! compiles it on first use (`kernels::cuda::device::compile_module`), when libnvrtc can be
//! loaded — no GPU needed (`scripts/compile-cuda.sh` installs one; set LD_LIBRARY_PATH to its
//! lib folder). Without libnvrtc the test says so and checks that the absence is an `Err`.
#![cfg(feature = "cuda")]

use memwise_kernels::cuda::device::{compile_module, libraries_present};
use memwise_kernels::cuda::sources::SOURCES;

#[test]
fn every_module_compiles_with_nvrtc_or_its_absence_is_an_error() {
    // SAFETY: only tries to load the library.
    let present = unsafe { memwise_kernels::cuda::device::cudarc::nvrtc::sys::is_culib_present() };
    for s in SOURCES {
        match compile_module(s.module, "sm_90") {
            Ok(ptx) => {
                assert!(present);
                let text = ptx.to_src();
                let entries = text.matches(".entry ").count();
                println!("{}: {entries} kernels", s.module);
                assert!(entries > 0, "{}", s.module);
            }
            Err(e) => {
                assert!(!present, "{}: {e}", s.module);
                assert!(e.contains("libnvrtc"), "{e}");
            }
        }
    }
    if !present {
        println!("libnvrtc not found: NVRTC compilation not checked here");
    }
    // Without a driver, opening a device is an Err naming what is missing, never a panic.
    // SAFETY: only tries to load the library.
    if !unsafe { memwise_kernels::cuda::device::cudarc::driver::sys::is_culib_present() } {
        let e = libraries_present().unwrap_err();
        assert!(e.contains("libcuda"), "{e}");
        let e = memwise_kernels::cuda::device::CudaDevice::open(0)
            .err()
            .unwrap();
        assert!(e.contains("libcuda"), "{e}");
    }
}
