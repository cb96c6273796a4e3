#!/usr/bin/env bash
# Expansion cost of the `#[memwise::model]` DSL: `cargo check` time of a scratch crate holding
# the 12-layer GPT-2 and the ResNet-50 of examples/dsl_models.rs, against the same crate
# without them (touch + re-check, median of RUNS). Not a test: a number for the issue.
#
#   scripts/bench_expansion.sh            # RUNS=3, scratch under target/bench-expansion
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$ROOT/target/bench-expansion}
RUNS=${RUNS:-3}
export CARGO_TARGET_DIR="$WORK/target"   # one target dir: dependencies are built once

make_crate() { # name, lib.rs contents on stdin
    local dir="$WORK/$1"
    mkdir -p "$dir/src"
    cat > "$dir/Cargo.toml" <<TOML
[package]
name = "bench-$1"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
memwise = { path = "$ROOT" }

# As in the memwise workspace: the macro (and the planner inside it) is built optimised.
[profile.dev.build-override]
opt-level = 3

[workspace]
TOML
    cp "$ROOT/Cargo.lock" "$dir/Cargo.lock"
    cat > "$dir/src/lib.rs"
}

# The two big models, cut from the example between its markers.
{
    echo '#![allow(dead_code)]'
    echo 'use memwise::prelude::*;'
    sed -n '/^\/\/ ---- ResNet-50/,/^\/\/ Checked by the compiler/p' "$ROOT/examples/dsl_models.rs" | sed '$d'
} | make_crate with

make_crate without <<'RS'
#![allow(dead_code, unused_imports)]
use memwise::prelude::*;
RS

check() { # crate dir → seconds of one touch + cargo check
    local dir="$WORK/$1"
    touch "$dir/src/lib.rs"
    local t0 t1
    t0=$(date +%s.%N)
    (cd "$dir" && cargo check --offline -q)
    t1=$(date +%s.%N)
    echo "$t1 - $t0" | bc -l | awk '{printf "%.3f", $1}'
}

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

echo "warming up (builds memwise and its dependencies once)…" >&2
# Dependencies' warnings are not ours to show; errors still stop the script.
(cd "$WORK/without" && cargo check --offline -q 2>/dev/null) || (cd "$WORK/without" && cargo check --offline)
(cd "$WORK/with" && cargo check --offline -q 2>/dev/null) || (cd "$WORK/with" && cargo check --offline)

declare -A result
for c in without with; do
    samples=()
    for _ in $(seq "$RUNS"); do samples+=("$(check "$c")"); done
    result[$c]=$(printf '%s\n' "${samples[@]}" | median)
    printf '%-8s %.3f s  (samples:%s)\n' "$c" "${result[$c]}" "$(printf ' %.3f' "${samples[@]}")"
done
printf 'added by ResNet-50 + 12-layer GPT-2: %.3f s (median of %s)\n' \
    "$(echo "${result[with]} - ${result[without]}" | bc -l)" "$RUNS"
