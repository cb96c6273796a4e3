//! Blocks: parameters with defaults, arithmetic on them, `from`, arrays of blocks, nested
//! blocks, a block from another module, and the handles they give.
use memwise::prelude::*;

mod parts {
    use memwise::prelude::*;

    /// conv → batch norm → relu.
    #[memwise::block(filters, kernel = 3, strides = 1)]
    pub struct ConvBnRelu {
        #[conv2d(filters, kernel, strides = strides, padding = same, use_bias = false)]
        conv: Conv2d,
        #[batch_norm]
        bn: BatchNorm,
        #[activation(relu)]
        relu: Activation,
    }
}
use parts::ConvBnRelu;

/// Two conv-bn-relu blocks and a projection shortcut.
#[memwise::block(width)]
struct Residual {
    #[block(filters = width, strides = 2)]
    a: ConvBnRelu,
    #[block(filters = width * 2, kernel = 1)]
    b: ConvBnRelu,
    #[conv2d(width * 2, 1, strides = 2, from = input)]
    shortcut: Conv2d,
    #[add(b, shortcut)]
    out: Add,
}

#[memwise::model(batch = 8, loss = sparse_categorical_crossentropy)]
struct Net {
    #[input(shape = [32, 32, 3])]
    image: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[block(from = image, filters = 16, kernel = 5)]
    stem: ConvBnRelu,
    #[block(width = 8)]
    stages: [Residual; 2],
    #[global_avg_pool]
    pool: GlobalAvgPool,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

fn main() {
    let spec = Net::spec();
    let names: Vec<&str> = spec.layers.iter().map(|l| l.name.as_str()).collect();
    assert!(names.contains(&"stem.conv"));
    assert!(names.contains(&"stages.1.b.relu"));
    assert_eq!(spec.layer("stem.conv").unwrap().inputs, ["image"]);
    assert_eq!(spec.layer("stages.0.a.conv").unwrap().inputs, ["stem.relu"]);
    assert_eq!(
        spec.layer("stages.1.a.conv").unwrap().inputs,
        ["stages.0.out"]
    );
    assert_eq!(
        spec.layer("stages.1.shortcut").unwrap().inputs,
        ["stages.0.out"]
    );
    assert_eq!(spec.layer("pool").unwrap().inputs, ["stages.1.out"]);
    let layers = Net::layers();
    assert_eq!(layers.stages[1].shortcut.name(), "stages.1.shortcut");
    assert_eq!(layers.stages.len(), 2);
    assert_eq!(
        Net::MEMORY
            .layers
            .iter()
            .filter(|l| l.kind == "conv2d")
            .count(),
        1 + 2 * 3
    );
}

impl Net {
    fn _handles(&self) -> &'static str {
        self.probs.name()
    }
}
