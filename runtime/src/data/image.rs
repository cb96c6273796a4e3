//! One image file's bytes → one uint8 sample of a model's input shape (height × width ×
//! channels, row-major, channels last): format sniffing, a header probe that plans the
//! scratch memory decoding will need, JPEG (zune-jpeg) and PNG (png) decoding into reused
//! buffers, channel conversion, and resizing (fast_image_resize, bilinear with antialiasing,
//! as PIL and torchvision resize).
//!
//! Nothing here panics on a bad file: every problem is an `Err` with a message saying what is
//! wrong (the caller adds the file's name). Decoding is strict — a truncated JPEG is an error,
//! not a picture with a grey bottom — because a silently damaged sample trains on noise.

use std::io::Cursor;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

/// Images larger than this many pixels are refused before anything is allocated (PIL refuses
/// "decompression bombs" at 179 million; a 64-megapixel photo still passes).
pub const DEFAULT_MAX_PIXELS: u64 = 1 << 27;

/// The decoder state the `png` crate allocates besides its row buffers (the inflate window and
/// tables), an upper bound of what a counting allocator measured for png 0.18 on every colour
/// type (270–276 KiB); `runtime/tests/image_decode_memory.rs` checks it.
pub const PNG_DECODER_STATE_BYTES: u64 = 320 << 10;

/// The formats the loader decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    Png,
    Jpeg,
}

impl ImageFormat {
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Png => "PNG",
            ImageFormat::Jpeg => "JPEG",
        }
    }

    /// The format a file name promises: `.png`, `.jpg` / `.jpeg` (any case); `None` for
    /// anything else.
    pub fn from_extension(path: &std::path::Path) -> Option<ImageFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "png" => Some(ImageFormat::Png),
            "jpg" | "jpeg" => Some(ImageFormat::Jpeg),
            _ => None,
        }
    }

    /// The format the bytes are, by their magic number.
    pub fn sniff(bytes: &[u8]) -> Option<ImageFormat> {
        if bytes.starts_with(&[0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a]) {
            Some(ImageFormat::Png)
        } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
            Some(ImageFormat::Jpeg)
        } else {
            None
        }
    }
}

/// The sample an image becomes: the model input's height, width and channels (1: grayscale,
/// 3: RGB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageShape {
    pub height: u32,
    pub width: u32,
    pub channels: u32,
}

impl ImageShape {
    /// Bytes of one sample (`height × width × channels` u8 values).
    pub fn bytes(&self) -> usize {
        self.height as usize * self.width as usize * self.channels as usize
    }

    /// An error unless the shape has pixels and 1 or 3 channels.
    pub fn check(&self) -> Result<(), String> {
        if self.height == 0 || self.width == 0 {
            return Err(format!(
                "an image size of {}×{} has no pixels",
                self.height, self.width
            ));
        }
        if self.channels != 1 && self.channels != 3 {
            return Err(format!(
                "images have 1 (grayscale) or 3 (RGB) channels, not {}",
                self.channels
            ));
        }
        Ok(())
    }
}

/// What a file's header says, read without decoding its pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageHeader {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
    /// Channels the file stores (PNG: as the colour type and a transparency chunk can expand
    /// to — palette and RGB may gain alpha; JPEG: its components).
    pub channels: u32,
    /// Bytes per sample in the file (PNG 16-bit: 2; decoded to 8 bits).
    pub sample_bytes: u32,
    /// A progressive JPEG, whose decoder keeps every coefficient of the image.
    pub progressive: bool,
}

impl ImageHeader {
    fn pixels(&self) -> u64 {
        self.width as u64 * self.height as u64
    }

    /// Channels the decoder hands over for `target` (JPEG: decoded straight to the target's
    /// colour space; PNG: 8-bit, with alpha where the file has it).
    fn decoded_channels(&self, target: ImageShape) -> u32 {
        match self.format {
            ImageFormat::Jpeg => target.channels,
            ImageFormat::Png => self.channels,
        }
    }
}

/// Reads `bytes`' header: its format (by magic number), size and channels. A file whose
/// pixels exceed `max_pixels` is refused here, before anything is allocated for it.
pub fn probe(bytes: &[u8], max_pixels: u64) -> Result<ImageHeader, String> {
    let header = match ImageFormat::sniff(bytes) {
        Some(ImageFormat::Png) => probe_png(bytes)?,
        Some(ImageFormat::Jpeg) => probe_jpeg(bytes)?,
        None => {
            return Err(match bytes.len() {
                0 => "the file is empty".to_string(),
                n => format!(
                    "not a PNG or JPEG file (it starts with {:02x?}, {n} bytes in all)",
                    &bytes[..n.min(8)]
                ),
            })
        }
    };
    if header.width == 0 || header.height == 0 {
        return Err(format!(
            "the {} header says {}×{} pixels",
            header.format.name(),
            header.width,
            header.height
        ));
    }
    if header.pixels() > max_pixels {
        return Err(format!(
            "the image is {}×{} = {} pixels, over the limit of {max_pixels}",
            header.width,
            header.height,
            header.pixels()
        ));
    }
    Ok(header)
}

fn probe_png(bytes: &[u8]) -> Result<ImageHeader, String> {
    let mut d = png::Decoder::new(Cursor::new(bytes));
    let info = d
        .read_header_info()
        .map_err(|e| format!("PNG header: {e}"))?;
    // With EXPAND, palette images become RGB(A) and a tRNS chunk (which comes after the
    // header) adds alpha: plan for the alpha.
    let channels = match info.color_type {
        png::ColorType::Grayscale | png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb | png::ColorType::Rgba | png::ColorType::Indexed => 4,
    };
    Ok(ImageHeader {
        format: ImageFormat::Png,
        width: info.width,
        height: info.height,
        channels,
        sample_bytes: if info.bit_depth == png::BitDepth::Sixteen {
            2
        } else {
            1
        },
        progressive: false,
    })
}

fn jpeg_options(out: ColorSpace) -> DecoderOptions {
    DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX))
        .jpeg_set_out_colorspace(out)
}

fn probe_jpeg(bytes: &[u8]) -> Result<ImageHeader, String> {
    let mut d = zune_jpeg::JpegDecoder::new_with_options(
        ZCursor::new(bytes),
        jpeg_options(ColorSpace::RGB),
    );
    d.decode_headers()
        .map_err(|e| format!("JPEG header: {e}"))?;
    let info = d
        .info()
        .ok_or_else(|| "JPEG header: no frame header".to_string())?;
    let progressive = info.sof.is_progressive();
    Ok(ImageHeader {
        format: ImageFormat::Jpeg,
        width: u32::from(info.width),
        height: u32::from(info.height),
        channels: u32::from(info.components).max(1),
        sample_bytes: 1,
        progressive,
    })
}

/// Bytes decoding the image of `h` into a `target` sample needs besides the file's bytes and
/// the sample itself, as four buffers: the decoded pixels, the pixels converted to the
/// target's channels (when they differ), the resizer's intermediate image, and what the
/// decoder allocates inside (JPEG: a row of MCUs, or every coefficient of a progressive
/// image; PNG: its inflate state and row buffers). An upper bound:
/// `runtime/tests/image_decode_memory.rs` measures it with a counting allocator.
pub fn scratch_bytes(h: &ImageHeader, target: ImageShape) -> ScratchBytes {
    let (w, ht) = (h.width as u64, h.height as u64);
    let decoded_ch = h.decoded_channels(target) as u64;
    let decoded = w * ht * decoded_ch;
    let converted = if decoded_ch != target.channels as u64 {
        w * ht * target.channels as u64
    } else {
        0
    };
    // fast_image_resize (u8 pixels) runs the vertical pass first, into a source-width ×
    // target-height image (plus one pixel of alignment slack).
    let resize = if (h.width, h.height) != (target.width, target.height) {
        (w * target.height as u64 + 1) * target.channels as u64
    } else {
        0
    };
    let pad16 = |x: u64| x.div_ceil(16) * 16;
    let decoder = match h.format {
        ImageFormat::Png => {
            let raw_row = w * h.channels as u64 * h.sample_bytes as u64 + 1;
            PNG_DECODER_STATE_BYTES + 3 * raw_row
        }
        // i16 coefficients: of the whole image when progressive, else of one row of MCUs
        // (16 lines at most) for each component, twice over for the upsampler.
        ImageFormat::Jpeg if h.progressive => h.channels as u64 * pad16(w) * pad16(ht) * 2,
        ImageFormat::Jpeg => 4 * h.channels as u64 * pad16(w) * 16 * 2 + (64 << 10),
    };
    ScratchBytes {
        decoded,
        converted,
        resize,
        decoder,
    }
}

/// The scratch one decode needs, by buffer (see [`scratch_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchBytes {
    pub decoded: u64,
    pub converted: u64,
    pub resize: u64,
    pub decoder: u64,
}

impl ScratchBytes {
    /// Buffer by buffer, the larger of the two: what one worker that reuses its buffers
    /// needs for both images.
    pub fn max(self, o: ScratchBytes) -> ScratchBytes {
        ScratchBytes {
            decoded: self.decoded.max(o.decoded),
            converted: self.converted.max(o.converted),
            resize: self.resize.max(o.resize),
            decoder: self.decoder.max(o.decoder),
        }
    }

    pub fn total(&self) -> u64 {
        self.decoded + self.converted + self.resize + self.decoder
    }
}

/// Decodes images into samples, reusing its buffers from one image to the next (one per
/// worker thread).
pub struct ImageDecoder {
    decoded: Vec<u8>,
    converted: Vec<u8>,
    resizer: Resizer,
    options: ResizeOptions,
    max_pixels: u64,
}

impl ImageDecoder {
    /// A decoder refusing images over `max_pixels`.
    pub fn new(max_pixels: u64) -> ImageDecoder {
        ImageDecoder {
            decoded: Vec::new(),
            converted: Vec::new(),
            resizer: Resizer::new(),
            options: ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear)),
            max_pixels,
        }
    }

    /// A decoder whose buffers are allocated once, at the sizes `plan` gives (the largest over
    /// the files it will see), so that its memory never grows while it works.
    pub fn with_capacity(
        max_pixels: u64,
        plan: ScratchBytes,
        widest: u32,
        target: ImageShape,
    ) -> ImageDecoder {
        let mut d = ImageDecoder::new(max_pixels);
        d.decoded = Vec::with_capacity(plan.decoded as usize);
        d.converted = Vec::with_capacity(plan.converted as usize);
        // The resizer sizes its intermediate image on first use and grows it by doubling:
        // one resize from the widest source gives it its largest size now.
        if plan.resize > 0 && target.check().is_ok() && widest > 0 {
            let src = vec![0u8; widest as usize * 2 * target.channels as usize];
            let mut dst = vec![0u8; target.bytes()];
            let _ = resize(
                &mut d.resizer,
                &d.options,
                &src,
                (widest, 2),
                target,
                &mut dst,
            );
        }
        d
    }

    /// Bytes held in this decoder's reusable buffers now.
    pub fn held_bytes(&self) -> u64 {
        (self.decoded.capacity() + self.converted.capacity()) as u64
            + self.resizer.size_of_internal_buffers() as u64
    }

    /// Decodes `bytes` — which must be a `expected` file — into `out`, one `target` sample.
    /// On an `Err`, `out` may hold part of an image.
    pub fn decode_into(
        &mut self,
        bytes: &[u8],
        expected: ImageFormat,
        target: ImageShape,
        out: &mut [u8],
    ) -> Result<(), String> {
        target.check()?;
        if out.len() != target.bytes() {
            return Err(format!(
                "the output holds {} bytes, a {}×{}×{} sample needs {}",
                out.len(),
                target.height,
                target.width,
                target.channels,
                target.bytes()
            ));
        }
        let header = probe(bytes, self.max_pixels)?;
        if header.format != expected {
            return Err(format!(
                "its name says {} but it holds a {} image",
                expected.name(),
                header.format.name()
            ));
        }
        let channels = match header.format {
            ImageFormat::Jpeg => self.decode_jpeg(bytes, target)?,
            ImageFormat::Png => self.decode_png(bytes)?,
        };
        let (w, h) = (header.width, header.height);
        let src: &[u8] = if channels != target.channels {
            convert_channels(
                &self.decoded,
                channels,
                target.channels,
                &mut self.converted,
            );
            &self.converted
        } else {
            &self.decoded
        };
        resize(&mut self.resizer, &self.options, src, (w, h), target, out)
    }

    fn decode_jpeg(&mut self, bytes: &[u8], target: ImageShape) -> Result<u32, String> {
        let out = if target.channels == 1 {
            ColorSpace::Luma
        } else {
            ColorSpace::RGB
        };
        let mut d =
            zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), jpeg_options(out));
        d.decode_headers().map_err(|e| format!("JPEG: {e}"))?;
        let n = d
            .output_buffer_size()
            .ok_or_else(|| "JPEG: the image size overflows".to_string())?;
        set_len(&mut self.decoded, n);
        d.decode_into(&mut self.decoded)
            .map_err(|e| format!("JPEG: {e}"))?;
        Ok(target.channels)
    }

    fn decode_png(&mut self, bytes: &[u8]) -> Result<u32, String> {
        let mut d = png::Decoder::new(Cursor::new(bytes));
        d.set_transformations(png::Transformations::normalize_to_color8());
        let mut r = d.read_info().map_err(|e| format!("PNG: {e}"))?;
        let n = r
            .output_buffer_size()
            .ok_or_else(|| "PNG: the image size overflows".to_string())?;
        set_len(&mut self.decoded, n);
        let info = r
            .next_frame(&mut self.decoded)
            .map_err(|e| format!("PNG: {e}"))?;
        if info.bit_depth != png::BitDepth::Eight {
            return Err(format!(
                "PNG: decoded to {:?} bits per sample, expected 8",
                info.bit_depth
            ));
        }
        self.decoded.truncate(info.buffer_size());
        Ok(match info.color_type {
            png::ColorType::Grayscale => 1,
            png::ColorType::GrayscaleAlpha => 2,
            png::ColorType::Rgb => 3,
            png::ColorType::Rgba => 4,
            png::ColorType::Indexed => {
                return Err("PNG: a palette image was not expanded".to_string())
            }
        })
    }
}

/// Converts interleaved 8-bit pixels of `from` channels (1 gray, 2 gray + alpha, 3 RGB, 4 RGBA)
/// to `to` channels (1 or 3), as PIL's `convert` does: alpha dropped, gray replicated, RGB to
/// gray by ITU-R 601 luma in PIL's fixed point (`L = (19595 R + 38470 G + 7471 B + 2^15) >> 16`).
pub fn convert_channels(src: &[u8], from: u32, to: u32, out: &mut Vec<u8>) {
    let (from, to) = (from as usize, to as usize);
    let pixels = src.len() / from.max(1);
    out.clear();
    out.reserve_exact(pixels * to);
    let luma = |p: &[u8]| {
        ((19595 * p[0] as u32 + 38470 * p[1] as u32 + 7471 * p[2] as u32 + 0x8000) >> 16) as u8
    };
    for p in src.chunks_exact(from.max(1)) {
        match (from, to) {
            (1 | 2, 1) => out.push(p[0]),
            (1 | 2, 3) => out.extend_from_slice(&[p[0], p[0], p[0]]),
            (3 | 4, 1) => out.push(luma(p)),
            (3 | 4, 3) => out.extend_from_slice(&p[..3]),
            _ => out.extend(std::iter::repeat_n(0, to)),
        }
    }
}

/// Resizes `src` (`size` = width, height; `target.channels` interleaved u8 channels) into
/// `out`, one `target` sample; copies when the sizes already agree.
fn resize(
    resizer: &mut Resizer,
    options: &ResizeOptions,
    src: &[u8],
    size: (u32, u32),
    target: ImageShape,
    out: &mut [u8],
) -> Result<(), String> {
    let (w, h) = size;
    if (w, h) == (target.width, target.height) {
        let n = out.len();
        let src = src
            .get(..n)
            .ok_or("the decoded image is shorter than its size")?;
        out.copy_from_slice(src);
        return Ok(());
    }
    let pt = if target.channels == 1 {
        PixelType::U8
    } else {
        PixelType::U8x3
    };
    let src = ImageRef::new(w, h, src, pt).map_err(|e| format!("resize: {e}"))?;
    let mut dst = Image::from_slice_u8(target.width, target.height, out, pt)
        .map_err(|e| format!("resize: {e}"))?;
    resizer
        .resize(&src, &mut dst, options)
        .map_err(|e| format!("resize: {e}"))
}

/// Makes `buf` `n` bytes long without rewriting the bytes it keeps: the decoders overwrite
/// every byte of their output, so zeroing an image's worth of memory per file is waste.
fn set_len(buf: &mut Vec<u8>, n: usize) {
    if buf.len() < n {
        buf.resize(n, 0);
    } else {
        buf.truncate(n);
    }
}
