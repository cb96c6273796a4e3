//! Every optimizer with its options, metrics, and Keras's defaults.
use memwise::plan::Optimizer;
use memwise::prelude::*;

macro_rules! mlp {
    ($name:ident, $($opt:tt)*) => {
        #[memwise::model(batch = 8, optimizer = $($opt)*, loss = mse(out, x), metrics = [mse])]
        struct $name {
            #[input(shape = [4])]
            x: Input,
            #[dense(4)]
            out: Dense,
        }
    };
}

mlp!(Sgd, sgd);
mlp!(
    SgdMomentum,
    sgd(learning_rate = 0.1, momentum = 0.9, nesterov = true)
);
mlp!(Momentum, momentum(lr = 0.05));
mlp!(
    Rms,
    rmsprop(
        lr = 1e-4,
        rho = 0.95,
        epsilon = 1e-6,
        momentum = 0.9,
        centered = true
    )
);
mlp!(
    Adam,
    adam(1e-4, beta_1 = 0.8, beta_2 = 0.99, epsilon = 1e-8)
);
mlp!(AdamW, adamw(weight_decay = 0.01));

fn main() {
    assert_eq!(Sgd::spec().optimizer, Optimizer::SGD);
    assert_eq!(
        SgdMomentum::spec().optimizer,
        Optimizer::Momentum {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true
        }
    );
    assert_eq!(
        Momentum::spec().optimizer,
        Optimizer::Momentum {
            lr: 0.05,
            momentum: 0.9,
            nesterov: false
        }
    );
    assert_eq!(
        Rms::spec().optimizer,
        Optimizer::RmsProp {
            lr: 1e-4,
            rho: 0.95,
            epsilon: 1e-6,
            momentum: 0.9,
            centered: true
        }
    );
    assert_eq!(
        Adam::spec().optimizer,
        Optimizer::Adam {
            lr: 1e-4,
            beta_1: 0.8,
            beta_2: 0.99,
            epsilon: 1e-8
        }
    );
    let Optimizer::AdamW {
        weight_decay, lr, ..
    } = AdamW::spec().optimizer
    else {
        panic!()
    };
    assert_eq!((weight_decay, lr), (0.01, 1e-3));
    assert_eq!(
        Sgd::spec().metrics,
        [memwise::plan::Metric::MeanSquaredError]
    );
    // Optimizer state: none for SGD, two slots for Adam.
    assert_eq!(Sgd::MEMORY.optimizer, 0);
    assert!(Adam::MEMORY.optimizer > Rms::MEMORY.optimizer / 4);
}
