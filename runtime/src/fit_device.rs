//! Fitting a model to the memory a device has free: the budget (free memory less a stated
//! safety margin) and the plan the planner chooses for it — never found by trial and OOM.
//!
//! The device says how much it has free (`mem_get_info` on CUDA, `MemAvailable` or the
//! device's memory limit on the CPU); [`budget`] keeps a margin back for what runs beside the
//! plan — on CUDA the context's growth and cuBLAS's workspace, on the CPU the trainer's batch
//! staging buffers and the GEMM library's packing slabs (`Trainer::host_bytes`) and whatever
//! else the process allocates meanwhile; [`memwise_plan::checkpoint::fit_budget`] then keeps
//! the model as declared if it fits, else checkpoints it at the declared batch, else takes the
//! largest batch that fits with checkpointing.

use memwise_plan::advice::format_bytes;
use memwise_plan::checkpoint::{fit_budget, BudgetFit};
use memwise_plan::ModelSpec;

use crate::device::Device;
use crate::error::{Result, RuntimeError};

/// The share of the free memory kept back.
pub const MARGIN_FRACTION: f64 = 0.05;
/// The least kept back on a CUDA device: the context grows (module loads, graph
/// instantiation) and cuBLAS allocates its workspace after the model is built.
pub const CUDA_MARGIN_MIN: u64 = 256 << 20;
/// The least kept back on the CPU: batch staging, the GEMM library's per-thread slabs.
pub const CPU_MARGIN_MIN: u64 = 64 << 20;

/// The budget for a model on `device`: its free memory, the margin kept back, and what is left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBudget {
    pub available: u64,
    pub margin: u64,
    pub budget: u64,
}

/// What [`fit_to_device`] chose: the device's budget and the planner's fit within it.
#[derive(Clone, Debug)]
pub struct DeviceFit {
    pub device: String,
    pub budget: DeviceBudget,
    pub fit: BudgetFit,
}

impl std::fmt::Display for DeviceFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} free, {} kept back ({:.0} %, at least {}), budget {} — {}",
            self.device,
            format_bytes(self.budget.available),
            format_bytes(self.budget.margin),
            MARGIN_FRACTION * 100.0,
            format_bytes(if self.device.starts_with("cuda") {
                CUDA_MARGIN_MIN
            } else {
                CPU_MARGIN_MIN
            }),
            format_bytes(self.budget.budget),
            self.fit
        )
    }
}

/// The margin kept back from `available` bytes free on a device of this kind.
pub fn margin(available: u64, cuda: bool) -> u64 {
    let least = if cuda {
        CUDA_MARGIN_MIN
    } else {
        CPU_MARGIN_MIN
    };
    ((available as f64 * MARGIN_FRACTION) as u64)
        .max(least)
        .min(available)
}

/// The memory budget for a model on `device`.
pub fn budget(device: &Device) -> Result<DeviceBudget> {
    let available = device.available_bytes().ok_or_else(|| {
        RuntimeError::Memory(format!(
            "cannot tell how much memory {} has free (no /proc/meminfo or mem_get_info); \
             give the device a limit with `with_memory_limit`",
            device.name()
        ))
    })?;
    let margin = margin(available, device.is_cuda());
    Ok(DeviceBudget {
        available,
        margin,
        budget: available - margin,
    })
}

/// Chooses how `spec` runs on `device`: as declared if it fits the budget, else
/// checkpointed, else at the largest batch that fits (see the module's doc).
pub fn fit_to_device(spec: &ModelSpec, device: &Device) -> Result<DeviceFit> {
    let budget = budget(device)?;
    let fit = fit_budget(spec, budget.budget).map_err(|e| {
        RuntimeError::Memory(format!(
            "{} on {} ({} free, {} kept back): {e}",
            spec.name,
            device.name(),
            format_bytes(budget.available),
            format_bytes(budget.margin)
        ))
    })?;
    Ok(DeviceFit {
        device: device.name(),
        budget,
        fit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_share_with_a_floor() {
        assert_eq!(margin(10 << 30, false), 512 << 20);
        assert_eq!(margin(100 << 20, false), 64 << 20);
        assert_eq!(margin(100 << 20, true), 100 << 20);
        assert_eq!(margin(80 << 30, true), 4 << 30);
    }
}
