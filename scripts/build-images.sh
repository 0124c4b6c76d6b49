#!/usr/bin/env bash
# Builds EnterSandBox's slow artefacts once, cached by content hash, and writes build/images.env
# (KEY=VALUE lines that the tests read) and a manifest of the build into
# $ESB_CACHE_DIR/builds/ (what esbd reads when started with no image configured: the newest
# complete build, core/image_discovery.h). Idempotent: an artefact whose recipe did not
# change is reused at once. Prints one line per artefact: "cached" or "built in N s".
#
#   ESB_CACHE_DIR   where images live (default /var/cache/entersandbox)
#   ESB_IMAGES      which artefacts to build (default "rootfs python.wasm"); the others keep
#                   their line from the previous build/images.env, if any
#
# Artefacts:
#   rootfs       images/rootfs/build.sh          -> ESBD_IMAGE_DEFAULT=<dir>
#   python.wasm  images/python-wasm/build.sh     -> ESBD_PYTHON_WASM=<path>   (when present)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_FILE="$REPO/build/images.env"
T0=$EPOCHSECONDS
declare -a env_lines=()
SELECTED=" ${ESB_IMAGES:-rootfs python.wasm} "

# keep_previous VAR: carries VAR's line over from the existing build/images.env.
keep_previous() {
  local line
  line="$(grep -E "^$1=" "$ENV_FILE" 2>/dev/null | tail -n 1)" || true
  if [[ -n "$line" ]]; then env_lines+=("$line"); fi
}

# Prints where SCRIPT's artefact is (or would be) without building it: asks `SCRIPT --path`,
# then `SCRIPT --print-dir`; prints nothing if the script supports neither.
artefact_path() {
  local script="$1" opt out
  for opt in --path --print-dir; do
    if out="$("$script" "$opt" 2>/dev/null </dev/null)" && [[ -n "$out" ]]; then
      tail -n 1 <<<"$out"
      return
    fi
  done
}

# build_artefact NAME SCRIPT VAR: reuses the artefact if its content-hashed path already exists
# (build scripts publish atomically, so existing means complete); otherwise runs SCRIPT, which
# builds and prints the artefact's path as its last stdout line (progress on stderr).
build_artefact() {
  local name="$1" script="$2" var="$3" t0=$EPOCHSECONDS path
  path="$(artefact_path "$script")"
  if [[ -n "$path" && -e "$path" ]]; then
    echo "[images] $name: cached ($path)"
  else
    if ! path="$("$script" </dev/null | tail -n 1)"; then
      echo "[images] $name: FAILED after $((EPOCHSECONDS - t0)) s (see its output above)" >&2
      exit 1
    fi
    if [[ -z "$path" || ! -e "$path" ]]; then
      echo "[images] $name: FAILED: $script reported '$path', which does not exist" >&2
      exit 1
    fi
    echo "[images] $name: built in $((EPOCHSECONDS - t0)) s ($path)"
  fi
  env_lines+=("$var=$path")
}

# Value of VAR in env_lines ("" when absent).
env_value() {
  local line
  for line in "${env_lines[@]}"; do
    if [[ "$line" == "$1="* ]]; then echo "${line#*=}"; fi
  done
}

# Writes $CACHE_DIR/builds/<time>-<pid>.json (atomically: tmp + rename), naming this build's
# artefacts; "complete" only when both exist. esbd picks the newest complete manifest.
write_manifest() {
  local dir="${ESB_CACHE_DIR:-/var/cache/entersandbox}/builds" rootfs wasm complete=false
  rootfs="$(env_value ESBD_IMAGE_DEFAULT)"
  wasm="$(env_value ESBD_PYTHON_WASM)"
  if [[ -n "$rootfs" && -d "$rootfs" && -n "$wasm" && -d "$wasm" ]]; then complete=true; fi
  mkdir -p "$dir"
  local now name tmp
  now="$(date +%s%3N)"
  name="$(date -u +%Y%m%dT%H%M%S%3NZ)-$$.json"
  tmp="$(mktemp "$dir/.manifest.XXXXXX")"
  # Paths are the build scripts' own (hex hashes under the cache): no JSON escaping needed,
  # but refuse anything that would need it rather than write a broken manifest.
  if [[ "$rootfs$wasm" == *[\"\\]* ]]; then
    rm -f "$tmp"
    echo "[images] manifest: artefact path contains a quote or backslash" >&2
    exit 1
  fi
  printf '{"format": 1, "created_unix_ms": %s, "complete": %s,\n "artefacts": {"rootfs": "%s", "python_wasm": "%s"}}\n' \
    "$now" "$complete" "$rootfs" "$wasm" >"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$dir/$name"
  echo "[images] manifest $dir/$name (complete: $complete)"
  # Keep the newest 20 manifests (names sort by time); the artefacts themselves stay.
  local old
  while IFS= read -r old; do rm -f -- "$old"; done < <(
    find "$dir" -maxdepth 1 -name '*.json' -type f | sort -r | tail -n +21)
}

main() {
  # --- rootfs (container driver's default image) ------------------------------------------------
  if [[ "$SELECTED" == *" rootfs "* ]]; then
    build_artefact rootfs "$REPO/images/rootfs/build.sh" ESBD_IMAGE_DEFAULT
  else
    echo "[images] rootfs: not selected (ESB_IMAGES)"
    keep_previous ESBD_IMAGE_DEFAULT
  fi

  # --- HOOK: nano tier python.wasm --------------------------------------------------------------
  # images/python-wasm/build.sh is owned by the nano-tier engineer. Contract used here (the same
  # as images/rootfs/build.sh): with no argument it builds if needed and prints the artefact's
  # path as its last stdout line, progress on stderr; `--path` or `--print-dir` prints that path
  # without building. The path must appear only when the artefact is complete (atomic publish).
  PYWASM="$REPO/images/python-wasm/build.sh"
  if [[ "$SELECTED" != *" python.wasm "* ]]; then
    echo "[images] python.wasm: not selected (ESB_IMAGES)"
    keep_previous ESBD_PYTHON_WASM
  elif [[ -x "$PYWASM" ]]; then
    build_artefact python.wasm "$PYWASM" ESBD_PYTHON_WASM
  else
    echo "[images] python.wasm: skipped ($PYWASM not present or not executable)"
  fi
  # --- end of HOOK ------------------------------------------------------------------------------

  write_manifest

  mkdir -p "$REPO/build"
  local tmp
  tmp="$(mktemp "$ENV_FILE.XXXXXX")"
  {
    echo "# Written by scripts/build-images.sh; do not edit (re-run it instead)."
    printf '%s\n' "${env_lines[@]}"
  } >"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$ENV_FILE"
  echo "[images] wrote $ENV_FILE ($((EPOCHSECONDS - T0)) s)"
}

main "$@"; exit $?  # one line: bash never reads past it (safe against edits while running)
