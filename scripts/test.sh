#!/usr/bin/env bash
# The whole test suite of rebound: what CI runs (.ci/run) and what the README
# tells a newcomer to run. Installs what the tests need when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "system packages"
need=()
command -v cc >/dev/null || need+=(build-essential)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
echo "ok"

step "format (cargo fmt --check)"
cargo fmt --all -- --check

step "lints (cargo clippy -D warnings)"
cargo clippy --workspace --all-targets -- -D warnings

step "tests (cargo test --workspace)"
cargo test --workspace

step "loom model checks of the lock-free protocols"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
  cargo test -p rcs --test loom --release

step "experiments, quick mode (smoke)"
cargo run --release --quiet -- bench rcs --quick

step "all passed"
