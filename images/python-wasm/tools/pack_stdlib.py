#!/usr/bin/env python3
"""stdlib.pack: the nano guest's read-only stdlib as one file (format: README.md).

  pack_stdlib.py pack DIR OUT.pack      DIR's tree (files and directories only) -> OUT.pack
  pack_stdlib.py unpack IN.pack DIR     the reverse (DIR must not exist); validates every path
  pack_stdlib.py list IN.pack           one line per entry: mode size path

Little-endian. Header: b"ESBSTD01", u32 entry_count, u32 reserved (0). Entries: u32 path_len,
path (UTF-8, relative, '/'-separated), u32 mode (0 file, 1 dir), u64 size, data. Directories
precede their contents; entries are sorted so the output is deterministic.
"""

import os
import struct
import sys

MAGIC = b"ESBSTD01"
MODE_FILE = 0
MODE_DIR = 1


def _entries(root):
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                raise SystemExit("pack: symlink not allowed: " + full)
            out.append((os.path.normpath(os.path.join(rel_dir, d)), MODE_DIR, full))
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            if os.path.islink(full) or not os.path.isfile(full):
                raise SystemExit("pack: not a regular file: " + full)
            out.append((os.path.normpath(os.path.join(rel_dir, f)), MODE_FILE, full))
    # os.walk is top-down, so directories already come before their contents.
    return out


def pack(root, out_path):
    entries = _entries(root)
    tmp = out_path + ".tmp"
    total = 0
    with open(tmp, "wb") as out:
        out.write(MAGIC + struct.pack("<II", len(entries), 0))
        for rel, mode, full in entries:
            p = rel.replace(os.sep, "/").encode()
            data = b""
            if mode == MODE_FILE:
                with open(full, "rb") as f:
                    data = f.read()
            out.write(struct.pack("<I", len(p)) + p + struct.pack("<IQ", mode, len(data)))
            out.write(data)
            total += len(data)
    os.replace(tmp, out_path)
    print("pack: %d entries, %d bytes of data -> %s (%d bytes)"
          % (len(entries), total, out_path, os.path.getsize(out_path)))


def _read(path):
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:8] != MAGIC:
        raise SystemExit("unpack: bad magic")
    count, _ = struct.unpack_from("<II", buf, 8)
    off = 16
    for _ in range(count):
        (plen,) = struct.unpack_from("<I", buf, off)
        off += 4
        name = buf[off:off + plen].decode()
        off += plen
        mode, size = struct.unpack_from("<IQ", buf, off)
        off += 12
        data = buf[off:off + size]
        if len(data) != size:
            raise SystemExit("unpack: truncated")
        off += size
        parts = name.split("/")
        if (not name or name.startswith("/") or "\0" in name
                or any(c in ("", ".", "..") for c in parts) or mode not in (0, 1)
                or (mode == MODE_DIR and size)):
            raise SystemExit("unpack: bad entry %r" % name)
        yield name, mode, data
    if off != len(buf):
        raise SystemExit("unpack: trailing bytes")


def unpack(path, root):
    os.makedirs(root)
    for name, mode, data in _read(path):
        full = os.path.join(root, *name.split("/"))
        if mode == MODE_DIR:
            os.mkdir(full)
        else:
            with open(full, "wb") as f:
                f.write(data)


def main(argv):
    if len(argv) == 4 and argv[1] == "pack":
        pack(argv[2], argv[3])
    elif len(argv) == 4 and argv[1] == "unpack":
        unpack(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "list":
        for name, mode, data in _read(argv[2]):
            print(mode, len(data), name)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
