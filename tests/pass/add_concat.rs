//! add (with an activation) and concat: a residual and a two-branch merge.
use memwise::prelude::*;

#[memwise::model(batch = 32, loss = sparse_categorical_crossentropy)]
struct Branches {
    #[input(shape = [16, 16, 8])]
    x: Input,
    #[conv2d(8, 3, padding = same, activation = relu)]
    branch_a: Conv2d,
    #[conv2d(8, 1, from = x)]
    branch_b: Conv2d,
    #[add(branch_a, branch_b, x, activation = relu)]
    sum: Add,
    #[conv2d(4, 3, padding = same, from = sum)]
    left: Conv2d,
    #[conv2d(12, 1, from = sum)]
    right: Conv2d,
    #[concat(left, right, axis = -1)]
    joined: Concat,
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dense(3, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

fn main() {
    let spec = Branches::spec();
    assert_eq!(
        spec.layer("sum").unwrap().inputs,
        ["branch_a", "branch_b", "x"]
    );
    assert_eq!(spec.layer("joined").unwrap().inputs, ["left", "right"]);
    let joined = Branches::MEMORY
        .layers
        .iter()
        .find(|l| l.name == "joined")
        .unwrap()
        .clone();
    assert_eq!(joined.output_shape.last(), Some(&16));
}
