#[memwise::model(batch = 32, loss = mse)]
struct Net {}

fn main() {}
