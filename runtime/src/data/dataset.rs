//! `Dataset`: samples a trainer gathers into batches, column by column, each column kept in
//! its stored type (u8 pixels stay u8 until the step converts them).

use memwise_plan::DType;

use crate::data::idx::MnistSplit;
use crate::error::{Result, RuntimeError};
use crate::executor::Batch;

/// One column of samples (one model input), stored as it arrives.
#[derive(Clone, Debug, PartialEq)]
pub enum Column {
    U8 { data: Vec<u8>, per_sample: usize },
    I32 { data: Vec<i32>, per_sample: usize },
    F32 { data: Vec<f32>, per_sample: usize },
}

impl Column {
    pub fn dtype(&self) -> DType {
        match self {
            Column::U8 { .. } => DType::U8,
            Column::I32 { .. } => DType::I32,
            Column::F32 { .. } => DType::F32,
        }
    }

    pub fn per_sample(&self) -> usize {
        match self {
            Column::U8 { per_sample, .. }
            | Column::I32 { per_sample, .. }
            | Column::F32 { per_sample, .. } => *per_sample,
        }
    }

    fn samples(&self) -> usize {
        let n = match self {
            Column::U8 { data, .. } => data.len(),
            Column::I32 { data, .. } => data.len(),
            Column::F32 { data, .. } => data.len(),
        };
        n / self.per_sample().max(1)
    }

    /// An empty buffer of this column's type for `batch` samples.
    pub fn buffer(&self, batch: usize) -> Column {
        let n = batch * self.per_sample();
        match self {
            Column::U8 { per_sample, .. } => Column::U8 {
                data: vec![0; n],
                per_sample: *per_sample,
            },
            Column::I32 { per_sample, .. } => Column::I32 {
                data: vec![0; n],
                per_sample: *per_sample,
            },
            Column::F32 { per_sample, .. } => Column::F32 {
                data: vec![0.0; n],
                per_sample: *per_sample,
            },
        }
    }

    /// Copies samples `indices` into `out` (a buffer from [`Column::buffer`]). Checks every
    /// range first (a [`Dataset`] implemented outside this crate may promise, in `len`, more
    /// samples than its columns hold), so a bad index or buffer is an error, not a panic.
    fn gather(&self, indices: &[usize], out: &mut Column) -> std::result::Result<(), String> {
        fn copy<T: Copy>(
            src: &[T],
            dst: &mut [T],
            per: usize,
            idx: &[usize],
        ) -> std::result::Result<(), String> {
            let range = |i: usize| Some(i.checked_mul(per)?..i.checked_add(1)?.checked_mul(per)?);
            if let Some(&i) = idx
                .iter()
                .find(|&&i| range(i).is_none_or(|r| r.end > src.len()))
            {
                return Err(format!(
                    "sample {i} lies past the column's end: it holds {} values, {} samples of {per}",
                    src.len(),
                    src.len().checked_div(per).unwrap_or(0)
                ));
            }
            let need = idx.len().saturating_mul(per);
            if need > dst.len() {
                return Err(format!(
                    "{} samples of {per} values need {need}, the buffer holds {}",
                    idx.len(),
                    dst.len()
                ));
            }
            for (k, &i) in idx.iter().enumerate() {
                dst[k * per..(k + 1) * per].copy_from_slice(&src[i * per..(i + 1) * per]);
            }
            Ok(())
        }
        let want = self.dtype();
        match (self, out) {
            (Column::U8 { data, per_sample }, Column::U8 { data: d, .. }) => {
                copy(data, d, *per_sample, indices)
            }
            (Column::I32 { data, per_sample }, Column::I32 { data: d, .. }) => {
                copy(data, d, *per_sample, indices)
            }
            (Column::F32 { data, per_sample }, Column::F32 { data: d, .. }) => {
                copy(data, d, *per_sample, indices)
            }
            (_, o) => Err(format!(
                "the buffer holds {} values, the column {}",
                o.dtype().name(),
                want.name()
            )),
        }
    }

    /// The first `samples` samples of this buffer as a batch.
    pub fn as_batch(&self, samples: usize) -> Batch<'_> {
        let n = samples.saturating_mul(self.per_sample());
        match self {
            Column::U8 { data, .. } => Batch::U8(&data[..n.min(data.len())]),
            Column::I32 { data, .. } => Batch::I32(&data[..n.min(data.len())]),
            Column::F32 { data, .. } => Batch::F32(&data[..n.min(data.len())]),
        }
    }
}

/// Samples a trainer can batch: one column per model input, in the model's input order.
pub trait Dataset {
    /// Number of samples.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The columns (their types and per-sample sizes; [`Dataset::gather`] fills buffers).
    fn columns(&self) -> &[Column];
    /// Copies samples `indices` into `out`, one buffer per column.
    fn gather(&self, indices: &[usize], out: &mut [Column]) -> Result<()> {
        let cols = self.columns();
        if out.len() != cols.len() {
            return Err(RuntimeError::Input(format!(
                "{} buffers for {} columns",
                out.len(),
                cols.len()
            )));
        }
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            return Err(RuntimeError::Input(format!(
                "sample {bad} of a {}-sample dataset",
                self.len()
            )));
        }
        for (k, (c, o)) in cols.iter().zip(out.iter_mut()).enumerate() {
            c.gather(indices, o).map_err(|e| {
                RuntimeError::Input(format!(
                    "dataset column {k} ({} samples by its `len`): {e}",
                    self.len()
                ))
            })?;
        }
        Ok(())
    }
    /// Says which samples will be gathered next, in order, in batches of `batch` (the last
    /// may be shorter): `fit` calls it at the start of each epoch with that epoch's shuffled
    /// order followed by the next epoch's, `evaluate` and `predict` with theirs. A streaming
    /// dataset ([`ImageFolder`](crate::data::image_folder::ImageFolder)) starts preparing
    /// those batches in the background; [`Dataset::gather`] must still answer any request
    /// exactly. The default does nothing.
    fn will_gather(&self, _upcoming: &[usize], _batch: usize) {}
    /// Host bytes this dataset allocates while serving batches of `batch` (a prefetch queue
    /// and its workers' decode buffers): what [`Trainer::host_bytes`](crate::Trainer::host_bytes)
    /// counts as `prefetch`. 0 for a dataset that holds its samples already.
    fn prefetch_bytes(&self, _batch: usize) -> u64 {
        0
    }
}

/// A dataset held in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct InMemory {
    columns: Vec<Column>,
    len: usize,
}

impl InMemory {
    /// Columns of equal sample counts; says which column disagrees.
    pub fn new(columns: Vec<Column>) -> Result<InMemory> {
        let len = columns.first().map_or(0, |c| c.samples());
        for (k, c) in columns.iter().enumerate() {
            if c.samples() != len {
                return Err(RuntimeError::Input(format!(
                    "column {k} holds {} samples, column 0 holds {len}",
                    c.samples()
                )));
            }
        }
        Ok(InMemory { columns, len })
    }

    /// The same dataset without the samples that hold a NaN or an infinity in any float
    /// column, and how many samples were dropped.
    ///
    /// Training refuses non-finite float inputs by default: `train_step` (and so
    /// [`Trainer::fit`](crate::Trainer::fit), `evaluate` and `predict`) fails with an error
    /// naming the input and the sample. This is the documented way to skip such samples
    /// instead — clean the data once, before training, and log how much was dropped:
    ///
    /// ```
    /// use memwise_runtime::data::dataset::{Column, Dataset, InMemory};
    ///
    /// let data = InMemory::new(vec![
    ///     Column::F32 { data: vec![0.5, 1.0, f32::NAN, 2.0, 3.0, f32::INFINITY], per_sample: 2 },
    ///     Column::I32 { data: vec![0, 1, 2], per_sample: 1 },
    /// ])?;
    /// let (clean, dropped) = data.drop_non_finite();
    /// assert_eq!((clean.len(), dropped), (1, 2));
    /// assert_eq!(clean.columns()[1], Column::I32 { data: vec![0], per_sample: 1 });
    /// # Ok::<(), memwise_runtime::RuntimeError>(())
    /// ```
    ///
    /// Integer columns (u8 pixels, i32 labels) are always finite and never cause a drop; the
    /// order of the kept samples is unchanged. `docs/ROBUSTNESS.md` lists every check.
    pub fn drop_non_finite(&self) -> (InMemory, usize) {
        // A column's sample `i` spans `i * stride .. (i + 1) * stride` (`stride` as `samples`
        // counts them: a per-sample size of 0 counts one value per sample).
        let stride = |c: &Column| c.per_sample().max(1);
        let keep: Vec<bool> = (0..self.len)
            .map(|i| {
                self.columns.iter().all(|c| match c {
                    Column::F32 { data, .. } => {
                        let s = stride(c);
                        data.get(i * s..(i + 1) * s)
                            .is_none_or(|x| x.iter().all(|v| v.is_finite()))
                    }
                    Column::U8 { .. } | Column::I32 { .. } => true,
                })
            })
            .collect();
        let kept = keep.iter().filter(|&&k| k).count();
        fn filter<T: Copy>(data: &[T], stride: usize, keep: &[bool]) -> Vec<T> {
            data.chunks_exact(stride)
                .zip(keep)
                .filter(|(_, &k)| k)
                .flat_map(|(x, _)| x.iter().copied())
                .collect()
        }
        let columns = self
            .columns
            .iter()
            .map(|c| {
                let s = stride(c);
                match c {
                    Column::U8 { data, per_sample } => Column::U8 {
                        data: filter(data, s, &keep),
                        per_sample: *per_sample,
                    },
                    Column::I32 { data, per_sample } => Column::I32 {
                        data: filter(data, s, &keep),
                        per_sample: *per_sample,
                    },
                    Column::F32 { data, per_sample } => Column::F32 {
                        data: filter(data, s, &keep),
                        per_sample: *per_sample,
                    },
                }
            })
            .collect();
        (InMemory { columns, len: kept }, self.len - kept)
    }

    /// Splits off the last `fraction` of the samples for validation, as Keras's
    /// `validation_split` does (before any shuffling: shuffle first if the samples are
    /// ordered by class): `(train, validation)`. The fraction is clamped to `[0, 1]`; both
    /// parts keep the sample order.
    pub fn validation_split(&self, fraction: f64) -> (InMemory, InMemory) {
        let held_out = ((self.len as f64) * fraction.clamp(0.0, 1.0)).round() as usize;
        let cut = self.len - held_out.min(self.len);
        (self.slice(0, cut), self.slice(cut, self.len))
    }

    /// Samples `start..end` (within `0..len`).
    fn slice(&self, start: usize, end: usize) -> InMemory {
        fn part<T: Clone>(data: &[T], per: usize, start: usize, end: usize) -> Vec<T> {
            data.get(start * per..end * per)
                .unwrap_or_default()
                .to_vec()
        }
        let columns = self
            .columns
            .iter()
            .map(|c| {
                let per = c.per_sample().max(1);
                match c {
                    Column::U8 { data, per_sample } => Column::U8 {
                        data: part(data, per, start, end),
                        per_sample: *per_sample,
                    },
                    Column::I32 { data, per_sample } => Column::I32 {
                        data: part(data, per, start, end),
                        per_sample: *per_sample,
                    },
                    Column::F32 { data, per_sample } => Column::F32 {
                        data: part(data, per, start, end),
                        per_sample: *per_sample,
                    },
                }
            })
            .collect();
        InMemory {
            columns,
            len: end - start,
        }
    }

    /// MNIST images (u8, 784 per sample) and labels (i32).
    pub fn mnist(split: &MnistSplit) -> InMemory {
        InMemory {
            len: split.len(),
            columns: vec![
                Column::U8 {
                    data: split.images.clone(),
                    per_sample: split.pixels_per_image(),
                },
                Column::I32 {
                    data: split.labels.iter().map(|&l| l as i32).collect(),
                    per_sample: 1,
                },
            ],
        }
    }

    /// Images only (an autoencoder's input and target).
    pub fn mnist_images(split: &MnistSplit) -> InMemory {
        InMemory {
            len: split.len(),
            columns: vec![Column::U8 {
                data: split.images.clone(),
                per_sample: split.pixels_per_image(),
            }],
        }
    }
}

impl Dataset for InMemory {
    fn len(&self) -> usize {
        self.len
    }
    fn columns(&self) -> &[Column] {
        &self.columns
    }
}
