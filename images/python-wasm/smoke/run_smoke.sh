#!/usr/bin/env bash
# Extended smoke test of a published python-wasm artefact with the throwaway host in this
# directory (NOT a sandbox; the real host is src/drivers/nano). Prints one line per case and
# "N passed, M failed" at the end; exits non-zero if any case failed.
#
#   smoke/run_smoke.sh [ARTEFACT_DIR]     default: build.sh --print-dir
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-$("$HERE/../build.sh" --print-dir)}"
[ -f "$OUT/manifest.json" ] || { echo "no artefact in $OUT (run build.sh)"; exit 1; }
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT

python3 "$HERE/gen_stubs.py" "$OUT/python_wasm.h" "$HERE/smoke_host.c" "$T/smoke_stubs.inc"
gcc -O1 -I/usr/src/wasm2c -I"$OUT" -I"$T" -o "$T/host" "$HERE/smoke_host.c" \
  /usr/src/wasm2c/wasm-rt-impl.c "$OUT/libpython_wasm.a" -lm || exit 1
mkdir -p "$T/root/usr/lib" "$T/root/workspace" "$T/root/.esb" "$T/root/tmp"
python3 "$HERE/../tools/pack_stdlib.py" unpack "$OUT/stdlib.pack" "$T/root/usr/lib/python3.11"

pass=0
fail=0
# case NAME EXPECTED_RC STDOUT_GREP RESULT_GREP CODE [TIMEOUT_MS]
case_() {
  local name="$1" want_rc="$2" want_out="$3" want_res="$4" code="$5" tmo="${6:-}"
  rm -f "$T/root/.esb/result.json"
  local out rc res
  out="$("$T/host" "$T/root" "$code" $tmo 2>"$T/stderr")"
  rc=$?
  res="$(cat "$T/root/.esb/result.json" 2>/dev/null)"
  if [ "$rc" = "$want_rc" ] && [[ "$out" =~ $want_out ]] && [[ "$res" =~ $want_res ]]; then
    pass=$((pass + 1)); echo "PASS $name"
  else
    fail=$((fail + 1))
    echo "FAIL $name: rc=$rc (want $want_rc)"
    echo "  stdout: $(printf '%s' "$out" | head -c 400)"
    echo "  stderr: $(head -c 600 "$T/stderr")"
    echo "  result: $(printf '%s' "$res" | head -c 400)"
  fi
}

case_ print 0 '^2$' '"status": "ok"' 'print(1+1)'
case_ exception 1 '^$' '"type": "ZeroDivisionError".*"unsupported": null' '1/0'
case_ syntax 1 '^$' '"type": "SyntaxError"' 'x = ('
case_ sys_exit 3 '^$' '"status": "exit"' 'import sys; sys.exit(3)'
case_ numpy 1 '^$' '"unsupported": "module:numpy"' 'import numpy'
case_ socket 1 '^$' '"unsupported": "socket"' 'import socket; socket.socket()'
case_ subprocess 1 '^$' '"unsupported": "subprocess"' 'import subprocess; subprocess.run(["ls"])'
case_ os_system 1 '^$' '"unsupported": "subprocess"' 'import os; os.system("ls")'
case_ thread 1 '^$' '"unsupported": "threads"' 'import threading; threading.Thread(target=print).start()'
case_ lazy_import 0 '^\(0.0, 1.0, 1\)$' '"ok"' 'import colorsys; print(colorsys.rgb_to_hsv(1, 0, 0))'
case_ stdlib_mix 0 '^\{"a": \[1, 2\]\} 3.3 ab [0-9a-f]{8}$' '"ok"' \
  'import json, re, decimal, hashlib; print(json.dumps({"a":[1,2]}), decimal.Decimal("1.1")*3, "".join(re.findall("[ab]", "xaxb")), hashlib.sha256(b"x").hexdigest()[:8])'
case_ zlib 0 '^True$' '"ok"' 'import zlib; print(zlib.decompress(zlib.compress(b"x"*1000)) == b"x"*1000)'
case_ workspace_file 0 '^hi$' '"ok"' 'open("/workspace/f.txt","w").write("hi"); print(open("f.txt").read())'
case_ recursion 1 '^$' '"type": "RecursionError"' 'def f(n): return f(n+1)
f(0)'
case_ timeout 124 '^$' '.*' 'while True: pass' 500
case_ timeout_regex 124 '^$' '.*' 'import re; re.match("(a+)+$", "a"*40+"b")' 500
case_ big_pow_timeout 124 '^$' '.*' 'x = 10**(10**8)' 500

# Reseed: two fresh instances must draw different random numbers.
r1="$("$T/host" "$T/root" 'import random; print(random.random())' 2>/dev/null)"
r2="$("$T/host" "$T/root" 'import random; print(random.random())' 2>/dev/null)"
if [ -n "$r1" ] && [ "$r1" != "$r2" ]; then pass=$((pass + 1)); echo "PASS reseed ($r1 != $r2)"
else fail=$((fail + 1)); echo "FAIL reseed: '$r1' vs '$r2'"; fi

# Start-to-exit time of print(1+1), 20 runs, median.
times=()
for i in $(seq 20); do
  s=$(date +%s%N)
  "$T/host" "$T/root" 'print(1+1)' >/dev/null 2>&1
  e=$(date +%s%N)
  times+=($(( (e - s) / 1000 )))
done
med=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 10p)
echo "INFO print(1+1) process start to exit: median ${med} us over 20 runs"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
