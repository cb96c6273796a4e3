//! IDX reader: round trips, malformed input, the standard MNIST folder
//! layout, and the bundled 10,000-digit subset.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use flate2::write::GzEncoder;
use flate2::Compression;
use memwise_runtime::data::idx::{
    load_bundled_digits, load_mnist_dir, parse_idx, read_idx, IdxArray, IdxError, MnistSplit,
    BUNDLED_TEST, BUNDLED_TRAIN,
};

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A fresh empty folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("memwise-idx-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` deterministic pseudo-random `rows × cols` images and labels 0..9.
fn generated(n: usize, rows: usize, cols: usize) -> (IdxArray, IdxArray) {
    let mut state = 0x2545_f491_u32;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    let images = (0..n * rows * cols).map(|_| next() as u8).collect();
    let labels = (0..n).map(|_| (next() % 10) as u8).collect();
    (
        IdxArray {
            dims: vec![n, rows, cols],
            data: images,
        },
        IdxArray {
            dims: vec![n],
            data: labels,
        },
    )
}

fn err_of(bytes: &[u8], name: &str) -> String {
    match parse_idx(bytes, name) {
        Ok(a) => panic!("{name}: expected an error, parsed dims {:?}", a.dims),
        Err(e) => e.to_string(),
    }
}

fn assert_msg(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
}

#[test]
fn round_trip_plain_and_gzipped() {
    let (images, labels) = generated(7, 5, 3);
    for arr in [&images, &labels] {
        let bytes = arr.to_bytes();
        assert_eq!(&parse_idx(&bytes, "plain").unwrap(), arr);
        assert_eq!(&parse_idx(&gzip(&bytes), "gz").unwrap(), arr);
    }
    // Header layout: magic, then big-endian dims.
    let bytes = images.to_bytes();
    assert_eq!(&bytes[..4], &[0, 0, 0x08, 3]);
    assert_eq!(&bytes[4..8], &7u32.to_be_bytes());
    assert_eq!(&bytes[8..16], &[0, 0, 0, 5, 0, 0, 0, 3]);
    assert_eq!(bytes.len(), 16 + 7 * 5 * 3);

    // Scalar (0 dims) and empty arrays are legal IDX.
    let scalar = IdxArray {
        dims: vec![],
        data: vec![42],
    };
    assert_eq!(parse_idx(&scalar.to_bytes(), "s").unwrap(), scalar);
    let empty = IdxArray {
        dims: vec![0, 28, 28],
        data: vec![],
    };
    assert_eq!(parse_idx(&empty.to_bytes(), "e").unwrap(), empty);
}

#[test]
fn read_idx_from_files_detects_gzip_by_content() {
    let tmp = TempDir::new("read");
    let (images, _) = generated(4, 2, 2);
    let plain = tmp.0.join("a.idx");
    // A gzipped file whose name does not say so still parses.
    let gz = tmp.0.join("b.idx");
    std::fs::write(&plain, images.to_bytes()).unwrap();
    std::fs::write(&gz, gzip(&images.to_bytes())).unwrap();
    assert_eq!(read_idx(&plain).unwrap(), images);
    assert_eq!(read_idx(&gz).unwrap(), images);

    let missing = tmp.0.join("nope.idx");
    let e = read_idx(&missing).unwrap_err();
    assert!(matches!(e, IdxError::Io { .. }));
    assert_msg(&e.to_string(), &["nope.idx", "cannot read"]);
    assert!(std::error::Error::source(&e).is_some());
}

#[test]
fn malformed_headers_and_payloads_are_errors() {
    let good = IdxArray {
        dims: vec![2, 3],
        data: vec![1, 2, 3, 4, 5, 6],
    }
    .to_bytes();

    // Shorter than the magic.
    assert_msg(
        &err_of(&[0, 0], "tiny.idx"),
        &["tiny.idx", "truncated header", "needs 4", "only 2"],
    );
    // Bad magic: non-zero leading bytes, or an unknown type code.
    assert_msg(
        &err_of(b"PK\x03\x04 not idx", "zip.idx"),
        &["zip.idx", "bad magic", "50 4b 03 04"],
    );
    assert_msg(
        &err_of(&[0, 0, 0x42, 1, 0, 0, 0, 0], "weird.idx"),
        &["weird.idx", "bad magic"],
    );
    // A valid IDX type that is not u8 (0x0D = f32).
    let mut f32_file = good.clone();
    f32_file[2] = 0x0d;
    assert_msg(
        &err_of(&f32_file, "float.idx"),
        &["float.idx", "unsupported element type 0x0d"],
    );
    // Header cut inside the dims.
    assert_msg(
        &err_of(&good[..9], "cut.idx"),
        &["cut.idx", "truncated header (dims)", "needs 12", "only 9"],
    );
    // Payload shorter than the dims say.
    assert_msg(
        &err_of(&good[..good.len() - 1], "short.idx"),
        &["short.idx", "truncated data", "needs 18", "only 17"],
    );
    // Payload longer than the dims say.
    let mut long = good.clone();
    long.extend_from_slice(&[9, 9]);
    let msg = err_of(&long, "long.idx");
    assert_msg(
        &msg,
        &["long.idx", "[2, 3]", "need 6", "found 8", "2 trailing"],
    );
    // Dims whose product overflows usize.
    let mut huge = vec![0, 0, 0x08, 4];
    for _ in 0..4 {
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
    }
    assert_msg(&err_of(&huge, "huge.idx"), &["huge.idx", "overflow"]);
    // Huge dims with a tiny payload must not allocate or panic either.
    let mut big = vec![0, 0, 0x08, 1];
    big.extend_from_slice(&u32::MAX.to_be_bytes());
    assert_msg(&err_of(&big, "big.idx"), &["big.idx", "truncated data"]);
    // Gzip magic with a corrupt or cut stream.
    let gz = gzip(&good);
    assert_msg(
        &err_of(&gz[..gz.len() / 2], "half.gz"),
        &["half.gz", "gzip", "corrupt or truncated"],
    );
    assert_msg(
        &err_of(&[0x1f, 0x8b, 0xff, 0xff, 0, 1, 2], "junk.gz"),
        &["junk.gz", "gzip"],
    );
    // A gzip stream holding a malformed IDX reports the IDX problem.
    assert_msg(
        &err_of(&gzip(&good[..good.len() - 1]), "inner.gz"),
        &["inner.gz", "truncated data"],
    );
}

#[test]
fn split_validation_errors() {
    let (images, labels) = generated(5, 4, 4);

    // Image/label count mismatch.
    let short_labels = IdxArray {
        dims: vec![4],
        data: labels.data[..4].to_vec(),
    };
    let e =
        MnistSplit::from_arrays(images.clone(), "img.idx", short_labels, "lab.idx").unwrap_err();
    assert!(matches!(e, IdxError::CountMismatch { .. }));
    assert_msg(
        &e.to_string(),
        &[
            "img.idx",
            "5 images",
            "lab.idx",
            "4 labels",
            "count mismatch",
        ],
    );

    // Label out of range.
    let mut bad = labels.clone();
    bad.data[3] = 12;
    let e = MnistSplit::from_arrays(images.clone(), "img.idx", bad, "lab.idx").unwrap_err();
    assert_msg(&e.to_string(), &["lab.idx", "label 12", "index 3", "0..9"]);

    // Wrong ranks.
    let flat = IdxArray {
        dims: vec![5, 16],
        data: images.data.clone(),
    };
    let e = MnistSplit::from_arrays(flat, "flat.idx", labels.clone(), "lab.idx").unwrap_err();
    assert_msg(&e.to_string(), &["flat.idx", "[5, 16]", "3 dims"]);
    let e =
        MnistSplit::from_arrays(images.clone(), "img.idx", images.clone(), "img2.idx").unwrap_err();
    assert_msg(&e.to_string(), &["img2.idx", "1 dim"]);

    // The good pair works, and accessors agree with the arrays.
    let split = MnistSplit::from_arrays(images.clone(), "i", labels.clone(), "l").unwrap();
    assert_eq!((split.len(), split.rows, split.cols), (5, 4, 4));
    assert_eq!(split.image(2).unwrap(), &images.data[32..48]);
    assert_eq!(split.label(4), Some(labels.data[4]));
    assert_eq!(split.image(5), None);
    assert_eq!(split.label(5), None);
    assert_eq!(split.class_counts().iter().sum::<usize>(), 5);
    let (a, b) = split.clone().split_at(3);
    assert_eq!((a.len(), b.len()), (3, 2));
    assert_eq!(b.image(0), split.image(3));
    assert_eq!(b.label(1), split.label(4));
}

#[test]
fn mnist_dir_with_standard_names() {
    let tmp = TempDir::new("dir");
    let (tr_i, tr_l) = generated(6, 28, 28);
    let (te_i, te_l) = generated(3, 28, 28);
    // Mix plain and gzipped files, as people unpack them either way.
    std::fs::write(
        tmp.0.join("train-images-idx3-ubyte.gz"),
        gzip(&tr_i.to_bytes()),
    )
    .unwrap();
    std::fs::write(tmp.0.join("train-labels-idx1-ubyte"), tr_l.to_bytes()).unwrap();
    std::fs::write(tmp.0.join("t10k-images-idx3-ubyte"), te_i.to_bytes()).unwrap();

    // Missing test labels: the error names the folder and the names tried.
    let e = load_mnist_dir(&tmp.0).unwrap_err();
    assert!(matches!(e, IdxError::Missing { .. }));
    assert_msg(
        &e.to_string(),
        &[
            &tmp.0.display().to_string(),
            "t10k-labels-idx1-ubyte, t10k-labels-idx1-ubyte.gz",
        ],
    );

    // Test labels with a count mismatch: the error names both files.
    let short = IdxArray {
        dims: vec![2],
        data: te_l.data[..2].to_vec(),
    };
    let labels_path = tmp.0.join("t10k-labels-idx1-ubyte.gz");
    std::fs::write(&labels_path, gzip(&short.to_bytes())).unwrap();
    assert_msg(
        &load_mnist_dir(&tmp.0).unwrap_err().to_string(),
        &[
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte.gz",
            "count mismatch",
        ],
    );

    std::fs::write(&labels_path, gzip(&te_l.to_bytes())).unwrap();
    let set = load_mnist_dir(&tmp.0).unwrap();
    assert_eq!(set.train.len(), 6);
    assert_eq!(set.test.len(), 3);
    assert_eq!(set.train.images, tr_i.data);
    assert_eq!(set.train.labels, tr_l.data);
    assert_eq!(set.test.images, te_i.data);
    assert_eq!(set.test.labels, te_l.data);
    assert_eq!((set.test.rows, set.test.cols), (28, 28));
}

#[test]
fn bundled_digits_load_and_look_like_mnist() {
    let (train, test) = load_bundled_digits().unwrap();
    assert_eq!(train.len(), BUNDLED_TRAIN);
    assert_eq!(test.len(), BUNDLED_TEST);
    assert_eq!((BUNDLED_TRAIN, BUNDLED_TEST), (8000, 2000));
    for split in [&train, &test] {
        assert_eq!((split.rows, split.cols), (28, 28));
        assert_eq!(split.images.len(), split.len() * 784);
        assert!(split.labels.iter().all(|&l| l <= 9));
    }

    // Every class present in both splits, in roughly MNIST's proportions
    // (about a tenth each; digit 5 is the rarest, 1 the most common).
    let (tc, sc) = (train.class_counts(), test.class_counts());
    for d in 0..10 {
        assert!((600..=1000).contains(&tc[d]), "train digit {d}: {}", tc[d]);
        assert!((140..=260).contains(&sc[d]), "test digit {d}: {}", sc[d]);
    }
    // The exact counts documented in data/mnist-10k/README.md.
    assert_eq!(tc, [817, 899, 783, 826, 774, 694, 827, 879, 740, 761]);
    assert_eq!(sc, [184, 228, 208, 206, 206, 169, 187, 191, 204, 217]);

    // The order is shuffled, not grouped by digit: the first 100 labels
    // already cover every class.
    let mut seen = [false; 10];
    for &l in &train.labels[..100] {
        seen[usize::from(l)] = true;
    }
    assert!(
        seen.iter().all(|&s| s),
        "first 100 labels: {:?}",
        &train.labels[..100]
    );

    // Pixel statistics: MNIST's mean is about 33/255 (0.13); the borders
    // are background; the full byte range is used.
    let all: Vec<u8> = train.images.iter().chain(&test.images).copied().collect();
    let mean = all.iter().map(|&p| f64::from(p)).sum::<f64>() / all.len() as f64;
    assert!((30.0..=37.0).contains(&mean), "mean pixel {mean}");
    assert_eq!(all.iter().copied().max(), Some(255));
    assert_eq!(all.iter().copied().min(), Some(0));
    let corner_ink: u64 = (0..train.len())
        .map(|i| u64::from(train.image(i).unwrap()[0]))
        .sum();
    assert_eq!(
        corner_ink, 0,
        "top-left pixel should be background everywhere"
    );
}
