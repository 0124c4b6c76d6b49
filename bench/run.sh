#!/usr/bin/env bash
# `make bench`: starts a private esbd and runs the benchmarks against it: bench/bench.py's
# table, then the transport rows (bench/transport_bench.cc) against a fresh daemon.
#   bash bench/run.sh              both
#   bash bench/run.sh mixed [...]  only the mixed auto-vs-heavy POST /run workload
#   bash bench/run.sh transport    only the transport rows (issue 10): 10,000 idle keep-alive
#                                  connections, 1,000 concurrent SSE streams, /healthz req/s vs
#                                  a Beast hello-world server, exec `echo hi` vs fork+exec
#   bash bench/run.sh egress       esb-proxy's added p50 per keep-alive request and per new TLS
#                                  connection vs direct to the same local upstream, same run
#                                  (bench/egress_bench.cc; args: BENCH_EGRESS_N, BENCH_EGRESS_TLS_N)
#   bash bench/run.sh exec-trace   where one exec's time goes: `perf trace` of esbd and the agent
#                                  during 40 execs, summarised by bench/exec_timeline.py
#                                  (BENCH_TRACE_OUT=FILE keeps the raw trace)
#   bash bench/run.sh nano-steps [N]  nano time travel (bench/nano_steps_bench.cc, no daemon):
#                                  step + capture vs the same step without capture (same run),
#                                  rewind/fork latency, compaction, bytes kept per step
#   bash bench/run.sh dlp [...]    DLP throughput (bench/dlp_bench.cc, no daemon): the default
#                                  rule set on 64 KiB mixed-text bodies (and chat-style JSON
#                                  bodies), MB/s per core, vs RE2::Set over the same rules and
#                                  corpus in the same run (arguments go to dlp_bench: --bodies N
#                                  --rounds R --config J [--corpus chat] --profile 1)
#   bash bench/run.sh steps [...]  time travel's per-step cost on the container path (bench/
#                                  step_bench.cc, no daemon): capture of a 2,000-file / 50 MB
#                                  workspace with one file changed vs the step's exec, same run
#   bash bench/run.sh steps-e2e [N]  time travel per driver through esbd (bench/
#                                  steps_e2e_bench.cc; nano, crun, runc, gvisor as the host has
#                                  them): N steps capture on vs off (same daemon, alternating),
#                                  rewind/fork latency, bytes kept per step: docs/benchmarks.md
# Transport knobs (environment): BENCH_ROWS (which rows, default "healthz exec sse idle";
# "exec-ab" adds the exec row against a second daemon with audit.write_behind_ms 0, alternating),
# BENCH_EXEC_GAP_MS (pause between exec calls, 0), BENCH_IDLE_CONNS (10000), BENCH_SSE_STREAMS (1000), BENCH_SSE_BODY (JSON for POST /run;
# default: a nano `time.sleep(5)`), BENCH_EXEC_N (200), BENCH_ESBD_CONFIG (esbd's config JSON;
# default raises the per-tenant request share, see run_transport).
set -euo pipefail
LOG_TAG=bench
. "$(dirname "$0")/../scripts/common.sh"
[ "$(id -u)" -eq 0 ] || exec sudo -E "$0" "$@"
MODE=all
case "${1:-}" in
  mixed) shift; set -- --bench mixed "$@"; MODE=python ;;
  transport) shift; MODE=transport ;;
  exec-trace) shift; MODE=exec-trace ;;
  dlp) shift; MODE=dlp ;;
  egress) shift; MODE=egress ;;
  steps) shift; MODE=steps ;;
  nano-steps) shift; MODE=nano-steps ;;
  steps-e2e) shift; MODE=steps-e2e ;;
esac
if [ "$MODE" = steps ]; then
  cmake --build "$BUILD_DIR" --target step_bench >/dev/null
  log "steps: load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
  exec "$BUILD_DIR/step_bench" "$@"
fi
if [ "$MODE" = dlp ]; then
  cmake --build "$BUILD_DIR" --target dlp_bench >/dev/null
  log "dlp: load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
  exec "$BUILD_DIR/dlp_bench" "$@"
fi
load_images_env
if [ "$MODE" = steps-e2e ]; then
  cmake --build "$BUILD_DIR" --target steps_e2e_bench >/dev/null
  log "steps-e2e: load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores; $(date -u)"
  exec "$BUILD_DIR/steps_e2e_bench" "$@"
fi
if [ "$MODE" = nano-steps ]; then
  cmake --build "$BUILD_DIR" --target nano_steps_bench >/dev/null
  log "nano-steps: load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
  exec "$BUILD_DIR/nano_steps_bench" "$BUILD_DIR/esb-nano-worker" "$ESBD_PYTHON_WASM" "$@"
fi

PIDS=()
STATES=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for state in "${STATES[@]}"; do
    "$BUILD_DIR/esbd" --state-dir "$state" cleanup >/dev/null 2>&1 || true
    rm -rf "$state"
  done
}
trap cleanup EXIT

# start_esbd POOL [CONFIG_JSON]: sets PORT, STATE, PID.
start_esbd() {
  PORT="$(free_port)"
  STATE="$(mktemp -d /tmp/esb-bench-XXXXXX)"
  STATES+=("$STATE")
  local config=()
  if [ -n "${2:-}" ]; then
    printf '%s\n' "$2" >"$STATE/config.json"
    config=(--config "$STATE/config.json")
  fi
  "$BUILD_DIR/esbd" "${config[@]}" --listen "127.0.0.1:$PORT" --state-dir "$STATE" \
    --unix-socket none --pool-size "$1" --log-level warn >"$STATE/esbd.log" 2>&1 &
  PID=$!
  PIDS+=("$PID")
  wait_healthy "http://127.0.0.1:$PORT" 60 || { cat "$STATE/esbd.log"; die "esbd did not start"; }
}

run_python() {
  start_esbd "${BENCH_POOL_SIZE:-4}"
  python3 "$(dirname "$0")/bench.py" --url "http://127.0.0.1:$PORT" --state-dir "$STATE" "$@"
  kill -TERM "$PID"; wait "$PID" 2>/dev/null || true
}

# Builds the transport tools and raises the fd limit this shell's children inherit.
transport_setup() {
  cmake --build "$BUILD_DIR" --target transport_bench beast_hello >/dev/null
  TB="$BUILD_DIR/transport_bench"
  # One fd per connection on both sides: 10,000 idle connections need well over the usual 1024.
  # esbd and beast_hello raise their soft limit to the hard limit themselves; raising the hard
  # limit needs CAP_SYS_RESOURCE (a container may not have it: then the hard limit stays).
  ulimit -Hn 65536 2>/dev/null || log "cannot raise the fd hard limit (no CAP_SYS_RESOURCE?)"
  ulimit -Sn "$(ulimit -Hn)"
  log "RLIMIT_NOFILE for esbd, beast_hello and the client: $(ulimit -Hn)"
}

# Creates a container environment on esbd at $1 (port); prints its id.
create_env() {
  curl -fsS -X POST -H 'Content-Type: application/json' -d '{}' \
    "http://127.0.0.1:$1/environments" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["environment_id"])'
}

run_transport() {
  transport_setup
  # The per-tenant share of concurrent requests (default: a quarter of max_connections = 256)
  # and max_connections are raised so that 1,000 streams from one (anonymous) client measure
  # the transport, not the fair-share policy. Pool 0: no refills during the measurement. The
  # per-peer connection cap (max_open_connections_per_peer, default 7/8 of the open-connection
  # cap = 3/4 of RLIMIT_NOFILE: 13,125 at the 20,000 fds here) must admit the idle row's 10,000
  # connections plus its probe from one address: raised to the open-connection cap's scale.
  local config='{"max_connections": 4096, "max_requests_per_tenant": 4096, "max_streams": 4096,
    "max_open_connections_per_peer": 1048576}'
  start_esbd 0 "${BENCH_ESBD_CONFIG-$config}"
  local esbd_port="$PORT" esbd_pid="$PID"
  local hello_port; hello_port="$(free_port)"
  "$BUILD_DIR/beast_hello" --listen "127.0.0.1:$hello_port" --threads "$(nproc)" &
  local hello_pid=$!
  PIDS+=("$hello_pid")
  wait_healthy "http://127.0.0.1:$hello_port" 10 || die "beast_hello did not start"
  log "transport: esbd pid $esbd_pid on :$esbd_port (config: $(cat "$STATE/config.json" \
    2>/dev/null || echo none)), beast_hello pid $hello_pid on :$hello_port;" \
    "load average: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"

  local rows=" ${BENCH_ROWS:-healthz exec sse idle} "
  if [[ "$rows" == *" healthz "* ]]; then
    log "/healthz throughput: esbd vs Beast hello-world"
    "$TB" healthz --target "127.0.0.1:$esbd_port" --baseline "127.0.0.1:$hello_port" \
      --pid "$esbd_pid" --baseline-pid "$hello_pid" --conns 4 --seconds 2 --rounds 4
  fi
  if [[ "$rows" == *" exec "* ]]; then
    log "exec round trip: echo hi via the API vs fork+exec"
    local env; env="$(create_env "$esbd_port")"
    "$TB" exec --target "127.0.0.1:$esbd_port" --env "$env" --n "${BENCH_EXEC_N:-200}" \
        --gap-ms "${BENCH_EXEC_GAP_MS:-0}"
    curl -fsS -X DELETE "http://127.0.0.1:$esbd_port/environments/$env" >/dev/null
  fi
  if [[ "$rows" == *" exec-ab "* ]]; then
    # The write-behind's effect on exec, same binary and same run: a second daemon with
    # audit.write_behind_ms 0 (audit row and counters written before the reply, as before),
    # alternating rounds against both so that both see the same load.
    local sync_config
    sync_config="$(python3 -c 'import json,sys; c=json.loads(sys.argv[1] or "{}");
c.setdefault("audit", {})["write_behind_ms"]=0; print(json.dumps(c))' \
      "${BENCH_ESBD_CONFIG-$config}")"
    start_esbd 0 "$sync_config"
    local sync_port="$PORT"
    local env_behind env_sync
    env_behind="$(create_env "$esbd_port")"; env_sync="$(create_env "$sync_port")"
    local round
    for round in 1 2; do
      log "exec A/B round $round: audit.write_behind_ms 0 (synchronous, before)"
      "$TB" exec --target "127.0.0.1:$sync_port" --env "$env_sync" --n "${BENCH_EXEC_N:-200}" \
        --gap-ms "${BENCH_EXEC_GAP_MS:-0}"
      log "exec A/B round $round: audit.write_behind_ms 50 (default, after)"
      "$TB" exec --target "127.0.0.1:$esbd_port" --env "$env_behind" --n "${BENCH_EXEC_N:-200}" \
        --gap-ms "${BENCH_EXEC_GAP_MS:-0}"
    done
    curl -fsS -X DELETE "http://127.0.0.1:$esbd_port/environments/$env_behind" >/dev/null
    curl -fsS -X DELETE "http://127.0.0.1:$sync_port/environments/$env_sync" >/dev/null
    kill -TERM "$PID"; wait "$PID" 2>/dev/null || true  # the second daemon (the trap cleans up)
  fi
  if [[ "$rows" == *" sse "* ]]; then
    log "${BENCH_SSE_STREAMS:-1000} concurrent SSE streams"
    local sse_args=()
    [ -n "${BENCH_SSE_BODY:-}" ] && sse_args=(--body "$BENCH_SSE_BODY")
    "$TB" sse --target "127.0.0.1:$esbd_port" --conns "${BENCH_SSE_STREAMS:-1000}" \
      "${sse_args[@]}"
  fi
  if [[ "$rows" == *" idle "* ]]; then
    log "${BENCH_IDLE_CONNS:-10000} idle keep-alive connections (Beast hello first, then esbd)"
    "$TB" idle --target "127.0.0.1:$esbd_port" --pid "$esbd_pid" \
      --baseline "127.0.0.1:$hello_port" --baseline-pid "$hello_pid" \
      --conns "${BENCH_IDLE_CONNS:-10000}" --probe-seconds 5
  fi
  log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
}

run_exec_trace() {
  command -v perf >/dev/null || die "exec-trace needs perf (linux-perf)"
  transport_setup
  start_esbd 0
  local env; env="$(create_env "$PORT")"
  local log_file="$STATE/perf-trace.txt"
  # System-wide, but only the few syscalls that mark the hops (cheap, unlike strace -f).
  perf trace -a -o "$log_file" \
    -e 'accept4,connect,sendmsg,recvmsg,recvfrom,sendto,writev,clone3,clone,pwrite64' &
  local perf_pid=$!
  sleep 2
  "$TB" exec --target "127.0.0.1:$PORT" --env "$env" --n 40 --warmup 2 --gap-ms 20 | tail -1
  sleep 0.3
  kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
  [ -n "${BENCH_TRACE_OUT:-}" ] && cp "$log_file" "$BENCH_TRACE_OUT"
  python3 "$(dirname "$0")/exec_timeline.py" "$log_file" || true
  curl -fsS -X DELETE "http://127.0.0.1:$PORT/environments/$env" >/dev/null
}

run_egress() {
  cmake --build "$BUILD_DIR" --target egress_bench >/dev/null
  log "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BUILD_DIR/egress_bench" "${BENCH_EGRESS_N:-4000}" "${BENCH_EGRESS_TLS_N:-400}"
  log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
}

case "$MODE" in
  egress) run_egress ;;
  python) run_python "$@" ;;
  transport) run_transport ;;
  exec-trace) run_exec_trace ;;
  all) run_python "$@"; run_transport ;;
esac
