#!/usr/bin/env bash
# Checks a built sandbox rootfs (images/rootfs/build.sh). Meant for CTest and for humans.
#
# Usage: images/rootfs/verify.sh [IMAGE_DIR]
#   IMAGE_DIR defaults to $ESBD_IMAGE_DEFAULT, then to ESBD_IMAGE_DEFAULT in build/images.env,
#   then to the image the current recipe would produce (build.sh --path).
#
# Static checks (files, owners, modes) run as any user. Runtime checks run the image's programs
# in a chroot — the image bind-mounted read-only in a private mount namespace, with tmpfs on
# /tmp and /workspace as the container driver does — so they need root. The image is never
# modified.
#
# Exit: 0 every check passed; 1 some check failed (each failure is printed with FAIL:);
#       2 no image to check (or bad usage); 77 static checks passed but the runtime checks were
#       skipped because we are not root (use SKIP_RETURN_CODE 77 in CTest).
set -uo pipefail

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
HERE="$(dirname "$SELF")"
REPO="$(cd "$HERE/../.." && pwd)"
failures=0

pass() { printf 'PASS: %s\n' "$*"; }
fail() {
  printf 'FAIL: %s\n' "$*"
  failures=$((failures + 1))
}
check() {  # check DESCRIPTION CMD... : passes when CMD exits 0
  local what="$1"
  shift
  if "$@"; then pass "$what"; else fail "$what"; fi
}

# ---------------------------------------------------------------------------------------------
# Runtime checks, executed inside a private mount namespace: inside MNT IMAGE

run_in() {  # run_in USER CMD : runs a bash command line in the chroot, prints its output
  local user="$1" cmd="$2" spec=0:0 home=/root
  if [[ "$user" == appuser ]]; then spec=1000:1000 home=/workspace; fi
  timeout 180 chroot --userspec="$spec" "$MNT" /usr/bin/env -i \
    PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME="$home" LANG=C.UTF-8 \
    /bin/bash -c "cd ~ && $cmd" 2>&1
}

expect() {  # expect DESCRIPTION USER CMD REGEX : CMD's output must match REGEX (ERE)
  local what="$1" user="$2" cmd="$3" re="$4" out rc
  out="$(run_in "$user" "$cmd")"
  rc=$?
  if [[ $rc -eq 0 ]] && grep -Eq -- "$re" <<<"$out"; then
    pass "$what: $(grep -Em 1 -- "$re" <<<"$out")"
  else
    fail "$what: exit $rc, output: $(head -c 600 <<<"$out")"
  fi
}

# A tiny MCP client (Node, no dependencies): spawns the server given as arguments, sends
# initialize, notifications/initialized and tools/list as newline-delimited JSON-RPC on its
# stdin and prints "server=NAME protocol=VERSION tools=N: name,name,...", or TIMEOUT/ERROR.
write_mcp_probe() {
  cat >"$1" <<'EOF'
const { spawn } = require('child_process');
const [cmd, ...args] = process.argv.slice(2);
const p = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'ignore'] });
const send = (m) => p.stdin.write(JSON.stringify(m) + '\n');
const done = (code, line) => { console.log(line); p.kill(); process.exit(code); };
const timer = setTimeout(() => done(1, 'TIMEOUT: no tools/list answer in 30 s'), 30000);
let buf = '', init;
p.on('error', (e) => done(1, 'ERROR: ' + e.message));
p.stdout.on('data', (d) => {
  buf += d;
  for (let i; (i = buf.indexOf('\n')) >= 0;) {
    const line = buf.slice(0, i);
    buf = buf.slice(i + 1);
    let m;
    try { m = JSON.parse(line); } catch { return done(1, 'ERROR: not JSON on stdout: ' + line); }
    if (m.id === 1) {
      if (!m.result) return done(1, 'ERROR: initialize: ' + line);
      init = m.result;
      send({ jsonrpc: '2.0', method: 'notifications/initialized' });
      send({ jsonrpc: '2.0', id: 2, method: 'tools/list' });
    } else if (m.id === 2) {
      if (!m.result) return done(1, 'ERROR: tools/list: ' + line);
      clearTimeout(timer);
      const names = m.result.tools.map((t) => t.name);
      done(0, `server=${init.serverInfo.name} protocol=${init.protocolVersion} ` +
        `tools=${names.length}: ${names.join(',')}`);
    }
  }
});
send({ jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-11-25',
  capabilities: {}, clientInfo: { name: 'esb-rootfs-verify', version: '1' } } });
EOF
}

inside() {
  MNT="$1"
  local image="$2"
  set -e
  mount --bind "$image" "$MNT"
  mount -o remount,bind,ro "$MNT"
  mount -t tmpfs -o mode=1777,size=256m tmpfs "$MNT/tmp"
  mount -t tmpfs -o mode=0755,uid=1000,gid=1000,size=256m tmpfs "$MNT/workspace"
  mount --rbind /dev "$MNT/dev"
  mount -t proc proc "$MNT/proc"
  set +e

  expect "python3 imports pandas, numpy, matplotlib" root \
    "python3 -c \"import pandas, numpy, matplotlib; print('ok')\"" '^ok$'
  expect "node --version (Node.js 22 from npm)" root "node --version" '^v22\.'
  expect "npm -v" root "npm -v" '^[0-9]+\.'
  expect "gcc --version" root "gcc --version" '^gcc'
  expect "git --version" root "git --version" '^git version'
  expect "id appuser" root "id appuser" '^uid=1000\(appuser\) gid=1000\(appuser\)'
  expect "no setuid/setgid file (find / -xdev -perm /6000)" root \
    "n=\$(find / -xdev -perm /6000 | tee /dev/stderr | wc -l); echo found=\$n" '^found=0$'
  # shellcheck disable=SC2016  # expanded inside the sandbox
  expect "appuser: whoami, HOME, cwd" appuser 'echo "$(whoami) $HOME $PWD"' \
    '^appuser /workspace /workspace$'
  expect "appuser: C compiles and runs" appuser \
    "printf 'int main(void){return 42;}' >t.c && gcc t.c -o t && ./t; echo rc=\$?" '^rc=42$'
  local mpl="import matplotlib, matplotlib.pyplot as p; p.plot([1, 2, 3])"
  mpl+="; p.savefig('/tmp/f.png'); print(matplotlib.get_backend().lower())"
  expect "appuser: matplotlib draws headless (Agg from /etc/matplotlibrc)" appuser \
    "b=\$(python3 -c \"$mpl\") && file -b /tmp/f.png | grep -q '^PNG image' &&
     echo backend=\$b png=ok" \
    '^backend=agg png=ok$'
  expect "appuser: pandas computes" appuser \
    "python3 -c \"import pandas as pd; print(pd.DataFrame({'a':[1,2,3]}).a.sum())\"" '^6$'
  expect "appuser: python3 -m venv works" appuser \
    "python3 -m venv /tmp/v && /tmp/v/bin/python -c 'import sys; print(sys.prefix)'" '^/tmp/v$'
  expect "appuser: pip3 --version" appuser "pip3 --version" '^pip [0-9]'
  expect "appuser: node runs a script" appuser \
    "echo 'console.log(6*7)' >t.js && node t.js" '^42$'
  # The reference MCP servers answer initialize and tools/list over stdin (what esbd's hosted
  # servers do through the agent's spawn).
  write_mcp_probe "$MNT/tmp/mcp-probe.js"
  expect "appuser: MCP server filesystem answers initialize + tools/list on stdio" appuser \
    "node /tmp/mcp-probe.js mcp-server-filesystem /workspace" \
    '^server=secure-filesystem-server protocol=2025-11-25 tools=[0-9]+: .*read_text_file'
  expect "appuser: MCP server memory answers initialize + tools/list on stdio" appuser \
    "MEMORY_FILE_PATH=/workspace/memory.jsonl node /tmp/mcp-probe.js mcp-server-memory" \
    '^server=memory-server protocol=2025-11-25 tools=[0-9]+: .*create_entities'
  expect "appuser: tools present (tree curl file unzip less ps)" appuser \
    "for t in tree curl file unzip less ps; do
       command -v \$t >/dev/null || echo missing \$t; done; echo done" \
    '^done$'
  expect "appuser: cannot write the rootfs" appuser \
    "touch /usr/x 2>/dev/null && echo writable || echo denied" '^denied$'
  expect "locale C.UTF-8 and UTF-8 output" appuser \
    "python3 -c 'import sys; print(sys.stdout.encoding); print(\"\u00e9\")'" '^utf-8$'
  exit $((failures > 0))
}

# ---------------------------------------------------------------------------------------------

main() {
  if [[ "${1:-}" == --inside ]]; then
    inside "$2" "$3"
  fi

  image="${1:-${ESBD_IMAGE_DEFAULT:-}}"
  if [[ -z "$image" && -f "$REPO/build/images.env" ]]; then
    image="$(sed -n 's/^ESBD_IMAGE_DEFAULT=//p' "$REPO/build/images.env" | tail -n 1)"
  fi
  if [[ -z "$image" ]]; then
    image="$("$HERE/build.sh" --path 2>/dev/null)"
  fi
  if [[ -z "$image" || ! -d "$image" ]]; then
    echo "verify.sh: no rootfs image at '${image:-?}'; build it with scripts/build-images.sh" >&2
    exit 2
  fi
  image="$(readlink -f "$image")"
  R="$image"
  echo "verifying rootfs $R"

  # --- static checks ----------------------------------------------------------------------------
  check "image marker /etc/esb-image (release bookworm)" grep -qx 'ESB_IMAGE_RELEASE=bookworm' \
    "$R/etc/esb-image"
  check "Debian 12 (/etc/debian_version)" grep -q '^12\.' "$R/etc/debian_version"
  check "passwd: appuser 1000:1000, home /workspace, shell /bin/bash" \
    grep -Eq '^appuser:[^:]*:1000:1000:[^:]*:/workspace:/bin/bash$' "$R/etc/passwd"
  check "group: appuser 1000" grep -Eq '^appuser:[^:]*:1000:' "$R/etc/group"
  check "/workspace is a directory owned by 1000:1000" \
    test -d "$R/workspace" -a "$(stat -c %u:%g "$R/workspace" 2>/dev/null)" = 1000:1000
  check "/workspace is empty" test -z "$(ls -A "$R/workspace" 2>/dev/null)"
  check "/run/esb mount point" test -d "$R/run/esb" -a ! -L "$R/run/esb"
  check "/sbin/esb-agent is an empty mount-point file (agent not baked in)" \
    test -f "$R/usr/sbin/esb-agent" -a ! -s "$R/usr/sbin/esb-agent" -a ! -L "$R/usr/sbin/esb-agent"
  check "/etc/hosts has localhost" grep -Eq '^127\.0\.0\.1[[:space:]]+localhost' "$R/etc/hosts"
  check "/etc/resolv.conf is a regular placeholder file" test -f "$R/etc/resolv.conf" -a \
    ! -L "$R/etc/resolv.conf"
  check "/etc/environment: LANG=C.UTF-8" grep -qx 'LANG=C.UTF-8' "$R/etc/environment"
  check "/etc/environment: MPLBACKEND=Agg" grep -qx 'MPLBACKEND=Agg' "$R/etc/environment"
  check "CA certificates bundle" test -s "$R/etc/ssl/certs/ca-certificates.crt"
  for b in bash git python3 pip3 gcc g++ make tree curl file unzip less ps; do
    check "/usr/bin/$b exists" test -e "$R/usr/bin/$b" -o -L "$R/usr/bin/$b"
  done
  # From npm (images/rootfs/npm/package-lock.json), linked into /usr/local/bin.
  for b in node npm npx mcp-server-filesystem mcp-server-memory; do
    check "/usr/local/bin/$b resolves inside the image" test -e "$R/usr/local/bin/$b"
  done
  check "no Debian nodejs (Node.js comes from npm)" test ! -e "$R/usr/bin/node"
  setid="$(find "$R" -xdev -perm /6000 2>/dev/null | head -n 20)"
  check "no setuid/setgid files${setid:+: $setid}" test -z "$setid"
  devs="$(find "$R" -xdev \( -type b -o -type c \) 2>/dev/null | head -n 5)"
  check "no device nodes${devs:+: $devs}" test -z "$devs"
  lists="$(find "$R/var/lib/apt/lists" -type f ! -name lock 2>/dev/null | head -n 3)"
  check "apt lists removed${lists:+: $lists}" test -z "$lists"
  debs="$(find "$R/var/cache/apt" -name '*.deb' -o -name '*.bin' 2>/dev/null | head -n 3)"
  check "apt caches removed${debs:+: $debs}" test -z "$debs"
  check "no build-time apt config left" test ! -e "$R/etc/apt/apt.conf.d/99esb-build"

  static_failures=$failures
  # --- runtime checks ---------------------------------------------------------------------------
  if [[ "$(id -u)" -ne 0 ]]; then
    echo "SKIP: runtime checks (chroot into the image) need root;" \
      "$static_failures static checks failed"
    ((static_failures == 0)) && exit 77
    exit 1
  fi
  mnt="$(mktemp -d /tmp/esb-rootfs-verify.XXXXXX)"
  unshare --mount --propagation private "$BASH" "$SELF" --inside "$mnt" "$R"
  runtime_rc=$?
  rmdir "$mnt" 2>/dev/null
  if ((runtime_rc != 0)); then failures=$((failures + 1)); fi

  if ((failures > 0)); then
    echo "rootfs $R: FAILED ($failures failing checks; see FAIL: lines above)"
    exit 1
  fi
  echo "rootfs $R: all checks passed"
  exit 0
}

main "$@"; exit $?  # one line: bash never reads past it (safe against edits while running)
