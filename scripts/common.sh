# Shared helpers for the project's scripts (sourced, not executed).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"

log() { printf '\033[1m[%s]\033[0m %s\n' "${LOG_TAG:-esb}" "$*"; }
die() { printf '\033[31m[%s] %s\033[0m\n' "${LOG_TAG:-esb}" "$*" >&2; exit 1; }

# Loads ESBD_IMAGE_DEFAULT (and friends) written by scripts/build-images.sh.
load_images_env() {
  [ -f "$BUILD_DIR/images.env" ] || die "no $BUILD_DIR/images.env: run 'make images' first"
  set -a
  # shellcheck disable=SC1091
  . "$BUILD_DIR/images.env"
  set +a
}

# Waits until esbd answers /healthz on $1 (base URL) or the deadline ($2 s) passes.
wait_healthy() {
  local url="$1" deadline=$(( $(date +%s) + ${2:-30} ))
  until curl -fsS "$url/healthz" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

# Picks a free TCP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
