//! `Trainer::fit` / `evaluate` / `predict` on in-memory datasets of any column count, dtype,
//! per-sample size and sample count (0 to 11), and `InMemory::drop_non_finite`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memwise_fuzz::decode::{self, Bytes};
use memwise_runtime::data::dataset::{Column, Dataset};
use memwise_runtime::{Device, FitOptions, Trainer};

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let models = decode::train_models();
    let spec = &models[b.below(models.len())];
    let mut t = Trainer::build(spec, &Device::cpu(), 3).expect("a fixed model builds");
    let Some(ds) = decode::dataset(t.plan(), &mut b) else {
        return;
    };
    let opts = FitOptions {
        epochs: 1 + b.below(2),
        verbose: false,
        max_steps: Some(3),
        seed: b.u8() as u64,
        ..FitOptions::default()
    };
    let r = match b.u8() % 5 {
        0 => t.fit(&ds, None, &opts, &mut []).map(|_| ()),
        1 => t.fit(&ds, Some(&ds), &opts, &mut []).map(|_| ()),
        2 => t.evaluate(&ds).map(|_| ()),
        3 => t.predict(&ds).map(|_| ()),
        _ => {
            let (clean, dropped) = ds.drop_non_finite();
            assert_eq!(clean.len() + dropped, ds.len());
            for c in clean.columns() {
                if let Column::F32 { data, .. } = c {
                    assert!(
                        data.iter().all(|v| v.is_finite()),
                        "a non-finite value survived"
                    );
                }
            }
            t.fit(&clean, None, &opts, &mut []).map(|_| ())
        }
    };
    if let Err(e) = r {
        assert!(!e.to_string().is_empty(), "an error without a message");
    }
});
