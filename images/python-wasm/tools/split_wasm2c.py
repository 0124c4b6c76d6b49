#!/usr/bin/env python3
"""Splits wasm2c (wabt 1.0.32) output into N C files and inserts interrupt checks.

Input: the .c/.h pair wasm2c wrote for module name MOD. Output in OUTDIR:
  python_wasm.h          wasm2c's public header, unchanged (renamed)
  python_wasm_impl.h     the shared prelude: runtime macros/helpers, function types, forward
                         declarations of every wasm function (made extern), interrupt hook
  python_wasm_0.c        func_types, module init/instantiate, exports; the data segments are
                         in python_wasm_data.bin, pulled in with .incbin: compile it with
                         -DESB_PYTHON_WASM_DATA='"<abs path of python_wasm_data.bin>"'
  python_wasm_<k>.c      k = 1..N-1: the wasm function bodies, balanced by size

Interrupt checks: at every function entry (after FUNC_PROLOGUE) and at every loop header
(wasm2c's `w2c_L<n>: ` labels, the target of a loop's back edge) the pass inserts
ESB_CHECK_INTERRUPT(), which calls the host's esb_nano_interrupted() when the host's
volatile flag esb_nano_interrupt is set.

wasm2c's internal functions are `static`; splitting makes them extern (names keep wasm2c's
`w2c_` prefix). Fails loudly if the input does not have the shape this pass expects.
"""

import argparse
import os
import re
import sys

# A wasm function definition; wasm2c wraps long parameter lists over several lines, so only
# the start is matched here and the header runs to the first line ending in ") {".
FUNC_START = re.compile(
    r"^static (?:void|u32|u64|f32|f64|v128) (w2c_\w+)\((Z_\w+_instance_t)\* instance[,)]")
FWD_DECL = re.compile(r"^static ((?:void|u32|u64|f32|f64|v128) w2c_\w+\(Z_\w+_instance_t\*.*\);)$")
FUNC_TYPES = re.compile(r"^static u32 func_types\[(\d+)\];$")
DATA_SEG_START = re.compile(r"^static const u8 data_segment_data_\w+\[\] = \{$")
DATA_SEG_NAME = re.compile(r"^static const u8 (data_segment_data_\w+)\[\] = \{$")
INIT_FUNC = re.compile(r"^static void init_\w+\(.*\) ?\{$")
LOOP_LABEL = re.compile(r"^(\s*)w2c_L\d+: $")
PROLOGUE = "  FUNC_PROLOGUE;"

INTERRUPT_DEFS = """
/* Interrupt hook (images/python-wasm/README.md, "Interrupts"): provided by the host. */
extern volatile int esb_nano_interrupt;
extern void esb_nano_interrupted(void);
#define ESB_CHECK_INTERRUPT() \\
  do { if (UNLIKELY(esb_nano_interrupt)) esb_nano_interrupted(); } while (0)
#define func_types esb_python_wasm_func_types
"""


def die(msg):
    sys.exit("split_wasm2c: " + msg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("c_file")
    ap.add_argument("h_file")
    ap.add_argument("outdir")
    ap.add_argument("--parts", type=int, default=8, help="files with function bodies")
    ap.add_argument("--no-interrupts", action="store_true")
    args = ap.parse_args()

    with open(args.c_file) as f:
        lines = f.read().split("\n")
    h_base = os.path.basename(args.h_file)

    prelude, data_segs, funcs, tail, early = [], [], [], [], []
    n_types = None
    n_fwd = 0
    n_loops = 0
    i = 0
    seen_func = False
    while i < len(lines):
        line = lines[i]
        m = FUNC_START.match(line)
        if m:
            seen_func = True
            h = i
            while not lines[h].endswith(") {"):
                h += 1
                if h - i > 50 or lines[h].endswith(";"):
                    die("cannot find the end of the header of " + m.group(1))
            j = h
            while lines[j] != "}":
                j += 1
                if j >= len(lines):
                    die("unterminated function " + m.group(1))
            body = lines[i:j + 1]
            body[0] = body[0][len("static "):]
            out = []
            entry_done = args.no_interrupts
            for b in body:
                out.append(b)
                if args.no_interrupts:
                    continue
                if not entry_done and b == PROLOGUE:
                    out.append("  ESB_CHECK_INTERRUPT();")
                    entry_done = True
                else:
                    lm = LOOP_LABEL.match(b)
                    if lm:
                        out.append(lm.group(1) + "  ESB_CHECK_INTERRUPT();")
                        n_loops += 1
            if not entry_done:
                die("no FUNC_PROLOGUE in " + m.group(1))
            funcs.append((m.group(1), out))
            i = j + 1
            continue
        if DATA_SEG_START.match(line):
            j = i
            while not lines[j].startswith("};"):
                j += 1
            data_segs.extend(lines[i:j + 1])
            i = j + 1
            continue
        if not seen_func and INIT_FUNC.match(line):
            # init_func_types / init_globals / init_memories ...: only module init uses them.
            j = i
            while lines[j] != "}":
                j += 1
            early.extend(lines[i:j + 1])
            i = j + 1
            continue
        if not seen_func:
            m = FUNC_TYPES.match(line)
            if m:
                n_types = int(m.group(1))
                prelude.append("extern u32 func_types[%d];" % n_types)
            else:
                m = FWD_DECL.match(line)
                if m:
                    prelude.append(m.group(1))
                    n_fwd += 1
                elif line == '#include "%s"' % h_base:
                    prelude.append('#include "python_wasm.h"')
                else:
                    prelude.append(line)
        else:
            tail.append(line)
        i += 1

    if n_types is None:
        die("no func_types declaration found")
    if not funcs:
        die("no functions found")
    if n_fwd < len(funcs):
        die("found %d forward declarations for %d functions" % (n_fwd, len(funcs)))

    # Insert the interrupt definitions right after the include of the public header.
    for k, line in enumerate(prelude):
        if line == '#include "python_wasm.h"':
            prelude.insert(k + 1, INTERRUPT_DEFS)
            break
    else:
        die("public header include not found in prelude")

    os.makedirs(args.outdir, exist_ok=True)
    with open(args.h_file) as f:
        hdr = f.read()
    with open(os.path.join(args.outdir, "python_wasm.h"), "w") as f:
        f.write(hdr)
    with open(os.path.join(args.outdir, "python_wasm_impl.h"), "w") as f:
        f.write("/* Generated by images/python-wasm/tools/split_wasm2c.py from wasm2c output. */\n")
        f.write("#pragma once\n")
        f.write("\n".join(prelude))
        f.write("\n")
    # Data segments (the Wizer snapshot: tens of MB) as hex arrays make gcc slow and hungry;
    # write them to one binary file and pull it in with the assembler's .incbin instead.
    blob = bytearray()
    seg_defs = []
    k = 0
    while k < len(data_segs):
        m = DATA_SEG_NAME.match(data_segs[k])
        if not m:
            die("unexpected data segment line: " + data_segs[k][:80])
        j = k + 1
        while not data_segs[j].startswith("};"):
            j += 1
        raw = "".join(data_segs[k + 1:j]).replace("0x", "").replace(",", "").replace(" ", "")
        data = bytes.fromhex(raw)
        while len(blob) % 16:
            blob.append(0)
        seg_defs.append("#define %s (esb_python_wasm_data + %d) /* %d bytes */"
                        % (m.group(1), len(blob), len(data)))
        blob += data
        k = j + 1
    blob_name = "python_wasm_data.bin"
    with open(os.path.join(args.outdir, blob_name), "wb") as f:
        f.write(blob)
    with open(os.path.join(args.outdir, "python_wasm_0.c"), "w") as f:
        f.write('#include "python_wasm_impl.h"\n\n')
        f.write("u32 func_types[%d];\n\n" % n_types)
        f.write('__asm__(".section .rodata\\n"\n'
                '        ".balign 16\\n"\n'
                '        ".globl esb_python_wasm_data\\n"\n'
                '        "esb_python_wasm_data:\\n"\n'
                '        ".incbin \\"" ESB_PYTHON_WASM_DATA "\\"\\n"\n'
                '        ".previous\\n");\n')
        f.write("extern const u8 esb_python_wasm_data[];\n")
        f.write("\n".join(seg_defs))
        f.write("\n\n")
        f.write("\n".join(early))
        f.write("\n")
        f.write("\n".join(tail))
        f.write("\n")

    # Greedy balance by line count (a good proxy for gcc time).
    parts = max(1, args.parts)
    buckets = [[] for _ in range(parts)]
    sizes = [0] * parts
    for name, body in sorted(funcs, key=lambda nb: -len(nb[1])):
        k = sizes.index(min(sizes))
        buckets[k].append(body)
        sizes[k] += len(body)
    for k, bucket in enumerate(buckets):
        with open(os.path.join(args.outdir, "python_wasm_%d.c" % (k + 1)), "w") as f:
            f.write('#include "python_wasm_impl.h"\n\n')
            for body in bucket:
                f.write("\n".join(body))
                f.write("\n\n")
    print("split_wasm2c: %d functions (%d loop headers instrumented) into %d files, "
          "lines per file %s" % (len(funcs), n_loops, parts, sizes))


if __name__ == "__main__":
    main()
