#!/usr/bin/env bash
# `make run`: starts esbd with its embedded defaults, shows one environment working, keeps serving.
set -euo pipefail
LOG_TAG=run
. "$(dirname "$0")/common.sh"
[ "$(id -u)" -eq 0 ] || exec sudo -E "$0" "$@"
load_images_env
cd "$ROOT"

LISTEN="${ESBD_LISTEN:-127.0.0.1:8080}"
URL="http://$LISTEN"
if curl -fsS "$URL/healthz" >/dev/null 2>&1; then
  die "something already answers on $LISTEN (an esbd from before?). Stop it or set ESBD_LISTEN."
fi

log "starting esbd on $LISTEN (state: ./var, image: $ESBD_IMAGE_DEFAULT)"
"$BUILD_DIR/esbd" --listen "$LISTEN" --state-dir ./var &
ESBD_PID=$!
trap 'log "stopping esbd"; kill -TERM $ESBD_PID 2>/dev/null; wait $ESBD_PID 2>/dev/null; exit 0' INT TERM
wait_healthy "$URL" 60 || { kill $ESBD_PID 2>/dev/null; die "esbd did not become healthy"; }

export ESB_URL="$URL"
ESB="$BUILD_DIR/esb"
log "demo: create an environment"
ENV_ID="$("$ESB" create --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["environment_id"])')"
echo "  environment: $ENV_ID"
log "demo: execute (state persists between calls)"
"$ESB" exec "$ENV_ID" -- 'cd /workspace && export GREETING=hello && echo "uid=$(id -u) cwd=$PWD"'
"$ESB" exec "$ENV_ID" -- 'echo "$GREETING from $(python3 --version)"'
log "demo: write and read a file"
printf 'print(sum(range(10)))\n' > /tmp/esb-demo.py
"$ESB" cp /tmp/esb-demo.py "$ENV_ID:demo.py"
"$ESB" cat "$ENV_ID" demo.py
"$ESB" exec "$ENV_ID" -- 'python3 demo.py'
log "demo: one-shot Python through POST /run (the router picks the tier and says why)"
for code in 'import json; print(json.dumps({"sum": sum(range(10))}))' \
            'import pandas as pd; print(pd.Series([1, 2, 3]).mean())'; do
  python3 - "$URL" "$code" <<'PY'
import json, sys, urllib.request
url, code = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url + "/run", data=json.dumps({"code": code}).encode(),
                             headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=120))
print("  %-62s -> %-14s tier=%s (%s), %d ms" % (code[:62], r["stdout"].strip(), r["tier"],
                                                r["reason"], r["duration_ms"]))
PY
done
log "demo: delete"
"$ESB" rm "$ENV_ID"
log "esbd keeps serving on $URL — try: curl -s -XPOST $URL/environments ; Ctrl-C stops it"
wait $ESBD_PID
