//! Developer aid: where a VAE training step's time goes, per (phase, op).
use memwise_runtime::*;
fn main() -> Result<()> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "vae".into());
    let spec = if which == "mlp" {
        memwise_plan::zoo::mnist_mlp(128)
    } else {
        memwise_plan::zoo::conv_vae(128)
    };
    let p = memwise_plan::plan(&spec)?;
    let mut ex = Executor::new(p.clone(), &Device::cpu(), 1)?;
    let px = vec![100u8; p.tensor(p.inputs[0]).elems()];
    let labels: Vec<i32> = (0..128).map(|i| i % 10).collect();
    let inputs: Vec<Batch> = if p.inputs.len() == 2 {
        vec![Batch::U8(&px), Batch::I32(&labels)]
    } else {
        vec![Batch::U8(&px)]
    };
    ex.train_step(&inputs)?;
    ex.enable_profiling();
    let t = std::time::Instant::now();
    let n = 10;
    for _ in 0..n {
        ex.train_step(&inputs)?;
    }
    println!("{} ms per step", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    for (k, s) in ex.profile().iter().take(12) {
        println!("{k:40} {:8.2} ms", s * 1e3 / n as f64);
    }
    Ok(())
}
