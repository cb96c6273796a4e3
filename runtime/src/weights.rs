//! Weights and training checkpoints on disk: safetensors, written atomically, checked on load.
//!
//! Two kinds of file, both plain [safetensors](https://github.com/huggingface/safetensors):
//!
//! - **weights** ([`Executor::save_weights`] / [`Executor::load_weights`]): one little-endian
//!   f32 tensor per parameter, named as the plan names it (`hidden.weight`, `hidden.bias`,
//!   `bn.running_mean` …), shaped as the plan shapes it (Keras layout: dense `[in, out]`, conv
//!   `[kh, kw, c_in, c_out]`; `docs/WEIGHTS.md` gives the PyTorch transposes).
//! - **checkpoints** ([`Executor::save_checkpoint`] / [`Executor::load_checkpoint`]): the
//!   weights, plus every optimizer state slot of every updated parameter as `<name>.opt0`,
//!   `<name>.opt1` …, plus the seed, the step counter, the optimizer's update count and the
//!   loss-scaler state in `__metadata__`: what a run needs to resume bit-exactly.
//!
//! The GPU executor writes and reads the same files through [`crate::Engine`]: its persistent
//! region is copied to the host to save and back to the device to load, so a checkpoint
//! moves between the CPU and a GPU.
//!
//! Saving writes a temporary file beside the target, fsyncs it, renames it over the target and
//! fsyncs the directory, so the target is always either the old complete file or the new one.
//! Loading checks the whole file (header, checksum, every name, shape and dtype, and the
//! metadata a checkpoint needs) before it writes a single byte of the model, and says exactly
//! what did not match; a failed load leaves the model as it was.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memwise_kernels::optimizer::LossScaler;
use memwise_plan::data_parallel::Sharding;
use memwise_plan::liveness::align_up;
use memwise_plan::{StaticPlan, NO_OFFSET};
use safetensors::tensor::{Metadata, TensorInfo, TensorView};
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::error::{Result, RuntimeError};
use crate::kernels::Kernels;
use crate::walk::PlanExecutor;

/// The memwise file-format version this build writes (`memwise.format_version`) and the
/// newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// Metadata keys (all values are strings, as safetensors requires).
pub mod keys {
    /// `"1"`: the memwise format version.
    pub const FORMAT_VERSION: &str = "memwise.format_version";
    /// `"weights"` or `"checkpoint"`.
    pub const KIND: &str = "memwise.kind";
    /// The plan's model name (`MnistMlp` …).
    pub const MODEL: &str = "memwise.model";
    /// `"keras"`: dense `[in, out]`, conv `[kh, kw, c_in, c_out]`.
    pub const LAYOUT: &str = "memwise.layout";
    /// `fnv1a64:<16 hex digits>` over every tensor (see [`checksum`](super::checksum)).
    pub const CHECKSUM: &str = "memwise.checksum";
    /// Checkpoints: the optimizer's name (`adam` …).
    pub const OPTIMIZER: &str = "memwise.optimizer";
    /// Checkpoints: state slots per updated parameter.
    pub const OPTIMIZER_SLOTS: &str = "memwise.optimizer_slots";
    /// Checkpoints: the executor's seed (decimal u64), which keys dropout and sampling.
    pub const SEED: &str = "memwise.seed";
    /// Checkpoints: training steps run (decimal u64).
    pub const STEP: &str = "memwise.step";
    /// Checkpoints: optimizer updates applied (decimal u64; Adam's bias correction).
    pub const UPDATES: &str = "memwise.updates";
    /// Checkpoints: `"true"` when the model uses dynamic loss scaling.
    pub const LOSS_SCALING: &str = "memwise.loss_scaling";
    /// Checkpoints: the loss scale's f32 bits (`0x47000000`); `memwise.loss_scale_value` is the
    /// same number in decimal, for people.
    pub const LOSS_SCALE: &str = "memwise.loss_scale";
    pub const LOSS_SCALE_VALUE: &str = "memwise.loss_scale_value";
    pub const LOSS_SCALE_GROWTH_INTERVAL: &str = "memwise.loss_scale_growth_interval";
    /// f32 bits, as `LOSS_SCALE`.
    pub const LOSS_SCALE_GROWTH: &str = "memwise.loss_scale_growth";
    /// f32 bits, as `LOSS_SCALE`.
    pub const LOSS_SCALE_BACKOFF: &str = "memwise.loss_scale_backoff";
    pub const LOSS_SCALE_GOOD_STEPS: &str = "memwise.loss_scale_good_steps";
    pub const LOSS_SCALE_SKIPPED_IN_A_ROW: &str = "memwise.loss_scale_skipped_in_a_row";
    /// Checkpoints of a ZeRO stage-1 replica: `"r/N"`, the replica whose shard of the
    /// optimizer state the file holds, of how many.
    pub const ZERO_SHARD: &str = "memwise.zero_shard";
}

/// At most this many mismatch lines in one error (the count of the rest follows).
const MAX_PROBLEM_LINES: usize = 24;

/// What a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Weights,
    Checkpoint,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::Checkpoint => "checkpoint",
        }
    }
}

/// One tensor to write: name, shape and its little-endian bytes.
struct Entry<'a> {
    name: String,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

/// FNV-1a, 64-bit.
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The checksum memwise writes in `memwise.checksum`: FNV-1a 64 over, for every tensor in
/// byte order of its name, the name's UTF-8 bytes, a 0 byte, the dtype's safetensors name
/// (`F32`), a 0 byte, each dimension as a little-endian u64, then the tensor's data bytes.
pub fn checksum<'a>(
    tensors: impl IntoIterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
) -> u64 {
    let mut all: Vec<_> = tensors.into_iter().collect();
    all.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (name, dtype, shape, data) in all {
        h = fnv1a(h, name.as_bytes());
        h = fnv1a(h, &[0]);
        h = fnv1a(h, dtype.to_string().as_bytes());
        h = fnv1a(h, &[0]);
        for &d in shape {
            h = fnv1a(h, &(d as u64).to_le_bytes());
        }
        h = fnv1a(h, data);
    }
    h
}

fn format_checksum(h: u64) -> String {
    format!("fnv1a64:{h:016x}")
}

/// f32 values as little-endian bytes (borrowed on little-endian hosts).
fn le_bytes(bytes: &[u8]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytes)
    } else {
        Cow::Owned(
            bytes
                .chunks_exact(4)
                .flat_map(|c| [c[3], c[2], c[1], c[0]])
                .collect(),
        )
    }
}

/// Copies little-endian f32 bytes `src` into host-order f32 bytes `dst` (same length).
fn copy_le_f32(src: &[u8], dst: &mut [u8]) {
    if cfg!(target_endian = "little") {
        dst.copy_from_slice(src);
    } else {
        for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            d.copy_from_slice(&[s[3], s[2], s[1], s[0]]);
        }
    }
}

fn shape_str(shape: &[usize]) -> String {
    format!("{shape:?}")
}

fn f32_bits(x: f32) -> String {
    format!("{:#010x}", x.to_bits())
}

/// Distinguishes temporary files of concurrent saves in one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `header` then every entry's data to `path` atomically: a temporary file in the same
/// directory (`.NAME.tmp-PID-N`), fsync, rename over `path`, fsync the directory. On error the
/// temporary file is removed and `path` is untouched.
fn write_atomic(path: &Path, what: &str, header: &[u8], entries: &[Entry<'_>]) -> Result<()> {
    let fail = |step: &str, e: std::io::Error| {
        RuntimeError::Io(format!(
            "cannot save {what} to `{}`: {step}: {e}",
            path.display()
        ))
    };
    let file_name = path.file_name().ok_or_else(|| {
        RuntimeError::Io(format!(
            "cannot save {what} to `{}`: not a file name",
            path.display()
        ))
    })?;
    let dir: PathBuf = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    remove_stale_temporaries(&dir, &file_name.to_string_lossy());
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{n}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| -> std::result::Result<(), (&'static str, std::io::Error)> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| ("creating the temporary file", e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(header).map_err(|e| ("writing", e))?;
        for e in entries {
            w.write_all(&e.data).map_err(|e| ("writing", e))?;
        }
        let file = w.into_inner().map_err(|e| ("writing", e.into_error()))?;
        file.sync_all()
            .map_err(|e| ("fsync of the temporary file", e))?;
        Ok(())
    })();
    if let Err((step, e)) = written {
        let _ = fs::remove_file(&tmp);
        return Err(fail(step, e));
    }
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(fail("renaming the temporary file over it", e));
    }
    sync_dir(&dir).map_err(|e| fail("fsync of the directory", e))
}

/// Removes the temporary files (`.NAME.tmp-PID-N`) that saves to `dir/NAME` left behind in
/// processes that no longer run — killed mid-save; a finished or failed save removes its
/// own. A temporary of a running process (another save under way) is left alone. Where
/// processes cannot be looked up (no `/proc`), nothing is removed.
fn remove_stale_temporaries(dir: &Path, name: &str) {
    let proc_fs = Path::new("/proc/self");
    if !proc_fs.exists() {
        return;
    }
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let running = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !running {
            let _ = fs::remove_file(entry.path());
        }
    }
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    // Windows cannot open a directory as a file; the rename itself is durable there.
    Ok(())
}

/// Sorts `entries` by name, and returns the safetensors header (8-byte length, JSON padded
/// to a multiple of 8) with `meta` plus the checksum.
fn encode_header(entries: &mut [Entry<'_>], mut meta: BTreeMap<String, String>) -> Result<Vec<u8>> {
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let sum = checksum(
        entries
            .iter()
            .map(|e| (e.name.as_str(), Dtype::F32, &e.shape[..], &e.data[..])),
    );
    meta.insert(keys::CHECKSUM.into(), format_checksum(sum));
    let fail = |e: String| RuntimeError::Io(format!("cannot build the safetensors header: {e}"));
    let quote = |s: &str| serde_json::to_string(s).map_err(|e| fail(e.to_string()));
    // The JSON by hand, so the bytes are deterministic: `__metadata__` first with its keys
    // sorted, then the tensors in data order (as the safetensors crate writes them).
    let mut json = String::from("{\"__metadata__\":{");
    for (k, (key, value)) in meta.iter().enumerate() {
        if k > 0 {
            json.push(',');
        }
        json.push_str(&quote(key)?);
        json.push(':');
        json.push_str(&quote(value)?);
    }
    json.push('}');
    let mut at = 0usize;
    let mut infos = Vec::with_capacity(entries.len());
    for e in entries.iter() {
        let end = at + e.data.len();
        let dims: Vec<String> = e.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ",{}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{at},{end}]}}",
            quote(&e.name)?,
            dims.join(",")
        ));
        infos.push((
            e.name.clone(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: e.shape.clone(),
                data_offsets: (at, end),
            },
        ));
        at = end;
    }
    json.push('}');
    // The same checks the safetensors crate makes on its own headers (offsets, sizes).
    Metadata::new(None, infos).map_err(|e| fail(e.to_string()))?;
    let mut json = json.into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = Vec::with_capacity(8 + json.len());
    header.extend_from_slice(&(json.len() as u64).to_le_bytes());
    header.extend_from_slice(&json);
    Ok(header)
}

/// A parsed file: its tensors and its `__metadata__`.
struct Parsed<'a> {
    tensors: Vec<(String, TensorView<'a>)>,
    meta: HashMap<String, String>,
}

/// Parses `bytes` as safetensors, turning every failure into a sentence about the file.
fn parse<'a>(bytes: &'a [u8], label: &str) -> Result<Parsed<'a>> {
    let err = |m: String| RuntimeError::Io(format!("{label}: {m}"));
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(err(format!(
            "the file is {} bytes, shorter than the 8-byte header length of a safetensors file (truncated, or not safetensors)",
            bytes.len()
        )));
    };
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(n8);
    let available = (bytes.len() - 8) as u64;
    if n > available {
        return Err(err(format!(
            "truncated or not safetensors: the header length field says {n} bytes of JSON but only {available} bytes follow"
        )));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        err(match e {
            SafeTensorError::MetadataIncompleteBuffer => {
                let data = available - n;
                match declared_data_len(bytes, n as usize) {
                    Some(d) if d > data => format!(
                        "truncated: the header describes {d} bytes of tensor data but the file holds {data}"
                    ),
                    Some(d) => format!(
                        "the header describes {d} bytes of tensor data but the file holds {data} (trailing bytes)"
                    ),
                    None => format!("the header's tensors do not cover the file's {data} data bytes exactly"),
                }
            }
            SafeTensorError::InvalidHeader(e) => format!("corrupt header: not UTF-8 ({e})"),
            SafeTensorError::InvalidHeaderDeserialization(e) => format!("corrupt header: not the JSON safetensors expects ({e})"),
            SafeTensorError::HeaderTooLarge => format!("corrupt header: its length field says {n} bytes (over safetensors' 100 MB limit)"),
            SafeTensorError::InvalidOffset(name) => {
                format!("corrupt header: the data offsets of tensor `{name}` overlap, leave gaps, or run backwards")
            }
            SafeTensorError::TensorInvalidInfo => {
                "corrupt header: a tensor's data offsets do not match its shape and dtype".to_string()
            }
            SafeTensorError::ValidationOverflow => "corrupt header: a tensor's shape overflows".to_string(),
            other => format!("not a valid safetensors file: {other}"),
        })
    })?;
    // `deserialize` has just read this header; reading it again cannot fail differently.
    let meta = SafeTensors::read_metadata(bytes)
        .map_err(|e| err(format!("corrupt header: {e}")))?
        .1
        .metadata()
        .clone()
        .unwrap_or_default();
    Ok(Parsed {
        tensors: st.tensors(),
        meta,
    })
}

/// The largest `data_offsets` end in the header, when the header parses as JSON.
fn declared_data_len(bytes: &[u8], n: usize) -> Option<u64> {
    let json: serde_json::Value = serde_json::from_slice(bytes.get(8..8 + n)?).ok()?;
    json.as_object()?
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .or(Some(0))
}

/// One tensor the model expects: its name, shape, and where its f32 values go.
struct Slot {
    name: String,
    shape: Vec<usize>,
    offset: u64,
}

/// The checked file: every expected tensor's bytes, in `Slot` order, and the metadata.
struct Checked<'a> {
    data: Vec<&'a [u8]>,
    meta: HashMap<String, String>,
}

/// If `name` is `<param>.opt<k>` for one of `params`, the optimizer-state slot of a
/// checkpoint (which `load_weights` skips).
fn is_opt_state(name: &str, params: &BTreeSet<&str>) -> bool {
    match name.rsplit_once(".opt") {
        Some((p, k)) => {
            !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) && params.contains(p)
        }
        None => false,
    }
}

/// A hint when a shape is the PyTorch layout of the expected Keras one.
fn layout_hint(file: &[usize], model: &[usize]) -> &'static str {
    match (file, model) {
        ([a, b], [c, d]) if a == d && b == c && a != b => {
            " (PyTorch's nn.Linear [out, in] layout? transpose it: docs/WEIGHTS.md)"
        }
        ([o, i, h, w], [kh, kw, ci, co]) if o == co && i == ci && h == kh && w == kw && file != model => {
            " (PyTorch's Conv2d [c_out, c_in, kh, kw] layout? permute it to [kh, kw, c_in, c_out]: docs/WEIGHTS.md)"
        }
        _ => "",
    }
}

/// What weights and checkpoints are read from and written to: an executor's plan, its
/// persistent region (parameters, 16-bit copies, gradients, optimizer state) as host bytes,
/// and the counters a checkpoint restores. The CPU [`Executor`] lends its region; the GPU
/// executor copies its region from and to the device.
pub(crate) trait PersistentState {
    fn state_plan(&self) -> &StaticPlan;
    /// The whole persistent region (`plan.persistent_bytes`), as host bytes.
    fn persistent_image(&self) -> Result<Cow<'_, [u8]>>;
    /// Runs `write` on the persistent region's bytes; when it returns `Ok`, refreshes the
    /// 16-bit copies of the parameters and keeps the result. `write` checks everything before
    /// it changes a byte, so an `Err` leaves the model as it was.
    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()>;
    fn counters(&self) -> TrainingCounters;
    fn set_counters(&mut self, c: TrainingCounters);
    /// This engine's data-parallel replica index, once it has one.
    fn replica_rank(&self) -> Option<usize>;
}

/// What a checkpoint restores besides tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TrainingCounters {
    /// The executor's seed (keys dropout and sampling).
    pub seed: u64,
    /// Training steps run.
    pub step: u64,
    /// Optimizer updates applied (Adam's bias correction).
    pub updates: u64,
    pub scaler: LossScaler,
}

/// Writes every parameter's f32 values to `path` (see [`Executor::save_weights`]).
pub(crate) fn save_weights<M: PersistentState + ?Sized>(m: &M, path: &Path) -> Result<()> {
    let image = m.persistent_image()?;
    let mut entries = weight_entries(m.state_plan(), &image)?;
    let header = encode_header(&mut entries, base_metadata(m.state_plan(), Kind::Weights))?;
    write_atomic(path, "weights", &header, &entries)
}

/// The bytes [`save_weights`] would write.
pub(crate) fn weights_to_bytes<M: PersistentState + ?Sized>(m: &M) -> Result<Vec<u8>> {
    let image = m.persistent_image()?;
    let mut entries = weight_entries(m.state_plan(), &image)?;
    let header = encode_header(&mut entries, base_metadata(m.state_plan(), Kind::Weights))?;
    Ok(concat(header, &entries))
}

/// Reads weights from `path` (see [`Executor::load_weights`]).
pub(crate) fn load_weights<M: PersistentState + ?Sized>(m: &mut M, path: &Path) -> Result<()> {
    let bytes = read_file(path, "weights")?;
    load_weights_labelled(m, &bytes, &format!("weights `{}`", path.display()))
}

/// Writes a training checkpoint to `path` (see [`Executor::save_checkpoint`]).
pub(crate) fn save_checkpoint<M: PersistentState + ?Sized>(m: &M, path: &Path) -> Result<()> {
    let shard = state_shard(m.state_plan(), m.replica_rank(), "saving a checkpoint")?;
    let image = m.persistent_image()?;
    let (mut entries, meta) = checkpoint_parts(m.state_plan(), &image, m.counters(), shard)?;
    let header = encode_header(&mut entries, meta)?;
    write_atomic(path, "checkpoint", &header, &entries)
}

/// The bytes [`save_checkpoint`] would write.
pub(crate) fn checkpoint_to_bytes<M: PersistentState + ?Sized>(m: &M) -> Result<Vec<u8>> {
    let shard = state_shard(m.state_plan(), m.replica_rank(), "saving a checkpoint")?;
    let image = m.persistent_image()?;
    let (mut entries, meta) = checkpoint_parts(m.state_plan(), &image, m.counters(), shard)?;
    let header = encode_header(&mut entries, meta)?;
    Ok(concat(header, &entries))
}

/// Restores a checkpoint from `path` (see [`Executor::load_checkpoint`]).
pub(crate) fn load_checkpoint<M: PersistentState + ?Sized>(m: &mut M, path: &Path) -> Result<()> {
    let bytes = read_file(path, "checkpoint")?;
    load_checkpoint_labelled(m, &bytes, &format!("checkpoint `{}`", path.display()))
}

impl<K: Kernels> PlanExecutor<K> {
    /// Writes every parameter's f32 values (batch-norm statistics included) to `path` as
    /// safetensors, atomically (see the module docs). Names are the plan's (`hidden.weight`),
    /// shapes the plan's Keras layout.
    pub fn save_weights(&self, path: impl AsRef<Path>) -> Result<()> {
        save_weights(self, path.as_ref())
    }

    /// The bytes [`save_weights`](Self::save_weights) would write.
    pub fn weights_to_bytes(&self) -> Result<Vec<u8>> {
        weights_to_bytes(self)
    }

    /// Reads a safetensors file of this model's parameters (one written by
    /// [`save_weights`](Self::save_weights), by [`save_checkpoint`](Self::save_checkpoint), or
    /// by anyone with the same names, shapes and f32 dtype) into the model. Every name, shape
    /// and dtype is checked before anything is written: on error the weights are untouched and
    /// the error lists each missing name, unexpected name, wrong shape and wrong dtype.
    /// Optimizer state and counters are left as they are.
    pub fn load_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        load_weights(self, path.as_ref())
    }

    /// [`load_weights`](Self::load_weights) from bytes in memory (a fuzzing entry point: any
    /// input gives `Ok` or an error, never a panic).
    pub fn load_weights_from_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        load_weights_labelled(self, bytes, "weights (in memory)")
    }

    /// Writes a training checkpoint to `path`, atomically: the weights, every optimizer state
    /// slot (`<name>.opt0`, `<name>.opt1` …), and in the metadata the seed, the step counter,
    /// the optimizer update count and the loss-scaler state. Loading it into a fresh executor
    /// of the same model and training on gives bit-identical results to never stopping.
    pub fn save_checkpoint(&self, path: impl AsRef<Path>) -> Result<()> {
        save_checkpoint(self, path.as_ref())
    }

    /// The bytes [`save_checkpoint`](Self::save_checkpoint) would write.
    pub fn checkpoint_to_bytes(&self) -> Result<Vec<u8>> {
        checkpoint_to_bytes(self)
    }

    /// Restores a checkpoint written by [`save_checkpoint`](Self::save_checkpoint) for this
    /// model: weights, optimizer state, seed, step counter, update count and loss scaler. The
    /// whole file is checked first (names, shapes, dtypes, checksum, the optimizer and every
    /// metadata value); on error nothing in the executor changes.
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<()> {
        load_checkpoint(self, path.as_ref())
    }

    /// [`load_checkpoint`](Self::load_checkpoint) from bytes in memory (a fuzzing entry point).
    pub fn load_checkpoint_from_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        load_checkpoint_labelled(self, bytes, "checkpoint (in memory)")
    }
}

impl<K: Kernels> PersistentState for PlanExecutor<K> {
    fn state_plan(&self) -> &StaticPlan {
        self.plan()
    }

    fn persistent_image(&self) -> Result<Cow<'_, [u8]>> {
        self.k.persistent_image()
    }

    fn write_persistent(&mut self, write: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        self.k.write_persistent(write)
    }

    fn counters(&self) -> TrainingCounters {
        TrainingCounters {
            seed: self.seed,
            step: self.step_counter,
            updates: self.updates,
            scaler: self.scaler,
        }
    }

    fn replica_rank(&self) -> Option<usize> {
        self.collective().map(|c| c.rank())
    }

    fn set_counters(&mut self, c: TrainingCounters) {
        self.seed = c.seed;
        self.step_counter = c.step;
        self.updates = c.updates;
        self.scaler = c.scaler;
    }
}

// ---- saving ----

fn base_metadata(plan: &StaticPlan, kind: Kind) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(keys::FORMAT_VERSION.into(), FORMAT_VERSION.to_string());
    m.insert(keys::KIND.into(), kind.name().into());
    m.insert(keys::MODEL.into(), plan.model.to_string());
    m.insert(keys::LAYOUT.into(), "keras".into());
    m
}

/// The bytes of `elems` f32 values at `offset` of the persistent region `region`.
fn region_f32<'a>(region: &'a [u8], offset: u64, elems: usize, name: &str) -> Result<&'a [u8]> {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    start
        .checked_add(elems * 4)
        .and_then(|end| region.get(start..end))
        .ok_or_else(|| {
            RuntimeError::Memory(format!(
                "`{name}`: {elems} f32 at offset {offset} lie outside the persistent region"
            ))
        })
}

fn weight_entries<'a>(plan: &StaticPlan, region: &'a [u8]) -> Result<Vec<Entry<'a>>> {
    plan.params
        .iter()
        .map(|p| {
            Ok(Entry {
                name: p.name.to_string(),
                shape: p.shape.to_vec(),
                data: le_bytes(region_f32(region, p.offset, p.elems(), &p.name)?),
            })
        })
        .collect()
}

/// Under ZeRO stage 1 with more than one replica, the replica (`rank`) whose shard of the
/// optimizer state this engine holds, or why it cannot say; `None` for an unsharded plan.
fn state_shard(plan: &StaticPlan, rank: Option<usize>, what: &str) -> Result<Option<usize>> {
    if plan.replicas <= 1 || plan.sharding == Sharding::Replicated {
        return Ok(None);
    }
    rank.map(Some).ok_or_else(|| {
        RuntimeError::Input(format!(
            "{what}: the plan shards the optimizer state over {} replicas (ZeRO stage 1), and \
             each replica's checkpoint holds its own shard: join the job first \
             (`set_data_parallel`), then save or load each rank's own file",
            plan.replicas
        ))
    })
}

/// Weights and optimizer-state slots: where each goes in the persistent region. Under ZeRO
/// stage 1 (`shard`: this replica's rank) a state slot is the replica's shard of it.
fn checkpoint_slots(plan: &StaticPlan, shard: Option<usize>) -> Vec<Slot> {
    let mut v: Vec<Slot> = plan
        .params
        .iter()
        .map(|p| Slot {
            name: p.name.to_string(),
            shape: p.shape.to_vec(),
            offset: p.offset,
        })
        .collect();
    let slots = plan.optimizer.state_slots();
    for p in plan.params.iter().filter(|p| p.state_offset != NO_OFFSET) {
        let stride = align_up(plan.state_elems(p) as u64 * 4, plan.alignment);
        let shape = match shard {
            Some(rank) => vec![plan.shard(p, rank).len()],
            None => p.shape.to_vec(),
        };
        for k in 0..slots {
            v.push(Slot {
                name: format!("{}.opt{k}", p.name),
                shape: shape.clone(),
                offset: p.state_offset + k * stride,
            });
        }
    }
    v
}

/// A checkpoint's shard (its `memwise.zero_shard`) against this engine's: one replica's
/// shard of the optimizer state fits that replica alone.
fn check_shard(
    plan: &StaticPlan,
    meta: &HashMap<String, String>,
    shard: Option<usize>,
    label: &str,
) -> Result<()> {
    let file = meta.get(keys::ZERO_SHARD).map(String::as_str);
    let mine = shard.map(|r| format!("{r}/{}", plan.replicas));
    if file == mine.as_deref() {
        return Ok(());
    }
    let whose = |s: Option<&str>| match s {
        Some(s) => format!("replica {s}'s shard of the optimizer state (ZeRO stage 1)"),
        None => "the whole optimizer state".to_string(),
    };
    Err(RuntimeError::Io(format!(
        "{label}: the checkpoint holds {}, this engine keeps {}: load each rank's own file",
        whose(file),
        whose(mine.as_deref())
    )))
}

fn checkpoint_parts<'a>(
    plan: &StaticPlan,
    region: &'a [u8],
    c: TrainingCounters,
    shard: Option<usize>,
) -> Result<(Vec<Entry<'a>>, BTreeMap<String, String>)> {
    let entries = checkpoint_slots(plan, shard)
        .into_iter()
        .map(|s| {
            let elems = s.shape.iter().product();
            let data = le_bytes(region_f32(region, s.offset, elems, &s.name)?);
            Ok(Entry {
                name: s.name,
                shape: s.shape,
                data,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut m = base_metadata(plan, Kind::Checkpoint);
    let sc = &c.scaler;
    let mut put = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    put(keys::OPTIMIZER, plan.optimizer.name().into());
    put(
        keys::OPTIMIZER_SLOTS,
        plan.optimizer.state_slots().to_string(),
    );
    if let Some(rank) = shard {
        put(keys::ZERO_SHARD, format!("{rank}/{}", plan.replicas));
    }
    put(keys::SEED, c.seed.to_string());
    put(keys::STEP, c.step.to_string());
    put(keys::UPDATES, c.updates.to_string());
    put(keys::LOSS_SCALING, plan.loss_scaling.to_string());
    put(keys::LOSS_SCALE, f32_bits(sc.scale));
    put(keys::LOSS_SCALE_VALUE, sc.scale.to_string());
    put(
        keys::LOSS_SCALE_GROWTH_INTERVAL,
        sc.growth_interval.to_string(),
    );
    put(keys::LOSS_SCALE_GROWTH, f32_bits(sc.growth));
    put(keys::LOSS_SCALE_BACKOFF, f32_bits(sc.backoff));
    put(keys::LOSS_SCALE_GOOD_STEPS, sc.good_steps.to_string());
    put(
        keys::LOSS_SCALE_SKIPPED_IN_A_ROW,
        sc.skipped_in_a_row.to_string(),
    );
    Ok((entries, m))
}

// ---- loading ----

fn load_weights_labelled<M: PersistentState + ?Sized>(
    m: &mut M,
    bytes: &[u8],
    label: &str,
) -> Result<()> {
    let file = parse(bytes, label)?;
    let plan = m.state_plan();
    let slots: Vec<Slot> = plan
        .params
        .iter()
        .map(|p| Slot {
            name: p.name.to_string(),
            shape: p.shape.to_vec(),
            offset: p.offset,
        })
        .collect();
    let params: BTreeSet<&str> = plan.params.iter().map(|p| p.name.as_ref()).collect();
    let checked = check(
        plan,
        file,
        label,
        &slots,
        &|n| is_opt_state(n, &params),
        None,
    )?;
    write_slots(m, &slots, &checked.data)
}

pub(crate) fn load_checkpoint_labelled<M: PersistentState + ?Sized>(
    m: &mut M,
    bytes: &[u8],
    label: &str,
) -> Result<()> {
    let file = parse(bytes, label)?;
    let plan = m.state_plan();
    let shard = state_shard(plan, m.replica_rank(), label)?;
    check_shard(plan, &file.meta, shard, label)?;
    let slots = checkpoint_slots(plan, shard);
    let checked = check(
        plan,
        file,
        label,
        &slots,
        &|_| false,
        Some(Kind::Checkpoint),
    )?;
    let state = checkpoint_state(plan, &checked.meta, label)?;
    write_slots(m, &slots, &checked.data)?;
    m.set_counters(state);
    Ok(())
}

/// Checks the file against `slots` (and, for a checkpoint, its kind, model and optimizer):
/// returns each slot's bytes, or one error listing every problem.
fn check<'a>(
    plan: &StaticPlan,
    file: Parsed<'a>,
    label: &str,
    slots: &[Slot],
    ignore: &dyn Fn(&str) -> bool,
    need: Option<Kind>,
) -> Result<Checked<'a>> {
    let err = |m: String| RuntimeError::Io(format!("{label}: {m}"));
    let Parsed { tensors, meta } = file;
    // Format version.
    if let Some(v) = meta.get(keys::FORMAT_VERSION) {
        match v.parse::<u32>() {
            Ok(v) if v <= FORMAT_VERSION => {}
            Ok(v) => {
                return Err(err(format!(
                    "written in memwise format version {v}; this build reads versions up to {FORMAT_VERSION}"
                )))
            }
            Err(_) => return Err(err(format!("corrupt metadata: `{}` is `{v}`, not a version number", keys::FORMAT_VERSION))),
        }
    }
    // Checksum of everything in the file.
    if let Some(want) = meta.get(keys::CHECKSUM) {
        let got = format_checksum(checksum(
            tensors
                .iter()
                .map(|(n, t)| (n.as_str(), t.dtype(), t.shape(), t.data())),
        ));
        if *want != got {
            return Err(err(format!(
                "checksum mismatch: the metadata says {want}, the tensors hash to {got} — the file was damaged or edited after memwise wrote it (drop `{}` from the metadata if you edited it on purpose)",
                keys::CHECKSUM
            )));
        }
    }
    let model = &plan.model;
    let file_model = meta.get(keys::MODEL);
    let from = match file_model {
        Some(m) if m != model.as_ref() => {
            format!(" (the file was saved from model `{m}`, this is `{model}`)")
        }
        _ => String::new(),
    };
    if let Some(kind) = need {
        match meta.get(keys::KIND).map(String::as_str) {
            Some(k) if k == kind.name() => {}
            Some(k) => {
                return Err(err(format!(
                    "is a memwise {k} file, not a training {}{from}; load_weights reads the weights of either",
                    kind.name()
                )))
            }
            None => {
                return Err(err(format!(
                    "has no `{}` metadata: not a memwise training checkpoint{from}",
                    keys::KIND
                )))
            }
        }
        let opt = plan.optimizer.name();
        if let Some(o) = meta.get(keys::OPTIMIZER) {
            if o != opt {
                return Err(err(format!(
                    "the checkpoint's optimizer is `{o}`, this model trains with `{opt}`: its state cannot be resumed (load_weights reads just the weights){from}"
                )));
            }
        }
        let slots = plan.optimizer.state_slots();
        if let Some(k) = meta.get(keys::OPTIMIZER_SLOTS) {
            if *k != slots.to_string() {
                return Err(err(format!(
                    "the checkpoint holds {k} optimizer state slots per parameter, this model's `{opt}` keeps {slots} (momentum or centering changed?): its state cannot be resumed (load_weights reads just the weights)"
                )));
            }
        }
    }
    // Names, shapes, dtypes.
    let by_name: HashMap<&str, &TensorView<'a>> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let wanted: BTreeSet<&str> = slots.iter().map(|s| s.name.as_str()).collect();
    let mut missing = Vec::new();
    let mut wrong = Vec::new();
    let mut data = Vec::with_capacity(slots.len());
    for s in slots {
        match by_name.get(s.name.as_str()) {
            None => missing.push(format!("missing: `{}` {} F32", s.name, shape_str(&s.shape))),
            Some(t) => {
                let mut bad = false;
                if t.shape() != &s.shape[..] {
                    wrong.push(format!(
                        "shape: `{}` is {} in the file, the model has {}{}",
                        s.name,
                        shape_str(t.shape()),
                        shape_str(&s.shape),
                        layout_hint(t.shape(), &s.shape)
                    ));
                    bad = true;
                }
                if t.dtype() != Dtype::F32 {
                    wrong.push(format!(
                        "dtype: `{}` is {} in the file, the model stores F32 (convert it to float32 before saving)",
                        s.name,
                        t.dtype()
                    ));
                    bad = true;
                }
                if !bad {
                    data.push(t.data());
                }
            }
        }
    }
    let mut unexpected: Vec<String> = tensors
        .iter()
        .filter(|(n, _)| !wanted.contains(n.as_str()) && !ignore(n))
        .map(|(n, t)| format!("unexpected: `{n}` {} {}", shape_str(t.shape()), t.dtype()))
        .collect();
    unexpected.sort();
    let problems: Vec<String> = missing.into_iter().chain(unexpected).chain(wrong).collect();
    if !problems.is_empty() {
        let n = problems.len();
        let mut lines: Vec<String> = problems
            .into_iter()
            .take(MAX_PROBLEM_LINES)
            .map(|l| format!("  {l}"))
            .collect();
        if n > MAX_PROBLEM_LINES {
            lines.push(format!("  … and {} more", n - MAX_PROBLEM_LINES));
        }
        return Err(err(format!(
            "does not match model `{model}`{from}: {n} problem{}; the model was not changed\n{}",
            if n == 1 { "" } else { "s" },
            lines.join("\n")
        )));
    }
    Ok(Checked { data, meta })
}

/// Parses a checkpoint's counters and loss-scaler state.
fn checkpoint_state(
    plan: &StaticPlan,
    meta: &HashMap<String, String>,
    label: &str,
) -> Result<TrainingCounters> {
    let get = |k: &str| -> Result<&str> {
        meta.get(k).map(String::as_str).ok_or_else(|| {
            RuntimeError::Io(format!(
                "{label}: the metadata has no `{k}`: not a complete memwise checkpoint"
            ))
        })
    };
    let bad = |k: &str, v: &str, what: &str| {
        RuntimeError::Io(format!("{label}: metadata `{k}` is `{v}`, not {what}"))
    };
    let u64_of = |k: &str| -> Result<u64> {
        let v = get(k)?;
        v.parse::<u64>()
            .map_err(|_| bad(k, v, "an unsigned integer"))
    };
    let u32_of = |k: &str| -> Result<u32> {
        let v = get(k)?;
        v.parse::<u32>()
            .map_err(|_| bad(k, v, "an unsigned 32-bit integer"))
    };
    let f32_of = |k: &str| -> Result<f32> {
        let v = get(k)?;
        v.strip_prefix("0x")
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .map(f32::from_bits)
            .ok_or_else(|| bad(k, v, "f32 bits like 0x47000000"))
    };
    let slots = u64_of(keys::OPTIMIZER_SLOTS)?;
    if slots != plan.optimizer.state_slots() {
        return Err(RuntimeError::Io(format!(
            "{label}: the checkpoint holds {slots} optimizer state slots per parameter, `{}` needs {}",
            plan.optimizer.name(),
            plan.optimizer.state_slots()
        )));
    }
    let scaling = get(keys::LOSS_SCALING)?;
    let scaling = match scaling {
        "true" => true,
        "false" => false,
        v => return Err(bad(keys::LOSS_SCALING, v, "true or false")),
    };
    if scaling != plan.loss_scaling {
        return Err(RuntimeError::Io(format!(
            "{label}: the checkpoint was saved {} dynamic loss scaling, this model trains {} it (a different precision policy)",
            if scaling { "with" } else { "without" },
            if plan.loss_scaling { "with" } else { "without" }
        )));
    }
    let scaler = LossScaler {
        scale: f32_of(keys::LOSS_SCALE)?,
        growth_interval: u32_of(keys::LOSS_SCALE_GROWTH_INTERVAL)?,
        growth: f32_of(keys::LOSS_SCALE_GROWTH)?,
        backoff: f32_of(keys::LOSS_SCALE_BACKOFF)?,
        good_steps: u32_of(keys::LOSS_SCALE_GOOD_STEPS)?,
        skipped_in_a_row: u32_of(keys::LOSS_SCALE_SKIPPED_IN_A_ROW)?,
    };
    if !(scaler.scale.is_finite() && scaler.scale > 0.0) {
        return Err(bad(
            keys::LOSS_SCALE,
            get(keys::LOSS_SCALE)?,
            "a positive finite scale",
        ));
    }
    // The scaler's other numbers are checked too: a growth below 1, a backoff outside (0, 1] or
    // an interval of 0 steps would drive the scale to 0 (an infinite unscale factor: NaN
    // weights) or make it skip every other step; and a model without loss scaling still
    // multiplies its loss gradient by the scale, so there it must be exactly 1.
    let reads = |k: &str, x: f32, want: &str| {
        bad(
            k,
            meta.get(k).map_or("", String::as_str),
            &format!("{want} (it reads {x})"),
        )
    };
    if plan.loss_scaling {
        if !(scaler.growth.is_finite() && scaler.growth >= 1.0) {
            return Err(reads(
                keys::LOSS_SCALE_GROWTH,
                scaler.growth,
                "a finite growth factor of at least 1",
            ));
        }
        if !(scaler.backoff > 0.0 && scaler.backoff <= 1.0) {
            return Err(reads(
                keys::LOSS_SCALE_BACKOFF,
                scaler.backoff,
                "a backoff factor in (0, 1]",
            ));
        }
        if scaler.growth_interval == 0 {
            return Err(bad(
                keys::LOSS_SCALE_GROWTH_INTERVAL,
                "0",
                "a growth interval of at least 1 step",
            ));
        }
    } else if scaler.scale != 1.0 {
        return Err(reads(
            keys::LOSS_SCALE,
            scaler.scale,
            "1 (a model without loss scaling leaves its loss unscaled)",
        ));
    }
    let (step, updates) = (u64_of(keys::STEP)?, u64_of(keys::UPDATES)?);
    if updates > step {
        return Err(RuntimeError::Io(format!(
            "{label}: metadata says {updates} optimizer updates in {step} steps (more updates than steps)"
        )));
    }
    Ok(TrainingCounters {
        seed: u64_of(keys::SEED)?,
        step,
        updates,
        scaler,
    })
}

/// Copies checked tensor bytes into their slots and refreshes the 16-bit copies. Called
/// only after every check of the file passed.
fn write_slots<M: PersistentState + ?Sized>(
    m: &mut M,
    slots: &[Slot],
    data: &[&[u8]],
) -> Result<()> {
    m.write_persistent(&mut |region: &mut [u8]| {
        // Bounds first, so a region problem cannot leave a half-written model.
        let len = region.len();
        for (s, d) in slots.iter().zip(data) {
            let start = usize::try_from(s.offset).unwrap_or(usize::MAX);
            if start.checked_add(d.len()).is_none_or(|end| end > len) {
                return Err(RuntimeError::Memory(format!(
                    "`{}`: {} bytes at offset {} lie outside the {len}-byte persistent region",
                    s.name,
                    d.len(),
                    s.offset
                )));
            }
        }
        for (s, d) in slots.iter().zip(data) {
            let start = s.offset as usize;
            copy_le_f32(d, &mut region[start..start + d.len()]);
        }
        Ok(())
    })
}

fn concat(header: Vec<u8>, entries: &[Entry<'_>]) -> Vec<u8> {
    let mut out = header;
    for e in entries {
        out.extend_from_slice(&e.data);
    }
    out
}

fn read_file(path: &Path, what: &str) -> Result<Vec<u8>> {
    fs::read(path)
        .map_err(|e| RuntimeError::Io(format!("cannot read {what} `{}`: {e}", path.display())))
}
