// kernel.py: the heavy tier's stateful Python kernel. esbd writes it to
// /tmp/.esb-kernel/kernel.py inside a container environment and runs each cell with
//   python3 /tmp/.esb-kernel/kernel.py run CELLFILE RESULTFILE TIMEOUT_MS
// through the ordinary Exec call (no agent or driver changes).
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
// Wire format: the client sends {"code": ...}\n; the server answers {"t":"out","s":"stdout"|
// "stderr","d":...}\n lines, then {"t":"done","status","value","error","truncated"}\n.
//
// Client mode (`run`): serialises cells with flock, starts the server if nothing listens,
// relays output to its own stdout/stderr, and at the deadline sends SIGINT to the server (its
// pid from SO_PEERCRED). If no answer comes within 2 s more, it SIGKILLs the server, removes
// the socket (the next cell starts a fresh kernel) and reports kernel_restarted. It always
// writes {status ok|error|interrupted, value, error, kernel_restarted, timed_out, truncated}
// to RESULTFILE and exits 0 (its own failure shows as a missing result file).
#include "api/heavy_kernel.h"

namespace esb::api {
namespace {

constexpr std::string_view kKernelPy = R"PY(
# esb heavy-tier Python kernel (written into the environment by esbd; stdlib only).
#   python3 kernel.py serve                                 -> the persistent kernel
#   python3 kernel.py run CELLFILE RESULTFILE TIMEOUT_MS    -> run one cell through it
import ast, builtins, errno, fcntl, glob, json, linecache, os, select, signal, socket
import struct, sys, time, traceback, types

DIR = os.path.dirname(os.path.abspath(__file__))
SOCK = os.path.join(DIR, "sock")
VALUE_MAX = 64 * 1024
STREAM_MAX = 2 * 1024 * 1024
GRACE_S = 2.0


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
        pass

    def isatty(self):
        return False

    def writable(self):
        return True

    @property
    def encoding(self):
        return "utf-8"


class Cell:
    def __init__(self, conn):
        self.conn, self.alive, self.sent, self.truncated = conn, True, 0, False

    def emit(self, name, s):
        if not s or not self.alive:
            return
        if self.sent + len(s) > STREAM_MAX:
            s = s[: max(0, STREAM_MAX - self.sent)]
            self.truncated = True
        if not s:
            return
        self.sent += len(s)
        try:
            send(self.conn, {"t": "out", "s": name, "d": s})
        except OSError:
            self.alive = False


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


def run_cell(ns, code, counter, cell):
    global IN_CELL
    name = "<cell-%d>" % counter
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    result = {"status": "ok", "value": None, "error": None}
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
            sys.stdout.flush()
        except BaseException:
            pass
        sys.stdout, sys.stderr = old
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


def serve():
    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.path[0] = ""
    ns = main.__dict__
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
                cell = Cell(conn)
                result = run_cell(ns, req.get("code", ""), counter, cell)
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


def run(cellfile, resultfile, timeout_ms):
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
    with open(cellfile, encoding="utf-8", errors="surrogateescape") as f:
        code = f.read()
    try:
        os.unlink(cellfile)
    except OSError:
        pass
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
    send(s, {"code": code})
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
    elif len(sys.argv) == 5 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        sys.stderr.write("usage: kernel.py serve | run CELLFILE RESULTFILE TIMEOUT_MS\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
)PY";

}  // namespace

std::string_view HeavyKernelSource() { return kKernelPy; }

}  // namespace esb::api
