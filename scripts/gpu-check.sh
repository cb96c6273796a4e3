#!/usr/bin/env bash
# The GPU check of the CUDA executor (issue 6): one prepared script, a few minutes on an H200.
#
#   scripts/gpu-check.sh build   here, with Rust: builds gpu-bin/gpu_check (git-ignored) with
#                                --features cuda; the device call carries gpu-bin
#   scripts/gpu-check.sh         there, on the GPU machine (no Rust, no network): finds
#                                libnvrtc / libcublas, runs the PyTorch baselines and
#                                gpu-bin/gpu_check, and prints the table last
#
# Without a GPU (or without the binary) it fails at once with the reason: exit 2 (no GPU or
# no CUDA library), 3 (no binary). Every stage has a time limit, so nothing hangs.
# Environment: GPU_CHECK_STEPS (200), GPU_CHECK_MODELS (40 random models per kind),
# GPU_CHECK_TIMED (100 timed steps), GPU_CHECK_{MLP,CONV,VAE}_BATCH, OUT (where logs go),
# MEMWISE_CUDA_SYNC=1 (synchronise after every launch, no graphs: a device fault such as an
# illegal address then names its kernel and plan step instead of surfacing at a later call).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "build" ]]; then
    set -e
    cargo build --release -p memwise-runtime --features cuda --example gpu_check
    mkdir -p gpu-bin
    cp target/release/examples/gpu_check gpu-bin/
    ls -l gpu-bin/
    exit 0
fi

LOG="${OUT:-target/gpu-check}"
mkdir -p "$LOG"

if [[ ! -x gpu-bin/gpu_check ]]; then
    echo "gpu-check: gpu-bin/gpu_check is missing: run 'scripts/gpu-check.sh build' on a machine with Rust, and carry gpu-bin"
    exit 3
fi

if ! command -v nvidia-smi > /dev/null 2>&1 || ! timeout 30 nvidia-smi -L > "$LOG/nvidia-smi.txt" 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi is missing or finds no device)"
    exit 2
fi
cat "$LOG/nvidia-smi.txt"

# libnvrtc.so.13 and libcublas.so.13: the CUDA toolkit's lib folder, or the nvidia-* wheels
# next to PyTorch.
dirs=()
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13*; do
    [[ -n "$d" ]] && dirs+=("$d/lib64" "$d/lib" "$d/targets/x86_64-linux/lib")
done
site="$(timeout 30 python3 -c 'import nvidia, os; print(" ".join(list(nvidia.__path__)))' 2> /dev/null || true)"
for s in $site; do
    for d in "$s"/*/lib "$s"/cu13/lib; do dirs+=("$d"); done
done
found=()
for lib in libnvrtc.so.13 libcublas.so.13; do
    hit=""
    for d in "${dirs[@]}"; do
        if [[ -e "$d/$lib" ]]; then hit="$d"; break; fi
    done
    if [[ -z "$hit" ]]; then
        echo "gpu-check: $lib not found (looked in the CUDA toolkit and PyTorch's nvidia wheels)"
        exit 2
    fi
    echo "gpu-check: $lib in $hit"
    found+=("$hit")
done
export LD_LIBRARY_PATH="$(printf '%s:' "${found[@]}")${LD_LIBRARY_PATH:-}"
export MEMWISE_KERNEL_CACHE="$LOG/kernels"

echo "== PyTorch baselines"
timeout 120 python3 scripts/torch_bench.py --steps "${GPU_CHECK_TIMED:-100}" 2>&1 | tee "$LOG/torch.txt"

echo "== gpu_check"
timeout 420 gpu-bin/gpu_check 2>&1 | tee "$LOG/gpu_check.txt"
rc=${PIPESTATUS[0]}

echo
echo "== PyTorch eager on the same GPU (for the table above)"
grep '^torch\|^PyTorch' "$LOG/torch.txt" || echo "(PyTorch baselines did not run)"
if [[ $rc -eq 124 ]]; then
    echo "gpu-check: gpu_check ran past its time limit"
fi
exit "$rc"
