//! The DSL models of `examples/dsl_models.rs` against the planner's zoo, built with the
//! Rust API: the same architecture written two ways must plan to the same bytes.
// The example loads three example files, each with its own `mod common;`.
#![allow(clippy::duplicate_mod)]
use memwise::plan::{plan, zoo};
use memwise::Model;

#[allow(dead_code)]
#[path = "../examples/dsl_models.rs"]
mod models;
use models::{ConvNet, ConvVae, Gpt2Small, MnistMlp, ResNet50};

fn same_as_zoo<M: Model>(zoo_spec: memwise::plan::ModelSpec) {
    let from_zoo = plan(&zoo_spec).expect("zoo model plans");
    let name = &M::PLAN.model;
    assert_eq!(
        M::PLAN.params_count,
        from_zoo.params_count,
        "{name}: parameters"
    );
    assert_eq!(
        M::PLAN.trainable_count,
        from_zoo.trainable_count,
        "{name}: trainable"
    );
    let (a, b) = (&M::MEMORY, &from_zoo.memory);
    assert_eq!(
        (
            a.params,
            a.grads,
            a.optimizer,
            a.activations_peak,
            a.workspace_peak,
            a.inputs,
            a.total
        ),
        (
            b.params,
            b.grads,
            b.optimizer,
            b.activations_peak,
            b.workspace_peak,
            b.inputs,
            b.total
        ),
        "{name}: memory"
    );
}

#[test]
fn mnist_mlp_matches_zoo() {
    same_as_zoo::<MnistMlp>(zoo::mnist_mlp(128));
}

#[test]
fn conv_vae_matches_zoo() {
    same_as_zoo::<ConvVae>(zoo::conv_vae(128));
}

#[test]
fn resnet50_matches_zoo() {
    same_as_zoo::<ResNet50>(zoo::resnet50(32));
    assert_eq!(ResNet50::PARAMS, 25_610_152);
}

#[test]
fn gpt2_small_matches_zoo() {
    same_as_zoo::<Gpt2Small>(zoo::gpt2_stack(8, zoo::GPT2_LAYERS));
    assert_eq!(Gpt2Small::PARAMS, 85_056_000);
}

#[test]
fn compile_time_plans_equal_run_time_plans() {
    assert_eq!(MnistMlp::plan_for_batch(128).unwrap(), MnistMlp::PLAN);
    assert_eq!(ConvNet::plan_for_batch(64).unwrap(), ConvNet::PLAN);
    assert_eq!(ConvVae::plan_for_batch(128).unwrap(), ConvVae::PLAN);
    assert_eq!(ResNet50::plan_for_batch(32).unwrap(), ResNet50::PLAN);
    assert_eq!(Gpt2Small::plan_for_batch(8).unwrap(), Gpt2Small::PLAN);
}

/// Lines of the definitions between two markers of the example file.
fn lines_between(start: &str, end: &str) -> usize {
    let src = include_str!("../examples/dsl_models.rs");
    let (a, b) = (
        src.find(start).expect("start marker"),
        src.find(end).expect("end marker"),
    );
    src[a..b].lines().filter(|l| !l.trim().is_empty()).count()
}

#[test]
fn big_models_are_short() {
    let resnet = lines_between("// ---- ResNet-50", "// ---- GPT-2");
    let gpt = lines_between("// ---- GPT-2", "// Checked by the compiler");
    assert!(resnet < 60, "ResNet-50 takes {resnet} lines");
    assert!(gpt < 60, "GPT-2 takes {gpt} lines");
}
