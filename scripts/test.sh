#!/usr/bin/env bash
# `make test`: every test — C++ (ctest) then the Python SDK (pytest) against a real daemon.
set -uo pipefail
LOG_TAG=test
. "$(dirname "$0")/common.sh"
[ "$(id -u)" -eq 0 ] || exec sudo -E "$0" "$@"
load_images_env
cd "$ROOT"

status=0
# The MCP tests' npm tools (node 22, conformance suite, inspector, SDK), cached by the hash of
# tests/mcp/package-lock.json. Without them (no npm registry) the MCP tests fail: say so here.
log "npm tools of the MCP tests"
if TOOLS="$(bash scripts/install-npm-tools.sh | tail -n 1)" && [ -n "$TOOLS" ]; then
  export ESBD_MCP_TOOLS="$TOOLS"
else
  log "FAILED to install the MCP tests' npm tools: the mcp-labelled tests will fail"; status=1
fi
log "ctest (unit, integration and security tests; 'root'-labelled ones need root: we are uid $(id -u))"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 600 || status=1

if [ -d sdk/python/tests ]; then
  PORT="$(free_port)"
  STATE="$(mktemp -d /tmp/esb-pytest-XXXXXX)"
  log "starting esbd on 127.0.0.1:$PORT for the SDK's end-to-end tests"
  # Two tenants, so the SDK's bad-credential and tenant-isolation cases run too.
  KEY_A="esb_e2e_alice_$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  KEY_B="esb_e2e_bob_$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  # An intent for the network tests (test_e2e_network.py): "check-weather" allows
  # weather.example, which esbd's proxy sends to the egress tests' local upstream.
  printf '{"keys": [{"key": "%s", "tenant": "alice"}, {"key": "%s", "tenant": "bob"}],
  "intents": {"check-weather": {"allow": ["weather.example"]}}}\n' \
    "$KEY_A" "$KEY_B" > "$STATE/config.json"
  mkdir -p "$STATE/upstream"
  coproc UPSTREAM { exec python3 tests/integration/egress/upstream.py "$STATE/upstream"; }
  UPSTREAM_PORT=""
  read -r -t 30 _ UPSTREAM_PORT <&"${UPSTREAM[0]}" || true
  [ -n "$UPSTREAM_PORT" ] || { log "the egress test upstream did not start"; status=1; }
  "$BUILD_DIR/esbd" --listen "127.0.0.1:$PORT" --state-dir "$STATE" --unix-socket none \
    --config "$STATE/config.json" \
    --egress-resolve "weather.example=127.0.0.1:${UPSTREAM_PORT:-9}" \
    --egress-upstream-ca "$STATE/upstream/root.pem" >"$STATE/esbd.log" 2>&1 &
  ESBD_PID=$!
  if wait_healthy "http://127.0.0.1:$PORT" 60; then
    AGENTBOX_E2E_URL="http://127.0.0.1:$PORT" AGENTBOX_E2E_API_KEY="$KEY_A" \
      AGENTBOX_E2E_API_KEY_2="$KEY_B" AGENTBOX_E2E_EGRESS_HOST=weather.example \
      AGENTBOX_E2E_INTENT=check-weather /usr/bin/python3 -m pytest -q sdk/python/tests \
      || status=1
  else
    log "esbd did not start; its log:"; cat "$STATE/esbd.log"; status=1
  fi
  kill -TERM "$ESBD_PID" 2>/dev/null; wait "$ESBD_PID" 2>/dev/null
  [ -n "${UPSTREAM_PID:-}" ] && { kill "$UPSTREAM_PID" 2>/dev/null; wait "$UPSTREAM_PID" 2>/dev/null; }
  # Environments survive esbd by design; tear down what the tests left behind.
  "$BUILD_DIR/esbd" --state-dir "$STATE" --image "default=$ESBD_IMAGE_DEFAULT" cleanup >/dev/null 2>&1 || true
  rm -rf "$STATE"
fi
exit $status
