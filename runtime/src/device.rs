//! `Device`: where a model runs, and how much memory it may take.

use crate::error::{Result, RuntimeError};

/// The kind of device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
}

/// A device, optionally with a memory limit (plan for a smaller GPU than the one at hand,
/// or cap a CPU run). Building a model on it fails before allocating anything when the
/// plan's total exceeds the limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub kind: DeviceKind,
    pub memory_limit: Option<u64>,
}

impl Device {
    /// The host CPU (multi-threaded kernels).
    pub fn cpu() -> Device {
        Device { kind: DeviceKind::Cpu, memory_limit: None }
    }

    /// The best available device: CUDA when it works, else the CPU. Says which on stderr.
    pub fn auto() -> Device {
        eprintln!("memwise: using the CPU ({} threads); build with the `cuda` feature for a GPU", rayon_threads());
        Device::cpu()
    }

    /// Parses `cpu`, `auto` (and, with the `cuda` feature, `cuda` / `cuda:N`).
    pub fn parse(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::cpu()),
            "auto" => Ok(Device::auto()),
            other if other.starts_with("cuda") => Err(RuntimeError::Device(format!(
                "`{other}`: this build has no CUDA support (build with `--features cuda`)"
            ))),
            other => Err(RuntimeError::Device(format!("unknown device `{other}`: use cpu, cuda or auto"))),
        }
    }

    /// Caps the memory a model may take on this device.
    pub fn with_memory_limit(mut self, bytes: u64) -> Device {
        self.memory_limit = Some(bytes);
        self
    }

    pub fn name(&self) -> String {
        match self.kind {
            DeviceKind::Cpu => "cpu".to_string(),
        }
    }

    /// Bytes a model may allocate here: the limit, else the host's available memory.
    pub fn available_bytes(&self) -> Option<u64> {
        self.memory_limit.or_else(host_available_bytes)
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// `MemAvailable` from /proc/meminfo (Linux), if readable.
pub fn host_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
