"""Runner inside the nano guest (CPython on wasm32-wasi). See images/python-wasm/README.md.

init() runs once at Wizer time (pre-imports, patches for unsupported features); run() and
reseed() run per request, called from the C entry points esb_run / esb_reseed.
"""

import errno
import os
import sys

ABI = 1
RESULT_PATH = "/.esb/result.json"
PRELOAD_REPORT = "/.esb/preload.json"  # written at Wizer time only, read by build.sh
MAX_TRACEBACK = 64 * 1024
MAX_MESSAGE = 8 * 1024

# Imported at snapshot time so that a run only executes user code.
PRELOAD = (
    "abc array ast base64 binascii bisect calendar codecs collections collections.abc "
    "contextlib copy csv dataclasses datetime decimal difflib enum fnmatch fractions functools "
    "glob hashlib heapq hmac io itertools json keyword linecache locale math numbers operator "
    "os pathlib pprint queue random re secrets shlex shutil signal socket statistics string "
    "struct subprocess tempfile textwrap threading time timeit token tokenize traceback types "
    "typing unicodedata warnings weakref zlib"
).split()

_runs = 0
_preloaded = []


class NanoUnsupportedError(OSError):
    """A feature the nano runtime does not provide (sockets, processes, threads, signals)."""

    def __init__(self, feature, what):
        super().__init__(errno.ENOTSUP,
                         f"{what} is not available in the nano runtime (no {feature} support)")
        self.feature = feature


def _unsupported(feature, what):
    def refuse(*args, **kwargs):
        raise NanoUnsupportedError(feature, what)
    refuse.__name__ = what.rsplit(".", 1)[-1]
    refuse.__qualname__ = refuse.__name__
    return refuse


def _patch_unsupported():
    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle",
                 "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn",
                 "posix_spawnp", "kill", "killpg"):
        setattr(os, name, _unsupported("subprocess", "os." + name))
    try:
        import subprocess
        subprocess.Popen.__init__ = _unsupported("subprocess", "subprocess.Popen")
    except ImportError:
        pass
    try:
        import socket
        socket.socket.__init__ = _unsupported("socket", "socket.socket")
        for name in ("create_connection", "create_server", "socketpair", "fromfd",
                     "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
            if hasattr(socket, name):
                setattr(socket, name, _unsupported("socket", "socket." + name))
    except ImportError:
        pass
    try:
        import _thread
        refuse = _unsupported("threads", "_thread.start_new_thread")
        _thread.start_new_thread = refuse
        _thread.start_new = refuse
        import threading
        threading._start_new_thread = refuse
    except ImportError:
        pass
    try:
        import signal
        for name in ("signal", "alarm", "setitimer", "pause", "pthread_kill", "raise_signal",
                     "sigwait", "siginterrupt"):
            if hasattr(signal, name):
                setattr(signal, name, _unsupported("signal", "signal." + name))
    except ImportError:
        pass


class _Quitter:
    """exit()/quit() as in the interactive interpreter (site.py is not imported in the guest)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "Use %s() to exit" % self.name

    def __call__(self, code=None):
        raise SystemExit(code)


def init():
    """Wizer time: make stdio line-buffered, pre-import, patch, freeze the heap."""
    import gc
    import importlib
    global _preloaded
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, errors="backslashreplace")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            _preloaded.append(name)
        except Exception:  # a missing optional module must not break the snapshot
            pass
    _patch_unsupported()
    import builtins
    builtins.exit = _Quitter("exit")
    builtins.quit = _Quitter("quit")
    # Warm the caches a first run would fill: compile(), json, the result path.
    exec(compile("pass", "<nano>", "exec", dont_inherit=True), {})
    import json
    json.dumps({"a": [1, 2.5, None, "x"]})
    # Warm the per-run paths too (first-call costs otherwise paid by every fresh instance):
    # result writing (creates /.esb/result.json at build time only), reseeding, flushing.
    _write_result("ok", 0, None)
    reseed()
    _flush()
    try:
        with open(PRELOAD_REPORT, "w") as f:
            json.dump({"preloaded": _preloaded, "modules": sorted(sys.modules)}, f)
    except OSError:
        pass
    sys.argv[:] = [""]
    gc.collect()
    gc.freeze()


def reseed():
    import random
    random.seed()
    try:
        import tempfile
        tempfile._name_sequence = None
    except ImportError:
        pass


def _read_code():
    chunks = []
    while True:
        try:
            b = os.read(0, 1 << 16)
        except InterruptedError:
            continue
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _classify(exc):
    """The "unsupported" tag of an exception, or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, NanoUnsupportedError):
            return exc.feature
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            return "module:" + exc.name.split(".", 1)[0]
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _write_result(status, code, error):
    import json
    doc = {"abi": ABI, "status": status, "exit_code": code, "error": error}
    try:
        data = json.dumps(doc, ensure_ascii=True)
    except Exception:
        data = json.dumps({"abi": ABI, "status": status, "exit_code": code, "error": None})
    try:
        fd = os.open(RESULT_PATH, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _exception_report(exc, tb):
    import traceback
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        sys.stderr.write(text)
    except Exception:
        pass
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable %s>" % type(exc).__name__
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    if len(text) > MAX_TRACEBACK:
        text = "...\n" + text[-MAX_TRACEBACK:]
    return {"type": type(exc).__name__, "message": message, "traceback": text,
            "unsupported": _classify(exc)}


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def run():
    """One request: code from fd 0, executed in the persistent __main__. Returns exit code."""
    global _runs
    import __main__
    import linecache
    src = _read_code()
    if src.strip():  # an empty warm-up run (host pre-forking) does not use up "<nano>"
        _runs += 1
    filename = "<nano>" if _runs <= 1 else "<nano:%d>" % _runs
    try:
        text = src.decode("utf-8", "replace")
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        code = compile(src, filename, "exec", dont_inherit=True)
        exec(code, __main__.__dict__)
    except SystemExit as e:
        _flush()
        rc = _exit_code(e)
        _write_result("exit", rc, None)
        return rc
    except BaseException as e:
        _flush()
        tb = e.__traceback__
        # Hide the runner's own frame (the exec call), as CPython hides its -c machinery.
        if tb is not None and tb.tb_frame.f_code is run.__code__:
            tb = tb.tb_next
        err = _exception_report(e, tb)
        _flush()
        _write_result("unsupported" if err["unsupported"] else "exception", 1, err)
        return 1
    _flush()
    _write_result("ok", 0, None)
    return 0
