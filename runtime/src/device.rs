//! `Device`: where a model runs, and how much memory it may take.

use crate::error::{Result, RuntimeError};

/// The kind of device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    /// An NVIDIA GPU (built with the `cuda` feature), opened and checked by [`Device::cuda`].
    Cuda {
        ordinal: usize,
        name: String,
    },
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
        Device {
            kind: DeviceKind::Cpu,
            memory_limit: None,
        }
    }

    /// CUDA device `ordinal`. Opening it checks, in order, that libcuda, libnvrtc and
    /// libcublas can be loaded and that the device exists: anything missing is an `Err` that
    /// says what (never a panic). Without the `cuda` feature this is always an `Err`.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            let dev = crate::cuda::device::open(ordinal)?;
            Ok(Device {
                kind: DeviceKind::Cuda {
                    ordinal,
                    name: dev.info().name.clone(),
                },
                memory_limit: None,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(RuntimeError::Device(format!(
                "cuda:{ordinal}: this build has no CUDA support (build with `--features cuda`)"
            )))
        }
    }

    /// The best available device: CUDA device 0 when it works, else the CPU. Says which on
    /// stderr (and, for the CPU, why not CUDA).
    pub fn auto() -> Device {
        match Device::cuda(0) {
            Ok(d) => {
                let free = d
                    .available_bytes()
                    .map(|b| format!(", {:.1} GiB free", b as f64 / (1u64 << 30) as f64));
                eprintln!("memwise: using {}{}", d.name(), free.unwrap_or_default());
                d
            }
            Err(e) => {
                let why = match e {
                    RuntimeError::Device(m) => m,
                    other => other.to_string(),
                };
                eprintln!(
                    "memwise: using the CPU ({} threads); no CUDA: {why}",
                    rayon_threads()
                );
                Device::cpu()
            }
        }
    }

    /// Parses `cpu`, `auto`, `cuda` and `cuda:N` (CUDA needs the `cuda` feature).
    pub fn parse(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::cpu()),
            "auto" => Ok(Device::auto()),
            "cuda" => Device::cuda(0),
            other if other.starts_with("cuda:") => {
                let n = other["cuda:".len()..].parse::<usize>().map_err(|_| {
                    RuntimeError::Device(format!(
                        "`{other}`: expected cuda:N with N a device number"
                    ))
                })?;
                Device::cuda(n)
            }
            other => Err(RuntimeError::Device(format!(
                "unknown device `{other}`: use cpu, cuda, cuda:N or auto"
            ))),
        }
    }

    /// Caps the memory a model may take on this device.
    pub fn with_memory_limit(mut self, bytes: u64) -> Device {
        self.memory_limit = Some(bytes);
        self
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self.kind, DeviceKind::Cuda { .. })
    }

    pub fn name(&self) -> String {
        match &self.kind {
            DeviceKind::Cpu => "cpu".to_string(),
            DeviceKind::Cuda { ordinal, name } => format!("cuda:{ordinal} ({name})"),
        }
    }

    /// Bytes a model may allocate here: the limit, else the host's available memory (CPU) or
    /// the device's free memory (CUDA).
    pub fn available_bytes(&self) -> Option<u64> {
        self.memory_limit.or_else(|| match &self.kind {
            DeviceKind::Cpu => host_available_bytes(),
            DeviceKind::Cuda { ordinal, .. } => cuda_free_bytes(*ordinal),
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda_free_bytes(ordinal: usize) -> Option<u64> {
    crate::cuda::device::open(ordinal)
        .ok()?
        .mem_get_info()
        .ok()
        .map(|(free, _)| free)
}

#[cfg(not(feature = "cuda"))]
fn cuda_free_bytes(_ordinal: usize) -> Option<u64> {
    None
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// `MemAvailable` from /proc/meminfo (Linux), if readable.
pub fn host_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
