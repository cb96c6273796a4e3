//! The poisoned arena: for hundreds of random models (chains and DAGs from the planner's
//! generators, random checkpoint sets and precisions), one training step with every tensor
//! overwritten by NaN the instant its life ends must give the same gradients and updated
//! weights as a plain execution where every tensor has its own bytes and nothing is freed.
//! (And one shape the random models rarely reach, checked against an f64 reference: a
//! transposed convolution with a kernel shorter than its stride.)

use memwise_plan::generate::{random_chain, random_dag};
use memwise_plan::{plan, DType, StaticPlan};
use memwise_runtime::reference::random_inputs;
use memwise_runtime::reference::without_reuse;
use memwise_runtime::{Batch, Device, Executor};

fn batches<'a>(plan: &StaticPlan, raw: &'a [Vec<u8>]) -> Vec<Batch<'a>> {
    plan.inputs
        .iter()
        .zip(raw)
        .map(|(&id, r)| {
            // SAFETY-free reinterpretation via bytemuck-like casts on aligned copies.
            match plan.tensor(id).dtype {
                DType::U8 => Batch::U8(r),
                DType::I32 => Batch::I32(cast(r)),
                DType::F32 => Batch::F32(cast(r)),
                DType::F16 => Batch::F16(cast(r)),
                DType::BF16 => Batch::BF16(cast(r)),
            }
        })
        .collect()
}

fn cast<T>(r: &[u8]) -> &[T] {
    let n = r.len() / std::mem::size_of::<T>();
    assert_eq!(
        r.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "vec allocations are aligned"
    );
    // SAFETY: plain-old-data, aligned (checked), length in whole elements.
    unsafe { std::slice::from_raw_parts(r.as_ptr() as *const T, n) }
}

/// Bit-identical, a NaN matching any NaN (a float16 overflow legitimately makes both runs'
/// gradients non-finite; the loss scaler then skips the update in both).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// Runs one step of `spec`'s plan both ways; `Ok(skipped)` when they agree.
fn check(name: &str, spec: &memwise_plan::ModelSpec) -> Result<bool, String> {
    let planned = plan(spec).map_err(|e| format!("{name}: plan: {e}"))?;
    let plain = without_reuse(&planned);
    let dev = Device::cpu();
    let mut a = Executor::new(planned.clone(), &dev, 7).map_err(|e| format!("{name}: {e}"))?;
    a.enable_poisoning().map_err(|e| format!("{name}: {e}"))?;
    let mut b = Executor::new(plain, &dev, 7).map_err(|e| format!("{name}: {e}"))?;
    let raw = random_inputs(&planned, 99);
    let oa = a
        .train_step(&batches(&planned, &raw))
        .map_err(|e| format!("{name}: planned: {e}"))?;
    let ob = b
        .train_step(&batches(&planned, &raw))
        .map_err(|e| format!("{name}: plain: {e}"))?;
    if !same_bits(&[oa.loss], &[ob.loss]) {
        return Err(format!(
            "{name}: loss {} (planned) vs {} (plain)",
            oa.loss, ob.loss
        ));
    }
    if oa.skipped != ob.skipped {
        return Err(format!("{name}: skipped {} vs {}", oa.skipped, ob.skipped));
    }
    assert_eq!(
        a.steps_executed,
        planned.steps.len() as u64,
        "{name}: every step ran once"
    );
    for p in planned.params.iter() {
        let (va, vb) = (a.param(&p.name).unwrap(), b.param(&p.name).unwrap());
        if va.iter().any(|x| x.is_nan()) || !same_bits(&va, &vb) {
            let i = va
                .iter()
                .zip(&vb)
                .position(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
                .unwrap_or(0);
            return Err(format!(
                "{name}: parameter `{}`[{i}] {} (planned) vs {} (plain)",
                p.name, va[i], vb[i]
            ));
        }
        if p.trainable {
            let (ga, gb) = (a.grad(&p.name).unwrap(), b.grad(&p.name).unwrap());
            if !same_bits(&ga, &gb) {
                let i = ga
                    .iter()
                    .zip(&gb)
                    .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
                    .unwrap_or(0);
                return Err(format!(
                    "{name}: gradient of `{}`[{i}] {} (planned) vs {} (plain)",
                    p.name, ga[i], gb[i]
                ));
            }
            if !oa.skipped && ga.iter().any(|g| !g.is_finite()) {
                return Err(format!(
                    "{name}: gradient of `{}` is not finite but the step was not skipped",
                    p.name
                ));
            }
        }
    }
    Ok(oa.skipped)
}

fn run(kind: &str, n: u64, make: fn(u64) -> memwise_plan::ModelSpec) {
    let mut failures = Vec::new();
    let (mut steps, mut skipped) = (0usize, 0u64);
    for seed in 0..n {
        let spec = make(seed);
        steps += plan(&spec).map(|p| p.steps.len()).unwrap_or(0);
        match check(&format!("{kind} {seed}"), &spec) {
            Ok(s) => skipped += s as u64,
            Err(e) => failures.push(e),
        }
    }
    println!(
        "poisoned arena: {n} random {kind}s, {steps} steps, {} failures, {skipped} float16 steps skipped by loss scaling",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {n} {kind}s differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Most steps must really update, or the comparison would prove little.
    assert!(skipped * 4 < n, "{skipped} of {n} steps were skipped");
}

#[test]
fn poisoned_arena_random_chains() {
    run("chain", 150, random_chain);
}

#[test]
fn poisoned_arena_random_dags() {
    run("dag", 150, random_dag);
}

/// A transposed convolution whose kernel is shorter than its stride, valid padding: Keras
/// gives `in·stride` outputs per axis, the last of each stride reached by no tap (bias only).
/// The kernels once wrote a `(in-1)·stride + k` layout into that buffer, so the loss here
/// (against an f64 scatter of the same weights) came out wrong.
#[test]
fn transposed_kernel_shorter_than_stride_gives_keras_output_size() {
    use memwise_plan::{Activation, LayerKind, LossKind, LossTerm, ModelSpec, Padding};
    let (n, h, w, c_in, c_out, (kh, kw), (sh, sw)) = (2, 4, 3, 2, 3, (1, 2), (2, 3));
    let (oh, ow) = (h * sh, w * sw);
    let mut m = ModelSpec::new("SparseUpsample", n);
    m.input("x", &[h, w, c_in], DType::F32, 1.0);
    m.input("y", &[oh, ow, c_out], DType::F32, 1.0);
    let up = LayerKind::Conv2dTranspose {
        filters: c_out,
        kernel: [kh, kw],
        strides: [sh, sw],
        padding: Padding::Valid,
        activation: Activation::Linear,
        use_bias: true,
    };
    m.add("up", up, &["x"]);
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["up", "y"]));
    let planned = plan(&m).expect("plans");
    let mut e = Executor::new(planned.clone(), &Device::cpu(), 7).unwrap();
    let raw = random_inputs(&planned, 5);
    let (wt, b) = (e.param("up.weight").unwrap(), e.param("up.bias").unwrap());
    // The step's loss is the forward's, before the update.
    let got = e.train_step(&batches(&planned, &raw)).unwrap().loss as f64;
    let (x, y): (&[f32], &[f32]) = (cast(&raw[0]), cast(&raw[1]));
    let mut pred: Vec<f64> = (0..n * oh * ow * c_out)
        .map(|i| b[i % c_out] as f64)
        .collect();
    for (s, iy, ix, ky, kx) in taps(n, h, w, kh, kw) {
        let (oy, ox) = (iy * sh + ky, ix * sw + kx);
        for co in 0..c_out {
            let acc: f64 = (0..c_in)
                .map(|ci| {
                    x[((s * h + iy) * w + ix) * c_in + ci] as f64
                        * wt[((ky * kw + kx) * c_out + co) * c_in + ci] as f64
                })
                .sum();
            pred[((s * oh + oy) * ow + ox) * c_out + co] += acc;
        }
    }
    let mse = pred
        .iter()
        .zip(y)
        .map(|(p, &t)| (p - t as f64).powi(2))
        .sum::<f64>()
        / (oh * ow * c_out) as f64
        / n as f64;
    assert!(
        (got - mse).abs() <= 1e-5 * mse,
        "loss {got}, Keras's output gives {mse}"
    );
}

/// Every `(sample, input row, input column, tap row, tap column)`.
fn taps(
    n: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize, usize)> {
    (0..n).flat_map(move |s| {
        (0..h).flat_map(move |iy| {
            (0..w).flat_map(move |ix| {
                (0..kh).flat_map(move |ky| (0..kw).map(move |kx| (s, iy, ix, ky, kx)))
            })
        })
    })
}
