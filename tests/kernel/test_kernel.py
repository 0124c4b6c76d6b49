"""kernel.py (src/agent/python/kernel.py, the heavy tier's Python kernel) run on the host from
its home in the tree, the way esbd runs it in a sandbox (read-only code, state in the writable
ESB_KERNEL_DIR): `python3 kernel.py run|once CELL RESULT TIMEOUT_MS FORMATS` with stdout and
stderr read from pipes. Each test gets its own kernel directory (and so its own kernel).
The end-to-end tests through esbd and a real container are in tests/integration."""
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

KERNEL = pathlib.Path(__file__).resolve().parents[2] / "src" / "agent" / "python" / "kernel.py"


def decode_frames(raw):
    """kernel.py's stdout: b"O"|b"E", 8 hex digits of length, the bytes (what esbd decodes)."""
    events, i = [], 0
    while i < len(raw):
        tag, n = raw[i:i + 1], int(raw[i + 1:i + 9], 16)
        assert tag in (b"O", b"E"), raw[i:i + 20]
        data = raw[i + 9:i + 9 + n]
        assert len(data) == n, "a torn frame"
        events.append(("stdout" if tag == b"O" else "stderr", data.decode()))
        i += 9 + n
    return events


class Kernel:
    def __init__(self, root: pathlib.Path):
        self.dir = root / "kernel"
        self.dir.mkdir()
        self.artifacts = root / "artifacts"
        self.env = dict(os.environ, ESB_KERNEL_ARTIFACTS=str(self.artifacts),
                        ESB_KERNEL_DIR=str(self.dir))

    def start(self, code, mode="run", timeout_ms=10000):
        tag = uuid.uuid4().hex[:8]
        cell, result = self.dir / f"cell-{tag}.py", self.dir / f"result-{tag}.json"
        cell.write_text(code)
        proc = subprocess.Popen(
            [sys.executable, str(KERNEL), mode, str(cell), str(result),
             str(timeout_ms), "png"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
            start_new_session=True)  # like the agent: its own process group
        return proc, result

    def run(self, code, mode="run", timeout_ms=10000):
        proc, result = self.start(code, mode, timeout_ms)
        out, err = proc.communicate(timeout=timeout_ms / 1000 + 20)
        assert result.exists(), f"no result file; rc={proc.returncode} stderr={err!r}"
        res = json.loads(result.read_text())
        res["events"] = decode_frames(out)
        res["stdout"] = "".join(d for s, d in res["events"] if s == "stdout")
        res["stderr"] = "".join(d for s, d in res["events"] if s == "stderr")
        res["own_stderr"] = err.decode()
        res["result_bytes"] = result.stat().st_size
        return res

    def server_pids(self):
        out = subprocess.run(["pgrep", "-f", f"{KERNEL} serve {self.dir}$"],
                             capture_output=True, text=True).stdout
        return sorted(int(p) for p in out.split())

    def stop(self):
        for pid in self.server_pids():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.stop()


def test_state_persists_and_final_expression_is_the_value(kernel):
    assert kernel.run("x = 41")["value"] is None
    r = kernel.run("x += 1\nx")
    assert r["status"] == "ok" and r["value"] == "42" and not r["kernel_restarted"]


def test_concurrent_threads_printing_do_not_corrupt_the_stream(kernel):
    code = (
        "import threading\n"
        "def spam(c):\n"
        "    for _ in range(20):\n"
        "        print(c * 40000)\n"
        "ts = [threading.Thread(target=spam, args=(c,)) for c in 'ab']\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "'finished'")
    r = kernel.run(code)
    assert r["status"] == "ok", r["error"]
    assert r["value"] == "'finished'"
    # Two threads' print()s may interleave (as with any stdout), but nothing is lost and the
    # frames that carry the output stay intact (a torn frame would lose the result).
    out = r["stdout"]
    assert (out.count("a"), out.count("b"), out.count("\n")) == (800000, 800000, 40)
    assert len(out) == 1600040 and not r["truncated"]


def test_output_of_subprocesses_and_os_system_reaches_the_cell(kernel):
    r = kernel.run("import os, subprocess\nos.system('echo from-system')\n"
                   "subprocess.run(['sh', '-c', 'echo from-sh; echo err-sh >&2'])\n"
                   "os.write(1, b'raw-fd\\n')\nNone")
    assert r["status"] == "ok", r["error"]
    for text in ("from-system\n", "from-sh\n", "raw-fd\n"):
        assert text in r["stdout"]
    assert "err-sh\n" in r["stderr"]


@pytest.mark.parametrize("mode", ["run", "once"])
def test_stdout_and_stderr_keep_their_order(kernel, mode):
    r = kernel.run("import sys, os\nfor i in range(50):\n"
                   "    sys.stderr.write('E%d\\n' % i)\n    print('O%d' % i)\n"
                   "os.system('echo sh-out; echo sh-err >&2')\nprint('end')", mode=mode)
    assert r["status"] == "ok", r["error"]
    lines = [line for _, d in r["events"] for line in d.splitlines()]
    expected = [x for i in range(50) for x in ("E%d" % i, "O%d" % i)]
    assert lines[:100] == expected
    # The shell's two writes race each other on two pipes, but both precede the next print.
    assert sorted(lines[100:102]) == ["sh-err", "sh-out"] and lines[102:] == ["end"], lines
    assert r["own_stderr"] == ""


@pytest.mark.parametrize("mode", ["run", "once"])
def test_subprocess_output_comes_before_what_the_cell_prints_next(kernel, mode):
    r = kernel.run("import os\nfor i in range(30):\n    os.system('echo child%d' % i)\n"
                   "    print('parent%d' % i)\n", mode=mode)
    assert r["stdout"] == "".join("child%d\nparent%d\n" % (i, i) for i in range(30))


def test_stream_objects_behave_like_files(kernel):
    r = kernel.run("import sys\nsys.stdout.writelines(['a\\n', 'b\\n'])\n"
                   "sys.stdout.buffer.write(b'bytes\\n')\nsys.stdout.flush()\n"
                   "(sys.stdout.closed, sys.stdout.writable())")
    assert r["status"] == "ok", r["error"]
    assert r["stdout"] == "a\nb\nbytes\n"
    assert r["value"] == "(False, True)"
    # A cell that closes or replaces sys.stdout does not silence the next one.
    kernel.run("import sys, io\nsys.stdout.close()\nsys.stdout = io.StringIO()")
    assert kernel.run("print('still here')")["stdout"] == "still here\n"


def test_logging_configured_in_one_cell_works_in_later_cells(kernel):
    kernel.run("import logging\nlogging.basicConfig(level=logging.INFO, format='%(message)s')")
    # A thread that logs between cells (after its cell ended) must not break the handler.
    kernel.run("import threading, logging\n"
               "threading.Timer(0.2, lambda: logging.info('between cells')).start()")
    time.sleep(0.6)
    assert kernel.run("logging.info('second cell')")["stderr"] == "second cell\n"
    assert kernel.run("logging.info('third cell')")["stderr"] == "third cell\n"


def test_fork_in_a_cell_does_not_make_a_second_kernel(kernel):
    r = kernel.run("import os\npid = os.getpid()\nchild = os.fork()\n"
                   "if child:\n    os.waitpid(child, 0)\npid")
    assert r["status"] == "ok", r["error"]
    pids = {kernel.run("import os\nos.getpid()")["value"] for _ in range(4)}
    assert pids == {r["value"]}
    assert len(kernel.server_pids()) == 1


def test_timeout_before_the_cell_starts_interrupts_instead_of_killing(kernel):
    kernel.run("kept = 'yes'")
    # Slow the start of the next cell: the kernel scans the artifacts directory first.
    many = kernel.artifacts / "many"
    many.mkdir(parents=True)
    for i in range(1900):
        (many / f"f{i}").write_text("x")
    r = kernel.run("import time\ntime.sleep(5)", timeout_ms=1)
    assert r["timed_out"] and r["status"] == "interrupted", r
    assert not r["kernel_restarted"], r["error"]
    assert kernel.run("kept")["value"] == "'yes'"


def test_ignored_interrupt_kills_the_kernel_and_its_children(kernel):
    kernel.run("state = 1")
    r = kernel.run("import subprocess, time\n"
                   "p = subprocess.Popen(['sleep', '987'])\n"
                   "while True:\n    try:\n        time.sleep(1)\n"
                   "    except KeyboardInterrupt:\n        pass\n", timeout_ms=500)
    assert r["timed_out"] and r["kernel_restarted"], r
    time.sleep(0.3)
    assert subprocess.run(["pgrep", "-f", "sleep 987"]).returncode == 1, "child survived"
    fresh = kernel.run("state")
    assert fresh["error"]["type"] == "NameError"
    # The client that killed it said so; the next cell does not report it a second time.
    assert not fresh["kernel_restarted"]


def test_a_client_that_goes_away_interrupts_its_cell(kernel):
    kernel.run("kept = 1")
    proc, _ = kernel.start("import time\ntry:\n    time.sleep(60)\n"
                           "except KeyboardInterrupt:\n    interrupted = True\n    raise\n")
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)  # what esbd does at the exec timeout
    proc.wait()
    start = time.monotonic()
    r = kernel.run("(kept, interrupted)", timeout_ms=20000)
    assert time.monotonic() - start < 5, "the next cell waited for the orphaned one"
    assert r["value"] == "(1, True)", r


def test_a_kernel_lost_between_cells_is_reported_by_the_next_cell(kernel):
    kernel.run("x = 1")
    [pid] = kernel.server_pids()
    os.kill(pid, signal.SIGKILL)  # the OOM killer, say
    time.sleep(0.2)
    r = kernel.run("1 + 1")
    assert r["value"] == "2" and r["kernel_restarted"], r


def test_kernel_directory_removed_between_cells_does_not_leave_two_kernels(kernel):
    kernel.run("x = 1")
    for f in kernel.dir.iterdir():  # what `rm -rf /tmp/*` in the sandbox would do
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink()
    r = kernel.run("x")
    assert r["value"] == "1", r
    assert len(kernel.server_pids()) == 1


def test_huge_errors_are_clipped_and_the_result_stays_small(kernel):
    r = kernel.run("raise ValueError('x' * 3_000_000)")
    assert r["error"]["type"] == "ValueError"
    assert "characters cut" in r["error"]["message"]
    assert r["result_bytes"] < 256 * 1024


def test_once_mode_value_and_timeout(kernel):
    r = kernel.run("print('hi')\n2 * 21", mode="once")
    assert r["stdout"] == "hi\n" and r["value"] == "42"
    r = kernel.run("import time\ntime.sleep(30)", mode="once", timeout_ms=300)
    assert r["timed_out"] and r["status"] == "interrupted"
    assert "time limit" in r["error"]["message"]


def test_once_mode_stubborn_cell_and_its_children_are_ended(kernel):
    start = time.monotonic()
    r = kernel.run("import subprocess, time\n"
                   "p = subprocess.Popen(['sleep', '988'])\n"
                   "while True:\n    try:\n        time.sleep(1)\n"
                   "    except KeyboardInterrupt:\n        pass\n", mode="once", timeout_ms=300)
    assert time.monotonic() - start < 8
    assert r["timed_out"] and "ignored the interrupt" in r["error"]["message"]
    time.sleep(0.3)
    assert subprocess.run(["pgrep", "-f", "sleep 988"]).returncode == 1, "child survived"


# --- pure functions, imported ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("esb_kernel_under_test", KERNEL)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_cell_values_are_json_safe(mod):
    assert mod.cell_value(10 ** 5000).startswith("<int of")
    assert mod.cell_value(2 ** 70) == str(2 ** 70)
    assert mod.cell_value(7) == 7 and mod.cell_value(True) is True
    assert mod.cell_value(float("nan")) is None
    assert mod.cell_value("y" * 5000) == "y" * mod.TABLE_CELL

    class Bad:
        def __str__(self):
            raise RuntimeError("no")
    assert mod.cell_value(Bad()).startswith("<unprintable Bad")


def test_a_frame_that_cannot_be_encoded_loses_only_its_table(mod):
    line = mod.encode_frame({"t": "done", "status": "ok", "value": "1",
                             "table": {"rows": [[10 ** 5000]]}})
    msg = json.loads(line)
    assert msg["status"] == "ok" and msg["value"] == "1" and msg["table"] is None


def test_a_failure_of_the_kernel_itself_reaches_its_own_stderr(kernel, tmp_path):
    # A result path in a directory that does not exist: finish() cannot write it.
    cell = kernel.dir / "cell-x.py"
    cell.write_text("print('hi')")
    proc = subprocess.run(
        [sys.executable, str(KERNEL), "once", str(cell),
         str(tmp_path / "no-such-dir" / "result-x.json"), "5000", "png"],
        capture_output=True, env=kernel.env, timeout=30)
    assert proc.returncode == 1
    assert b"FileNotFoundError" in proc.stderr, proc.stderr


def test_an_interrupt_sent_with_the_request_interrupts_that_cell(kernel):
    import socket
    kernel.run("x = 1")  # starts the kernel
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0esb-kernel:" + str(kernel.dir))
    # Both lines in one write, so the kernel reads them together (a client whose deadline
    # passed before the kernel read its request).
    s.sendall(b'{"code": "import time\\ntime.sleep(20)"}\n{"t": "interrupt"}\n')
    start, buf = time.monotonic(), b""
    s.settimeout(10)
    while b'"t": "done"' not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    s.close()
    assert time.monotonic() - start < 5
    done = json.loads(buf.strip().splitlines()[-1])
    assert done["status"] == "interrupted", done
    assert kernel.run("x")["value"] == "1"


def test_variables_summary_after_each_cell_and_frame_locals_on_error(kernel):
    """Time travel: with ESB_KERNEL_VARIABLES=1 (what esbd sets for session cells) each result
    carries the bounded summary of the namespace (esb_vars.py), and after an error the locals
    of the failing frames; without it, nothing is computed."""
    assert "variables" not in kernel.run("a = 1")
    kernel.env["ESB_KERNEL_VARIABLES"] = "1"
    r = kernel.run("b = [1, 2, 3]\nclass C:\n    def __repr__(self): raise SystemExit\nc = C()")
    assert r["status"] == "ok"
    v = {e["name"]: e for e in json.loads(r["variables"])}
    assert v["a"]["repr"] == "1" and v["b"]["repr"] == "[1, 2, 3]" and v["b"]["len"] == 3
    assert v["c"]["repr"].endswith("C object>")  # its __repr__ (which would exit) never ran
    r = kernel.run("def f(x):\n    local_y = x * 2\n    return 1 / 0\nf(21)")
    assert r["status"] == "error" and r["error"]["type"] == "ZeroDivisionError"
    entries = json.loads(r["variables"])
    assert len(r["variables"].encode()) <= 64 * 1024
    frame = [e for e in entries if e.get("frame", "").startswith("f (")]
    assert {e["name"]: e["repr"] for e in frame} == {"x": "21", "local_y": "42"}
    assert {e["name"] for e in entries if "frame" not in e} >= {"a", "b", "c", "f"}


def test_reset_kills_the_kernel_and_the_next_cell_starts_fresh(kernel):
    assert kernel.run("x = 5")["status"] == "ok"
    pids = kernel.server_pids()
    assert pids
    r = subprocess.run([sys.executable, str(KERNEL), "reset"], env=kernel.env, timeout=20)
    assert r.returncode == 0
    deadline = time.time() + 5
    while time.time() < deadline and set(kernel.server_pids()) & set(pids):
        time.sleep(0.05)
    assert not set(kernel.server_pids()) & set(pids)
    r = kernel.run("'x' in globals()")
    assert r["value"] == "False" and r["kernel_restarted"]
