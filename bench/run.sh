#!/usr/bin/env bash
# `make bench`: starts a private esbd and runs the benchmarks against it.
set -euo pipefail
LOG_TAG=bench
. "$(dirname "$0")/../scripts/common.sh"
[ "$(id -u)" -eq 0 ] || exec sudo -E "$0" "$@"
# `bench/run.sh mixed [...]` runs only the mixed auto-vs-heavy POST /run workload.
if [ "${1:-}" = "mixed" ]; then shift; set -- --bench mixed "$@"; fi
load_images_env
PORT="$(free_port)"
STATE="$(mktemp -d /tmp/esb-bench-XXXXXX)"
POOL="${BENCH_POOL_SIZE:-4}"
"$BUILD_DIR/esbd" --listen "127.0.0.1:$PORT" --state-dir "$STATE" --unix-socket none \
  --pool-size "$POOL" --log-level warn >"$STATE/esbd.log" 2>&1 &
PID=$!
cleanup() {
  kill -TERM "$PID" 2>/dev/null; wait "$PID" 2>/dev/null
  "$BUILD_DIR/esbd" --state-dir "$STATE" cleanup >/dev/null 2>&1 || true
  rm -rf "$STATE"
}
trap cleanup EXIT
wait_healthy "http://127.0.0.1:$PORT" 60 || { cat "$STATE/esbd.log"; die "esbd did not start"; }
python3 "$(dirname "$0")/bench.py" --url "http://127.0.0.1:$PORT" --state-dir "$STATE" "$@"
