#!/usr/bin/env bash
# Compare rebound with other NBD servers on the same machine, in the same
# run, with the same client: fio's nbd engine running bench/fio/cache-standard.fio
# (4 KiB random, 75% reads, iodepth 32, over a 1 GiB export).
#
#   bench/controller.sh [--quick] [--out DIR] [--rebound PATH] [--rounds N] [--runtime SECONDS]
#
# Servers: rebound (whole data path: rcs dispatch, cache, NVS, destage)
# over TCP, over a Unix socket (rebound-unix) and over TLS (rebound-tls,
# --tls require with a throwaway X.509 CA); nbdkit file plugin (on a
# preallocated 1 GiB file), the same with --tls=require (nbdkit-tls),
# nbdkit memory plugin, qemu-nbd (raw file). Rounds are interleaved (every
# server once per round) and the median round per server is reported, with
# the server's CPU time per I/O (utime + stime of all its threads, from
# /proc/PID/stat, over the run). Prints a table and writes
# DIR/controller.csv (one line per run). `rebound bench controller` runs this
# script and draws DIR/controller.png.
#
# Then random writes of 4 KiB and of 512 bytes (bench/fio/randwrite.fio) on
# rebound, where 512 bytes is a read-modify-write of a 4 KiB track, and on
# nbdkit's file plugin: DIR/controller-writes.csv and a second table.
#
# Last, the server's CPU time per I/O at fixed offered loads below
# saturation (fio's rate_iops, 75% reads: LOADS, default "20000 60000"
# IOPS), next to nbdkit's null plugin (stores nothing: the floor of the
# protocol and loopback TCP alone): DIR/controller-cpu.csv and a third table.
# Taken in steady state: after RAMP seconds of the same load (default half
# the runtime), over the runtime. For rebound, the same time split by
# thread role (destage threads against the rest, the request path):
# DIR/controller-cpu-threads.csv and a fourth table.
#
# A server named with the suffix -filled (rebound-filled, the default
# extra row; nbdkit-file-filled, ...) is the same server with the whole
# export written first (bench/fio/fill.fio: 1 MiB sequential writes, then
# FLUSH), so that no read miss is a track never written: rebound answers
# those from its allocation map without a device read, and a file
# plugin reads a hole. The fill is not counted.
#
# Servers are started by bench/lib/servers.sh (as for bench/cpu-floor.sh).
#
# Environment: REBOUND_FLAGS adds flags to `rebound serve` (experiments);
# SERVERS limits the servers measured (default: all); WRITE_SERVERS
# those of the write table (default: rebound nbdkit-file); CPU_SERVERS
# those of the fixed-load tables (default: rebound rebound-filled
# rebound-unix nbdkit-file nbdkit-null); LOADS and RAMP as above.
set -euo pipefail

quick=0; out="bench/out"; rebound=""; rounds=""; runtime=""
while (($#)); do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --rebound) rebound="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --runtime) runtime="$2"; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "controller.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if ((quick)); then rounds=${rounds:-1}; runtime=${runtime:-5}; else rounds=${rounds:-3}; runtime=${runtime:-20}; fi
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=bench/lib/servers.sh
source "$here/lib/servers.sh"
job="$here/fio/cache-standard.fio"
if [ -z "$rebound" ]; then
  rebound="$here/../target/release/rebound"
fi
[ -x "$rebound" ] || { echo "controller.sh: no rebound binary at $rebound (cargo build --release)" >&2; exit 2; }

need=()
for t in fio:fio nbdkit:nbdkit qemu-nbd:qemu-utils jq:jq openssl:openssl curl:curl bc:bc; do
  command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${need[@]}"
fi

mkdir -p "$out"
work="$(mktemp -d)"
shm="rebound-bench-$$"  # rebound's NVS and recovery box in /dev/shm (bench/lib/servers.sh)
trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$work" "/dev/shm/$shm.nvs" "/dev/shm/$shm.box"' EXIT
# Ports below the kernel's ephemeral range: a port inside it may be the
# local end of a client connection (or its TIME_WAIT) at the moment a
# server binds it, and the bind fails with "Address already in use"
# (CI hit it once with 20000 + PID % 20000).
read -r ephemeral_low _ < /proc/sys/net/ipv4/ip_local_port_range
span=$(( ephemeral_low - 10002 )); ((span > 0)) || span=1
port=$((10000 + $$ % span))
mport=$((port + 1))  # rebound's metrics endpoint (read hit ratio)
hits="$out/controller-hits.csv"
echo "server,round,reads,hit_ratio" > "$hits"
csv="$out/controller.csv"
echo "server,round,iops,read_p99_us,write_p99_us,read_mean_us,write_mean_us,cpu_us_per_io" > "$csv"
ticks=$(getconf CLK_TCK)

# A throwaway CA and a server certificate for 127.0.0.1, in the layout
# nbdkit, qemu and rebound read (ca-cert.pem, server-cert.pem,
# server-key.pem).
pki="$work/pki"; mkdir -p "$pki"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=rebound bench CA" \
  -keyout "$pki/ca-key.pem" -out "$pki/ca-cert.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
  -keyout "$pki/server-key.pem" -out "$pki/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$pki/san.ext"
openssl x509 -req -in "$pki/server.csr" -CA "$pki/ca-cert.pem" -CAkey "$pki/ca-key.pem" \
  -CAcreateserial -days 2 -extfile "$pki/san.ext" -out "$pki/server-cert.pem" 2>/dev/null
chmod 600 "$pki"/*-key.pem

# The URI fio's nbd engine connects to for server $1.
uri_of() {
  case "${1%-filled}" in
    rebound-unix) echo "nbd+unix:///?socket=$work/nbd.sock" ;;
    # fio cannot name local files in its URI (libnbd refuses
    # tls-certificates there for it): encrypt without checking the server.
    *-tls) echo "nbds://127.0.0.1:$port/?tls-verify-peer=false" ;;
    *) echo "nbd://127.0.0.1:$port/" ;;
  esac
}

# fio's job for server $1 (its URI) from job file $2 into $3.
job_for() {
  sed -e "s/^runtime=.*/runtime=$runtime/" -e "s|^uri=.*|uri=$(uri_of "$1")|" "$2" > "$3"
}

# CPU seconds (user + system, all threads) process $1 has used, in ticks.
cpu_ticks() {
  awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0
}

# The same, split: user ticks, then system (kernel) ticks.
cpu_split() {
  awk '{ print $14, $15 }' "/proc/$1/stat" 2>/dev/null || echo 0 0
}

# CPU ticks (user + system) of rebound's destage threads: the rcs workers,
# which run destage's device writes, and the destage syncer (fdatasync).
# Long-lived threads, so a per-thread sum over a window is exact; the
# connection threads are what is left of the process's time.
destage_ticks() {
  local t c sum=0
  for t in /proc/"$1"/task/*; do
    c=$(cat "$t/comm" 2>/dev/null) || continue
    case "$c" in
      rebound-worker*|rebound-destage) sum=$((sum + $(cpu_ticks "$1/task/${t##*/}"))) ;;
    esac
  done
  echo "$sum"
}

# Write the whole export of server $1 (started) once, then FLUSH.
fill() {
  job_for "$1" "$here/fio/fill.fio" "$work/fill.fio"
  fio "$work/fill.fio" --output-format=json 2>"$work/fio.err" >/dev/null \
    || { echo "controller.sh: filling $1 failed:" >&2; tail -5 "$work/fio.err" >&2; exit 1; }
}

# Start server $1; NAME-filled is NAME with its export written first.
start() {
  local server="${1%-filled}"
  server_start "$server"
  if [ "$server" != "$1" ]; then fill "$1"; fi
}

stop() {
  server_stop
}

all_servers="rebound rebound-unix nbdkit-file nbdkit-memory qemu-nbd"
# TLS rows when this rebound has --tls.
if "$rebound" serve --help 2>/dev/null | grep -q -- '--tls '; then
  all_servers="rebound rebound-unix rebound-tls nbdkit-file nbdkit-tls nbdkit-memory qemu-nbd"
fi
read -r -a servers <<< "${SERVERS:-$all_servers}"
total=$((rounds * ${#servers[@]})); n=0
for round in $(seq 1 "$rounds"); do
  for s in "${servers[@]}"; do
    n=$((n + 1))
    printf '\r[%d/%d] round %d: %-14s (%ss)' "$n" "$total" "$round" "$s" "$runtime" >&2
    start "$s"
    job_for "$s" "$job" "$work/job.fio"
    cpu0=$(cpu_ticks "$pid")
    fio "$work/job.fio" --output-format=json 2>"$work/fio.err" | sed -n '/^{/,$p' > "$work/out.json" \
      || { echo "controller.sh: fio failed against $s:" >&2; tail -5 "$work/fio.err" >&2; exit 1; }
    cpu1=$(cpu_ticks "$pid")
    if [[ "$s" == rebound* ]]; then
      # Reads served by the cache (frames) or the NVS, of all reads.
      curl -sf "http://127.0.0.1:$mport/metrics" | awk -v s="$s" -v r="$round" '
        /^rebound_cache_hits_total /     { h += $2 }
        /^rebound_cache_nvs_hits_total / { h += $2 }
        /^rebound_cache_misses_total /   { m += $2 }
        END { if (h + m > 0) printf "%s,%s,%d,%.4f\n", s, r, h + m, h / (h + m) }' >> "$hits" || true
    fi
    stop
    jq -r --arg s "$s" --arg r "$round" --arg cpu "$(( cpu1 - cpu0 ))" --arg hz "$ticks" '.jobs[0] as $j | [$s, $r,
        ($j.read.iops + $j.write.iops),
        ($j.read.clat_ns.percentile["99.000000"] / 1000),
        ($j.write.clat_ns.percentile["99.000000"] / 1000),
        ($j.read.clat_ns.mean / 1000), ($j.write.clat_ns.mean / 1000),
        (($cpu | tonumber) / ($hz | tonumber) * 1e6 / ($j.read.total_ios + $j.write.total_ios))] | @csv' \
      "$work/out.json" | tr -d '"' >> "$csv"
  done
done
printf '\r%60s\r' '' >&2

echo "cache-standard (fio nbd engine, 4 KiB random 75% read, iodepth 32, 1 GiB): $rounds round(s) of ${runtime}s, median per server"
awk -F, 'NR > 1 { if (!($1 in n)) seen[++ns] = $1; n[$1]++; i[$1, n[$1]] = $3; rp[$1, n[$1]] = $4; wp[$1, n[$1]] = $5; rm[$1, n[$1]] = $6; wm[$1, n[$1]] = $7; cp[$1, n[$1]] = $8 }
END {
  na = split("rebound rebound-unix rebound-tls nbdkit-file nbdkit-tls nbdkit-memory qemu-nbd", all, " ")
  c = 0; for (k = 1; k <= na; k++) if (all[k] in n) { order[++c] = all[k]; known[all[k]] = 1 }
  # Then any other server measured (a -filled one), in the order run.
  for (k = 1; k <= ns; k++) if (!(seen[k] in known)) order[++c] = seen[k]
  for (k = 1; k <= c; k++) {
    s = order[k]; m = n[s]
    # median by IOPS: sort indices
    for (a = 1; a <= m; a++) idx[a] = a
    for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (i[s, idx[b]] < i[s, idx[a]]) { t = idx[a]; idx[a] = idx[b]; idx[b] = t }
    j = idx[int((m + 1) / 2)]
    med[s] = i[s, j]; p99r[s] = rp[s, j]; p99w[s] = wp[s, j]; mr[s] = rm[s, j]; mw[s] = wm[s, j]; cpu[s] = cp[s, j]
  }
  printf "%-18s %10s %9s %14s %15s %13s %14s %12s\n", "server", "IOPS", "vs file", "read p99 µs", "write p99 µs", "read mean µs", "write mean µs", "CPU µs/IO"
  for (k = 1; k <= c; k++) { s = order[k]
    printf "%-18s %10.0f %9.3f %14.0f %15.0f %13.1f %14.1f %12.1f\n", s, med[s], med[s] / med["nbdkit-file"], p99r[s], p99w[s], mr[s], mw[s], cpu[s] }
  ratio = med["rebound"] / med["nbdkit-file"]
  p99 = (p99r["rebound"] <= p99r["nbdkit-file"] && p99w["rebound"] <= p99w["nbdkit-file"])
  printf "target: rebound >= 1.1x nbdkit-file IOPS: %.3fx (%s); p99 no worse (read %.0f vs %.0f, write %.0f vs %.0f µs): %s\n",
    ratio, (ratio >= 1.1 ? "met" : "MISSED"), p99r["rebound"], p99r["nbdkit-file"], p99w["rebound"], p99w["nbdkit-file"], (p99 ? "met" : "MISSED")
  if ("rebound-unix" in n) printf "rebound over a Unix socket: %.3fx its TCP IOPS, %.1f vs %.1f CPU µs/IO\n", med["rebound-unix"] / med["rebound"], cpu["rebound-unix"], cpu["rebound"]
  if ("rebound-tls" in n && "nbdkit-tls" in n) printf "TLS: rebound %.3fx its plaintext IOPS, nbdkit-file %.3fx its plaintext IOPS; rebound-tls %.3fx nbdkit-tls\n", med["rebound-tls"] / med["rebound"], med["nbdkit-tls"] / med["nbdkit-file"], med["rebound-tls"] / med["nbdkit-tls"]
}' "$csv"
awk -F, 'NR > 1 && $1 == "rebound" { n++; v[n] = $4 }
END { if (n) { for (a = 1; a <= n; a++) for (b = a + 1; b <= n; b++) if (v[b] < v[a]) { t = v[a]; v[a] = v[b]; v[b] = t }
  printf "rebound read hit ratio (cache frames and NVS records, of all reads): %.3f, median of %d (the paper'"'"'s cache-standard: 0.735)\n", v[int((n + 1) / 2)], n } }' "$hits"
echo "raw results: $csv"

# The partial-track path: random writes of 512 bytes (the Linux kernel
# client's default block size) against whole 4 KiB tracks, on rebound and
# on nbdkit's file plugin, interleaved as above.
wjob="$here/fio/randwrite.fio"
wcsv="$out/controller-writes.csv"
echo "server,bs,round,iops,write_p99_us,write_mean_us" > "$wcsv"
read -r -a wservers <<< "${WRITE_SERVERS:-rebound nbdkit-file}"
total=$((rounds * ${#wservers[@]} * 2)); n=0
for round in $(seq 1 "$rounds"); do
  for s in "${wservers[@]}"; do
    for bs in 4k 512; do
      n=$((n + 1))
      printf '\r[%d/%d] round %d: %-14s %4s writes (%ss)' "$n" "$total" "$round" "$s" "$bs" "$runtime" >&2
      start "$s"
      job_for "$s" "$wjob" "$work/write.fio"
      BS=$bs fio "$work/write.fio" --output-format=json 2>"$work/fio.err" | sed -n '/^{/,$p' > "$work/out.json" \
        || { echo "controller.sh: fio failed against $s:" >&2; tail -5 "$work/fio.err" >&2; exit 1; }
      stop
      jq -r --arg s "$s" --arg b "$bs" --arg r "$round" '.jobs[0] as $j | [$s, $b, $r, $j.write.iops,
          ($j.write.clat_ns.percentile["99.000000"] / 1000), ($j.write.clat_ns.mean / 1000)] | @csv' \
        "$work/out.json" | tr -d '"' >> "$wcsv"
    done
  done
done
printf '\r%70s\r' '' >&2
echo
echo "random writes (fio nbd engine, iodepth 32, 1 GiB): $rounds round(s) of ${runtime}s, median per server and block size"
awk -F, 'NR > 1 { k = $1 " " $2; n[k]++; i[k, n[k]] = $4; p[k, n[k]] = $5; mn[k, n[k]] = $6; if (!(k in seen)) { seen[k] = 1; order[++c] = k } }
END {
  printf "%-22s %10s %12s %15s %14s\n", "server, block size", "IOPS", "vs its 4k", "write p99 µs", "write mean µs"
  for (q = 1; q <= c; q++) { k = order[q]; m = n[k]
    for (a = 1; a <= m; a++) idx[a] = a
    for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (i[k, idx[b]] < i[k, idx[a]]) { t = idx[a]; idx[a] = idx[b]; idx[b] = t }
    j = idx[int((m + 1) / 2)]; med[k] = i[k, j]; pp[k] = p[k, j]; mm[k] = mn[k, j] }
  for (q = 1; q <= c; q++) { k = order[q]; split(k, w, " ")
    printf "%-22s %10.0f %12.3f %15.0f %14.1f\n", w[1] ", " w[2], med[k], med[k] / med[w[1] " 4k"], pp[k], mm[k] }
}' "$wcsv"
echo "raw results: $wcsv"

# Server CPU per I/O at fixed offered loads (issue: per-I/O cost below a
# server that stores nothing). At saturation every server takes about one
# core and CPU per I/O only mirrors IOPS; below it, it shows the server.
# Steady state: fio runs RAMP seconds first (default half the runtime;
# rebound's cache and the page cache fill, a server that has run for a
# while is the one users have), and the CPU time is taken over the
# measured runtime only, divided by the I/Os fio counted in it.
ramp=${RAMP:-$((runtime / 2))}
ccsv="$out/controller-cpu.csv"
echo "server,load,round,iops,cpu_us_per_io,read_p99_us,write_p99_us,user_us_per_io,sys_us_per_io" > "$ccsv"
# rebound's CPU per I/O split by thread role: the connection threads (the
# whole request path) and the destage threads (device writes and syncs).
tcsv="$out/controller-cpu-threads.csv"
echo "server,load,round,request_path_us_per_io,destage_us_per_io" > "$tcsv"
read -r -a loads <<< "${LOADS:-20000 60000}"
read -r -a cservers <<< "${CPU_SERVERS:-rebound rebound-filled rebound-unix nbdkit-file nbdkit-null}"
total=$((rounds * ${#cservers[@]} * ${#loads[@]})); n=0
for round in $(seq 1 "$rounds"); do
  for load in "${loads[@]}"; do
    for s in "${cservers[@]}"; do
      n=$((n + 1))
      printf '\r[%d/%d] round %d: %-14s at %6d IOPS offered (%ss)' "$n" "$total" "$round" "$s" "$load" "$runtime" >&2
      start "$s"
      job_for "$s" "$job" "$work/rate.fio"
      # 75% reads: split the offered load between the directions.
      printf 'rate_iops=%d,%d\nramp_time=%d\n' $((load * 3 / 4)) $((load / 4)) "$ramp" >> "$work/rate.fio"
      rm -f "$work/cpu0"
      (sleep "$ramp"; echo "$(cpu_split "$pid") $(date +%s.%N) $(destage_ticks "$pid")" > "$work/cpu0") &
      sampler=$!
      fio "$work/rate.fio" --output-format=json 2>"$work/fio.err" | sed -n '/^{/,$p' > "$work/out.json" \
        || { echo "controller.sh: fio failed against $s:" >&2; tail -5 "$work/fio.err" >&2; exit 1; }
      read -r user1 sys1 < <(cpu_split "$pid"); t1=$(date +%s.%N); d1=$(destage_ticks "$pid")
      wait "$sampler"
      read -r user0 sys0 t0 d0 < "$work/cpu0"
      secs=$(echo "$t1 - $t0" | bc -l)
      stop
      # I/Os in the window: fio's rate over its measured runtime, times the
      # window the CPU time was taken over.
      # User and system time apart: what the server does itself, and what
      # it asks of the kernel (system calls, copies, wake-ups).
      jq -r --arg s "$s" --arg l "$load" --arg r "$round" --arg user "$(( user1 - user0 ))" \
          --arg sys "$(( sys1 - sys0 ))" --arg hz "$ticks" \
          --arg secs "$secs" '.jobs[0] as $j
          | (1e6 / ($hz | tonumber) / (($j.read.iops + $j.write.iops) * ($secs | tonumber))) as $per
          | [$s, $l, $r,
          ($j.read.iops + $j.write.iops),
          ((($user | tonumber) + ($sys | tonumber)) * $per),
          ($j.read.clat_ns.percentile["99.000000"] / 1000), ($j.write.clat_ns.percentile["99.000000"] / 1000),
          (($user | tonumber) * $per), (($sys | tonumber) * $per)] | @csv' \
        "$work/out.json" | tr -d '"' >> "$ccsv"
      if [[ "$s" == rebound* ]]; then
        jq -r --arg s "$s" --arg l "$load" --arg r "$round" --arg all "$(( user1 + sys1 - user0 - sys0 ))" \
            --arg d "$(( d1 - d0 ))" --arg hz "$ticks" --arg secs "$secs" '.jobs[0] as $j
            | (1e6 / ($hz | tonumber) / (($j.read.iops + $j.write.iops) * ($secs | tonumber))) as $per
            | [$s, $l, $r, ((($all | tonumber) - ($d | tonumber)) * $per), (($d | tonumber) * $per)] | @csv' \
          "$work/out.json" | tr -d '"' >> "$tcsv"
      fi
    done
  done
done
printf '\r%75s\r' '' >&2
echo
echo "server CPU per I/O at fixed offered loads (cache-standard, rate_iops 75/25): $rounds round(s) of ${runtime}s after ${ramp}s of ramp, median per server and load"
awk -F, 'NR > 1 { k = $1 " " $2; n[k]++; c[k, n[k]] = $5; i[k, n[k]] = $4; rp[k, n[k]] = $6; wp[k, n[k]] = $7; us[k, n[k]] = $8; sy[k, n[k]] = $9; if (!(k in seen)) { seen[k] = 1; order[++q] = k } }
END {
  printf "%-18s %10s %10s %12s %13s %10s %10s %12s %12s\n", "server", "offered", "IOPS", "CPU µs/IO", "vs null", "user µs", "sys µs", "read p99 µs", "write p99 µs"
  for (a = 1; a <= q; a++) { k = order[a]; m = n[k]
    for (x = 1; x <= m; x++) idx[x] = x
    for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (c[k, idx[y]] < c[k, idx[x]]) { t = idx[x]; idx[x] = idx[y]; idx[y] = t }
    j = idx[int((m + 1) / 2)]; med[k] = c[k, j]; io[k] = i[k, j]; r9[k] = rp[k, j]; w9[k] = wp[k, j]; u9[k] = us[k, j]; s9[k] = sy[k, j] }
  for (a = 1; a <= q; a++) { k = order[a]; split(k, w, " ")
    floor = med["nbdkit-null " w[2]]
    printf "%-18s %10d %10.0f %12.1f %13s %10.1f %10.1f %12.0f %12.0f\n", w[1], w[2], io[k], med[k], (floor > 0 ? sprintf("%.2fx", med[k] / floor) : "-"), u9[k], s9[k], r9[k], w9[k] }
  for (a = 1; a <= q; a++) { k = order[a]; split(k, w, " ")
    floor = med["nbdkit-null " w[2]]
    if (w[1] == "rebound" && floor > 0)
      printf "target: rebound CPU per I/O at most nbdkit-null'"'"'s at %d offered: %.1f vs %.1f µs (%s)\n", w[2], med[k], floor, (med[k] <= floor ? "met" : "MISSED")
    if (w[1] == "rebound-filled" && floor > 0)
      printf "rebound on a volume written whole first, at %d offered: %.1f vs %.1f µs (%.2fx nbdkit-null; every read miss a device read)\n", w[2], med[k], floor, med[k] / floor }
}' "$ccsv"
echo "raw results: $ccsv"
echo
echo "rebound's CPU per I/O by thread role at the same loads (median round): the request path (every thread but destage's: the connection threads run the protocol, cache, NVS record and replies) and destage (rcs workers' device writes, the syncer's fdatasync writeback), next to nbdkit-null's whole server"
awk -F, 'FNR == 1 { f++; next }
  f == 1 && $1 == "nbdkit-null" { k = $2; nn[k]++; nv[k, nn[k]] = $5 }
  f == 2 { k = $1 " " $2; n[k]++; rp[k, n[k]] = $4; ds[k, n[k]] = $5; if (!(k in seen)) { seen[k] = 1; order[++q] = k } }
  END {
    printf "%-18s %10s %18s %12s %18s\n", "server", "offered", "request path µs", "destage µs", "nbdkit-null µs"
    for (a = 1; a <= q; a++) { k = order[a]; m = n[k]; split(k, w, " ")
      # the round whose total is the median
      for (x = 1; x <= m; x++) idx[x] = x
      for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (rp[k, idx[y]] + ds[k, idx[y]] < rp[k, idx[x]] + ds[k, idx[x]]) { t = idx[x]; idx[x] = idx[y]; idx[y] = t }
      j = idx[int((m + 1) / 2)]
      mm = nn[w[2]]; for (x = 1; x <= mm; x++) v[x] = nv[w[2], x]
      for (x = 1; x <= mm; x++) for (y = x + 1; y <= mm; y++) if (v[y] < v[x]) { t = v[x]; v[x] = v[y]; v[y] = t }
      printf "%-18s %10d %18.1f %12.1f %18s\n", w[1], w[2], rp[k, j], ds[k, j], (mm ? sprintf("%.1f", v[int((mm + 1) / 2)]) : "-") }
  }' "$ccsv" "$tcsv"
echo "raw results: $tcsv"
