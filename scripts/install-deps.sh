#!/usr/bin/env bash
# Installs the Debian packages EnterSandBox needs to build, test and run.
# Idempotent: only missing packages are installed, and it says what it does.
set -euo pipefail

PKGS=(
  # toolchain and libraries
  build-essential cmake pkg-config git ca-certificates
  libboost1.81-dev libboost-json1.81-dev libabsl-dev libsqlite3-dev sqlite3
  libseccomp-dev libcap-dev libssl-dev openssl zlib1g-dev libgtest-dev libgmock-dev
  # egress DLP (src/governance/dlp): Vectorscan, RE2, brotli (gzip/deflate use zlib above)
  libvectorscan-dev libre2-dev libbrotli-dev
  # container driver and images
  crun runc debootstrap iproute2 util-linux procps
  # persistent volumes (an ext4 file system per volume, loop-mounted)
  e2fsprogs
  # python SDK tests; the egress tests' fixtures (pip and git against a local HTTPS upstream)
  python3 python3-pytest python3-pip
  # nano tier (CPython -> wasm32-wasi -> wasm2c)
  clang-14 lld-14 llvm-14 wabt wasi-libc libclang-rt-14-dev-wasm32 dpkg-dev
  # (nodejs/npm: added below only when no npm is on PATH)
)
# Optional: gVisor, used only when runtime "gvisor" is requested.
OPTIONAL=(runsc)

missing=()
# Some images ship their own Node.js whose npm conflicts with Debian's npm.
command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
opt_missing=()
for p in "${OPTIONAL[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" || opt_missing+=("$p")
done

# esb-proxy (the egress proxy esbd starts) runs as a system user of its own: no login, no home,
# not root, not a sandbox uid. Without it esbd uses the fixed id 1879048190 (docs/design.md).
if ! getent passwd esb-proxy >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
      --user-group esb-proxy && echo "[deps] created system user esb-proxy"
  else
    echo "[deps] as root, create the egress proxy's user: useradd --system --user-group esb-proxy"
  fi
fi

if [ ${#missing[@]} -eq 0 ] && [ ${#opt_missing[@]} -eq 0 ]; then
  echo "[deps] all Debian packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
echo "[deps] apt-get update"
$SUDO apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  echo "[deps] installing: ${missing[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#opt_missing[@]} -gt 0 ]; then
  echo "[deps] installing optional: ${opt_missing[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${opt_missing[@]}" \
    || echo "[deps] optional packages unavailable (${opt_missing[*]}): gvisor runtime disabled"
fi
echo "[deps] done"
