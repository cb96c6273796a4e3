//! Weights on disk: a bit-exact round trip; every kind of bad file (wrong names, shapes,
//! dtypes, another model's file, truncated, corrupt header, damaged data) is an error that
//! names the problem and leaves the model untouched; a file made by the `safetensors` crate
//! from independent tensors loads.

use std::path::PathBuf;

use memwise_plan::{
    plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer, Padding,
};
use memwise_runtime::weights::{keys, FORMAT_VERSION};
use memwise_runtime::{Batch, Device, Executor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// 784 u8 pixels → dense 32 relu → batch norm → dropout → dense 10 softmax; Adam.
fn small(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("Small", batch);
    m.optimizer = Optimizer::ADAM;
    m.input("pixels", &[784], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(32, Activation::Relu),
        &["pixels"],
    );
    m.add("bn", LayerKind::batch_norm(), &[]);
    m.add("drop", LayerKind::Dropout { rate: 0.2 }, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    m
}

/// Another model: a conv net on 8×8 images.
fn other(batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("Other", batch);
    m.input("image", &[8, 8, 1], DType::F32, 1.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "conv",
        LayerKind::conv2d(4, 3, 1, Padding::Same, Activation::Relu),
        &["image"],
    );
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    m
}

fn tmp_dir(test: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("weights-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An executor of `small` trained for two steps (so every parameter, the batch-norm
/// statistics and the optimizer state hold something other than their initial values).
fn trained(seed: u64) -> Executor {
    let mut ex = Executor::new(plan(&small(8)).unwrap(), &Device::cpu(), seed).unwrap();
    for step in 0..2u32 {
        let px: Vec<u8> = (0..8 * 784u32)
            .map(|i| ((i * 31 + step * 7) % 251) as u8)
            .collect();
        let labels: Vec<i32> = (0..8).map(|i| ((i + step) % 10) as i32).collect();
        ex.train_step(&[Batch::U8(&px), Batch::I32(&labels)])
            .unwrap();
    }
    ex
}

/// Every parameter's values, by name.
fn params(ex: &Executor) -> Vec<(String, Vec<u32>)> {
    ex.plan()
        .params
        .iter()
        .map(|p| {
            (
                p.name.to_string(),
                ex.param(&p.name)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            )
        })
        .collect()
}

/// The file's tensors as (name, dtype, shape, bytes), to rebuild variants of it.
fn tensors_of(bytes: &[u8]) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Serialises `tensors` with the safetensors crate, without memwise metadata.
fn write_with_crate(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Loads `bytes` into a trained model and returns the error text; asserts the whole
/// persistent region (weights, 16-bit copies, gradients, optimizer state) is unchanged.
fn load_fails(bytes: &[u8]) -> String {
    let mut ex = trained(3);
    let before = ex.persistent_bytes().to_vec();
    let (step, loss_scale) = (ex.step_counter(), ex.loss_scale());
    let e = ex
        .load_weights_from_bytes(bytes)
        .expect_err("loading must fail")
        .to_string();
    assert!(
        ex.persistent_bytes() == &before[..],
        "a failed load changed the model ({e})"
    );
    assert_eq!((ex.step_counter(), ex.loss_scale()), (step, loss_scale));
    e
}

#[test]
fn round_trip_is_bit_exact_and_the_file_is_plain_safetensors() {
    let dir = tmp_dir("round-trip");
    let path = dir.join("small.safetensors");
    let a = trained(1);
    a.save_weights(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(
        bytes,
        a.weights_to_bytes().unwrap(),
        "save_weights and weights_to_bytes agree"
    );
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("small.safetensors")]);

    // What any safetensors reader sees: the plan's names, Keras shapes, F32, metadata.
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut got: Vec<(String, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect();
    got.sort();
    let want: Vec<(String, Vec<usize>)> = [
        ("bn.bias", vec![32]),
        ("bn.running_mean", vec![32]),
        ("bn.running_var", vec![32]),
        ("bn.weight", vec![32]),
        ("hidden.bias", vec![32]),
        ("hidden.weight", vec![784, 32]),
        ("logits.bias", vec![10]),
        ("logits.weight", vec![32, 10]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    assert_eq!(got, want);
    assert!(st.tensors().iter().all(|(_, t)| t.dtype() == Dtype::F32));
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta[keys::MODEL], "Small");
    assert_eq!(meta[keys::FORMAT_VERSION], FORMAT_VERSION.to_string());
    assert_eq!(meta[keys::KIND], "weights");
    assert!(meta[keys::CHECKSUM].starts_with("fnv1a64:"));
    // The values are the model's, little-endian f32 (copied: the data may be unaligned).
    let w = st.tensor("hidden.weight").unwrap();
    let vals: Vec<f32> = w
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(vals, a.param("hidden.weight").unwrap());

    // Round trip into a model built with another seed: every bit comes back.
    let mut b = Executor::new(plan(&small(8)).unwrap(), &Device::cpu(), 99).unwrap();
    assert_ne!(params(&a), params(&b));
    b.load_weights(&path).unwrap();
    assert_eq!(params(&a), params(&b));
    // And it trains on from there.
    let px: Vec<u8> = (0..8 * 784u32).map(|i| (i % 256) as u8).collect();
    let labels: Vec<i32> = (0..8).collect();
    assert!(b
        .train_step(&[Batch::U8(&px), Batch::I32(&labels)])
        .unwrap()
        .loss
        .is_finite());

    // Saving again over the existing file replaces it atomically.
    b.save_weights(&path).unwrap();
    assert!(std::fs::read(&path).unwrap() == b.weights_to_bytes().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wrong_names_are_listed_and_the_model_is_untouched() {
    let mut t = tensors_of(&trained(1).weights_to_bytes().unwrap());
    for e in t.iter_mut() {
        if e.0 == "hidden.bias" {
            e.0 = "hidden.b".into();
        }
    }
    t.retain(|e| e.0 != "bn.running_var");
    let e = load_fails(&write_with_crate(&t));
    assert!(e.contains("missing: `hidden.bias` [32] F32"), "{e}");
    assert!(e.contains("missing: `bn.running_var` [32] F32"), "{e}");
    assert!(e.contains("unexpected: `hidden.b` [32] F32"), "{e}");
    assert!(e.contains("3 problems"), "{e}");
    assert!(e.contains("the model was not changed"), "{e}");
}

#[test]
fn a_transposed_pytorch_layout_is_named_with_both_shapes() {
    let mut t = tensors_of(&trained(1).weights_to_bytes().unwrap());
    for e in t.iter_mut() {
        if e.0 == "hidden.weight" {
            e.2 = vec![32, 784];
        }
    }
    let e = load_fails(&write_with_crate(&t));
    assert!(
        e.contains("shape: `hidden.weight` is [32, 784] in the file, the model has [784, 32]"),
        "{e}"
    );
    assert!(e.contains("PyTorch"), "{e}");
    assert!(e.contains("1 problem;"), "{e}");
}

#[test]
fn a_wrong_dtype_is_named() {
    let mut t = tensors_of(&trained(1).weights_to_bytes().unwrap());
    for e in t.iter_mut() {
        if e.0 == "logits.bias" {
            // The same ten values as f16.
            let f: Vec<u8> = e
                .3
                .chunks_exact(4)
                .flat_map(|c| {
                    half::f16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
                })
                .collect();
            e.1 = Dtype::F16;
            e.3 = f;
        }
        if e.0 == "bn.weight" {
            // F64 of a wrong shape: both are reported.
            e.1 = Dtype::F64;
            e.2 = vec![16];
        }
    }
    let e = load_fails(&write_with_crate(&t));
    assert!(
        e.contains("dtype: `logits.bias` is F16 in the file, the model stores F32"),
        "{e}"
    );
    assert!(e.contains("dtype: `bn.weight` is F64"), "{e}");
    assert!(
        e.contains("shape: `bn.weight` is [16] in the file, the model has [32]"),
        "{e}"
    );
}

#[test]
fn another_models_file_is_refused_with_both_model_names() {
    let o = Executor::new(plan(&other(4)).unwrap(), &Device::cpu(), 1).unwrap();
    let e = load_fails(&o.weights_to_bytes().unwrap());
    assert!(
        e.contains("the file was saved from model `Other`, this is `Small`"),
        "{e}"
    );
    assert!(e.contains("missing: `hidden.weight` [784, 32] F32"), "{e}");
    assert!(
        e.contains("unexpected: `conv.weight` [3, 3, 1, 4] F32"),
        "{e}"
    );
    assert!(
        e.contains("shape: `logits.weight` is [256, 10] in the file, the model has [32, 10]"),
        "{e}"
    );
}

#[test]
fn truncated_files_are_clear_errors() {
    let bytes = trained(1).weights_to_bytes().unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let cuts = [
        0,
        3,
        7,
        8,
        9,
        8 + header / 2,
        8 + header,
        8 + header + 1,
        bytes.len() / 2,
        bytes.len() - 1,
    ];
    for cut in cuts {
        let e = load_fails(&bytes[..cut]);
        assert!(
            e.contains("truncated"),
            "cut at {cut} of {}: {e}",
            bytes.len()
        );
    }
    // A file cut short on disk, through the path API.
    let dir = tmp_dir("truncated");
    let path = dir.join("cut.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let mut ex = trained(3);
    let before = ex.persistent_bytes().to_vec();
    let e = ex.load_weights(&path).unwrap_err().to_string();
    assert!(
        e.contains("cut.safetensors") && e.contains("truncated"),
        "{e}"
    );
    assert!(ex.persistent_bytes() == &before[..]);
    let e = ex
        .load_weights(dir.join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_headers_are_clear_errors() {
    let bytes = trained(1).weights_to_bytes().unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    // Not JSON.
    let mut b = bytes.clone();
    b[8] = b'X';
    let e = load_fails(&b);
    assert!(e.contains("corrupt header"), "{e}");
    // Not UTF-8.
    let mut b = bytes.clone();
    b[8 + header / 2] = 0xFF;
    let e = load_fails(&b);
    assert!(e.contains("corrupt header"), "{e}");
    // A length field far past the end.
    let mut b = bytes.clone();
    b[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let e = load_fails(&b);
    assert!(e.contains("truncated or not safetensors"), "{e}");
    // Data offsets that do not match the shape.
    let text = String::from_utf8(bytes[8..8 + header].to_vec()).unwrap();
    let bad = text.replacen("\"shape\":[32]", "\"shape\":[33]", 1);
    assert_ne!(bad, text);
    let mut b = bytes[..8].to_vec();
    b.extend_from_slice(bad.as_bytes());
    b.extend_from_slice(&bytes[8 + header..]);
    let e = load_fails(&b);
    assert!(e.contains("corrupt header"), "{e}");
    // Garbage.
    let e = load_fails(b"definitely not a safetensors file at all");
    assert!(e.contains("truncated or not safetensors"), "{e}");
}

#[test]
fn damaged_data_fails_the_checksum() {
    let bytes = trained(1).weights_to_bytes().unwrap();
    let mut b = bytes.clone();
    let last = b.len() - 3;
    b[last] ^= 0x40;
    let e = load_fails(&b);
    assert!(e.contains("checksum mismatch"), "{e}");
}

#[test]
fn a_file_written_by_the_safetensors_crate_loads() {
    // Independently made tensors in the model's layout, no memwise metadata, written by
    // the reference implementation (its own layout and order).
    let ex = trained(1);
    let mut want = Vec::new();
    let mut t = Vec::new();
    for (k, p) in ex.plan().params.iter().enumerate() {
        let vals: Vec<f32> = (0..p.elems())
            .map(|i| (i as f32 * 0.001 + k as f32).sin())
            .collect();
        t.push((
            p.name.to_string(),
            Dtype::F32,
            p.shape.to_vec(),
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        want.push((
            p.name.to_string(),
            vals.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        ));
    }
    let dir = tmp_dir("foreign");
    let path = dir.join("foreign.safetensors");
    let views: Vec<(String, TensorView<'_>)> = t
        .iter()
        .map(|(n, d, s, b): &(String, Dtype, Vec<usize>, Vec<u8>)| {
            (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let mut ex = trained(2);
    ex.load_weights(&path).unwrap();
    assert_eq!(params(&ex), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpoints_and_weights_files_are_told_apart() {
    let a = trained(1);
    // load_weights reads a checkpoint's weights and skips its optimizer state.
    let ckpt = a.checkpoint_to_bytes().unwrap();
    assert!(tensors_of(&ckpt)
        .iter()
        .any(|t| t.0 == "hidden.weight.opt1"));
    let mut b = Executor::new(plan(&small(8)).unwrap(), &Device::cpu(), 5).unwrap();
    b.load_weights_from_bytes(&ckpt).unwrap();
    assert_eq!(params(&a), params(&b));
    assert_eq!(
        b.step_counter(),
        0,
        "load_weights leaves the counters alone"
    );
    // load_checkpoint refuses a weights file, and says what it is.
    let mut c = trained(4);
    let before = c.persistent_bytes().to_vec();
    let e = c
        .load_checkpoint_from_bytes(&a.weights_to_bytes().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is a memwise weights file, not a training checkpoint"),
        "{e}"
    );
    assert!(c.persistent_bytes() == &before[..]);
    // A checkpoint of another optimizer cannot be resumed.
    let mut spec = small(8);
    spec.optimizer = Optimizer::RMSPROP;
    let r = Executor::new(plan(&spec).unwrap(), &Device::cpu(), 1).unwrap();
    let e = c
        .load_checkpoint_from_bytes(&r.checkpoint_to_bytes().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer is `rmsprop`, this model trains with `adam`"),
        "{e}"
    );
    assert!(c.persistent_bytes() == &before[..]);
    // Nor one whose optimizer keeps another number of state slots.
    let mut with_momentum = spec.clone();
    with_momentum.optimizer = Optimizer::RmsProp {
        lr: 1e-3,
        rho: 0.9,
        epsilon: 1e-7,
        momentum: 0.9,
        centered: false,
    };
    let m = Executor::new(plan(&with_momentum).unwrap(), &Device::cpu(), 1).unwrap();
    let mut r = r;
    let e = r
        .load_checkpoint_from_bytes(&m.checkpoint_to_bytes().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("holds 2 optimizer state slots per parameter, this model's `rmsprop` keeps 1"),
        "{e}"
    );
}

#[test]
fn saving_into_a_missing_directory_names_the_path() {
    let dir = tmp_dir("missing-dir");
    let path = dir.join("no/such/dir/w.safetensors");
    let e = trained(1).save_weights(&path).unwrap_err().to_string();
    assert!(e.contains("no/such/dir/w.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fuzzing entry points on mutated files: every input is `Ok` or an error, never a
/// panic, and a failed load changes nothing.
#[test]
fn mutated_files_never_panic_and_never_half_load() {
    let a = trained(1);
    let seeds = [
        a.weights_to_bytes().unwrap(),
        a.checkpoint_to_bytes().unwrap(),
    ];
    let mut ex = trained(7);
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let (mut ok, mut err) = (0, 0);
    for round in 0..400 {
        let mut b = seeds[round % 2].clone();
        let header = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let edits = 1 + rnd() % 4;
        for _ in 0..edits {
            // Mostly the header, where structure lives.
            let span = if rnd() % 4 == 0 {
                b.len()
            } else {
                (8 + header).min(b.len())
            };
            let at = (rnd() as usize) % span;
            match rnd() % 4 {
                0 => b[at] ^= 1 << (rnd() % 8),
                1 => b[at] = rnd() as u8,
                2 => b.truncate(at),
                _ => b.insert(at, rnd() as u8),
            }
            if b.is_empty() {
                break;
            }
        }
        let before = ex.persistent_bytes().to_vec();
        let r = if round % 3 == 0 {
            ex.load_checkpoint_from_bytes(&b)
        } else {
            ex.load_weights_from_bytes(&b)
        };
        match r {
            Ok(()) => ok += 1,
            Err(_) => {
                err += 1;
                assert!(
                    ex.persistent_bytes() == &before[..],
                    "round {round}: a failed load changed the model"
                );
            }
        }
    }
    assert!(err > 300, "{ok} loaded, {err} refused");
}

#[test]
fn a_newer_format_version_is_refused() {
    let t = tensors_of(&trained(1).weights_to_bytes().unwrap());
    let views: Vec<(String, TensorView<'_>)> = t
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = [(
        keys::FORMAT_VERSION.to_string(),
        (FORMAT_VERSION + 1).to_string(),
    )]
    .into_iter()
    .collect();
    let e = load_fails(&safetensors::serialize(views, Some(meta)).unwrap());
    assert!(
        e.contains(&format!("written in memwise format version {}; this build reads versions up to {FORMAT_VERSION}", FORMAT_VERSION + 1)),
        "{e}"
    );
}

/// A save removes the temporaries that killed saves to the same path left behind (their
/// process is gone), and only those: another running process's temporary stays.
#[test]
fn a_save_removes_the_temporaries_of_dead_processes() {
    let dir = tmp_dir("stale_temporaries");
    let path = dir.join("w.safetensors");
    // A process id no process has: above every running one.
    let dead = (1..u32::MAX)
        .map(|k| 4_000_000 - k)
        .find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
        .unwrap();
    let stale = dir.join(format!(".w.safetensors.tmp-{dead}-3"));
    let running = dir.join(".w.safetensors.tmp-1-0"); // pid 1 always runs
    let other_path = dir.join(format!(".v.safetensors.tmp-{dead}-0"));
    for t in [&stale, &running, &other_path] {
        std::fs::write(t, b"half a file").unwrap();
    }
    trained(1).save_weights(&path).unwrap();
    assert!(!stale.exists(), "the dead process's temporary is removed");
    assert!(running.exists(), "a running process's temporary stays");
    assert!(
        other_path.exists(),
        "another path's temporaries are not this save's business"
    );
    assert!(path.exists());
}
