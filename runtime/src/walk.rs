//! `PlanExecutor<K>`: the one walk of a static plan — phases, recompute, loss scaling,
//! non-finite checks, counters, parameters by name, profiling and poisoning — over any
//! [`Kernels`]: the CPU's (`Executor`) or a GPU's (`GpuExecutor`). Each step is decoded into
//! its op's named tensors ([`memwise_plan::io`]) and handed to one typed kernel method; the
//! match over ops is exhaustive, so an op without a kernel does not compile.

use memwise_kernels as k;
use memwise_plan::io::*;
use memwise_plan::{Op, Phase, PlanStep, Reduction, StaticPlan, NONE};

use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use crate::executor::{
    attention_dims, check_inputs, check_param_values, conv_dims, convt_dims, dw_dims, param_named,
    pool_dims, readable_prediction, trainable_param_named, Batch, StepOutput,
};
use crate::kernels::{BceInput, Kernels, OpError, StepScalars, UpdateStep};

/// The poisoned-arena test's lists: the tensors whose life ends at each step, by step, and the
/// arena's padding ([`memwise_plan::StaticPlan::arena_padding`]), poisoned with them.
struct Poisoning {
    by_step: Vec<Vec<u32>>,
    padding: Vec<(u64, u64)>,
}

/// Runs training (or inference) steps of one plan over kernels `K`.
pub struct PlanExecutor<K: Kernels> {
    pub(crate) k: K,
    pub(crate) seed: u64,
    pub(crate) step_counter: u64,
    /// Optimizer updates applied (Adam's bias correction counts these).
    pub(crate) updates: u64,
    pub(crate) scaler: k::optimizer::LossScaler,
    /// What to poison after each step (the poisoned-arena test).
    poison_after: Option<Poisoning>,
    /// Seconds per step, when profiling.
    profile: Option<Vec<f64>>,
    /// Steps run in all (every phase), for tests that count work.
    pub steps_executed: u64,
    /// Data parallel: the other replicas ([`PlanExecutor::set_collective`]); model parallel:
    /// the other stages.
    collective: Option<std::sync::Arc<dyn Collective>>,
    /// A replicated pipeline's stage: the replicas of this stage, its gradients' sums.
    stage_replicas: Option<std::sync::Arc<dyn Collective>>,
    /// A pipeline stage's replica (0 but in a replicated pipeline).
    pipeline_replica: usize,
    /// [`PlanExecutor::send_buffer_bytes`].
    send_buffer_bytes: u64,
}

fn kerr(step: &PlanStep, e: k::KernelError) -> RuntimeError {
    RuntimeError::Kernel {
        step: step.index,
        op: step.op.name(),
        layer: step.layer.to_string(),
        error: e,
    }
}

fn io_err(e: IoError) -> OpError {
    OpError::Runtime(RuntimeError::Memory(e.0))
}

impl<K: Kernels> PlanExecutor<K> {
    /// Walks `k`'s plan; the weights in `k` were initialised from `seed`, which also keys
    /// dropout and sampling.
    pub fn from_kernels(k: K, seed: u64) -> PlanExecutor<K> {
        let scaler = if k.plan().loss_scaling {
            k::optimizer::LossScaler::new()
        } else {
            k::optimizer::LossScaler::disabled()
        };
        PlanExecutor {
            k,
            seed,
            step_counter: 0,
            updates: 0,
            scaler,
            poison_after: None,
            profile: None,
            steps_executed: 0,
            collective: None,
            stage_replicas: None,
            pipeline_replica: 0,
            send_buffer_bytes: 0,
        }
    }

    /// Data parallel: this executor is replica `c.rank()` of `c.size()`, which must be the
    /// plan's `replicas`. Its gradients are summed with the others' at the plan's
    /// `AllReduceGradients` steps, and each step's output is the whole batch's. Takes rank
    /// 0's seed, step counters and parameters (a collective call: every rank makes it).
    pub fn set_collective(&mut self, c: std::sync::Arc<dyn Collective>) -> Result<()> {
        if self.plan().stages > 1 {
            return self.set_stages(c);
        }
        let replicas = self.plan().replicas;
        if c.size() != replicas {
            return Err(RuntimeError::Input(format!(
                "the plan is one of {replicas} data-parallel replicas, the {} job has {} ranks: \
                 plan the model with `replicas = {}` or launch {replicas} ranks",
                c.engine(),
                c.size(),
                c.size()
            )));
        }
        self.share_counters(&*c)?;
        self.take_rank0_params(&*c)?;
        // Under ZeRO stage 1 each replica's optimizer state is its own shard's: kept as it
        // is (zeros, or this rank's checkpoint), never rank 0's.
        self.k.set_replica(c.rank())?;
        self.collective = Some(c);
        Ok(())
    }

    /// Rank 0's parameters and batch-norm statistics, in place (no copy on the CPU), as
    /// PyTorch's DistributedDataParallel does when it wraps a model: the replicas start equal
    /// whatever each was initialised with or loaded.
    fn take_rank0_params(&mut self, c: &dyn Collective) -> Result<()> {
        let params: Vec<(usize, usize)> = (self.plan().params.iter())
            .map(|p| (p.offset as usize, p.elems() * 4))
            .collect();
        self.k.write_persistent(&mut |region: &mut [u8]| {
            for &(at, len) in &params {
                c.broadcast(0, &mut region[at..at + len])?;
            }
            Ok(())
        })
    }

    /// Rank 0's seed and counters, so every rank keys its random streams and its optimizer's
    /// step alike whatever it was built or restored with.
    fn share_counters(&mut self, c: &dyn Collective) -> Result<()> {
        let mut shared = [self.seed, self.step_counter, self.updates]
            .map(u64::to_le_bytes)
            .concat();
        c.broadcast(0, &mut shared)?;
        let word =
            |i: usize| u64::from_le_bytes(shared[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        (self.seed, self.step_counter, self.updates) = (word(0), word(1), word(2));
        Ok(())
    }

    /// Model parallel: this executor runs the plan's stage on rank `c.rank()` of the job,
    /// whose other ranks run the other stages and, with the plan's `replicas`, the other
    /// replicas of the pipeline (stage `s` of replica `r` on rank
    /// [`memwise_plan::stage::stage_rank`]). Each stage keeps its own parameters, the
    /// one-device model's as initialised from the seed, which must be the same on every
    /// rank (an `Err` says so otherwise); the ranks take rank 0's counters, so that every
    /// micro-batch draws the random numbers it would draw on one device. A replicated
    /// stage's gradients are summed over its replicas, split from `c` here.
    fn set_stages(&mut self, c: std::sync::Arc<dyn Collective>) -> Result<()> {
        let plan = self.plan();
        let (stage, stages) = (plan.stage as usize, plan.stages as usize);
        let replicas = plan.replicas.max(1);
        let (at, replica) = memwise_plan::stage::stage_of_rank(c.rank(), replicas);
        if c.size() != stages * replicas || at != stage {
            let launch = if replicas > 1 {
                format!(
                    "launch {} ranks ({stages} stages × {replicas} replicas) and give rank k \
                     stage k / {replicas}'s plan",
                    stages * replicas
                )
            } else {
                format!("launch {stages} ranks and give rank k stage k's plan")
            };
            return Err(RuntimeError::Input(format!(
                "the plan is stage {stage} of a {stages}-stage pipeline{}, and this is rank {} \
                 of a {}-rank {} job: {launch}",
                if replicas > 1 {
                    format!(" of {replicas} replicas")
                } else {
                    String::new()
                },
                c.rank(),
                c.size(),
                c.engine()
            )));
        }
        if plan.training {
            self.join_stage_replicas(&c, stage, replica)?;
        }
        self.pipeline_replica = replica;
        // One step's sends, buffered once where a send could wait for its receiver.
        let sends = (self.plan().steps.iter()).filter_map(|s| match s.op {
            memwise_plan::Op::SendTensor { bytes, .. } => Some(bytes as usize),
            _ => None,
        });
        let (bytes, messages) = sends.fold((0, 0), |(b, n), x| (b + x, n + 1));
        self.send_buffer_bytes = c.reserve_sends(bytes, messages)?;
        self.collective = Some(c);
        Ok(())
    }

    /// A training stage takes rank 0's counters, checks that every stage was built from the
    /// same seed, and with replicas splits off the ranks of its stage, which sum its
    /// gradients, taking their first rank's parameters. Collective calls, every rank makes
    /// them; an inference stage makes none (it draws no random numbers and its weights are
    /// copied from its training stage), so that it can be built where only its own replica
    /// of the pipeline runs it.
    fn join_stage_replicas(
        &mut self,
        c: &std::sync::Arc<dyn Collective>,
        stage: usize,
        replica: usize,
    ) -> Result<()> {
        let own = self.seed;
        self.share_counters(&**c)?;
        if self.seed != own {
            return Err(RuntimeError::Input(format!(
                "stage {stage} was built with seed {own} and stage 0 with {}: build every stage \
                 with the same seed, so that together they hold the one-device model's weights",
                self.seed
            )));
        }
        if self.plan().replicas > 1 {
            let group = c.split(stage, replica)?;
            self.take_rank0_params(&*group)?;
            self.stage_replicas = Some(group);
        }
        Ok(())
    }

    /// Host bytes the stages' collective holds for this stage's sends
    /// ([`Collective::reserve_sends`]; 0 but on a pipeline stage whose sends could wait).
    pub fn send_buffer_bytes(&self) -> u64 {
        self.send_buffer_bytes
    }

    /// The data-parallel replicas this executor is one of, if any.
    pub fn collective(&self) -> Option<&dyn Collective> {
        self.collective.as_deref()
    }

    /// Where this executor's random streams start, in parts of the whole batch: its
    /// replica index (0 on one device), and on a pipeline stage the index of its replica's
    /// first micro-batch (its replica's `m` micro-batches are `r·m … r·m + m − 1`).
    fn replica(&self) -> u32 {
        let plan = self.plan();
        match &self.collective {
            Some(_) if plan.stages > 1 => self.pipeline_replica as u32 * plan.micro_batches,
            Some(c) if plan.replicas > 1 => c.rank() as u32,
            _ => 0,
        }
    }

    /// What the steps of the next training step share.
    fn step_cx(&self) -> StepCx<'_> {
        StepCx {
            seed: self.seed,
            step: self.step_counter,
            replica: self.replica(),
            collective: self.collective.as_deref(),
            stage_replicas: self.stage_replicas.as_deref(),
            pipeline_replica: self.pipeline_replica,
        }
    }

    pub fn plan(&self) -> &StaticPlan {
        self.k.plan()
    }

    /// The device side: its memory and kernels.
    pub fn kernels(&self) -> &K {
        &self.k
    }

    /// [`PlanExecutor::kernels`], to change (a GPU's graph switch …).
    pub fn kernels_mut(&mut self) -> &mut K {
        &mut self.k
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Training steps run so far.
    pub fn step_counter(&self) -> u64 {
        self.step_counter
    }

    /// The dynamic loss scale (1.0 when loss scaling is off).
    pub fn loss_scale(&self) -> f32 {
        self.scaler.scale()
    }

    /// Device memory in use minus before the model was built (`None` on the CPU).
    pub fn device_bytes_used(&self) -> Option<u64> {
        self.k.device_bytes_used()
    }

    /// Device memory of the device's stream and cuBLAS handle and workspace, taken before
    /// the model (`None` on the CPU).
    pub fn device_lane_bytes(&self) -> Option<u64> {
        self.k.device_lane_bytes()
    }

    /// Starts timing every step of the plan (see [`PlanExecutor::profile`]). On a GPU the
    /// times are those of launching, not of running.
    pub fn enable_profiling(&mut self) {
        self.profile = Some(vec![0.0; self.plan().steps.len()]);
    }

    /// Seconds spent per `(phase, op)` so far, largest first (profiling must be on).
    pub fn profile(&self) -> Vec<(String, f64)> {
        let Some(p) = &self.profile else {
            return Vec::new();
        };
        let mut by: Vec<(String, f64)> = Vec::new();
        for (s, t) in self.plan().steps.iter().zip(p) {
            let key = profile_key(s);
            match by.iter_mut().find(|(k, _)| *k == key) {
                Some(e) => e.1 += t,
                None => by.push((key, *t)),
            }
        }
        by.sort_by(|a, b| b.1.total_cmp(&a.1));
        by
    }

    /// Test hook: after each step, overwrite with NaN every tensor whose life ends there
    /// (unless another tensor took its bytes over in place), and the arena's padding (bytes no
    /// tensor occupies, poisoned from now on). A plan that frees anything too early, or a
    /// kernel that reads past its tensor, then poisons the result.
    pub fn enable_poisoning(&mut self) -> Result<()> {
        let plan = self.k.plan();
        let mut by_step = vec![Vec::new(); plan.steps.len()];
        let donated: std::collections::HashSet<u32> = plan
            .tensors
            .iter()
            .filter(|t| t.in_place_of != NONE)
            .map(|t| t.in_place_of)
            .collect();
        for t in plan.tensors.iter() {
            if !donated.contains(&t.id)
                && (t.last as usize) < by_step.len()
                && !plan.losses.contains(&t.id)
            {
                by_step[t.last as usize].push(t.id);
            }
        }
        let padding = plan.arena_padding();
        self.k.poison(&[], &padding)?;
        self.poison_after = Some(Poisoning { by_step, padding });
        Ok(())
    }

    /// The f32 values of parameter `name` (`hidden.weight` …).
    pub fn param(&self, name: &str) -> Result<Vec<f32>> {
        let (id, _) = param_named(self.plan(), name)?;
        self.k.read_param(id as u32, false)
    }

    /// The f32 gradient of trainable parameter `name` from the last step.
    pub fn grad(&self, name: &str) -> Result<Vec<f32>> {
        let p = trainable_param_named(self.plan(), name)?;
        let id = self.plan().params.iter().position(|q| std::ptr::eq(q, p));
        self.k.read_param(id.unwrap_or(usize::MAX) as u32, true)
    }

    /// Overwrites parameter `name` with `values` (and its 16-bit copy).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let (id, p) = param_named(self.plan(), name)?;
        check_param_values(p, values)?;
        self.k.write_param(id as u32, values)
    }

    /// The prediction tensor's values after the last step of an inference plan.
    pub fn read_prediction(&self, out: &mut [f32]) -> Result<()> {
        let t = readable_prediction(self.plan(), out.len())?;
        self.k.read_tensor(t.id, out)
    }

    /// Value of loss term `i` from the last step.
    pub fn loss_term(&self, i: usize) -> Result<f32> {
        let id = *self
            .plan()
            .losses
            .get(i)
            .ok_or_else(|| RuntimeError::Input(format!("no loss term {i}")))?;
        let mut v = [0f32];
        self.k.read_tensor(id, &mut v)?;
        Ok(v[0])
    }

    /// Runs the plan's forward and loss steps without updating (an inference plan).
    pub fn evaluate_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        if self.plan().training {
            return Err(RuntimeError::Input(
                "evaluate_step needs an inference plan (plan_inference)".into(),
            ));
        }
        self.train_step(inputs)
    }

    /// Runs one training step on `inputs` (one batch per model input, in declaration order).
    pub fn train_step(&mut self, inputs: &[Batch<'_>]) -> Result<StepOutput> {
        check_inputs(self.plan(), inputs)?;
        let _turn = self.k.take_turn();
        self.k.load_inputs(inputs)?;
        let scalars = StepScalars {
            step: self.step_counter,
            loss_scale: self.scaler.scale(),
            grad_unscale: 1.0 / self.scaler.scale(),
            update: self.updates + 1,
        };
        self.k.begin_step(&scalars)?;
        if self.plan().replicas > 1 && self.plan().training && self.collective.is_none() {
            return Err(RuntimeError::Input(format!(
                "the plan is one of {} data-parallel replicas: give the executor its \
                 collective (`set_collective`) before training",
                self.plan().replicas
            )));
        }
        // Field by field: the walk below borrows the kernels and the profile mutably.
        let cx = StepCx {
            seed: self.seed,
            step: scalars.step,
            replica: self.replica(),
            collective: self.collective.as_deref(),
            stage_replicas: self.stage_replicas.as_deref(),
            pipeline_replica: self.pipeline_replica,
        };
        let (profile, poison) = (&mut self.profile, &self.poison_after);
        // Without loss scaling a non-finite loss ends the step where the device can tell at
        // once: no gradient is computed from it (the optimizer would skip it anyway). Not
        // with replicas: each must reach the sums, which settle the flag for all.
        let stop_on_nonfinite = self.k.plan().training
            && !self.k.plan().loss_scaling
            && self.k.plan().replicas == 1
            && self.k.plan().stages == 1;
        let mut executed = 0u64;
        self.k.run_steps(&mut |k: &K| {
            let steps = &k.plan().steps;
            for (i, s) in steps.iter().enumerate() {
                let t0 = profile.is_some().then(std::time::Instant::now);
                run_in_its_transfer_run(k, steps, i, &cx.for_step(s))?;
                executed += 1;
                if let (Some(t0), Some(p)) = (t0, profile.as_mut()) {
                    p[i] += t0.elapsed().as_secs_f64();
                }
                if let Some(Poisoning { by_step, padding }) = poison {
                    k.poison(&by_step[i], padding)?;
                }
                if stop_on_nonfinite && s.phase == Phase::Loss && k.flagged_now() == Some(true) {
                    break;
                }
            }
            Ok(())
        })?;
        self.steps_executed += executed;
        let mut flags = self.k.end_step()?;
        // An inference step's output is this rank's own: `evaluate` sums what it needs.
        if let Some(c) = self.collective.as_ref().filter(|_| self.k.plan().training) {
            sum_over_replicas(&**c, &mut flags)?;
        }
        self.finish_step(inputs, flags)
    }

    /// The walk's decisions after a step: a label out of range found on a device, the loss
    /// scaler, a non-finite float32 loss (named by its first non-finite forward output),
    /// the counters.
    fn finish_step(
        &mut self,
        inputs: &[Batch<'_>],
        flags: crate::kernels::StepFlags,
    ) -> Result<StepOutput> {
        if let Some(i) = flags.bad_index {
            return Err(RuntimeError::Input(format!(
                "sample or token {i} has a label or id out of range; the weights were not updated"
            )));
        }
        let mut out = StepOutput {
            loss: flags.loss,
            correct: flags.correct,
            skipped: false,
        };
        if self.plan().training {
            if self.plan().loss_scaling {
                if let k::optimizer::StepDecision::Skip = self.scaler.update(flags.nonfinite) {
                    out.skipped = true;
                }
            } else if flags.nonfinite {
                // The optimizer skipped its updates: the weights are those before the step.
                let culprit = self.first_non_finite(inputs)?;
                return Err(RuntimeError::NonFinite(format!(
                    "training step {}: the loss is {}; {culprit}. The weights were not updated.",
                    self.step_counter + 1,
                    flags.loss
                )));
            }
        }
        if !out.skipped {
            self.updates += 1;
        }
        self.step_counter += 1;
        Ok(out)
    }

    /// Re-runs the forward steps on `inputs`, checking every float output, and names the
    /// first layer whose output is not finite (the weights are those the step started from).
    fn first_non_finite(&mut self, inputs: &[Batch<'_>]) -> Result<String> {
        if self.plan().stages > 1 {
            // Re-running one stage's forward would send and wait for the other stages.
            return Ok(format!(
                "the pipeline's stages agreed to skip the update (this is stage {} of {})",
                self.plan().stage,
                self.plan().stages
            ));
        }
        self.k.load_inputs(inputs)?;
        let plan = self.k.plan();
        for (i, &id) in plan.inputs.iter().enumerate() {
            if !self.k.tensor_finite(id)? {
                return Ok(format!(
                    "input {i} (`{}`) holds non-finite values",
                    plan.tensor(id).name
                ));
            }
        }
        let cx = self.step_cx();
        for s in plan.steps.iter().take_while(|s| s.phase == Phase::Forward) {
            run_step(&self.k, s, &cx)?;
            let n = s.writes.len().saturating_sub(2);
            for &w in &s.writes[..n] {
                if w != NONE && !self.k.tensor_finite(w)? {
                    let t = plan.tensor(w);
                    return Ok(format!(
                        "the first non-finite value appears in the output `{}` of layer `{}` ({} at step {})",
                        t.name, s.layer, s.op.name(), s.index
                    ));
                }
            }
        }
        Ok("every forward output is finite: the loss itself overflowed".to_string())
    }
}

/// Data parallel: one step's output over every replica — the loss (each replica's is its
/// share of the whole batch's, [`memwise_plan::ModelSpec::per_replica`]), the correct
/// predictions, and a label out of range anywhere — so every rank decides alike.
fn sum_over_replicas(c: &dyn Collective, flags: &mut crate::kernels::StepFlags) -> Result<()> {
    let mut v = [
        flags.loss as f64,
        flags.correct as f64,
        flags.bad_index.is_some() as u8 as f64,
    ];
    c.all_reduce_sum_f64(&mut v)?;
    flags.loss = v[0] as f32;
    flags.correct = v[1] as usize;
    if v[2] > 0.0 && flags.bad_index.is_none() {
        return Err(RuntimeError::Input(
            "another replica's batch has a label or id out of range; the weights were not updated"
                .into(),
        ));
    }
    Ok(())
}

/// What the steps of one training step share: the random streams' seed and step, and
/// data parallelism's replica and collective.
#[derive(Clone, Copy)]
pub struct StepCx<'c> {
    pub seed: u64,
    pub step: u64,
    /// This replica's index (0 on one device): where its random streams start.
    pub replica: u32,
    /// Every rank of the job: data parallelism's replicas, or a pipeline's stages.
    pub collective: Option<&'c dyn Collective>,
    /// A replicated pipeline's stage: the replicas of this stage, which sum its gradients.
    pub stage_replicas: Option<&'c dyn Collective>,
    /// A pipeline stage: its pipeline's replica, whose stages it sends to and receives from
    /// (on the ranks [`memwise_plan::stage::stage_rank`] gives).
    pub pipeline_replica: usize,
}

impl StepCx<'_> {
    /// What step `s` sees: its micro-batch's random streams start where that micro-batch's
    /// rows start in its replica's batch (the micro-batches of replica `r` are `r·m … r·m +
    /// m − 1` of the whole batch; a pipeline has one replica today).
    fn for_step(&self, s: &PlanStep) -> StepCx<'_> {
        StepCx {
            replica: self.replica + s.micro_batch,
            ..*self
        }
    }

    /// Step `step` of one device's training.
    pub fn one_device(seed: u64, step: u64) -> StepCx<'static> {
        StepCx {
            seed,
            step,
            replica: 0,
            collective: None,
            stage_replicas: None,
            pipeline_replica: 0,
        }
    }

    /// The random stream of layer `layer`'s tensor of `elems` elements on this replica
    /// ([`k::random::RngKey::first_block`]).
    fn key(&self, layer: u32, elems: usize) -> std::result::Result<k::random::RngKey, OpError> {
        let first = self.replica as u64 * (elems as u64).div_ceil(4);
        let first_block = u32::try_from(first).map_err(|_| {
            OpError::Runtime(RuntimeError::Input(format!(
                "replica {}'s random numbers for {elems} elements start past one stream's 2^34",
                self.replica
            )))
        })?;
        Ok(k::random::RngKey {
            seed: self.seed,
            layer,
            step: self.step,
            first_block,
        })
    }
}

/// Runs step `s` on `k`: decodes its tensors and calls its op's kernel for its phase.
pub(crate) fn run_step<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> Result<()> {
    let r = match s.phase {
        Phase::Forward | Phase::Recompute => forward(k, s, cx),
        Phase::Backward => backward(k, s, cx),
        Phase::Loss => loss(k, s),
        Phase::Update => update(k, s, cx),
    };
    r.map_err(|e| step_error(s, e))
}

/// `e`, from step `s`, named by the step where the kernel's words do not name it.
fn step_error(s: &PlanStep, e: OpError) -> RuntimeError {
    match e {
        OpError::Kernel(e) => kerr(s, e),
        OpError::Runtime(RuntimeError::Memory(m)) => RuntimeError::Memory(at_step(s, &m)),
        // A device's failed launch, or a dtype mix it has no kernel for: named by its step too.
        OpError::Runtime(RuntimeError::Device(m)) => RuntimeError::Device(at_step(s, &m)),
        OpError::Runtime(e) => e,
    }
}

/// Runs step `i` of `steps`. A pipeline stage's run of consecutive transfers (the sends that
/// end one unit and the receives that begin the next) is opened before its first step and
/// closed after its last ([`Kernels::transfer_run`]), or at once when a step inside it fails.
fn run_in_its_transfer_run<K: Kernels>(
    k: &K,
    steps: &[PlanStep],
    i: usize,
    cx: &StepCx<'_>,
) -> Result<()> {
    let s = &steps[i];
    let is_transfer = |t: &PlanStep| matches!(t.op, Op::SendTensor { .. } | Op::RecvTensor { .. });
    let (Some(c), true) = (cx.collective, is_transfer(s)) else {
        return run_step(k, s, cx);
    };
    let edge = |j: Option<usize>| j.and_then(|j| steps.get(j)).is_none_or(|t| !is_transfer(t));
    let run = |begin: bool| k.transfer_run(begin, c).map_err(|e| step_error(s, e));
    if edge(i.checked_sub(1)) {
        run(true)?;
    }
    let ran = run_step(k, s, cx);
    if edge(Some(i + 1)) || ran.is_err() {
        let ended = run(false);
        ran?;
        return ended;
    }
    ran
}

fn at_step(s: &PlanStep, m: &str) -> String {
    format!(
        "step {} ({} of layer `{}`): {m}",
        s.index,
        s.op.name(),
        s.layer
    )
}

fn not_in_phase(s: &PlanStep) -> OpError {
    OpError::Runtime(RuntimeError::Memory(format!(
        "{} has no {} step",
        s.op.name(),
        s.phase.name()
    )))
}

/// Both attention ops, forward and backward (the backward of the materialising one draws
/// nothing: its mask is saved).
fn attention<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> std::result::Result<(), OpError> {
    let backward = s.phase == Phase::Backward;
    let Some(a) = s.op.attention() else {
        return Err(not_in_phase(s));
    };
    let (d, causal, dropout) = (attention_dims(&a), a.causal, a.dropout);
    let key = cx.key(a.key, d.batch * d.heads * d.seq * d.seq)?;
    match (a.flash, backward) {
        (false, false) => k.attention(
            &AttentionForward::of(s).map_err(io_err)?,
            d,
            causal,
            dropout,
            key,
        ),
        (false, true) => {
            k.attention_backward(&AttentionBackward::of(s).map_err(io_err)?, d, dropout)
        }
        (true, false) => {
            let io = FlashAttentionForward::of(s).map_err(io_err)?;
            k.flash_attention(&io, d, causal, dropout, key)
        }
        (true, true) => {
            let io = FlashAttentionBackward::of(s).map_err(io_err)?;
            k.flash_attention_backward(&io, d, causal, dropout, key)
        }
    }
}

fn forward<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> std::result::Result<(), OpError> {
    let recompute = s.phase == Phase::Recompute;
    match s.op {
        Op::InputCast { scale, .. } => k.input_cast(&UnaryForward::of(s).map_err(io_err)?, scale),
        Op::Cast { .. } => k.cast(&UnaryForward::of(s).map_err(io_err)?),
        Op::Dense {
            rows,
            in_features,
            units,
            ..
        } => k.dense(
            &LinearForward::of(s).map_err(io_err)?,
            k::dense::DenseDims {
                batch: rows,
                in_features,
                out_features: units,
            },
        ),
        Op::Conv2d { dims, chunk, .. } => k.conv2d(
            &LinearForward::of(s).map_err(io_err)?,
            conv_dims(&dims),
            chunk,
        ),
        Op::DepthwiseConv2d { dims, .. } => {
            k.depthwise_conv2d(&LinearForward::of(s).map_err(io_err)?, dw_dims(&dims))
        }
        Op::Conv2dTranspose { dims, chunk, .. } => k.conv2d_transpose(
            &LinearForward::of(s).map_err(io_err)?,
            convt_dims(&dims),
            chunk,
        ),
        Op::MaxPool2d { dims } => {
            k.max_pool2d(&MaxPoolForward::of(s).map_err(io_err)?, &pool_dims(&dims)?)
        }
        Op::AvgPool2d { dims } => {
            k.avg_pool2d(&UnaryForward::of(s).map_err(io_err)?, &pool_dims(&dims)?)
        }
        Op::GlobalAvgPool { n, hw, c } => {
            k.global_avg_pool(&UnaryForward::of(s).map_err(io_err)?, n, hw, c)
        }
        Op::BatchNorm {
            rows,
            channels,
            momentum,
            epsilon,
            ..
        } => k.batch_norm(
            &BatchNormForward::of(s).map_err(io_err)?,
            k::norm::NormDims { rows, channels },
            k::norm::BatchNormConfig { epsilon, momentum },
            !recompute,
        ),
        Op::BatchNormInference {
            rows,
            channels,
            epsilon,
        } => k.batch_norm_inference(
            &BatchNormInferenceForward::of(s).map_err(io_err)?,
            k::norm::NormDims { rows, channels },
            epsilon,
        ),
        Op::LayerNorm {
            rows,
            features,
            epsilon,
            ..
        } => k.layer_norm(
            &LayerNormForward::of(s).map_err(io_err)?,
            k::norm::NormDims {
                rows,
                channels: features,
            },
            epsilon,
        ),
        Op::GroupNorm {
            samples,
            spatial,
            channels,
            groups,
            epsilon,
            center,
        } => k.group_norm(
            &GroupNormForward::of(s).map_err(io_err)?,
            k::norm::GroupNormDims {
                samples,
                spatial,
                channels,
                groups,
                center,
            },
            epsilon,
        ),
        Op::Dropout {
            rate,
            key: l,
            elems,
        } => k.dropout(
            &DropoutForward::of(s).map_err(io_err)?,
            rate,
            cx.key(l, elems)?,
        ),
        Op::Activation { act, elems, cols } => k.activation(
            &UnaryForward::of(s).map_err(io_err)?,
            act,
            elems / cols.max(1),
            cols,
        ),
        Op::Add { .. } => k.add(&AddForward::of(s).map_err(io_err)?),
        Op::Concat { rows, a, b } => k.concat(&ConcatForward::of(s).map_err(io_err)?, rows, a, b),
        Op::Embedding { tokens, vocab, dim } => k.embedding(
            &EmbeddingForward::of(s).map_err(io_err)?,
            k::embedding::EmbeddingDims { tokens, vocab, dim },
        ),
        Op::PositionalEmbedding { batch, seq, dim } => k.positional_embedding(
            &PositionalEmbeddingForward::of(s).map_err(io_err)?,
            batch,
            seq.saturating_mul(dim),
        ),
        Op::Attention { .. } | Op::FlashAttention { .. } => attention(k, s, cx),
        Op::SampleNormal { key: l, elems } => k.sample_normal(
            &SampleNormalForward::of(s).map_err(io_err)?,
            cx.key(l, elems)?,
        ),
        Op::Accumulate { .. }
        | memwise_plan::loss_ops!()
        | Op::KlNormal { .. }
        | Op::CheckFinite
        | Op::AllReduceGradients { .. }
        | Op::Update
        | Op::AllGatherParams { .. } => Err(not_in_phase(s)),
        Op::SendTensor { .. } | Op::RecvTensor { .. } => transfer(k, s, cx),
    }
}

fn backward<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> std::result::Result<(), OpError> {
    match s.op {
        Op::Cast { .. } => k.cast_backward(&UnaryBackward::of(s).map_err(io_err)?),
        Op::Dense {
            rows,
            in_features,
            units,
            ..
        } => k.dense_backward(
            &LinearBackward::of(s).map_err(io_err)?,
            k::dense::DenseDims {
                batch: rows,
                in_features,
                out_features: units,
            },
        ),
        Op::Conv2d { dims, chunk, .. } => k.conv2d_backward(
            &LinearBackward::of(s).map_err(io_err)?,
            conv_dims(&dims),
            chunk,
        ),
        Op::DepthwiseConv2d { dims, .. } => {
            k.depthwise_conv2d_backward(&LinearBackward::of(s).map_err(io_err)?, dw_dims(&dims))
        }
        Op::Conv2dTranspose { dims, chunk, .. } => k.conv2d_transpose_backward(
            &LinearBackward::of(s).map_err(io_err)?,
            convt_dims(&dims),
            chunk,
        ),
        Op::MaxPool2d { dims } => {
            k.max_pool2d_backward(&SavedBackward::of(s).map_err(io_err)?, &pool_dims(&dims)?)
        }
        Op::AvgPool2d { dims } => {
            k.avg_pool2d_backward(&UnaryBackward::of(s).map_err(io_err)?, &pool_dims(&dims)?)
        }
        Op::GlobalAvgPool { n, hw, c } => {
            k.global_avg_pool_backward(&UnaryBackward::of(s).map_err(io_err)?, n, hw, c)
        }
        Op::BatchNorm {
            rows,
            channels,
            rebuild_x_hat: true,
            ..
        } => k.batch_norm_backward_rebuild(
            &BatchNormRebuildBackward::of(s).map_err(io_err)?,
            k::norm::NormDims { rows, channels },
        ),
        Op::BatchNorm {
            rows,
            channels,
            rebuild_x_hat: false,
            ..
        } => k.batch_norm_backward(
            &NormBackward::of(s).map_err(io_err)?,
            k::norm::NormDims { rows, channels },
        ),
        Op::LayerNorm {
            rows,
            features,
            rebuild_x_hat: true,
            ..
        } => k.layer_norm_backward_rebuild(
            &LayerNormRebuildBackward::of(s).map_err(io_err)?,
            k::norm::NormDims {
                rows,
                channels: features,
            },
        ),
        Op::LayerNorm {
            rows,
            features,
            rebuild_x_hat: false,
            ..
        } => k.layer_norm_backward(
            &NormBackward::of(s).map_err(io_err)?,
            k::norm::NormDims {
                rows,
                channels: features,
            },
        ),
        Op::GroupNorm {
            samples,
            spatial,
            channels,
            groups,
            center,
            ..
        } => k.group_norm_backward(
            &GroupNormBackward::of(s).map_err(io_err)?,
            k::norm::GroupNormDims {
                samples,
                spatial,
                channels,
                groups,
                center,
            },
        ),
        Op::Dropout { rate, .. } => {
            k.dropout_backward(&SavedBackward::of(s).map_err(io_err)?, rate)
        }
        Op::Activation { act, elems, cols } => k.activation_backward(
            &SavedBackward::of(s).map_err(io_err)?,
            act,
            elems / cols.max(1),
            cols,
        ),
        Op::Concat { rows, a, b } => {
            k.concat_backward(&ConcatBackward::of(s).map_err(io_err)?, rows, a, b)
        }
        Op::Embedding { tokens, vocab, dim } => k.embedding_backward(
            &EmbeddingBackward::of(s).map_err(io_err)?,
            k::embedding::EmbeddingDims { tokens, vocab, dim },
        ),
        Op::Attention { .. } | Op::FlashAttention { .. } => attention(k, s, cx),
        Op::PositionalEmbedding { batch, seq, dim } => k.positional_embedding_backward(
            &PositionalEmbeddingBackward::of(s).map_err(io_err)?,
            batch,
            seq.saturating_mul(dim),
        ),
        Op::SampleNormal { key: l, elems } => k.sample_normal_backward(
            &SampleNormalBackward::of(s).map_err(io_err)?,
            cx.key(l, elems)?,
        ),
        Op::Accumulate { .. } => k.accumulate(&AccumulateIo::of(s).map_err(io_err)?),
        Op::AllReduceGradients { last, .. } => all_reduce_gradients(k, s, last, cx),
        Op::InputCast { .. }
        | Op::Add { .. }
        | Op::BatchNormInference { .. }
        | memwise_plan::loss_ops!()
        | Op::KlNormal { .. }
        | Op::CheckFinite
        | Op::Update
        | Op::AllGatherParams { .. } => Err(not_in_phase(s)),
        Op::SendTensor { .. } | Op::RecvTensor { .. } => transfer(k, s, cx),
    }
}

/// A pipeline stage's send or receive, to or from another stage's rank.
fn transfer<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> std::result::Result<(), OpError> {
    let Some(c) = cx.collective else {
        return Err(OpError::Runtime(RuntimeError::Input(
            "a pipeline stage's plan sends and receives: give the executor the stages' \
             collective (`set_collective`) before training"
                .into(),
        )));
    };
    let rank = |stage: u32| {
        memwise_plan::stage::stage_rank(stage as usize, cx.pipeline_replica, k.plan().replicas)
    };
    match s.op {
        Op::SendTensor { stage, .. } => {
            k.send_tensor(&SendIo::of(s).map_err(io_err)?, rank(stage), c)
        }
        Op::RecvTensor { stage, .. } => {
            k.recv_tensor(&RecvIo::of(s).map_err(io_err)?, rank(stage), c)
        }
        _ => Err(not_in_phase(s)),
    }
}

fn loss<K: Kernels>(k: &K, s: &PlanStep) -> std::result::Result<(), OpError> {
    let bce = |input: BceInput, rows, features, reduction, weight| {
        k.binary_crossentropy(
            &LossIo::of(s).map_err(io_err)?,
            rows,
            features,
            reduction,
            weight,
            input,
        )
    };
    match s.op {
        Op::SoftmaxCrossEntropy {
            rows,
            classes,
            weight,
        } => k.sparse_categorical_crossentropy(
            &LossIo::of(s).map_err(io_err)?,
            rows,
            classes,
            weight,
            false,
        ),
        Op::SoftmaxCrossEntropyFromLogits {
            rows,
            classes,
            weight,
        } => k.sparse_categorical_crossentropy(
            &LossIo::of(s).map_err(io_err)?,
            rows,
            classes,
            weight,
            true,
        ),
        Op::SigmoidBinaryCrossentropy {
            rows,
            features,
            reduction,
            weight,
        } => bce(BceInput::FusedSigmoid, rows, features, reduction, weight),
        Op::BinaryCrossentropyFromLogits {
            rows,
            features,
            reduction,
            weight,
        } => bce(BceInput::Logits, rows, features, reduction, weight),
        Op::BinaryCrossentropy {
            rows,
            features,
            reduction,
            weight,
        } => bce(BceInput::Probabilities, rows, features, reduction, weight),
        Op::MeanSquaredError {
            rows,
            features,
            reduction,
            weight,
        } => k.mean_squared_error(
            &LossIo::of(s).map_err(io_err)?,
            rows,
            features,
            reduction,
            weight,
        ),
        Op::KlNormal {
            rows,
            features,
            reduction,
            weight,
        } => {
            // The kernel sums over features; a mean divides by them.
            let w = if reduction == Reduction::Mean {
                weight / features as f32
            } else {
                weight
            };
            k.kl_normal(&KlIo::of(s).map_err(io_err)?, rows, features, w)
        }
        Op::InputCast { .. }
        | Op::Cast { .. }
        | Op::Dense { .. }
        | Op::Conv2d { .. }
        | Op::DepthwiseConv2d { .. }
        | Op::Conv2dTranspose { .. }
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::GlobalAvgPool { .. }
        | Op::BatchNorm { .. }
        | Op::BatchNormInference { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Dropout { .. }
        | Op::Activation { .. }
        | Op::Add { .. }
        | Op::Concat { .. }
        | Op::Embedding { .. }
        | Op::PositionalEmbedding { .. }
        | Op::Attention { .. }
        | Op::FlashAttention { .. }
        | Op::SampleNormal { .. }
        | Op::Accumulate { .. }
        | Op::CheckFinite
        | Op::AllReduceGradients { .. }
        | Op::Update
        | Op::AllGatherParams { .. }
        | Op::SendTensor { .. }
        | Op::RecvTensor { .. } => Err(not_in_phase(s)),
    }
}

/// A data-parallel gradient sum, over the replicas (of this stage, in a replicated
/// pipeline); or a pipeline's flag sum (no gradients, `last`), over every rank.
fn all_reduce_gradients<K: Kernels>(
    k: &K,
    s: &PlanStep,
    last: bool,
    cx: &StepCx<'_>,
) -> std::result::Result<(), OpError> {
    let over = match cx.stage_replicas {
        Some(replicas) if !s.params.is_empty() => Some(replicas),
        _ => cx.collective,
    };
    match over {
        Some(c) => k.all_reduce_gradients(&s.params, last, c),
        None => Err(OpError::Runtime(RuntimeError::Input(
            "a data-parallel plan's gradient sum without the other replicas".into(),
        ))),
    }
}

fn update<K: Kernels>(k: &K, s: &PlanStep, cx: &StepCx<'_>) -> std::result::Result<(), OpError> {
    match s.op {
        Op::CheckFinite => k.check_finite(),
        Op::Update => k.update(
            s,
            UpdateStep {
                optimizer: k.plan().optimizer,
                params: &s.params,
                rank: cx.replica as usize,
            },
        ),
        // A pipeline stage's flag sum comes after its finite check (`memwise_plan::stage`).
        Op::AllReduceGradients { last, .. } => all_reduce_gradients(k, s, last, cx),
        Op::AllGatherParams { .. } => match cx.collective {
            Some(c) => k.all_gather_params(&s.params, c),
            None => Err(OpError::Runtime(RuntimeError::Input(
                "a ZeRO plan's all-gather of updated weights without the other replicas".into(),
            ))),
        },
        Op::InputCast { .. }
        | Op::Cast { .. }
        | Op::Dense { .. }
        | Op::Conv2d { .. }
        | Op::DepthwiseConv2d { .. }
        | Op::Conv2dTranspose { .. }
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::GlobalAvgPool { .. }
        | Op::BatchNorm { .. }
        | Op::BatchNormInference { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Dropout { .. }
        | Op::Activation { .. }
        | Op::Add { .. }
        | Op::Concat { .. }
        | Op::Embedding { .. }
        | Op::PositionalEmbedding { .. }
        | Op::Attention { .. }
        | Op::FlashAttention { .. }
        | Op::SampleNormal { .. }
        | Op::Accumulate { .. }
        | memwise_plan::loss_ops!()
        | Op::KlNormal { .. }
        | Op::SendTensor { .. }
        | Op::RecvTensor { .. } => Err(not_in_phase(s)),
    }
}

/// The `(phase, op)` a step's time is counted under in [`PlanExecutor::profile`].
pub fn profile_key(s: &PlanStep) -> String {
    format!("{} {}", s.phase.name(), s.op.name())
}
