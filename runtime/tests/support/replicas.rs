//! What the data-parallel tests (`data_parallel.rs`, `zero.rs`) train on and compare: MNIST-
//! shaped samples, a trainer's weights by name, and replicas as threads.

#![allow(dead_code)]

use memwise_plan::ModelSpec;
use memwise_runtime::collective::{Collective, ThreadGroup};
use memwise_runtime::data::dataset::{Dataset, InMemory};
use memwise_runtime::reference::{digits_dataset, xorshift};
use memwise_runtime::train::Trainer;
use memwise_runtime::Device;
use std::sync::Arc;

/// `n` MNIST-shaped samples: u8 pixels with a little structure, and labels that follow it.
pub fn digits(n: usize) -> InMemory {
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    let labels: Vec<i32> = (0..n).map(|_| (next() % 10) as i32).collect();
    let pixels: Vec<u8> = (0..n * 784)
        .map(|i| {
            let (s, p) = (i / 784, i % 784);
            let bright = (p / 78) as i32 == labels[s];
            (next() % 64) as u8 + if bright { 160 } else { 0 }
        })
        .collect();
    digits_dataset(pixels, labels)
}

/// Only the pixels (the VAE's one input).
pub fn pixels_only(n: usize) -> InMemory {
    let d = digits(n);
    InMemory::new(vec![d.columns()[0].clone()]).unwrap()
}

/// Every parameter's values, by name.
pub type Weights = Vec<(String, Vec<f32>)>;

pub fn weights(t: &Trainer) -> Weights {
    t.plan()
        .params
        .iter()
        .map(|p| (p.name.to_string(), t.engine().param(&p.name).unwrap()))
        .collect()
}

/// Runs `each(rank, trainer)` on `n` replicas of `spec` (threads), each joined to the job
/// first, and returns what each returned.
pub fn on_replicas<T: Send>(
    spec: &ModelSpec,
    n: usize,
    each: impl Fn(usize, &mut Trainer) -> T + Sync,
) -> Vec<T> {
    let ranks = ThreadGroup::new(n);
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let each = &each;
                s.spawn(move || {
                    let mut t = Trainer::build(spec, &Device::cpu(), 5 + r as u64).unwrap();
                    t.set_data_parallel(Arc::new(c) as Arc<dyn Collective>)
                        .unwrap();
                    each(r, &mut t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
