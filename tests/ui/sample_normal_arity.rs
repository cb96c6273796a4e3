use memwise::prelude::*;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [16])]
    x: Input,
    #[dense(2)]
    z_mean: Dense,
    #[sample_normal(z_mean)]
    z: SampleNormal,
}

fn main() {}
