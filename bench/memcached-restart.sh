#!/usr/bin/env bash
# The recovery box against its peer, memcached's restartable cache
# (`memcached -e FILE`, item memory mapped from a file on /dev/shm, saved on
# SIGUSR1): for N items, how long a restart takes after a clean shutdown,
# and how many items are left after kill -9.
#
#   bench/memcached-restart.sh [--items N] [--rounds R] [--rebound PATH] [--out DIR]
#
# Each restart is timed from process start to state restored (memcached:
# answering `stats` with its items; rebound: `rebound box inspect` having
# validated the box). Prints a table and writes DIR/memcached-restart.csv.
set -euo pipefail

items=20000; rounds=3; out="bench/out"; rebound=""
while (($#)); do
  case "$1" in
    --items) items="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --rebound) rebound="$2"; shift ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "memcached-restart.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
here="$(cd "$(dirname "$0")" && pwd)"
rebound="${rebound:-$here/../target/release/rebound}"
[ -x "$rebound" ] || { echo "no rebound binary at $rebound" >&2; exit 2; }
need=()
command -v memcached >/dev/null || need+=(memcached)
command -v nc >/dev/null || need+=(netcat-openbsd)
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${need[@]}"
fi
mkdir -p "$out"
work="$(mktemp -d)"; mcfile="/dev/shm/rebound-mc-$$"; boxfile="/dev/shm/rebound-box-$$"
# Below the kernel's ephemeral range (as bench/controller.sh): a port
# inside it may be a client connection's local end when memcached binds.
read -r ephemeral_low _ < /proc/sys/net/ipv4/ip_local_port_range
span=$(( ephemeral_low - 10001 )); ((span > 0)) || span=1
port=$((10000 + $$ % span))
trap 'jobs -p | xargs -r kill -9 2>/dev/null || true; rm -rf "$work" "$mcfile" "$boxfile"' EXIT

now_ms() { date +%s%3N; }

mc_start() { memcached -u root -p "$port" -U 0 -m 64 -e "$mcfile" >/dev/null 2>&1 & mc=$!; }

# Items memcached holds, once it answers (waits for it to come up).
mc_items() {
  local out
  for _ in $(seq 1 2000); do
    out=$(printf 'stats\r\nquit\r\n' | nc -N 127.0.0.1 "$port" 2>/dev/null || true)
    if [ -n "$out" ]; then
      printf '%s\n' "$out" | tr -d '\r' | awk '$2 == "curr_items" { print $3 }'
      return 0
    fi
    sleep 0.005
  done
  echo "memcached did not come up" >&2; return 1
}

mc_fill() {
  local value; value=$(printf 'x%.0s' $(seq 1 52))
  for ((i = 0; i < items; i++)); do printf 'set k%d 0 0 52 noreply\r\n%s\r\n' "$i" "$value"; done > "$work/fill"
  printf 'quit\r\n' >> "$work/fill"
  nc -N 127.0.0.1 "$port" < "$work/fill" > /dev/null
  while [ "$(mc_items)" -lt "$items" ]; do sleep 0.01; done
}

box_items() { "$rebound" box inspect "$boxfile" | awk '/^[0-9]+\.[0-9]+ / { gsub(",", "", $4); print $4 }'; }

csv="$out/memcached-restart.csv"
echo "system,round,items,restart_ms,items_after_restart,items_after_kill9" > "$csv"
for round in $(seq 1 "$rounds"); do
  # memcached: fill, clean shutdown (SIGUSR1 saves), timed restart.
  rm -f "$mcfile"; mc_start; mc_items >/dev/null; mc_fill
  kill -USR1 "$mc"; wait "$mc" || true
  # memcached refuses a restart in the same second as the stop ("restart
  # incompatible due to setting for [stop_time]"): wait, untimed.
  sleep 1.1
  t0=$(now_ms); mc_start; warm=$(mc_items); t1=$(now_ms)
  # kill -9, restart: what is left?
  kill -9 "$mc"; wait "$mc" 2>/dev/null || true
  mc_start; cold=$(mc_items); kill -9 "$mc"; wait "$mc" 2>/dev/null || true
  echo "memcached -e,$round,$items,$((t1 - t0)),$warm,$cold" >> "$csv"

  # rebound's recovery box: fill, clean shutdown (SIGTERM), timed restart
  # (open + validate); then kill -9 while it is open.
  "$rebound" box fill "$boxfile" --items "$items" >/dev/null & filler=$!
  until [ -s "$boxfile" ] && "$rebound" box inspect "$boxfile" >/dev/null 2>&1 && [ "$(box_items)" = "$items" ]; do sleep 0.01; done
  kill -TERM "$filler"; wait "$filler" 2>/dev/null || true
  t0=$(now_ms); warm=$(box_items); t1=$(now_ms)
  "$rebound" box fill "$boxfile" --items "$items" >/dev/null & filler=$!
  until [ -s "$boxfile" ] && "$rebound" box inspect "$boxfile" >/dev/null 2>&1 && [ "$(box_items)" = "$items" ]; do sleep 0.01; done
  kill -9 "$filler"; wait "$filler" 2>/dev/null || true
  cold=$(box_items)
  echo "recovery box,$round,$items,$((t1 - t0)),$warm,$cold" >> "$csv"
done

echo "restart with $items items of 52 bytes ($rounds rounds, median restart time)"
awk -F, 'NR > 1 { k = $1; n[k]++; t[k, n[k]] = $4; w[k] = $5; c[k] = $6 }
END {
  printf "%-14s %16s %20s %22s\n", "system", "restart ms", "items after restart", "items after kill -9"
  split("memcached -e|recovery box", order, "|")
  for (j = 1; j <= 2; j++) { s = order[j]; m = n[s]
    for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (t[s, b] < t[s, a]) { x = t[s, a]; t[s, a] = t[s, b]; t[s, b] = x }
    printf "%-14s %16d %20d %22d\n", s, t[s, int((m + 1) / 2)], w[s], c[s] }
}' "$csv"
echo "raw results: $csv"
