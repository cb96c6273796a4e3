//! Memory measurements of the running process, to set beside the compile-time estimate:
//! resident size now and at its peak, read from /proc (Linux), and on a GPU the device
//! memory the model holds at its peak.

/// Resident-set figures in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Rss {
    /// `VmRSS`: resident now.
    pub current: u64,
    /// `VmHWM`: the peak resident size so far.
    pub peak: u64,
}

/// Reads `VmRSS` and `VmHWM` from /proc/self/status; `None` where that file does not exist.
pub fn rss() -> Option<Rss> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some(Rss {
        current: field("VmRSS:")?,
        peak: field("VmHWM:")?,
    })
}

/// Measures growth from a baseline taken before a model is built (the run report's
/// `peak_rss_growth_bytes` = peak resident size − resident size at the baseline), and keeps
/// the largest device-memory sample it is given (the run report's `device_peak_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryMonitor {
    baseline: u64,
    device_peak: Option<u64>,
}

impl MemoryMonitor {
    /// Takes the baseline now. First it hands the heap's free pages back to the kernel
    /// ([`release_free_heap`]) and resets the peak ([`reset_peak`]): memory freed before the
    /// baseline (a dataset's decoding buffers) would otherwise be reused by the model without
    /// showing as growth, and a peak reached before it would show as growth.
    pub fn start() -> MemoryMonitor {
        release_free_heap();
        reset_peak();
        MemoryMonitor {
            baseline: rss().map_or(0, |r| r.current),
            device_peak: None,
        }
    }

    /// Pays the runtime's one-time costs for `device` first ([`crate::warm_up::warm_up`]:
    /// thread pools, GEMM slabs, kernel code pages), then takes the baseline: where a model's
    /// measured growth starts, so that it measures the model and nothing else.
    pub fn start_on(device: &crate::device::Device) -> MemoryMonitor {
        crate::warm_up::warm_up(device);
        MemoryMonitor::start()
    }

    /// Records a sample of the device memory the model holds (device memory in use minus
    /// what was in use before the model was built: `Engine::device_bytes_used`); `None`
    /// (the CPU) records nothing.
    pub fn record_device_bytes(&mut self, used: Option<u64>) {
        if let Some(b) = used {
            self.device_peak = Some(self.device_peak.map_or(b, |p| p.max(b)));
        }
    }

    /// The largest device-memory sample recorded; `None` on the CPU.
    pub fn device_peak(&self) -> Option<u64> {
        self.device_peak
    }

    pub fn baseline(&self) -> u64 {
        self.baseline
    }

    /// Resident growth now and at its peak since the baseline.
    pub fn growth(&self) -> Option<Rss> {
        rss().map(|r| Rss {
            current: r.current.saturating_sub(self.baseline),
            peak: r.peak.saturating_sub(self.baseline),
        })
    }
}

/// `measured / estimated − 1`, as a signed percentage.
pub fn error_percent(measured: u64, estimated: u64) -> f64 {
    if estimated == 0 {
        return 0.0;
    }
    (measured as f64 / estimated as f64 - 1.0) * 100.0
}

/// Resets the kernel's peak resident size (`VmHWM`) to the current size (Linux: writes `5`
/// to /proc/self/clear_refs), so one process can measure several models one after another.
/// Returns false where that is not possible.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Returns the allocator's free heap pages to the kernel (glibc's `malloc_trim(0)`), so
/// that resident size counts memory in use; a no-op elsewhere.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim only releases free memory; it is thread-safe.
        unsafe {
            malloc_trim(0);
        }
    }
}
