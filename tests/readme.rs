//! The README never drifts from the code: the summary it quotes is what the MNIST model it
//! shows really prints, and the model it shows is the one the main example trains.

use memwise::prelude::*;

#[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
                 metrics = [accuracy], budget = "2 GiB")]
pub struct MnistMlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(512, activation = relu, from = pixels)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    logits: Dense,
}

const README: &str = include_str!("../README.md");
const EXAMPLE: &str = include_str!("../examples/mnist_mlp.rs");
const YOUR_OWN: &str = include_str!("../examples/train_your_own.rs");

/// The fenced block of `lang` that follows the first line containing `after`.
fn block_after<'a>(text: &'a str, after: &str, lang: &str) -> &'a str {
    let at = text
        .find(after)
        .unwrap_or_else(|| panic!("README: no `{after}`"));
    let open = format!("```{lang}\n");
    let start = at + text[at..].find(&open).expect("a fenced block") + open.len();
    let len = text[start..].find("```").expect("a closed block");
    &text[start..start + len]
}

/// The lines from `#[memwise::model` to the struct's closing brace.
fn model_source(text: &str) -> String {
    let start = text.find("#[memwise::model").expect("a model");
    let end = start + text[start..].find("\n}\n").expect("the struct's end") + 2;
    text[start..end].to_string()
}

#[test]
fn the_readme_summary_is_what_the_model_prints() {
    let quoted = block_after(README, "prints what the compiler planned", "text");
    assert_eq!(
        quoted.trim_end(),
        MnistMlp::summary().trim_end(),
        "README.md's summary is stale: paste the output of \
         `cargo run --release --example mnist_mlp -- --summary`"
    );
}

#[test]
fn the_readme_model_is_the_main_example() {
    let shown = block_after(README, "## The model", "rust");
    assert_eq!(model_source(shown), model_source(EXAMPLE));
}

/// From `use memwise::prelude::*;` to the end of `fn main`.
fn program_source(text: &str) -> &str {
    let start = text.find("use memwise::prelude::*;").expect("the imports");
    let main = start + text[start..].find("fn main()").expect("a main");
    let end = main + text[main..].find("\n}\n").expect("main's end") + 3;
    &text[start..end]
}

#[test]
fn the_readme_training_walkthrough_is_the_example() {
    let shown = block_after(README, "## Train your own model", "rust");
    assert_eq!(program_source(shown), program_source(YOUR_OWN));
}

/// The model of `tests/pass/checkpoint_auto.rs`, which the README's budget section quotes.
#[memwise::model(batch = 1024, loss = mse(out, target), budget = "15 MiB", checkpoint = auto)]
struct AutoNet {
    #[input(shape = [512])]
    x: Input,
    #[input(shape = [512])]
    target: Input,
    #[dense(256, activation = gelu, from = x)]
    h1: Dense,
    #[dense(256, activation = gelu)]
    h2: Dense,
    #[dense(256, activation = gelu)]
    h3: Dense,
    #[dense(256, activation = gelu)]
    h4: Dense,
    #[dense(512)]
    out: Dense,
}

#[test]
fn the_readme_quotes_what_checkpoint_auto_chose() {
    let shown = block_after(README, "## Fitting a budget, or a device", "rust");
    let start = shown.find("what the solver chose: \"").expect("the quote") + 24;
    let end = start + shown[start..].find('"').expect("its end");
    let quoted: Vec<&str> = shown[start..end]
        .split_whitespace()
        .filter(|w| *w != "//")
        .collect();
    assert_eq!(quoted.join(" "), AutoNet::AUTO_CHECKPOINT);
}

#[test]
fn the_readme_lists_every_layer_of_the_catalogue() {
    let start = README.find("\nLayers: ").expect("a list of layers") + "\nLayers: ".len();
    let end = start + README[start..].find("; modifiers").expect("the list's end");
    let listed: Vec<String> = README[start..end]
        .split(',')
        .map(|w| w.trim().trim_matches('`').to_string())
        .collect();
    let catalogue: Vec<String> = memwise::plan::layers::CATALOGUE
        .iter()
        .filter(|d| d.inputs != memwise::plan::layers::Inputs::None)
        .map(|d| d.name.to_string())
        .collect();
    assert_eq!(
        listed, catalogue,
        "README.md's \"Layers:\" list is not the layer catalogue's (planner/src/layers/)"
    );
}
