//! `advice::parse_bytes` (the budget strings: `"8 GiB"`, `"80GB"`) on any text, and
//! `format_bytes` on any number; a parsed size formats and parses back close to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memwise_plan::advice::{format_bytes, parse_bytes};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse_bytes(&text) {
        // Sizes from 16 EiB − 0.5% up format as `16384 PiB`, over u64::MAX: not parsed back.
        Ok(n) if n < 1 << 63 => {
            let shown = format_bytes(n);
            let back = parse_bytes(&shown)
                .unwrap_or_else(|e| panic!("`{shown}` does not parse back: {e}"));
            // format_bytes rounds to two decimals of its unit.
            assert!(
                back.abs_diff(n) as f64 <= n as f64 * 0.005 + 1.0,
                "{n} → `{shown}` → {back}"
            );
        }
        Ok(_) => {}
        Err(e) => assert!(!e.is_empty(), "an error without a message"),
    }
    if data.len() >= 8 {
        let n = u64::from_le_bytes(data[..8].try_into().unwrap());
        assert!(!format_bytes(n).is_empty());
    }
});
