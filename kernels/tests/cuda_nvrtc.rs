//! With the `cuda` feature: every kernel module compiles through NVRTC exactly as the device
//! compiles it on first use (`kernels::cuda::device::compile_module`), when libnvrtc can be
//! loaded — no GPU needed (`scripts/compile-cuda.sh` installs one; set LD_LIBRARY_PATH to its
//! lib folder). Without libnvrtc the test says so and checks that the absence is an `Err`.
#![cfg(feature = "cuda")]

use memwise_kernels::cuda::device::{compile_module, libraries_present, nvrtc_version};
use memwise_kernels::cuda::sources::SOURCES;

#[test]
fn every_module_compiles_with_nvrtc_or_its_absence_is_an_error() {
    // SAFETY: only tries to load the library.
    let present = unsafe { memwise_kernels::cuda::device::cudarc::nvrtc::sys::is_culib_present() };
    for s in SOURCES {
        match compile_module(s.module, "sm_90") {
            Ok(compiled) => {
                assert!(present);
                let entries: Vec<&str> = compiled
                    .ptx
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
                    .map(|l| l.split('(').next().unwrap())
                    .collect();
                println!(
                    "{}: {} kernels, CUBIN {} bytes",
                    s.module,
                    entries.len(),
                    compiled.cubin.len()
                );
                assert!(!entries.is_empty(), "{}", s.module);
                // The device loads the CUBIN: an ELF image holding every kernel's symbol.
                assert_eq!(&compiled.cubin[..4], b"\x7fELF", "{}", s.module);
                for e in &entries {
                    let needle = e.as_bytes();
                    assert!(
                        compiled.cubin.windows(needle.len()).any(|w| w == needle),
                        "{}: kernel {e} not in the CUBIN",
                        s.module
                    );
                }
            }
            Err(e) => {
                assert!(!present, "{}: {e}", s.module);
                assert!(e.contains("libnvrtc"), "{e}");
            }
        }
    }
    if present {
        let (major, minor) = nvrtc_version().unwrap();
        println!("NVRTC {major}.{minor}");
        assert!(major >= 12, "NVRTC {major}.{minor}");
    } else {
        println!("libnvrtc not found: NVRTC compilation not checked here");
        assert!(nvrtc_version().unwrap_err().contains("libnvrtc"));
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
