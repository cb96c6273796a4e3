#!/usr/bin/env bash
# Measured peak resident growth beside the estimate for every example at its default batch
# and at a large one, the three user-written models, and `vae --compare`'s five variants:
# the table in docs/BENCHMARKS.md ("Measured vs estimated"). Each run is its own process
# (release build, CPU), and writes a memwise.report/1 file read back here.
#
#   bash scripts/estimate-table.sh [STEPS]     (default 6 steps per run)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-6}"
cargo build --release --examples -q
out="$(mktemp -d)"
bin=target/release/examples
runs=(
  "mnist_mlp|128|$bin/mnist_mlp --device cpu --steps $steps --epochs 1"
  "mnist_mlp|4096|$bin/mnist_mlp --device cpu --batch 4096 --steps $steps --epochs 1"
  "convnet|64|$bin/convnet --device cpu --steps $steps --epochs 1"
  "convnet|512|$bin/convnet --device cpu --batch 512 --steps $steps --epochs 1"
  "vae|128|$bin/vae --device cpu --steps $steps --epochs 1"
  "vae|2048|$bin/vae --device cpu --batch 2048 --steps $steps --epochs 1"
  "user_models unet|16|$bin/user_models --model unet --device cpu --steps $steps"
  "user_models unet|256|$bin/user_models --model unet --device cpu --batch 256 --steps $steps"
  "user_models gpt|32|$bin/user_models --model gpt --device cpu --steps $steps"
  "user_models gpt|512|$bin/user_models --model gpt --device cpu --batch 512 --samples 1024 --steps $steps"
  "user_models resnet|32|$bin/user_models --model resnet --device cpu --steps $steps"
  "user_models resnet|256|$bin/user_models --model resnet --device cpu --batch 256 --steps $steps"
  "cats_vs_dogs|32|$bin/cats_vs_dogs --device cpu --steps $steps"
  "cats_vs_dogs|96|$bin/cats_vs_dogs --device cpu --batch 96 --steps $steps"
)
echo "| run | batch | estimate | measured | error | target |"
echo "|---|--:|--:|--:|--:|:-:|"
for r in "${runs[@]}"; do
  IFS='|' read -r name batch cmd <<<"$r"
  json="$out/$(echo "$name-$batch" | tr ' ' '_').json"
  $cmd --report-json "$json" >/dev/null 2>&1
  python3 - "$name" "$batch" "$json" <<'PY'
import json, sys
name, batch, path = sys.argv[1:]
r = json.load(open(path))
e, m = r["estimate"]["total"], r["measured"]["peak_rss_growth_bytes"]
err = m - e
ok = abs(err) <= max(0.03 * e, 1 << 20)
mib = lambda b: f"{b / 2**20:.2f} MiB"
print(f"| {name} | {batch} | {mib(e)} | {mib(m)} | {100 * err / e:+.1f}% ({err / 2**20:+.2f} MiB) | {'yes' if ok else 'no'} |")
PY
done
echo
echo "vae --compare (batch 128, 30 steps, one process):"
$bin/vae --device cpu --compare --compare-svg "$out/vae_compare.svg" 2>/dev/null
rm -rf "$out"
