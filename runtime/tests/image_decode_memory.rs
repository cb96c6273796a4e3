//! The decode scratch an image folder plans per worker (`image::scratch_bytes`) against what
//! decoding really allocates, measured with a counting allocator: for PNG (gray, gray + alpha,
//! RGB, RGBA, 16-bit) and JPEG (baseline, progressive; RGB and gray) files into grayscale and
//! RGB samples. The plan must hold every byte (an upper bound) and not be far above it, or
//! the host estimate would drift from the measured peak.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;

use memwise_runtime::data::digits_folder::{encode_jpeg_with, encode_png};
use memwise_runtime::data::image::{
    probe, scratch_bytes, ImageDecoder, ImageFormat, ImageShape, DEFAULT_MAX_PIXELS,
};

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(l.size(), SeqCst) + l.size();
        PEAK.fetch_max(now, SeqCst);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CURRENT.fetch_sub(l.size(), SeqCst);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() {
            let now = CURRENT.fetch_add(new - l.size(), SeqCst) + new - l.size();
            PEAK.fetch_max(now, SeqCst);
        } else {
            CURRENT.fetch_sub(l.size() - new, SeqCst);
        }
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Tests share the counters: one measurement at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Smooth, photo-like pixels (gradients and a ripple), so the codecs work as on a photo.
fn photo(w: u32, h: u32, c: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity((w * h * c) as usize);
    for y in 0..h {
        for x in 0..w {
            for k in 0..c {
                let r = ((x * 3 + y * 2 + k * 50) % 256) as f32;
                let ripple = 20.0 * ((x as f32 * 0.05).sin() + (y as f32 * 0.07).cos());
                v.push((r * 0.8 + ripple + 20.0).clamp(0.0, 255.0) as u8);
            }
        }
    }
    v
}

fn png16(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut e = png::Encoder::new(&mut out, w, h);
    e.set_color(png::ColorType::Rgb);
    e.set_depth(png::BitDepth::Sixteen);
    let data: Vec<u8> = photo(w, h, 6);
    e.write_header().unwrap().write_image_data(&data).unwrap();
    out
}

/// Peak heap bytes a worker's decoder takes to decode `file` into `target`, from its
/// creation (buffers at their planned sizes) to the end of the decode, and the plan.
fn measure(file: &[u8], target: ImageShape) -> (u64, u64) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let header = probe(file, DEFAULT_MAX_PIXELS).unwrap();
    let planned = scratch_bytes(&header, target);
    let mut out = vec![0u8; target.bytes()];
    let format = header.format;
    let base = CURRENT.load(SeqCst);
    PEAK.store(base, SeqCst);
    let mut d = ImageDecoder::with_capacity(DEFAULT_MAX_PIXELS, planned, header.width, target);
    d.decode_into(file, format, target, &mut out).unwrap();
    let peak = PEAK.load(SeqCst) - base;
    drop(d);
    (peak as u64, planned.total())
}

#[test]
fn the_planned_decode_scratch_holds_what_decoding_allocates() {
    let rgb = ImageShape {
        height: 180,
        width: 180,
        channels: 3,
    };
    let gray = ImageShape {
        height: 180,
        width: 180,
        channels: 1,
    };
    let (w, h) = (500u32, 375u32);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("png gray", encode_png(&photo(w, h, 1), w, h, 1).unwrap()),
        (
            "png gray+alpha",
            encode_png(&photo(w, h, 2), w, h, 2).unwrap(),
        ),
        ("png rgb", encode_png(&photo(w, h, 3), w, h, 3).unwrap()),
        ("png rgba", encode_png(&photo(w, h, 4), w, h, 4).unwrap()),
        ("png rgb 16-bit", png16(w, h)),
        (
            "jpeg rgb baseline",
            encode_jpeg_with(&photo(w, h, 3), w, h, 3, 90, false).unwrap(),
        ),
        (
            "jpeg rgb progressive",
            encode_jpeg_with(&photo(w, h, 3), w, h, 3, 90, true).unwrap(),
        ),
        (
            "jpeg gray baseline",
            encode_jpeg_with(&photo(w, h, 1), w, h, 1, 90, false).unwrap(),
        ),
        (
            "jpeg gray progressive",
            encode_jpeg_with(&photo(w, h, 1), w, h, 1, 90, true).unwrap(),
        ),
    ];
    let mut report = Vec::new();
    for (name, file) in &cases {
        assert_eq!(
            probe(file, DEFAULT_MAX_PIXELS).unwrap().format,
            if name.starts_with("png") {
                ImageFormat::Png
            } else {
                ImageFormat::Jpeg
            }
        );
        for target in [rgb, gray] {
            let (used, planned) = measure(file, target);
            report.push(format!(
                "{name} → {} channels: used {used}, planned {planned} ({:.0} %)",
                target.channels,
                100.0 * used as f64 / planned as f64
            ));
            assert!(
                used <= planned,
                "{name} into {target:?}: used {used} > planned {planned}"
            );
            assert!(
                used * 2 >= planned,
                "{name} into {target:?}: planned {planned} is over twice the {used} used"
            );
        }
    }
    println!("{}", report.join("\n"));
}
