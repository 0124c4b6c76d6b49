"""End-to-end tests against a REAL esbd.

Select the daemon with ``AGENTBOX_E2E_URL`` (e.g. http://127.0.0.1:8080) and, if it has keys,
``AGENTBOX_E2E_API_KEY``. ``AGENTBOX_E2E_API_KEY_2`` (a key of another tenant) enables the
tenant-isolation case. Without ``AGENTBOX_E2E_URL`` every case here is skipped, and the
reason is printed in the header and the summary.

Run: ``AGENTBOX_E2E_URL=http://127.0.0.1:8080 /usr/bin/python3 -m pytest sdk/python/tests -rs``
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time

import pytest

from conftest import E2E_SKIP_REASON, E2E_URL
from agentbox import (AsyncSandbox, AuthError, CommandExitError, Conflict, DaemonUnreachable,
                      InvalidArgument, Sandbox, SandboxConfig, SandboxError, SandboxNotFound,
                      tools)
from agentbox.workflow import ScriptedPlanner, run_workflow

if not E2E_URL:  # one clear line instead of 44 identical ones
    pytest.skip(E2E_SKIP_REASON, allow_module_level=True)

KEY = os.environ.get("AGENTBOX_E2E_API_KEY") or None
KEY2 = os.environ.get("AGENTBOX_E2E_API_KEY_2") or None


@pytest.fixture
def box() -> Sandbox:
    return Sandbox(url=E2E_URL, api_key=KEY, request_timeout=60)


@pytest.fixture
def env(box):
    with box.create(ttl_seconds=600) as e:
        yield e


def _state(box: Sandbox, env_id: str) -> str:
    return str(box._transport.json("GET", f"/environments/{env_id}").get("state"))


# -- service -----------------------------------------------------------------------------
def test_healthz(box):
    h = box.health()
    assert h["status"] == "ok" and "drivers" in h


# -- Sandbox.run (seed 002 §5) -------------------------------------------------------------
def test_run_seed_example(box):
    code = 'import json\ndata = {"status": "ok"}\nprint(json.dumps(data))\n'
    r = box.run(code)
    assert r.stdout == '{"status": "ok"}\n' and r.exit_code == 0 and not r.error


def test_run_stdout_and_stderr(box):
    r = box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert r.stdout == "out\n" and "err" in r.stderr and r.exit_code == 0


def test_run_exception_is_structured(box):
    r = box.run("def f():\n    return 1/0\nf()")
    assert r.error and r.exit_code != 0
    assert r.exception is not None and r.exception.name == "ZeroDivisionError"


def test_run_timeout(box):
    t0 = time.monotonic()
    r = box.run("while True:\n    pass", config=SandboxConfig(timeout_ms=2000))
    assert r.timed_out or r.exit_code == 124
    assert time.monotonic() - t0 < 30


def test_run_leaves_no_environment_behind(box):
    before = {e["environment_id"] for e in box.list()}
    box.run("print(1)")
    after = {e["environment_id"] for e in box.list()}
    assert after <= before


# -- lifecycle -----------------------------------------------------------------------------
def test_create_info_list_delete(box):
    env = box.create(memory_mb=256, ttl_seconds=120)
    try:
        info = env.info()
        assert info["state"] == "running" and info["limits"]["memory_mb"] == 256
        assert env.id in [e["environment_id"] for e in box.list()]
    finally:
        assert env.kill() is True
    assert _state(box, env.id) == "destroyed"
    assert env.id not in [e["environment_id"] for e in box.list()]
    assert env.kill() is True  # DELETE is idempotent for our own environment


def test_context_manager_deletes_on_exception(box):
    with pytest.raises(RuntimeError):
        with box.create(ttl_seconds=120) as env:
            raise RuntimeError("boom")
    assert _state(box, env.id) == "destroyed"


def test_bad_create_options(box):
    with pytest.raises(InvalidArgument) as info:
        box.create(memory_mb=1)
    assert info.value.status == 400 and info.value.message
    with pytest.raises(InvalidArgument):
        box.create(runtime="no-such-runtime")


def test_heartbeat_extends_lease(env):
    first = env.info()["expires_at"]
    time.sleep(1.1)
    new = env.heartbeat(900)
    assert new > first


def test_keep_alive_thread(box):
    with box.create(ttl_seconds=30, keep_alive=0.5) as env:
        first = env.info()["expires_at"]
        time.sleep(2.5)
        assert env.info()["expires_at"] > first and env.keep_alive_error is None


def test_ttl_expiry_destroys_environment(box):
    env = box.create(ttl_seconds=10)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and env.is_running():
        time.sleep(2)
    data = box._transport.json("GET", f"/environments/{env.id}")
    assert data["state"] == "destroyed" and data["destroy_reason"] == "ttl_expired"


# -- commands ------------------------------------------------------------------------------
def test_stateful_cd_and_export(env):
    env.commands.run("mkdir -p a/b && cd a/b && export FOO=bar && X=1")
    r = env.commands.run('pwd; echo "$FOO $X"')
    assert r.stdout == "/workspace/a/b\nbar 1\n"


def test_stateful_functions(env):
    env.commands.run('greet() { echo "hi $1"; }')
    assert env.commands.run("greet you").stdout == "hi you\n"


def test_runs_as_appuser_in_workspace(env):
    r = env.commands.run("id -un; pwd")
    assert r.stdout == "appuser\n/workspace\n"


def test_exit_code_and_error_flag(env):
    r = env.commands.run("echo bad >&2; exit 7")
    assert (r.exit_code, r.error, r.stderr) == (7, True, "bad\n")
    with pytest.raises(CommandExitError) as info:
        env.commands.run("false", check=True)
    assert info.value.exit_code == 1


def test_command_timeout_and_session_survives(env):
    env.commands.run("cd /tmp")
    t0 = time.monotonic()
    r = env.commands.run("sleep 60", timeout=2)
    assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 20
    assert env.commands.run("echo alive; pwd").stdout == "alive\n/tmp\n"


def test_timeout_kills_background_children(env):
    r = env.commands.run("sleep 300 & echo $! > bg.pid; sleep 300", timeout=1)
    assert r.timed_out
    time.sleep(1.0)
    # gone, or at worst a zombie waiting to be reaped (state Z): it must not be running
    check = env.commands.run(
        "p=$(cat bg.pid); s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -c1); "
        'if [ -z "$s" ] || [ "$s" = Z ]; then echo gone; else echo "alive $s"; fi')
    assert check.stdout == "gone\n"


def test_per_command_and_environment_envs(box):
    with box.create(envs={"BASE": "b"}, ttl_seconds=120) as env:
        assert env.commands.run("echo $BASE-$ONE", envs={"ONE": "1"}).stdout == "b-1\n"


def test_output_cap_truncates(env):
    r = env.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
    assert r.truncated and 0 < len(r.stdout) < 3000000 and r.exit_code == 0


# -- streaming -----------------------------------------------------------------------------
def test_streaming_order_and_content(env):
    out, err = [], []
    r = env.commands.run("for i in 1 2 3 4 5; do echo o$i; echo e$i >&2; sleep 0.1; done",
                         on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "o1\no2\no3\no4\no5\n" == r.stdout
    assert "".join(err) == "e1\ne2\ne3\ne4\ne5\n" == r.stderr
    assert len(out) >= 2


def test_streaming_is_live(env):
    stamps = []
    t0 = time.monotonic()
    env.commands.run("echo first; sleep 2; echo second",
                     on_stdout=lambda c: stamps.append((c, time.monotonic() - t0)))
    assert stamps[0][0].startswith("first") and stamps[0][1] < 1.8


def test_streaming_binary_output(env):
    got = []
    r = env.commands.run("printf 'ok\\xff\\n'", on_stdout=got.append)
    assert "".join(got) == "ok\ufffd\n" and r.exit_code == 0


def test_streaming_timeout_result(env):
    got = []
    r = env.commands.run("echo start; sleep 60", timeout=1, on_stdout=got.append)
    assert r.timed_out and "".join(got).startswith("start")


def test_cancel_kills_a_command_that_writes_output(env):
    from agentbox import CancelToken, Cancelled
    import threading
    token = CancelToken()
    threading.Timer(0.5, token.cancel).start()
    with pytest.raises(Cancelled):
        env.commands.run("for i in $(seq 30); do echo $i; sleep 0.1; done; touch marker",
                         cancel=token)
    time.sleep(3.5)
    assert not env.files.exists("marker")


def test_cancel_kills_the_command(env):
    """api.md: "If the client disconnects, the command is killed" — also a silent one."""
    from agentbox import CancelToken, Cancelled
    import threading
    token = CancelToken()
    threading.Timer(0.5, token.cancel).start()
    with pytest.raises(Cancelled):
        env.commands.run("sleep 3; touch marker", cancel=token)
    time.sleep(4)
    assert not env.files.exists("marker")
    assert env.commands.run("echo ok").stdout == "ok\n"


# -- files ---------------------------------------------------------------------------------
def test_files_text_round_trip(env):
    text = "héllo wörld ✓\nline 2\n"
    assert env.files.write("src/main.py", text).bytes == len(text.encode())
    assert env.files.read("src/main.py") == text
    assert env.commands.run("cat src/main.py").stdout == text


def test_files_binary_round_trip(env):
    blob = bytes(range(256)) * 64
    env.files.write("bin/blob", blob)
    assert env.files.read("bin/blob", format="bytes") == blob
    raw = env._transport.json("GET", f"/environments/{env.id}/files/read",
                              query={"path": "bin/blob"})
    assert raw["encoding"] == "base64" and base64.b64decode(raw["content"]) == blob
    assert env.commands.run("sha256sum bin/blob | cut -c1-8").exit_code == 0


def test_files_large_upload_download(env, tmp_path):
    data = os.urandom(20 * 1024 * 1024)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    assert env.files.upload("big/big.bin", src).bytes == len(data)
    dest = tmp_path / "back.bin"
    assert env.files.download("big/big.bin", dest) == len(data)
    assert dest.read_bytes() == data
    assert env.files.read("big/big.bin", format="bytes") == data  # 413 → raw fallback
    assert env.commands.run("stat -c %s big/big.bin").stdout.strip() == str(len(data))


def test_files_write_large_bytes_uses_raw(env):
    data = os.urandom(9 * 1024 * 1024)
    assert env.files.write("w.bin", data).bytes == len(data)
    assert env.files.download("w.bin") == data


def test_files_upload_file_object(env):
    assert env.files.upload("obj.txt", io.BytesIO(b"from a file object")).bytes == 18
    buf = io.BytesIO()
    env.files.download("obj.txt", buf)
    assert buf.getvalue() == b"from a file object"


def test_files_list(env):
    env.files.write("d/a.txt", "abc")
    env.commands.run("mkdir -p d/sub && ln -sf a.txt d/link")
    entries = {e.name: e for e in env.files.list("d")}
    assert entries["a.txt"].type == "file" and entries["a.txt"].size == 3
    assert entries["sub"].type == "dir" and entries["link"].type == "symlink"
    assert env.files.exists("d/a.txt") and not env.files.exists("d/none")


def test_files_make_dir_rename_remove(env):
    env.commands.run("mkdir -p elsewhere && cd elsewhere")
    env.files.make_dir("x/y")
    env.files.write("x/y/f.txt", "1")
    env.files.rename("x/y/f.txt", "x/g.txt")
    assert env.files.read("x/g.txt") == "1" and not env.files.exists("x/y/f.txt")
    env.files.remove("x")
    assert not env.files.exists("x")
    assert env.commands.run("pwd").stdout == "/workspace/elsewhere\n"


def test_files_stat_conflicts_and_typed_errors(env):
    assert env.files.make_dir("m/n") is True and env.files.make_dir("m/n") is False
    env.files.write("m/f.txt", "abc")
    info = env.files.stat("m/f.txt")
    assert (info.type, info.size, info.name) == ("file", 3, "f.txt")
    assert env.files.stat("m/n").type == "dir"
    with pytest.raises(SandboxNotFound):
        env.files.stat("m/none")
    with pytest.raises(Conflict):
        env.files.make_dir("m/f.txt")
    env.files.write("m/g.txt", "g")
    with pytest.raises(Conflict):
        env.files.rename("m/f.txt", "m/g.txt")
    env.files.rename("m/f.txt", "m/g.txt", overwrite=True)
    assert env.files.read("m/g.txt") == "abc"
    with pytest.raises(Conflict):
        env.files.remove("m", recursive=False)
    with pytest.raises(InvalidArgument):
        env.files.make_dir("../escape")
    with pytest.raises(InvalidArgument):
        env.files.rename("m/g.txt", "/etc/g.txt")
    env.files.remove("m")
    with pytest.raises(SandboxNotFound):
        env.files.remove("m")


def test_files_symlink_to_etc_is_removed_and_renamed_as_a_link(env):
    env.commands.run("ln -sfn /etc etclink")
    with pytest.raises(InvalidArgument):
        env.files.make_dir("etclink/esb-sdk-test")  # a symlinked parent is never followed
    env.files.rename("etclink", "moved")
    assert env.commands.run("readlink moved").stdout == "/etc\n"
    env.files.remove("moved")
    assert env.commands.run("test -L moved || echo gone; test -f /etc/passwd && echo kept"
                            ).stdout == "gone\nkept\n"


def test_files_missing(env):
    with pytest.raises(SandboxNotFound) as info:
        env.files.read("no/such/file.txt")
    assert info.value.status == 404 and info.value.message


def test_files_read_only_rootfs_and_special_files(env, box):
    with pytest.raises(SandboxError) as info:
        env.files.write("/etc/agentbox-e2e", "x")
    assert info.value.status is not None and 400 <= info.value.status < 500
    env.commands.run("mkfifo pipe")
    with pytest.raises(InvalidArgument):
        env.files.read("pipe")
    assert box.health()["status"] == "ok"


def test_files_created_by_commands_are_readable(env):
    env.commands.run("python3 -c \"open('gen.txt','w').write('generated')\"")
    assert env.files.read("gen.txt") == "generated"


# -- errors --------------------------------------------------------------------------------
def test_deleted_environment(box):
    env = box.create(ttl_seconds=120)
    env.kill()
    with pytest.raises(SandboxNotFound):
        env.commands.run("true")
    with pytest.raises(SandboxNotFound):
        env.files.write("a", "b")
    with pytest.raises(SandboxNotFound):
        env.heartbeat()
    with pytest.raises(SandboxNotFound):
        box.connect(env.id)


def test_unknown_environment(box):
    with pytest.raises(SandboxNotFound):
        box.connect("env_00000000000000000000")
    from agentbox import Environment
    assert Environment(box._transport, "env_00000000000000000000").kill() is False


def test_bad_credentials():
    if not KEY:
        pytest.skip("AGENTBOX_E2E_API_KEY is not set: the daemon runs in dev mode without "
                    "keys, so bad credentials cannot be rejected")
    with pytest.raises(AuthError) as info:
        Sandbox(url=E2E_URL, api_key="definitely-wrong-key").create()
    assert info.value.status == 401
    with pytest.raises(AuthError):
        Sandbox(url=E2E_URL, api_key="").create()


def test_other_tenant_sees_404(env):
    if not KEY2:
        pytest.skip("AGENTBOX_E2E_API_KEY_2 (a second tenant's key) is not set")
    other = Sandbox(url=E2E_URL, api_key=KEY2)
    with pytest.raises(SandboxNotFound):
        other.connect(env.id)
    assert env.id not in [e["environment_id"] for e in other.list()]


# -- heavy-tier notebook features: artifacts, tables, streaming cells ---------------------
_FIGURE = ("import matplotlib.pyplot as plt\n"
           "plt.plot([1, 2, 3], [3, 1, 2])\n"
           "plt.title('e2e figure')\n"
           "plt.show()\n")


def test_run_captures_a_figure_as_an_artifact(box, tmp_path):
    r = box.run(_FIGURE, config=SandboxConfig(runtime="auto"))
    assert r.ok, r.stderr
    assert r.runtime == "heavy"
    assert [a.mime_type for a in r.artifacts] == ["image/png"]
    art = r.artifacts[0]
    assert art.title == "e2e figure" and art.kind == "image"
    data = box.download_artifact(art)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) == art.size
    saved = box.save_artifact(art, tmp_path)
    assert saved == art.size
    assert (tmp_path / art.name).read_bytes() == data


def test_run_auto_routes_by_imports_and_says_why(box):
    logic = box.run("import json, re\nprint(json.dumps(re.findall(r'\\d', 'a1b2')))")
    assert logic.ok and logic.stdout == '["1", "2"]\n', logic.stderr
    assert logic.runtime == "nano" and "json" in (logic.reason or ""), logic.reason
    frame = box.run("import pandas as pd\nprint(int(pd.Series([1, 2, 3]).sum()))")
    assert frame.ok and frame.stdout == "6\n", frame.stderr
    assert frame.runtime == "heavy" and "pandas" in (frame.reason or ""), frame.reason


def test_nano_session_is_stateful(box):
    with box.create(runtime="nano", ttl_seconds=300) as e:
        assert e.run_code("import math\nx = 41").ok
        r = e.run_code("x += 1\nprint(x, math.isqrt(x * x))")
        assert r.ok and r.stdout == "42 42\n", r.stderr
        assert r.runtime == "nano"


def test_stateful_cells_table_and_live_output(box):
    with box.create(runtime="container", ttl_seconds=300) as e:
        assert e.run_code("import pandas as pd\nrows = [1, 2, 3]").ok
        chunks = []
        r = e.run_code("for i in rows:\n    print('row', i, flush=True)\n"
                       "pd.DataFrame({'v': rows, 'sq': [i * i for i in rows]})",
                       on_stdout=chunks.append)
        assert r.ok, r.stderr
        assert "".join(chunks) == "row 1\nrow 2\nrow 3\n"
        assert r.table is not None
        assert r.table.columns == ["v", "sq"]
        assert r.table.rows == [[1, 1], [2, 4], [3, 9]]
        assert r.table.to_records()[2] == {"v": 3, "sq": 9}
        r = e.run_code("open('/workspace/artifacts/out.txt', 'w').write('hello')")
        assert [a.name for a in r.artifacts] == ["out.txt"]
        assert e.artifacts.get(r.artifacts[0]) == b"hello"
        assert [a.id for a in e.artifacts.list()] == [r.artifacts[0].id]


def test_other_tenant_cannot_read_artifacts(box):
    if not KEY2:
        pytest.skip("AGENTBOX_E2E_API_KEY_2 (a second tenant's key) is not set")
    r = box.run("open('/workspace/artifacts/secret.txt', 'w').write('s3cret')",
                config=SandboxConfig(runtime="heavy"))
    assert [a.name for a in r.artifacts] == ["secret.txt"]
    other = Sandbox(url=E2E_URL, api_key=KEY2)
    with pytest.raises(SandboxNotFound):
        other.download_artifact(r.artifacts[0])


def test_daemon_down(dead_url):
    with pytest.raises(DaemonUnreachable) as info:
        Sandbox(url=dead_url).create()
    assert dead_url in str(info.value)


def test_audit_records_commands(box, env):
    env.commands.run("echo e2e-audit-marker")
    rows = box.audit(environment_id=env.id, limit=100)
    assert any(r["action"] == "execute" and "e2e-audit-marker" in r["detail"] for r in rows)


def test_permission_denied_outside_workspace(env):
    with pytest.raises(SandboxError) as info:  # 403 (EACCES) or 400: a 4xx either way
        env.files.write("/etc/passwd", "x")
    assert info.value.status is not None and 400 <= info.value.status < 500, info.value
    assert "root:" in env.files.read("/etc/passwd")  # readable: it is the sandbox's own file


# -- meta-tools and executor --------------------------------------------------------------
def test_tools_dispatch_shapes(env):
    assert tools.dispatch(env, "environment.write_file",
                          {"path": "src/main.py", "content": "print(6*7)"}) == \
        {"error": False, "message": "File saved successfully."}
    assert tools.dispatch(env, "environment_execute_command",
                          '{"command": "python3 src/main.py", "timeout_seconds": 30}') == \
        {"error": False, "stdout": "42\n", "stderr": "", "exit_code": 0}
    assert tools.dispatch(env, "environment.read_file", {"path": "src/main.py"}) == \
        {"error": False, "content": "print(6*7)"}
    missing = tools.dispatch(env, "environment.read_file", {"path": "nope"})
    assert missing["error"] is True and missing["content"]


def test_daemon_tool_catalogue_matches(box):
    served = box.tools()
    assert served["tools"] == tools.TOOLS, "daemon and SDK must describe the same meta-tools"
    # Both derive the vendor formats from sdk/tools.json by the same rule.
    assert served["openai"] == tools.openai_tools()
    assert served["anthropic"] == tools.anthropic_tools()
    # ... and the MCP server's view of the whole catalogue.
    assert served["mcp"] == tools.mcp_tools()


def test_workflow_approves_and_deprovisions(box):
    ids = []
    planner = ScriptedPlanner([
        ("environment.execute_command", {"command": "git --version"}),
        ("environment.write_file", {"path": "repo/script.py", "content": "print('done')"}),
        ("environment.execute_command", {"command": "python3 repo/script.py"}),
    ])
    report = run_workflow("e2e", planner, sandbox=box,
                          on_provisioned=lambda e: ids.append(e.id))
    assert report.approved and report.final_output["stdout"] == "done\n"
    assert report.deprovisioned and _state(box, ids[0]) == "destroyed"


def test_workflow_failure_names_step_and_cleans_up(box):
    planner = ScriptedPlanner([("execute_command", {"command": "true"}),
                               ("execute_command", {"command": "ls /nonexistent"})])
    report = run_workflow("e2e", planner, sandbox=box)
    assert not report.approved and report.review.failed_step == 2
    assert "step 2" in report.review.feedback
    assert _state(box, report.environment_id) == "destroyed"


def test_workflow_cleanup_when_planner_raises(box):
    ids = []

    def planner(request):
        raise RuntimeError("planner crashed")
    with pytest.raises(RuntimeError):
        run_workflow("e2e", planner, sandbox=box, on_provisioned=lambda e: ids.append(e.id))
    assert _state(box, ids[0]) == "destroyed"


# -- asyncio -------------------------------------------------------------------------------
def test_async_streaming_and_concurrency():
    async def main():
        box = AsyncSandbox(url=E2E_URL, api_key=KEY)
        chunks = []

        async def on_out(c):
            chunks.append(c)
        envs = await asyncio.gather(*(box.create(ttl_seconds=120) for _ in range(3)))
        try:
            rs = await asyncio.gather(*(e.commands.run(f"echo {i}; sleep 0.2; echo {i}",
                                                       on_stdout=on_out)
                                        for i, e in enumerate(envs)))
            assert [r.stdout for r in rs] == ["0\n0\n", "1\n1\n", "2\n2\n"]
            assert sorted("".join(chunks)) == sorted("0\n0\n1\n1\n2\n2\n")
            r = await box.run("print('async')")
            assert r.stdout == "async\n"
        finally:
            for e in envs:
                await e.close()
    asyncio.run(main())
