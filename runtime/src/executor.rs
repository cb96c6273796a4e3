//! `Executor`, the CPU's walk of a plan ([`crate::walk::PlanExecutor`] over
//! [`crate::cpu::CpuKernels`]), and what every executor shares: input batches and their
//! checks, a step's output, parameter lookups by name, and the plan-to-kernel geometry.

use half::{bf16, f16};
use memwise_kernels as k;
use memwise_plan::op::AttentionSettings;
use memwise_plan::{DType, Op, PlanParam, PlanTensor, StaticPlan, Window2d, NONE, NO_OFFSET};

use crate::cpu::CpuKernels;
use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::walk::PlanExecutor;

/// Runs training steps of one plan on the CPU.
pub type Executor = PlanExecutor<CpuKernels>;

impl PlanExecutor<CpuKernels> {
    /// Allocates the two regions of `plan` on `device` (failing with the numbers, before any
    /// allocation, when the plan exceeds the device's memory) and initialises the weights as
    /// Keras does (Glorot-uniform kernels, zero biases, unit norm scales), seeded.
    pub fn new(plan: StaticPlan, device: &Device, seed: u64) -> Result<Executor> {
        Ok(PlanExecutor::from_kernels(
            CpuKernels::new(plan, device, seed)?,
            seed,
        ))
    }

    /// The whole persistent region (parameters, 16-bit copies, gradients, optimizer state).
    pub fn persistent_bytes(&self) -> &[u8] {
        self.kernels().persistent_bytes()
    }
}

/// One input batch, in the input's stored dtype.
#[derive(Clone, Copy, Debug)]
pub enum Batch<'a> {
    U8(&'a [u8]),
    I32(&'a [i32]),
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Batch<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Batch::U8(_) => DType::U8,
            Batch::I32(_) => DType::I32,
            Batch::F32(_) => DType::F32,
            Batch::F16(_) => DType::F16,
            Batch::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Batch::U8(x) => x.len(),
            Batch::I32(x) => x.len(),
            Batch::F32(x) => x.len(),
            Batch::F16(x) => x.len(),
            Batch::BF16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Elements `range` of the batch (`None` past its end).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Option<Self> {
        Some(match self {
            Batch::U8(x) => Batch::U8(x.get(range)?),
            Batch::I32(x) => Batch::I32(x.get(range)?),
            Batch::F32(x) => Batch::F32(x.get(range)?),
            Batch::F16(x) => Batch::F16(x.get(range)?),
            Batch::BF16(x) => Batch::BF16(x.get(range)?),
        })
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        fn b<T>(x: &[T]) -> &[u8] {
            // SAFETY: plain-old-data element types, reinterpreted as their bytes.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
        }
        match self {
            Batch::U8(x) => x,
            Batch::I32(x) => b(x),
            Batch::F32(x) => b(x),
            Batch::F16(x) => b(x),
            Batch::BF16(x) => b(x),
        }
    }
}

/// What one training step produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// Sum of the weighted loss terms (unscaled).
    pub loss: f32,
    /// Predictions (rows of the classification losses: samples, or tokens of a sequence) whose
    /// arg-max matched the label, else 0.
    pub correct: usize,
    /// Mixed precision found a non-finite gradient: the update was skipped.
    pub skipped: bool,
}

/// A storage type and its plan dtype.
pub trait Stored: Copy + 'static {
    const DTYPE: DType;
}
impl Stored for f32 {
    const DTYPE: DType = DType::F32;
}
impl Stored for f16 {
    const DTYPE: DType = DType::F16;
}
impl Stored for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Stored for u8 {
    const DTYPE: DType = DType::U8;
}
impl Stored for i32 {
    const DTYPE: DType = DType::I32;
}

/// Runs `$body` with `$T` bound to the element type of float dtype `$dt` (the [`Stored`] type
/// of that dtype), and `$else` for the other dtypes (`$other` bound to the dtype): the one
/// dispatch from a plan's float dtype to a kernel's type parameter.
macro_rules! match_float {
    ($dt:expr, $T:ident, $body:expr, $other:pat => $else:expr) => {
        match $dt {
            ::memwise_plan::DType::F32 => {
                type $T = f32;
                $body
            }
            ::memwise_plan::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            ::memwise_plan::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            $other => $else,
        }
    };
}
pub(crate) use match_float;

/// A conv2d step's kernel dims: the plan's window shape itself.
pub(crate) fn conv_dims(d: &Window2d) -> k::conv::Conv2dDims {
    *d
}

/// A conv2d_transpose step's kernel dims (the kernels' transposed rules over the same fields).
pub(crate) fn convt_dims(d: &Window2d) -> k::conv::ConvTranspose2dDims {
    k::conv::ConvTranspose2dDims {
        n: d.n,
        h: d.h,
        w: d.w,
        c_in: d.c_in,
        c_out: d.c_out,
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: d.padding,
    }
}

pub(crate) fn dw_dims(d: &Window2d) -> k::conv::DepthwiseConv2dDims {
    k::conv::DepthwiseConv2dDims {
        n: d.n,
        h: d.h,
        w: d.w,
        c: d.c_in,
        multiplier: d.c_out / d.c_in.max(1),
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: d.padding,
    }
}

pub(crate) fn pool_dims(d: &Window2d) -> std::result::Result<k::pool::Pool2d, k::KernelError> {
    let p = d.padding;
    let (out_h, pad_top) = k::pool::tf_out_and_pad(d.h, d.kh, d.sh, p)?;
    let (out_w, pad_left) = k::pool::tf_out_and_pad(d.w, d.kw, d.sw, p)?;
    Ok(k::pool::Pool2d {
        n: d.n,
        h: d.h,
        w: d.w,
        c: d.c_in,
        kh: d.kh,
        kw: d.kw,
        sh: d.sh,
        sw: d.sw,
        padding: p,
        out_h,
        out_w,
        pad_top,
        pad_left,
    })
}

/// Parameter `name` of `plan` and its index; the error names it. Shared by the CPU and GPU
/// executors, like the lookups below, so both answer a wrong name in the same words.
pub(crate) fn param_named<'p>(plan: &'p StaticPlan, name: &str) -> Result<(usize, &'p PlanParam)> {
    plan.params
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == name)
        .ok_or_else(|| RuntimeError::Input(format!("the model has no parameter `{name}`")))
}

/// Trainable parameter `name` of `plan` (one with a gradient).
pub(crate) fn trainable_param_named<'p>(plan: &'p StaticPlan, name: &str) -> Result<&'p PlanParam> {
    plan.params
        .iter()
        .find(|p| p.name == name && p.grad_offset != NO_OFFSET)
        .ok_or_else(|| {
            RuntimeError::Input(format!("the model has no trainable parameter `{name}`"))
        })
}

/// Checks that `values` are exactly parameter `p`'s values.
pub(crate) fn check_param_values(p: &PlanParam, values: &[f32]) -> Result<()> {
    if values.len() != p.elems() {
        return Err(RuntimeError::Input(format!(
            "parameter `{}` has {} values ({:?}), got {}",
            p.name,
            p.elems(),
            &p.shape[..],
            values.len()
        )));
    }
    Ok(())
}

/// The prediction tensor of an inference plan, checked against a buffer of `len` values. A
/// training plan is refused: its later steps may reuse the prediction's bytes, so what is
/// read there after a step is not the prediction.
pub(crate) fn readable_prediction(plan: &StaticPlan, len: usize) -> Result<&PlanTensor> {
    if plan.prediction == NONE {
        return Err(RuntimeError::Input("the model has no prediction".into()));
    }
    if plan.training {
        return Err(RuntimeError::Input(
            "read_prediction needs an inference plan (plan_inference)".into(),
        ));
    }
    let t = plan.tensor(plan.prediction);
    if len != t.elems() {
        return Err(RuntimeError::Input(format!(
            "prediction has {} values, buffer {len}",
            t.elems()
        )));
    }
    Ok(t)
}

/// An attention step's geometry (its score scale is `AttentionDims::scale`).
pub(crate) fn attention_dims(a: &AttentionSettings) -> k::attention::AttentionDims {
    k::attention::AttentionDims {
        batch: a.batch,
        seq: a.seq,
        hidden: a.heads * a.head_dim,
        heads: a.heads,
    }
}

/// A pipeline stage's inputs from the whole batch's: for each input of the stage's plan
/// (micro-batch `k`'s copy of a model input, `memwise_plan::stage::micro_batch_name`), its
/// rows of the model input of that name in `whole`, one per name of `model_inputs` (the
/// one-device plan's input tensors' names, in its order). The stage runs pipeline replica
/// `replica` of the plan's `replicas`, whose `m` micro-batches are the parts `replica · m …
/// replica · m + m − 1` of the whole batch. An inference stage's plan
/// ([`memwise_plan::stage::plan_stage_inference`]) runs its replica's samples as its one
/// micro-batch: `whole` is then that replica's samples alone, and `replica` is not read.
pub fn stage_inputs<'a>(
    plan: &StaticPlan,
    model_inputs: &[&str],
    whole: &[Batch<'a>],
    replica: usize,
) -> Result<Vec<Batch<'a>>> {
    if whole.len() != model_inputs.len() {
        return Err(RuntimeError::Input(format!(
            "{} model inputs named ({}), {} batches given",
            model_inputs.len(),
            model_inputs.join(", "),
            whole.len()
        )));
    }
    let micro = plan.micro_batches.max(1) as usize;
    let (parts, first) = if plan.training {
        (micro * plan.replicas.max(1), replica * micro)
    } else {
        (micro, 0)
    };
    (plan.inputs.iter())
        .map(|&id| {
            let t = plan.tensor(id);
            let found = memwise_plan::stage::split_micro_batch_name(&t.name)
                .and_then(|(base, k)| Some((model_inputs.iter().position(|&n| n == base)?, k)));
            let Some((i, k)) = found else {
                return Err(RuntimeError::Input(format!(
                    "the stage reads `{}`, which is no micro-batch of the model inputs {}",
                    t.name,
                    model_inputs.join(", ")
                )));
            };
            let each = t.elems();
            whole[i]
                .slice((first + k) * each..(first + k + 1) * each)
                .filter(|_| whole[i].len() == parts * each)
                .ok_or_else(|| {
                    RuntimeError::Input(format!(
                        "model input `{}` holds {} values; the pipeline's {parts} micro-batches \
                         of {} samples take {}",
                        model_inputs[i],
                        whole[i].len(),
                        plan.batch,
                        parts * each
                    ))
                })
        })
        .collect()
}

/// Checks `inputs` against `plan`'s inputs before anything is copied or run: their count,
/// dtypes and lengths; no NaN or infinity in float inputs; labels and token ids in range.
/// Shared by the CPU and GPU executors, so both refuse the same batches with the same words.
pub(crate) fn check_inputs(plan: &StaticPlan, inputs: &[Batch<'_>]) -> Result<()> {
    let ids = &plan.inputs;
    if inputs.len() != ids.len() {
        let names: Vec<&str> = ids.iter().map(|&i| plan.tensor(i).name.as_ref()).collect();
        return Err(RuntimeError::Input(format!(
            "the model takes {} inputs ({}), got {}",
            ids.len(),
            names.join(", "),
            inputs.len()
        )));
    }
    for (b, &id) in inputs.iter().zip(ids.iter()) {
        let t = plan.tensor(id);
        if b.dtype() != t.dtype {
            return Err(RuntimeError::Input(format!(
                "input `{}` holds {} values, got {}",
                t.name,
                t.dtype.name(),
                b.dtype().name()
            )));
        }
        if b.len() != t.elems() {
            // Say what the batch was, when it is whole samples: a batch larger than the
            // plan's is refused here, before a byte is copied into the arena.
            let per = t.shape.get(1..).map_or(1, |s| s.iter().product::<usize>());
            let samples = match b.len().checked_div(per) {
                Some(n) if n * per == b.len() => format!(
                    " (a batch of {n}; this plan's batch is {}: plan the model for {n} or split the batch)",
                    plan.batch
                ),
                _ => String::new(),
            };
            return Err(RuntimeError::Input(format!(
                "input `{}` expects {} values (shape {:?}), got {}{samples}",
                t.name,
                t.elems(),
                &t.shape[..],
                b.len()
            )));
        }
    }
    for (b, &id) in inputs.iter().zip(ids.iter()) {
        let bad = match b {
            Batch::F32(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::F16(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::BF16(x) => x
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, x[i].to_string())),
            Batch::U8(_) | Batch::I32(_) => None,
        };
        if let Some((i, value)) = bad {
            let t = plan.tensor(id);
            let per = (t.elems() / t.shape.first().copied().unwrap_or(1).max(1)).max(1);
            return Err(RuntimeError::InputSample {
                input: t.name.to_string(),
                sample: i / per,
                problem: format!(
                    "holds a non-finite value ({value} at element {i} of the batch, \
                     expected a finite {}); clean the data or drop such samples \
                     (`InMemory::drop_non_finite`)",
                    t.dtype.name()
                ),
                context: String::new(),
            });
        }
    }
    check_index_ranges(plan, inputs)?;
    Ok(())
}

/// Checks the integer inputs that index something: labels read by a sparse
/// cross-entropy (`0..classes`) and token ids read by an embedding (`0..vocab`), so a bad
/// value is refused before any step runs, naming the input, the sample and the range.
fn check_index_ranges(plan: &StaticPlan, inputs: &[Batch<'_>]) -> Result<()> {
    for s in plan.steps.iter() {
        let (at, limit, what) = match s.op {
            Op::SoftmaxCrossEntropy { classes, .. }
            | Op::SoftmaxCrossEntropyFromLogits { classes, .. } => (1, classes, "classes"),
            Op::Embedding { vocab, .. } => (0, vocab, "tokens in the vocabulary"),
            _ => continue,
        };
        let Some(&id) = s.reads.get(at) else { continue };
        let Some(k) = plan.inputs.iter().position(|&i| i == id) else {
            continue;
        };
        let Some(Batch::I32(x)) = inputs.get(k) else {
            continue;
        };
        let Some(i) = x
            .iter()
            .position(|&v| !usize::try_from(v).is_ok_and(|v| v < limit))
        else {
            continue;
        };
        let t = plan.tensor(id);
        let per = (t.elems() / t.shape.first().copied().unwrap_or(1).max(1)).max(1);
        let (name, range_of) = match s.op {
            Op::Embedding { .. } => (
                "token id",
                format!("the embedding `{}` has {limit} {what}", s.layer),
            ),
            _ => {
                let prediction = s.reads.first().map_or("", |&p| &*plan.tensor(p).layer);
                (
                    "label",
                    format!(
                        "the sparse categorical cross-entropy on `{prediction}` has {limit} {what}"
                    ),
                )
            }
        };
        return Err(RuntimeError::InputSample {
            input: t.name.to_string(),
            sample: i / per,
            problem: format!(
                "has {name} {} (element {i} of the batch), expected 0..={}: {range_of}",
                x[i],
                limit as i64 - 1,
            ),
            context: String::new(),
        });
    }
    Ok(())
}
