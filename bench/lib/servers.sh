# The NBD servers the benches compare, started one way for every bench
# that sources this file (bench/controller.sh, bench/cpu-floor.sh): the
# flags `rebound serve` gets and the peers' plugins and files live here.
#
# The caller sets: rebound (the binary), work (a scratch directory), port
# (the TCP port to serve on), shm (the name of rebound's NVS and recovery
# box in /dev/shm, without suffix); optionally mport (rebound's metrics
# endpoint on 127.0.0.1) and pki (a directory holding ca-cert.pem,
# server-cert.pem and server-key.pem, for the -tls servers).
# REBOUND_FLAGS adds flags to `rebound serve` (experiments).
#
# server_start NAME starts a fresh server (a new volume, file or NVS each
# time) and returns once it accepts connections; it sets pid. A server's
# stderr goes to $work/server.log. server_stop ends it.

# Start server $1: rebound (TCP), rebound-unix ($work/nbd.sock),
# rebound-tls (--tls require), nbdkit-file and nbdkit-tls (on a
# preallocated 1 GiB file), nbdkit-memory, nbdkit-null (stores nothing),
# qemu-nbd (raw file).
server_start() {
  case "$1" in
    rebound|rebound-unix|rebound-tls)
      local listen=(--listen "127.0.0.1:$port") extra=()
      [ "$1" = rebound-unix ] && listen=(--listen "unix:$work/nbd.sock")
      [ "$1" = rebound-tls ] && listen+=(--tls require --tls-certificates "${pki:?the -tls servers need pki}")
      [ -n "${mport:-}" ] && extra=(--metrics "127.0.0.1:$mport")
      rm -rf "$work/rebound" "$work/nbd.sock" "/dev/shm/$shm.nvs" "/dev/shm/$shm.box"
      # shellcheck disable=SC2086 # REBOUND_FLAGS is a list of flags.
      "$rebound" serve "${listen[@]}" --data-dir "$work/rebound" \
        --nvs "/dev/shm/$shm.nvs" --box "/dev/shm/$shm.box" \
        "${extra[@]}" ${REBOUND_FLAGS:-} 2>"$work/server.log" & ;;
    nbdkit-file)
      rm -f "$work/file.img"; fallocate -l 1G "$work/file.img"
      nbdkit -f -p "$port" file "$work/file.img" 2>"$work/server.log" & ;;
    nbdkit-tls)
      rm -f "$work/file.img"; fallocate -l 1G "$work/file.img"
      nbdkit -f -p "$port" --tls=require --tls-certificates="${pki:?the -tls servers need pki}" file "$work/file.img" 2>"$work/server.log" & ;;
    nbdkit-memory)
      nbdkit -f -p "$port" memory 1G 2>"$work/server.log" & ;;
    nbdkit-null)
      nbdkit -f -p "$port" null 1G 2>"$work/server.log" & ;;
    qemu-nbd)
      rm -f "$work/qemu.img"; fallocate -l 1G "$work/qemu.img"
      qemu-nbd -f raw -x "" -p "$port" -t "$work/qemu.img" 2>"$work/server.log" & ;;
    *)
      echo "$(basename "$0"): unknown server $1 (rebound, rebound-unix, rebound-tls, nbdkit-file, nbdkit-tls, nbdkit-memory, nbdkit-null, qemu-nbd)" >&2
      exit 2 ;;
  esac
  pid=$!
  server_wait "$1"
}

# Wait (up to 10 s) until server $1, process $pid, accepts connections;
# exit with its log's tail if it dies or does not.
server_wait() {
  for _ in $(seq 1 200); do
    if [ "$1" = rebound-unix ]; then
      [ -S "$work/nbd.sock" ] && return 0
    else
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$(basename "$0"): $1 did not start:" >&2
      tail -n 5 "$work/server.log" >&2 || true
      exit 1
    fi
    sleep 0.05
  done
  echo "$(basename "$0"): $1 did not listen within 10 s" >&2
  tail -n 5 "$work/server.log" >&2 || true
  exit 1
}

# Stop the server started last (SIGINT: a clean shutdown) and reap it.
server_stop() {
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
