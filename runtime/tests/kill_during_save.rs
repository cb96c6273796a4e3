//! Saving is atomic: a child process trains and saves numbered checkpoints in a loop (keeping
//! the last two); this test SIGKILLs it at random moments, 200 times, resuming each new child
//! from the newest checkpoint. After every kill the newest complete checkpoint loads, the one
//! before it loads, the newest one seen before the kill is byte-for-byte unchanged (or was
//! rotated away by a later save), and no file under a checkpoint's name is ever partial.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memwise_plan::{plan, Activation, DType, LayerKind, LossKind, LossTerm, ModelSpec, Optimizer};
use memwise_runtime::{Batch, Device, Executor};

const KILLS: usize = 200;
const BATCH: usize = 8;
/// Environment variable that turns `child_save_loop` into the child.
const CHILD_ENV: &str = "MEMWISE_SAVE_LOOP_DIR";

/// 196 u8 pixels → dense 64 relu → dropout → dense 10; Adam: 13,258 parameters, a
/// checkpoint of about 160 KB (weights and two Adam slots). Small, so that a debug build
/// spends about half of each train-and-save cycle inside `save_checkpoint`.
fn spec() -> ModelSpec {
    let mut m = ModelSpec::new("KillMlp", BATCH);
    m.optimizer = Optimizer::ADAM;
    m.input("pixels", &[196], DType::U8, 1.0 / 255.0);
    m.input("labels", &[], DType::I32, 1.0);
    m.add(
        "hidden",
        LayerKind::dense(64, Activation::Relu),
        &["pixels"],
    );
    m.add("drop", LayerKind::Dropout { rate: 0.2 }, &[]);
    m.add("logits", LayerKind::dense(10, Activation::Softmax), &[]);
    m.loss
        .push(LossTerm::new(LossKind::SparseCategoricalCrossentropy).on(&["logits", "labels"]));
    m
}

fn new_executor() -> Executor {
    Executor::new(plan(&spec()).unwrap(), &Device::cpu(), 5).unwrap()
}

fn name(step: u64) -> String {
    format!("ckpt-{step:08}.safetensors")
}

/// The complete checkpoints in `dir`, oldest first.
fn checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let n = e
                .file_name()
                .to_str()?
                .strip_prefix("ckpt-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()?;
            Some((n, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// Temporary files left by a save that was killed before its rename.
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with('.') && n.contains(".tmp-"))
        })
        .map(|e| e.path())
        .collect()
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn checkpoints_survive_sigkill_at_random_points() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kill-during-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut verifier = new_executor();
    // The newest checkpoint seen after the previous kill, and its bytes.
    let mut last: Option<(u64, Vec<u8>)> = None;
    let (mut mid_save, mut rotated, mut unchanged) = (0usize, 0usize, 0usize);
    let started = Instant::now();
    for round in 0..KILLS {
        let mut child = Command::new(&exe)
            .args([
                "child_save_loop",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until it has loaded the newest checkpoint and entered its save loop …
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            if out.read_line(&mut line).unwrap() == 0 {
                let status = child.wait().unwrap();
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                panic!("round {round}: the child exited ({status}) before it was ready:\n{err}");
            }
            if line.contains("ready ") {
                break;
            }
        }
        // … then kill it at a random moment of its train-and-save cycle.
        std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        let pid = child.id();
        child.kill().unwrap();
        child.wait().unwrap();

        // Its temporaries are left (it was killed mid-save); those of earlier children are
        // removed by the next save to the path (the saves of this one, if it saved at all).
        let mine = format!(".tmp-{pid}-");
        if temporaries(&dir)
            .iter()
            .any(|t| t.to_string_lossy().contains(&mine))
        {
            mid_save += 1;
        }
        let ckpts = checkpoints(&dir);
        let Some((newest, newest_path)) = ckpts.last().cloned() else {
            assert!(last.is_none(), "round {round}: every checkpoint vanished");
            continue;
        };
        // The newest complete checkpoint loads and is the step its name says.
        verifier
            .load_checkpoint(&newest_path)
            .unwrap_or_else(|e| panic!("round {round}: the newest checkpoint does not load: {e}"));
        assert_eq!(verifier.step_counter(), newest, "round {round}");
        // So does the one before it, and any other still on disk.
        for (n, path) in ckpts.iter().rev().skip(1) {
            verifier.load_checkpoint(path).unwrap_or_else(|e| {
                panic!("round {round}: checkpoint {n} (not the newest) does not load: {e}")
            });
            assert_eq!(verifier.step_counter(), *n, "round {round}");
        }
        // Never backwards, and the newest one seen before is untouched unless rotated away.
        let bytes = std::fs::read(&newest_path).unwrap();
        if let Some((n, old)) = &last {
            assert!(
                newest >= *n,
                "round {round}: newest checkpoint went back from {n} to {newest}"
            );
            match std::fs::read(dir.join(name(*n))) {
                Ok(now) => {
                    assert!(now == *old, "round {round}: checkpoint {n} changed on disk");
                    unchanged += 1;
                }
                Err(_) => {
                    assert!(
                        newest >= n + 2,
                        "round {round}: checkpoint {n} vanished before two newer saves"
                    );
                    rotated += 1;
                }
            }
        }
        last = Some((newest, bytes));
    }
    let final_step = last.as_ref().map_or(0, |l| l.0);
    eprintln!(
        "{KILLS} SIGKILLs in {:.1} s: {mid_save} landed mid-save (a temporary file left behind), \
         {unchanged} left the previous newest checkpoint in place, {rotated} after it was rotated \
         away; the children reached step {final_step}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        mid_save > 0,
        "no kill landed during a save: the test does not test anything"
    );
    // Temporaries pile up only until the next save: one more save of every checkpoint name
    // on disk removes what the killed children left.
    let left = temporaries(&dir).len();
    for (_, path) in checkpoints(&dir) {
        verifier.save_checkpoint(&path).unwrap();
    }
    for t in temporaries(&dir) {
        let name = t.file_name().unwrap().to_string_lossy().to_string();
        let stem = name
            .trim_start_matches('.')
            .split(".tmp-")
            .next()
            .unwrap()
            .to_string();
        assert!(
            !dir.join(&stem).exists(),
            "{name}: a save to `{stem}` leaves the temporaries of dead processes behind"
        );
    }
    eprintln!(
        "after {mid_save} kills mid-save, {left} temporaries were still on disk (each later \
         save removes those of dead processes); the final saves left none for their paths"
    );
    assert!(
        final_step > KILLS as u64 / 4,
        "the children made too little progress ({final_step} steps)"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The child of `checkpoints_survive_sigkill_at_random_points` (a no-op in a normal run):
/// resumes from the newest checkpoint, then trains and saves `ckpt-<step>` forever,
/// deleting the one two steps back.
#[test]
fn child_save_loop() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let mut ex = new_executor();
    if let Some((n, path)) = checkpoints(dir).pop() {
        ex.load_checkpoint(&path).unwrap();
        assert_eq!(ex.step_counter(), n);
    }
    println!("ready {}", ex.step_counter());
    for _ in 0..1_000_000 {
        let s = ex.step_counter() as usize;
        let px: Vec<u8> = (0..BATCH * 196)
            .map(|i| ((i * 7 + s * 13) % 256) as u8)
            .collect();
        let labels: Vec<i32> = (0..BATCH).map(|i| ((i + s) % 10) as i32).collect();
        ex.train_step(&[Batch::U8(&px), Batch::I32(&labels)])
            .unwrap();
        let step = ex.step_counter();
        ex.save_checkpoint(dir.join(name(step))).unwrap();
        if step >= 2 {
            let _ = std::fs::remove_file(dir.join(name(step - 2)));
        }
    }
}
