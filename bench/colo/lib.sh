# shellcheck shell=bash disable=SC2154
# (bin, out, backend and results are the caller's.)
# Pieces the co-located benches share (sourced by bench/colo/run.sh, latency.sh and
# step_rounds.sh).
# The caller sets bin (the binary dir), out (where logs go) and backend, then calls colo_setup.
colo_pids=()

# Makes $out and the scratch dir $dir, finds the binaries' libraries, and stops the servers and
# removes $dir on exit.
colo_setup() {
  mkdir -p "$out"
  dir=$(mktemp -d)
  colo_libs
  trap colo_cleanup EXIT
}

# The binary dir's libraries (a bundle keeps them in ../lib).
colo_libs() {
  local lib
  lib=$(cd "$bin/.." && pwd)/lib
  [[ -d $lib ]] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  return 0
}

colo_cleanup() {
  ((${#colo_pids[@]})) && kill "${colo_pids[@]}" 2>/dev/null
  ((${#colo_pids[@]})) && wait "${colo_pids[@]}" 2>/dev/null
  rm -rf "$dir"
}

# Waits for a port file written by a server started in the background (pid $2); its log is $3.
colo_wait_port() {
  local file=$1 pid=$2 log=$3
  for _ in $(seq 300); do
    [[ -s $file ]] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "colo: a server did not start:" >&2
  cat "$log" >&2
  exit 1
}

# start_attention NAME FLAGS...: attention_server on free loopback ports with --backend=$backend;
# sets NAME_target (127.0.0.1:PORT), NAME_metrics (its metrics port) and NAME_pid. Log:
# $out/NAME.log.
start_attention() {
  local name=$1
  shift
  "$bin/attention_server" --backend="$backend" --host=127.0.0.1 --port=0 --metrics_port=0 \
    --port_file="$dir/$name.port" "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  colo_pids+=("$pid")
  colo_wait_port "$dir/$name.port" "$pid" "$out/$name.log"
  printf -v "${name}_target" '127.0.0.1:%s' "$(cut -d' ' -f1 "$dir/$name.port")"
  printf -v "${name}_metrics" '%s' "$(cut -d' ' -f2 "$dir/$name.port")"
  printf -v "${name}_pid" '%s' "$pid"
}

# start_echo NAME FLAGS...: attn_echo_server on a free loopback port; sets NAME_target and
# NAME_pid. Log: $out/NAME.log.
start_echo() {
  local name=$1
  shift
  "$bin/attn_echo_server" --port=0 --port_file="$dir/$name.port" "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  colo_pids+=("$pid")
  colo_wait_port "$dir/$name.port" "$pid" "$out/$name.log"
  printf -v "${name}_target" '127.0.0.1:%s' "$(cat "$dir/$name.port")"
  printf -v "${name}_pid" '%s' "$pid"
}

# stop_server PID: SIGTERM and wait (a GPU server frees its device memory for the next one).
stop_server() {
  kill "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  return 0
}

# busy PORT: attention_device_busy_ratio (the largest over the devices) of the attention_server
# whose metrics port is PORT. The server computes it at each scrape over the time since its last
# scrape at or before 10 s ago (kBusyWindow, server/metrics/metrics.h), or since its start.
busy() {
  python3 - "$1" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
vals = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("attention_device_busy_ratio")]
print(max(vals) if vals else "null")
PY
}

# busy_poll PORT: scrapes PORT every second until killed (or the server is gone), so that a busy
# ratio scraped next covers only the last 10 to 11 s, not what came before a longer run.
busy_poll() {
  while busy "$1" >/dev/null 2>&1; do sleep 1; done
}

# keep NAME VALUE: one result line in $results, echoed; a VALUE that is not a JSON object or a
# number (a tool that failed) is kept as null, its output being in the logs.
keep() {
  local value=${2:-null}
  [[ $value == \{* || $value =~ ^[0-9.]+$ ]] || value=null
  echo "{\"run\": \"$1\", \"result\": $value}" >>"$results"
  echo "$1: $value"
}
