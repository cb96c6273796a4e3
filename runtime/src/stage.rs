//! A pipeline stage's training on its rank (model parallel, issue 16): the stage's plan from
//! the model's split and the rank ([`memwise_plan::stage::plan_stage`]), its engine joined to
//! the other stages through their [`Collective`], and each step's micro-batches cut from the
//! whole batch, so that every stage is handed the same batches one device would train on.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memwise_plan::pipeline::PipelineSchedule;
use memwise_plan::stage::{plan_stage, plan_stage_inference, stage_of_rank, Pipeline};
use memwise_plan::{ModelSpec, StaticPlan, NONE};

use serde_json::{json, Value};

use crate::collective::Collective;
use crate::data::dataset::{Column, Dataset};
use crate::device::Device;
use crate::engine::{build_engine, Engine};
use crate::error::{Result, RuntimeError};
use crate::executor::{stage_inputs, Batch, StepOutput};
use crate::monitor::MemoryMonitor;
use crate::train::{
    bar_step, check_step, epoch_bar, epoch_line, in_dataset, scored_predictions, shuffle,
    shuffle_seed, EpochLog, Evaluation, FitOptions, History,
};

/// Stage `stage`'s file of the pipeline checkpoint `prefix`: `PREFIX.stage<k>`.
pub fn stage_checkpoint_path(prefix: &Path, stage: usize) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(format!(".stage{stage}"));
    PathBuf::from(name)
}

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
    /// Which replica of the pipeline this stage is (0 of 1 unless the model has `replicas`).
    replica: usize,
    /// Started before the stage was built: its growth is what the stage holds.
    monitor: MemoryMonitor,
    /// What the inference stages are planned and built from.
    spec: ModelSpec,
    pipeline: Pipeline,
    device: Device,
    collective: Arc<dyn Collective>,
    /// The engines `evaluate` and `predict` run, one per batch size.
    infer: Vec<InferenceStage>,
    /// The predictions a sample scores for accuracy (0: the model is no classifier).
    scored_per_sample: usize,
    /// The model's prediction: its values per sample, and the stage that makes it.
    prediction: Option<(usize, usize)>,
}

/// A stage's inference engine for one batch size, and whether its weights are the training
/// engine's (they are copied when a training step has changed them).
struct InferenceStage {
    engine: Box<dyn Engine>,
    current: bool,
}

impl StageTrainer {
    /// Rank `c.rank()`'s stage of `spec`'s pipeline (`spec.pipeline`) on `device`, its
    /// weights initialised from `seed` as the one-device model's (the same seed on every
    /// rank). The job has a rank per stage, or with `spec.replicas` a rank per stage of each
    /// replica of the whole pipeline (stage `s` of replica `r` on rank
    /// [`memwise_plan::stage::stage_rank`]`(s, r, replicas)`), each replica training on its
    /// share of every batch and each stage's gradients summed over its replicas.
    pub fn build(
        spec: &ModelSpec,
        device: &Device,
        seed: u64,
        c: Arc<dyn Collective>,
    ) -> Result<StageTrainer> {
        StageTrainer::build_with(spec, device, c, &mut |plan| {
            build_engine(plan, device, seed)
        })
    }

    /// [`StageTrainer::build`] with the stage's engine made by `make` from its plan (the
    /// CPU executor, or a CUDA executor over a backend of the caller's: the emulated GPU in
    /// tests); its inference engines are then of the same kind. The weights are `make`'s.
    pub fn build_with(
        spec: &ModelSpec,
        device: &Device,
        c: Arc<dyn Collective>,
        make: &mut dyn FnMut(StaticPlan) -> Result<Box<dyn Engine>>,
    ) -> Result<StageTrainer> {
        let monitor = MemoryMonitor::start_on(device);
        let Some(pipe) = &spec.pipeline else {
            return Err(RuntimeError::Input(format!(
                "`{}` is not split into stages: mark the field each stage begins at with \
                 `#[stage(k)]`, or give the model `stages = N`",
                spec.name
            )));
        };
        let replicas = spec.replicas.max(1);
        if c.size() != pipe.stages() * replicas {
            let per = if replicas > 1 {
                format!(" of each of its {replicas} replicas")
            } else {
                String::new()
            };
            return Err(RuntimeError::Input(format!(
                "`{}` is split into {} stages, and the {} job has {} ranks: launch one rank per \
                 stage{per}",
                spec.name,
                pipe.stages(),
                c.engine(),
                c.size()
            )));
        }
        let (stage, replica) = memwise_plan::stage::stage_of_rank(c.rank(), replicas);
        let one = memwise_plan::plan(&spec.one_device().with_batch(1))?;
        let model_inputs = (one.inputs.iter())
            .map(|&i| one.tensor(i).name.to_string())
            .collect();
        let per_sample = (one.inputs.iter())
            .map(|&i| one.tensor(i).elems())
            .collect();
        let input_sizes = (one.inputs.iter())
            .map(|&i| one.tensor(i).dtype.size())
            .collect();
        let prediction = (one.prediction != NONE)
            .then(|| {
                let t = one.tensor(one.prediction);
                let layer = spec.layers.iter().position(|l| *l.name == *t.layer)?;
                Some((t.elems(), pipe.stage_of_layers(spec).ok()?[layer]))
            })
            .flatten();
        let plan = plan_stage(spec, pipe, stage)?;
        let mut engine = make(plan)?;
        engine.set_collective(c.clone())?;
        Ok(StageTrainer {
            engine,
            model_inputs,
            per_sample,
            input_sizes,
            global_batch: spec.batch,
            schedule: pipe.schedule,
            replica,
            monitor,
            spec: spec.clone(),
            pipeline: pipe.clone(),
            device: device.clone(),
            collective: c,
            infer: Vec::new(),
            scored_per_sample: scored_predictions(&one),
            prediction,
        })
    }

    /// This stage's plan.
    pub fn plan(&self) -> &StaticPlan {
        self.engine.plan()
    }

    /// Which replica of the pipeline this stage is (0 without `replicas`).
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Host bytes the stage holds beside its plan's `memory.total`: the whole batch's
    /// gather buffers ([`StageTrainer::train_steps`]), the collective's send buffer and its
    /// buffers for the gradient sums over the stage's replicas, the inference engines built
    /// for `evaluate`, `predict` and validation, and on the CPU the GEMM library's resident
    /// heap — what a measured peak is compared with.
    pub fn host_bytes(&self) -> u64 {
        let plan = self.engine.plan();
        let gather: u64 = (self.per_sample.iter().zip(&self.input_sizes))
            .map(|(&n, &size)| (n * self.global_batch) as u64 * size)
            .sum();
        let gemm = if self.engine.device_bytes_used().is_some() {
            0
        } else {
            // Evaluation's engines run GEMMs of their own shapes (one call at a time).
            let engines = (self.infer.iter()).map(|e| e.engine.plan());
            crate::cpu_heap::gemm_library_resident_bytes(std::iter::once(plan).chain(engines))
        };
        let sums = match self.engine.collective() {
            Some(c) if plan.replicas > 1 => crate::train::collective_host_bytes(
                plan,
                c,
                self.engine.device_bytes_used().is_some(),
            ),
            _ => 0,
        };
        // The inference engines' arenas and weights, and what their sends added.
        let inference: u64 = (self.infer.iter())
            .map(|e| {
                let p = e.engine.plan();
                p.arena_bytes + p.persistent_bytes + e.engine.send_buffer_bytes()
            })
            .sum();
        gather + self.engine.send_buffer_bytes() + sums + gemm + inference
    }

    /// What the stage is estimated to hold: its plan's total and the host bytes beside it
    /// ([`StageTrainer::host_bytes`]), the figure its measured peak is compared with.
    pub fn estimate_bytes(&self) -> u64 {
        self.engine.plan().memory.total + self.host_bytes()
    }

    /// The stage's run report (`memwise.report/1`, as [`crate::train::Trainer::report`]) of
    /// the steps that returned `losses`, with the peak resident growth measured over them:
    /// the stage's own estimate (its plan and [`StageTrainer::host_bytes`]) beside what it
    /// measured, and which stage of which pipeline it is:
    ///
    /// ```json
    /// {"schema": "memwise.report/1", "model", "device", "batch", "steps",
    ///  "stage", "stages", "replica", "replicas", "micro_batches", "schedule", "estimate": {…},
    ///  "measured": {"peak_rss_growth_bytes", "error_percent"}, "loss": [per step]}
    /// ```
    pub fn report(&self, device: &Device, losses: &[f32], peak_rss_growth: Option<u64>) -> Value {
        let plan = self.engine.plan();
        let total = self.estimate_bytes();
        json!({
            "schema": "memwise.report/1",
            "model": plan.model,
            "device": device.name(),
            "batch": self.global_batch,
            "steps": losses.len(),
            "stage": plan.stage,
            "stages": plan.stages,
            "replica": self.replica,
            "replicas": plan.replicas,
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

    /// Writes a training checkpoint of the whole pipeline under `prefix`: the stages of
    /// replica 0 each write their own file ([`stage_checkpoint_path`]: weights, optimizer
    /// state, counters and loss scaler, atomically), the other replicas holding the same
    /// state. Every rank calls it between steps; it returns once every stage's file is
    /// written, or on every rank an `Err` when any stage's write failed.
    pub fn save_checkpoint(&self, prefix: &Path) -> Result<()> {
        let stage = self.engine.plan().stage as usize;
        let mine = match self.replica {
            0 => (self.engine).save_checkpoint(&stage_checkpoint_path(prefix, stage)),
            _ => Ok(()),
        };
        self.agree(mine, "saving the pipeline's checkpoint")
    }

    /// Restores the checkpoint [`StageTrainer::save_checkpoint`] wrote under `prefix`: each
    /// stage (of every replica) its own file's weights, optimizer state, counters and loss
    /// scaler; [`StageTrainer::train_steps`] then goes on with the batches after it. Every
    /// rank calls it. The stages must all load, and their files be of one step: otherwise
    /// every rank returns an `Err` and keeps the state it had, so a torn or mixed checkpoint
    /// never starts a pipeline whose stages disagree.
    pub fn load_checkpoint(&mut self, prefix: &Path) -> Result<()> {
        let stage = self.engine.plan().stage as usize;
        let before = self.engine.checkpoint_to_bytes()?;
        let path = stage_checkpoint_path(prefix, stage);
        let loaded = self.engine.load_checkpoint(&path);
        // Every rank's step beside stage 0's (of replica 0): one step, or no resuming.
        // (Every rank takes part in the broadcast, whether its own load failed or not.)
        let step = self.engine.step_counter();
        let mut first = step.to_le_bytes();
        self.collective.broadcast(0, &mut first)?;
        let agreed = loaded.and_then(|()| match u64::from_le_bytes(first) {
            s if s == step => Ok(()),
            s => Err(RuntimeError::Input(format!(
                "{} is of step {step}, stage 0's checkpoint of step {s}: the stages' files are \
                 of different checkpoints",
                path.display()
            ))),
        });
        let outcome = self.agree(agreed, "loading the pipeline's checkpoint");
        if outcome.is_err() {
            self.engine.load_checkpoint_from_bytes(&before)?;
        }
        for e in &mut self.infer {
            e.current = false;
        }
        outcome
    }

    /// `mine`, this rank's outcome, agreed over every rank: `Ok` when every rank's is, else
    /// on every rank an `Err` (this rank's own, or one naming the first rank that failed).
    fn agree(&self, mine: Result<()>, what: &str) -> Result<()> {
        let c = &self.collective;
        let mut failed = vec![0f64; c.size()];
        failed[c.rank()] = mine.is_err() as u8 as f64;
        c.all_reduce_sum_f64(&mut failed)?;
        mine?;
        match failed.iter().position(|&f| f > 0.0) {
            Some(rank) => {
                let (stage, replica) = stage_of_rank(rank, self.spec.replicas.max(1));
                Err(RuntimeError::Input(format!(
                    "{what}: rank {rank} (stage {stage}, replica {replica}) failed; its error \
                     says why"
                )))
            }
            None => Ok(()),
        }
    }

    /// One training step on the whole batch (`batch` samples of every model input, in
    /// declaration order), of which this stage reads its micro-batches' share. Every stage
    /// takes the step together; each returns the whole step's loss.
    pub fn train_step(&mut self, whole: &[Batch<'_>]) -> Result<StepOutput> {
        let names: Vec<&str> = self.model_inputs.iter().map(String::as_str).collect();
        let mine = stage_inputs(self.engine.plan(), &names, whole, self.replica)?;
        for e in &mut self.infer {
            e.current = false;
        }
        self.engine.train_step(&mine)
    }

    /// `steps` training steps over `data`'s samples in order (wrapping round at its end),
    /// from where the stage's step counter is (a stage resumed from a checkpoint goes on
    /// with the batches after it), the whole batch gathered once per step into buffers made
    /// once; the steps' losses.
    pub fn train_steps(&mut self, data: &dyn Dataset, steps: usize) -> Result<Vec<f32>> {
        let b = self.global_batch;
        self.check_columns(data)?;
        let mut buffers: Vec<Column> = data.columns().iter().map(|c| c.buffer(b)).collect();
        let mut indices = vec![0usize; b];
        let done = self.engine.step_counter() as usize;
        (done..done + steps)
            .map(|step| {
                for (j, i) in indices.iter_mut().enumerate() {
                    *i = (step * b + j) % data.len();
                }
                Ok(self.step_on(data, &indices, &mut buffers)?.loss)
            })
            .collect()
    }

    /// Trains `opts.epochs` epochs over `data` as [`crate::train::Trainer::fit`] does on one
    /// device: full global batches (a final partial batch waits for the next epoch's
    /// shuffle), the samples reshuffled every epoch from `opts.seed` — the same order on
    /// every rank, and the same batches `Trainer::fit` trains one device on —, and
    /// `steps_per_epoch` and `max_steps` honoured, and the same errors for a diverged loss
    /// or loss scaling that keeps skipping. After each epoch it evaluates `validation`
    /// ([`StageTrainer::evaluate`]; its engines are built before the first step, so a
    /// pipeline without room for them fails at once). Every rank returns the same history,
    /// accuracy included for classifiers; the last stage of replica 0 shows Keras's progress
    /// bar (on a terminal) and prints a line per epoch when `opts.verbose`.
    pub fn fit(
        &mut self,
        data: &dyn Dataset,
        validation: Option<&dyn Dataset>,
        opts: &FitOptions,
    ) -> Result<History> {
        let b = self.global_batch;
        self.check_columns(data)?;
        if data.len() < b {
            return Err(RuntimeError::Input(format!(
                "the dataset has {} samples, fewer than one batch of {b}",
                data.len()
            )));
        }
        if let Some(v) = validation {
            self.check_columns(v)?;
            self.reserve_inference(v.len())?;
        }
        let per_epoch = (data.len() / b).min(opts.steps_per_epoch.unwrap_or(usize::MAX));
        let plan = self.engine.plan();
        let verbose = opts.verbose && plan.stage + 1 == plan.stages && self.replica == 0;
        let mut remaining = opts.max_steps.unwrap_or(usize::MAX);
        let mut order: Vec<usize> = (0..data.len()).collect();
        let mut rng = shuffle_seed(opts.seed);
        let mut buffers: Vec<Column> = data.columns().iter().map(|c| c.buffer(b)).collect();
        let mut history = History::default();
        let mut skipped_in_a_row = 0u32;
        for epoch in 1..=opts.epochs {
            if remaining == 0 {
                break;
            }
            let steps = per_epoch.min(remaining);
            remaining -= steps;
            if opts.shuffle {
                shuffle(&mut order, &mut rng);
            }
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let bar = epoch_bar(verbose && tty, steps, (epoch, opts.epochs));
            let t0 = std::time::Instant::now();
            let (mut loss_sum, mut correct) = (0f64, 0usize);
            for s in 0..steps {
                let ts = std::time::Instant::now();
                let out = self.step_on(data, &order[s * b..][..b], &mut buffers)?;
                history.step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
                check_step(
                    &out,
                    &mut skipped_in_a_row,
                    self.engine.loss_scale(),
                    (epoch, s + 1),
                )?;
                history.step_losses.push(out.loss);
                loss_sum += out.loss as f64;
                correct += out.correct;
                let seen = self.scored_per_sample * b * (s + 1);
                let accuracy = (seen > 0).then(|| correct as f64 / seen as f64);
                bar_step(&bar, loss_sum / (s + 1) as f64, accuracy);
            }
            bar.finish_and_clear();
            let seconds = t0.elapsed().as_secs_f64();
            let mut log = self.epoch_log(epoch, steps, loss_sum, seconds);
            // The step's correct predictions are summed over every rank, as its loss.
            let scored = (self.scored_per_sample * b * steps).max(1);
            log.accuracy = (self.scored_per_sample > 0).then_some(correct as f32 / scored as f32);
            if let Some(v) = validation {
                let e = self.evaluate(v)?;
                (log.val_loss, log.val_accuracy) = (Some(e.loss), e.accuracy);
            }
            if verbose {
                eprintln!("{}", epoch_line(&log, opts.epochs, log.estimate_bytes));
            }
            history.epochs.push(log);
        }
        Ok(history)
    }

    /// Epoch `epoch`'s log: its mean loss, time, and the stage's memory beside its estimate.
    fn epoch_log(&self, epoch: usize, steps: usize, loss_sum: f64, seconds: f64) -> EpochLog {
        let g = self.monitor.growth().unwrap_or_default();
        EpochLog {
            epoch,
            steps,
            loss: (loss_sum / steps.max(1) as f64) as f32,
            accuracy: None,
            val_loss: None,
            val_accuracy: None,
            seconds,
            rss_growth: g.current,
            peak_rss_growth: g.peak,
            device_peak_bytes: None,
            estimate_bytes: self.estimate_bytes(),
            data_wait_seconds: 0.0,
        }
    }

    /// Loss (and accuracy for classifiers) over every sample of `data`, in inference mode
    /// (batch norm from its running statistics, no dropout), as
    /// [`crate::train::Trainer::evaluate`] gives it on one device. Every rank of the job
    /// calls it on the same data and returns the same figures. The samples go through the
    /// pipeline a global batch at a time (the tail in a smaller one), each replica taking
    /// its share of the batch as in training, each stage running its inference plan
    /// ([`memwise_plan::stage::plan_stage_inference`]) between its receives and sends; the
    /// stages that hold loss terms add theirs, over every rank, after each batch.
    pub fn evaluate(&mut self, data: &dyn Dataset) -> Result<Evaluation> {
        self.check_columns(data)?;
        // (loss × samples, correct predictions, scored predictions), summed.
        let mut sums = [0f64; 3];
        self.over_batches(data, "`evaluate`", |c, ran, _| {
            let mut batch = [0f64; 3];
            if let Some((engine, n, out)) = ran {
                let scored = scored_predictions(engine.plan());
                batch = [
                    out.loss as f64 * n as f64,
                    out.correct as f64,
                    scored as f64,
                ];
            }
            c.all_reduce_sum_f64(&mut batch)?;
            for (sum, x) in sums.iter_mut().zip(batch) {
                *sum += x;
            }
            Ok(())
        })?;
        let samples = data.len();
        Ok(Evaluation {
            loss: (sums[0] / samples as f64) as f32,
            accuracy: (self.scored_per_sample > 0).then_some((sums[1] / sums[2].max(1.0)) as f32),
            samples,
        })
    }

    /// The model's prediction for every sample (row-major, `[samples, …]`), in inference
    /// mode, as [`crate::train::Trainer::predict`] gives it on one device: the stage that
    /// makes the prediction reads it after each batch, and every rank returns every sample's.
    pub fn predict(&mut self, data: &dyn Dataset) -> Result<Vec<f32>> {
        self.check_columns(data)?;
        let Some((width, holder)) = self.prediction else {
            return Err(RuntimeError::Input(
                "`predict`: the model has no prediction (no loss reads a layer)".into(),
            ));
        };
        let (replica, replicas) = (self.replica, self.spec.replicas.max(1));
        let mut out = vec![0f32; data.len() * width];
        self.over_batches(data, "`predict`", |c, ran, all| {
            let n = all.len();
            let at = |r: usize| (all.start + r * n / replicas) * width;
            if let Some((engine, _, _)) = ran.filter(|(e, _, _)| e.plan().prediction != NONE) {
                engine.read_prediction(&mut out[at(replica)..at(replica + 1)])?;
            }
            // Each replica's stage that makes the prediction holds its share of the batch.
            let part = |rank: usize| {
                let (stage, r) = stage_of_rank(rank, replicas);
                let bytes = |i: usize| (at(i) - at(0)) * 4;
                if stage == holder {
                    bytes(r)..bytes(r + 1)
                } else {
                    0..0
                }
            };
            let batch = &mut out[at(0)..at(replicas)];
            // SAFETY: the f32 values' bytes, for as long as `batch` is borrowed here.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(batch.as_mut_ptr().cast::<u8>(), batch.len() * 4)
            };
            c.all_gather_parts(bytes, &part)
        })?;
        Ok(out)
    }

    /// The samples of `len` each batch of `evaluate` and `predict` covers, and of them the
    /// ones this rank's replica runs: global batches, then the tail, each split over the
    /// replicas as a training batch is (replica `r` of `R` takes `r·n/R .. (r+1)·n/R` of its
    /// `n` samples).
    fn inference_batches(&self, len: usize) -> Vec<(Range<usize>, Range<usize>)> {
        let (b, replicas) = (self.global_batch, self.spec.replicas.max(1));
        (0..len.div_ceil(b))
            .map(|j| {
                let start = j * b;
                let n = b.min(len - start);
                let at = |r: usize| start + r * n / replicas;
                (start..start + n, at(self.replica)..at(self.replica + 1))
            })
            .collect()
    }

    /// Builds, before anything runs, the inference engines a pass over `len` samples needs:
    /// their memory is taken when the pass (or a `fit` that validates on it) starts.
    fn reserve_inference(&mut self, len: usize) -> Result<()> {
        for (_, mine) in self.inference_batches(len) {
            if !mine.is_empty() {
                self.inference_engine(mine.len())?;
            }
        }
        Ok(())
    }

    /// The index of the inference engine for batches of `n` samples, built on first use:
    /// this stage's inference plan, the training engine's kind, joined to the pipeline.
    fn inference_engine(&mut self, n: usize) -> Result<usize> {
        if let Some(k) = self.inference_index(n) {
            return Ok(k);
        }
        let stage = self.engine.plan().stage as usize;
        let p = plan_stage_inference(&self.spec, &self.pipeline, stage, n)?;
        let mut engine = self.engine.inference_engine(p, &self.device)?;
        engine.set_collective(self.collective.clone())?;
        self.infer.push(InferenceStage {
            engine,
            current: false,
        });
        Ok(self.infer.len() - 1)
    }

    /// The index of the inference engine built for batches of `n` samples, if there is one.
    fn inference_index(&self, n: usize) -> Option<usize> {
        self.infer.iter().position(|e| e.engine.plan().batch == n)
    }

    /// Runs `data` through the pipeline a batch at a time ([`StageTrainer::inference_batches`])
    /// and hands `each`, after every batch and on every rank, the job's collective, what this
    /// rank ran (its engine, its samples and the step's output; `None` when its replica's
    /// share of a tail is empty) and the batch's samples. `each` must make a collective call
    /// over every rank: it keeps the ranks a batch apart at most, so that no send waits
    /// beyond the buffer its stage set aside. `what` names the caller in an error.
    fn over_batches(
        &mut self,
        data: &dyn Dataset,
        what: &str,
        mut each: impl FnMut(
            &dyn Collective,
            Option<(&dyn Engine, usize, StepOutput)>,
            &Range<usize>,
        ) -> Result<()>,
    ) -> Result<()> {
        self.reserve_inference(data.len())?;
        let c = self.collective.clone();
        let names: Vec<&str> = self.model_inputs.iter().map(String::as_str).collect();
        for (all, mine) in self.inference_batches(data.len()) {
            let ran = match mine.len() {
                0 => None,
                n => {
                    // Built by `reserve_inference` above.
                    let k = self.inference_index(n).ok_or_else(|| {
                        RuntimeError::Input(format!("no inference engine for {n} samples"))
                    })?;
                    let e = &mut self.infer[k];
                    if !e.current {
                        e.engine.copy_params_from(&*self.engine)?;
                        e.current = true;
                    }
                    let idx: Vec<usize> = mine.collect();
                    let mut bufs: Vec<Column> =
                        data.columns().iter().map(|c| c.buffer(n)).collect();
                    data.gather(&idx, &mut bufs)?;
                    let whole: Vec<Batch<'_>> = bufs.iter().map(|b| b.as_batch(n)).collect();
                    let inputs = stage_inputs(e.engine.plan(), &names, &whole, 0)?;
                    let out = (e.engine.evaluate_step(&inputs))
                        .map_err(|err| in_dataset(err, &idx, what))?;
                    Some((k, n, out))
                }
            };
            let ran = ran.map(|(k, n, out)| (&*self.infer[k].engine, n, out));
            each(&*c, ran, &all)?;
        }
        Ok(())
    }

    /// The peak resident growth since the stage began to be built (`None` where the
    /// platform cannot tell).
    pub fn peak_rss_growth(&self) -> Option<u64> {
        self.monitor.growth().map(|g| g.peak)
    }

    /// One step on the samples `indices` of `data`, gathered into `buffers`.
    fn step_on(
        &mut self,
        data: &dyn Dataset,
        indices: &[usize],
        buffers: &mut [Column],
    ) -> Result<StepOutput> {
        data.gather(indices, buffers)?;
        let b = self.global_batch;
        let whole: Vec<Batch<'_>> = buffers.iter().map(|c| c.as_batch(b)).collect();
        self.train_step(&whole)
    }

    /// `data` has one column per model input, each of the input's size, and some samples.
    fn check_columns(&self, data: &dyn Dataset) -> Result<()> {
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
        Ok(())
    }
}
