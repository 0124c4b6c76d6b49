#!/usr/bin/env python3
"""Writes ENOSYS stubs for every WASI import in python_wasm.h that smoke_host.c does not define."""
import re
import sys

header, host, out = sys.argv[1:4]
decls = re.findall(r"^(\w+) (Z_wasi_snapshot_preview1Z_\w+)\(([^)]*)\);$",
                   open(header).read(), re.M)
defined = set(re.findall(r"^\w+ (Z_wasi_snapshot_preview1Z_\w+)\(", open(host).read(), re.M))
with open(out, "w") as f:
    for ret, name, params in decls:
        if name in defined:
            continue
        types = [p.strip() for p in params.split(",")]
        args = ", ".join("%s a%d" % (t, i) for i, t in enumerate(types))
        body = "return 52;" if ret != "void" else "return;"
        f.write("%s %s(%s) { %s }\n" % (ret, name, args, body))
