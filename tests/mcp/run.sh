#!/usr/bin/env bash
# Runs one MCP test with the npm tools' Node.js 22 (CTest calls it; see tests/mcp/CMakeLists.txt):
#   tests/mcp/run.sh BUILD_DIR conformance ERA      the official conformance suite, one era
#   tests/mcp/run.sh BUILD_DIR e2e NAME             tests/mcp/e2e/NAME.test.mjs (node --test)
#   tests/mcp/run.sh BUILD_DIR unit NAME            tests/mcp/NAME.test.mjs (no esbd, no root)
# The npm tools come from $ESBD_MCP_TOOLS (scripts/test.sh sets it) or the cache directory
# scripts/install-npm-tools.sh installs them into. Missing tools are a FAILURE, not a skip: the
# tests must not pass silently on a machine without the npm registry. Not root: skip (77), as
# the other tests that start esbd's containers.
set -uo pipefail
BUILD="$(cd "${1:?usage: run.sh BUILD_DIR conformance ERA | e2e NAME}" && pwd)"
KIND="${2:?}" ARG="${3:?}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ "$KIND" != unit ] && [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: needs root (esbd's containers)"
  exit 77
fi
TOOLS="${ESBD_MCP_TOOLS:-$("$HERE/../../scripts/install-npm-tools.sh" --path)}"
if [ ! -f "$TOOLS/.esb-complete" ] || [ ! -x "$TOOLS/node_modules/.bin/node" ]; then
  echo "FAIL: the MCP tests' npm tools (node 22, conformance, inspector, SDK) are not installed"
  echo "      at $TOOLS. Install them with scripts/install-npm-tools.sh (make test does; it"
  echo "      needs npm and the npm registry)."
  exit 1
fi
export ESB_BUILD_DIR="$BUILD" ESBD_MCP_TOOLS="$TOOLS"
export PATH="$TOOLS/node_modules/.bin:$PATH"
echo "node $(node --version) from $TOOLS"
case "$KIND" in
  conformance) exec node "$HERE/conformance.mjs" "$ARG" ;;
  e2e) exec node --test --test-reporter=spec --test-concurrency=1 --test-timeout=300000 \
    "$HERE/e2e/$ARG.test.mjs" ;;
  unit) exec node --test --test-reporter=spec "$HERE/$ARG.test.mjs" ;;
  *) echo "run.sh: unknown kind '$KIND'"; exit 2 ;;
esac
