//! The bundled MNIST digits written out as an image folder — one subfolder per class, PNG
//! files and every `jpeg_every`-th one a JPEG — so that the image-folder path (listing,
//! decoding both formats, resizing) runs out of the box on real images; and the PNG / JPEG
//! encoders it uses, which tests use to write their own images.

use std::path::{Path, PathBuf};

use crate::data::idx::load_bundled_digits;
use crate::error::{Result, RuntimeError};

/// What [`write_digits_folder`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DigitsFolder {
    pub dir: PathBuf,
    /// The class folders, in label order (`digit_0`, `digit_1`, …).
    pub classes: Vec<String>,
    pub png: usize,
    pub jpeg: usize,
}

impl DigitsFolder {
    pub fn files(&self) -> usize {
        self.png + self.jpeg
    }
}

/// Writes every bundled digit (the 10,000 real MNIST images of `data/mnist-10k`, 28×28
/// grayscale) whose label is in `digits` to `dir/digit_<d>/<index>.png`, or `.jpg` for every
/// `jpeg_every`-th image of a class (0: none). Existing files of those names are replaced.
pub fn write_digits_folder(dir: &Path, digits: &[u8], jpeg_every: usize) -> Result<DigitsFolder> {
    let io = |p: &Path, e: std::io::Error| RuntimeError::Io(format!("{}: {e}", p.display()));
    let (train, test) = load_bundled_digits().map_err(|e| RuntimeError::Io(e.to_string()))?;
    let (rows, cols) = (train.rows as u32, train.cols as u32);
    let mut out = DigitsFolder {
        dir: dir.to_path_buf(),
        classes: Vec::new(),
        png: 0,
        jpeg: 0,
    };
    for &d in digits {
        let class = format!("digit_{d}");
        let cdir = dir.join(&class);
        std::fs::create_dir_all(&cdir).map_err(|e| io(&cdir, e))?;
        let mut k = 0usize;
        for (index, (image, &label)) in train
            .images
            .chunks_exact(train.pixels_per_image())
            .zip(&train.labels)
            .chain(
                test.images
                    .chunks_exact(test.pixels_per_image())
                    .zip(&test.labels),
            )
            .enumerate()
        {
            if label != d {
                continue;
            }
            k += 1;
            let jpeg = jpeg_every > 0 && k.is_multiple_of(jpeg_every);
            let (bytes, ext) = if jpeg {
                (encode_jpeg(image, cols, rows, 1, 95)?, "jpg")
            } else {
                (encode_png(image, cols, rows, 1)?, "png")
            };
            let path = cdir.join(format!("{index:05}.{ext}"));
            std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
            if jpeg {
                out.jpeg += 1;
            } else {
                out.png += 1;
            }
        }
        out.classes.push(class);
    }
    Ok(out)
}

/// An 8-bit PNG of `width × height` pixels of `channels` (1 gray, 2 gray + alpha, 3 RGB,
/// 4 RGBA) interleaved values.
pub fn encode_png(pixels: &[u8], width: u32, height: u32, channels: u32) -> Result<Vec<u8>> {
    let color = match channels {
        1 => png::ColorType::Grayscale,
        2 => png::ColorType::GrayscaleAlpha,
        3 => png::ColorType::Rgb,
        4 => png::ColorType::Rgba,
        c => return Err(RuntimeError::Input(format!("PNG: {c} channels"))),
    };
    let mut out = Vec::new();
    let err = |e: png::EncodingError| RuntimeError::Io(format!("PNG encoding: {e}"));
    {
        let mut enc = png::Encoder::new(&mut out, width, height);
        enc.set_color(color);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(err)?;
        w.write_image_data(pixels).map_err(err)?;
    }
    Ok(out)
}

/// A baseline JPEG (`quality` 1–100) of `width × height` pixels of 1 (gray) or 3 (RGB)
/// interleaved channels.
pub fn encode_jpeg(
    pixels: &[u8],
    width: u32,
    height: u32,
    channels: u32,
    quality: u8,
) -> Result<Vec<u8>> {
    encode_jpeg_with(pixels, width, height, channels, quality, false)
}

/// [`encode_jpeg`], progressive when `progressive`.
pub fn encode_jpeg_with(
    pixels: &[u8],
    width: u32,
    height: u32,
    channels: u32,
    quality: u8,
    progressive: bool,
) -> Result<Vec<u8>> {
    let color = match channels {
        1 => jpeg_encoder::ColorType::Luma,
        3 => jpeg_encoder::ColorType::Rgb,
        c => return Err(RuntimeError::Input(format!("JPEG: {c} channels"))),
    };
    let dim = |x: u32| {
        u16::try_from(x).map_err(|_| RuntimeError::Input(format!("JPEG: {x} pixels is too large")))
    };
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, quality);
    enc.set_progressive(progressive);
    enc.encode(pixels, dim(width)?, dim(height)?, color)
        .map_err(|e| RuntimeError::Io(format!("JPEG encoding: {e}")))?;
    Ok(out)
}
