// kernel.py: the heavy tier's Python kernel. esbd writes it to /tmp/.esb-kernel/kernel.py
// inside a container environment and runs each cell with
//   python3 /tmp/.esb-kernel/kernel.py run|once CELLFILE RESULTFILE TIMEOUT_MS FORMATS
// through the ordinary Exec call (no agent or driver changes). `run` = a cell of the
// environment's persistent kernel; `once` = a one-shot run in this process (POST /run on heavy).
//
// Every cell (both modes) returns `table` (a final DataFrame/Series as columns + rows) and
// `artifacts`: figures saved as FORMATS (png,svg) into RESULTFILE's "-art" directory — on
// plt.show() through an in-memory matplotlib backend module, and for figures left open at the
// end — plus files created or changed under /workspace/artifacts during the cell. esbd copies
// the reported files out (run_service.cc) and removes the staging directory.
//
// Server mode (`serve`, started on demand by the client, double-forked + setsid so it outlives
// the exec's process group; stdio on /dev/null): listens on /tmp/.esb-kernel/sock (dir 0700,
// socket 0600) and runs cells one after another in one persistent `__main__` namespace. A
// cell is parsed with `ast`; a final expression statement is evaluated separately and its
// repr() (capped at 64 KiB) returned as `value` (None -> null, like a notebook).
// sys.stdout/sys.stderr are replaced during the cell by objects that forward each write to
// the client as a JSON line (capped at 2 MiB per cell -> `truncated`). Exceptions come back as
// {type, message, traceback} without the kernel's own frames. SIGINT raises KeyboardInterrupt
// only while a cell runs (a late interrupt between cells is ignored).
// Wire format: the client sends {"code", "formats", "outdir"}\n; the server answers
// {"t":"out","s":"stdout"|"stderr","d":...}\n lines, then {"t":"done","status","value",
// "error","truncated","table","artifacts"}\n.
//
// Client mode (`run`): serialises cells with flock, starts the server if nothing listens,
// relays output to its own stdout/stderr, and at the deadline sends SIGINT to the server (its
// pid from SO_PEERCRED). If no answer comes within 2 s more, it SIGKILLs the server, removes
// the socket (the next cell starts a fresh kernel) and reports kernel_restarted. It always
// writes {status ok|error|interrupted, value, error, kernel_restarted, timed_out, truncated,
// table, artifacts} to RESULTFILE and exits 0 (its own failure shows as a missing result file).
//
// Once mode (`once`): the same cell in the client's own process; SIGALRM at the deadline raises
// KeyboardInterrupt, and a cell that ignores it is ended 2 s later (still with a result file).
#include "api/heavy_kernel.h"

namespace esb::api {
namespace {

constexpr std::string_view kKernelPy = R"PY(
# esb heavy-tier Python kernel (written into the environment by esbd; stdlib only).
#   python3 kernel.py serve                                 -> the persistent kernel
#   python3 kernel.py run CELLFILE RESULTFILE TIMEOUT_MS    -> run one cell through it
import ast, builtins, errno, fcntl, glob, importlib, importlib.machinery, json, linecache
import os, select, signal, socket, stat, struct, sys, time, traceback, types

DIR = os.path.dirname(os.path.abspath(__file__))
SOCK = os.path.join(DIR, "sock")
VALUE_MAX = 64 * 1024
STREAM_MAX = 2 * 1024 * 1024
GRACE_S = 2.0
ARTIFACTS = "/workspace/artifacts"   # files written here during a cell are artifacts
ARTIFACT_SCAN_MAX = 2000             # entries looked at per scan of ARTIFACTS
ARTIFACTS_PER_CELL = 32
FIGURE_FORMATS = {"png": "image/png", "svg": "image/svg+xml"}
TABLE_ROWS, TABLE_COLS, TABLE_CELL = 200, 50, 1000
BACKEND = "_esb_mpl_backend"


def send(conn, msg):
    conn.sendall((json.dumps(msg) + "\n").encode("utf-8", "surrogatepass"))


class Forward:
    def __init__(self, cell, name):
        self.cell, self.name = cell, name

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        self.cell.emit(self.name, s)
        return len(s)

    def flush(self):
        self.cell.flush()

    def isatty(self):
        return False

    def writable(self):
        return True

    @property
    def encoding(self):
        return "utf-8"


class Cell:
    """Forwards one cell's output through `deliver(stream, text)`, capped at STREAM_MAX.
    Writes are held until a line ends (or a flush, 4 KiB, or the other stream writes), so
    print()'s separate writes of text and newline leave as one chunk, in order."""

    def __init__(self, deliver):
        self.deliver, self.alive, self.sent, self.truncated = deliver, True, 0, False
        self.held_name, self.held = None, []

    def emit(self, name, s):
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
        if not self.held:
            return
        text, self.held = "".join(self.held), []
        if not self.alive:
            return
        try:
            self.deliver(self.held_name, text)
        except OSError:
            self.alive = False


def write_std(name, s):
    data = s.encode("utf-8", "replace")
    fd = 1 if name == "stdout" else 2
    while data:
        data = data[os.write(fd, data):]


# Matplotlib: MPLBACKEND=module://_esb_mpl_backend, a module this finder provides without a
# file on disk. It draws with Agg and its show() captures the open figures as artifacts, so
# plt.show() behaves like a notebook's inline backend.
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
        self.before = scan_artifacts()

    def add(self, item):
        if len(self.items) < ARTIFACTS_PER_CELL:
            self.items.append(item)

    def capture_figures(self):
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in list(plt.get_fignums()):
            fig = plt.figure(num)
            try:
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
        return self.items


def figure_title(fig):
    try:
        if getattr(fig, "_suptitle", None) is not None and fig._suptitle.get_text():
            return fig._suptitle.get_text()
        for ax in fig.get_axes():
            if ax.get_title():
                return ax.get_title()
    except Exception:
        pass
    return None


def scan_artifacts():
    """{path: (mtime_ns, size)} of regular files under ARTIFACTS (no symlinks followed)."""
    found, seen = {}, 0
    for root, dirs, files in os.walk(ARTIFACTS):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for f in files:
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
    return found


def cell_value(v):
    if v is None:
        return None
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, (bool, int, str)):
        return v if not isinstance(v, str) else v[:TABLE_CELL]
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
            return iso()
        except Exception:
            pass
    try:
        if v != v:  # NaN, NaT, NA
            return None
    except Exception:
        pass
    return str(v)[:TABLE_CELL]


def table_of(v):
    """A pandas DataFrame (or Series) as {columns, index, rows, total_rows, ...}."""
    t = type(v)
    if not t.__module__.startswith("pandas"):
        return None
    if t.__name__ == "Series":
        v = v.to_frame()
    elif t.__name__ != "DataFrame":
        return None
    rows_total, cols_total = v.shape
    part = v.iloc[:TABLE_ROWS, :TABLE_COLS]
    return {
        "columns": [str(c) for c in part.columns],
        "index": [cell_value(i) for i in part.index],
        "rows": [[cell_value(x) for x in row]
                 for row in part.itertuples(index=False, name=None)],
        "total_rows": int(rows_total),
        "total_columns": int(cols_total),
        "truncated": rows_total > TABLE_ROWS or cols_total > TABLE_COLS,
    }


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


IN_CELL = False


def on_sigint(signum, frame):
    if IN_CELL:
        raise KeyboardInterrupt


def describe(e):
    # Only frames of cells and of the code they call: the kernel's own frames are noise.
    skip = (__file__, ast.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename not in skip]
    text = "".join(traceback.format_exception_only(type(e), e))
    if frames:
        text = ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                + text)
    return {"type": type(e).__name__, "message": str(e), "traceback": text}


def run_cell(ns, code, counter, cell, req):
    global IN_CELL
    name = "<cell-%d>" % counter
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    result = {"status": "ok", "value": None, "error": None, "table": None}
    formats = [f for f in req.get("formats") or ["png"] if f in FIGURE_FORMATS] or ["png"]
    capture = Capture(req.get("outdir") or os.path.join(DIR, "out-%d" % counter), formats)
    hooks = sys.modules.get("__esb_kernel__")
    if hooks is not None:
        hooks.capture_figures = capture.capture_figures
    refresh_user_site()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Forward(cell, "stdout"), Forward(cell, "stderr")
    try:
        IN_CELL = True
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
    finally:
        IN_CELL = False
        try:
            cell.flush()  # even if the cell replaced sys.stdout
        except BaseException:
            pass
        sys.stdout, sys.stderr = old
    try:
        result["artifacts"] = capture.finish()
    except BaseException as e:  # noqa: never lose the cell's result over its artifacts
        result["artifacts"] = [{"error": "artifact capture failed: %s" % e}]
    if hooks is not None:
        hooks.capture_figures = None
    result["truncated"] = cell.truncated
    return result


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


def serve():
    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ns = new_namespace()
    try:
        os.unlink(SOCK)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    srv.bind(SOCK)
    os.umask(old_umask)
    srv.listen(8)
    counter = 0
    while True:
        try:
            conn, _ = srv.accept()
        except KeyboardInterrupt:
            continue
        except OSError:
            continue
        try:
            with conn:
                line, _ = read_line(conn, b"")
                if line is None:
                    continue
                req = json.loads(line)
                counter += 1
                cell = Cell(lambda n, d: send(conn, {"t": "out", "s": n, "d": d}))
                result = run_cell(ns, req.get("code", ""), counter, cell, req)
                result["t"] = "done"
                send(conn, result)
        except KeyboardInterrupt:
            continue
        except Exception:
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
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "serve"])
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
    code = read_cell(cellfile)
    out = {"status": "error", "value": None, "error": None, "kernel_restarted": False,
           "timed_out": False, "truncated": False, "table": None, "artifacts": []}
    fired = []

    def on_alarm(signum, frame):
        fired.append(time.monotonic())
        if len(fired) == 1:
            signal.setitimer(signal.ITIMER_REAL, GRACE_S)
            if IN_CELL:
                raise KeyboardInterrupt
            return
        out.update(status="interrupted", timed_out=True, error={
            "type": "KeyboardInterrupt", "traceback": "",
            "message": "the code ignored the interrupt at the time limit and was stopped"})
        finish(resultfile, out)
        os._exit(0)

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGALRM, on_alarm)
    ns = new_namespace()
    cell = Cell(write_std)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, timeout_ms / 1000.0))
    result = run_cell(ns, code, 1, cell, {"formats": formats, "outdir": resultfile[:-5] + "-art"})
    signal.setitimer(signal.ITIMER_REAL, 0)
    out.update(result)
    out["timed_out"] = bool(fired)
    if fired and out["status"] == "interrupted" and out["error"]:
        out["error"]["message"] = "the code ran past its time limit of %d ms" % timeout_ms
    return finish(resultfile, out)


def run(cellfile, resultfile, timeout_ms, formats):
    sys.stdout.reconfigure(errors="replace")
    sys.stderr.reconfigure(errors="replace")
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
    send(s, {"code": code, "formats": formats, "outdir": resultfile[:-5] + "-art"})
    buf = b""
    interrupted_at = None
    done = None
    while done is None:
        now = time.monotonic()
        if interrupted_at is None and now >= deadline:
            out["timed_out"] = True
            interrupted_at = now
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass
        if interrupted_at is not None and now >= interrupted_at + GRACE_S:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.unlink(SOCK)
            except OSError:
                pass
            out["kernel_restarted"] = True
            out["status"] = "interrupted"
            out["error"] = {"type": "KeyboardInterrupt", "message":
                            "the cell ignored the interrupt; the kernel was killed and will "
                            "restart fresh (all variables are lost)", "traceback": ""}
            break
        limit = (interrupted_at + GRACE_S) if interrupted_at is not None else deadline
        r, _, _ = select.select([s], [], [], max(0.0, min(0.25, limit - now)))
        if not r:
            continue
        chunk = s.recv(65536)
        if not chunk:
            # The kernel died under the cell (os._exit, a crash, the OOM killer).
            out["kernel_restarted"] = True
            out["status"] = "interrupted" if out["timed_out"] else "error"
            out["error"] = {"type": "KernelDied", "message":
                            "the kernel process died during the cell; the next run starts a "
                            "fresh kernel (all variables are lost)", "traceback": ""}
            try:
                os.unlink(SOCK)
            except OSError:
                pass
            break
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            msg = json.loads(line)
            if msg.get("t") == "out":
                stream = sys.stdout if msg.get("s") == "stdout" else sys.stderr
                stream.write(msg.get("d", ""))
                stream.flush()
            elif msg.get("t") == "done":
                done = msg
                break
    if done is not None:
        out["status"] = done.get("status", "error")
        out["value"] = done.get("value")
        out["error"] = done.get("error")
        out["truncated"] = bool(done.get("truncated"))
        out["table"] = done.get("table")
        out["artifacts"] = done.get("artifacts") or []
    return finish(resultfile, out)


def finish(resultfile, out):
    tmp = resultfile + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, resultfile)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) == 6 and sys.argv[1] in ("run", "once"):
        mode = run if sys.argv[1] == "run" else once
        sys.exit(mode(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split(",")))
    else:
        sys.stderr.write("usage: kernel.py serve | run|once CELLFILE RESULTFILE TIMEOUT_MS "
                         "FORMATS\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
)PY";

}  // namespace

std::string_view HeavyKernelSource() { return kKernelPy; }

}  // namespace esb::api
