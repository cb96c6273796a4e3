#!/usr/bin/env bash
# Step time of the three examples from two builds, side by side in one run (the run reports'
# `step_ms_median`). Each example runs 4 times per build, in the order old new new old old new
# new old: on this machine whichever binary runs first in a pair tends to be faster, so
# alternating cancels that. For "is this change slower?" on one machine, where only a
# side-by-side ratio means anything; the last rows are the medians and their ratio.
#
#   bash scripts/step-time-compare.sh OLD_EXAMPLES_DIR [NEW_EXAMPLES_DIR]
#   (e.g. a target/release/examples of an older checkout; NEW defaults to this one's)
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:?usage: step-time-compare.sh OLD_EXAMPLES_DIR [NEW_EXAMPLES_DIR]}"
new="${2:-target/release/examples}"
out="$(mktemp -d)"
run() { # example, build (old/new), run number
  local dir="$old"; [ "$2" = new ] && dir="$new"
  local steps=40; [ "$1" != mnist_mlp ] && steps=15
  "$dir/$1" --device cpu --steps "$steps" --epochs 1 --report-json "$out/$1-$2-$3.json" >/dev/null 2>&1
}
for ex in mnist_mlp convnet vae; do
  for r in 1 2 3 4; do
    if [ $((r % 2)) = 1 ]; then run "$ex" old "$r"; run "$ex" new "$r"
    else run "$ex" new "$r"; run "$ex" old "$r"; fi
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
ms = lambda ex, b, r: json.load(open(f"{out}/{ex}-{b}-{r}.json"))["measured"]["step_ms_median"]
print("| example | old runs (ms) | new runs (ms) | old median | new median | new / old |")
print("|---|---|---|--:|--:|--:|")
for ex in ["mnist_mlp", "convnet", "vae"]:
    o = [ms(ex, "old", r) for r in range(1, 5)]
    n = [ms(ex, "new", r) for r in range(1, 5)]
    mo, mn = statistics.median(o), statistics.median(n)
    f = lambda v: ", ".join(f"{x:.2f}" for x in v)
    print(f"| {ex} | {f(o)} | {f(n)} | {mo:.2f} | {mn:.2f} | {mn / mo:.3f} |")
PY
rm -rf "$out"
