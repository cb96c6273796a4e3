//! The image-folder decode path on one file: `image::probe` then `ImageDecoder::decode_into`
//! (JPEG, PNG, channel conversion, resizing) on raw bytes and on valid PNG/JPEG files that are
//! truncated, bit-flipped or given other header sizes. A failure must be an error with a
//! message; a success must have written the whole sample.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_runtime::data::image::{probe, ImageDecoder};

/// Small enough that no input makes the fuzzer allocate gigabytes.
const MAX_PIXELS: u64 = 1 << 22;

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let (file, promised, target) = decode::image_file(&mut b);
    let header = probe(&file, MAX_PIXELS);
    let mut out = vec![0xA5u8; target.bytes()];
    let mut d = ImageDecoder::new(MAX_PIXELS);
    match d.decode_into(&file, promised, target, &mut out) {
        Ok(()) => {
            let h = header.expect("a decoded file has a header");
            assert_eq!(h.format, promised, "decoded a file that is not what its name says");
        }
        Err(e) => assert!(!e.is_empty(), "an error without a message"),
    }
    // The decoder is reused across images: a second, valid decode must still work.
    let ok = memwise_runtime::data::digits_folder::encode_png(&[7u8; 16], 4, 4, 1).unwrap();
    d.decode_into(&ok, memwise_runtime::data::image::ImageFormat::Png, target, &mut out)
        .expect("a valid PNG decodes after any failure");
    assert!(out.iter().all(|&v| v == 7), "a 4×4 gray of 7 resizes to 7s");
});
