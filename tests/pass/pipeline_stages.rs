//! Model parallel: `#[stage(k)]` on the fields that begin each stage, `micro_batches` and
//! `schedule` on the model; and `stages = N`, where the planner chooses the split. Every
//! stage's plan and memory are consts, and the budget applies to each stage.
use memwise::plan::pipeline::PipelineSchedule;
use memwise::plan::stage::{plan_pipeline, Pipeline};
use memwise::prelude::*;

// The VAE's encoder on one device, its decoder on another, 4 micro-batches of 8.
#[memwise::model(batch = 32, optimizer = adam, micro_batches = 4, schedule = gpipe,
                 budget = "64 MiB",
                 loss = binary_crossentropy(decoded, pixels, reduction = sum) + kl_normal(z_mean, z_log_var))]
struct Vae {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[dense(64, activation = relu)]
    enc: Dense,
    #[dense(2, from = enc)]
    z_mean: Dense,
    #[dense(2, from = enc)]
    z_log_var: Dense,
    #[sample_normal(z_mean, z_log_var)]
    z: SampleNormal,
    #[stage(1)]
    #[dense(64, activation = relu)]
    dec: Dense,
    #[dense(784, activation = sigmoid)]
    decoded: Dense,
}

const _: () = assert!(Vae::STAGES.len() == 2 && Vae::MICRO_BATCHES == 4);
const _: () = assert!(Vae::STAGES[1].stage == 1 && Vae::STAGES[0].batch == 8);

// Three stages of the MLP, the split chosen by the planner.
#[memwise::model(batch = 64, stages = 3, micro_batches = 8, loss = sparse_categorical_crossentropy)]
struct Mlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[dense(256, activation = relu)]
    a: Dense,
    #[dense(256, activation = relu)]
    b: Dense,
    #[dense(256, activation = relu)]
    c: Dense,
    #[dense(10, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

// Two replicas of a 2-stage MLP (4 ranks): each stage plans its replica's half of the batch
// in 4 micro-batches, and sums its gradients over its replicas.
#[memwise::model(batch = 64, replicas = 2, micro_batches = 4, budget = "64 MiB",
                 loss = sparse_categorical_crossentropy)]
struct Replicated {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[dense(256, activation = relu)]
    a: Dense,
    #[stage(1)]
    #[dense(10, activation = softmax)]
    probs: Dense,
    #[input(shape = [], dtype = i32)]
    label: Input,
}

const _: () = assert!(Replicated::STAGES.len() == 2 && Replicated::STAGES[0].replicas == 2);
const _: () = assert!(Replicated::STAGES[0].batch == 8 && Replicated::MAX_BATCH % 8 == 0);

fn main() {
    // A replicated stage is the same stage at its replica's share of the batch, to the byte.
    let half = plan_pipeline(&Replicated::spec().one_device().with_batch(32), &Replicated::spec().pipeline.unwrap()).unwrap();
    for (s, plan) in Replicated::STAGES.iter().enumerate() {
        assert_eq!(plan.memory.total, half.stages[s].memory.total);
    }
    assert_eq!(<Replicated as memwise::Model>::max_batch(64 << 20), Some(Replicated::MAX_BATCH));

    let spec = Vae::spec();
    let pipe = spec.pipeline.clone().unwrap();
    assert_eq!(pipe, Pipeline::new(PipelineSchedule::GPipe, 4, &["dec"]));
    let planned = plan_pipeline(&spec, &pipe).unwrap();
    assert_eq!(planned.stages, Vae::STAGES);
    for (s, plan) in Vae::STAGES.iter().enumerate() {
        assert_eq!(Vae::STAGE_MEMORY[s], plan.memory);
        assert!(plan.memory.total <= 64 << 20);
    }
    assert_eq!(Vae::LARGEST_STAGE, planned.largest_stage().0);
    assert_eq!(Vae::BUBBLE_FRACTION, planned.bubble_fraction());
    // The stages hold the model's parameters once; the one-device plan is the comparison.
    let held: u64 = Vae::STAGES.iter().map(|s| s.params_count).sum();
    assert_eq!(held, Vae::PARAMS);
    assert_eq!(Vae::MAX_BATCH % 4, 0);
    // The run-time search is the const's: every stage fits at it, one stage not at the next.
    assert_eq!(<Vae as memwise::Model>::max_batch(64 << 20), Some(Vae::MAX_BATCH));
    let at = |b: usize| plan_pipeline(&spec.with_batch(b), &pipe).unwrap().largest_stage().1;
    assert!(at(Vae::MAX_BATCH) <= 64 << 20 && at(Vae::MAX_BATCH + 4) > 64 << 20);
    let summary = Vae::summary();
    assert!(summary.contains("Split into 2 pipeline stages"), "{summary}");
    assert!(summary.contains("stage 1  dec … decoded"), "{summary}");

    let mlp = Mlp::spec().pipeline.unwrap();
    assert_eq!((mlp.stages(), mlp.micro_batches), (3, 8));
    assert_eq!(Mlp::STAGES.len(), 3);
    assert_eq!(<Mlp as memwise::Model>::STAGES.len(), 3);
}
