//! Devices: `cuda` and `cuda:N` parse; without a usable GPU (no feature, no driver, no
//! device) `Device::cuda` is an `Err` that says why, and `Device::auto()` falls back to the
//! CPU. On a machine with a GPU and the `cuda` feature, `auto` picks it.

use memwise_runtime::device::DeviceKind;
use memwise_runtime::{Device, RuntimeError};

#[test]
fn cuda_without_a_usable_gpu_is_an_error_and_auto_falls_back_to_the_cpu() {
    match Device::cuda(0) {
        Ok(d) => {
            // A GPU machine with the feature: auto must pick it.
            assert!(d.is_cuda());
            assert!(Device::auto().is_cuda());
            assert!(d.name().starts_with("cuda:0 ("), "{}", d.name());
        }
        Err(RuntimeError::Device(m)) => {
            let why = [
                "--features cuda",
                "libcuda",
                "libnvrtc",
                "libcublas",
                "no CUDA device",
            ];
            assert!(why.iter().any(|w| m.contains(w)), "unexplained: {m}");
            assert_eq!(Device::auto().kind, DeviceKind::Cpu);
        }
        Err(other) => panic!("not a device error: {other}"),
    }
    assert!(matches!(
        Device::parse("cuda:x"),
        Err(RuntimeError::Device(_))
    ));
    assert!(matches!(Device::parse("tpu"), Err(RuntimeError::Device(_))));
    assert_eq!(Device::parse("cpu").unwrap(), Device::cpu());
    let limited = Device::cpu().with_memory_limit(1 << 20);
    assert_eq!(limited.available_bytes(), Some(1 << 20));
    assert!(Device::cpu().available_bytes().is_some());
}
