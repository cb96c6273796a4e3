"""memwise vs PyTorch, side by side on this machine's CPU (see docs/BENCHMARKS.md).

For each example (mnist_mlp, vae, convnet, gpt) this runs, in fresh processes and one after the
other:

1. the memwise example, release build, ``--device cpu --no-shuffle --steps N`` with
   ``--save-initial-weights``, ``--dump-batches`` and ``--report-json``;
2. its PyTorch twin (bench/twins.py) from those initial weights on those batches;

and prints, for both: the median step time, samples/s, the peak resident growth (VmHWM minus
the resident size just before the model is built, the peak reset there, as memwise's
MemoryMonitor measures it), and the largest relative difference between the two losses over
the first 20 steps. ``--rounds R`` alternates the two R times and reports the median of the
per-round medians (the machine may be shared: the load average is printed with the table).

PyTorch runs under each of ``--torch-configs`` (default: 2 threads; 2 threads with
``OMP_WAIT_POLICY=PASSIVE``; 1 thread; each again with the channels-last memory format, the
NHWC layout memwise itself uses, for the image models) and the fastest is reported: on a
shared, loaded machine PyTorch's spinning OpenMP threads can be 30x slower than either
alternative, and the comparison is meant against PyTorch at its best on these cores.

The losses compared are those of the reported (float32) twin runs. ``--loss-precision f64`` or
``f64r`` runs the twin once more per model in float64 (``f64r``: each layer's output rounded to
float32) and compares those losses instead; step times and memory still come from the float32
runs. These are diagnostics for the convnet's divergence (docs/BENCHMARKS.md).

    bash bench/setup.sh                       # once: bench/.venv with torch, numpy, safetensors
    bench/.venv/bin/python bench/compare.py   # builds the examples (cargo build --release)
    bench/.venv/bin/python bench/compare.py --models vae --steps 60 --rounds 3 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["mnist_mlp", "vae", "convnet", "gpt"]
COMPARED_STEPS = 20
TOLERANCE = 1e-4


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def build(models: list[str]) -> None:
    cmd = ["cargo", "build", "--release", "-p", "memwise"]
    for m in models:
        cmd += ["--example", m]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True)


def run_memwise(model: str, steps: int, batch: int | None, seed: int, work: Path, dump: bool) -> dict:
    exe = target_dir() / "release" / "examples" / model
    report = work / f"{model}.memwise.json"
    cmd = [str(exe), "--device", "cpu", "--no-shuffle", "--steps", str(steps), "--seed", str(seed),
           "--report-json", str(report)]
    if batch:
        cmd += ["--batch", str(batch)]
    if dump:
        cmd += ["--save-initial-weights", str(work / f"{model}.init.safetensors"),
                "--dump-batches", str(work / f"{model}.batches.safetensors")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return json.loads(report.read_text())


def parse_config(c: str) -> tuple[int, bool, bool]:
    """`2` → 2 threads; `2p` → with OMP_WAIT_POLICY=PASSIVE; a `c` → channels-last."""
    return int(c.rstrip("pc")), "p" in c, "c" in c


def run_torch(model: str, steps: int, config: str, work: Path, precision: str = "f32") -> dict:
    threads, passive, channels_last = parse_config(config)
    report = work / f"{model}.torch.json"
    cmd = [sys.executable, str(ROOT / "bench" / "twins.py"), "--model", model,
           "--weights", str(work / f"{model}.init.safetensors"),
           "--batches", str(work / f"{model}.batches.safetensors"),
           "--steps", str(steps), "--threads", str(threads), "--precision", precision,
           "--report-json", str(report)] + (["--channels-last"] if channels_last else [])
    env = dict(os.environ)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return json.loads(report.read_text())


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    """|a - b| / |a| for the first COMPARED_STEPS steps (a: memwise)."""
    n = min(len(a), len(b), COMPARED_STEPS)
    return [abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a[:n], b[:n])]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(rel_diffs(a, b))


def mib(b: float) -> str:
    return f"{b / 1048576:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (≥ 20)")
    ap.add_argument("--batch", type=int, help="override every model's batch")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="alternate memwise/PyTorch this many times")
    ap.add_argument("--torch-configs", default=",".join(
        f"{t}{c}" for c in ("", "c") for t in (f"{os.cpu_count() or 1}", f"{os.cpu_count() or 1}p", "1")),
                    help="PyTorch settings to try, comma-separated: N threads, Np = N threads with "
                         "OMP_WAIT_POLICY=PASSIVE, a trailing c = channels-last memory format; the "
                         "fastest (median over rounds) is reported")
    ap.add_argument("--loss-precision", choices=["f32", "f64", "f64r"], default="f32",
                    help="compare the losses of the float32 twin runs (f32, default) or of one extra "
                         "twin run in float64 (f64r: each layer rounded to float32); diagnostics")
    ap.add_argument("--no-build", action="store_true", help="use the examples already built")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--json", help="also write every figure here")
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            sys.exit(f"unknown model {m!r}")
    steps = max(a.steps, COMPARED_STEPS)
    if not a.no_build:
        build(models)

    import torch  # noqa: F401  (fail early when the venv is missing)

    load_before = loadavg()
    t_start = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memwise-bench-") as tmp:
        work = Path(tmp)
        for m in models:
            configs = [c for c in a.torch_configs.split(",") if c]
            mw_runs, by_config = [], {c: [] for c in configs}
            for r in range(a.rounds):
                mw_runs.append(run_memwise(m, steps, a.batch, a.seed, work, dump=(r == 0)))
                line = f"{m} round {r + 1}: memwise {mw_runs[-1]['measured']['step_ms_median']:.2f} ms"
                for c in configs:
                    by_config[c].append(run_torch(m, steps, c, work))
                    line += f", PyTorch[{c}] {by_config[c][-1]['measured']['step_ms_median']:.2f} ms"
                print(f"{line} (load {loadavg()})", file=sys.stderr)

            def med(runs, key):
                return statistics.median(x["measured"][key] for x in runs)

            best = min(configs, key=lambda c: med(by_config[c], "step_ms_median"))
            pt_runs = by_config[best]
            mw_ms, pt_ms = med(mw_runs, "step_ms_median"), med(pt_runs, "step_ms_median")
            mw_rss, pt_rss = med(mw_runs, "peak_rss_growth_bytes"), med(pt_runs, "peak_rss_growth_bytes")
            batch = mw_runs[0]["batch"]
            loss_runs = pt_runs
            if a.loss_precision != "f32":
                loss_runs = [run_torch(m, COMPARED_STEPS, "1", work, a.loss_precision)]
            diff = max(max_rel(x["loss"], y["loss"]) for x, y in zip(mw_runs, loss_runs))
            per_step = rel_diffs(mw_runs[0]["loss"], loss_runs[0]["loss"])
            over = next((i + 1 for i, d in enumerate(per_step) if not d <= TOLERANCE), None)
            rows.append({
                "model": m, "batch": batch, "steps": steps, "rounds": a.rounds,
                "memwise": {"step_ms": mw_ms, "samples_per_s": batch / mw_ms * 1e3, "peak_rss_growth_bytes": mw_rss,
                            "estimate_total_bytes": mw_runs[0]["estimate"]["total"]},
                "torch": {"step_ms": pt_ms, "samples_per_s": batch / pt_ms * 1e3, "peak_rss_growth_bytes": pt_rss},
                "torch_config": best,
                "torch_all": {c: med(v, "step_ms_median") for c, v in by_config.items()},
                "step_ratio": mw_ms / pt_ms, "rss_ratio": mw_rss / pt_rss if pt_rss else float("nan"),
                "max_rel_loss_diff_20": diff, "loss_precision": a.loss_precision,
                "rel_loss_diff_per_step": per_step, "first_step_over_tolerance": over,
                "loss_memwise": mw_runs[0]["loss"][:COMPARED_STEPS], "loss_torch": loss_runs[0]["loss"][:COMPARED_STEPS],
            })
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "nproc": os.cpu_count(),
        "torch": torch.__version__, "torch_configs": a.torch_configs, "python": platform.python_version(),
        "loss_precision": a.loss_precision,
        "load_before": load_before, "load_after": loadavg(), "seconds": round(time.time() - t_start, 1),
    }
    hdr = ("model", "batch", "memwise ms", "PyTorch ms", "PyTorch setting", "ratio", "memwise samples/s", "PyTorch samples/s",
           "memwise RSS MiB", "PyTorch RSS MiB", "ratio", "max rel loss diff (20 steps)")
    lines = []
    for r in rows:
        mw, pt = r["memwise"], r["torch"]
        lines.append((r["model"], str(r["batch"]), f"{mw['step_ms']:.2f}", f"{pt['step_ms']:.2f}", r["torch_config"],
                      f"{r['step_ratio']:.2f}",
                      f"{mw['samples_per_s']:.0f}", f"{pt['samples_per_s']:.0f}", mib(mw["peak_rss_growth_bytes"]),
                      mib(pt["peak_rss_growth_bytes"]), f"{r['rss_ratio']:.2f}", f"{r['max_rel_loss_diff_20']:.1e}"))
    if a.markdown:
        print("| " + " | ".join(hdr) + " |")
        print("|---|" + "--:|" * (len(hdr) - 1))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(hdr)]
        print("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(f"\n{env['date']}, {env['cpu']}, nproc {env['nproc']}, torch {env['torch']} (settings tried: {a.torch_configs}), "
          f"{steps} steps x {a.rounds} round(s), load average {env['load_before']} -> {env['load_after']}"
          + ("" if a.loss_precision == "f32" else f"; losses compared with the {a.loss_precision} twin"))
    bad = [r for r in rows if not r["max_rel_loss_diff_20"] <= TOLERANCE]
    if bad:
        print(f"losses differ by more than {TOLERANCE:g} relative within {COMPARED_STEPS} steps: "
              + ", ".join(f"{r['model']} (from step {r['first_step_over_tolerance']})" for r in bad))
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
