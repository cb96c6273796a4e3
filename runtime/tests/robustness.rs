//! Nothing panics on bad input, and every refusal says what was wrong.
//!
//! Two halves:
//! - property tests: every public entry point (`plan`, `plan_inference`, `train_step`,
//!   `evaluate_step`, `Trainer::fit/evaluate/predict`, `load_weights_from_bytes`,
//!   `load_checkpoint_from_bytes`, `parse_idx`, `parse_bytes`, `InMemory::drop_non_finite`,
//!   the image folder's `image::probe` and `ImageDecoder::decode_into`)
//!   on random inputs, decoded from random bytes by the same decoders the fuzz targets use
//!   (`support/decode.rs`, `fuzz/`): `Ok`, or an `Err` with a message — never a panic, and a
//!   refused input or a failed load leaves the model bit-identical;
//! - one test per input error of issue 9's list, asserting the message names the input and
//!   the expected and actual values.
//!
//! docs/ROBUSTNESS.md lists what is validated where.

mod support;

use memwise_plan::advice::{format_bytes, parse_bytes};
use memwise_plan::{
    plan, plan_inference, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, StaticPlan,
};
use memwise_runtime::data::dataset::{Column, Dataset, InMemory};
use memwise_runtime::data::idx::{parse_idx, MnistSplit};
use memwise_runtime::{Batch, Device, Executor, FitOptions, RuntimeError, StepOutput, Trainer};
use proptest::prelude::*;
use support::decode::{self, Bytes, Owned};

// ---------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------

/// Cases per property (the sum is printed in docs/ROBUSTNESS.md).
const PLAN_CASES: u32 = 1024;
const STEP_CASES: u32 = 512;
const TRAINER_CASES: u32 = 256;
const LOAD_CASES: u32 = 384;
const IDX_CASES: u32 = 512;
const PARSE_BYTES_CASES: u32 = 1024;
const DROP_CASES: u32 = 256;
const DEVICE_CASES: u32 = 256;
const IMAGE_CASES: u32 = 512;

fn plans() -> &'static [(StaticPlan, StaticPlan)] {
    static PLANS: std::sync::OnceLock<Vec<(StaticPlan, StaticPlan)>> = std::sync::OnceLock::new();
    PLANS.get_or_init(|| {
        decode::train_models()
            .iter()
            .map(|m| (plan(m).unwrap(), plan_inference(m).unwrap()))
            .collect()
    })
}

fn views(owned: &[Owned]) -> Vec<Batch<'_>> {
    owned.iter().map(Owned::as_batch).collect()
}

/// A valid weights (`checkpoint == false`) or checkpoint file of fixed model `k`, saved after
/// two training steps.
fn valid_file(k: usize, checkpoint: bool) -> &'static [u8] {
    static FILES: std::sync::OnceLock<Vec<(Vec<u8>, Vec<u8>)>> = std::sync::OnceLock::new();
    let files = FILES.get_or_init(|| {
        plans()
            .iter()
            .map(|(p, _)| {
                let mut ex = Executor::new(p.clone(), &Device::cpu(), 5).unwrap();
                let owned = decode::batches(ex.plan(), &mut Bytes::new(&[]));
                ex.train_step(&views(&owned)).unwrap();
                ex.train_step(&views(&owned)).unwrap();
                (
                    ex.weights_to_bytes().unwrap(),
                    ex.checkpoint_to_bytes().unwrap(),
                )
            })
            .collect()
    });
    if checkpoint {
        &files[k].1
    } else {
        &files[k].0
    }
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max)
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// Runs one step of `ex` (training or inference, as its plan is) on `owned`.
fn step(ex: &mut Executor, owned: &[Owned]) -> Result<StepOutput, RuntimeError> {
    if ex.plan().training {
        ex.train_step(&views(owned))
    } else {
        ex.evaluate_step(&views(owned))
    }
}

/// Any `ModelSpec` plans or fails with a message; a small plan also builds and runs a step.
fn check_plan(data: &[u8]) -> Result<(), TestCaseError> {
    let spec = decode::model_spec(data);
    for p in [plan(&spec), plan_inference(&spec)] {
        match p {
            Err(e) => prop_assert!(!e.to_string().is_empty()),
            Ok(p) if p.arena_bytes + p.persistent_bytes <= 1 << 20 && p.steps.len() <= 200 => {
                if let Ok(mut ex) = Executor::new(p, &Device::cpu(), 7) {
                    let owned = decode::batches(ex.plan(), &mut Bytes::new(&[]));
                    if let Err(e) = step(&mut ex, &owned) {
                        prop_assert!(!e.to_string().is_empty());
                    }
                }
            }
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Any batches (count, dtype, length, values) on the fixed models: a step or an error, and
/// an input error leaves the model untouched.
fn check_step(data: &[u8]) -> Result<(), TestCaseError> {
    let mut b = Bytes::new(data);
    let plans = plans();
    let (train, infer) = &plans[b.below(plans.len())];
    let p = if b.u8() > 200 { infer } else { train };
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 1).unwrap();
    for _ in 0..1 + b.below(2) {
        let before = ex.persistent_bytes().to_vec();
        let owned = decode::batches(ex.plan(), &mut b);
        if let Err(e) = step(&mut ex, &owned) {
            prop_assert!(!e.to_string().is_empty());
            if e.is_input() {
                let same = ex.persistent_bytes() == &before[..];
                prop_assert!(same, "a refused input changed the model: {}", e);
            }
        }
    }
    Ok(())
}

/// Any in-memory dataset (columns, dtypes, sizes, 0–11 samples) through fit, evaluate and
/// predict: a result or an error with a message.
fn check_trainer(data: &[u8]) -> Result<(), TestCaseError> {
    let mut b = Bytes::new(data);
    let models = decode::train_models();
    let spec = &models[b.below(models.len())];
    let mut t = Trainer::build(spec, &Device::cpu(), 3).unwrap();
    let Some(ds) = decode::dataset(t.plan(), &mut b) else {
        return Ok(());
    };
    let opts = FitOptions {
        epochs: 1,
        verbose: false,
        max_steps: Some(2),
        ..FitOptions::default()
    };
    let r = match b.u8() % 4 {
        0 => t.fit(&ds, Some(&ds), &opts, &mut []).map(|_| ()),
        1 => t.evaluate(&ds).map(|_| ()),
        2 => t.predict(&ds).map(|_| ()),
        _ => t
            .fit(&ds.drop_non_finite().0, None, &opts, &mut [])
            .map(|_| ()),
    };
    if let Err(e) = r {
        prop_assert!(!e.to_string().is_empty());
    }
    Ok(())
}

/// Mutated (and raw) weights or checkpoint files: loaded, or an error and the model (and its
/// counters) bit-identical.
fn check_load(data: &[u8], checkpoint: bool) -> Result<(), TestCaseError> {
    let mut b = Bytes::new(data);
    let k = b.below(plans().len());
    let file = valid_file(k, checkpoint);
    let bytes = if b.u8() < 24 {
        b.rest().to_vec()
    } else {
        decode::mutate_safetensors(file, &mut b)
    };
    let mut ex = Executor::new(plans()[k].0.clone(), &Device::cpu(), 9).unwrap();
    let state = |ex: &Executor| {
        let scale = ex.loss_scale().to_bits();
        (ex.persistent_bytes().to_vec(), ex.step_counter(), scale)
    };
    let before = state(&ex);
    let r = if checkpoint {
        ex.load_checkpoint_from_bytes(&bytes)
    } else {
        ex.load_weights_from_bytes(&bytes)
    };
    if let Err(e) = r {
        prop_assert!(!e.to_string().is_empty());
        prop_assert!(
            state(&ex) == before,
            "a failed load changed the model: {}",
            e
        );
    }
    Ok(())
}

/// IDX files (valid, gzipped, damaged, raw): an array whose data matches its dims, or an
/// error naming the file; then an MNIST split from two of them.
fn check_idx(data: &[u8]) -> Result<(), TestCaseError> {
    let mut b = Bytes::new(data);
    let (images, labels) = (decode::idx_file(&mut b), decode::idx_file(&mut b));
    let i = parse_idx(&images, "images.idx");
    let l = parse_idx(&labels, "labels.idx");
    for r in [&i, &l] {
        match r {
            Ok(a) => {
                let n = a.dims.iter().try_fold(1usize, |x, &d| x.checked_mul(d));
                prop_assert_eq!(n, Some(a.data.len()));
            }
            Err(e) => prop_assert!(e.to_string().contains(".idx:"), "{}", e),
        }
    }
    if let (Ok(i), Ok(l)) = (i, l) {
        match MnistSplit::from_arrays(i, "images.idx", l, "labels.idx") {
            Ok(s) => {
                let _ = (s.class_counts(), s.image(0), s.label(0));
                let n = s.len();
                let (a, c) = s.split_at(b.below(n + 2));
                prop_assert_eq!(a.len() + c.len(), n);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
    Ok(())
}

/// Budget strings: any text parses or is refused with a message; what parses formats and
/// parses back within `format_bytes`'s rounding.
fn check_parse_bytes(text: &str) -> Result<(), TestCaseError> {
    match parse_bytes(text) {
        // Sizes from 16 EiB − 0.5% up format as `16384 PiB`, over u64::MAX.
        Ok(n) if n >= 1 << 63 => {}
        Ok(n) => {
            let shown = format_bytes(n);
            let back = parse_bytes(&shown);
            prop_assert!(
                back.is_ok(),
                "`{}` (from {}) does not parse back: {:?}",
                shown,
                n,
                back
            );
            let back = back.unwrap();
            let close = back.abs_diff(n) as f64 <= n as f64 * 0.005 + 1.0;
            prop_assert!(close, "{} → `{}` → {}", n, shown, back);
        }
        Err(e) => prop_assert!(!e.is_empty()),
    }
    Ok(())
}

/// Dropping non-finite samples keeps exactly the finite ones, in order, in every column.
fn check_drop_non_finite(per: usize, values: &[f32]) -> Result<(), TestCaseError> {
    let n = values.len() / per;
    let x = &values[..n * per];
    let finite = |i: usize| x[i * per..(i + 1) * per].iter().all(|v| v.is_finite());
    let ds = InMemory::new(vec![
        Column::F32 {
            data: x.to_vec(),
            per_sample: per,
        },
        Column::I32 {
            data: (0..n as i32).collect(),
            per_sample: 1,
        },
    ])
    .unwrap();
    let (clean, dropped) = ds.drop_non_finite();
    let keep: Vec<usize> = (0..n).filter(|&i| finite(i)).collect();
    prop_assert_eq!(clean.len(), keep.len());
    prop_assert_eq!(dropped, n - keep.len());
    let want_x: Vec<f32> = keep
        .iter()
        .flat_map(|&i| x[i * per..(i + 1) * per].iter().copied())
        .collect();
    let want_l: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
    let want = [
        Column::F32 {
            data: want_x,
            per_sample: per,
        },
        Column::I32 {
            data: want_l,
            per_sample: 1,
        },
    ];
    prop_assert_eq!(clean.columns(), &want[..]);
    Ok(())
}

fn float_or_not() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -10.0f32..10.0,
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
    ]
}

fn size_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ ]{0,2}[0-9_.]{0,22}[ ]?(B|b|KiB|kib|MiB|GiB|TiB|PiB|KB|MB|GB|TB|PB|k|m|x|)[ ]{0,2}",
    ]
}

proptest! {
    #![proptest_config(config(PLAN_CASES))]
    #[test]
    fn planning_any_spec_never_panics(data in bytes(256)) {
        check_plan(&data)?;
    }
}

proptest! {
    #![proptest_config(config(STEP_CASES))]
    #[test]
    fn train_step_on_any_batch_never_panics(data in bytes(512)) {
        check_step(&data)?;
    }
}

proptest! {
    #![proptest_config(config(TRAINER_CASES))]
    #[test]
    fn trainer_on_any_dataset_never_panics(data in bytes(256)) {
        check_trainer(&data)?;
    }
}

proptest! {
    #![proptest_config(config(LOAD_CASES))]
    #[test]
    fn loading_mutated_weights_never_panics_nor_changes_the_model(data in bytes(128)) {
        check_load(&data, false)?;
    }

    #[test]
    fn loading_mutated_checkpoints_never_panics_nor_changes_the_model(data in bytes(128)) {
        check_load(&data, true)?;
    }
}

proptest! {
    #![proptest_config(config(IDX_CASES))]
    #[test]
    fn parse_idx_never_panics(data in bytes(256)) {
        check_idx(&data)?;
    }
}

/// An image file (raw, or a valid PNG/JPEG damaged): decoded into the whole sample, or an
/// error with a message; the decoder still decodes a valid file afterwards.
fn check_image(data: &[u8]) -> Result<(), TestCaseError> {
    use memwise_runtime::data::image::{probe, ImageDecoder, ImageFormat};
    let mut b = Bytes::new(data);
    let (file, promised, target) = decode::image_file(&mut b);
    let mut d = ImageDecoder::new(1 << 22);
    let mut out = vec![0u8; target.bytes()];
    match d.decode_into(&file, promised, target, &mut out) {
        Ok(()) => prop_assert_eq!(probe(&file, 1 << 22).map(|h| h.format), Ok(promised)),
        Err(e) => prop_assert!(!e.is_empty()),
    }
    let ok = memwise_runtime::data::digits_folder::encode_png(&[7u8; 16], 4, 4, 1).unwrap();
    prop_assert!(d
        .decode_into(&ok, ImageFormat::Png, target, &mut out)
        .is_ok());
    prop_assert!(
        out.iter().all(|&v| v == 7),
        "a 4×4 gray of 7 resizes to 7s: {:?}",
        out
    );
    Ok(())
}

proptest! {
    #![proptest_config(config(IMAGE_CASES))]
    #[test]
    fn decoding_any_image_file_never_panics(data in bytes(512)) {
        check_image(&data)?;
    }
}

proptest! {
    #![proptest_config(config(PARSE_BYTES_CASES))]
    #[test]
    fn parse_bytes_never_panics(text in size_text()) {
        check_parse_bytes(&text)?;
    }

    /// Any size below 2^63 formats, and the text parses back.
    #[test]
    fn format_bytes_parses_back(n in 0..1u64 << 63) {
        let shown = format_bytes(n);
        prop_assert!(parse_bytes(&shown).is_ok(), "`{}` does not parse back", shown);
    }
}

proptest! {
    #![proptest_config(config(DROP_CASES))]
    #[test]
    fn drop_non_finite_keeps_exactly_the_finite_samples(
        per in 1usize..4,
        values in prop::collection::vec(float_or_not(), 0..40),
    ) {
        check_drop_non_finite(per, &values)?;
    }
}

proptest! {
    #![proptest_config(config(DEVICE_CASES))]
    /// `Device::parse` (the examples' `--device`) on any text: a device, or an error quoting
    /// the text.
    #[test]
    fn device_parse_never_panics(text in prop_oneof![
        any::<String>(),
        "(cpu|cuda|gpu|cuda:|cuda:-)?[0-9a-z:]{0,24}",
    ]) {
        if let Err(e) = Device::parse(&text) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

/// Found by the `parse_bytes` fuzz target: `format_bytes` prints sizes of 1 PiB and more in
/// PiB, which `parse_bytes` did not know.
#[test]
fn sizes_in_pib_parse_back() {
    assert_eq!(format_bytes(3 << 50), "3 PiB");
    assert_eq!(parse_bytes("3 PiB"), Ok(3 << 50));
    assert_eq!(parse_bytes("2PB"), Ok(2_000_000_000_000_000));
    assert!(parse_bytes("2 P").unwrap_err().contains("ambiguous"));
    let n = 2_206_299_360_000_000_000u64;
    assert!(parse_bytes(&format_bytes(n)).is_ok(), "{}", format_bytes(n));
}

/// Found by the `plan_spec` fuzz target: sizes whose products overflow `usize` (a panic in
/// debug builds, a wrapped plan in release) are refused, naming the layer and the limit.
#[test]
fn enormous_sizes_are_refused_not_overflowed() {
    let mut m = ModelSpec::new("Huge", 4);
    m.input("x", &[1 << 31, 1 << 31, 8], DType::F32, 1.0);
    m.add("h", LayerKind::dense(4, Activation::Linear), &["x"]);
    let e = plan(&m).unwrap_err().to_string();
    contains_all(
        &e,
        &[
            "layer `x`",
            "[4, 2147483648, 2147483648, 8]",
            "more than 2^40",
        ],
    );

    let mut m = ModelSpec::new("Up", usize::MAX / 2);
    m.input("x", &[2, 2, 1], DType::F32, 1.0);
    let up = LayerKind::conv2d_transpose(
        3,
        2,
        usize::MAX / 3,
        memwise_plan::Padding::Valid,
        Activation::Relu,
    );
    m.add("up", up, &["x"]);
    let e = plan(&m).unwrap_err().to_string();
    contains_all(&e, &["more than 2^40"]);

    // A zero dimension (depth multiplier 0) does not hide the overflow of the others.
    let mut m = ModelSpec::new("Zero", 3);
    m.input("x", &[4, 4, 4], DType::F32, 1.0);
    let dw = LayerKind::DepthwiseConv2d {
        kernel: [usize::MAX / 3; 2],
        strides: [3, 1],
        padding: memwise_plan::Padding::Same,
        multiplier: 0,
        activation: Activation::Sigmoid,
        use_bias: true,
    };
    m.add("dw", dw, &["x"]);
    let e = plan(&m).unwrap_err().to_string();
    contains_all(&e, &["layer `dw`", "more than 2^40"]);

    let mut m = ModelSpec::new("Wide", 2);
    m.input("x", &[4], DType::F32, 1.0);
    m.add("h", LayerKind::dense(1 << 40, Activation::Relu), &["x"]);
    contains_all(
        &plan_inference(&m).unwrap_err().to_string(),
        &["layer `h`", "more than 2^40"],
    );
}

/// Found by the `plan_spec` fuzz target: a transposed convolution (same padding) whose
/// kernel is wider than its input underflowed an index in the kernels' col2im.
#[test]
fn a_transposed_conv_with_a_kernel_wider_than_its_input_trains() {
    let mut m = ModelSpec::new("Wide", 4);
    m.input("x", &[6, 2, 6], DType::U8, 1.0);
    m.add(
        "up",
        LayerKind::conv2d_transpose(8, 8, 1, memwise_plan::Padding::Same, Activation::Linear),
        &["x"],
    );
    m.add("act", LayerKind::Activation(Activation::Tanh), &[]);
    m.add(
        "out",
        LayerKind::conv2d(6, 1, 1, memwise_plan::Padding::Same, Activation::Linear),
        &[],
    );
    m.loss
        .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "x"]));
    let p = plan(&m).unwrap();
    let mut ex = Executor::new(p, &Device::cpu(), 1).unwrap();
    let x = vec![3u8; 4 * 6 * 2 * 6];
    let out = ex.train_step(&[Batch::U8(&x)]).unwrap();
    assert!(out.loss.is_finite());
}

/// Found by the `plan_spec` fuzz target: a pooling window far larger than its input (same
/// padding) overflowed the pooling kernels' work estimate.
#[test]
fn a_pooling_window_far_larger_than_its_input_is_an_answer_not_a_panic() {
    for kind in [
        LayerKind::avg_pool2d(1 << 33, 1, memwise_plan::Padding::Same),
        LayerKind::max_pool2d(1 << 33, 1, memwise_plan::Padding::Same),
    ] {
        let mut m = ModelSpec::new("Pool", 2);
        m.input("x", &[4, 4, 2], DType::F32, 1.0);
        m.add("pool", kind, &["x"]);
        m.add("flat", LayerKind::Flatten, &[]);
        m.add("out", LayerKind::dense(2, Activation::Linear), &[]);
        m.input("y", &[2], DType::F32, 1.0);
        m.loss
            .push(LossTerm::new(LossKind::MeanSquaredError).on(&["out", "y"]));
        match plan(&m) {
            // Max pooling stores its argmax in a byte: at most 255 elements a window.
            Err(e) => assert!(e.to_string().contains("max_pool2d window"), "{e}"),
            Ok(p) => {
                let mut ex = Executor::new(p, &Device::cpu(), 1).unwrap();
                let (x, y) = ([0.5f32; 64], [0.1f32; 4]);
                if let Err(e) = ex.train_step(&[Batch::F32(&x), Batch::F32(&y)]) {
                    assert!(!e.to_string().is_empty());
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// One test per input error
// ---------------------------------------------------------------------------------------

/// u8 pixels [8] → dense 16 relu → dense 10 softmax; i32 labels; batch 4.
fn mlp_spec(batch: usize) -> ModelSpec {
    decode::train_models()[0].with_batch(batch)
}

fn mlp() -> Executor {
    Executor::new(plan(&mlp_spec(4)).unwrap(), &Device::cpu(), 1).unwrap()
}

/// f32 x [8] → dense 16 relu → dense 3 softmax; i32 labels; batch 4.
fn float_spec() -> ModelSpec {
    let mut m = ModelSpec::new("F", 4);
    m.input("x", &[8], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("h", LayerKind::dense(16, Activation::Relu), &["x"]);
    m.add("out", LayerKind::dense(3, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["out", "labels"]));
    m
}

/// An error, and the model exactly as it was (weights, gradients, optimizer state, counters,
/// and no kernel step run).
fn refused(ex: &mut Executor, inputs: &[Batch<'_>]) -> String {
    let before = (
        ex.persistent_bytes().to_vec(),
        ex.step_counter(),
        ex.steps_executed,
    );
    let e = ex.train_step(inputs).expect_err("the step must be refused");
    assert!(e.is_input(), "an input error: {e:?}");
    let after = (
        ex.persistent_bytes().to_vec(),
        ex.step_counter(),
        ex.steps_executed,
    );
    assert!(after == before, "a refused step changed the model: {e}");
    e.to_string()
}

fn contains_all(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "`{p}` missing from: {e}");
    }
}

const PIXELS: [u8; 32] = [7; 32];

#[test]
fn batch_count_names_the_inputs_expected_and_actual() {
    let e = refused(&mut mlp(), &[Batch::U8(&PIXELS)]);
    contains_all(&e, &["takes 2 inputs (pixels, labels), got 1"]);
}

#[test]
fn batch_dtype_names_the_input_expected_and_actual() {
    let x = [0.5f32; 32];
    let e = refused(&mut mlp(), &[Batch::F32(&x), Batch::I32(&[0; 4])]);
    contains_all(&e, &["input `pixels` holds u8 values, got f32"]);
    let e = refused(&mut mlp(), &[Batch::U8(&PIXELS), Batch::F32(&[0.0; 4])]);
    contains_all(&e, &["input `labels` holds i32 values, got f32"]);
}

#[test]
fn batch_shape_names_the_input_expected_and_actual() {
    let e = refused(&mut mlp(), &[Batch::U8(&PIXELS[..30]), Batch::I32(&[0; 4])]);
    contains_all(
        &e,
        &["input `pixels` expects 32 values (shape [4, 8]), got 30"],
    );
    let e = refused(&mut mlp(), &[Batch::U8(&PIXELS), Batch::I32(&[0; 5])]);
    contains_all(&e, &["input `labels` expects 4 values (shape [4]), got 5"]);
}

#[test]
fn an_empty_batch_names_the_input_expected_and_actual() {
    let e = refused(&mut mlp(), &[Batch::U8(&[]), Batch::I32(&[])]);
    contains_all(
        &e,
        &["input `pixels` expects 32 values (shape [4, 8]), got 0"],
    );
}

/// The executor never writes past the arena: a batch larger than the plan's is refused
/// before a byte is copied, with the numbers.
#[test]
fn a_batch_larger_than_the_plan_is_refused_by_the_executor_with_the_numbers() {
    let big = [1u8; 64];
    let e = refused(&mut mlp(), &[Batch::U8(&big), Batch::I32(&[0; 8])]);
    contains_all(
        &e,
        &[
            "input `pixels` expects 32 values (shape [4, 8]), got 64",
            "a batch of 8",
            "this plan's batch is 4",
        ],
    );
}

/// `Trainer` never hands the executor a batch larger than its plan: `fit` runs full batches
/// of the plan's size (a final partial batch waits for the next epoch's shuffle), and
/// `evaluate` / `predict` re-plan for the smaller last batch.
#[test]
fn the_trainer_splits_large_datasets_and_replans_the_last_batch() {
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let ds = InMemory::new(vec![
        Column::U8 {
            data: vec![9; 10 * 8],
            per_sample: 8,
        },
        Column::I32 {
            data: (0..10).collect(),
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        epochs: 1,
        verbose: false,
        ..FitOptions::default()
    };
    let h = t.fit(&ds, None, &opts, &mut []).unwrap();
    assert_eq!(
        h.epochs[0].steps, 2,
        "two full batches of 4 out of 10 samples"
    );
    assert_eq!(t.evaluate(&ds).unwrap().samples, 10);
    assert_eq!(
        t.predict(&ds).unwrap().len(),
        10 * 10,
        "10 samples × 10 classes"
    );
}

#[test]
fn a_label_out_of_range_names_the_input_sample_value_and_classes() {
    let e = refused(
        &mut mlp(),
        &[Batch::U8(&PIXELS), Batch::I32(&[1, 2, 10, 3])],
    );
    contains_all(
        &e,
        &[
            "input `labels`",
            "sample 2",
            "label 10",
            "expected 0..=9",
            "10 classes",
        ],
    );
    let e = refused(
        &mut mlp(),
        &[Batch::U8(&PIXELS), Batch::I32(&[-1, 2, 3, 3])],
    );
    contains_all(
        &e,
        &[
            "input `labels`",
            "sample 0",
            "label -1",
            "expected 0..=9",
            "10 classes",
        ],
    );
}

#[test]
fn a_label_out_of_range_through_fit_names_the_input() {
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let ds = InMemory::new(vec![
        Column::U8 {
            data: vec![9; 4 * 8],
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2, 42],
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        epochs: 1,
        shuffle: false,
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err().to_string();
    contains_all(
        &e,
        &["input `labels`", "sample 3", "label 42", "expected 0..=9"],
    );
}

/// Through `fit` with shuffling, the sample an error names is the dataset's, with the epoch,
/// the step and its place in the batch.
#[test]
fn a_bad_sample_in_fit_is_named_by_its_index_in_the_dataset() {
    let mut t = Trainer::build(&float_spec(), &Device::cpu(), 1).unwrap();
    let n = 12;
    let mut x = vec![0.25f32; n * 8];
    x[9 * 8 + 5] = f32::INFINITY; // dataset sample 9
    let ds = InMemory::new(vec![
        Column::F32 {
            data: x,
            per_sample: 8,
        },
        Column::I32 {
            data: (0..n as i32).map(|i| i % 3).collect(),
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        epochs: 1,
        shuffle: true,
        seed: 7,
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err();
    assert!(e.is_input(), "{e:?}");
    let text = e.to_string();
    contains_all(
        &text,
        &[
            "input `x`",
            "sample 9 holds a non-finite value (inf",
            "in `fit`, epoch 1, step",
            "of its batch",
        ],
    );
    // evaluate: the dataset's order is the batch's.
    let e = t.evaluate(&ds).unwrap_err().to_string();
    contains_all(
        &e,
        &["sample 9 holds", "in `evaluate`: sample 1 of its batch"],
    );
}

/// In mixed precision, NaN in the weights makes every step skip: `fit` stops after
/// `MAX_SKIPPED_IN_A_ROW` of them, saying so, with the weights as they were.
#[test]
fn endless_loss_scaling_skips_stop_fit() {
    use memwise_runtime::train::MAX_SKIPPED_IN_A_ROW;
    let mut spec = float_spec();
    spec.precision = memwise_plan::Precision::MixedFloat16;
    let mut t = Trainer::build(&spec, &Device::cpu(), 1).unwrap();
    // (A NaN behind the ReLU would be swallowed by it; the softmax's bias is not.)
    let mut w = t.engine().param("out.bias").unwrap();
    w[1] = f32::NAN;
    t.engine_mut().set_param("out.bias", &w).unwrap();
    let ds = InMemory::new(vec![
        Column::F32 {
            data: vec![0.5; 4 * 8],
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2, 0],
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        epochs: 100,
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err();
    assert!(matches!(e, RuntimeError::NonFinite(_)), "{e:?}");
    contains_all(
        &e.to_string(),
        &[
            &format!("epoch {MAX_SKIPPED_IN_A_ROW}, step 1"),
            &format!("skipped the last {MAX_SKIPPED_IN_A_ROW} steps in a row"),
        ],
    );
    let after = t.engine().param("out.bias").unwrap();
    assert_eq!(
        after.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "skipped steps change nothing"
    );
}

#[test]
fn a_token_id_out_of_range_names_the_input_sample_value_and_vocabulary() {
    // ids [4] per sample, vocabulary 10, batch 2.
    let (p, _) = &plans()[2];
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 1).unwrap();
    let e = refused(
        &mut ex,
        &[Batch::I32(&[1, 2, 3, 4, 5, 6, 12, 7]), Batch::I32(&[0; 8])],
    );
    contains_all(
        &e,
        &[
            "input `ids`",
            "sample 1",
            "token id 12",
            "expected 0..=9",
            "10 tokens",
        ],
    );
}

#[test]
fn nan_in_a_float_input_names_the_input_sample_and_value() {
    let mut ex = Executor::new(plan(&float_spec()).unwrap(), &Device::cpu(), 1).unwrap();
    let mut x = [0.5f32; 32];
    x[19] = f32::NAN;
    let e = refused(&mut ex, &[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])]);
    contains_all(
        &e,
        &[
            "input `x`: sample 2 holds a non-finite value",
            "NaN at element 19",
            "expected a finite f32",
        ],
    );
}

#[test]
fn infinity_in_a_float_input_names_the_input_sample_and_value() {
    let mut ex = Executor::new(plan(&float_spec()).unwrap(), &Device::cpu(), 1).unwrap();
    let mut x = [0.5f32; 32];
    x[0] = f32::NEG_INFINITY;
    let e = refused(&mut ex, &[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])]);
    contains_all(
        &e,
        &[
            "input `x`: sample 0",
            "-inf at element 0",
            "expected a finite f32",
        ],
    );
    // Half-precision inputs too.
    let (p, _) = &plans()[3];
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 1).unwrap();
    let mut x = [half::f16::from_f32(0.5); 12];
    x[7] = half::f16::INFINITY;
    let e = refused(&mut ex, &[Batch::F16(&x)]);
    contains_all(
        &e,
        &[
            "input `x`: sample 1",
            "inf at element 7",
            "expected a finite f16",
        ],
    );
}

/// The documented option to skip such samples: `InMemory::drop_non_finite`, then train.
#[test]
fn non_finite_samples_are_refused_by_fit_and_trained_after_drop_non_finite() {
    let mut t = Trainer::build(&float_spec(), &Device::cpu(), 1).unwrap();
    let mut x = vec![0.25f32; 10 * 8];
    x[3 * 8 + 5] = f32::NAN;
    x[6 * 8] = f32::INFINITY;
    let ds = InMemory::new(vec![
        Column::F32 {
            data: x,
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2, 0, 1, 2, 0, 1, 2, 0],
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        epochs: 1,
        shuffle: false,
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err().to_string();
    contains_all(
        &e,
        &[
            "input `x`: sample 3 holds a non-finite value",
            "NaN",
            "drop_non_finite",
        ],
    );
    let (clean, dropped) = ds.drop_non_finite();
    assert_eq!((clean.len(), dropped), (8, 2));
    let h = t.fit(&clean, None, &opts, &mut []).unwrap();
    assert_eq!(h.epochs[0].steps, 2);
    assert!(h.step_losses.iter().all(|l| l.is_finite()));
}

#[test]
fn an_empty_dataset_is_refused_by_fit_evaluate_and_predict() {
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let empty = InMemory::new(vec![
        Column::U8 {
            data: vec![],
            per_sample: 8,
        },
        Column::I32 {
            data: vec![],
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&empty, None, &opts, &mut []).unwrap_err().to_string();
    contains_all(
        &e,
        &[
            "the dataset is empty",
            "`fit` needs at least one batch of 4 samples",
        ],
    );
    contains_all(
        &t.evaluate(&empty).unwrap_err().to_string(),
        &[
            "the dataset is empty",
            "`evaluate` needs at least one sample",
        ],
    );
    contains_all(
        &t.predict(&empty).unwrap_err().to_string(),
        &[
            "the dataset is empty",
            "`predict` needs at least one sample",
        ],
    );
}

#[test]
fn a_dataset_smaller_than_one_batch_is_refused_by_fit_with_the_numbers() {
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let ds = InMemory::new(vec![
        Column::U8 {
            data: vec![1; 3 * 8],
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2],
            per_sample: 1,
        },
    ])
    .unwrap();
    let opts = FitOptions {
        verbose: false,
        ..FitOptions::default()
    };
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err().to_string();
    contains_all(
        &e,
        &["the dataset has 3 samples, fewer than one batch of 4"],
    );
    // Evaluate and predict take any number of samples (they re-plan for it).
    assert_eq!(t.evaluate(&ds).unwrap().samples, 3);
}

#[test]
fn wrong_dataset_columns_name_the_input_expected_and_actual() {
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let opts = FitOptions {
        verbose: false,
        ..FitOptions::default()
    };
    let pixels = Column::U8 {
        data: vec![1; 4 * 8],
        per_sample: 8,
    };
    let labels = Column::I32 {
        data: vec![0; 4],
        per_sample: 1,
    };
    // Too few columns.
    let ds = InMemory::new(vec![pixels.clone()]).unwrap();
    let e = t.fit(&ds, None, &opts, &mut []).unwrap_err().to_string();
    contains_all(
        &e,
        &["the dataset has 1 columns, the model takes 2 inputs (pixels, labels)"],
    );
    // A column of the wrong dtype.
    let ds = InMemory::new(vec![
        Column::F32 {
            data: vec![0.5; 4 * 8],
            per_sample: 8,
        },
        labels.clone(),
    ])
    .unwrap();
    let e = t.evaluate(&ds).unwrap_err().to_string();
    contains_all(
        &e,
        &["input `pixels` takes 8 values of u8 per sample, the dataset column has 8 of f32"],
    );
    // A column of the wrong per-sample size.
    let ds = InMemory::new(vec![
        Column::U8 {
            data: vec![1; 4 * 7],
            per_sample: 7,
        },
        labels.clone(),
    ])
    .unwrap();
    let e = t.predict(&ds).unwrap_err().to_string();
    contains_all(
        &e,
        &["input `pixels` takes 8 values of u8 per sample, the dataset column has 7 of u8"],
    );
    // Columns of different lengths.
    let e = InMemory::new(vec![
        pixels,
        Column::I32 {
            data: vec![0; 3],
            per_sample: 1,
        },
    ])
    .unwrap_err()
    .to_string();
    contains_all(&e, &["column 1 holds 3 samples, column 0 holds 4"]);
}

/// Non-finite values are refused in every float input — bf16 features and f32 regression
/// targets too — naming the input, the sample, the value and the expected dtype.
#[test]
fn non_finite_bf16_features_and_f32_targets_name_the_input() {
    // x: bf16 [4], y: f32 [3] targets, batch 3.
    let (p, _) = &plans()[4];
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 1).unwrap();
    let mut x = [half::bf16::from_f32(0.25); 12];
    let y = [0.5f32; 9];
    x[9] = half::bf16::NAN;
    let e = refused(&mut ex, &[Batch::BF16(&x), Batch::F32(&y)]);
    contains_all(
        &e,
        &[
            "input `x`: sample 2",
            "NaN at element 9",
            "expected a finite bf16",
        ],
    );
    let x = [half::bf16::from_f32(0.25); 12];
    let mut y = [0.5f32; 9];
    y[4] = f32::INFINITY;
    let e = refused(&mut ex, &[Batch::BF16(&x), Batch::F32(&y)]);
    contains_all(
        &e,
        &[
            "input `y`: sample 1",
            "inf at element 4",
            "expected a finite f32",
        ],
    );
}

/// Inference refuses non-finite inputs as training does: `evaluate_step` on an inference
/// plan, and `Trainer::evaluate` / `predict` on a dataset.
#[test]
fn non_finite_inputs_are_refused_by_evaluate_step_evaluate_and_predict() {
    let mut ex = Executor::new(plan_inference(&float_spec()).unwrap(), &Device::cpu(), 1).unwrap();
    let before = ex.persistent_bytes().to_vec();
    let mut x = [0.5f32; 32];
    x[9] = f32::NAN;
    let e = ex
        .evaluate_step(&[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])])
        .unwrap_err();
    assert!(e.is_input(), "an input error: {e:?}");
    contains_all(
        &e.to_string(),
        &[
            "input `x`: sample 1 holds a non-finite value",
            "NaN at element 9",
            "expected a finite f32",
        ],
    );
    assert!(ex.persistent_bytes() == &before[..]);

    let mut t = Trainer::build(&float_spec(), &Device::cpu(), 1).unwrap();
    let mut x = vec![0.25f32; 6 * 8];
    x[5 * 8 + 1] = f32::NEG_INFINITY;
    let ds = InMemory::new(vec![
        Column::F32 {
            data: x,
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2, 0, 1, 2],
            per_sample: 1,
        },
    ])
    .unwrap();
    // Six samples: a full batch of four, then the re-planned last batch of two, which holds
    // the bad sample (the message counts samples within the batch).
    for e in [
        t.evaluate(&ds).unwrap_err().to_string(),
        t.predict(&ds).unwrap_err().to_string(),
    ] {
        contains_all(
            &e,
            &[
                "input `x`: sample ",
                "holds a non-finite value",
                "-inf",
                "expected a finite f32",
                "drop_non_finite",
            ],
        );
    }
    let (clean, dropped) = ds.drop_non_finite();
    assert_eq!((clean.len(), dropped), (5, 1));
    assert_eq!(t.evaluate(&clean).unwrap().samples, 5);
}

/// A memwise file with one metadata value replaced (the checksum covers the tensors only).
fn with_metadata(file: &[u8], key: &str, value: &str) -> Vec<u8> {
    let st = safetensors::SafeTensors::deserialize(file).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(file).unwrap();
    let mut meta = m.metadata().clone().unwrap_or_default();
    meta.insert(key.to_string(), value.to_string());
    safetensors::serialize(st.tensors(), Some(meta)).unwrap()
}

/// A checkpoint's loss-scaler metadata is checked like its tensors: a growth factor, backoff
/// or interval that would drive the scale to 0 (an infinite unscale factor, NaN weights) or
/// make it skip every other step, and a scale other than 1 on a model without loss scaling
/// (which would silently multiply every gradient), are refused, naming the key, what it
/// holds and what was expected; the model stays bit-identical.
#[test]
fn a_checkpoint_whose_loss_scaler_would_corrupt_training_is_refused() {
    use memwise_runtime::weights::keys;
    let bits = |x: f32| format!("0x{:08x}", x.to_bits());
    let cases: [(usize, &str, String, &str); 7] = [
        // Model 2 trains in mixed float16, with dynamic loss scaling.
        (
            2,
            keys::LOSS_SCALE_GROWTH,
            bits(0.0),
            "a finite growth factor of at least 1 (it reads 0)",
        ),
        (
            2,
            keys::LOSS_SCALE_GROWTH,
            bits(f32::INFINITY),
            "a finite growth factor of at least 1 (it reads inf)",
        ),
        (
            2,
            keys::LOSS_SCALE_GROWTH,
            bits(0.5),
            "a finite growth factor of at least 1 (it reads 0.5)",
        ),
        (
            2,
            keys::LOSS_SCALE_BACKOFF,
            bits(f32::NAN),
            "a backoff factor in (0, 1] (it reads NaN)",
        ),
        (
            2,
            keys::LOSS_SCALE_BACKOFF,
            bits(2.0),
            "a backoff factor in (0, 1] (it reads 2)",
        ),
        (
            2,
            keys::LOSS_SCALE_GROWTH_INTERVAL,
            "0".to_string(),
            "a growth interval of at least 1 step",
        ),
        // Model 0 trains in float32, without loss scaling.
        (
            0,
            keys::LOSS_SCALE,
            bits(1024.0),
            "1 (a model without loss scaling leaves its loss unscaled) (it reads 1024)",
        ),
    ];
    assert!(plans()[2].0.loss_scaling && !plans()[0].0.loss_scaling);
    for (k, key, value, want) in cases {
        let file = with_metadata(valid_file(k, true), key, &value);
        let mut ex = Executor::new(plans()[k].0.clone(), &Device::cpu(), 9).unwrap();
        let state = |ex: &Executor| {
            let scale = ex.loss_scale().to_bits();
            (ex.persistent_bytes().to_vec(), ex.step_counter(), scale)
        };
        let before = state(&ex);
        let e = ex
            .load_checkpoint_from_bytes(&file)
            .expect_err("the checkpoint must be refused")
            .to_string();
        contains_all(&e, &[&format!("metadata `{key}` is `{value}`"), want]);
        assert!(state(&ex) == before, "a failed load changed the model: {e}");
    }
    // The same rewrite with sound values loads.
    for (k, key, value) in [
        (2, keys::LOSS_SCALE_GROWTH, bits(2.0)),
        (0, keys::LOSS_SCALE, bits(1.0)),
    ] {
        let file = with_metadata(valid_file(k, true), key, &value);
        let mut ex = Executor::new(plans()[k].0.clone(), &Device::cpu(), 9).unwrap();
        ex.load_checkpoint_from_bytes(&file).unwrap();
        assert_eq!(ex.step_counter(), 2);
    }
}

/// A device string names the text and the choices.
#[test]
fn an_unknown_device_names_the_text_and_the_choices() {
    let e = Device::parse("gpu0").unwrap_err().to_string();
    contains_all(&e, &["unknown device `gpu0`", "cpu, cuda, cuda:N or auto"]);
    let e = Device::parse("cuda:x").unwrap_err().to_string();
    contains_all(&e, &["`cuda:x`", "expected cuda:N with N a device number"]);
    assert!(Device::parse("cpu").is_ok());
}

/// A `Dataset` implemented outside the crate whose `len` promises more samples than its
/// columns hold: `fit`, `evaluate` and `predict` answer with an error naming the column and
/// the sample (they used to panic indexing past the column's end).
#[test]
fn a_dataset_whose_len_overstates_its_columns_is_an_error_not_a_panic() {
    struct Overstated(InMemory);
    impl Dataset for Overstated {
        fn len(&self) -> usize {
            self.0.len() + 3
        }
        fn columns(&self) -> &[Column] {
            self.0.columns()
        }
    }
    let ds = Overstated(
        InMemory::new(vec![
            Column::U8 {
                data: vec![1; 5 * 8],
                per_sample: 8,
            },
            Column::I32 {
                data: vec![0, 1, 2, 3, 4],
                per_sample: 1,
            },
        ])
        .unwrap(),
    );
    let mut t = Trainer::build(&mlp_spec(4), &Device::cpu(), 1).unwrap();
    let opts = FitOptions {
        epochs: 1,
        shuffle: false,
        verbose: false,
        ..FitOptions::default()
    };
    let want = [
        "dataset column 0 (8 samples by its `len`)",
        "sample 5 lies past the column's end: it holds 40 values, 5 samples of 8",
    ];
    contains_all(
        &t.fit(&ds, None, &opts, &mut []).unwrap_err().to_string(),
        &want,
    );
    contains_all(&t.evaluate(&ds).unwrap_err().to_string(), &want);
    contains_all(&t.predict(&ds).unwrap_err().to_string(), &want);
}
