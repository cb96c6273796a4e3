#!/usr/bin/env bash
# Data parallel on this machine's cores, side by side in one run (docs/DATA_PARALLEL.md):
#   memwise, 2 MPI ranks x 1 thread       mpirun -n 2 mnist_mlp --data-parallel
#   memwise, 1 process x 2 threads        mnist_mlp
#   PyTorch DDP, gloo, 2 ranks x 1 thread torchrun --nproc_per_node 2 bench/ddp.py
# the MNIST MLP at the same global batch. Prints samples/s of the whole job (from the median
# step) and each rank's peak resident growth. Not part of CI (it needs bench/setup.sh's torch).
#   bash bench/setup.sh && bash bench/data_parallel.sh        # BATCH=4096 STEPS=30 by default
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_INCREMENTAL=0
BATCH="${BATCH:-4096}"
STEPS="${STEPS:-30}"
OUT=target/bench-data-parallel
mkdir -p "$OUT"

bash scripts/install-mpi.sh
cargo build --release --features mpi --example mnist_mlp
bin=target/release/examples/mnist_mlp
common=(--device cpu --no-shuffle --batch "$BATCH" --steps "$STEPS" --epochs 100000)

RAYON_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -n 2 -x RAYON_NUM_THREADS \
    "$bin" "${common[@]}" --data-parallel --report-json "$OUT/ranks.json" > "$OUT/ranks.txt" 2>&1
RAYON_NUM_THREADS=2 "$bin" "${common[@]}" --report-json "$OUT/threads.json" \
    > "$OUT/threads.txt" 2>&1
OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --nproc_per_node 2 bench/ddp.py \
    --batch "$BATCH" --steps "$STEPS" > "$OUT/torch.txt" 2> "$OUT/torch.err"

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda p: json.load(open(f"{out}/{p}"))
mib = lambda b: f"{b / 2**20:.1f} MiB"
ranks = [load("ranks.json"), load("ranks.rank1.json")]
threads = load("threads.json")
torch = [json.loads(l) for l in open(f"{out}/torch.txt") if l.startswith("{")]
torch.sort(key=lambda r: r["rank"])
rows = [
    ("memwise, 2 ranks x 1 thread", ranks[0]["measured"]["job_samples_per_s"],
     [r["measured"]["peak_rss_growth_bytes"] for r in ranks]),
    ("memwise, 1 process x 2 threads", threads["measured"]["samples_per_s"],
     [threads["measured"]["peak_rss_growth_bytes"]]),
    (f"PyTorch {torch[0]['torch']} DDP (gloo), 2 ranks x 1 thread",
     torch[0]["job_samples_per_s"], [r["peak_rss_growth_bytes"] for r in torch]),
]
print(f"MNIST MLP, global batch {ranks[0]['global_batch']}, {ranks[0]['steps']} steps")
print(f"| run | samples/s | peak resident growth per rank |\n|---|---|---|")
for name, sps, rss in rows:
    print(f"| {name} | {sps:,.0f} | {', '.join(mib(b) for b in rss)} |")
mw, pt = rows[0], rows[2]
print(f"memwise ranks / PyTorch DDP: samples/s x{mw[1] / pt[1]:.2f}, "
      f"peak resident growth per rank x{max(mw[2]) / max(pt[2]):.2f}; "
      f"2 ranks / 1 process x 2 threads: x{mw[1] / rows[1][1]:.2f}")
PY
