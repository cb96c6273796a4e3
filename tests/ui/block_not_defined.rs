struct Plain;

#[memwise::model(batch = 32, loss = mse)]
struct Net {
    #[input(shape = [64])]
    x: Input,
    #[block]
    hidden: Plain,
}

fn main() {}
