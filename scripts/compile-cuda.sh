#!/usr/bin/env bash
# Compiles every CUDA kernel source for the H200 (sm_90) on a machine without a GPU:
#   1. nvcc -cubin with ptxas -v: any error fails, and so does a register spill in any
#      kernel; prints registers / stack / spills of the hot kernels;
#   2. NVRTC (when libnvrtc is present, which step 0 ensures): each module exactly as the
#      runtime compiles it (common.cuh + the file, no include path), then ptxas on the PTX;
#      every kernel must declare its block bound (__launch_bounds__, `.maxntid` in the PTX)
#      and its registers × that many threads must fit an SM's 65,536 registers.
# Step 0 installs nvcc, ptxas, the CCCL headers and NVRTC from PyPI into a cached venv
# ($MEMWISE_CUDA_VENV, default ~/.cache/memwise/cuda13), pinned to CUDA 13.0 — the
# version of the GPU machine's driver (580) — so the PTX it makes would load there.
# Idempotent; a warm run takes about a minute, a cold one adds a ~600 MB download.
#
#   scripts/compile-cuda.sh                 install if needed, compile, check
#   scripts/compile-cuda.sh --print-lib-dir install if needed, print the folder holding
#                                           libnvrtc.so.13 (for LD_LIBRARY_PATH), nothing else
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${MEMWISE_CUDA_VENV:-$HOME/.cache/memwise/cuda13}"
PINS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88)
STAMP="$VENV/.memwise-pins"

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "${PINS[*]}" ]]; then
    echo "== installing the CUDA 13.0 compilers from PyPI into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}" >&2
    echo "${PINS[*]}" > "$STAMP"
fi
CU="$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
if [[ "${1:-}" == "--print-lib-dir" ]]; then
    echo "$CU/lib"
    exit 0
fi
NVCC="$CU/bin/nvcc"
export PATH="$CU/bin:$PATH"
export LD_LIBRARY_PATH="$CU/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$NVCC" --version | tail -2

OUT="${MEMWISE_CUDA_OUT:-target/cuda}"
SRC="${MEMWISE_CUDA_SRC:-kernels/cuda}"  # (another folder only to test this script)
mkdir -p "$OUT"
ARCH=sm_90
# Kernels whose registers and spills are printed (the ones a training step runs most).
HOT='mw_(cast_u8_f32|cast_f32_f16|act_fwd_f32|act_bwd_f32|softmax_f32_f32|softmax_bwd_f32_f32_f32|scce_f32_f32|bn_train_fwd_f32|bn_bwd_f32|ln_fwd_f32|ln_bwd_f32|column_sums_f32|maxpool_fwd_f32|maxpool_bwd_f32|im2col_f16|col2im_f16|dw_fwd_f32|dropout_fwd_f16|adam|sgd|rmsprop|all_finite_f32|bias_add_f16|flash_fwd_f32|flash_bwd_dkv_f32|flash_bwd_dq_f32)$'

fail=0
echo "== nvcc -arch=$ARCH -cubin (ptxas -v)"
for src in "$SRC"/*.cu; do
    name="$(basename "$src" .cu)"
    log="$OUT/$name.ptxas.txt"
    if ! "$NVCC" -arch="$ARCH" -cubin -Xptxas -v --Werror all-warnings -I "$SRC" \
            -o "$OUT/$name.cubin" "$src" > "$log" 2>&1; then
        echo "FAILED: $src"; cat "$log"; fail=1; continue
    fi
    # ptxas -v prints, per entry: "Compiling entry function 'NAME'", then "N bytes stack
    # frame, S bytes spill stores, L bytes spill loads", then "Used R registers …".
    awk -v hot="$HOT" -v file="$name" '
        /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART+1, RLENGTH-2) }
        /bytes stack frame/ { stack = $1; st = $5; ld = $9;
            if (st + 0 > 0 || ld + 0 > 0) { printf "SPILL: %s in %s: %s bytes stores, %s bytes loads\n", fn, file, st, ld; bad = 1 } }
        /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART+5, RLENGTH-15);
            n++; if (fn ~ hot) printf "  %-26s %3d regs  %3d B stack  %d/%d B spilled\n", fn, regs, stack, st, ld }
        END { printf "  %s.cu: %d kernels\n", file, n; exit bad }' "$log" || fail=1
done

echo "== NVRTC (the runtime's compile: common.cuh + module, --gpu-architecture=$ARCH)"
NVRTC="$(ls "$CU"/lib/libnvrtc.so.* 2>/dev/null | grep -v alt | head -1 || true)"
if [[ -z "$NVRTC" ]]; then
    echo "libnvrtc not found: skipped"
else
    python3 scripts/nvrtc_check.py "$NVRTC" "$ARCH" "$OUT" "$SRC" || fail=1
fi

if [[ $fail -ne 0 ]]; then
    echo "compile-cuda: FAILED"
    exit 1
fi
echo "compile-cuda: every kernel compiles for $ARCH with nvcc and NVRTC, no spills"
