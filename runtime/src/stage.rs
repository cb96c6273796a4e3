//! A pipeline stage's training on its rank (model parallel, issue 16): the stage's plan from
//! the model's split and the rank ([`memwise_plan::stage::plan_stage`]), its engine joined to
//! the other stages through their [`Collective`], and each step's micro-batches cut from the
//! whole batch, so that every stage is handed the same batches one device would train on.

use std::sync::Arc;

use memwise_plan::pipeline::PipelineSchedule;
use memwise_plan::stage::plan_stage;
use memwise_plan::{ModelSpec, StaticPlan};

use serde_json::{json, Value};

use crate::collective::Collective;
use crate::data::dataset::{Column, Dataset};
use crate::device::Device;
use crate::engine::{build_engine, Engine};
use crate::error::{Result, RuntimeError};
use crate::executor::{stage_inputs, Batch, StepOutput};

/// One stage of a model split into a pipeline, trained on its own rank.
pub struct StageTrainer {
    engine: Box<dyn Engine>,
    /// The one-device plan's input tensors' names, in its order (the whole batch's columns).
    model_inputs: Vec<String>,
    /// Each model input's values per sample, and their bytes each, in the same order.
    per_sample: Vec<usize>,
    input_sizes: Vec<u64>,
    global_batch: usize,
    schedule: PipelineSchedule,
}

impl StageTrainer {
    /// Stage `c.rank()` of `spec`'s pipeline (`spec.pipeline`, which needs `c.size()`
    /// stages) on `device`, its weights initialised from `seed` as the one-device model's
    /// (the same seed on every stage).
    pub fn build(
        spec: &ModelSpec,
        device: &Device,
        seed: u64,
        c: Arc<dyn Collective>,
    ) -> Result<StageTrainer> {
        let Some(pipe) = &spec.pipeline else {
            return Err(RuntimeError::Input(format!(
                "`{}` is not split into stages: mark the field each stage begins at with \
                 `#[stage(k)]`, or give the model `stages = N`",
                spec.name
            )));
        };
        if c.size() != pipe.stages() {
            return Err(RuntimeError::Input(format!(
                "`{}` is split into {} stages, and the {} job has {} ranks: launch one rank per \
                 stage",
                spec.name,
                pipe.stages(),
                c.engine(),
                c.size()
            )));
        }
        let one = memwise_plan::plan(&spec.with_batch(1))?;
        let model_inputs = (one.inputs.iter())
            .map(|&i| one.tensor(i).name.to_string())
            .collect();
        let per_sample = (one.inputs.iter())
            .map(|&i| one.tensor(i).elems())
            .collect();
        let input_sizes = (one.inputs.iter())
            .map(|&i| one.tensor(i).dtype.size())
            .collect();
        let plan = plan_stage(spec, pipe, c.rank())?;
        let mut engine = build_engine(plan, device, seed)?;
        engine.set_collective(c)?;
        Ok(StageTrainer {
            engine,
            model_inputs,
            per_sample,
            input_sizes,
            global_batch: spec.batch,
            schedule: pipe.schedule,
        })
    }

    /// This stage's plan.
    pub fn plan(&self) -> &StaticPlan {
        self.engine.plan()
    }

    /// Host bytes the stage holds beside its plan's `memory.total`: the whole batch's
    /// gather buffers ([`StageTrainer::train_steps`]), the collective's send buffer, and on
    /// the CPU the GEMM library's resident heap — what a measured peak is compared with.
    pub fn host_bytes(&self) -> u64 {
        let plan = self.engine.plan();
        let gather: u64 = (self.per_sample.iter().zip(&self.input_sizes))
            .map(|(&n, &size)| (n * self.global_batch) as u64 * size)
            .sum();
        let gemm = if self.engine.device_bytes_used().is_some() {
            0
        } else {
            crate::cpu_heap::gemm_library_resident_bytes(std::iter::once(plan))
        };
        gather + self.engine.send_buffer_bytes() + gemm
    }

    /// The stage's run report (`memwise.report/1`, as [`crate::train::Trainer::report`]) of
    /// the steps that returned `losses`, with the peak resident growth measured over them:
    /// the stage's own estimate (its plan and [`StageTrainer::host_bytes`]) beside what it
    /// measured, and which stage of which pipeline it is:
    ///
    /// ```json
    /// {"schema": "memwise.report/1", "model", "device", "batch", "steps",
    ///  "stage", "stages", "micro_batches", "schedule", "estimate": {…},
    ///  "measured": {"peak_rss_growth_bytes", "error_percent"}, "loss": [per step]}
    /// ```
    pub fn report(&self, device: &Device, losses: &[f32], peak_rss_growth: Option<u64>) -> Value {
        let plan = self.engine.plan();
        let total = plan.memory.total + self.host_bytes();
        json!({
            "schema": "memwise.report/1",
            "model": plan.model,
            "device": device.name(),
            "batch": self.global_batch,
            "steps": losses.len(),
            "stage": plan.stage,
            "stages": plan.stages,
            "micro_batches": plan.micro_batches,
            "schedule": self.schedule.name(),
            "estimate": crate::report::estimate_json(&plan.memory, total),
            "measured": {
                "peak_rss_growth_bytes": peak_rss_growth,
                "error_percent": peak_rss_growth.map(|p| crate::monitor::error_percent(p, total)),
            },
            "loss": losses,
        })
    }

    /// The stage's engine (its parameters, saving its weights …).
    pub fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    /// One training step on the whole batch (`batch` samples of every model input, in
    /// declaration order), of which this stage reads its micro-batches' share. Every stage
    /// takes the step together; each returns the whole step's loss.
    pub fn train_step(&mut self, whole: &[Batch<'_>]) -> Result<StepOutput> {
        let names: Vec<&str> = self.model_inputs.iter().map(String::as_str).collect();
        let mine = stage_inputs(self.engine.plan(), &names, whole)?;
        self.engine.train_step(&mine)
    }

    /// `steps` training steps over `data`'s samples in order (wrapping round at its end),
    /// the whole batch gathered once per step into buffers made once; the steps' losses.
    pub fn train_steps(&mut self, data: &dyn Dataset, steps: usize) -> Result<Vec<f32>> {
        let b = self.global_batch;
        if data.columns().len() != self.model_inputs.len() || data.is_empty() {
            return Err(RuntimeError::Input(format!(
                "the dataset has {} columns of {} samples; the model takes {} inputs ({})",
                data.columns().len(),
                data.len(),
                self.model_inputs.len(),
                self.model_inputs.join(", ")
            )));
        }
        for (c, (name, &n)) in data
            .columns()
            .iter()
            .zip(self.model_inputs.iter().zip(&self.per_sample))
        {
            if c.per_sample() != n {
                return Err(RuntimeError::Input(format!(
                    "`{name}` takes {n} values a sample, the dataset's column has {}",
                    c.per_sample()
                )));
            }
        }
        let mut buffers: Vec<Column> = data.columns().iter().map(|c| c.buffer(b)).collect();
        let mut indices = vec![0usize; b];
        (0..steps)
            .map(|step| {
                for (j, i) in indices.iter_mut().enumerate() {
                    *i = (step * b + j) % data.len();
                }
                data.gather(&indices, &mut buffers)?;
                let whole: Vec<Batch<'_>> = buffers.iter().map(|c| c.as_batch(b)).collect();
                Ok(self.train_step(&whole)?.loss)
            })
            .collect()
    }
}
