//! `parse_idx` on IDX files (valid, gzipped, wrong magic/dtype/dims/payload, raw bytes), then
//! `MnistSplit::from_arrays` and its accessors on what parsed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_runtime::data::idx::{parse_idx, MnistSplit};

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let images = decode::idx_file(&mut b);
    let labels = decode::idx_file(&mut b);
    let parsed = (parse_idx(&images, "images"), parse_idx(&labels, "labels"));
    for r in [&parsed.0, &parsed.1] {
        match r {
            Ok(a) => {
                let n = a.dims.iter().try_fold(1usize, |x, &d| x.checked_mul(d));
                assert_eq!(n, Some(a.data.len()), "dims and data disagree");
            }
            Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
        }
    }
    if let (Ok(i), Ok(l)) = parsed {
        match MnistSplit::from_arrays(i, "images", l, "labels") {
            Ok(s) => {
                let _ = (
                    s.len(),
                    s.class_counts(),
                    s.image(s.len().saturating_sub(1)),
                    s.label(0),
                );
                let at = b.below(s.len() + 2);
                let (a, c) = s.split_at(at);
                assert_eq!(a.len() + c.len(), a.labels.len() + c.labels.len());
            }
            Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
        }
    }
});
