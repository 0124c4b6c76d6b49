#!/usr/bin/env bash
# Runs a selection of CPython's own regression tests (stdlib-tests.pack) inside the guest with
# the throwaway smoke host (NOT the real nano host: its WASI subset lacks e.g. path_unlink_file,
# so tests that delete files error here). One line per test module; "N passed, M failed" at the
# end counts modules whose unittest run had no failures and no errors.
#
#   smoke/run_cpython_tests.sh [ARTEFACT_DIR] [test_module ...]
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-$("$HERE/../build.sh" --print-dir)}"
shift || true
MODS=("$@")
[ ${#MODS[@]} -gt 0 ] || MODS=(test_json test_re test_datetime test_collections test_math
  test_dataclasses test_fractions test_statistics test_string test_textwrap test_itertools
  test_functools test_typing test_heapq test_bisect test_enum test_struct test_operator
  test_copy test_csv test_calendar test_pprint test_random test_binascii test_zlib
  test_unicodedata test_int test_float test_list test_dict test_set test_tuple test_fstring
  test_format test_contextlib test_abc test_shlex test_fnmatch test_sort test_keyword
  test_types test_genericalias test_exceptions test_base64 test_hashlib test_decimal)
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
python3 "$HERE/gen_stubs.py" "$OUT/python_wasm.h" "$HERE/smoke_host.c" "$T/smoke_stubs.inc"
gcc -O1 -I/usr/src/wasm2c -I"$OUT" -I"$T" -o "$T/host" "$HERE/smoke_host.c" \
  /usr/src/wasm2c/wasm-rt-impl.c "$OUT/libpython_wasm.a" -lm || exit 1
mkdir -p "$T/root/usr/lib" "$T/root/workspace" "$T/root/.esb" "$T/root/tmp"
python3 "$HERE/../tools/pack_stdlib.py" unpack "$OUT/stdlib.pack" "$T/root/usr/lib/python3.11"
python3 "$HERE/../tools/pack_stdlib.py" unpack "$OUT/stdlib-tests.pack" "$T/tests"
mv "$T/tests/test" "$T/root/usr/lib/python3.11/test"
pass=0
fail=0
for m in "${MODS[@]}"; do
  line="$(timeout 600 "$T/host" "$T/root" "import unittest
r = unittest.main(module='test.$m', exit=False, verbosity=0).result
print('ran', r.testsRun, 'failures', len(r.failures), 'errors', len(r.errors), 'skipped', len(r.skipped))" 2>"$T/err" | tail -n1)"
  printf '%-20s %s\n' "$m" "${line:-no result (exit $?): $(tail -n1 "$T/err")}"
  if [[ "$line" =~ failures\ 0\ errors\ 0 ]]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
