//! The poisoned arena: for hundreds of random models (chains and DAGs from the planner's
//! generators, random checkpoint sets and precisions), one training step with every tensor
//! overwritten by NaN the instant its life ends must give the same gradients and updated
//! weights as a plain execution where every tensor has its own bytes and nothing is freed.

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
    a.enable_poisoning();
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
