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

/// `Trainer` on a CUDA device: with no usable device (no feature, no driver, no such
/// ordinal) building is an `Err` that says why, never a panic; on a GPU machine with the
/// feature the trainer runs the CUDA engine, and measures the device peak.
#[test]
fn the_trainer_on_cuda_builds_the_cuda_engine_or_says_why_not() {
    use memwise_plan::zoo;
    use memwise_runtime::Trainer;

    let absent = Device {
        kind: DeviceKind::Cuda {
            ordinal: 99,
            name: "absent".into(),
        },
        memory_limit: None,
    };
    match Trainer::build(&zoo::mnist_mlp(4), &absent, 1) {
        Err(RuntimeError::Device(m)) => {
            let why = [
                "--features cuda",
                "libcuda",
                "libnvrtc",
                "libcublas",
                "no CUDA device",
            ];
            assert!(why.iter().any(|w| m.contains(w)), "unexplained: {m}");
        }
        Err(other) => panic!("not a device error: {other}"),
        Ok(_) => panic!("a trainer on CUDA device 99"),
    }
    if let Ok(d) = Device::cuda(0) {
        let t = Trainer::build(&zoo::mnist_mlp(4), &d, 1).unwrap();
        assert!(t.cpu_executor().is_none());
        assert!(t.engine().device_name().starts_with("cuda:0"));
        let p = t.plan();
        assert!(t.device_peak_bytes().unwrap() >= p.persistent_bytes + p.arena_bytes);
    }
}
