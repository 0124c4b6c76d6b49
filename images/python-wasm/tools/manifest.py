#!/usr/bin/env python3
"""Writes manifest.json for a published python-wasm directory (to stdout)."""

import argparse
import hashlib
import json
import os
import re
import subprocess


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wasm_memory_pages(path):
    """Initial/maximum pages of the (single, defined) memory, from wasm-objdump."""
    try:
        out = subprocess.run(["wasm-objdump", "-x", "-j", "Memory", path], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    m = re.search(r"pages: initial=(\d+)(?: max=(\d+))?", out)
    if not m:
        return None, None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--hash", required=True)
    ap.add_argument("--python-version", required=True)
    ap.add_argument("--zlib-version", required=True)
    ap.add_argument("--preload", required=True)
    ap.add_argument("--cflags", required=True)
    ap.add_argument("--parts", type=int, required=True)
    a = ap.parse_args()

    files = {}
    for name in ("libpython_wasm.a", "python_wasm.h", "stdlib.pack", "stdlib-tests.pack",
                 "python.wasm"):
        p = os.path.join(a.dir, name)
        files[name] = {"sha256": sha256(p), "size": os.path.getsize(p)}
    with open(os.path.join(a.dir, "python_wasm.h")) as f:
        header = f.read()
    exports = sorted(set(re.findall(r"/\* export: '([^']+)' \*/", header)))
    export_symbols = sorted(set(re.findall(r"\b(Z_pythonZ_\w+)\(", header)))
    imports = sorted(set(re.findall(r"/\* import: 'wasi_snapshot_preview1' '(\w+)' \*/", header)))
    initial, maximum = wasm_memory_pages(os.path.join(a.dir, "python.wasm"))
    with open(a.preload) as f:
        preload = json.load(f)
    doc = {
        "abi": 1,
        "hash": a.hash,
        "python": {"source_package": "python3.11", "version": a.python_version},
        "zlib": {"source_package": "zlib", "version": a.zlib_version},
        "wasm2c": {
            "module_name": "python",
            "parts": a.parts,
            "cflags": a.cflags.split(),
            "note": "compile /usr/src/wasm2c/wasm-rt-impl.c with wasm-rt.h's defaults "
                    "(no WASM_RT_* defines), as this library was",
            "instance_type": "Z_python_instance_t",
            "init_module": "Z_python_init_module",
            "instantiate": "Z_python_instantiate",
            "free": "Z_python_free",
        },
        "exports": exports,
        "export_symbols": export_symbols,
        "wasi_imports": imports,
        "host_symbols": ["esb_nano_interrupt", "esb_nano_interrupted"],
        "memory_initial_pages": initial,
        "memory_max_pages": maximum,
        "preopens": [{"fd": 3, "path": "/"}],
        "stdlib_mount": "/usr/lib/python3.11",
        "result_path": "/.esb/result.json",
        "preloaded_modules": preload.get("preloaded", []),
        "files": files,
    }
    print(json.dumps(doc, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
