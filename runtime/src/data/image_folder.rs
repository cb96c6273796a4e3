//! `ImageFolder`: a dataset streamed from a folder of images, one subfolder per class —
//! Keras's `image_dataset_from_directory` and torchvision's `ImageFolder` — decoded and
//! resized to the model's input in background workers, kept as uint8 until the step converts
//! them, with a bounded, planned prefetch queue (`docs/DATA.md`).
//!
//! Opening a folder lists it (class folders sorted by name, as Keras and torchvision do; files
//! sorted, subfolders included), splits it (`validation_split`, `subset`, `seed`, Keras's
//! rule) and reads every file's header — so that a file that is not an image is found now,
//! and the largest image plans the workers' buffers. Pixels are decoded only when a batch
//! needs them.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memwise_plan::{DType, StaticPlan};

use crate::data::dataset::{Column, Dataset};
use crate::data::image::{
    probe, scratch_bytes, ImageDecoder, ImageFormat, ImageHeader, ImageShape, ScratchBytes,
    DEFAULT_MAX_PIXELS,
};
use crate::data::prefetch::{Fill, Filled, Pool, PrefetchStats};
use crate::error::{Result, RuntimeError};

/// What the label column holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelMode {
    /// The class index as an i32 (`#[input(shape = [], dtype = i32)]`): Keras's `"int"`.
    Int,
    /// 0.0 or 1.0 as an f32 of shape [1], for two classes (`dense(1, activation = sigmoid)`
    /// with `binary_crossentropy`): Keras's `"binary"`.
    Binary,
    /// No label column (an autoencoder): Keras's `None`.
    None,
}

/// Which part of a split folder to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subset {
    Training,
    Validation,
}

/// A file left out, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedFile {
    pub path: PathBuf,
    pub reason: String,
}

impl std::fmt::Display for SkippedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

/// Column roles, in the model's input order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Image,
    Label(LabelMode),
}

/// How to open an image folder: [`ImageFolder::options`], then the builder methods, then
/// [`ImageFolderOptions::open`] (one subset) or [`ImageFolderOptions::open_split`] (both).
#[derive(Clone, Debug)]
pub struct ImageFolderOptions {
    dir: PathBuf,
    shape: ImageShape,
    roles: Vec<Role>,
    validation_split: Option<f64>,
    subset: Subset,
    seed: u64,
    workers: usize,
    prefetch: Option<usize>,
    strict: bool,
    max_pixels: u64,
    plan_error: Option<String>,
}

/// Header reads are this long; a JPEG whose headers run longer is read whole.
const PROBE_PREFIX: u64 = 64 << 10;

impl ImageFolderOptions {
    /// The image size and channels, and the columns, from a model's plan: its u8 image input
    /// `[height, width, channels]` (or `[height, width]`: grayscale) and its label input —
    /// i32 `[]` ([`LabelMode::Int`]) or f32 `[1]` ([`LabelMode::Binary`]) — in the plan's
    /// input order. Any other input is an error when the folder is opened.
    pub fn for_plan(mut self, plan: &StaticPlan) -> Self {
        match roles_of(plan) {
            Ok((shape, roles)) => {
                self.shape = shape;
                self.roles = roles;
                self.plan_error = None;
            }
            Err(e) => self.plan_error = Some(e),
        }
        self
    }
    /// Images resized to `height × width` (default 256 × 256, as Keras).
    pub fn image_size(mut self, height: u32, width: u32) -> Self {
        self.shape.height = height;
        self.shape.width = width;
        self
    }
    /// 1 (grayscale) or 3 (RGB, the default) channels.
    pub fn channels(mut self, channels: u32) -> Self {
        self.shape.channels = channels;
        self
    }
    /// The label column (default [`LabelMode::Int`], after the image column).
    pub fn labels(mut self, mode: LabelMode) -> Self {
        self.roles = match mode {
            LabelMode::None => vec![Role::Image],
            m => vec![Role::Image, Role::Label(m)],
        };
        self
    }
    /// Keeps `fraction` of the files for validation (Keras: the files are shuffled with
    /// `seed`, the last `floor(fraction × n)` are the validation subset).
    pub fn validation_split(mut self, fraction: f64) -> Self {
        self.validation_split = Some(fraction);
        self
    }
    /// Which subset [`ImageFolderOptions::open`] opens (default training).
    pub fn subset(mut self, subset: Subset) -> Self {
        self.subset = subset;
        self
    }
    /// The seed of the split's shuffle (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Decoding threads (default: one per CPU). 0 decodes in the calling thread, when a batch
    /// is gathered.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }
    /// Batches decoded ahead of the step, being decoded or waiting (default: 2 per worker,
    /// PyTorch's `prefetch_factor`). At least 1.
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = Some(batches.max(1));
        self
    }
    /// Refuse the folder with an `Err` naming the file at the first bad file or empty class
    /// folder, instead of skipping it with a warning (the default).
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }
    /// Refuse images over this many pixels (default [`DEFAULT_MAX_PIXELS`]).
    pub fn max_pixels(mut self, pixels: u64) -> Self {
        self.max_pixels = pixels;
        self
    }

    /// Opens the subset chosen with [`ImageFolderOptions::subset`] (all files without a
    /// `validation_split`).
    pub fn open(self) -> Result<ImageFolder> {
        let listing = self.list()?;
        let files = self.split(listing.files);
        let pick = match (self.validation_split, self.subset) {
            (None, Subset::Validation) => {
                return Err(RuntimeError::Input(format!(
                    "{}: the validation subset needs a `validation_split`",
                    self.dir.display()
                )))
            }
            (None, Subset::Training) => files.0,
            (Some(_), Subset::Training) => files.0,
            (Some(_), Subset::Validation) => files.1,
        };
        ImageFolder::from_files(&self, listing.classes, pick, listing.skipped)
    }

    /// Opens both subsets of a `validation_split` from one listing: `(training, validation)`.
    pub fn open_split(self) -> Result<(ImageFolder, ImageFolder)> {
        if self.validation_split.is_none() {
            return Err(RuntimeError::Input(format!(
                "{}: `open_split` needs a `validation_split`",
                self.dir.display()
            )));
        }
        let listing = self.list()?;
        let (train, val) = self.split(listing.files);
        let t = ImageFolder::from_files(&self, listing.classes.clone(), train, listing.skipped)?;
        let v = ImageFolder::from_files(&self, listing.classes, val, Vec::new())?;
        Ok((t, v))
    }

    fn bad(&self, skipped: &mut Vec<SkippedFile>, path: &Path, reason: String) -> Result<()> {
        let s = SkippedFile {
            path: path.to_path_buf(),
            reason,
        };
        if self.strict {
            return Err(RuntimeError::Input(format!("image folder: {s}")));
        }
        eprintln!("memwise: skipping {s}");
        skipped.push(s);
        Ok(())
    }

    /// Class folders and their files (sorted), files with an extension other than PNG/JPEG
    /// already refused or skipped.
    fn list(&self) -> Result<Listing> {
        if let Some(e) = &self.plan_error {
            return Err(RuntimeError::Input(format!(
                "image folder for this model: {e}"
            )));
        }
        self.shape
            .check()
            .map_err(|e| RuntimeError::Input(format!("image folder: {e}")))?;
        if let Some(f) = self.validation_split {
            if !(f > 0.0 && f < 1.0) {
                return Err(RuntimeError::Input(format!(
                    "validation_split must lie strictly between 0 and 1, got {f}"
                )));
            }
        }
        let io = |p: &Path, e: std::io::Error| {
            RuntimeError::Io(format!("image folder {}: {e}", p.display()))
        };
        let mut classes: Vec<(String, PathBuf)> = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(|e| io(&self.dir, e))? {
            let entry = entry.map_err(|e| io(&self.dir, e))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() && !name.starts_with('.') {
                classes.push((name, path));
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(RuntimeError::Input(format!(
                "image folder {}: no class folders in it (expected one subfolder of images per class)",
                self.dir.display()
            )));
        }
        if self.roles.contains(&Role::Label(LabelMode::Binary)) && classes.len() != 2 {
            return Err(RuntimeError::Input(format!(
                "image folder {}: binary labels need exactly 2 class folders, found {} ({})",
                self.dir.display(),
                classes.len(),
                classes
                    .iter()
                    .map(|c| c.0.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut files = Vec::new();
        let mut skipped = Vec::new();
        for (label, (name, path)) in classes.iter().enumerate() {
            let mut found = Vec::new();
            walk(path, &mut found).map_err(|e| io(path, e))?;
            found.sort();
            let before = files.len();
            for f in found {
                if ImageFormat::from_extension(&f).is_some() {
                    files.push((f, label as i32));
                } else {
                    self.bad(
                        &mut skipped,
                        &f,
                        "not a .png, .jpg or .jpeg file".to_string(),
                    )?;
                }
            }
            if files.len() == before {
                let why = format!("class folder `{name}` holds no PNG or JPEG image (class {label} will have no samples)");
                self.bad(&mut skipped, path, why)?;
            }
        }
        Ok(Listing {
            classes: classes.into_iter().map(|c| c.0).collect(),
            files,
            skipped,
        })
    }

    /// Keras's split: shuffle every file with the seed, the last `floor(split × n)` are the
    /// validation subset. Without a split, every file in listing order is training.
    #[allow(clippy::type_complexity)]
    fn split(&self, mut files: Vec<(PathBuf, i32)>) -> (Vec<(PathBuf, i32)>, Vec<(PathBuf, i32)>) {
        let Some(fraction) = self.validation_split else {
            return (files, Vec::new());
        };
        let mut rng = self.seed ^ 0x5350_4c49_5421; // "SPLIT!"
        for i in (1..files.len()).rev() {
            let j = (crate::train::splitmix(&mut rng) % (i as u64 + 1)) as usize;
            files.swap(i, j);
        }
        let val = (fraction * files.len() as f64).floor() as usize;
        let at = files.len() - val.min(files.len());
        let val = files.split_off(at);
        (files, val)
    }
}

struct Listing {
    classes: Vec<String>,
    files: Vec<(PathBuf, i32)>,
    skipped: Vec<SkippedFile>,
}

/// Every file under `dir`, recursively (hidden files and folders, named `.…`, left out).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Symlinked folders are not followed (Keras's rule), so a link loop cannot recurse.
        if entry.file_type()?.is_dir() {
            walk(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// The image shape and the column roles a plan's inputs ask for.
fn roles_of(plan: &StaticPlan) -> std::result::Result<(ImageShape, Vec<Role>), String> {
    let mut shape = None;
    let mut roles = Vec::new();
    for &id in plan.inputs.iter() {
        let t = plan.tensor(id);
        let s = &t.shape[1.min(t.shape.len())..];
        let image = match (t.dtype, s) {
            (DType::U8, &[h, w, c]) if c == 1 || c == 3 => Some((h, w, c)),
            (DType::U8, &[h, w]) => Some((h, w, 1)),
            _ => None,
        };
        let role = match (image, t.dtype, s) {
            (Some((h, w, c)), _, _) if shape.is_none() => {
                let dim = |x: usize| {
                    u32::try_from(x).map_err(|_| format!("input `{}`: {x} pixels is too large", t.name))
                };
                shape = Some(ImageShape {
                    height: dim(h)?,
                    width: dim(w)?,
                    channels: dim(c)?,
                });
                Role::Image
            }
            (_, DType::I32, []) => Role::Label(LabelMode::Int),
            (_, DType::F32, [1]) => Role::Label(LabelMode::Binary),
            _ => {
                return Err(format!(
                    "input `{}` is {} {:?}; an image folder fills one u8 image input [height, width, 1 or 3] \
                     and one label input (i32 [] for a class index, f32 [1] for two classes)",
                    t.name,
                    t.dtype.name(),
                    s
                ))
            }
        };
        if matches!(role, Role::Label(_)) && roles.iter().any(|r| matches!(r, Role::Label(_))) {
            return Err(format!(
                "input `{}`: the model takes two label inputs; an image folder has one label",
                t.name
            ));
        }
        roles.push(role);
    }
    let shape = shape.ok_or_else(|| {
        format!(
            "model `{}` has no u8 image input [height, width, 1 or 3] for the images",
            plan.model
        )
    })?;
    Ok((shape, roles))
}

/// What the workers share: the files, and how to turn one into a sample.
struct FolderCore {
    files: Vec<(PathBuf, i32)>,
    shape: ImageShape,
    strict: bool,
    max_pixels: u64,
    /// The largest file, and the largest of each scratch buffer over every file: what each
    /// worker allocates once.
    max_file: u64,
    scratch: ScratchBytes,
    widest: u32,
    /// Files found bad while decoding (skipped from then on), and what was said about them.
    bad: Vec<AtomicBool>,
    skipped: Mutex<Vec<SkippedFile>>,
    synchronous: AtomicU64,
}

/// A worker's buffers: the file's bytes and the decoder's.
struct WorkerScratch {
    file: Vec<u8>,
    decoder: ImageDecoder,
}

impl FolderCore {
    fn new_scratch(&self) -> WorkerScratch {
        WorkerScratch {
            file: Vec::with_capacity(self.max_file as usize),
            decoder: ImageDecoder::with_capacity(
                self.max_pixels,
                self.scratch,
                self.widest,
                self.shape,
            ),
        }
    }

    /// One sample into `out`: file `i`, or — when it fails to decode and the folder is not
    /// strict — the next file that decodes, whose class is returned with it.
    fn sample(
        &self,
        s: &mut WorkerScratch,
        i: usize,
        out: &mut [u8],
    ) -> std::result::Result<i32, String> {
        let n = self.files.len();
        for k in 0..n {
            let j = (i + k) % n;
            if self.bad.get(j).is_some_and(|b| b.load(Ordering::Relaxed)) {
                continue;
            }
            let (path, label) = &self.files[j];
            match self.decode(s, path, out) {
                Ok(()) => return Ok(*label),
                Err(reason) => {
                    let skipped = SkippedFile {
                        path: path.clone(),
                        reason,
                    };
                    if self.strict {
                        return Err(format!("image folder: {skipped}"));
                    }
                    if !self.bad[j].swap(true, Ordering::Relaxed) {
                        eprintln!("memwise: skipping {skipped} (its place in the batch goes to the next image that decodes)");
                        self.skipped
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(skipped);
                    }
                }
            }
        }
        Err(format!("image folder: none of its {n} images decodes"))
    }

    /// Samples `idx` into `images` (back to back) and their classes into `labels`.
    fn fill_into(
        &self,
        s: &mut WorkerScratch,
        idx: &[usize],
        images: &mut [u8],
        labels: &mut [i32],
    ) -> std::result::Result<(), String> {
        let per = self.shape.bytes();
        for ((&i, slot), label) in idx
            .iter()
            .zip(images.chunks_exact_mut(per))
            .zip(labels.iter_mut())
        {
            *label = self.sample(s, i, slot)?;
        }
        Ok(())
    }

    fn decode(
        &self,
        s: &mut WorkerScratch,
        path: &Path,
        out: &mut [u8],
    ) -> std::result::Result<(), String> {
        let expected = ImageFormat::from_extension(path).ok_or("not a .png, .jpg or .jpeg file")?;
        s.file.clear();
        File::open(path)
            .and_then(|mut f| f.read_to_end(&mut s.file))
            .map_err(|e| format!("cannot read it: {e}"))?;
        let (bytes, shape) = (&s.file, self.shape);
        catch_decoder_panic(|| s.decoder.decode_into(bytes, expected, shape, out))
    }
}

/// A panic inside a decoder crate on a malformed file becomes that file's error (the fuzz
/// target `decode_image` looks for such panics; none is known).
fn catch_decoder_panic(
    f: impl FnOnce() -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err("the image decoder panicked on this file".to_string()))
}

impl Fill for FolderCore {
    type Scratch = WorkerScratch;
    fn scratch(&self) -> WorkerScratch {
        self.new_scratch()
    }
    fn fill(
        &self,
        s: &mut WorkerScratch,
        idx: &[usize],
        out: &mut Filled,
    ) -> std::result::Result<(), String> {
        self.fill_into(s, idx, &mut out.images, &mut out.labels)
    }
    fn sample_bytes(&self) -> usize {
        self.shape.bytes()
    }
}

/// What an [`ImageFolder`] allocates while it serves batches, planned from its options and
/// the largest file it holds (see [`ImageFolder::prefetch_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchPlan {
    pub workers: usize,
    /// Batch buffers (being decoded or waiting), and their bytes: uint8 images and i32 classes.
    pub batches: usize,
    pub queue_bytes: u64,
    /// Each decoder's buffers (one per worker; without workers, the calling thread's): the
    /// largest file's bytes and the decode scratch.
    pub worker_bytes: u64,
    pub decoders: usize,
    /// The announced sample order (two epochs of indices).
    pub order_bytes: u64,
}

impl PrefetchPlan {
    pub fn total(&self) -> u64 {
        self.queue_bytes + self.decoders as u64 * self.worker_bytes + self.order_bytes
    }
}

/// A folder of images, one subfolder per class, as a [`Dataset`] streamed through a prefetch
/// pool. Build it with [`ImageFolder::options`].
///
/// ```no_run
/// use memwise_runtime::data::image_folder::ImageFolder;
/// # fn main() -> Result<(), memwise_runtime::RuntimeError> {
/// # let plan: memwise_plan::StaticPlan = todo!();
/// let (train, val) = ImageFolder::options("cats_vs_dogs/train")
///     .for_plan(&plan)             // 180×180×3 u8 images, the label column the model declares
///     .validation_split(0.2)
///     .seed(1337)
///     .open_split()?;
/// # Ok(()) }
/// ```
pub struct ImageFolder {
    core: Arc<FolderCore>,
    classes: Vec<String>,
    roles: Vec<Role>,
    columns: Vec<Column>,
    workers: usize,
    prefetch: usize,
    pool: Mutex<Option<Pool<FolderCore>>>,
    sync_scratch: Mutex<Option<WorkerScratch>>,
    opened_with: Vec<SkippedFile>,
}

impl ImageFolder {
    /// Options for the folder `dir`: 256 × 256 RGB images and i32 class labels until told
    /// otherwise ([`ImageFolderOptions::for_plan`] takes both from a model).
    pub fn options(dir: impl AsRef<Path>) -> ImageFolderOptions {
        ImageFolderOptions {
            dir: dir.as_ref().to_path_buf(),
            shape: ImageShape {
                height: 256,
                width: 256,
                channels: 3,
            },
            roles: vec![Role::Image, Role::Label(LabelMode::Int)],
            validation_split: None,
            subset: Subset::Training,
            seed: 0,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            prefetch: None,
            strict: false,
            max_pixels: DEFAULT_MAX_PIXELS,
            plan_error: None,
        }
    }

    fn from_files(
        o: &ImageFolderOptions,
        classes: Vec<String>,
        files: Vec<(PathBuf, i32)>,
        mut skipped: Vec<SkippedFile>,
    ) -> Result<ImageFolder> {
        let probed = probe_all(&files, o.max_pixels, o.workers.max(1));
        let mut kept = Vec::with_capacity(files.len());
        let (mut max_file, mut scratch, mut widest) = (0u64, ScratchBytes::default(), 0u32);
        for ((path, label), p) in files.into_iter().zip(probed) {
            match p {
                Ok((header, len)) => {
                    max_file = max_file.max(len);
                    scratch = scratch.max(scratch_bytes(&header, o.shape));
                    widest = widest.max(header.width);
                    kept.push((path, label));
                }
                Err(reason) => o.bad(&mut skipped, &path, reason)?,
            }
        }
        let columns = o
            .roles
            .iter()
            .map(|r| match r {
                Role::Image => Column::U8 {
                    data: Vec::new(),
                    per_sample: o.shape.bytes(),
                },
                Role::Label(LabelMode::Binary) => Column::F32 {
                    data: Vec::new(),
                    per_sample: 1,
                },
                Role::Label(_) => Column::I32 {
                    data: Vec::new(),
                    per_sample: 1,
                },
            })
            .collect();
        let workers = o.workers;
        Ok(ImageFolder {
            core: Arc::new(FolderCore {
                bad: kept.iter().map(|_| AtomicBool::new(false)).collect(),
                files: kept,
                shape: o.shape,
                strict: o.strict,
                max_pixels: o.max_pixels,
                max_file,
                scratch,
                widest,
                skipped: Mutex::new(Vec::new()),
                synchronous: AtomicU64::new(0),
            }),
            classes,
            roles: o.roles.clone(),
            columns,
            workers,
            prefetch: o.prefetch.unwrap_or(2 * workers).max(1),
            pool: Mutex::new(None),
            sync_scratch: Mutex::new(None),
            opened_with: skipped,
        })
    }

    /// Class names, sorted: label `k` is `class_names()[k]`.
    pub fn class_names(&self) -> &[String] {
        &self.classes
    }

    /// The files of this subset with their class, in sample order.
    pub fn files(&self) -> impl Iterator<Item = (&Path, i32)> {
        self.core.files.iter().map(|(p, l)| (p.as_path(), *l))
    }

    /// The sample shape images are resized to.
    pub fn shape(&self) -> ImageShape {
        self.core.shape
    }

    /// Files left out with a warning so far: when the folder was opened (not an image, a
    /// wrong extension, an empty class folder) and while decoding (a truncated file).
    pub fn skipped(&self) -> Vec<SkippedFile> {
        let mut v = self.opened_with.clone();
        v.extend(
            self.core
                .skipped
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned(),
        );
        v
    }

    /// Decoding threads and batches in flight.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// What serving batches of `batch` allocates: `prefetch` batch buffers, each worker's
    /// buffers at their largest, and the announced order.
    pub fn prefetch_plan(&self, batch: usize) -> PrefetchPlan {
        let c = &self.core;
        let sample = c.shape.bytes() as u64 + std::mem::size_of::<i32>() as u64;
        let workers = self.workers;
        // Without workers the calling thread decodes, with one worker's buffers.
        let decoders = workers.max(1);
        PrefetchPlan {
            workers,
            batches: if workers == 0 { 0 } else { self.prefetch },
            queue_bytes: if workers == 0 {
                0
            } else {
                self.prefetch as u64 * batch as u64 * sample
            },
            worker_bytes: c.max_file + c.scratch.total(),
            decoders,
            order_bytes: if workers == 0 {
                0
            } else {
                2 * c.files.len() as u64 * std::mem::size_of::<usize>() as u64
            },
        }
    }

    /// The prefetch pool's counters (time blocked on the queue, buffers used), and how many
    /// batches were decoded in the calling thread because they were not the announced next.
    pub fn stats(&self) -> (PrefetchStats, u64) {
        let pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        (
            pool.as_ref().map(|p| p.stats()).unwrap_or_default(),
            self.core.synchronous.load(Ordering::Relaxed),
        )
    }

    fn check_buffers(&self, indices: &[usize], out: &[Column]) -> Result<()> {
        if out.len() != self.columns.len() {
            return Err(RuntimeError::Input(format!(
                "{} buffers for {} columns",
                out.len(),
                self.columns.len()
            )));
        }
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.core.files.len()) {
            return Err(RuntimeError::Input(format!(
                "sample {bad} of a {}-image folder",
                self.core.files.len()
            )));
        }
        for (k, (c, o)) in self.columns.iter().zip(out).enumerate() {
            let short = match o {
                Column::U8 { data, .. } => data.len(),
                Column::I32 { data, .. } => data.len(),
                Column::F32 { data, .. } => data.len(),
            } < indices.len() * c.per_sample();
            if o.dtype() != c.dtype() || short {
                return Err(RuntimeError::Input(format!(
                    "buffer {k} must hold {} samples of {} {} values",
                    indices.len(),
                    c.per_sample(),
                    c.dtype().name()
                )));
            }
        }
        Ok(())
    }

    /// Hands one batch's images to the image buffer: a buffer of exactly the batch's size
    /// (`fit`'s staging buffer) is swapped with the pool's, which then goes back to the pool in
    /// its place — no copy, and no more buffers than before; any other is copied into.
    fn write_images(&self, images: &mut Vec<u8>, out: &mut [Column]) {
        for (r, o) in self.roles.iter().zip(out.iter_mut()) {
            if let (Role::Image, Column::U8 { data, .. }) = (r, o) {
                if data.len() == images.len() {
                    std::mem::swap(data, images);
                } else {
                    data[..images.len()].copy_from_slice(images);
                }
            }
        }
    }

    /// Writes one batch's classes into the label buffer, as the label column holds them.
    fn write_labels(&self, labels: &[i32], out: &mut [Column]) {
        for (r, o) in self.roles.iter().zip(out.iter_mut()) {
            match (r, o) {
                (Role::Label(_), Column::I32 { data, .. }) => {
                    data[..labels.len()].copy_from_slice(labels)
                }
                (Role::Label(_), Column::F32 { data, .. }) => {
                    for (d, &l) in data.iter_mut().zip(labels) {
                        *d = l as f32;
                    }
                }
                _ => {}
            }
        }
    }
}

/// Every file's header and length, read with `threads` threads; in the files' order.
fn probe_all(
    files: &[(PathBuf, i32)],
    max_pixels: u64,
    threads: usize,
) -> Vec<std::result::Result<(ImageHeader, u64), String>> {
    let chunk = files.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|(p, _)| probe_file(p, max_pixels))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// A file's header (its first 64 KiB, or all of it when a JPEG's headers run longer) and its
/// length; an error when it is not the image its extension names.
fn probe_file(path: &Path, max_pixels: u64) -> std::result::Result<(ImageHeader, u64), String> {
    let read = |limit: Option<u64>| -> std::result::Result<(Vec<u8>, u64), String> {
        let f = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
        let len = f
            .metadata()
            .map_err(|e| format!("cannot read it: {e}"))?
            .len();
        let mut buf = Vec::new();
        f.take(limit.unwrap_or(len))
            .read_to_end(&mut buf)
            .map_err(|e| format!("cannot read it: {e}"))?;
        Ok((buf, len))
    };
    let (head, len) = read(Some(PROBE_PREFIX))?;
    let expected = ImageFormat::from_extension(path).ok_or("not a .png, .jpg or .jpeg file")?;
    let header = match catch_probe_panic(|| probe(&head, max_pixels)) {
        Err(_) if len > head.len() as u64 => {
            let (all, _) = read(None)?;
            catch_probe_panic(|| probe(&all, max_pixels))?
        }
        r => r?,
    };
    if header.format != expected {
        return Err(format!(
            "its name says {} but it holds a {} image",
            expected.name(),
            header.format.name()
        ));
    }
    Ok((header, len))
}

fn catch_probe_panic(
    f: impl FnOnce() -> std::result::Result<ImageHeader, String>,
) -> std::result::Result<ImageHeader, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err("the image decoder panicked on its header".to_string()))
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.core.files.len()
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, indices: &[usize], out: &mut [Column]) -> Result<()> {
        self.check_buffers(indices, out)?;
        let taken = {
            let pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            pool.as_ref().and_then(|p| p.take(indices))
        };
        let Some(filled) = taken else {
            // Not the announced next batch (or no workers): decode it here, into `out`.
            self.core.synchronous.fetch_add(1, Ordering::Relaxed);
            let mut labels = vec![0i32; indices.len()];
            let mut s = self.sync_scratch.lock().unwrap_or_else(|e| e.into_inner());
            let s = s.get_or_insert_with(|| self.core.new_scratch());
            let n = indices.len() * self.core.shape.bytes();
            let images = self
                .roles
                .iter()
                .zip(out.iter_mut())
                .find_map(|(r, o)| match (r, o) {
                    (Role::Image, Column::U8 { data, .. }) => Some(&mut data[..n]),
                    _ => None,
                })
                .ok_or_else(|| RuntimeError::Input("no image buffer".to_string()))?;
            self.core
                .fill_into(s, indices, images, &mut labels)
                .map_err(RuntimeError::Input)?;
            self.write_labels(&labels, out);
            return Ok(());
        };
        let mut filled = filled.map_err(RuntimeError::Input)?;
        self.write_images(&mut filled.images, out);
        self.write_labels(&filled.labels, out);
        if let Some(p) = self.pool.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            p.give_back(filled);
        }
        Ok(())
    }

    fn will_gather(&self, upcoming: &[usize], batch: usize) {
        if self.workers == 0 || batch == 0 {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.is_none() {
            *pool = Pool::start(Arc::clone(&self.core), self.workers, self.prefetch);
        }
        if let Some(p) = pool.as_ref() {
            p.announce(upcoming.chunks(batch).map(Arc::from).collect());
        }
    }

    fn prefetch_bytes(&self, batch: usize) -> u64 {
        self.prefetch_plan(batch).total()
    }
}
