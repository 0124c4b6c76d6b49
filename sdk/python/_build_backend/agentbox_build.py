"""A tiny in-tree PEP 517 build backend for agentbox (no dependencies, no network).

pip normally installs the build backend (setuptools) into an isolated environment from an
index; this one ships with the source, so ``pip install ./sdk/python`` works offline. It
builds a pure-Python wheel of the ``agentbox`` package, an sdist, and a PEP 660 editable
wheel (a ``.pth`` file pointing at this checkout).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "agentbox"
PACKAGE_DIR = os.path.join(ROOT, NAME)


def _version() -> str:
    with open(os.path.join(PACKAGE_DIR, "__init__.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not m:
        raise RuntimeError("agentbox/__init__.py has no __version__")
    return m.group(1)


def _metadata() -> str:
    readme = ""
    path = os.path.join(ROOT, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            readme = f.read()
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {_version()}\n"
            "Summary: Python SDK for EnterSandBox (esbd): sandboxes, meta-tools and the "
            "Plan-Execute-Review executor for AI agents\n"
            "Requires-Python: >=3.11\nClassifier: Programming Language :: Python :: 3\n"
            "Classifier: Typing :: Typed\n"
            "Description-Content-Type: text/markdown\n\n" + readme)


def _package_files() -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(PACKAGE_DIR):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            # tools.json is a link to the repository's one catalogue (sdk/tools.json): open()
            # and the sdist's dereference=True package its content, not the link.
            if fn.endswith((".py", ".typed", ".json")):
                full = os.path.join(dirpath, fn)
                out.append((full, os.path.relpath(full, ROOT).replace(os.sep, "/")))
    return out


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _write_wheel(directory: str, files: list[tuple[str, bytes]]) -> str:
    version = _version()
    dist_info = f"{NAME}-{version}.dist-info"
    name = f"{NAME}-{version}-py3-none-any.whl"
    meta = [
        (f"{dist_info}/METADATA", _metadata().encode("utf-8")),
        (f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: agentbox_build\n"
                               b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{dist_info}/top_level.txt", f"{NAME}\n".encode()),
    ]
    records = []
    with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, data in files + meta:
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            records.append(_record_line(arcname, data))
        records.append(f"{dist_info}/RECORD,,")
        zf.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return name


def get_requires_for_build_wheel(config_settings: Optional[dict[str, Any]] = None) -> list:
    """PEP 517 hook: nothing is needed to build."""
    return []


def get_requires_for_build_sdist(config_settings: Optional[dict[str, Any]] = None) -> list:
    """PEP 517 hook: nothing is needed to build."""
    return []


def get_requires_for_build_editable(config_settings: Optional[dict[str, Any]] = None) -> list:
    """PEP 660 hook: nothing is needed to build."""
    return []


def build_wheel(wheel_directory: str, config_settings: Optional[dict[str, Any]] = None,
                metadata_directory: Optional[str] = None) -> str:
    """PEP 517 hook: build ``agentbox-<version>-py3-none-any.whl``."""
    files = []
    for full, arcname in _package_files():
        with open(full, "rb") as f:
            files.append((arcname, f.read()))
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory: str, config_settings: Optional[dict[str, Any]] = None,
                   metadata_directory: Optional[str] = None) -> str:
    """PEP 660 hook: a wheel whose ``.pth`` file puts this checkout on ``sys.path``."""
    return _write_wheel(wheel_directory, [("agentbox_editable.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory: str, config_settings: Optional[dict[str, Any]] = None) -> str:
    """PEP 517 hook: build ``agentbox-<version>.tar.gz``."""
    version = _version()
    base = f"{NAME}-{version}"
    name = f"{base}.tar.gz"
    extra = ["pyproject.toml", "README.md", "_build_backend/agentbox_build.py"]
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", dereference=True) as tf:
        for rel in extra:
            if os.path.exists(os.path.join(ROOT, rel)):
                tf.add(os.path.join(ROOT, rel), f"{base}/{rel}")
        for full, arcname in _package_files():
            tf.add(full, f"{base}/{arcname}")
        data = _metadata().encode("utf-8")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size, info.mtime = len(data), int(time.time())
        tf.addfile(info, io.BytesIO(data))
    return name
