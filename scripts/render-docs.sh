#!/usr/bin/env bash
# Regenerates the pictures under docs/img/ from the code (plan timelines and model graphs),
# so the committed pictures never drift from what the planner and the plot module produce.
# Usage: scripts/render-docs.sh [OUT_DIR]   (default docs/img)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/img}"
# The dev profile: it shares its build with `cargo test`, and planning takes seconds there.
cargo run -p memwise-runtime --example render_plots -- "$out"
