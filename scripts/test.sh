#!/usr/bin/env bash
# The whole test suite of rebound: what CI runs (.ci/run) and what the README
# tells a newcomer to run. Installs what the tests need when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "system packages"
# command -> Debian package providing it
need=()
want() { command -v "$1" >/dev/null 2>&1 || need+=("$2"); }
want cc build-essential
want qemu-img qemu-utils
want qemu-io qemu-utils
want fio fio
want nbdinfo libnbd-bin
want nbdcopy libnbd-bin
want nbdkit nbdkit
want valgrind valgrind
want memcached memcached
want nc netcat-openbsd
want jq jq
want ip iproute2         # rebound query --link: a network namespace per node (tests/smartstore_cli.rs)
want tc iproute2
want openssl openssl       # throwaway certificates for the TLS tests
want nbdsh python3-libnbd
# libnbd's Python bindings, for the system Python the tests run.
/usr/bin/python3 -c 'import nbd' 2>/dev/null || need+=(python3-libnbd)
want systemd-socket-activate systemd
want systemd-analyze systemd
want pkg-config pkg-config   # finds the system OpenSSL for the openssl crate (NBD STARTTLS)
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
want psktool gnutls-bin     # tests/tls.rs: PSK files, and GnuTLS is what libnbd and qemu speak TLS with
want certtool gnutls-bin
want promtool prometheus   # checks dist/prometheus/rebound-alerts.yml (tests/ops_metrics.rs)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if ((${#need[@]})); then
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  echo "installing: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${need[@]}"
fi
# The DuckDB peer of `bench smartstore` (Python packages).
python3 -c 'import duckdb, pyarrow' 2>/dev/null || {
  echo "installing: duckdb pyarrow (pip)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore duckdb pyarrow
}
# fio must have its nbd engine (Debian's does).
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "fio lacks the nbd engine"; exit 1; }
echo "ok"

step "format (cargo fmt --check)"
cargo fmt --all -- --check

step "lints (cargo clippy -D warnings)"
cargo clippy --workspace --all-targets -- -D warnings

step "lints of the server alone (cargo clippy --no-default-features)"
cargo clippy -p rebound --no-default-features --all-targets -- -D warnings

step "the server alone builds without smart storage or experiments"
cargo build --no-default-features -p rebound
if cargo tree -p rebound --no-default-features -e normal | grep -Ei 'datafusion|arrow|tonic|plotters'; then
  echo "the server-only build (--no-default-features) depends on the crates above"
  exit 1
fi
echo "ok"

step "tests (cargo test --workspace)"
cargo test --workspace

step "loom model checks of the lock-free protocols"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
  cargo test -p rcs --test loom --release

step "memcheck (valgrind) on the recovery box's unsafe mapping code"
# Miri needs a nightly toolchain; valgrind checks the same code as built.
for t in api; do
  bin=$(cargo test -p recobox --test "$t" --no-run --message-format=json 2>/dev/null \
    | jq -r 'select(.executable != null and .target.name == "'"$t"'") | .executable' | tail -1)
  valgrind --error-exitcode=1 --leak-check=no -q "$bin" --test-threads=1 >/dev/null
done
echo "ok"

step "experiments, quick mode (smoke)"
cargo run --release --quiet -- bench rcs --quick
cargo run --release --quiet -- sim rcs --quick
cargo run --release --quiet -- sim rcs --quick --workload figure9 --task-us paper --policy performance,dynamic
cargo run --release --quiet -- bench controller --quick
cargo run --release --quiet -- bench cpu-floor --quick
cargo run --release --quiet -- bench box --quick
cargo run --release --quiet -- bench loglock --quick
cargo run --release --quiet -- bench availability --quick
cargo run --release --quiet -- bench lost-device --quick
cargo run --release --quiet -- bench device-faults --quick
cargo run --release --quiet -- bench badpath --quick
cargo run --release --quiet -- bench output-commit --quick
cargo run --release --quiet -- bench smartstore --quick
cargo run --release --quiet -- bench smartstore --scale --quick
cargo run --release --quiet -- bench smartstore --recovery --quick
# Smart storage at scale factor 1: Q1 on 4 node processes must equal a
# single-process DataFusion run and the TPC-H reference answer.
cargo run --release --quiet -- query --sf 1 --format csv --verify --quiet
# The ladder end to end: exits non-zero if an acknowledged write was lost.
cargo run --release --quiet -- demo

step "all passed"
