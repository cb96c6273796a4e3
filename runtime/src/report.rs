//! The run report (`memwise.report/1`): what a training run was estimated to take and what
//! it measured, with its losses and metrics, as the JSON other tools read.

use serde_json::{json, Value};

use memwise_plan::MemoryReport;

use crate::train::{History, Trainer};

/// A report's `estimate` object: the plan's rows, and `total` (the plan's total and the host
/// memory beside it) with its `host` share.
pub(crate) fn estimate_json(m: &MemoryReport, total: u64) -> Value {
    json!({
        "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
        "activations_peak": m.activations_peak, "workspace_peak": m.workspace_peak,
        "inputs": m.inputs, "plan_total": m.total,
        "host": total.saturating_sub(m.total), "total": total,
    })
}

impl Trainer {
    /// The run report of `history` (what [`Trainer::fit`] returned), with the caller's own
    /// `metrics` (held-out loss and accuracy, say) beside it:
    ///
    /// ```json
    /// {"schema": "memwise.report/1", "model", "device", "batch", "steps",
    ///  "estimate": {"params", "grads", "optimizer", "activations_peak", "workspace_peak",
    ///               "inputs", "plan_total", "host", "total"},
    ///  "measured": {"peak_rss_growth_bytes", "device_peak_bytes", "device_lane_bytes",
    ///               "step_ms_median", "samples_per_s", "runtime_warm_up_bytes",
    ///               "data_wait_ms_after_warmup"},
    ///  "loss": [per step], "metrics": {…}}
    /// ```
    ///
    /// A data-parallel replica adds `"replicas"`, `"rank"`, `"global_batch"` and
    /// `measured.job_samples_per_s`; `batch` and the estimate are the replica's own.
    ///
    /// `measured.peak_rss_growth_bytes` is the peak resident growth at the end of the last
    /// epoch and `estimate.total` what the trainer estimated for that moment: the plan's
    /// total plus the host memory beside it ([`Trainer::host_bytes`]: batch staging, the CPU
    /// GEMM library's buffers, the inference engines validation built). On a GPU
    /// `device_peak_bytes` is the device memory the model held at its peak, and
    /// `device_lane_bytes` what its stream and cuBLAS handle and workspace took before it
    /// (measured when they opened; about 100 MiB on an H200); both are null on the CPU. `runtime_warm_up_bytes` is what the process paid once, before the first
    /// model's baseline ([`crate::warm_up`]).
    pub fn report(&self, history: &History, metrics: Value) -> Value {
        let plan = self.plan();
        let m = &plan.memory;
        let last = history.epochs.last();
        let peak = match last {
            Some(e) => Some(e.peak_rss_growth),
            None => self.monitor().growth().map(|g| g.peak),
        };
        let total = last.map_or_else(|| self.estimate_bytes(), |e| e.estimate_bytes);
        let median = history.step_ms_median();
        let (rank, replicas) = self
            .engine()
            .collective()
            .map_or((0, 1), |c| (c.rank(), c.size()));
        let mut report = json!({
            "schema": "memwise.report/1",
            "model": plan.model,
            "device": self.device().name(),
            "batch": plan.batch,
            "steps": history.step_losses.len(),
            "estimate": estimate_json(m, total),
            "measured": {
                "peak_rss_growth_bytes": peak,
                "device_peak_bytes": self.device_peak_bytes(),
                // The stream and cuBLAS handle and workspace, taken before the baseline.
                "device_lane_bytes": self.device_lane_bytes(),
                "step_ms_median": median,
                "samples_per_s": if median > 0.0 { plan.batch as f64 / (median / 1e3) } else { 0.0 },
                // Paid once per process before the baseline, not by the model.
                "runtime_warm_up_bytes": crate::warm_up::warm_up_cost().map(|w| w.resident_bytes),
                // Time a step waited for its batch after the first (a streamed folder's queue).
                "data_wait_ms_after_warmup": history.data_wait_ms_after_warmup(),
            },
            "loss": history.step_losses,
            "metrics": metrics,
        });
        // Data parallel: which replica this is; its estimate and measurement are its own,
        // and the samples per second the job's (every replica steps together).
        if replicas > 1 {
            report["replicas"] = json!(replicas);
            report["rank"] = json!(rank);
            report["global_batch"] = json!(plan.batch * replicas);
            // 1: this replica's `estimate.optimizer` is its shard of the state (ZeRO).
            report["zero_stage"] = json!(plan.sharding.zero_stage());
            report["measured"]["job_samples_per_s"] = json!(if median > 0.0 {
                (plan.batch * replicas) as f64 / (median / 1e3)
            } else {
                0.0
            });
        }
        report
    }
}
