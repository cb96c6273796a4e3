//! What a model tells about its memory: the summary (compact and wide, totals equal to
//! `MEMORY`, the measured peak, the automatic checkpoint choice), `MAX_BATCH` /
//! `max_batch`, and `fit_to_device`.

use memwise::plan::advice::format_bytes;
use memwise::plan::checkpoint::Policy;
use memwise::prelude::*;
use memwise::runtime::fit_device::margin;
use memwise::runtime::Device;
use memwise::summary::{Summary, COMPACT_WIDTH};

#[memwise::model(batch = 128, optimizer = rmsprop(lr = 1e-3), loss = sparse_categorical_crossentropy,
                 budget = "2 GiB")]
struct Mlp {
    #[input(shape = [784], dtype = u8, scale = 1.0 / 255.0)]
    pixels: Input,
    #[input(shape = [], dtype = i32)]
    labels: Input,
    #[dense(512, activation = relu, from = pixels)]
    a_hidden_layer_with_a_name_longer_than_the_compact_column: Dense,
    #[dropout(0.2)]
    drop: Dropout,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

#[memwise::model(batch = 1024, loss = mse(out, target), budget = "15 MiB", checkpoint = auto)]
struct Auto {
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

/// Activations dominate: 4 dense layers of 1024 at batch 8192.
#[memwise::model(batch = 8192, loss = mse(out, target))]
struct Deep {
    #[input(shape = [256])]
    x: Input,
    #[input(shape = [256])]
    target: Input,
    #[dense(1024, activation = gelu, from = x)]
    hidden: [Dense; 4],
    #[dense(256)]
    out: Dense,
}

/// Mixed float16, a 10-unit head: its GEMM is not tensor-core shaped.
#[memwise::model(batch = 64, precision = mixed_float16, loss = sparse_categorical_crossentropy)]
struct Half {
    #[input(shape = [256])]
    x: Input,
    #[input(shape = [], dtype = i32)]
    label: Input,
    #[dense(128, activation = relu, from = x)]
    hidden: Dense,
    #[dense(10, activation = softmax)]
    probs: Dense,
}

/// The value printed after `label` on the totals line that starts with it.
fn line_with<'a>(text: &'a str, label: &str) -> &'a str {
    text.lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no line `{label}` in\n{text}"))
}

#[test]
fn the_summary_totals_are_memory() {
    for (text, m) in [
        (Mlp::summary(), Mlp::MEMORY),
        (Auto::summary(), Auto::MEMORY),
        (Summary::of::<Deep>().wide().to_string(), Deep::MEMORY),
    ] {
        for (label, bytes) in [
            ("parameters", m.params),
            ("gradients", m.grads),
            ("optimizer state", m.optimizer),
            ("activations (peak)", m.activations_peak),
            ("workspace (peak)", m.workspace_peak),
            ("inputs (peak)", m.inputs),
            ("total", m.total),
        ] {
            let line = line_with(&text, label);
            assert!(line.contains(&format_bytes(bytes)), "{label}: {line}");
        }
        let arena = line_with(&text, "Arena");
        assert!(arena.contains(&format_bytes(m.arena)), "{arena}");
        assert!(arena.contains(&format_bytes(m.lower_bound)), "{arena}");
        assert!(text.contains("binary units"), "{text}");
    }
    let total = line_with(&Mlp::summary(), "total").to_string();
    assert!(total.contains("of a 2 GiB budget"), "{total}");
}

#[test]
fn the_compact_summary_fits_80_columns_and_the_wide_one_shows_everything() {
    for text in [Mlp::summary(), Auto::summary(), Deep::summary()] {
        for line in text.lines() {
            assert!(
                line.chars().count() <= COMPACT_WIDTH,
                "{} columns: {line}",
                line.chars().count()
            );
        }
    }
    let compact = Mlp::summary();
    assert!(
        compact.contains("a_hidden_layer_with_a_name_…"),
        "{compact}"
    );
    // The ReLU after the dense GEMM writes over the GEMM's output: the in-place flag.
    assert!(
        line_with(&compact, "a_hidden_layer").ends_with('I'),
        "{compact}"
    );
    assert!(
        !line_with(&compact, "drop (dropout)").ends_with('I'),
        "{compact}"
    );
    let wide = Summary::of::<Mlp>().wide().to_string();
    for column in [
        "DType",
        "Checkpointed",
        "In-place",
        "Fwd FLOPs",
        "Persistent",
    ] {
        assert!(wide.contains(column), "{column} missing:\n{wide}");
    }
    assert!(wide.contains("a_hidden_layer_with_a_name_longer_than_the_compact_column (dense)"));
    assert!(wide.lines().any(|l| l.chars().count() > COMPACT_WIDTH));
}

#[test]
fn the_wide_summary_notes_tensor_core_shapes() {
    let wide = Summary::of::<Half>().wide().to_string();
    let note = line_with(&wide, "Tensor cores:");
    assert!(note.contains("1 of 2 16-bit GEMMs"), "{note}");
    assert!(note.contains("`probs` (n = 10)"), "{note}");
    assert!(
        !Half::summary().contains("Tensor cores"),
        "compact leaves it out"
    );
    assert!(!Summary::of::<Mlp>()
        .wide()
        .to_string()
        .contains("Tensor cores"));
}

#[test]
fn the_summary_shows_checkpointing_and_what_auto_chose() {
    let text = Auto::summary();
    // The checkpointed layers carry the C flag.
    assert!(
        text.lines()
            .any(|l| l.contains("(dense)") && (l.ends_with(" C") || l.contains(" C I"))),
        "{text}"
    );
    let cp = line_with(&text, "Checkpointing:");
    assert!(cp.contains("% of forward FLOPs again"), "{cp}");
    let at = text.find("checkpoint = auto:").expect("the auto choice");
    let auto = text[at..].replace("\n  ", " ");
    assert!(auto.contains(Auto::AUTO_CHECKPOINT), "{auto}");
    assert!(auto.contains("recomputes"), "{auto}");
    // One figure for one choice: the summary's share is the solver's.
    let share = |s: &str, before: &str| -> String {
        let end = s.find(before).expect("a share");
        s[..end]
            .rsplit(' ')
            .find(|w| !w.is_empty())
            .unwrap()
            .trim_end_matches('%')
            .to_string()
    };
    assert_eq!(
        share(cp, " % of forward FLOPs"),
        share(&auto, "% of forward FLOPs"),
        "{text}"
    );
    assert!(!Mlp::summary().contains("Checkpointing:"));
}

#[test]
fn the_measured_peak_stands_beside_the_estimate() {
    let est = Mlp::MEMORY.total + (1 << 20);
    let measured = est + est / 20;
    let text = Summary::of::<Mlp>()
        .measured_peak(Some(measured), 1 << 20)
        .to_string();
    let line = line_with(&text, "measured peak");
    assert!(line.contains(&format_bytes(measured)), "{line}");
    assert!(line.contains("+5.0 %"), "{line}");
    assert!(line.contains(&format_bytes(est)), "{line}");
    assert!(line_with(&text, "+ host").contains("1 MiB"));
    // The totals block alone.
    let totals = Summary::of::<Mlp>()
        .measured_peak(Some(measured), 0)
        .totals();
    assert!(totals.starts_with("Total params"));
    assert!(!totals.contains("Layer (type)"));
}

#[test]
fn max_batch_is_the_largest_batch_that_fits() {
    let budget = 2u64 << 30;
    assert_eq!(Mlp::BUDGET, Some(budget));
    assert_eq!(Some(Mlp::MAX_BATCH), <Mlp as Model>::max_batch(budget));
    let fits = |b: usize| Mlp::plan_for_batch(b).unwrap().memory.total <= budget;
    assert!(fits(Mlp::MAX_BATCH) && !fits(Mlp::MAX_BATCH + 1));
    const { assert!(Mlp::MAX_BATCH > 128) };

    // checkpoint = auto: the largest batch with the checkpoints chosen at that batch.
    let budget = 15u64 << 20;
    assert_eq!(Some(Auto::MAX_BATCH), <Auto as Model>::max_batch(budget));
    const { assert!(Auto::MAX_BATCH >= 1024) };
    // `Plain` keeps the checkpoints chosen at batch 1024; without any it fits less.
    let plain = <Auto as Model>::max_batch_with(budget, Policy::Plain).unwrap();
    assert!((1024..=Auto::MAX_BATCH).contains(&plain));
    let mut bare = Auto::spec();
    bare.layers.iter_mut().for_each(|l| l.checkpoint = None);
    let unchecked =
        memwise::plan::checkpoint::max_batch_with(&bare, budget, Policy::Plain).unwrap();
    assert!(unchecked < 1024);
    let both = <Auto as Model>::max_batch_with(budget, Policy::Fp16AndAutoCheckpoint).unwrap();
    assert!(both >= Auto::MAX_BATCH);
    assert_eq!(<Deep as Model>::max_batch(1 << 10), None);
}

/// A CPU device whose budget (limit less the margin) is `budget`.
fn cpu_with_budget(budget: u64) -> Device {
    let limit = budget + (64 << 20);
    assert_eq!(
        margin(limit, false),
        64 << 20,
        "the floor applies below 1.25 GiB"
    );
    Device::cpu().with_memory_limit(limit)
}

#[test]
fn fit_to_device_keeps_checkpoints_or_lowers_the_batch() {
    let total = Deep::MEMORY.total;
    // Room to spare: as declared.
    let (trainer, chosen) = Deep::fit_to_device(&cpu_with_budget(total + (1 << 20))).unwrap();
    assert_eq!(trainer.plan().batch, 8192);
    assert!(chosen.fit.checkpoint.is_none());
    assert!(
        chosen.to_string().contains("batch 8192 as declared"),
        "{chosen}"
    );
    drop(trainer);

    // 80 % of it: checkpointed at the same batch.
    let budget = total / 10 * 8;
    let (trainer, chosen) = Deep::fit_to_device(&cpu_with_budget(budget)).unwrap();
    assert_eq!(trainer.plan().batch, 8192);
    assert!(trainer.plan().memory.total <= budget);
    assert!(chosen.fit.checkpoint.is_some(), "{chosen}");
    assert!(chosen.to_string().contains("recomputes"), "{chosen}");
    drop(trainer);

    // A quarter: a smaller batch.
    let budget = total / 4;
    let (trainer, chosen) = Deep::fit_to_device(&cpu_with_budget(budget)).unwrap();
    assert!(trainer.plan().batch < 8192, "{chosen}");
    assert!(trainer.plan().memory.total <= budget);
    assert!(chosen.to_string().contains("declared 8192"), "{chosen}");
    drop(trainer);

    // Nothing fits: an error with the numbers, nothing built.
    let e = match Deep::fit_to_device(&Device::cpu().with_memory_limit(1 << 20)) {
        Ok(_) => panic!("a 1 MiB device fits nothing"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("even at batch 1"), "{e}");
}

/// The summary's rows add up to the total it prints, for every zoo model (the examples' MLP
/// and VAE among them) and this file's models, at their batch and checkpointed.
#[test]
fn the_summary_rows_add_up_to_the_total() {
    use memwise::summary::total_rows;
    let mut reports = vec![Mlp::MEMORY, Auto::MEMORY, Deep::MEMORY, Half::MEMORY];
    for (_, spec) in memwise::plan::zoo::all(0.25) {
        reports.push(memwise::plan::plan(&spec).unwrap().memory);
    }
    for m in &reports {
        let sum: u64 = total_rows(m).iter().map(|r| r.1).sum();
        assert_eq!(sum, m.total, "{m:?}");
    }
}
