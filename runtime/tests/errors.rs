//! Bad input is an `Err` whose text names the input and the expected vs actual value —
//! never a panic — and the model loses nothing.

use memwise_plan::{plan, zoo, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec};
use memwise_runtime::data::dataset::{Column, InMemory};
use memwise_runtime::{Batch, Device, Executor, FitOptions, Trainer};

fn mlp() -> Executor {
    Executor::new(plan(&zoo::mnist_mlp(4)).unwrap(), &Device::cpu(), 1).unwrap()
}

fn weights(ex: &Executor) -> Vec<u8> {
    ex.persistent_bytes().to_vec()
}

#[test]
fn wrong_number_of_inputs() {
    let mut ex = mlp();
    let e = ex
        .train_step(&[Batch::U8(&[0; 4 * 784])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("takes 2 inputs (pixels, labels), got 1"), "{e}");
}

#[test]
fn wrong_dtype_names_the_input() {
    let mut ex = mlp();
    let px = vec![0.0f32; 4 * 784];
    let e = ex
        .train_step(&[Batch::F32(&px), Batch::I32(&[0; 4])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("input `pixels` holds u8 values, got f32"), "{e}");
}

#[test]
fn wrong_length_names_expected_and_actual() {
    let mut ex = mlp();
    let e = ex
        .train_step(&[Batch::U8(&[0; 784]), Batch::I32(&[0; 4])])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("input `pixels` expects 3136 values (shape [4, 784]), got 784"),
        "{e}"
    );
}

#[test]
fn label_out_of_range_names_sample_label_and_classes() {
    let mut ex = mlp();
    let before = weights(&ex);
    let e = ex
        .train_step(&[Batch::U8(&[0; 4 * 784]), Batch::I32(&[1, 2, 10, 3])])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sample 2") && e.contains("label 10") && e.contains("10 classes"),
        "{e}"
    );
    assert_eq!(
        weights(&ex),
        before,
        "a refused step leaves the weights untouched"
    );
}

fn float_model() -> ModelSpec {
    let mut m = ModelSpec::new("F", 4);
    m.input("x", &[8], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add("h", LayerKind::dense(16, Activation::Relu), &["x"]);
    m.add("out", LayerKind::dense(3, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["out", "labels"]));
    m
}

#[test]
fn nan_in_a_float_input_is_refused_by_default() {
    let mut ex = Executor::new(plan(&float_model()).unwrap(), &Device::cpu(), 1).unwrap();
    let mut x = vec![0.5f32; 32];
    x[19] = f32::NAN;
    let e = ex
        .train_step(&[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("input `x`: sample 2 holds a non-finite value"),
        "{e}"
    );
}

#[test]
fn a_non_finite_loss_in_float32_stops_before_the_update_and_names_the_layer() {
    let mut ex = Executor::new(plan(&float_model()).unwrap(), &Device::cpu(), 1).unwrap();
    let before = weights(&ex);
    // Finite input, but large enough that the first dense layer overflows f32.
    let x = vec![3.0e38f32; 32];
    let e = ex
        .train_step(&[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("training step 1") && e.contains("layer `h`"),
        "{e}"
    );
    assert_eq!(weights(&ex), before, "nothing was updated");
    // The model keeps working on good data.
    let x = vec![0.5f32; 32];
    assert!(ex
        .train_step(&[Batch::F32(&x), Batch::I32(&[0, 1, 2, 0])])
        .is_ok());
}

/// Through `fit`: the second batch overflows the first layer in float32, so the loss goes
/// NaN at step 2; `fit` stops with an error naming the step and the layer, and the weights
/// are those after step 1 (bit for bit: the same predictions as a run that stopped there).
#[test]
fn a_nan_loss_in_float32_stops_fit_naming_the_step_and_the_first_non_finite_layer() {
    let opts = FitOptions {
        epochs: 1,
        shuffle: false,
        verbose: false,
        ..FitOptions::default()
    };
    let labels = Column::I32 {
        data: vec![0, 1, 2, 0, 1, 2, 0, 1],
        per_sample: 1,
    };
    let mut x = vec![0.5f32; 8 * 8];
    x[4 * 8..].fill(3.0e38);
    let data = InMemory::new(vec![
        Column::F32 {
            data: x.clone(),
            per_sample: 8,
        },
        labels,
    ])
    .unwrap();
    let probe = InMemory::new(vec![
        Column::F32 {
            data: vec![0.5; 4 * 8],
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0; 4],
            per_sample: 1,
        },
    ])
    .unwrap();
    let mut t = Trainer::build(&float_model(), &Device::cpu(), 1).unwrap();
    let e = t.fit(&data, None, &opts, &mut []).unwrap_err().to_string();
    assert!(
        e.contains("training step 2")
            && e.contains("the loss is NaN")
            && e.contains("layer `h`")
            && e.contains("not updated"),
        "{e}"
    );
    // The same model after only the first (finite) batch.
    let mut first = Trainer::build(&float_model(), &Device::cpu(), 1).unwrap();
    let head = InMemory::new(vec![
        Column::F32 {
            data: x[..4 * 8].to_vec(),
            per_sample: 8,
        },
        Column::I32 {
            data: vec![0, 1, 2, 0],
            per_sample: 1,
        },
    ])
    .unwrap();
    let h = first.fit(&head, None, &opts, &mut []).unwrap();
    assert_eq!(h.step_losses.len(), 1);
    let bits = |p: Vec<f32>| p.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(t.predict(&probe).unwrap()),
        bits(first.predict(&probe).unwrap()),
        "the failed step changed the weights"
    );
}

#[test]
fn a_plan_over_the_device_memory_limit_is_refused_before_allocating() {
    let p = plan(&zoo::mnist_mlp(128)).unwrap();
    let e = Executor::new(p, &Device::cpu().with_memory_limit(1 << 20), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("needs")
            && e.contains("1 MiB available")
            && e.contains("5.39 MiB")
            && e.contains("nothing was allocated"),
        "{e}"
    );
}
