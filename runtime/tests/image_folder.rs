//! The image-folder loader on real files written to a temporary folder: class order and
//! labels, grayscale and RGB, resizing, Keras's validation split, the epoch shuffle following
//! the fit seed, bad files (skipped with a warning naming them, or an `Err` in strict mode),
//! empty class folders, the bounded prefetch queue, the data wait, and training through `fit`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use memwise_plan::{plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Padding};
use memwise_runtime::data::dataset::{Column, Dataset, InMemory};
use memwise_runtime::data::digits_folder::{encode_jpeg, encode_png, write_digits_folder};
use memwise_runtime::data::image_folder::{ImageFolder, LabelMode, Subset};
use memwise_runtime::{Device, FitOptions, Trainer};

/// A fresh, empty folder under the system's temporary folder.
fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memwise-imgf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn solid(w: u32, h: u32, color: &[u8]) -> Vec<u8> {
    color.repeat((w * h) as usize)
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// Gathers every sample of `d` in order, synchronously or through the pool (as `fit` does).
fn gather_all(d: &ImageFolder, announce: bool) -> Vec<Column> {
    let n = d.len();
    let mut bufs: Vec<Column> = d.columns().iter().map(|c| c.buffer(n)).collect();
    let idx: Vec<usize> = (0..n).collect();
    if announce {
        d.will_gather(&idx, n);
    }
    d.gather(&idx, &mut bufs).unwrap();
    bufs
}

fn u8s(c: &Column) -> &[u8] {
    match c {
        Column::U8 { data, .. } => data,
        other => panic!("expected a u8 column, got {:?}", other.dtype()),
    }
}

fn i32s(c: &Column) -> &[i32] {
    match c {
        Column::I32 { data, .. } => data,
        other => panic!("expected an i32 column, got {:?}", other.dtype()),
    }
}

/// Three classes created out of order, each a solid colour; class `k`'s colour is
/// `[40 (k + 1), 255 − 40 (k + 1), 10]`.
fn three_colour_folder(tag: &str) -> PathBuf {
    let dir = tmp(tag);
    for class in ["dogs", "birds", "cats"] {
        let label = match class {
            "birds" => 0u8,
            "cats" => 1,
            _ => 2,
        };
        let c = [40 * (label + 1), 255 - 40 * (label + 1), 10];
        write(
            &dir.join(class).join("a.png"),
            &encode_png(&solid(12, 9, &c), 12, 9, 3).unwrap(),
        );
        write(
            &dir.join(class).join("nested/b.jpg"),
            &encode_jpeg(&solid(16, 16, &c), 16, 16, 3, 100).unwrap(),
        );
    }
    dir
}

#[test]
fn classes_are_the_sorted_folder_names_and_each_image_keeps_its_folders_label() {
    let dir = three_colour_folder("classes");
    let d = ImageFolder::options(&dir)
        .image_size(8, 8)
        .workers(0)
        .open()
        .unwrap();
    assert_eq!(d.class_names(), ["birds", "cats", "dogs"]);
    assert_eq!(d.len(), 6);
    let labels: Vec<i32> = d.files().map(|(_, l)| l).collect();
    assert_eq!(
        labels,
        [0, 0, 1, 1, 2, 2],
        "files sorted within each class, subfolders included"
    );
    for announce in [false, true] {
        let cols = gather_all(&d, announce);
        assert_eq!(i32s(&cols[1]), [0, 0, 1, 1, 2, 2]);
        for (k, px) in u8s(&cols[0]).chunks(8 * 8 * 3).enumerate() {
            let l = i32s(&cols[1])[k] as u8;
            let want = [40 * (l + 1), 255 - 40 * (l + 1), 10];
            for p in px.chunks(3) {
                for c in 0..3 {
                    assert!(
                        p[c].abs_diff(want[c]) <= 3,
                        "sample {k} (class {l}): pixel {p:?}, its folder's colour is {want:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn grayscale_or_rgb_as_the_input_declares() {
    let dir = tmp("channels");
    let rgb = [200u8, 100, 50];
    write(
        &dir.join("a/rgb.png"),
        &encode_png(&solid(4, 4, &rgb), 4, 4, 3).unwrap(),
    );
    write(
        &dir.join("a/rgba.png"),
        &encode_png(&solid(4, 4, &[200, 100, 50, 7]), 4, 4, 4).unwrap(),
    );
    write(
        &dir.join("a/rgb.jpg"),
        &encode_jpeg(&solid(8, 8, &rgb), 8, 8, 3, 100).unwrap(),
    );
    write(
        &dir.join("b/gray.png"),
        &encode_png(&solid(4, 4, &[90]), 4, 4, 1).unwrap(),
    );
    write(
        &dir.join("b/gray_alpha.png"),
        &encode_png(&solid(4, 4, &[90, 3]), 4, 4, 2).unwrap(),
    );
    write(
        &dir.join("b/gray.jpg"),
        &encode_jpeg(&solid(8, 8, &[90]), 8, 8, 1, 100).unwrap(),
    );
    // PIL's luma: (19595 R + 38470 G + 7471 B + 2^15) >> 16.
    let luma = ((19595 * 200 + 38470 * 100 + 7471 * 50 + 32768) >> 16) as u8;
    assert_eq!(luma, 124);
    for channels in [1u32, 3] {
        let d = ImageFolder::options(&dir)
            .image_size(4, 4)
            .channels(channels)
            .workers(0)
            .open()
            .unwrap();
        assert_eq!(d.columns()[0].per_sample(), 16 * channels as usize);
        let cols = gather_all(&d, false);
        let px = u8s(&cols[0]);
        // Files sorted: a/rgb.jpg, a/rgb.png, a/rgba.png, b/gray.jpg, b/gray.png, b/gray_alpha.png.
        let want: [&[u8]; 6] = if channels == 1 {
            [&[luma], &[luma], &[luma], &[90], &[90], &[90]]
        } else {
            [
                &rgb,
                &rgb,
                &rgb,
                &[90, 90, 90],
                &[90, 90, 90],
                &[90, 90, 90],
            ]
        };
        for (k, sample) in px.chunks(16 * channels as usize).enumerate() {
            for p in sample.chunks(channels as usize) {
                for (c, (&got, &w)) in p.iter().zip(want[k]).enumerate() {
                    assert!(
                        got.abs_diff(w) <= 2,
                        "{channels} channels, sample {k}, channel {c}: {got} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn images_are_resized_to_the_input_size() {
    let dir = tmp("resize");
    // 40 wide, 20 high: the left half black, the right half white.
    let mut px = vec![0u8; 40 * 20];
    for (i, p) in px.iter_mut().enumerate() {
        if i % 40 >= 20 {
            *p = 255;
        }
    }
    write(
        &dir.join("x/halves.png"),
        &encode_png(&px, 40, 20, 1).unwrap(),
    );
    // A 1-pixel checkerboard keeps its mean when shrunk with antialiasing.
    let checker: Vec<u8> = (0..64 * 64)
        .map(|i| if (i % 64 + i / 64) % 2 == 0 { 0 } else { 254 })
        .collect();
    write(
        &dir.join("x/checker.png"),
        &encode_png(&checker, 64, 64, 1).unwrap(),
    );
    let d = ImageFolder::options(&dir)
        .image_size(10, 10)
        .channels(1)
        .workers(0)
        .open()
        .unwrap();
    let cols = gather_all(&d, false);
    let px = u8s(&cols[0]);
    assert_eq!(px.len(), 2 * 100);
    let (checker, halves) = px.split_at(100);
    for row in halves.chunks(10) {
        assert!(
            row[..4].iter().all(|&v| v < 10),
            "left half stays black: {row:?}"
        );
        assert!(
            row[6..].iter().all(|&v| v > 245),
            "right half stays white: {row:?}"
        );
    }
    let mean = checker.iter().map(|&v| v as f64).sum::<f64>() / 100.0;
    assert!(
        (mean - 127.0).abs() < 3.0,
        "antialiased shrink keeps the mean: {mean}"
    );
    assert!(
        checker.iter().all(|&v| v > 100 && v < 155),
        "no aliasing: {checker:?}"
    );
}

fn many_files(tag: &str, per_class: usize) -> PathBuf {
    let dir = tmp(tag);
    for class in 0..2u8 {
        for i in 0..per_class {
            let v = (i * 5 % 250) as u8;
            let path = dir.join(format!("class_{class}/{i:03}.png"));
            write(
                &path,
                &encode_png(&solid(6, 6, &[v, class * 100, 0]), 6, 6, 3).unwrap(),
            );
        }
    }
    dir
}

#[test]
fn validation_split_subsets_are_disjoint_deterministic_and_cover_the_folder() {
    let dir = many_files("split", 25);
    let open = |subset, seed| {
        ImageFolder::options(&dir)
            .image_size(6, 6)
            .validation_split(0.2)
            .subset(subset)
            .seed(seed)
            .workers(0)
            .open()
            .unwrap()
    };
    let files = |d: &ImageFolder| d.files().map(|(p, _)| p.to_path_buf()).collect::<Vec<_>>();
    let (t, v) = (
        files(&open(Subset::Training, 7)),
        files(&open(Subset::Validation, 7)),
    );
    assert_eq!(
        (t.len(), v.len()),
        (40, 10),
        "floor(0.2 × 50) files for validation"
    );
    assert!(t.iter().all(|p| !v.contains(p)), "the subsets are disjoint");
    let mut all: Vec<PathBuf> = t.iter().chain(&v).cloned().collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 50, "together they cover the folder");
    assert_eq!(
        files(&open(Subset::Validation, 7)),
        v,
        "the same seed gives the same split"
    );
    assert_ne!(
        files(&open(Subset::Validation, 8)),
        v,
        "another seed another split"
    );
    let (ts, vs) = ImageFolder::options(&dir)
        .image_size(6, 6)
        .validation_split(0.2)
        .seed(7)
        .workers(0)
        .open_split()
        .unwrap();
    assert_eq!(
        (files(&ts), files(&vs)),
        (t, v),
        "open_split = open(training) + open(validation)"
    );
    // Labels still follow the folders after the shuffle.
    for (p, l) in vs.files() {
        assert!(
            p.to_string_lossy().contains(&format!("class_{l}")),
            "{} labelled {l}",
            p.display()
        );
    }
    let e = ImageFolder::options(&dir)
        .subset(Subset::Validation)
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("validation_split"), "{e}");
    let e = ImageFolder::options(&dir)
        .validation_split(1.5)
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("between 0 and 1"), "{e}");
}

/// A small classifier of `h × w × c` u8 images: conv 8 → max pool → flatten → dense 2 softmax.
fn classifier(h: usize, w: usize, c: usize, batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("Tiny", batch);
    m.input("pixels", &[h, w, c], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "conv",
        LayerKind::conv2d(8, 3, 1, Padding::Valid, Activation::Relu),
        &["pixels"],
    );
    m.add("pool", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("probs", LayerKind::dense(2, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "labels"]));
    m
}

/// The guide's binary head: … → dense 1 sigmoid, binary cross-entropy on an f32 [1] label.
fn binary(h: usize, w: usize, c: usize, batch: usize) -> ModelSpec {
    let mut m = ModelSpec::new("TinyBinary", batch);
    m.input("pixels", &[h, w, c], DType::U8, 1.0 / 255.0);
    m.input("label", &[1], DType::F32, 1.0);
    m.add(
        "conv",
        LayerKind::conv2d(8, 3, 1, Padding::Valid, Activation::Relu),
        &["pixels"],
    );
    m.add("pool", LayerKind::max_pool2d(2, 2, Padding::Valid), &[]);
    m.add("flat", LayerKind::Flatten, &[]);
    m.add("prob", LayerKind::dense(1, Activation::Sigmoid), &[]);
    m.loss
        .push(LossTerm::new(LossKind::BinaryCrossentropy).on(&["prob", "label"]));
    m
}

fn quiet(epochs: usize, seed: u64) -> FitOptions {
    FitOptions {
        epochs,
        seed,
        verbose: false,
        ..Default::default()
    }
}

#[test]
fn for_plan_takes_the_image_shape_and_the_label_column_from_the_model() {
    let dir = many_files("forplan", 4);
    let p = plan(&binary(180, 180, 3, 4)).unwrap();
    let d = ImageFolder::options(&dir)
        .for_plan(&p)
        .workers(0)
        .open()
        .unwrap();
    assert_eq!(
        (d.shape().height, d.shape().width, d.shape().channels),
        (180, 180, 3)
    );
    assert_eq!(d.columns()[0].dtype(), DType::U8);
    assert_eq!(d.columns()[0].per_sample(), 180 * 180 * 3);
    assert_eq!(
        d.columns()[1].dtype(),
        DType::F32,
        "binary_crossentropy's f32 [1] target"
    );
    let cols = gather_all(&d, false);
    match &cols[1] {
        Column::F32 { data, .. } => assert_eq!(data, &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
        other => panic!("{other:?}"),
    }
    // Inputs in another order: the columns follow the plan.
    let mut m = ModelSpec::new("LabelFirst", 2);
    m.input("labels", &[], DType::I32, 1.0);
    m.input("pixels", &[5, 7], DType::U8, 1.0 / 255.0);
    m.add("flat", LayerKind::Flatten, &["pixels"]);
    m.add("probs", LayerKind::dense(2, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["probs", "labels"]));
    let d = ImageFolder::options(&dir)
        .for_plan(&plan(&m).unwrap())
        .workers(0)
        .open()
        .unwrap();
    assert_eq!(d.columns()[0].dtype(), DType::I32);
    assert_eq!(
        d.columns()[1].per_sample(),
        35,
        "a [5, 7] u8 input is a grayscale image"
    );
    // An input the folder cannot fill is an error naming it.
    let mut m = classifier(8, 8, 3, 2);
    m.layers[0].kind = LayerKind::Input {
        shape: vec![8, 8, 3],
        dtype: DType::F32,
        scale: 1.0,
    };
    let e = ImageFolder::options(&dir)
        .for_plan(&plan(&m).unwrap())
        .open()
        .err()
        .unwrap();
    assert!(e.to_string().contains("input `pixels` is f32"), "{e}");
}

/// Bad files of every kind, each in its own class folder beside good ones.
fn folder_with_bad_files(tag: &str) -> PathBuf {
    let dir = tmp(tag);
    let good = |name: &str, v: u8| {
        write(
            &dir.join(name),
            &encode_png(&solid(6, 6, &[v, v, v]), 6, 6, 3).unwrap(),
        );
    };
    good("a/1.png", 10);
    good("a/2.png", 10);
    good("b/1.png", 200);
    good("b/2.png", 200);
    write(&dir.join("a/notes.txt"), b"not an image");
    write(&dir.join("a/fake.png"), b"this is text, not a PNG");
    write(&dir.join("b/empty.jpg"), b"");
    write(
        &dir.join("b/png_named.jpg"),
        &encode_png(&solid(6, 6, &[1, 2, 3]), 6, 6, 3).unwrap(),
    );
    // Truncated past the header: found only when its pixels are decoded.
    let jpeg = encode_jpeg(
        &(0..64 * 64 * 3)
            .map(|i| (i * 7 % 251) as u8)
            .collect::<Vec<_>>(),
        64,
        64,
        3,
        90,
    )
    .unwrap();
    write(&dir.join("b/truncated.jpg"), &jpeg[..jpeg.len() / 2]);
    std::fs::create_dir_all(dir.join("c_empty")).unwrap();
    dir
}

#[test]
fn bad_files_are_skipped_with_a_warning_naming_them_and_never_take_a_wrong_label() {
    let dir = folder_with_bad_files("bad");
    let d = ImageFolder::options(&dir)
        .image_size(6, 6)
        .workers(0)
        .open()
        .unwrap();
    assert_eq!(
        d.class_names(),
        ["a", "b", "c_empty"],
        "an empty class keeps its label"
    );
    let skipped = d.skipped();
    let named = |name: &str| {
        skipped
            .iter()
            .find(|s| s.path.ends_with(name))
            .map(|s| s.reason.clone())
    };
    assert!(
        named("a/notes.txt")
            .unwrap()
            .contains("not a .png, .jpg or .jpeg"),
        "{skipped:?}"
    );
    assert!(
        named("a/fake.png").unwrap().contains("not a PNG or JPEG"),
        "{skipped:?}"
    );
    assert!(
        named("b/empty.jpg").unwrap().contains("empty"),
        "{skipped:?}"
    );
    assert!(
        named("b/png_named.jpg")
            .unwrap()
            .contains("name says JPEG but it holds a PNG"),
        "{skipped:?}"
    );
    assert!(
        named("c_empty").unwrap().contains("holds no PNG or JPEG"),
        "{skipped:?}"
    );
    assert!(
        named("b/truncated.jpg").is_none(),
        "its header is fine: found when decoded"
    );
    // Kept: the four good files and the truncated one.
    assert_eq!(d.len(), 5);
    let cols = gather_all(&d, true);
    let skipped = d.skipped();
    let trunc = skipped
        .iter()
        .find(|s| s.path.ends_with("b/truncated.jpg"))
        .expect("found when decoded");
    assert!(trunc.reason.contains("JPEG"), "{trunc}");
    // Every sample's pixels match its label's class (the truncated file's slot holds the
    // next file that decodes, with that file's label).
    for (k, px) in u8s(&cols[0]).chunks(6 * 6 * 3).enumerate() {
        let want = if i32s(&cols[1])[k] == 0 { 10 } else { 200 };
        assert!(
            px.iter().all(|&v| v.abs_diff(want) <= 2),
            "sample {k}: {:?} vs label {}",
            &px[..3],
            i32s(&cols[1])[k]
        );
    }
    // Over `max_pixels`: refused from its header, before anything is allocated for it.
    let e = ImageFolder::options(many_files("pixels", 2))
        .max_pixels(35)
        .strict(true)
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("the image is 6×6 = 36 pixels, over the limit of 35"),
        "{e}"
    );
    // Strict: the first bad file is an error naming it.
    let e = ImageFolder::options(&dir)
        .strict(true)
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("a/fake.png") || e.contains("a/notes.txt"), "{e}");
}

#[test]
fn strict_mode_refuses_a_file_that_fails_to_decode_and_an_empty_class() {
    let dir = tmp("strict");
    write(
        &dir.join("a/1.png"),
        &encode_png(&solid(6, 6, &[9, 9, 9]), 6, 6, 3).unwrap(),
    );
    let png = encode_png(
        &(0..32 * 32 * 3)
            .map(|i| (i * 13 % 256) as u8)
            .collect::<Vec<_>>(),
        32,
        32,
        3,
    )
    .unwrap();
    write(&dir.join("b/truncated.png"), &png[..png.len() - 20]);
    for workers in [0, 2] {
        let d = ImageFolder::options(&dir)
            .image_size(6, 6)
            .strict(true)
            .workers(workers)
            .open()
            .unwrap();
        let mut bufs: Vec<Column> = d.columns().iter().map(|c| c.buffer(2)).collect();
        d.will_gather(&[0, 1], 2);
        let e = d.gather(&[0, 1], &mut bufs).unwrap_err().to_string();
        assert!(
            e.contains("b/truncated.png") && e.contains("PNG"),
            "{workers} workers: {e}"
        );
    }
    std::fs::create_dir_all(dir.join("c")).unwrap();
    let e = ImageFolder::options(&dir)
        .strict(true)
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("class folder `c` holds no PNG or JPEG image"),
        "{e}"
    );
    let e = ImageFolder::options(dir.join("a"))
        .open()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no class folders"), "{e}");
}

#[test]
fn the_prefetch_queue_is_bounded_and_serves_the_announced_batches_in_order() {
    let dir = many_files("bounded", 20);
    let d = ImageFolder::options(&dir)
        .image_size(16, 16)
        .workers(2)
        .prefetch(3)
        .open()
        .unwrap();
    let plan = d.prefetch_plan(2);
    assert_eq!(plan.batches, 3);
    assert_eq!(
        plan.queue_bytes,
        3 * 2 * (16 * 16 * 3 + 4),
        "3 batches of 2 u8 images and i32 labels"
    );
    // A shuffled order, as `fit` announces it.
    let order: Vec<usize> = (0..40).map(|i| (i * 17) % 40).collect();
    d.will_gather(&order, 2);
    std::thread::sleep(Duration::from_millis(300));
    let (early, _) = d.stats();
    assert!(early.max_buffers <= 3 && early.max_ready <= 3, "{early:?}");
    assert!(
        early.max_ready >= 1,
        "the workers filled batches ahead: {early:?}"
    );
    let reference = ImageFolder::options(&dir)
        .image_size(16, 16)
        .workers(0)
        .open()
        .unwrap();
    for b in order.chunks(2) {
        let mut got: Vec<Column> = d.columns().iter().map(|c| c.buffer(2)).collect();
        let mut want = got.clone();
        d.gather(b, &mut got).unwrap();
        reference.gather(b, &mut want).unwrap();
        assert_eq!(got, want, "batch {b:?} from the queue = decoded in place");
    }
    let (stats, synchronous) = d.stats();
    assert_eq!((stats.prefetched, synchronous), (20, 0), "{stats:?}");
    assert!(
        stats.max_buffers <= 3,
        "never more than 3 batch buffers: {stats:?}"
    );
    // A request that is not the announced next batch is answered exactly, in place.
    let mut got: Vec<Column> = d.columns().iter().map(|c| c.buffer(2)).collect();
    d.gather(&[5, 6], &mut got).unwrap();
    assert_eq!(d.stats().1, 1);
}

#[test]
fn streaming_from_the_folder_trains_exactly_as_the_same_images_in_memory() {
    let dir = many_files("equal", 12);
    let folder = ImageFolder::options(&dir)
        .image_size(8, 8)
        .workers(2)
        .prefetch(2)
        .open()
        .unwrap();
    let cols = gather_all(
        &ImageFolder::options(&dir)
            .image_size(8, 8)
            .workers(0)
            .open()
            .unwrap(),
        false,
    );
    let memory = InMemory::new(cols).unwrap();
    let spec = classifier(8, 8, 3, 4);
    let run = |data: &dyn Dataset, seed: u64| {
        let mut t = Trainer::build(&spec, &Device::cpu(), 3).unwrap();
        t.fit(data, None, &quiet(3, seed), &mut []).unwrap()
    };
    let streamed = run(&folder, 5);
    let in_memory = run(&memory, 5);
    assert_eq!(
        streamed.step_losses, in_memory.step_losses,
        "same batches, same order"
    );
    assert_eq!(streamed.step_losses.len(), 3 * 6);
    assert_ne!(
        run(&folder, 6).step_losses,
        streamed.step_losses,
        "the epoch shuffle follows the fit seed"
    );
    let (stats, synchronous) = folder.stats();
    assert_eq!(
        synchronous, 0,
        "every batch of every epoch came from the queue: {stats:?}"
    );
    assert_eq!(stats.prefetched, 2 * 18);
}

#[test]
fn fit_from_a_folder_of_digits_learns_and_counts_the_queue_and_the_data_wait() {
    let dir = tmp("digits");
    let written = write_digits_folder(&dir, &[0, 1], 5).unwrap();
    assert!(written.png > 1500 && written.jpeg > 300, "{written:?}");
    let spec = binary(20, 20, 1, 32);
    let p = plan(&spec).unwrap();
    let (train, val) = ImageFolder::options(&dir)
        .for_plan(&p)
        .validation_split(0.2)
        .seed(1)
        .workers(2)
        .open_split()
        .unwrap();
    let mut t = Trainer::from_plan(
        &spec,
        p,
        &Device::cpu(),
        1,
        memwise_runtime::monitor::MemoryMonitor::start(),
    )
    .unwrap();
    let opts = FitOptions {
        steps_per_epoch: Some(15),
        ..quiet(2, 1)
    };
    let h = t.fit(&train, Some(&val), &opts, &mut []).unwrap();
    let last = h.epochs.last().unwrap();
    assert!(
        last.val_loss.unwrap() < 0.4,
        "zeros vs ones separate (chance is ln 2 = 0.69): val_loss {:?}",
        last.val_loss
    );
    assert_eq!(h.data_wait_ms.len(), 30, "one data-wait figure per step");
    let total: f64 = h.epochs.iter().map(|e| e.data_wait_seconds).sum();
    assert!((total * 1e3 - h.data_wait_ms.iter().sum::<f64>()).abs() < 1e-6);
    let (stats, _) = train.stats();
    assert!(
        stats.blocked.as_secs_f64() <= total + 1e-3,
        "time blocked on the queue {:?} is part of the wait fit measured {total}",
        stats.blocked
    );
    assert_eq!(
        t.host_bytes().prefetch,
        train.prefetch_bytes(32) + val.prefetch_bytes(32),
        "both loaders' queues and buffers are in the host estimate"
    );
    assert!(t.estimate_bytes() >= t.plan().memory.total + t.host_bytes().prefetch);
    let e = t.evaluate(&val).unwrap();
    assert_eq!(e.samples, val.len());
    assert_eq!(t.predict(&val).unwrap().len(), val.len());
}

#[test]
fn decoding_in_the_step_shows_as_data_wait_and_prefetching_hides_it() {
    let dir = tmp("wait");
    // Large images (512 × 512 JPEG) so that decoding a batch takes measurable time.
    let px: Vec<u8> = (0..512 * 512 * 3)
        .map(|i| ((i / 3) % 509 + i % 3 * 40) as u8)
        .collect();
    let jpeg = encode_jpeg(&px, 512, 512, 3, 90).unwrap();
    for i in 0..24 {
        write(&dir.join(format!("c{}/{i}.jpg", i % 2)), &jpeg);
    }
    let spec = classifier(32, 32, 3, 4);
    let wait = |workers: usize| {
        let d = ImageFolder::options(&dir)
            .image_size(32, 32)
            .workers(workers)
            .open()
            .unwrap();
        let mut t = Trainer::build(&spec, &Device::cpu(), 3).unwrap();
        let h = t.fit(&d, None, &quiet(1, 1), &mut []).unwrap();
        (h.data_wait_ms.clone(), d.stats())
    };
    let (inline, (_, sync)) = wait(0);
    assert_eq!(
        sync, 6,
        "without workers every batch is decoded in the step"
    );
    assert!(
        inline.iter().all(|&ms| ms > 0.5),
        "decoding 4 images of 512² waits: {inline:?}"
    );
    let (prefetched, (stats, sync)) = wait(2);
    assert_eq!((sync, stats.prefetched), (0, 6));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(
        mean(&prefetched) <= mean(&inline),
        "prefetching never waits longer on average: {prefetched:?} vs {inline:?}"
    );
}

#[test]
fn the_plan_of_a_folder_counts_the_largest_image() {
    let dir = tmp("planbytes");
    write(
        &dir.join("a/small.png"),
        &encode_png(&solid(10, 10, &[1, 2, 3]), 10, 10, 3).unwrap(),
    );
    let small = ImageFolder::options(&dir)
        .image_size(8, 8)
        .open()
        .unwrap()
        .prefetch_plan(4);
    write(
        &dir.join("a/big.png"),
        &encode_png(&solid(300, 200, &[1, 2, 3]), 300, 200, 3).unwrap(),
    );
    let big = ImageFolder::options(&dir)
        .image_size(8, 8)
        .open()
        .unwrap()
        .prefetch_plan(4);
    assert_eq!(
        small.queue_bytes, big.queue_bytes,
        "the queue holds resized samples"
    );
    assert!(
        big.worker_bytes >= small.worker_bytes + 300 * 200 * 4,
        "a worker's buffers hold the largest decoded image: {} vs {}",
        big.worker_bytes,
        small.worker_bytes
    );
    let no_workers = ImageFolder::options(&dir).workers(0).open().unwrap();
    assert_eq!(no_workers.prefetch_plan(4).queue_bytes, 0);
    let images_only = ImageFolder::options(&dir)
        .labels(LabelMode::None)
        .open()
        .unwrap();
    assert_eq!(
        images_only.columns().len(),
        1,
        "no label column (an autoencoder's input)"
    );
}
