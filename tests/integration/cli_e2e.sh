#!/usr/bin/env bash
# End-to-end test of the `esb` CLI against a real esbd (root: containers). Exit 77 = skipped.
set -uo pipefail
BUILD="${1:?usage: cli_e2e.sh BUILD_DIR}"
if [ "$(id -u)" -ne 0 ]; then echo "SKIP: needs root (containers)"; exit 77; fi
if [ -z "${ESBD_IMAGE_DEFAULT:-}" ]; then echo "SKIP: ESBD_IMAGE_DEFAULT unset (run via make test)"; exit 77; fi

STATE="$(mktemp -d /tmp/esb-cli-e2e-XXXXXX)"
# esbd binds port 0 and says which port it got in its start-up line (choosing a free port here
# and passing it races with the other tests' daemons and connections).
"$BUILD/esbd" --listen "127.0.0.1:0" --state-dir "$STATE" --pool-size 0 --unix-socket none \
  >"$STATE/esbd.log" 2>&1 &
PID=$!
cleanup() {
  kill -TERM "$PID" 2>/dev/null; wait "$PID" 2>/dev/null
  "$BUILD/esbd" --state-dir "$STATE" cleanup >/dev/null 2>&1
  rm -rf "$STATE"
}
trap cleanup EXIT
PORT=""
for _ in $(seq 1 300); do
  [ -n "$PORT" ] || PORT="$(sed -n 's|.* listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$STATE/esbd.log" | head -n 1)"
  [ -n "$PORT" ] && curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null && break
  sleep 0.1
done
if [ -z "$PORT" ]; then echo "FAIL: esbd did not start; its log:"; cat "$STATE/esbd.log"; exit 1; fi

export ESB_URL="http://127.0.0.1:$PORT"
ESB="$BUILD/esb"
fails=0
passes=0
check() {  # check NAME EXPECTED ACTUAL
  if [ "$2" == "$3" ]; then echo "ok   $1"; passes=$((passes+1)); else echo "FAIL $1: expected [$2], got [$3]"; fails=$((fails+1)); return 1; fi
}

check "health" 0 "$("$ESB" health >/dev/null; echo $?)"
ENV="$("$ESB" create)"
check "create prints an id" "env_" "${ENV:0:4}"
check "exec output" "hello" "$("$ESB" exec "$ENV" -- echo hello)"
"$ESB" exec "$ENV" -- 'cd /tmp && export X=7' >/dev/null
check "exec keeps shell state" "/tmp 7" "$("$ESB" exec "$ENV" -- 'echo $PWD $X')"
"$ESB" exec "$ENV" -- 'exit 5'
check "exec exit code" 5 "$?"
head -c 300000 /dev/urandom > "$STATE/blob"
"$ESB" cp "$STATE/blob" "$ENV:data/blob.bin" >/dev/null 2>&1
"$ESB" cp "$ENV:data/blob.bin" "$STATE/back" >/dev/null 2>&1
check "cp round trip is byte-identical" 0 "$(cmp -s "$STATE/blob" "$STATE/back"; echo $?)"
printf 'line one\n' > "$STATE/t.txt"
"$ESB" cp "$STATE/t.txt" "$ENV:t.txt" >/dev/null 2>&1
check "cat" "line one" "$("$ESB" cat "$ENV" t.txt)"
check "ls lists it" 1 "$("$ESB" ls | grep -c "$ENV")"
check "logs show the exec" 1 "$("$ESB" logs "$ENV" | grep -c 'exit 5')"
check "audit search" 1 "$("$ESB" audit --q blob.bin --json | python3 -c 'import json,sys; print(min(1,len(json.load(sys.stdin)["entries"])))')"
check "audit --kind egress (none yet)" 0 "$("$ESB" audit --kind egress --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["entries"]))')"
check "report json" 0 "$("$ESB" report --period weekly --format json | python3 -c 'import json,sys; print(json.load(sys.stdin)["totals"]["requests"])')"
check "report html is a page" 1 "$("$ESB" report --format html | grep -c '^<!DOCTYPE html>')"
check "report csv header" "section,name,requests,allowed,blocked,redacted,opaque,errors,bytes_up,bytes_down" "$("$ESB" report --format csv | head -1 | tr -d '\r')"
check "report tables" 1 "$("$ESB" report | grep -c '^Daily egress report')"
# The terminal (a WebSocket): piped keystrokes, the shell's exit code as esb's.
OUT="$(printf 'cd /tmp; echo $((6*7))\nexit 7\n' | "$ESB" shell "$ENV" 2>&1 | tr -d '\r')"
check "shell exit code" 7 "$(printf 'cd /tmp; echo $((6*7))\nexit 7\n' | "$ESB" shell "$ENV" >/dev/null 2>&1; echo $?)"
check "shell runs commands" 1 "$(grep -c '42$' <<<"$OUT")"
check "shell on an unknown env → exit 1" 1 "$("$ESB" shell env_doesnotexist </dev/null >/dev/null 2>&1; echo $?)"
# Time travel: steps, step, rewind, fork, shell --step (needs the daemon's steps routes).
STEPS_OUT="$("$ESB" steps "$ENV" 2>&1)"
check "steps answers" 0 "$("$ESB" steps "$ENV" >/dev/null 2>&1; echo $?)"
{
  N="$("$ESB" steps --json --limit 200 "$ENV" | python3 -c 'import json,sys; print(next(s["step"] for s in json.load(sys.stdin)["steps"] if "t.txt" in s["summary"]))')"
  check "steps lists the upload" 1 "$(grep -c 't.txt' <<<"$STEPS_OUT" | tr -d ' ' | cut -c1)"
  check "step shows its files" 1 "$("$ESB" step "$ENV" "$N" | grep -q 't.txt' && echo 1)"
  "$ESB" exec "$ENV" -- 'echo changed > t.txt' >/dev/null
  check "rewind" 0 "$("$ESB" rewind "$ENV" "$N" >/dev/null; echo $?)"
  check "rewind restores the file" "line one" "$("$ESB" cat "$ENV" t.txt)"
  FORK="$("$ESB" fork "$ENV" "$N")"
  check "fork prints an id" "env_" "${FORK:0:4}"
  check "fork has the file" "line one" "$("$ESB" cat "$FORK" t.txt)"
  "$ESB" rm "$FORK" >/dev/null
  # (bash's prompt control sequences precede the output on the pty: no ^ anchor.)
  SHELL_OUT="$(printf 'cat t.txt\nexit 0\n' | "$ESB" shell --step "$N" "$ENV" 2>&1 | tr -d '\r')"
  check "shell --step sees the step's files" 1 "$(grep -c 'line one$' <<<"$SHELL_OUT")" ||
    printf 'esb shell --step printed:\n%s\n' "$SHELL_OUT" | cat -v >&2
  FORK2="$(grep -o 'into env_[a-z0-9]*' <<<"$SHELL_OUT" | cut -d' ' -f2)"
  [ -n "$FORK2" ] && "$ESB" rm "$FORK2" >/dev/null
}
"$ESB" rm "$ENV" >/dev/null
check "rm then exec fails" 1 "$("$ESB" exec "$ENV" -- true >/dev/null 2>&1; echo $?)"
"$ESB" rm env_doesnotexist >/dev/null 2>&1
check "rm unknown → exit 1" 1 "$?"
kill -TERM "$PID"; wait "$PID" 2>/dev/null
MSG="$("$ESB" ls 2>&1)"; RC=$?
check "daemon down → exit 2" 2 "$RC"
check "daemon down → says where" 1 "$(grep -c "cannot connect to esbd at $ESB_URL" <<<"$MSG")"

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
