#!/usr/bin/env python3
"""Cross-checks ExtractImports against Python's own parser on every .py file of the installed
standard library: the dotted names and relative imports router_scan reports must equal those
found by walking ast (Import, ImportFrom, and __import__/import_module calls with a literal name).

Usage: crosscheck_ast.py /path/to/router_scan [directory]   (default: the stdlib directory)
"""
import ast
import pathlib
import subprocess
import sys
import sysconfig


def expected(tree):
    dotted, rel = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            dotted.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                rel.add(f"{n.level}:{n.module or ''}")
            elif n.module != "__future__":
                dotted.add(n.module)
                dotted.update(f"{n.module}.{a.name}" for a in n.names if a.name != "*")
        elif isinstance(n, ast.Call):
            f = n.func
            name = getattr(f, "id", None) or getattr(f, "attr", None)
            if (name in ("__import__", "import_module") and n.args
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
                    and n.args[0].value):
                v = n.args[0].value
                stripped = v.lstrip(".")
                if stripped != v:
                    rel.add(f"{len(v) - len(stripped)}:{stripped}")
                else:
                    dotted.add(v)
    return dotted, rel


def main():
    scanner = sys.argv[1]
    root = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.rglob("*.py"))
    if not files:
        print(f"SKIP: no .py files under {root}")
        return 0
    got = {}
    for i in range(0, len(files), 200):
        out = subprocess.run([scanner] + files[i:i + 200], capture_output=True, check=True).stdout
        for line in out.decode("utf-8", "replace").splitlines():
            path, _dyn, dotted, rel, _warn = line.split("\t")
            got[path] = (set(dotted.split()), set(rel.split()))
    checked = bad = 0
    for path in files:
        try:
            tree = ast.parse(pathlib.Path(path).read_bytes())
        except (SyntaxError, ValueError):
            continue  # test data with deliberate syntax errors
        checked += 1
        want = expected(tree)
        if got.get(path) != want:
            bad += 1
            have = got.get(path, (set(), set()))
            print(f"MISMATCH {path}: extra {sorted(have[0] - want[0])} {sorted(have[1] - want[1])}"
                  f" missing {sorted(want[0] - have[0])} {sorted(want[1] - have[1])}")
    print(f"{checked} files checked under {root}, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
