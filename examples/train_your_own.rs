//! Train your own model, from data in memory to saved weights: the README's "Train your own
//! model" section is this file.
//!
//! `cargo run --release --example train_your_own`

use memwise::prelude::*;

/// Points in the plane, labelled by which of three rings around the origin they lie on.
#[memwise::model(batch = 64, optimizer = adam(lr = 1e-2),
                 loss = sparse_categorical_crossentropy, metrics = [accuracy])]
struct Rings {
    #[input(shape = [2])]
    point: Input,
    #[input(shape = [], dtype = i32)]
    ring: Input,
    #[dense(32, activation = relu, from = point)]
    hidden: Dense,
    #[dense(32, activation = relu)]
    hidden_2: Dense,
    #[dense(3)] // a linear output: the loss reads it as logits and fuses the softmax
    logits: Dense,
}

fn main() -> Result<(), RuntimeError> {
    // One column per input, in the order the inputs are declared: `point`, then `ring`.
    let (points, rings) = three_rings(3000);
    let data = InMemory::new(vec![
        Column::F32 {
            data: points,
            per_sample: 2,
        },
        Column::I32 {
            data: rings,
            per_sample: 1,
        },
    ])?;
    let (train, validation) = data.validation_split(0.2); // the last 20 %, as Keras takes it

    let mut model = Rings::new(&Device::cpu())?; // the compile-time plan, allocated once
    let options = FitOptions {
        epochs: 10,
        ..Default::default()
    };
    model.fit(&train, Some(&validation), &options, &mut [])?;

    let eval = model.evaluate(&validation)?;
    println!(
        "validation: loss {:.4}, accuracy {:.3}",
        eval.loss,
        eval.accuracy.unwrap_or(0.0)
    );
    let logits = model.predict(&validation)?; // [samples, 3], row-major

    let path = std::env::temp_dir().join("rings.safetensors");
    model.save_weights(&path)?;
    let mut restored = Rings::new(&Device::cpu())?;
    restored.load_weights(&path)?;
    assert_eq!(restored.predict(&validation)?, logits);
    println!("weights saved to {} and loaded back", path.display());
    Ok(())
}

/// `n` points on three noisy rings of radius 1, 2 and 3, and each point's ring.
fn three_rings(n: usize) -> (Vec<f32>, Vec<i32>) {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let (mut points, mut rings) = (Vec::new(), Vec::new());
    for i in 0..n {
        let ring = (i % 3) as i32;
        let radius = 1.0 + ring as f32 + 0.3 * (uniform() - 0.5);
        let angle = std::f32::consts::TAU * uniform();
        points.extend([radius * angle.cos(), radius * angle.sin()]);
        rings.push(ring);
    }
    (points, rings)
}
