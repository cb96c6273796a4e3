#[memwise::model(batch = 32, loss = mse)]
enum Net {
    Input,
    Dense,
}

fn main() {}
