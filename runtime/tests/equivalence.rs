//! Checkpointed vs plain execution (identical gradients, dropout included), float16/bfloat16
//! vs float32 (within a documented tolerance), and a loss-scaling skip that leaves the
//! weights bit-identical.

use memwise_plan::generate::{random_chain, random_dag};
use memwise_plan::*;
use memwise_runtime::{Batch, Device, Executor};

fn inputs_for(p: &StaticPlan, seed: u64) -> Vec<Vec<f32>> {
    let mut s = seed | 1;
    p.inputs
        .iter()
        .map(|&id| {
            (0..p.tensor(id).elems())
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % 1000) as f32 / 1000.0
                })
                .collect()
        })
        .collect()
}

/// Runs one step; returns (loss, every trainable gradient divided by the loss scale).
fn step(spec: &ModelSpec, raw: &[Vec<f32>]) -> (f32, Vec<(String, Vec<f32>)>) {
    let p = plan(spec).unwrap();
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 5).unwrap();
    // Typed copies of the raw values for each input's dtype.
    let u8s: Vec<Vec<u8>> = raw
        .iter()
        .map(|v| v.iter().map(|x| (x * 255.0) as u8).collect())
        .collect();
    let i32s: Vec<Vec<i32>> = p
        .inputs
        .iter()
        .zip(raw)
        .map(|(&id, v)| {
            let range = p.index_limit(id).unwrap_or(2);
            v.iter()
                .map(|x| ((x * 1000.0) as usize % range) as i32)
                .collect()
        })
        .collect();
    let f16s: Vec<Vec<half::f16>> = raw
        .iter()
        .map(|v| v.iter().map(|&x| half::f16::from_f32(x)).collect())
        .collect();
    let bf16s: Vec<Vec<half::bf16>> = raw
        .iter()
        .map(|v| v.iter().map(|&x| half::bf16::from_f32(x)).collect())
        .collect();
    let batches: Vec<Batch<'_>> = p
        .inputs
        .iter()
        .enumerate()
        .map(|(k, &id)| match p.tensor(id).dtype {
            DType::U8 => Batch::U8(&u8s[k]),
            DType::I32 => Batch::I32(&i32s[k]),
            DType::F32 => Batch::F32(&raw[k]),
            DType::F16 => Batch::F16(&f16s[k]),
            DType::BF16 => Batch::BF16(&bf16s[k]),
        })
        .collect();
    let scale = ex.loss_scale();
    let out = ex.train_step(&batches).unwrap();
    let grads = p
        .params
        .iter()
        .filter(|q| q.trainable)
        .map(|q| {
            (
                q.name.to_string(),
                ex.grad(&q.name)
                    .unwrap()
                    .iter()
                    .map(|g| g / scale)
                    .collect(),
            )
        })
        .collect();
    (out.loss, grads)
}

/// The spec with nothing recomputed by choice: no checkpoint, no norm output remade.
fn without_checkpoints(spec: &ModelSpec) -> ModelSpec {
    let mut s = spec.clone();
    for l in s.layers.iter_mut() {
        l.checkpoint = None;
        l.recompute_output = false;
    }
    s
}

#[test]
fn checkpointed_and_plain_give_identical_gradients() {
    let (mut compared, mut outputs) = (0, 0);
    for seed in 0..200u64 {
        for spec in [random_chain(seed), random_dag(seed)] {
            let Ok(p) = plan(&spec) else { continue };
            let remade = p.memory.layers.iter().any(|l| l.recomputes_output);
            if spec.layers.iter().all(|l| l.checkpoint.is_none()) && !remade {
                continue;
            }
            outputs += remade as usize;
            let plain = without_checkpoints(&spec);
            let raw = inputs_for(&plan(&spec).unwrap(), seed);
            let (la, ga) = step(&spec, &raw);
            let (lb, gb) = step(&plain, &raw);
            assert!(
                la.to_bits() == lb.to_bits() || (la.is_nan() && lb.is_nan()),
                "{}: loss {la} vs {lb}",
                spec.name
            );
            for ((n, a), (_, b)) in ga.iter().zip(&gb) {
                let same = a
                    .iter()
                    .zip(b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
                assert!(
                    same,
                    "seed {seed} {}: gradient of {n} differs with checkpointing",
                    spec.name
                );
            }
            compared += 1;
        }
    }
    println!(
        "{compared} checkpointed random models ({outputs} with norm outputs recomputed) match their plain twins bit for bit"
    );
    assert!(compared >= 100, "only {compared} models had checkpoints");
    assert!(
        outputs >= 10,
        "only {outputs} models recomputed a norm's output"
    );
}

fn mlp(precision: Precision) -> ModelSpec {
    let mut m = ModelSpec::new("Mlp", 32);
    m.precision = precision;
    m.input("x", &[64], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("h1", LayerKind::dense(96, Activation::Gelu), &["x"]);
    m.add("drop", LayerKind::Dropout { rate: 0.2 }, &[]);
    m.add("h2", LayerKind::dense(48, Activation::Relu), &[]);
    m.add("ln", LayerKind::layer_norm(), &[]);
    m.add("out", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["out", "labels"]));
    m
}

/// Relative L2 error of `a` against `b`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn half_precision_is_close_to_float32() {
    // Tolerances (documented in docs/PLANNER.md): float16 storage keeps 11 significant bits,
    // bfloat16 8; gradients through three layers stay within 2% (f16) and 8% (bf16) in
    // relative L2, losses within 1% and 3%.
    let f32_spec = mlp(Precision::Float32);
    let raw = inputs_for(&plan(&f32_spec).unwrap(), 3);
    let (l32, g32) = step(&f32_spec, &raw);
    for (prec, loss_tol, grad_tol) in [
        (Precision::MixedFloat16, 0.01, 0.02),
        (Precision::MixedBFloat16, 0.03, 0.08),
    ] {
        let (l, g) = step(&mlp(prec), &raw);
        assert!(
            ((l - l32) / l32).abs() < loss_tol,
            "{prec:?}: loss {l} vs {l32}"
        );
        for ((n, a), (_, b)) in g.iter().zip(&g32) {
            let e = rel_err(a, b);
            println!("{prec:?} {n}: relative L2 error {e:.2e}");
            assert!(e < grad_tol, "{prec:?}: gradient of {n} off by {e}");
        }
    }
}

#[test]
fn a_non_finite_gradient_skips_the_step_and_leaves_weights_bit_identical() {
    let spec = mlp(Precision::MixedFloat16);
    let p = plan(&spec).unwrap();
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 5).unwrap();
    let before: Vec<Vec<u8>> = vec![ex.persistent_bytes().to_vec()];
    // 1e30 overflows float16: the forward goes infinite and so do the gradients.
    let mut x = vec![0.5f32; 32 * 64];
    x[7] = 1e30;
    let labels: Vec<i32> = (0..32).map(|i| i % 10).collect();
    let scale = ex.loss_scale();
    let out = ex
        .train_step(&[Batch::F32(&x), Batch::I32(&labels)])
        .unwrap();
    assert!(out.skipped);
    assert_eq!(ex.loss_scale(), scale * 0.5, "the scale backs off");
    for q in p.params.iter() {
        let now = ex.param(&q.name).unwrap();
        let was = &before[0][q.offset as usize..q.offset as usize + 4 * q.elems()];
        let now_bytes: Vec<u8> = now.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&now_bytes[..], was, "{} changed on a skipped step", q.name);
        if q.state_offset != NO_OFFSET {
            let s0 = q.state_offset as usize;
            let n = 4 * q.elems();
            assert_eq!(
                &ex.persistent_bytes()[s0..s0 + n],
                &before[0][s0..s0 + n],
                "optimizer state of {} changed",
                q.name
            );
        }
    }
    // A finite step afterwards updates.
    x[7] = 0.5;
    let out = ex
        .train_step(&[Batch::F32(&x), Batch::I32(&labels)])
        .unwrap();
    assert!(!out.skipped);
    let w = p.params.iter().find(|q| q.name == "h1.weight").unwrap();
    let (o, n) = (w.offset as usize, 4 * w.elems());
    assert_ne!(
        &ex.persistent_bytes()[o..o + n],
        &before[0][o..o + n],
        "a finite step updates the weights"
    );
}
