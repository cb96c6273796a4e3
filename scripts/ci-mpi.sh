#!/usr/bin/env bash
# The MPI check (issue 15): the `mpi` feature (collective::Mpi over Open MPI) installs, lints,
# builds and works across processes, and a rank that dies ends the job instead of hanging it.
#   1. scripts/install-mpi.sh (Open MPI and libclang from Debian; nothing when present);
#   2. clippy of memwise-runtime with --features mpi, every target, warnings denied, and
#      with --features nccl (collective::Nccl; NCCL and CUDA load at run time, so it builds
#      without them), and of the facade's library and examples with --features nccl;
#   3. runtime/examples/mpi_check under `mpirun -n 2`: sums bit for bit, broadcast, barrier,
#      point to point round a ring;
#   4. the fault test: rank 1 exits after 5 barriers while rank 0 keeps calling collectives;
#      mpirun must exit non-zero within 60 s (under `timeout 120`, so nothing hangs);
#   5. the examples with --data-parallel on 2 ranks: mnist_mlp and vae end 10 steps with the
#      weights of one process at the same global batch (scripts/compare_weights.py, 1e-5),
#      and with --zero 1 (the optimizer state sharded) with the weights of unsharded ranks
#      (1e-6); each rank's peak RSS growth is within 5 % of its estimate (MLP at global batch
#      4096, VAE at 2048, with and without --zero 1); a rank killed with SIGKILL
#      mid-training ends the job within 60 s;
#   6. model parallel (issue 16): the example `pipeline` (the VAE, encoder and decoder on two
#      ranks, 4 micro-batches) under 1F1B and GPipe ends 10 steps with the weights of one
#      process (1e-5), and so do 2 replicas of the pipeline (4 ranks), whose evaluation of the
#      2,000 held-out digits through the pipeline gives one process's loss; a job resumed
#      from the stages' checkpoint ends at the uninterrupted run's weights; each stage's peak RSS
#      growth is within 5 % of its estimate (batch 2048, and 2 replicas under 1F1B); a stage
#      killed mid-training ends the job within 60 s.
# Prints a PASS or FAIL line per check; exits non-zero when any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_INCREMENTAL=0

LOG="${OUT:-target/ci-mpi}"
mkdir -p "$LOG"
failed=0
pass() { echo "ci-mpi: PASS: $*"; }
fail() { echo "ci-mpi: FAIL: $*"; failed=1; }

# A step the rest depends on: FAIL and stop when it fails.
must() {
    local what="$1"
    shift
    if "$@"; then
        pass "$what"
    else
        echo "ci-mpi: FAIL: $what (exit status $?)"
        exit 1
    fi
}

echo "== MPI: install (scripts/install-mpi.sh)"
must "install-mpi.sh" bash scripts/install-mpi.sh

echo "== MPI: clippy --features mpi"
must "clippy -p memwise-runtime --features mpi --all-targets" \
    cargo clippy -p memwise-runtime --features mpi --all-targets -- -D warnings

echo "== NCCL: clippy --features nccl (NCCL and CUDA are loaded at run time)"
must "clippy -p memwise-runtime --features nccl --all-targets" \
    cargo clippy -p memwise-runtime --features nccl --all-targets -- -D warnings
must "clippy -p memwise --features nccl --lib --examples" \
    cargo clippy -p memwise --features nccl --lib --examples -- -D warnings

echo "== MPI: build mpi_check (release)"
must "build mpi_check (release)" \
    cargo build --release -p memwise-runtime --features mpi --example mpi_check
BIN=target/release/examples/mpi_check
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -n 2)
# A replicated pipeline's 2 stages × 2 replicas (more ranks than the 2 cores: oversubscribed).
MPIRUN4=(mpirun --allow-run-as-root --oversubscribe -n 4)

echo "== MPI: mpi_check on 2 ranks"
rc=0
timeout 120 "${MPIRUN[@]}" "$BIN" > "$LOG/check.txt" 2>&1 || rc=$?
cat "$LOG/check.txt"
if [[ $rc == 0 ]] && grep -qx "mpi_check: rank 0 of 2 ok" "$LOG/check.txt" \
    && grep -qx "mpi_check: rank 1 of 2 ok" "$LOG/check.txt"; then
    pass "mpi_check: both ranks ok"
else
    fail "mpi_check: exit status $rc, or a rank did not print ok (output above)"
fi

echo "== MPI: fault test (rank 1 exits after 5 barriers)"
rc=0
start=$(date +%s.%N)
timeout 120 "${MPIRUN[@]}" "$BIN" --die-at-step 5 > "$LOG/fault.txt" 2>&1 || rc=$?
secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
cat "$LOG/fault.txt"
echo "ci-mpi: the fault test's mpirun exited with status $rc after $secs s"
if [[ $rc == 0 ]]; then
    fail "fault test: mpirun exited 0 although rank 1 died"
elif [[ $rc == 124 || $rc == 137 ]]; then
    fail "fault test: mpirun was still running after 120 s (the surviving rank hung)"
elif awk -v s="$secs" 'BEGIN { exit !(s < 60) }'; then
    pass "fault test: mpirun ended the job with status $rc in $secs s"
else
    fail "fault test: mpirun took $secs s to end the job (60 s allowed)"
fi

echo "== MPI: data-parallel examples (release, --features mpi)"
must "build mnist_mlp and vae with --features mpi (release)" \
    cargo build --release --features mpi --example mnist_mlp --example vae

# 1. Equivalence: 2 ranks at global batch 128 end with the weights of 1 process at 128, and
#    2 ranks with the optimizer state sharded (ZeRO stage 1) with those of 2 unsharded ranks.
for ex in mnist_mlp vae; do
    bin=target/release/examples/$ex
    common=(--device cpu --steps 10 --batch 128 --no-shuffle)
    rc=0
    timeout 300 "${MPIRUN[@]}" "$bin" "${common[@]}" --data-parallel \
        --save-weights "$LOG/$ex.2ranks.safetensors" > "$LOG/$ex.2ranks.txt" 2>&1 || rc=$?
    timeout 300 "${MPIRUN[@]}" "$bin" "${common[@]}" --data-parallel --zero 1 \
        --save-weights "$LOG/$ex.zero1.safetensors" > "$LOG/$ex.zero1.txt" 2>&1 || rc=$?
    timeout 300 "$bin" "${common[@]}" \
        --save-weights "$LOG/$ex.1process.safetensors" > "$LOG/$ex.1process.txt" 2>&1 || rc=$?
    if [[ $rc != 0 ]]; then
        tail -n 20 "$LOG/$ex.2ranks.txt" "$LOG/$ex.zero1.txt" "$LOG/$ex.1process.txt"
        fail "$ex: a run exited with status $rc"
        continue
    fi
    if python3 scripts/compare_weights.py --tol 1e-5 \
        "$LOG/$ex.1process.safetensors" "$LOG/$ex.2ranks.safetensors"; then
        pass "$ex: 2 ranks = 1 process after 10 steps at batch 128"
    else
        fail "$ex: 2 ranks and 1 process trained different weights"
    fi
    if python3 scripts/compare_weights.py --tol 1e-6 \
        "$LOG/$ex.2ranks.safetensors" "$LOG/$ex.zero1.safetensors"; then
        pass "$ex: 2 ranks with ZeRO stage 1 = 2 unsharded ranks after 10 steps"
    else
        fail "$ex: ZeRO stage 1 trained different weights from unsharded data parallelism"
    fi
done

# 2. Memory: each rank's measured peak RSS growth within 5 % of its per-replica estimate.
for run in "mnist_mlp 4096 10 0" "vae 2048 4 0" "mnist_mlp 4096 10 1" "vae 2048 4 1"; do
    read -r ex batch steps zero <<< "$run"
    name="$ex.$batch.zero$zero"
    rc=0
    timeout 600 "${MPIRUN[@]}" "target/release/examples/$ex" --device cpu --data-parallel \
        --zero "$zero" --batch "$batch" --steps "$steps" --no-shuffle \
        --report-json "$LOG/$name.json" > "$LOG/$name.txt" 2>&1 || rc=$?
    if [[ $rc != 0 ]]; then
        tail -n 20 "$LOG/$name.txt"
        fail "$ex at batch $batch on 2 ranks (ZeRO stage $zero): exit status $rc"
    elif python3 - "$LOG/$name.json" "$LOG/$name.rank1.json" <<'PY'
import json, sys
ok = True
for path in sys.argv[1:]:
    r = json.load(open(path))
    est, got = r["estimate"]["total"], r["measured"]["peak_rss_growth_bytes"]
    off = 100 * (got - est) / est
    print(f"ci-mpi: {r['model']} rank {r['rank']} of {r['replicas']}, batch {r['batch']} of "
          f"{r['global_batch']}, ZeRO stage {r['zero_stage']} (optimizer state "
          f"{r['estimate']['optimizer'] / 2**20:.2f} MiB): measured {got / 2**20:.2f} MiB, "
          f"estimate {est / 2**20:.2f} MiB ({off:+.1f} %)")
    ok &= abs(off) <= 5
sys.exit(0 if ok else 1)
PY
    then
        pass "$ex at global batch $batch, ZeRO stage $zero: every rank within 5 % of its estimate"
    else
        fail "$ex at global batch $batch, ZeRO stage $zero: a rank's peak is more than 5 % off its estimate"
    fi
done

# 3. A rank killed mid-training ends the job: mpirun exits non-zero, with a message, in 60 s.
# kill_test WHAT LOG STARTED VICTIM CMD…: runs CMD in the background, waits until LOG shows
# STARTED, kills the newest process whose command line matches VICTIM (a rank: mpirun's own
# line is older), and requires mpirun to end within 60 s with a non-zero status and a message.
kill_test() {
    local what="$1" log="$2" started="$3" pattern="$4"
    shift 4
    timeout 120 "$@" > "$log" 2>&1 &
    local job=$! victim="" rc=0
    for _ in $(seq 100); do
        # Anywhere in a line: the ranks share the output, and a line may follow another's
        # unfinished one.
        if grep -q "$started" "$log"; then
            victim=$(pgrep -f "$pattern" | tail -n 1 || true)
            break
        fi
        sleep 0.2
    done
    if [[ -z "$victim" ]]; then
        kill "$job" 2> /dev/null || true
        wait "$job" || true
        cat "$log"
        fail "$what: training never started"
        return
    fi
    local start
    start=$(date +%s.%N)
    kill -KILL "$victim"
    wait "$job" || rc=$?
    local secs
    secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
    tail -n 8 "$log"
    # 137 is the killed rank's own status (128 + SIGKILL), which mpirun passes on; 124 is
    # `timeout`'s: the job outlived 120 s.
    if [[ $rc == 0 || $rc == 124 ]]; then
        fail "$what: mpirun exited with status $rc after $secs s"
    elif awk -v s="$secs" 'BEGIN { exit !(s < 60) }' && grep -qi "killed\|signal" "$log"; then
        pass "$what: the job ended with status $rc and a message $secs s after the kill"
    else
        fail "$what: status $rc after $secs s, or no message naming the killed rank"
    fi
}

echo "== MPI: one of two mnist_mlp ranks killed mid-training"
kill_test "kill test" "$LOG/kill.txt" "Epoch 1/" \
    "target/release/examples/mnist_mlp --device cpu --data-parallel" \
    "${MPIRUN[@]}" target/release/examples/mnist_mlp --device cpu --data-parallel --epochs 100000

echo "== MPI: model parallel, the VAE in 2 pipeline stages (examples/pipeline)"
must "build pipeline with --features mpi (release)" \
    cargo build --release --features mpi --example pipeline
bin=target/release/examples/pipeline
rc=0
timeout 300 "$bin" --one-device --steps 10 --save-weights "$LOG/pipeline.1process.safetensors" \
    > "$LOG/pipeline.1process.txt" 2>&1 || rc=$?
# A pipeline run `schedule:replicas`: sets `schedule`, `replicas`, the `launch` command (4
# ranks for 2 replicas, else 2) and `rc=0`.
pipeline_run() {
    schedule=${1%:*}
    replicas=${1#*:}
    launch=("${MPIRUN[@]}")
    [[ $replicas == 2 ]] && launch=("${MPIRUN4[@]}")
    rc=0
}
# Under both schedules, and 2 replicas of the whole pipeline under 1F1B (4 ranks, rank 2·s + r
# runs stage s of replica r, each replica on half of every batch): replica 0's stages end at
# one process's weights.
for run in one_f_one_b:1 gpipe:1 one_f_one_b:2; do
    pipeline_run "$run"
    w="$LOG/pipeline.$schedule.$replicas.safetensors"
    timeout 300 "${launch[@]}" "$bin" --mpi --schedule "$schedule" --replicas "$replicas" \
        --steps 10 --save-weights "$w" > "$LOG/pipeline.$run.txt" 2>&1 || rc=$?
    cat "$LOG/pipeline.$run.txt"
    if [[ $rc != 0 ]]; then
        fail "pipeline ($schedule, $replicas replicas): a run exited with status $rc"
    elif python3 scripts/compare_weights.py --tol 1e-5 "$LOG/pipeline.1process.safetensors" \
        "$w.stage0" "$w.stage1"; then
        pass "pipeline ($schedule, $replicas replicas): 2 stages = 1 process after 10 steps"
    else
        fail "pipeline ($schedule, $replicas replicas): the stages trained different weights from one process"
    fi
    # `evaluate` through the ranks' inference stages: one process's held-out loss (1e-5).
    one=$(sed -n 's/^one device: held-out loss \([0-9.]*\).*/\1/p' "$LOG/pipeline.1process.txt")
    got=$(sed -n 's/.*(MPI ranks): held-out loss \([0-9.]*\).*/\1/p' "$LOG/pipeline.$run.txt")
    if [[ $rc == 0 ]] && python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(abs(a - b) > 1e-5 * abs(a))" "$one" "$got"; then
        pass "pipeline ($schedule, $replicas replicas): held-out loss $got = 1 process's $one"
    else
        fail "pipeline ($schedule, $replicas replicas): held-out loss '$got', 1 process '$one'"
    fi
done
# Resuming across processes: 4 steps, the pipeline's checkpoint (a file per stage), then a
# new job resumed from it for 6 more ends at the 10-step run's weights, bit for bit.
rc=0
ck="$LOG/pipeline.checkpoint"
timeout 300 "${MPIRUN[@]}" "$bin" --mpi --steps 4 --save-checkpoint "$ck" \
    > "$LOG/pipeline.resume.txt" 2>&1 || rc=$?
[[ $rc == 0 ]] && { timeout 300 "${MPIRUN[@]}" "$bin" --mpi --steps 6 --resume "$ck" \
    --save-weights "$LOG/pipeline.resumed.safetensors" >> "$LOG/pipeline.resume.txt" 2>&1 || rc=$?; }
cat "$LOG/pipeline.resume.txt"
w="$LOG/pipeline.one_f_one_b.1.safetensors"
same=1
for k in 0 1; do
    python3 scripts/compare_weights.py --tol 0 "$w.stage$k" \
        "$LOG/pipeline.resumed.safetensors.stage$k" || same=0
done
if [[ $rc == 0 && $same == 1 ]]; then
    pass "pipeline: 4 steps, checkpoint, a new job resumed for 6 = 10 steps, bit for bit"
else
    fail "pipeline: resuming from the stages' checkpoint (status $rc) did not reach the 10-step weights"
fi
# Each stage's measured peak RSS growth within 5 % of its estimate (its plan plus the host
# bytes beside it), at batch 2048, under both schedules, and over 2 replicas under 1F1B.
for run in one_f_one_b:1 gpipe:1 one_f_one_b:2; do
    pipeline_run "$run"
    r="$LOG/pipeline.memory.$schedule.$replicas.json"
    rm -f "$r".stage*
    timeout 600 "${launch[@]}" "$bin" --mpi --schedule "$schedule" --replicas "$replicas" \
        --batch 2048 --steps 4 --report-json "$r" > "$LOG/pipeline.memory.$run.txt" 2>&1 || rc=$?
    if [[ $rc != 0 ]]; then
        tail -n 20 "$LOG/pipeline.memory.$run.txt"
        fail "pipeline memory ($schedule, $replicas replicas): exit status $rc"
    # Each rank's own report file: the ranks share stderr, where their lines can interleave.
    elif python3 - "$r".stage* <<'PY'
import json, sys
ok = len(sys.argv) > 2
for path in sys.argv[1:]:
    r = json.load(open(path))
    e, m = r["estimate"], r["measured"]
    mib = lambda b: b / 2**20
    print(f"ci-mpi: stage {r['stage']} of {r['stages']}, replica {r['replica']} of "
          f"{r['replicas']} ({r['schedule']}, batch {r['batch']}): "
          f"measured {mib(m['peak_rss_growth_bytes']):.2f} MiB, estimate {mib(e['total']):.2f} "
          f"MiB (plan {mib(e['plan_total']):.2f} + host {mib(e['host']):.2f}): "
          f"{m['error_percent']:+.1f} %")
    ok &= abs(m["error_percent"]) <= 5
sys.exit(0 if ok else 1)
PY
    then
        pass "pipeline memory ($schedule, $replicas replicas): each stage's peak within 5 % of its estimate"
    else
        fail "pipeline memory ($schedule, $replicas replicas): a stage's peak is more than 5 % off its estimate"
    fi
done

echo "== MPI: one of two pipeline stages killed mid-training"
kill_test "pipeline kill test" "$LOG/pipeline.kill.txt" "training" "$bin --mpi --steps 100000" \
    "${MPIRUN[@]}" "$bin" --mpi --steps 100000

if [[ $failed != 0 ]]; then
    echo "ci-mpi: FAIL (see the FAIL lines above)"
    exit 1
fi
echo "ci-mpi: PASS: every MPI check"
