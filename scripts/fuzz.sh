#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for N seconds each and prints, per target, the
# executions and whether it crashed. Not part of CI (docs/ROBUSTNESS.md).
#
#   scripts/fuzz.sh [SECONDS] [TARGET ...]      # default: 60 s, every target
#
# Works on a stable toolchain: cargo-fuzz passes nightly-only flags (-Zsanitizer=address,
# the sancov passes) to rustc, which stable accepts with RUSTC_BOOTSTRAP=1. Installs
# cargo-fuzz when missing. The corpus grows in fuzz/corpus/TARGET (reused by the next run);
# a crash is saved in fuzz/artifacts/TARGET/ and replays with
#   fuzz/target/<host>/release/TARGET fuzz/artifacts/TARGET/crash-…
# or, in the property tests' terms, through the same decoders (runtime/tests/support/decode.rs).
#
# Environment: FUZZ_SANITIZER (address | none; default address), FUZZ_JOBS (cargo build
# jobs; default 2), FUZZ_TIMEOUT (seconds one input may take before it counts as a hang;
# default 30).
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
shift || true
sanitizer=${FUZZ_SANITIZER:-address}
unit_timeout=${FUZZ_TIMEOUT:-30}

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
host=$(rustc -vV | sed -n 's/^host: //p')
bin=fuzz/target/$host/release

if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi

echo "== building ${#targets[@]} targets (sanitizer: $sanitizer)"
CARGO_BUILD_JOBS=${FUZZ_JOBS:-2} cargo fuzz build --fuzz-dir fuzz -s "$sanitizer"

summary=()
failed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t" fuzz/logs
    log=fuzz/logs/$t.log
    echo "== $t: ${secs}s"
    set +e
    "$bin/$t" "fuzz/corpus/$t" \
        -max_total_time="$secs" -timeout="$unit_timeout" -print_final_stats=1 \
        -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
    if [ "$rc" -eq 0 ]; then
        result="no crash"
    else
        result="CRASH (exit $rc): $(grep -m1 -E "panicked at|ERROR: AddressSanitizer|ERROR: libFuzzer" "$log" || true)"
        failed=1
    fi
    summary+=("$(printf '%-16s %6ss %12s execs %7s corpus  %s' "$t" "$secs" "${execs:-?}" "$corpus" "$result")")
done

echo
echo "== summary (logs in fuzz/logs/, crashes in fuzz/artifacts/)"
printf '%s\n' "${summary[@]}"
exit $failed
