#!/usr/bin/env bash
# The GPU check of the CUDA executor (issue 6): one prepared script, a few minutes on an H200.
#
#   scripts/gpu-check.sh build   here, with Rust: builds gpu-bin/gpu_check (git-ignored) with
#                                --features cuda; the device call carries gpu-bin
#   scripts/gpu-check.sh         there, on the GPU machine (no Rust, no network): finds
#                                libnvrtc / libcublas, runs the PyTorch baselines and
#                                gpu-bin/gpu_check, and prints the table last
#   scripts/gpu-check.sh --install   the same, first installing NVRTC and cuBLAS for CUDA 13.0
#                                from PyPI (pip --target $MEMWISE_GPU_LIBS, default
#                                ~/.cache/memwise/gpu-libs) where no toolkit or PyTorch has them
#
# Without a GPU (or without the binary) it fails at once with the reason: exit 2 (no GPU or
# no CUDA library), 3 (no binary). Every stage has a time limit, so nothing hangs.
# Environment: GPU_CHECK_STEPS (200), GPU_CHECK_MODELS (40 random models per kind),
# GPU_CHECK_TIMED (100 timed steps), GPU_CHECK_{MLP,CONV,VAE}_BATCH, OUT (where logs go),
# MEMWISE_CUDA_SYNC=1 (synchronise after every launch, no graphs: a device fault such as an
# illegal address then names its kernel and plan step instead of surfacing at a later call).
set -uo pipefail
cd "$(dirname "$0")/.."

INSTALL=0
if [[ "${1:-}" == "--install" ]]; then
    INSTALL=1
    shift
fi

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
timeout 30 nvidia-smi > "$LOG/nvidia-smi-full.txt" 2>&1 && grep -m1 "Driver Version" "$LOG/nvidia-smi-full.txt"
# The kernels are compiled by NVRTC 13 for the device: a driver for CUDA older than 13.0
# cannot load them (gpu_check says so too, from cuDriverGetVersion).
cuda_version="$(grep -o 'CUDA Version: [0-9.]*' "$LOG/nvidia-smi-full.txt" | grep -o '[0-9.]*$' || true)"
if [[ -n "$cuda_version" && "${cuda_version%%.*}" -lt 13 ]]; then
    echo "gpu-check: the driver supports CUDA $cuda_version; memwise needs a driver for CUDA 13.0 or newer (R580+)"
    exit 2
fi

GPU_LIBS="${MEMWISE_GPU_LIBS:-$HOME/.cache/memwise/gpu-libs}"
if [[ $INSTALL -eq 1 ]]; then
    echo "gpu-check: installing NVRTC and cuBLAS for CUDA 13.0 from PyPI into $GPU_LIBS"
    if ! python3 -m pip install -q --disable-pip-version-check --target "$GPU_LIBS" \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14; then
        echo "gpu-check: pip could not install nvidia-cuda-nvrtc and nvidia-cublas"
        exit 4
    fi
fi

# libnvrtc.so.13 and libcublas.so.13: the CUDA toolkit's lib folder, the wheels --install
# put in $GPU_LIBS, or the nvidia-* wheels next to PyTorch.
dirs=()
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13*; do
    [[ -n "$d" ]] && dirs+=("$d/lib64" "$d/lib" "$d/targets/x86_64-linux/lib")
done
site="$(timeout 30 python3 -c 'import nvidia, os; print(" ".join(list(nvidia.__path__)))' 2> /dev/null || true)"
for s in "$GPU_LIBS/nvidia" $site; do
    for d in "$s"/*/lib "$s"/cu13/lib; do dirs+=("$d"); done
done
found=()
for lib in libnvrtc.so.13 libcublas.so.13; do
    hit=""
    for d in "${dirs[@]}"; do
        if [[ -e "$d/$lib" ]]; then hit="$d"; break; fi
    done
    if [[ -z "$hit" ]]; then
        echo "gpu-check: $lib not found (looked in the CUDA toolkit, $GPU_LIBS and PyTorch's nvidia wheels); 'scripts/gpu-check.sh --install' installs it from PyPI"
        exit 2
    fi
    echo "gpu-check: $lib in $hit"
    found+=("$hit")
done
export LD_LIBRARY_PATH="$(printf '%s:' "${found[@]}")${LD_LIBRARY_PATH:-}"
export MEMWISE_KERNEL_CACHE="${MEMWISE_KERNEL_CACHE:-$LOG/kernels}"

echo "== PyTorch baselines"
timeout "${GPU_CHECK_TORCH_LIMIT:-120}" python3 scripts/torch_bench.py --steps "${GPU_CHECK_TIMED:-100}" 2>&1 | tee "$LOG/torch.txt"
# The same models at the large batches gpu_check measures memory at (a few steps).
GPU_CHECK_MLP_BATCH="${GPU_CHECK_MEM_MLP_BATCH:-16384}" GPU_CHECK_CONV_BATCH="${GPU_CHECK_MEM_CONV_BATCH:-2048}" \
    GPU_CHECK_VAE_BATCH="${GPU_CHECK_MEM_VAE_BATCH:-2048}" \
    timeout "${GPU_CHECK_TORCH_LIMIT:-120}" python3 scripts/torch_bench.py --steps 5 2>&1 | tee "$LOG/torch_mem.txt"
export GPU_CHECK_TORCH="$LOG/torch.txt" GPU_CHECK_TORCH_MEM="$LOG/torch_mem.txt"

echo "== gpu_check"
timeout "${GPU_CHECK_LIMIT:-420}" gpu-bin/gpu_check 2>&1 | tee "$LOG/gpu_check.txt"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 && $rc -ne 124 && -z "${MEMWISE_CUDA_SYNC:-}" ]]; then
    # A device fault is sticky and surfaces at a later call: run a short check again with a
    # synchronisation after every launch so the first failure names its kernel and step.
    echo "== gpu_check failed (exit $rc): again, short, with MEMWISE_CUDA_SYNC=1"
    MEMWISE_CUDA_SYNC=1 GPU_CHECK_MODELS=3 GPU_CHECK_STEPS=3 GPU_CHECK_TIMED=2 \
        timeout 150 gpu-bin/gpu_check 2>&1 | tee "$LOG/gpu_check_sync.txt" | tail -40
fi

echo
echo "== PyTorch eager on the same GPU (for the table above)"
cat "$LOG/torch.txt" "$LOG/torch_mem.txt" | grep '^torch\|^PyTorch' || echo "(PyTorch baselines did not run)"
if [[ $rc -eq 124 ]]; then
    echo "gpu-check: gpu_check ran past its time limit"
fi
exit "$rc"
