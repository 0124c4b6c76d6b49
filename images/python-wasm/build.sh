#!/usr/bin/env bash
# Builds the nano tier's guest: CPython 3.11 (Debian's source package) for wasm32-wasi, with zlib,
# pre-initialised by Wizer, turned into C by wasm2c with interrupt checks, compiled by gcc into a
# static library + header for the C++ host (src/drivers/nano). See README.md beside this file.
#
# Usage: build.sh [--print-dir] [--clean-work]
#   (no args)     build if missing, print the published directory on the last line
#   --print-dir   print the directory the artefact is (or would be) published to, build nothing
#                 (alias: --path; this is the contract scripts/build-images.sh uses)
#   --clean-work  also delete the intermediate work tree after publishing
# Environment: ESB_CACHE_DIR (default /var/cache/entersandbox), JOBS (default 2),
#   NANO_HASH_SEED (fixed str-hash secret for a bit-reproducible snapshot; default: random).
#
# Idempotent and resumable: each step records a key (hash of its own recipe chained to the
# previous step's key) under work/<srcver>/stamps, so a re-run skips finished steps and an
# edit to one step re-runs only that step and the ones after it. The final artefact is keyed by
# a content hash of every recipe file + the Debian source versions + tool versions, and is
# published atomically (built under a temporary name, then renamed).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${ESB_CACHE_DIR:-/var/cache/entersandbox}/python-wasm"
JOBS="${JOBS:-2}"
PY_SRC_PKG=python3.11
ZLIB_SRC_PKG=zlib
T0=$SECONDS

log() { printf '[python-wasm %5ds] %s\n' $((SECONDS - T0)) "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

PRINT_DIR=0
CLEAN_WORK=0
for a in "$@"; do
  case "$a" in
    --print-dir|--path) PRINT_DIR=1 ;;
    --clean-work) CLEAN_WORK=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) die "unknown argument: $a" ;;
  esac
done

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# ---------------------------------------------------------------------------------------------
# Step 0: tools. Debian packages and the Wizer binary from npm (pinned by package-lock.json).
# ---------------------------------------------------------------------------------------------
DEB_PKGS=(clang-14 lld-14 llvm-14 wasi-libc libclang-rt-14-dev-wasm32 wabt dpkg-dev gcc make
          xz-utils bzip2 pkg-config)
ensure_tools() {
  local missing=() p
  for p in "${DEB_PKGS[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2
  fi
  # The x86_64 Linux package itself (see package.json for why not the multi-platform wrapper).
  WIZER="$HERE/node_modules/@bytecodealliance/wizer-linux-x64/wizer"
  if [ ! -x "$WIZER" ]; then
    command -v npm >/dev/null || die "npm not found (scripts/install-deps.sh installs it)"
    log "npm ci (Wizer) in $HERE"
    (cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error >&2) \
      || die "npm ci failed (Wizer is pinned by package-lock.json; this build needs x86_64 Linux)"
    [ -x "$WIZER" ] || die "npm ci did not install $WIZER"
  fi
}

# ---------------------------------------------------------------------------------------------
# Step 1: sources. A deb-src entry for the same archive the host's apt uses, in its own file.
# ---------------------------------------------------------------------------------------------
SRC_LIST=/etc/apt/sources.list.d/entersandbox-src.sources
ensure_deb_src() {
  local have
  have="$(apt-cache showsrc "$PY_SRC_PKG" 2>/dev/null || true)"
  if printf '%s\n' "$have" | grep -q '^Version:'; then return 0; fi
  if [ ! -f "$SRC_LIST" ]; then
    local tmp
    tmp="$(mktemp)"
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      # deb822: same URIs/Suites/Components/Signed-By, Types deb-src.
      sed -E 's/^Types:.*/Types: deb-src/' /etc/apt/sources.list.d/debian.sources >"$tmp"
    elif [ -f /etc/apt/sources.list ]; then
      grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' >"$tmp"
      SRC_LIST=/etc/apt/sources.list.d/entersandbox-src.list
    else
      die "cannot find the host's apt sources to derive a deb-src entry from"
    fi
    log "adding deb-src entry $SRC_LIST"
    $SUDO install -m 0644 "$tmp" "$SRC_LIST"
    rm -f "$tmp"
  fi
  log "apt-get update (for source package lists)"
  $SUDO apt-get update -qq >&2
}

# Downloads the newest version of source package $1 that the archive really serves (a security
# mirror may list a version it does not carry) into $CACHE_ROOT/src; prints the version.
fetch_source() {
  local pkg="$1" v
  mkdir -p "$CACHE_ROOT/src"
  for v in $(apt-cache showsrc "$pkg" | sed -n 's/^Version: //p' | sort -V -r -u); do
    if [ -f "$CACHE_ROOT/src/${pkg}_${v#*:}.dsc" ]; then echo "$v"; return 0; fi
  done
  for v in $(apt-cache showsrc "$pkg" | sed -n 's/^Version: //p' | sort -V -r -u); do
    log "apt-get source --download-only $pkg=$v"
    if (cd "$CACHE_ROOT/src" && apt-get source -qq --download-only "$pkg=$v" >&2 2>/dev/null); then
      echo "$v"; return 0
    fi
    log "  $pkg=$v not downloadable, trying an older version"
  done
  die "no downloadable source version of $pkg"
}

# ---------------------------------------------------------------------------------------------
# Step helpers: resumable steps keyed by their recipe.
# ---------------------------------------------------------------------------------------------
PREV_KEY=""
run_step() {  # run_step NAME FUNC [extra key material...]
  local name="$1" fn="$2"; shift 2
  local key
  key="$( { echo "$PREV_KEY"; declare -f "$fn"; printf '%s\n' "$@"; } | sha256sum | cut -c1-32)"
  PREV_KEY="$key"
  if [ -f "$STAMPS/$name" ] && [ "$(cat "$STAMPS/$name")" = "$key" ]; then
    log "step $name: up to date"
    return 0
  fi
  rm -f "$STAMPS/$name"
  log "step $name: start"
  local t=$SECONDS
  "$fn"
  echo "$key" >"$STAMPS/$name"
  log "step $name: done in $((SECONDS - t))s"
}

files_hash() { cat "$@" | sha256sum | cut -c1-32; }

# ---------------------------------------------------------------------------------------------
# Step 2: unpack. Upstream tarball + Debian's upstream bug/security fixes (CVE-*, backported
# 3.11 fixes). Debian's packaging/layout patches (multiarch, deb-locations, distutils install
# layout, setup-modules, ...) are skipped: they describe Debian's filesystem, not the guest's.
# ---------------------------------------------------------------------------------------------
debian_patch_filter() {
  grep -E '^(CVE-[0-9-]+[^ ]*|000[0-9]-3\.11-[^ ]*|shutdown-deadlock\.diff|frame_dealloc-crash\.diff|relfile-nullptr-dereference\.patch)$' \
    | grep -v '^skip-'
}
step_unpack() {
  rm -rf "$WORK/src"
  mkdir -p "$WORK/src"
  local v="${PY_VER#*:}" up="${PY_VER#*:}"
  up="${up%-*}"
  tar -C "$WORK/src" -xzf "$CACHE_ROOT/src/${PY_SRC_PKG}_${up}.orig.tar.gz"
  mv "$WORK/src/Python-$up" "$WORK/src/cpython"
  tar -C "$WORK/src/cpython" -xJf "$CACHE_ROOT/src/${PY_SRC_PKG}_${v}.debian.tar.xz"
  local p n=0
  for p in $(debian_patch_filter <"$WORK/src/cpython/debian/patches/series"); do
    patch -d "$WORK/src/cpython" -p1 -s -N <"$WORK/src/cpython/debian/patches/$p" \
      || die "Debian patch $p does not apply"
    n=$((n + 1))
  done
  log "  applied $n Debian upstream-fix patches"
  local zv="${ZLIB_VER#*:}" zup
  zup="${zv%-*}"
  mkdir -p "$WORK/src/zlib"
  tar -C "$WORK/src/zlib" --strip-components=1 -xjf "$CACHE_ROOT/src/${ZLIB_SRC_PKG}_${zup}.orig.tar.bz2"
}

# ---------------------------------------------------------------------------------------------
# Step 3: a WASI-SDK-shaped directory around Debian's clang-14/lld-14/wasi-libc, so CPython's
# own Tools/wasm/wasi-env works unchanged.
# ---------------------------------------------------------------------------------------------
step_wasi_sdk() {
  local sdk="$WORK/wasi-sdk"
  rm -rf "$sdk"
  mkdir -p "$sdk/bin" "$sdk/share/wasi-sysroot/lib"
  local t
  for t in clang clang++; do
    printf '#!/bin/sh\nexec %s --target=wasm32-wasi "$@"\n' "/usr/bin/${t}-14" >"$sdk/bin/$t"
  done
  printf '#!/bin/sh\nexec /usr/bin/clang-14 --target=wasm32-wasi -E "$@"\n' >"$sdk/bin/clang-cpp"
  chmod +x "$sdk/bin/"*
  ln -s /usr/bin/wasm-ld-14 "$sdk/bin/wasm-ld"
  ln -s /usr/bin/llvm-ar-14 "$sdk/bin/llvm-ar"
  ln -s /usr/bin/llvm-ranlib-14 "$sdk/bin/ranlib"
  ln -s /usr/bin/llvm-ranlib-14 "$sdk/bin/llvm-ranlib"
  ln -s /usr/include/wasm32-wasi "$sdk/share/wasi-sysroot/include"
  ln -s /usr/lib/wasm32-wasi "$sdk/share/wasi-sysroot/lib/wasm32-wasi"
  mkdir -p "$sdk/share/wasi-sysroot/lib/pkgconfig"
}

# ---------------------------------------------------------------------------------------------
# Step 4: zlib for wasm32-wasi, static.
# ---------------------------------------------------------------------------------------------
step_zlib() {
  local b="$WORK/zlib-build" p="$WORK/zlib-wasm"
  rm -rf "$b" "$p"
  cp -a "$WORK/src/zlib" "$b"
  (cd "$b" && CC="$WORK/wasi-sdk/bin/clang" AR="$WORK/wasi-sdk/bin/llvm-ar" \
     RANLIB="$WORK/wasi-sdk/bin/ranlib" CFLAGS="-O2" CHOST=wasm32 \
     ./configure --static --prefix="$p" >"$WORK/logs/zlib.log" 2>&1 \
   && make -j"$JOBS" libz.a >>"$WORK/logs/zlib.log" 2>&1 \
   && make install >>"$WORK/logs/zlib.log" 2>&1) || die "zlib build failed, see $WORK/logs/zlib.log"
  [ -f "$p/lib/libz.a" ] || die "zlib: no libz.a"
}

# ---------------------------------------------------------------------------------------------
# Step 5: the native CPython of the same source (the cross build's build python) and the
# wasm32-wasi CPython (Tools/wasm/wasi-env + config.site-wasm32-wasi). They overlap: the native
# `make -j` runs while the (serial, slow) wasi configure runs; configure only asks the build
# python its version, which Debian's python3.11 of the same version answers until the native
# build is done (build-python wrapper below). The wasi `make` waits for the native build.
# ---------------------------------------------------------------------------------------------
native_build() {
  local b="$WORK/native"
  rm -rf "$b"
  mkdir -p "$b"
  # A build tool only: -O1 without -g compiles much faster than the default -O3 -g.
  (cd "$b" && OPT="-DNDEBUG -fwrapv -O1" ../src/cpython/configure -C --without-ensurepip \
      --disable-test-modules >"$WORK/logs/native-configure.log" 2>&1) || return 1
  (cd "$b" && make -j"$JOBS" all >"$WORK/logs/native-make.log" 2>&1) || return 1
  "$b/python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' || return 1
  touch "$b/.done"
}
write_build_python() {
  {
    echo '#!/bin/sh'
    echo '# Build python for the wasi cross build: the native build of the same source once it'
    echo '# is done; before that (only the wasi configure version check runs) python3.11.'
    echo "if [ -f '$WORK/native/.done' ]; then exec '$WORK/native/python' \"\$@\"; fi"
    echo 'exec python3.11 "$@"'
  } >"$WORK/build-python"
  chmod +x "$WORK/build-python"
}
wasi_configure() {
  local b="$WORK/wasi" src="$WORK/src/cpython"
  rm -rf "$b"
  mkdir -p "$b"
  (cd "$b" && WASI_SDK_PATH="$WORK/wasi-sdk" CONFIG_SITE="$src/Tools/wasm/config.site-wasm32-wasi" \
     ZLIB_CFLAGS="-I$WORK/zlib-wasm/include" ZLIB_LIBS="$WORK/zlib-wasm/lib/libz.a" \
     "$src/Tools/wasm/wasi-env" ../src/cpython/configure -C \
       --host=wasm32-unknown-wasi --build="$("$src/config.guess")" \
       --with-build-python="$WORK/build-python" --without-ensurepip --disable-test-modules \
       >"$WORK/logs/wasi-configure.log" 2>&1) \
    || die "wasi configure failed, see $WORK/logs/wasi-configure.log"
  grep -q '^MODULE_ZLIB_STATE=yes' "$b/Makefile" \
    || die "wasi configure did not find zlib (see $WORK/logs/wasi-configure.log)"
}
step_cpython() {
  write_build_python
  local npid=""
  if command -v python3.11 >/dev/null; then
    native_build &
    npid=$!
    wasi_configure
    wait "$npid" || die "native build failed, see $WORK/logs/native-*.log"
  else
    native_build || die "native build failed, see $WORK/logs/native-*.log"
    wasi_configure
  fi
  log "  native build + wasi configure done"
  (cd "$WORK/wasi" && WASI_SDK_PATH="$WORK/wasi-sdk" "$WORK/src/cpython/Tools/wasm/wasi-env" \
     make -j"$JOBS" python.wasm >"$WORK/logs/wasi-make.log" 2>&1) \
    || die "wasi make failed, see $WORK/logs/wasi-make.log"
}

# Our own link: the same objects as python.wasm, with guest/nano_main.c instead of
# Programs/python.c, as a reactor exporting wizer.initialize / esb_run / esb_reseed.
step_nano_link() {
  local b="$WORK/wasi" cflags=""
  [ -n "${NANO_HASH_SEED:-}" ] && cflags="-DNANO_HASH_SEED=${NANO_HASH_SEED}"
  (cd "$b" && WASI_SDK_PATH="$WORK/wasi-sdk" "$WORK/src/cpython/Tools/wasm/wasi-env" \
     make -f Makefile -f "$HERE/guest/nano.mk" NANO_MAIN_SRC="$HERE/guest/nano_main.c" \
       NANO_CFLAGS="$cflags" nano.wasm >"$WORK/logs/nano-link.log" 2>&1) \
    || die "nano.wasm link failed, see $WORK/logs/nano-link.log"
}

# The guest stdlib: sourceless .pyc (compiled by the native build python of the same version),
# without tests, GUI, packaging and modules that cannot work in the guest.
STDLIB_DROP=(test idlelib tkinter turtledemo turtle.py ensurepip lib2to3 distutils venv
             pydoc_data ctypes curses sqlite3 dbm/gnu.py dbm/ndbm.py multiprocessing msilib
             __phello__ site-packages unittest/test tkinter/test sqlite3/test ctypes/test
             idlelib/idle_test lib2to3/tests)
step_stdlib() {
  local st="$WORK/stdlib" src="$WORK/src/cpython/Lib" d
  rm -rf "$st"
  mkdir -p "$st"
  cp -a "$src/." "$st/"
  for d in "${STDLIB_DROP[@]}"; do rm -rf "${st:?}/$d"; done
  find "$st" -name __pycache__ -prune -exec rm -rf {} + 
  find "$st" -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
  # sysconfig data of the guest build (test.support and sysconfig users need it).
  (cd "$WORK/wasi" && WASI_SDK_PATH="$WORK/wasi-sdk" "$WORK/src/cpython/Tools/wasm/wasi-env" \
     make pybuilddir.txt >"$WORK/logs/pybuilddir.log" 2>&1) \
    || die "make pybuilddir.txt failed, see $WORK/logs/pybuilddir.log"
  local sysconf
  sysconf="$(find "$WORK/wasi/build" -name "_sysconfigdata_*.py" | head -n1)"
  [ -n "$sysconf" ] || die "no _sysconfigdata for the guest"
  cp "$sysconf" "$st/"
  cp "$HERE/guest/_esb_nano.py" "$st/_esb_nano.py"
  "$WORK/native/python" -E -m compileall -q -b -f --invalidation-mode unchecked-hash \
    -s "$st" -p /usr/lib/python3.11 -j "$JOBS" "$st" >"$WORK/logs/compileall.log" 2>&1 \
    || die "compileall failed, see $WORK/logs/compileall.log"
  find "$st" -type f ! -name '*.pyc' -delete
  find "$st" -depth -type d -empty -delete
  [ -f "$st/os.pyc" ] || die "stdlib: no os.pyc"
  python3 "$HERE/tools/pack_stdlib.py" pack "$st" "$WORK/stdlib.pack" >&2
}

# Optional second pack with a selection of CPython's own regression tests as .py sources (same
# format, same mount point: entries under test/), for running them inside the nano tier.
TESTS_KEEP=(__init__.py __main__.py support libregrtest test_json test_re.py test_datetime.py
  datetimetester.py test_collections.py test_math.py math_testcases.txt ieee754.txt
  cmath_testcases.txt test_cmath.py test_dataclasses.py test_decimal.py decimaltestdata
  test_fractions.py test_statistics.py test_string.py test_textwrap.py test_base64.py
  test_hashlib.py test_itertools.py test_functools.py test_typing.py mod_generics_cache.py
  _typed_dict_helper.py typinganndata test_heapq.py test_bisect.py test_enum.py test_struct.py
  test_operator.py test_copy.py test_difflib.py test_csv.py test_calendar.py test_pprint.py
  test_random.py test_binascii.py test_zlib.py test_unicodedata.py test_int.py test_float.py
  formatfloat_testcases.txt floating_points.txt test_list.py test_dict.py test_set.py
  test_tuple.py test_fstring.py test_format.py list_tests.py seq_tests.py mapping_tests.py
  string_tests.py test_contextlib.py test_abc.py test_shlex.py test_fnmatch.py test_glob.py
  test_pathlib.py test_tempfile.py test_long.py test_types.py test_sort.py test_keyword.py
  test_genericalias.py test_exceptions.py test_unittest.py re_tests.py test_grammar.py)
step_tests() {
  local tt="$WORK/tests" src="$WORK/src/cpython/Lib/test" f
  rm -rf "$tt"
  mkdir -p "$tt/test"
  for f in "${TESTS_KEEP[@]}"; do
    [ -e "$src/$f" ] && cp -a "$src/$f" "$tt/test/"
  done
  cp -a "$src"/ann_module*.py "$src"/dataclass_*.py "$tt/test/" 2>/dev/null || true
  find "$tt" -name __pycache__ -prune -exec rm -rf {} +
  # Sources, not .pyc: unittest discovery (load_package_tests) looks for __init__.py files.
  python3 "$HERE/tools/pack_stdlib.py" pack "$tt" "$WORK/stdlib-tests.pack" >&2
}

# Wizer: instantiate nano.wasm with the guest filesystem layout (README: one preopen "/"),
# run wizer.initialize, snapshot.
step_wizer() {
  local root="$WORK/wizer-root"
  rm -rf "$root"
  mkdir -p "$root/usr/lib" "$root/workspace" "$root/.esb" "$root/tmp"
  python3 "$HERE/tools/pack_stdlib.py" unpack "$WORK/stdlib.pack" "$root/usr/lib/python3.11"
  "$WIZER" --allow-wasi --inherit-stdio true --wasm-bulk-memory true \
    --init-func wizer.initialize --mapdir "/::$root" \
    -o "$WORK/python.wasm.tmp" "$WORK/wasi/nano.wasm" >"$WORK/logs/wizer.log" 2>&1 \
    || die "wizer failed, see $WORK/logs/wizer.log"
  [ -f "$root/.esb/preload.json" ] || die "wizer: the guest wrote no preload report"
  cp "$root/.esb/preload.json" "$WORK/preload.json"
  mv "$WORK/python.wasm.tmp" "$WORK/python.wasm"
}

# wasm2c, split into parts with interrupt checks, gcc -O2 in parallel, one static library.
W2C_PARTS=8
W2C_CFLAGS="-O2 -w -fno-strict-aliasing"
step_wasm2c() {
  local w="$WORK/w2c"
  rm -rf "$w"
  mkdir -p "$w/raw" "$w/src" "$w/obj"
  wasm2c "$WORK/python.wasm" -n python -o "$w/raw/python.c" >"$WORK/logs/wasm2c.log" 2>&1 \
    || die "wasm2c failed, see $WORK/logs/wasm2c.log"
  python3 "$HERE/tools/split_wasm2c.py" --parts "$W2C_PARTS" \
    "$w/raw/python.c" "$w/raw/python.h" "$w/src" >>"$WORK/logs/wasm2c.log" 2>&1 \
    || die "split failed, see $WORK/logs/wasm2c.log"
  rm -rf "$w/raw"
  log "  $(tail -n1 "$WORK/logs/wasm2c.log")"
}
step_compile() {
  local w="$WORK/w2c"
  rm -rf "$w/obj"
  mkdir -p "$w/obj"
  # Biggest first so the two cores finish together.
  (cd "$w/src" && ls -S python_wasm_*.c | xargs -P "$JOBS" -I{} sh -c \
     'gcc $0 -I/usr/src/wasm2c -DESB_PYTHON_WASM_DATA="\"$1/python_wasm_data.bin\"" \
        -c {} -o "$2/$(basename {} .c).o" || exit 255' \
     "$W2C_CFLAGS" "$w/src" "$w/obj") >"$WORK/logs/gcc.log" 2>&1 \
    || die "gcc failed, see $WORK/logs/gcc.log"
  rm -f "$w/libpython_wasm.a"
  ar rcs "$w/libpython_wasm.a" "$w/obj/"*.o
}

# Smoke: a throwaway C WASI host (smoke/) runs print(1+1) on the library.
step_smoke() {
  local s="$WORK/smoke"
  rm -rf "$s"
  mkdir -p "$s"
  python3 "$HERE/smoke/gen_stubs.py" "$WORK/w2c/src/python_wasm.h" "$HERE/smoke/smoke_host.c" \
    "$s/smoke_stubs.inc"
  gcc -O1 -I/usr/src/wasm2c -I"$WORK/w2c/src" -I"$s" -o "$s/smoke_host" "$HERE/smoke/smoke_host.c" \
    /usr/src/wasm2c/wasm-rt-impl.c "$WORK/w2c/libpython_wasm.a" -lm \
    >"$WORK/logs/smoke.log" 2>&1 || die "smoke host build failed, see $WORK/logs/smoke.log"
  local out
  out="$("$s/smoke_host" "$WORK/wizer-root" 'print(1+1)' 2>>"$WORK/logs/smoke.log")" \
    || die "smoke run failed: $out (see $WORK/logs/smoke.log)"
  [ "$(printf '%s' "$out" | head -n1)" = "2" ] || die "smoke: expected 2, got: $out"
  log "  smoke: print(1+1) -> $(printf '%s' "$out" | head -n1)"
}

publish() {
  local tmp="$CACHE_ROOT/.tmp-$(basename "$OUT")-$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  cp "$WORK/w2c/libpython_wasm.a" "$WORK/w2c/src/python_wasm.h" "$WORK/stdlib.pack" \
    "$WORK/stdlib-tests.pack" "$tmp/"
  cp "$WORK/python.wasm" "$tmp/python.wasm"
  python3 "$HERE/tools/manifest.py" --dir "$tmp" --hash "$(basename "$OUT")" \
    --python-version "$PY_VER" --zlib-version "$ZLIB_VER" --preload "$WORK/preload.json" \
    --cflags "$W2C_CFLAGS" --parts "$W2C_PARTS" >"$tmp/manifest.json" \
    || die "manifest failed"
  if [ -e "$OUT" ]; then rm -rf "$OUT.old.$$"; mv -T "$OUT" "$OUT.old.$$"; fi
  mv -T "$tmp" "$OUT"
  rm -rf "$OUT.old.$$"
  ln -sfn "$(basename "$OUT")" "$CACHE_ROOT/current.tmp"
  mv -T "$CACHE_ROOT/current.tmp" "$CACHE_ROOT/current"
}

link_out() {
  # images/python-wasm/out -> the published directory (git-ignored), for nanort's CMake.
  ln -sfn "$OUT" "$HERE/out.tmp" && mv -T "$HERE/out.tmp" "$HERE/out"
}

# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------
main() {
  if [ "$PRINT_DIR" = 1 ]; then
    WIZER=""
  else
    ensure_tools
  fi
  ensure_deb_src
  PY_VER="$(fetch_source "$PY_SRC_PKG")"
  ZLIB_VER="$(fetch_source "$ZLIB_SRC_PKG")"
  local tool_versions
  tool_versions="$(dpkg-query -W -f='${Package}=${Version}\n' clang-14 lld-14 wasi-libc \
    libclang-rt-14-dev-wasm32 wabt gcc 2>/dev/null | sort)"
  local recipe_hash
  recipe_hash="$( { cd "$HERE" && find . -path ./node_modules -prune -o -type f \
      \( -name '*.sh' -o -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.mk' \
         -o -name 'package*.json' \) -not -path './smoke/*' -print | LC_ALL=C sort \
      | xargs sha256sum; echo "$PY_VER $ZLIB_VER"; echo "$tool_versions"; } \
    | sha256sum | cut -c1-16)"
  OUT="$CACHE_ROOT/$recipe_hash"
  if [ "$PRINT_DIR" = 1 ]; then echo "$OUT"; return 0; fi
  if [ -f "$OUT/manifest.json" ]; then
    log "up to date: $OUT"
    ln -sfn "$recipe_hash" "$CACHE_ROOT/current.tmp" && mv -T "$CACHE_ROOT/current.tmp" "$CACHE_ROOT/current"
    link_out
    echo "$OUT"
    return 0
  fi
  log "building $PY_SRC_PKG $PY_VER + zlib $ZLIB_VER -> $OUT"
  WORK="$CACHE_ROOT/work/${PY_VER#*:}"
  STAMPS="$WORK/stamps"
  mkdir -p "$STAMPS" "$WORK/logs"
  run_step unpack step_unpack "$PY_VER" "$ZLIB_VER"
  run_step wasi_sdk step_wasi_sdk
  run_step zlib step_zlib
  run_step cpython step_cpython
  run_step nano_link step_nano_link "$(files_hash "$HERE/guest/nano_main.c" "$HERE/guest/nano.mk")" \
    "${NANO_HASH_SEED:-}"
  run_step stdlib step_stdlib "$(files_hash "$HERE/guest/_esb_nano.py" "$HERE/tools/pack_stdlib.py")" \
    "${STDLIB_DROP[*]}"
  run_step wizer step_wizer
  run_step wasm2c step_wasm2c "$(files_hash "$HERE/tools/split_wasm2c.py")" "$W2C_PARTS"
  run_step compile step_compile "$W2C_CFLAGS"
  run_step smoke step_smoke "$(files_hash "$HERE/smoke/smoke_host.c" "$HERE/smoke/gen_stubs.py")"
  run_step tests step_tests "${TESTS_KEEP[*]}"
  publish
  link_out
  if [ "$CLEAN_WORK" = 1 ]; then rm -rf "$WORK"; fi
  log "published $OUT (total $((SECONDS - T0))s)"
  echo "$OUT"
}

main "$@"; exit $?
