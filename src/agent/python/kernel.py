# esb heavy-tier Python kernel (guest side: runs inside the sandbox; stdlib only).
#   python3 kernel.py serve [DIR]                                   -> the persistent kernel
#   python3 kernel.py run|once CELLFILE RESULTFILE TIMEOUT_MS FMTS  -> one cell
#
# This file is compiled into esbd (src/drivers/CMakeLists.txt embeds it at build time); the
# container driver puts it on its share tmpfs and binds it READ-ONLY at /usr/lib/esb/kernel.py
# in every sandbox (like esb-agent), and cells run through the ordinary Exec call. The kernel's
# working state (cells, results, lock, restart counter) lives in the writable directory
# ESB_KERNEL_DIR (default /tmp/.esb-kernel), never next to the code. The protocol and the
# guarantees are described in src/drivers/heavy_kernel.h. tests/kernel/test_kernel.py runs it
# on the host, from this file.
import ast, builtins, fcntl, glob, importlib, importlib.machinery, io, json, linecache
import os, select, signal, socket, stat, struct, sys, threading, time, traceback, types


def readable(objs, timeout):
    """The objects (fds or sockets) among `objs` ready to read within `timeout` seconds (None:
    wait). poll(2), not select(2): gVisor's sandbox filter answers select with EPERM."""
    p = select.poll()
    by_fd = {}
    for o in objs:
        fd = o if isinstance(o, int) else o.fileno()
        by_fd[fd] = o
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    events = p.poll(None if timeout is None else int(timeout * 1000))
    return [by_fd[fd] for fd, _ in events]

DIR = os.path.abspath(
    (sys.argv[2] if len(sys.argv) == 3 and sys.argv[1] == "serve" else None)
    or os.environ.get("ESB_KERNEL_DIR") or "/tmp/.esb-kernel")
# An abstract unix socket: no file that `rm -rf /tmp/*` could delete while the kernel lives
# on, and the name is free again the moment the kernel dies. One per kernel directory.
SOCK = "\0esb-kernel:" + DIR
VALUE_MAX = 64 * 1024             # repr() of a cell's final value
STREAM_MAX = 2 * 1024 * 1024      # characters of output per cell
ERROR_TEXT_MAX = 16 * 1024        # an exception's message
TRACEBACK_MAX = 64 * 1024         # its traceback (the end is kept)
GRACE_S = 2.0                     # from interrupt to kill
# Files written here during a cell are artifacts (the variable is for tests on the host).
ARTIFACTS = os.environ.get("ESB_KERNEL_ARTIFACTS", "/workspace/artifacts")
ARTIFACT_SCAN_MAX = 2000             # entries (files and directories) looked at per scan
ARTIFACTS_PER_CELL = 32
FIGURE_FORMATS = {"png": "image/png", "svg": "image/svg+xml"}
TABLE_ROWS, TABLE_COLS, TABLE_CELL = 200, 50, 1000
TABLE_JSON_MAX = 512 * 1024       # a table's encoded size; rows are dropped to fit
BACKEND = "_esb_mpl_backend"
OWNER_PID = os.getpid()           # the kernel process (a fork() in a cell is not it)


# --- output ---------------------------------------------------------------------------------
# The current cell's Cell, or None between cells (output then is dropped). sys.stdout and
# sys.stderr are KernelStream objects for the kernel's whole life, so output from threads that
# outlive a cell goes to whichever cell runs when they write.
CURRENT = None
IN_CELL = False
PUMP = None  # the FdPump, once fds 1/2 are its pipes
# SIGINT/SIGALRM arriving while the main thread sends a frame must not cut the frame in two:
# the handler defers the KeyboardInterrupt until the frame is out.
MAIN_SENDING = False
DEFERRED = False


def main_thread():
    return threading.current_thread() is threading.main_thread()


def guarded(fn, *args):
    """Calls fn with interrupts deferred (main thread), then raises a deferred interrupt."""
    global MAIN_SENDING, DEFERRED
    if not main_thread() or MAIN_SENDING:
        return fn(*args)
    MAIN_SENDING = True
    try:
        return fn(*args)
    finally:
        MAIN_SENDING = False
        if DEFERRED:
            DEFERRED = False
            if IN_CELL:
                raise KeyboardInterrupt


class Cell:
    """One cell's output, forwarded through `deliver(stream, text)` and capped at STREAM_MAX.
    Writes are held until a line ends (or a flush, 4 KiB, or the other stream writes), so
    print()'s separate writes of text and newline leave as one chunk, in order. Thread-safe:
    one lock orders every write and the final `done`."""

    def __init__(self, deliver):
        self.deliver, self.alive, self.sent, self.truncated = deliver, True, 0, False
        self.held_name, self.held = None, []
        self.lock = threading.RLock()
        self.interrupt_requested = False
        self.interrupt_raised = False

    def emit(self, name, s):
        with self.lock:
            if not s or not self.alive:
                return
            if self.sent + len(s) > STREAM_MAX:
                s = s[: max(0, STREAM_MAX - self.sent)]
                self.truncated = True
            if not s:
                return
            self.sent += len(s)
            if self.held_name != name:
                self.flush()
                self.held_name = name
            self.held.append(s)
            if "\n" in s or "\r" in s or sum(map(len, self.held)) >= 4096:
                self.flush()

    def flush(self):
        with self.lock:
            if not self.held:
                return
            text, self.held = "".join(self.held), []
            if not self.alive:
                return
            try:
                guarded(self.deliver, self.held_name, text)
            except OSError:
                self.alive = False

    def close(self, last=None):
        """Flushes, sends `last` (a callable) if given, and drops all later output."""
        with self.lock:
            self.flush()
            ok = self.alive
            self.alive = False
            if last is not None and ok:
                guarded(last)


class KernelStream(io.TextIOBase):
    """sys.stdout / sys.stderr of the kernel: writes go to the current cell."""

    def __init__(self, name):
        super().__init__()
        self._name = name
        self.buffer = _BinaryWriter(self)

    @property
    def name(self):
        return "<%s>" % self._name

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return "replace"

    def writable(self):
        return True

    def isatty(self):
        return False

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        cell = CURRENT
        if cell is not None:
            if PUMP is not None:
                PUMP.drain()  # what a subprocess wrote before this write goes first
            cell.emit(self._name, s)
        return len(s)

    def flush(self):
        cell = CURRENT
        if cell is not None:
            cell.flush()

    def close(self):
        pass  # a cell closing sys.stdout must not silence the kernel

    @property
    def closed(self):
        return False


class _BinaryWriter:
    """sys.stdout.buffer: bytes written there are decoded as UTF-8 (invalid bytes replaced)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, b):
        self._stream.write(bytes(b).decode("utf-8", "replace"))
        return len(b)

    def flush(self):
        self._stream.flush()

    def writable(self):
        return True


STDOUT, STDERR = KernelStream("stdout"), KernelStream("stderr")


# `run` and `once` write the cell's output to their stdout as frames, so that esbd sees
# stdout and stderr in the order they were written (the exec's two pipes cannot keep it):
# b"O" or b"E", 8 lowercase hex digits of length, then that many bytes of UTF-8.
# (src/api/kernel_frames.h decodes them.) Their own stderr is left for their own failures.
FRAME_FD = 1
FRAME_MAX = 1 << 20


def write_frame(name, s):
    data = s.encode("utf-8", "replace")
    tag = b"O" if name == "stdout" else b"E"
    for i in range(0, len(data), FRAME_MAX):
        part = data[i:i + FRAME_MAX]
        buf = tag + b"%08x" % len(part) + part
        while buf:
            buf = buf[os.write(FRAME_FD, buf):]


class FdPump:
    """The kernel's file descriptors 1 and 2 are pipes read here, so output that bypasses
    sys.stdout (subprocesses, os.system, C extensions) reaches the current cell too."""

    def __init__(self):
        global PUMP
        PUMP = self
        self.fds = {}
        self.lock = threading.Lock()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.fds[r] = name
        threading.Thread(target=self.loop, name="esb-fd-pump", daemon=True).start()

    def read_available(self, fd):
        """Forwards what can be read from fd now; False at EOF. Caller holds self.lock."""
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            cell = CURRENT
            if cell is not None:
                cell.emit(self.fds[fd], data.decode("utf-8", "replace"))

    def loop(self):
        while True:
            try:
                ready = readable(list(self.fds), None)
            except OSError:
                return
            for fd in ready:
                with self.lock:
                    self.read_available(fd)

    def drain(self):
        """Called at the end of a cell: what was written so far belongs to it."""
        with self.lock:
            for fd in self.fds:
                self.read_available(fd)


# --- matplotlib ------------------------------------------------------------------------------
# MPLBACKEND=module://_esb_mpl_backend, a module this finder provides without a file on disk.
# It draws with Agg and its show() captures the open figures as artifacts, so plt.show()
# behaves like a notebook's inline backend.
BACKEND_SOURCE = """
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas
from matplotlib.backend_bases import FigureManagerBase as FigureManager
import sys as _sys


def show(*args, **kwargs):
    hook = getattr(_sys.modules.get("__esb_kernel__"), "capture_figures", None)
    if hook is not None:
        hook()
"""


class BackendFinder:
    # A meta path finder and loader (duck-typed: importlib.abc costs ~18 ms of imports).
    def find_spec(self, name, path=None, target=None):
        if name == BACKEND:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(compile(BACKEND_SOURCE, "<esb matplotlib backend>", "exec"), module.__dict__)


class Capture:
    """What one cell produced besides output: figures and files under ARTIFACTS."""

    def __init__(self, outdir, formats):
        self.outdir, self.formats, self.items, self.figures = outdir, formats, [], 0
        self.dropped_figures = 0
        self.before = scan_artifacts()

    def full(self):
        return len(self.items) >= ARTIFACTS_PER_CELL

    def add(self, item):
        if not self.full():
            self.items.append(item)

    def capture_figures(self):
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in list(plt.get_fignums()):
            fig = plt.figure(num)
            try:
                if self.full():  # drawing figures nobody will get only costs time
                    self.dropped_figures += 1
                    continue
                self.figures += 1
                title = figure_title(fig)
                for fmt in self.formats:
                    os.makedirs(self.outdir, exist_ok=True)
                    name = "figure-%d.%s" % (self.figures, fmt)
                    path = os.path.join(self.outdir, name)
                    fig.savefig(path, format=fmt)
                    self.add({"path": path, "name": name, "kind": "image",
                              "mime_type": FIGURE_FORMATS[fmt], "title": title,
                              "staged": True})
            finally:
                plt.close(fig)

    def finish(self):
        try:
            self.capture_figures()
        except Exception as e:  # a figure that cannot be drawn must not lose the cell
            self.add({"error": "figure capture failed: %s: %s" % (type(e).__name__, e)})
        after = scan_artifacts()
        for path in sorted(after):
            if self.before.get(path) != after[path]:
                import mimetypes  # only when there is something to describe
                mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
                self.add({"path": path, "name": os.path.relpath(path, ARTIFACTS),
                          "kind": "image" if mime.startswith("image/") else "file",
                          "mime_type": mime, "title": None, "staged": False})
        items = list(self.items)
        if self.dropped_figures:
            items.append({"error": "%d more open figure(s) were not saved: at most %d "
                          "artifacts per cell" % (self.dropped_figures, ARTIFACTS_PER_CELL)})
        return items


def figure_title(fig):
    try:
        if getattr(fig, "_suptitle", None) is not None and fig._suptitle.get_text():
            return fig._suptitle.get_text()[:TABLE_CELL]
        for ax in fig.get_axes():
            if ax.get_title():
                return ax.get_title()[:TABLE_CELL]
    except Exception:
        pass
    return None


def scan_artifacts():
    """{path: (mtime_ns, size)} of regular files under ARTIFACTS (no symlinks followed), in a
    stable order (sorted), looking at ARTIFACT_SCAN_MAX entries at most."""
    found, seen = {}, 0
    for root, dirs, files in os.walk(ARTIFACTS):
        dirs.sort()
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        seen += len(dirs)
        for f in sorted(files):
            seen += 1
            if seen > ARTIFACT_SCAN_MAX:
                return found
            p = os.path.join(root, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[p] = (st.st_mtime_ns, st.st_size)
        if seen > ARTIFACT_SCAN_MAX:
            return found
    return found


# --- values and tables -----------------------------------------------------------------------
def cell_value(v):
    if v is None:
        return None
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if -(2 ** 63) <= v < 2 ** 63:
            return v
        try:
            return str(v)[:TABLE_CELL]
        except ValueError:  # more digits than int->str allows
            return "<int of %d bits>" % v.bit_length()
    if isinstance(v, str):
        return v[:TABLE_CELL]
    item = getattr(v, "item", None)  # numpy scalars
    if callable(item):
        try:
            x = item()
            if isinstance(x, (bool, int, float, str)) or x is None:
                return cell_value(x)
        except Exception:
            pass
    iso = getattr(v, "isoformat", None)
    if callable(iso):
        try:
            return str(iso())[:TABLE_CELL]
        except Exception:
            pass
    try:
        if v != v:  # NaN, NaT, NA
            return None
    except Exception:
        pass
    try:
        return str(v)[:TABLE_CELL]
    except Exception as e:
        return "<unprintable %s: %s>" % (type(v).__name__, type(e).__name__)


def table_of(v):
    """A pandas DataFrame (or Series) as {columns, index, rows, total_rows, ...}, at most
    TABLE_JSON_MAX bytes of JSON (rows are dropped to fit; `truncated` says so)."""
    t = type(v)
    if not t.__module__.startswith("pandas"):
        return None
    if t.__name__ == "Series":
        v = v.to_frame()
    elif t.__name__ != "DataFrame":
        return None
    rows_total, cols_total = v.shape
    part = v.iloc[:TABLE_ROWS, :TABLE_COLS]
    table = {
        "columns": [str(cell_value(c)) for c in part.columns],
        "index": [cell_value(i) for i in part.index],
        "rows": [[cell_value(x) for x in row]
                 for row in part.itertuples(index=False, name=None)],
        "total_rows": int(rows_total),
        "total_columns": int(cols_total),
        "truncated": rows_total > TABLE_ROWS or cols_total > TABLE_COLS,
    }
    while len(json.dumps(table)) > TABLE_JSON_MAX and table["rows"]:
        keep = len(table["rows"]) // 2
        table["rows"], table["index"] = table["rows"][:keep], table["index"][:keep]
        table["truncated"] = True
    return table


# --- running a cell --------------------------------------------------------------------------
def install_hooks():
    if not any(isinstance(f, BackendFinder) for f in sys.meta_path):
        sys.meta_path.append(BackendFinder())
    os.environ["MPLBACKEND"] = "module://" + BACKEND
    hooks = types.ModuleType("__esb_kernel__")
    sys.modules["__esb_kernel__"] = hooks
    try:
        os.makedirs(ARTIFACTS, exist_ok=True)
    except OSError:
        pass
    return hooks


def refresh_user_site():
    # Packages installed with `pip install --user` after the kernel started.
    import site
    try:
        user = site.getusersitepackages()
    except Exception:
        return
    if os.path.isdir(user) and user not in sys.path:
        site.addsitedir(user)
        importlib.invalidate_caches()


def on_sigint(signum, frame):
    """KeyboardInterrupt in the cell, once per requested interrupt; nothing between cells."""
    global DEFERRED
    if not IN_CELL:
        return
    cell = CURRENT
    if cell is not None and cell.interrupt_requested:
        if cell.interrupt_raised:
            return
        cell.interrupt_raised = True
    if MAIN_SENDING:
        DEFERRED = True
        return
    raise KeyboardInterrupt


def request_interrupt(cell):
    """From another thread: interrupt `cell` now if it runs, or as soon as it starts."""
    cell.interrupt_requested = True
    if IN_CELL and CURRENT is cell:
        os.kill(OWNER_PID, signal.SIGINT)


def clip(text, limit, keep_end=False):
    if len(text) <= limit:
        return text
    if keep_end:
        return "...[%d characters cut]...\n" % (len(text) - limit) + text[-limit:]
    return text[:limit] + "...[%d characters cut]" % (len(text) - limit)


def describe(e):
    # Only frames of cells and of the code they call: the kernel's own frames are noise.
    skip = (__file__, ast.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename not in skip]
    text = "".join(traceback.format_exception_only(type(e), e))
    if frames:
        text = ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                + text)
    try:
        message = str(e)
    except Exception:
        message = "<exception message could not be printed>"
    return {"type": type(e).__name__, "message": clip(message, ERROR_TEXT_MAX),
            "traceback": clip(text, TRACEBACK_MAX, keep_end=True)}


ESB_VARS = None


def variables_of(ns, tb=None):
    """The step's bounded variables summary (esb_vars.py) as JSON text; None when it cannot be
    made. esbd ships esb_vars.py's source inside this file (_ESB_VARS_SOURCE, prepended); run
    from the tree, the file next to this one is read."""
    global ESB_VARS
    try:
        if ESB_VARS is None:
            source = globals().get("_ESB_VARS_SOURCE")
            path = "<esb_vars>"
            if source is None:
                path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "esb_vars.py")
                with open(path, encoding="utf-8") as f:
                    source = f.read()
            module = types.ModuleType("__esb_vars__")
            exec(compile(source, path, "exec"), module.__dict__)
            ESB_VARS = module
        return ESB_VARS.summarize_step(ns, tb, skip_files=(__file__, ast.__file__))
    except BaseException:  # noqa: never lose the cell's result over its summary
        return None


def run_cell(ns, code, counter, cell, req, pump=None):
    global IN_CELL, CURRENT
    name = "<cell-%d>" % counter
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    result = {"status": "ok", "value": None, "error": None, "table": None}
    formats = [f for f in req.get("formats") or ["png"] if f in FIGURE_FORMATS] or ["png"]
    capture = Capture(req.get("outdir") or os.path.join(DIR, "out-%d" % counter), formats)
    hooks = sys.modules.get("__esb_kernel__")
    if hooks is not None:
        hooks.capture_figures = capture.capture_figures
    refresh_user_site()
    # A cell may have replaced them, or the SIGINT handler: this cell starts clean.
    sys.stdout, sys.stderr = STDOUT, STDERR
    signal.signal(signal.SIGINT, on_sigint)
    CURRENT = cell
    try:
        IN_CELL = True
        if cell.interrupt_requested and not cell.interrupt_raised:  # timed out before starting
            cell.interrupt_raised = True
            raise KeyboardInterrupt
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            v = eval(compile(last, name, "eval"), ns)
            if v is not None:
                ns["_"] = v
                r = repr(v)
                if len(r) > VALUE_MAX:
                    r = r[:VALUE_MAX] + "...[truncated]"
                result["value"] = r
                try:
                    result["table"] = table_of(v)
                except Exception:
                    result["table"] = None
        IN_CELL = False
    except BaseException as e:  # noqa: the cell's own failure, reported
        IN_CELL = False
        result["status"] = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
        try:
            result["error"] = describe(e)
        except BaseException:
            result["error"] = {"type": type(e).__name__, "message": "", "traceback": ""}
        if req.get("variables"):
            result["variables"] = variables_of(ns, e.__traceback__)
    finally:
        IN_CELL = False
        if os.getpid() != OWNER_PID:
            os._exit(0)  # a fork() in the cell: the child must not become a second kernel
        sys.stdout, sys.stderr = STDOUT, STDERR
        try:
            if pump is not None:
                pump.drain()
            cell.flush()
        except BaseException:
            pass
    if req.get("variables") and result["status"] == "ok":
        result["variables"] = variables_of(ns)
    try:
        result["artifacts"] = capture.finish()
    except BaseException as e:  # noqa: never lose the cell's result over its artifacts
        result["artifacts"] = [{"error": "artifact capture failed: %s" % e}]
    if hooks is not None:
        hooks.capture_figures = None
    result["truncated"] = cell.truncated
    return result


def encode_frame(msg):
    """One JSON line. A result that cannot be encoded (a table cell json refuses) loses the
    part that fails, never the frame."""
    try:
        text = json.dumps(msg)
    except (TypeError, ValueError):
        msg = dict(msg, table=None)
        try:
            text = json.dumps(msg)
        except (TypeError, ValueError) as e:
            text = json.dumps({"t": msg.get("t"), "status": "error", "value": None,
                               "table": None, "truncated": bool(msg.get("truncated")),
                               "artifacts": [], "error": {
                                   "type": "KernelError", "traceback": "",
                                   "message": "the cell's result could not be encoded: %s" % e}})
    return (text + "\n").encode("utf-8", "surrogatepass")


def send(conn, msg):
    conn.sendall(encode_frame(msg))


def read_line(conn, buf):
    while b"\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None, buf
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    return line, rest


def new_namespace():
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.path[0] = ""
    sys.argv = [""]
    install_hooks()
    return main.__dict__


def watch_client(conn, cell, done):
    """Per cell, in a thread: the client asks for an interrupt by sending a line, and a client
    that goes away (killed by its exec timeout, its HTTP caller gone) interrupts the cell too;
    if that cell does not stop within GRACE_S, the kernel kills itself and its children
    rather than keep running code nobody waits for."""
    while not done.is_set():
        try:
            ready = readable([conn], 0.2)
        except (OSError, ValueError):
            return
        if not ready:
            continue
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if done.is_set():
            return
        request_interrupt(cell)
        if not data:
            if not done.wait(GRACE_S):
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return


def note_start():
    """Counts kernel starts in DIR; True when this start replaces a kernel that was lost
    without a client having said so (the restart marker is a client's)."""
    count_file, marker = os.path.join(DIR, "starts"), os.path.join(DIR, "restart-reported")
    try:
        with open(count_file) as f:
            count = int(f.read().strip() or 0)
    except (OSError, ValueError):
        count = 0
    try:
        with open(count_file, "w") as f:
            f.write(str(count + 1))
    except OSError:
        pass
    try:
        os.unlink(marker)
        return False
    except OSError:
        return count > 0


def serve():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(SOCK)
    except OSError:
        return  # another kernel serves this directory already
    restarted = note_start()
    srv.listen(8)
    pump = FdPump()
    sys.stdout, sys.stderr = STDOUT, STDERR
    signal.signal(signal.SIGINT, on_sigint)
    ns = new_namespace()
    counter = 0
    while True:
        try:
            conn, _ = srv.accept()
        except (KeyboardInterrupt, OSError):
            continue
        try:
            with conn:
                conn.settimeout(10)  # the client sends its request at once
                line, rest = read_line(conn, b"")
                conn.settimeout(None)
                if line is None:
                    continue
                req = json.loads(line)
                counter += 1
                cell = Cell(lambda n, d, c=conn: send(c, {"t": "out", "s": n, "d": d}))
                if rest:  # the interrupt line came with the request: the time is already up
                    cell.interrupt_requested = True
                done = threading.Event()
                threading.Thread(target=watch_client, args=(conn, cell, done),
                                 name="esb-watch", daemon=True).start()
                try:
                    result = run_cell(ns, req.get("code", ""), counter, cell, req, pump)
                finally:
                    done.set()
                result["t"] = "done"
                result["restarted"] = restarted
                restarted = False
                cell.close(lambda: send(conn, result))
        except (KeyboardInterrupt, Exception):
            continue


def start_server():
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        fd = os.open(os.devnull, os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "serve", DIR])
    finally:
        os._exit(1)


def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(SOCK)
        return s
    except OSError:
        s.close()
        return None


def peer_pid(s):
    return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]


def read_cell(cellfile):
    with open(cellfile, encoding="utf-8", errors="surrogateescape") as f:
        code = f.read()
    try:
        os.unlink(cellfile)
    except OSError:
        pass
    return code


def once(cellfile, resultfile, timeout_ms, formats):
    """One-shot run in this process (POST /run on the heavy tier): same cell semantics as the
    kernel (value, table, artifacts, structured errors) without a server. At the deadline
    SIGALRM raises KeyboardInterrupt in the cell; a cell that ignores it is ended GRACE_S
    later, still with a result file."""
    global FRAME_FD
    code = read_cell(cellfile)
    out = {"status": "error", "value": None, "error": None, "kernel_restarted": False,
           "timed_out": False, "truncated": False, "table": None, "artifacts": []}
    fired = []
    # Output goes out as frames on a copy of fd 1; fds 1/2 become the pump's pipes, so that
    # subprocess output is framed (and ordered) too.
    FRAME_FD = os.dup(1)
    pump = FdPump()
    cell = Cell(write_frame)

    def on_alarm(signum, frame):
        fired.append(time.monotonic())
        if len(fired) == 1:
            signal.setitimer(signal.ITIMER_REAL, GRACE_S)
            cell.interrupt_requested = True
            on_sigint(signum, frame)  # the same once-per-request interrupt as the kernel's
            return
        if os.getpid() != OWNER_PID:
            os._exit(0)
        out.update(status="interrupted", timed_out=True, error={
            "type": "KeyboardInterrupt", "traceback": "",
            "message": "the code ignored the interrupt at the time limit and was stopped"})
        finish(resultfile, out)
        os.killpg(os.getpgid(0), signal.SIGKILL)  # and whatever it started

    signal.signal(signal.SIGALRM, on_alarm)
    ns = new_namespace()
    signal.setitimer(signal.ITIMER_REAL, max(0.001, timeout_ms / 1000.0))
    result = run_cell(ns, code, 1, cell, {"formats": formats, "outdir": resultfile[:-5] + "-art"},
                      pump)
    signal.setitimer(signal.ITIMER_REAL, 0)
    cell.close()
    out.update(result)
    out["timed_out"] = bool(fired)
    if fired and out["status"] == "interrupted" and out["error"]:
        out["error"]["message"] = "the code ran past its time limit of %d ms" % timeout_ms
    return finish(resultfile, out)


def kill_kernel(pid):
    """SIGKILL to the kernel's process group (its cells' children too), and a marker so the
    next kernel does not report this restart a second time."""
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # start_server made it a group of its own
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        with open(os.path.join(DIR, "restart-reported"), "w"):
            pass
    except OSError:
        pass


def run(cellfile, resultfile, timeout_ms, formats):
    os.makedirs(DIR, exist_ok=True)
    os.chmod(DIR, 0o700)
    out = {"status": "error", "value": None, "error": None, "kernel_restarted": False,
           "timed_out": False, "truncated": False}
    # Old result files that nobody read (the daemon reads them right after the run).
    now = time.time()
    for old in glob.glob(os.path.join(DIR, "result-*.json")):
        try:
            if now - os.path.getmtime(old) > 600:
                os.unlink(old)
        except OSError:
            pass
    code = read_cell(cellfile)
    start = time.monotonic()
    deadline = start + timeout_ms / 1000.0
    # One cell at a time per kernel: later runs queue here (their deadline keeps running).
    lock = open(os.path.join(DIR, "lock"), "w")
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                out["timed_out"] = True
                out["status"] = "interrupted"
                out["error"] = {"type": "TimeoutError", "message":
                                "another cell kept the kernel busy past the timeout",
                                "traceback": ""}
                return finish(resultfile, out)
            time.sleep(0.02)
    s = connect()
    if s is None:
        start_server()
        while s is None and time.monotonic() < start + 10:
            time.sleep(0.02)
            s = connect()
        if s is None:
            out["error"] = {"type": "KernelError", "message": "the kernel did not start",
                            "traceback": ""}
            return finish(resultfile, out)
    pid = peer_pid(s)
    send(s, {"code": code, "formats": formats, "outdir": resultfile[:-5] + "-art",
             "variables": os.environ.get("ESB_KERNEL_VARIABLES") == "1"})
    buf = b""
    interrupted_at = None
    done = None

    def lost(kind, message):
        kill_kernel(pid)
        out["kernel_restarted"] = True
        out["status"] = "interrupted" if out["timed_out"] else "error"
        out["error"] = {"type": kind, "message": message, "traceback": ""}

    while done is None:
        now = time.monotonic()
        if interrupted_at is None and now >= deadline:
            out["timed_out"] = True
            interrupted_at = now
            try:
                s.sendall(b'{"t": "interrupt"}\n')  # the kernel interrupts this very cell
            except OSError:
                pass
        if interrupted_at is not None and now >= interrupted_at + GRACE_S:
            lost("KeyboardInterrupt", "the cell ignored the interrupt; the kernel was killed "
                 "and will restart fresh (all variables are lost)")
            break
        limit = (interrupted_at + GRACE_S) if interrupted_at is not None else deadline
        r = readable([s], max(0.0, min(0.25, limit - now)))
        if not r:
            continue
        try:
            chunk = s.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            # The kernel died under the cell (os._exit, a crash, the OOM killer).
            lost("KernelDied", "the kernel process died during the cell; the next run starts "
                 "a fresh kernel (all variables are lost)")
            break
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                lost("KernelError", "the kernel sent something that is not a frame; it was "
                     "killed and the next run starts a fresh kernel")
                done = {}
                break
            if msg.get("t") == "out":
                write_frame("stdout" if msg.get("s") == "stdout" else "stderr",
                            str(msg.get("d", "")))
            elif msg.get("t") == "done":
                done = msg
                break
    if done:
        out["status"] = done.get("status", "error")
        out["value"] = done.get("value")
        out["error"] = done.get("error")
        out["truncated"] = bool(done.get("truncated"))
        out["table"] = done.get("table")
        out["artifacts"] = done.get("artifacts") or []
        out["kernel_restarted"] = bool(done.get("restarted"))
        if isinstance(done.get("variables"), str):
            out["variables"] = done["variables"]
    return finish(resultfile, out)


def reset():
    """Kills this directory's persistent kernel (time travel's rewind without a memory
    snapshot): the next cell starts a fresh one, which reports kernel_restarted."""
    s = connect()
    if s is None:
        return 0
    pid = peer_pid(s)
    s.close()
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # start_server made it a group of its own
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for _ in range(200):  # until its socket name is free again (at most 2 s)
        probe = connect()
        if probe is None:
            break
        probe.close()
        time.sleep(0.01)
    return 0


def finish(resultfile, out):
    tmp = resultfile + ".tmp"
    with open(tmp, "wb") as f:
        f.write(encode_frame(out))
    os.replace(tmp, resultfile)
    return 0


def main():
    if len(sys.argv) in (2, 3) and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) == 2 and sys.argv[1] == "reset":
        sys.exit(reset())
    elif len(sys.argv) == 6 and sys.argv[1] in ("run", "once"):
        mode = run if sys.argv[1] == "run" else once
        # once() turns fds 1/2 into the cell's pipes: a failure of kernel.py itself is written
        # to the exec's own stderr, where esbd reports it.
        own_stderr = os.dup(2)
        try:
            sys.exit(mode(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split(",")))
        except Exception:
            os.write(own_stderr, traceback.format_exc().encode("utf-8", "replace"))
            os._exit(1)
    else:
        sys.stderr.write("usage: kernel.py serve [DIR] | reset | run|once CELLFILE RESULTFILE TIMEOUT_MS "
                         "FORMATS\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
