//! Resuming is exact: train N steps, save a checkpoint, load it into a fresh executor (built
//! with another seed) — in this process and in a child process — train M more: every loss
//! and every bit of the weights, optimizer state, counters and loss scaler equal an
//! uninterrupted N + M run. The model has dropout (keyed by seed and step) and Adam (whose
//! bias correction counts updates), on the bundled MNIST digits.

use std::path::{Path, PathBuf};
use std::process::Command;

use memwise_plan::{
    plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer, Precision,
};
use memwise_runtime::data::idx::load_bundled_digits;
use memwise_runtime::{Batch, Device, Executor};

const BATCH: usize = 32;
/// Steps before the checkpoint.
const N: usize = 7;
/// Steps after it.
const M: usize = 6;
const SEED: u64 = 11;
/// Environment variable that turns `child_process_resumes_a_checkpoint` into the child.
const CHILD_ENV: &str = "MEMWISE_RESUME_CHILD_DIR";

/// 784 u8 pixels → dense 64 relu → dropout 0.3 → dense 10 softmax; Adam.
fn spec(precision: Precision) -> ModelSpec {
    let mut m = ModelSpec::new("ResumeMlp", BATCH);
    m.optimizer = Optimizer::ADAM;
    m.precision = precision;
    m.input("pixels", &[784], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(64, Activation::Relu),
        &["pixels"],
    );
    m.add("drop", LayerKind::Dropout { rate: 0.3 }, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    m
}

/// The first (N + M) batches of the bundled digits' training split, in order.
struct Data {
    pixels: Vec<u8>,
    labels: Vec<i32>,
}

fn data() -> Data {
    let (train, _) = load_bundled_digits().unwrap();
    let n = (N + M) * BATCH;
    assert!(train.len() >= n);
    Data {
        pixels: train.images[..n * 784].to_vec(),
        labels: train.labels[..n].iter().map(|&l| l as i32).collect(),
    }
}

/// Runs training steps `from..to`; returns each loss's bits.
fn run(ex: &mut Executor, d: &Data, from: usize, to: usize) -> Vec<u32> {
    (from..to)
        .map(|i| {
            let px = &d.pixels[i * BATCH * 784..(i + 1) * BATCH * 784];
            let lb = &d.labels[i * BATCH..(i + 1) * BATCH];
            ex.train_step(&[Batch::U8(px), Batch::I32(lb)])
                .unwrap()
                .loss
                .to_bits()
        })
        .collect()
}

fn new(precision: Precision, seed: u64) -> Executor {
    Executor::new(plan(&spec(precision)).unwrap(), &Device::cpu(), seed).unwrap()
}

fn tmp_dir(test: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("resume-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Asserts `b` holds bit for bit what `a` holds: every parameter (named on failure), then
/// the whole checkpoint (optimizer state, seed, counters, loss scaler).
fn assert_same_state(a: &Executor, b: &Executor) {
    for p in a.plan().params.iter() {
        let (x, y) = (a.param(&p.name).unwrap(), b.param(&p.name).unwrap());
        let diff = x
            .iter()
            .zip(y)
            .filter(|(u, v)| u.to_bits() != v.to_bits())
            .count();
        assert_eq!(diff, 0, "`{}`: {diff} of {} values differ", p.name, x.len());
    }
    assert_eq!(a.step_counter(), b.step_counter());
    assert_eq!(a.loss_scale().to_bits(), b.loss_scale().to_bits());
    assert!(
        a.checkpoint_to_bytes().unwrap() == b.checkpoint_to_bytes().unwrap(),
        "optimizer state, seed, counters or loss scaler differ"
    );
}

/// The uninterrupted run: its losses and final executor.
fn uninterrupted(precision: Precision, d: &Data) -> (Vec<u32>, Executor) {
    let mut ex = new(precision, SEED);
    let losses = run(&mut ex, d, 0, N + M);
    (losses, ex)
}

fn resume_in_process(precision: Precision, test: &str) {
    let d = data();
    let (full, reference) = uninterrupted(precision, &d);
    let dir = tmp_dir(test);
    let path = dir.join("at-n.safetensors");

    let mut first = new(precision, SEED);
    assert_eq!(run(&mut first, &d, 0, N), full[..N]);
    first.save_checkpoint(&path).unwrap();
    drop(first);

    // Another seed: the checkpoint must bring back the seed that keys dropout.
    let mut resumed = new(precision, 987_654_321);
    resumed.load_checkpoint(&path).unwrap();
    assert_eq!(resumed.step_counter(), N as u64);
    assert_eq!(resumed.seed(), SEED);
    let rest = run(&mut resumed, &d, N, N + M);
    assert_eq!(rest, full[N..], "losses after resuming");
    assert_same_state(&reference, &resumed);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resuming_in_a_fresh_executor_is_bit_exact() {
    resume_in_process(Precision::Float32, "f32");
}

#[test]
fn resuming_mixed_float16_restores_the_loss_scaler_exactly() {
    let p = plan(&spec(Precision::MixedFloat16)).unwrap();
    assert!(p.loss_scaling, "mixed_float16 scales the loss");
    resume_in_process(Precision::MixedFloat16, "f16");
}

#[test]
fn resuming_in_a_new_process_is_bit_exact() {
    let d = data();
    let (full, reference) = uninterrupted(Precision::Float32, &d);
    let dir = tmp_dir("process");
    let mut first = new(Precision::Float32, SEED);
    run(&mut first, &d, 0, N);
    first.save_checkpoint(dir.join("at-n.safetensors")).unwrap();
    drop(first);

    // This test binary again, running only the child entry point below.
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_process_resumes_a_checkpoint",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let losses: Vec<u32> = std::fs::read_to_string(dir.join("child-losses.txt"))
        .unwrap()
        .lines()
        .map(|l| u32::from_str_radix(l, 16).unwrap())
        .collect();
    assert_eq!(losses, full[N..], "the child's losses after resuming");
    let mut child = new(Precision::Float32, 1);
    child
        .load_checkpoint(dir.join("child-final.safetensors"))
        .unwrap();
    assert_same_state(&reference, &child);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The child process of `resuming_in_a_new_process_is_bit_exact` (a no-op in a normal run):
/// loads the checkpoint, trains M steps, writes the losses and a final checkpoint.
#[test]
fn child_process_resumes_a_checkpoint() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let d = data();
    let mut ex = new(Precision::Float32, 424_242);
    ex.load_checkpoint(dir.join("at-n.safetensors")).unwrap();
    let losses = run(&mut ex, &d, N, N + M);
    let text: String = losses.iter().map(|l| format!("{l:08x}\n")).collect();
    std::fs::write(dir.join("child-losses.txt"), text).unwrap();
    ex.save_checkpoint(dir.join("child-final.safetensors"))
        .unwrap();
}
