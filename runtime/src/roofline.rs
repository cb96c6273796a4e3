//! How close a training step comes to what this machine can do: the CPU's measured peak (a
//! large square f32 GEMM through the gemm crate for FLOP/s, a streaming copy over every core
//! for memory bandwidth) against a plan's FLOPs and bytes moved ([`StaticPlan::cost`]). The
//! roofline time of a step is the larger of its FLOPs over the peak rate and its bytes over
//! the bandwidth; the fraction a measured step reaches is that time over the measured one.

use std::time::Instant;

use memwise_kernels::gemm::matmul;
use memwise_plan::cost::StepCost;
use memwise_plan::StaticPlan;
use rayon::prelude::*;
use serde_json::{json, Value};

/// This machine's measured peak rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachinePeak {
    /// f32 FLOP/s of a large square GEMM on every core (the gemm crate, as memwise's dense and
    /// convolution kernels use it).
    pub flops_per_s: f64,
    /// Bytes per second a streaming copy over every core reads plus writes (STREAM's "copy"
    /// count: the write-allocate reads are not counted).
    pub bytes_per_s: f64,
}

/// Square GEMM side: 2·n³ = 17 GFLOP, large enough for the gemm crate's best blocking.
const GEMM_N: usize = 2048;
/// Copy size per buffer: far beyond any last-level cache.
const COPY_BYTES: usize = 256 << 20;
/// Runs of each measurement; the fastest counts (the rate the machine can reach).
const RUNS: usize = 5;

impl MachinePeak {
    /// Measures both rates on the CPU (about two seconds; allocates 3 × 16 MiB for the GEMM
    /// and 2 × 256 MiB for the copy, freed before it returns).
    pub fn measure_cpu() -> MachinePeak {
        MachinePeak {
            flops_per_s: gemm_flops_per_s(),
            bytes_per_s: copy_bytes_per_s(),
        }
    }
}

fn fastest(mut run: impl FnMut()) -> f64 {
    run();
    (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn gemm_flops_per_s() -> f64 {
    let n = GEMM_N;
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i % 251) as f32 - 125.0) / 125.0)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i % 241) as f32 - 120.0) / 120.0)
        .collect();
    let mut c = vec![0f32; n * n];
    let s = fastest(|| {
        // f32 needs no workspace; the shapes are consistent, so it cannot fail.
        matmul(n, n, n, &a, false, &b, false, &mut c, 1.0, 0.0, &mut [])
            .expect("a square f32 GEMM");
    });
    2.0 * (n as f64).powi(3) / s
}

fn copy_bytes_per_s() -> f64 {
    let elems = COPY_BYTES / 4;
    let src: Vec<f32> = (0..elems).map(|i| i as f32).collect();
    let mut dst = vec![0f32; elems];
    let chunk = elems.div_ceil(rayon::current_num_threads() * 4).max(1);
    let s = fastest(|| {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
    });
    2.0 * COPY_BYTES as f64 / s
}

/// A plan's step against a machine's peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    pub cost: StepCost,
    pub peak: MachinePeak,
}

impl Roofline {
    pub fn of(plan: &StaticPlan, peak: MachinePeak) -> Roofline {
        Roofline {
            cost: plan.cost(),
            peak,
        }
    }

    /// Milliseconds the step's FLOPs need at the peak rate.
    pub fn compute_ms(&self) -> f64 {
        self.cost.flops as f64 / self.peak.flops_per_s * 1e3
    }

    /// Milliseconds the step's bytes need at the peak bandwidth.
    pub fn memory_ms(&self) -> f64 {
        self.cost.bytes as f64 / self.peak.bytes_per_s * 1e3
    }

    /// The roofline time: no step can be faster on this machine.
    pub fn bound_ms(&self) -> f64 {
        self.compute_ms().max(self.memory_ms())
    }

    /// `"compute"` or `"memory"`: what bounds the step.
    pub fn limit(&self) -> &'static str {
        if self.compute_ms() >= self.memory_ms() {
            "compute"
        } else {
            "memory"
        }
    }

    /// The fraction of the roofline a step measured at `step_ms` reaches (1 is the machine's
    /// limit).
    pub fn fraction(&self, step_ms: f64) -> f64 {
        if step_ms > 0.0 {
            self.bound_ms() / step_ms
        } else {
            0.0
        }
    }

    /// One line for a person: the step's cost, the machine, the bound and the fraction.
    pub fn describe(&self, step_ms: f64) -> String {
        format!(
            "roofline: {:.2} GFLOP and {:.1} MB moved per step; this machine's peak {:.1} GFLOP/s \
             and {:.1} GB/s bound it at {:.2} ms ({}-bound); the median step took {:.2} ms: \
             {:.0} % of the roofline",
            self.cost.flops as f64 / 1e9,
            self.cost.bytes as f64 / 1e6,
            self.peak.flops_per_s / 1e9,
            self.peak.bytes_per_s / 1e9,
            self.bound_ms(),
            self.limit(),
            step_ms,
            100.0 * self.fraction(step_ms)
        )
    }

    /// The report's `roofline` object.
    pub fn to_json(&self, step_ms: f64) -> Value {
        json!({
            "flops": self.cost.flops, "bytes": self.cost.bytes,
            "peak_flops_per_s": self.peak.flops_per_s, "peak_bytes_per_s": self.peak.bytes_per_s,
            "compute_ms": self.compute_ms(), "memory_ms": self.memory_ms(),
            "bound_ms": self.bound_ms(), "limit": self.limit(),
            "step_ms_median": step_ms, "fraction": self.fraction(step_ms),
        })
    }
}

/// One `(phase, op)` group of a plan's steps, as [`crate::walk::PlanExecutor::profile`]
/// counts them: its measured time beside its roofline.
#[derive(Clone, Debug, PartialEq)]
pub struct OpGroup {
    pub key: String,
    pub cost: StepCost,
    /// The sum over the group's steps of each step's own bound (its FLOPs or its bytes).
    pub bound_ms: f64,
    /// Measured milliseconds per training step.
    pub measured_ms: f64,
}

/// `plan`'s steps grouped by `(phase, op)`, each with its roofline at `peak` and its measured
/// time from `profile` (seconds over `steps` steps), slowest first.
pub fn by_op(
    plan: &StaticPlan,
    peak: MachinePeak,
    profile: &[(String, f64)],
    steps: usize,
) -> Vec<OpGroup> {
    let mut groups: Vec<OpGroup> = Vec::new();
    for s in plan.steps.iter() {
        let (key, cost) = (crate::walk::profile_key(s), plan.step_cost(s));
        let bound = Roofline { cost, peak }.bound_ms();
        match groups.iter_mut().find(|g| g.key == key) {
            Some(g) => {
                g.cost = g.cost + cost;
                g.bound_ms += bound;
            }
            None => groups.push(OpGroup {
                key,
                cost,
                bound_ms: bound,
                measured_ms: 0.0,
            }),
        }
    }
    for g in groups.iter_mut() {
        let secs = profile
            .iter()
            .find(|(k, _)| *k == g.key)
            .map_or(0.0, |p| p.1);
        g.measured_ms = secs * 1e3 / steps.max(1) as f64;
    }
    groups.sort_by(|a, b| b.measured_ms.total_cmp(&a.measured_ms));
    groups
}

/// The table of [`by_op`]'s first `rows` groups: where a step's time goes and how far each
/// group is from its own roofline.
pub fn by_op_table(groups: &[OpGroup], rows: usize) -> String {
    let mut s = format!(
        "  {:34} {:>9} {:>9} {:>7} {:>9} {:>9}\n",
        "(phase, op)", "ms/step", "bound ms", "of it", "GFLOP", "MB"
    );
    for g in groups.iter().take(rows) {
        let frac = if g.measured_ms > 0.0 {
            100.0 * g.bound_ms / g.measured_ms
        } else {
            0.0
        };
        s += &format!(
            "  {:34} {:9.2} {:9.2} {:6.0}% {:9.3} {:9.1}\n",
            g.key,
            g.measured_ms,
            g.bound_ms,
            frac,
            g.cost.flops as f64 / 1e9,
            g.cost.bytes as f64 / 1e6
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_the_slower_of_compute_and_memory() {
        let r = Roofline {
            cost: StepCost {
                flops: 2_000_000_000,
                bytes: 500_000_000,
            },
            peak: MachinePeak {
                flops_per_s: 100e9,
                bytes_per_s: 10e9,
            },
        };
        assert_eq!((r.compute_ms(), r.memory_ms()), (20.0, 50.0));
        assert_eq!((r.bound_ms(), r.limit()), (50.0, "memory"));
        assert_eq!(r.fraction(100.0), 0.5);
        assert_eq!(r.fraction(0.0), 0.0);
    }

    #[test]
    fn the_groups_split_the_plan_and_take_the_profiles_time() {
        let plan = memwise_plan::plan(&memwise_plan::zoo::mnist_mlp(128)).unwrap();
        let peak = MachinePeak {
            flops_per_s: 1e11,
            bytes_per_s: 1e10,
        };
        let profile = vec![("forward dense".to_string(), 0.5)];
        let groups = by_op(&plan, peak, &profile, 10);
        let total = groups.iter().fold(StepCost::default(), |a, g| a + g.cost);
        assert_eq!(total, plan.cost());
        assert_eq!(groups[0].key, "forward dense");
        assert_eq!(groups[0].measured_ms, 50.0);
        assert!(groups[1..].iter().all(|g| g.measured_ms == 0.0));
        // Each group's bound is at least the whole-plan model's for its own totals.
        for g in &groups {
            let whole = Roofline { cost: g.cost, peak }.bound_ms();
            assert!(g.bound_ms >= whole * (1.0 - 1e-12), "{}", g.key);
        }
        assert!(by_op_table(&groups, 3).lines().count() == 4);
    }
}
