//! Developer check: trains the MNIST MLP on the bundled digits.
use memwise_runtime::data::dataset::InMemory;
use memwise_runtime::data::idx::load_bundled_digits;
use memwise_runtime::*;
fn main() -> Result<()> {
    let (train, test) = load_bundled_digits().map_err(|e| RuntimeError::Io(e.to_string()))?;
    let spec = memwise_plan::zoo::mnist_mlp(128);
    let mut m = Trainer::build(&spec, &Device::cpu(), 1)?;
    let (tr, te) = (InMemory::mnist(&train), InMemory::mnist(&test));
    let mut mem = MemoryCallback::default();
    let h = m.fit(
        &tr,
        Some(&te),
        &FitOptions {
            epochs: 5,
            ..Default::default()
        },
        &mut [&mut mem],
    )?;
    println!("median step {:.2} ms", h.step_ms_median());
    Ok(())
}
