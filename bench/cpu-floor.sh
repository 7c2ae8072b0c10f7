#!/usr/bin/env bash
# Where a server's CPU time per I/O goes at a fixed offered load below
# saturation: rebound next to nbdkit's null plugin (which stores nothing,
# the floor of the NBD protocol over loopback TCP), with the same client
# (fio's nbd engine, bench/fio/cache-standard.fio at rate_iops).
#
#   bench/cpu-floor.sh [--out DIR] [--rebound PATH] [--runtime SECONDS] [--rounds N]
#
# For each round, load (LOADS, default "20000 60000") and server
# (SERVERS, default "rebound nbdkit-null"): a fresh server, RAMP seconds of
# the load first (default 4), then two windows of the runtime (default 6 s):
#   - the first, unobserved: the server's CPU time (utime + stime of all
#     threads, /proc/PID/stat) and fio's I/Os in it;
#   - the second, observed (perf costs the server time of its own, more
#     for a server making more system calls, so it only gives shares):
#     `perf record -g` (cpu-clock, all threads): DIR/floor-SERVER-LOAD-ROUND.perf,
#     which `rebound bench cpu-floor` sorts into cost categories;
#   - `perf stat` of the system calls a server of this kind makes and of
#     its context switches: DIR/floor-syscalls.csv.
# DIR/floor.csv gets one line per run (I/Os and CPU seconds in the window).
# Servers are started by bench/lib/servers.sh (as for bench/controller.sh).
# Needs perf (linux-perf), fio and nbdkit; installs what is missing.
set -euo pipefail

out="bench/out"; rebound=""; runtime=6; rounds=1
while (($#)); do
  case "$1" in
    --out) out="$2"; shift ;;
    --rebound) rebound="$2"; shift ;;
    --runtime) runtime="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "cpu-floor.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=bench/lib/servers.sh
source "$here/lib/servers.sh"
[ -n "$rebound" ] || rebound="$here/../target/release/rebound"
[ -x "$rebound" ] || { echo "cpu-floor.sh: no rebound binary at $rebound (cargo build --release)" >&2; exit 2; }

need=()
for t in fio:fio nbdkit:nbdkit perf:linux-perf bc:bc; do
  command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${need[@]}"
fi
# perf may refuse to sample other processes' kernel stacks by default.
if [ -w /proc/sys/kernel/perf_event_paranoid ]; then echo -1 > /proc/sys/kernel/perf_event_paranoid; fi

mkdir -p "$out"
work="$(mktemp -d)"
shm="rebound-floor-$$"  # rebound's NVS and recovery box in /dev/shm (bench/lib/servers.sh)
trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$work" "/dev/shm/$shm.nvs" "/dev/shm/$shm.box"' EXIT
port=$((10300 + $$ % 200))
ramp=${RAMP:-4}
ticks=$(getconf CLK_TCK)
read -r -a loads <<< "${LOADS:-20000 60000}"
read -r -a servers <<< "${SERVERS:-rebound nbdkit-null}"
# The system calls counted: what rebound and nbdkit make on this path.
calls=(read write recvfrom recvmsg sendmsg sendto pread64 preadv2 pwrite64 pwritev2
  fdatasync fsync msync futex epoll_wait epoll_pwait poll ppoll sched_yield)
events="context-switches"
for c in "${calls[@]}"; do events+=",syscalls:sys_enter_$c"; done

csv="$out/floor.csv"; scsv="$out/floor-syscalls.csv"
echo "server,load,round,ios,cpu_seconds,perf_file" > "$csv"
echo "server,load,round,event,count" > "$scsv"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

total=$((rounds * ${#loads[@]} * ${#servers[@]})); n=0
for round in $(seq 1 "$rounds"); do
  for load in "${loads[@]}"; do
    for s in "${servers[@]}"; do
      n=$((n + 1))
      printf '[%d/%d] round %d: %-12s at %6d IOPS offered (%ss after %ss)\n' "$n" "$total" "$round" "$s" "$load" "$runtime" "$ramp" >&2
      server_start "$s"
      sed -e "s/\${PORT}/$port/" "$here/fio/cache-standard.fio" > "$work/job.fio"
      # 75% reads: the offered load split between the directions; fio
      # runs past the window so the window is steady state throughout.
      printf 'rate_iops=%d,%d\nruntime=%d\n' $((load * 3 / 4)) $((load / 4)) $((ramp + 2 * runtime + 2)) >> "$work/job.fio"
      fio "$work/job.fio" --output-format=json > "$work/fio.json" 2>"$work/fio.err" &
      fio_pid=$!
      sleep "$ramp"
      c0=$(cpu_ticks "$pid"); t0=$(date +%s.%N)
      sleep "$runtime"
      c1=$(cpu_ticks "$pid"); t1=$(date +%s.%N)
      perf_file="$out/floor-$s-$load-$round.perf"
      perf record -q -e cpu-clock -F 4999 -g -p "$pid" -o "$perf_file" -- sleep "$runtime" >/dev/null 2>"$work/perf.err" &
      rec=$!
      timeout -s INT "$runtime" perf stat -x, -e "$events" -p "$pid" 2>"$work/stat.txt" >/dev/null || true
      wait "$rec" || { echo "cpu-floor.sh: perf record failed:" >&2; cat "$work/perf.err" >&2; exit 1; }
      wait "$fio_pid" || { echo "cpu-floor.sh: fio failed against $s:" >&2; tail -5 "$work/fio.err" >&2; exit 1; }
      server_stop
      secs=$(echo "$t1 - $t0" | bc -l)
      # I/Os in a window: fio's rate over its run (the offered one when
      # the server keeps up) times the window.
      achieved=$(grep -o '"iops" : [0-9.]*' "$work/fio.json" | awk '{s += $3} END {printf "%.0f", s}')
      ios=$(echo "$achieved * $secs" | bc -l | cut -d. -f1)
      cpu=$(echo "($c1 - $c0) / $ticks" | bc -l)
      echo "$s,$load,$round,$ios,$cpu,$perf_file" >> "$csv"
      awk -F, -v s="$s" -v l="$load" -v r="$round" \
        'NF > 3 && $1 ~ /^[0-9]+$/ { ev = $3; sub(/^syscalls:sys_enter_/, "", ev); print s "," l "," r "," ev "," $1 }' \
        "$work/stat.txt" >> "$scsv"
    done
  done
done
echo "raw results: $csv, $scsv" >&2
