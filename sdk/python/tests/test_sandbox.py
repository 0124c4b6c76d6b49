"""Fast tests of the synchronous client against the fake esbd."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from agentbox import (AuthError, CommandExitError, CommandTimeout, Conflict, DaemonUnreachable,
                      InvalidArgument, Sandbox, SandboxConfig, SandboxError, SandboxNotFound,
                      SandboxTimeout)
from agentbox._http import parse_sse
from agentbox.errors import RateLimited, error_from_response


def test_run_falls_back_to_an_environment_without_post_run(fake):
    box = Sandbox(url=fake.url)
    result = box.run('import json\nprint(json.dumps({"status": "ok"}))')
    assert result.stdout == '{"status": "ok"}\n'
    assert result.exit_code == 0 and not result.error and result.ok
    assert result.via == "environment"
    assert fake.live() == []  # the fallback environment was deleted
    assert ("POST", "/run") in fake.requests
    # the decision is cached: a second run does not probe /run again
    box.run("print(2)")
    assert fake.requests.count(("POST", "/run")) == 1


def test_run_falls_back_when_run_tier_is_unavailable():
    from fake_esbd import FakeEsbd
    fake = FakeEsbd(run_endpoint="unavailable").start()
    try:
        result = Sandbox(url=fake.url).run("print('fallback')")
        assert result.stdout == "fallback\n" and result.via == "environment"
        assert fake.live() == []
        # an explicit nano request is not silently moved to another tier
        with pytest.raises(InvalidArgument) as info:
            Sandbox(SandboxConfig(runtime="nano"), url=fake.url).run("print(1)")
        assert info.value.code == "tier_unavailable"
    finally:
        fake.stop()


def test_run_does_not_fall_back_on_text_that_only_sounds_unavailable():
    # The fallback follows the machine code, never the message: a plain 400 that says "not
    # available" is the caller's error and is raised.
    from fake_esbd import FakeEsbd
    fake = FakeEsbd(run_endpoint="unavailable_text").start()
    try:
        with pytest.raises(InvalidArgument) as info:
            Sandbox(url=fake.url).run("print('x')")
        assert info.value.code == "bad_request"
        assert fake.create_bodies == [] and fake.live() == []
    finally:
        fake.stop()


def test_run_fallback_reports_python_exception(fake):
    result = Sandbox(url=fake.url).run("1/0")
    assert result.exit_code == 1 and result.error
    assert result.exception is not None and result.exception.name == "ZeroDivisionError"
    assert "division by zero" in result.exception.value
    assert fake.live() == []


def test_run_fallback_timeout(fake):
    result = Sandbox(SandboxConfig(timeout_ms=1000), url=fake.url).run(
        "import time\nprint('x', flush=True)\ntime.sleep(30)")
    assert result.timed_out and result.exit_code == 124
    assert fake.live() == []


def test_run_fallback_maps_memory_and_ttl(fake):
    Sandbox(SandboxConfig(memory_limit_mb=64, timeout_ms=5000), url=fake.url).run("pass")
    body = fake.create_bodies[-1]
    assert body["memory_mb"] == 64 and body["ttl_seconds"] >= 60 and "runtime" not in body


def test_run_fallback_missing_package(fake):
    result = Sandbox(SandboxConfig(packages=["surely-not-installed-pkg-xyz"]),
                     url=fake.url).run("print(1)")
    assert result.error and "surely-not-installed-pkg-xyz" in result.stderr
    assert fake.live() == []


def test_run_uses_post_run_when_available(fake_run):
    box = Sandbox(SandboxConfig(runtime="nano", timeout_ms=5000, memory_limit_mb=64),
                  url=fake_run.url)
    result = box.run("print('hi')")
    assert result.stdout == "hi\n" and result.via == "run" and result.runtime == "nano"
    assert fake_run.run_bodies[-1] == {"code": "print('hi')", "runtime": "nano",
                                       "timeout_ms": 5000, "memory_limit_mb": 64}
    assert not any(p == "/environments" for _, p in fake_run.requests)


def test_run_post_run_structured_error(fake_run):
    result = Sandbox(url=fake_run.url).run("raise ValueError('bad')")
    assert result.error and result.exception is not None
    assert result.exception.name == "ValueError" and result.exception.value == "bad"


def test_sandbox_config_validation():
    with pytest.raises(InvalidArgument):
        SandboxConfig(runtime="fast")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SandboxConfig(timeout_ms=0)
    with pytest.raises(InvalidArgument):
        SandboxConfig(packages="pandas")  # type: ignore[arg-type]


def test_env_vars_select_url_and_key(fake_auth, monkeypatch):
    monkeypatch.setenv("AGENTBOX_URL", fake_auth.url)
    monkeypatch.setenv("AGENTBOX_API_KEY", "key-a")
    with Sandbox.create() as env:
        assert env.commands.run("echo ok").stdout == "ok\n"
    assert Sandbox().url == fake_auth.url


def test_default_url():
    assert Sandbox().url == "http://127.0.0.1:8080"


def test_stateful_commands(fake):
    with Sandbox.create(url=fake.url) as env:
        env.commands.run("mkdir -p sub && cd sub && export GREETING=hello && COUNT=3")
        env.commands.run("twice() { echo \"$1$1\"; }")
        r = env.commands.run('pwd; echo "$GREETING $COUNT"; twice ab')
        assert r.stdout.splitlines()[1:] == ["hello 3", "abab"]
        assert r.stdout.splitlines()[0].endswith("/sub")


def test_command_exit_code_and_check(fake):
    with Sandbox.create(url=fake.url) as env:
        r = env.commands.run("echo oops >&2; exit 3")
        assert (r.exit_code, r.error, r.stderr) == (3, True, "oops\n")
        with pytest.raises(CommandExitError) as info:
            env.commands.run("exit 5", check=True)
        assert info.value.exit_code == 5


def test_command_timeout(fake):
    with Sandbox.create(url=fake.url) as env:
        t0 = time.monotonic()
        r = env.commands.run("sleep 30", timeout=1)
        assert r.timed_out and r.exit_code == 124
        assert time.monotonic() - t0 < 10
        with pytest.raises(CommandTimeout):
            env.commands.run("sleep 30", timeout=1, check=True)


def test_command_per_call_envs(fake):
    with Sandbox.create(url=fake.url, envs={"BASE": "b"}) as env:
        assert env.commands.run("echo $BASE-$ONE", envs={"ONE": "1"}).stdout == "b-1\n"
        assert env.commands.run("echo \"[$ONE]\"").stdout == "[]\n"


def test_streaming_callbacks_in_order(fake):
    out, err = [], []
    with Sandbox.create(url=fake.url) as env:
        r = env.commands.run("for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done",
                             on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "out1\nout2\nout3\n" == r.stdout
    assert "".join(err) == "err1\nerr2\nerr3\n" == r.stderr
    assert len(out) >= 2  # chunks really arrived separately


def test_streaming_arrives_before_command_ends(fake):
    seen = []
    with Sandbox.create(url=fake.url) as env:
        def on_out(chunk):
            seen.append((chunk, time.monotonic()))
        t0 = time.monotonic()
        env.commands.run("echo first; sleep 1; echo second", on_stdout=on_out)
    assert seen[0][0] == "first\n" and seen[0][1] - t0 < 0.9


def test_streaming_non_utf8_is_reassembled(fake):
    got = []
    with Sandbox.create(url=fake.url) as env:
        # 'é' split over two writes, plus an invalid byte
        env.commands.run(r"printf '\xc3'; sleep 0.1; printf '\xa9\xff\n'", on_stdout=got.append)
    assert "".join(got) == "é\ufffd\n"


def test_files_text_and_binary_round_trip(fake):
    blob = bytes(range(256)) * 10
    with Sandbox.create(url=fake.url) as env:
        assert env.files.write("src/main.py", "print('héllo')\n").bytes == 16
        assert env.files.read("src/main.py") == "print('héllo')\n"
        env.files.write("/workspace/bin/blob", blob)
        assert env.files.read("bin/blob", format="bytes") == blob
        assert env.commands.run("python3 src/main.py").stdout == "héllo\n"
        assert env.files.exists("src/main.py") and not env.files.exists("nope.txt")


def test_files_large_write_uses_raw(fake, monkeypatch):
    import agentbox.sandbox as sb
    monkeypatch.setattr(sb, "RAW_WRITE_THRESHOLD", 1000)
    data = os.urandom(5000)
    with Sandbox.create(url=fake.url) as env:
        assert env.files.write("big.bin", data).bytes == 5000
        assert ("PUT", f"/environments/{env.id}/files/raw") in fake.requests
        assert env.files.read("big.bin", format="bytes") == data


def test_files_read_too_large_falls_back_to_raw(fake):
    fake.read_limit = 100
    with Sandbox.create(url=fake.url) as env:
        env.files.write("x.txt", "y" * 500)
        assert env.files.read("x.txt") == "y" * 500
        assert ("GET", f"/environments/{env.id}/files/raw") in fake.requests


def test_files_upload_download_streams(fake, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(300_000))
    with Sandbox.create(url=fake.url) as env:
        assert env.files.upload("data/in.bin", src).bytes == 300_000
        assert env.files.upload("data/obj.bin", io.BytesIO(b"abc")).bytes == 3

        class Pipe(io.RawIOBase):  # not seekable: sent chunked
            def __init__(self):
                self.left = [b"x" * 70000, b"y" * 10]

            def readable(self):
                return True

            def read(self, n=-1):
                return self.left.pop(0) if self.left else b""

        assert env.files.upload("data/pipe.bin", Pipe()).bytes == 70010
        dest = tmp_path / "out.bin"
        assert env.files.download("data/in.bin", dest) == 300_000
        assert dest.read_bytes() == src.read_bytes()
        buf = io.BytesIO()
        env.files.download("data/obj.bin", buf)
        assert buf.getvalue() == b"abc" == env.files.download("data/obj.bin")


def test_files_list(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("d/a.txt", "abc")
        env.commands.run("mkdir -p d/sub")
        entries = {e.name: e for e in env.files.list("d")}
        assert entries["a.txt"].type == "file" and entries["a.txt"].size == 3
        assert entries["sub"].type == "dir"
        assert entries["a.txt"].path == "/workspace/d/a.txt"


def test_files_errors(fake):
    with Sandbox.create(url=fake.url) as env:
        with pytest.raises(SandboxNotFound) as info:
            env.files.read("missing.txt")
        assert "missing.txt" in info.value.message and info.value.status == 404
        with pytest.raises(InvalidArgument) as bad:
            env.files.write("../../etc/x", "no")
        assert "escapes" in str(bad.value)
        with pytest.raises(InvalidArgument):
            env.files.read("x", format="json")  # type: ignore[call-overload]
        with pytest.raises(InvalidArgument):
            env.files.write("x", 123)  # type: ignore[arg-type]


def test_context_manager_always_deletes(fake):
    with pytest.raises(RuntimeError):
        with Sandbox.create(url=fake.url) as env:
            raise RuntimeError("boom")
    assert fake.envs[env.id].destroyed_at is not None
    assert env.closed
    env.close()  # idempotent


def test_kill_and_deleted_env(fake):
    env = Sandbox.create(url=fake.url)
    assert env.is_running()
    assert env.kill() is True
    assert not env.is_running()
    with pytest.raises(SandboxNotFound):
        env.commands.run("true")
    with pytest.raises(SandboxNotFound):
        Sandbox(url=fake.url).connect(env.id)


def test_unknown_env(fake):
    box = Sandbox(url=fake.url)
    with pytest.raises(SandboxNotFound):
        box.connect("env_doesnotexist")
    from agentbox import Environment
    ghost = Environment(box._transport, "env_doesnotexist")
    assert ghost.kill() is False
    with pytest.raises(SandboxNotFound):
        ghost.files.read("x")


def test_ids_cannot_escape_their_path_segment(fake):
    from agentbox import Environment
    ghost = Environment(Sandbox(url=fake.url)._transport, "../healthz")
    with pytest.raises(SandboxNotFound):
        ghost.info()


def test_connect_and_list(fake):
    box = Sandbox(url=fake.url)
    with box.create() as env:
        again = box.connect(env.id)
        assert again.commands.run("echo hi").stdout == "hi\n"
        assert env.id in [e["environment_id"] for e in box.list()]
    assert env.id not in [e["environment_id"] for e in box.list()]
    assert env.id in [e["environment_id"] for e in box.list(all=True)]


def test_audit(fake):
    box = Sandbox(url=fake.url)
    with box.create() as env:
        env.commands.run("echo audited-command")
        rows = box.audit(environment_id=env.id, q="audited")
    assert [r["action"] for r in rows] == ["execute"]
    assert rows[0]["detail"] == "echo audited-command"
    assert ("GET", "/audit") in fake.requests


def test_heartbeat_and_keep_alive(fake):
    with Sandbox.create(url=fake.url, ttl_seconds=60) as env:
        assert env.heartbeat(120).endswith("Z")
        assert fake.envs[env.id].heartbeats == 1
    with Sandbox.create(url=fake.url, keep_alive=0.1) as env:
        time.sleep(0.55)
        assert fake.envs[env.id].heartbeats >= 3
    n = fake.envs[env.id].heartbeats
    time.sleep(0.3)
    assert fake.envs[env.id].heartbeats == n  # thread stopped at close
    assert not any(t.name.startswith("agentbox-keepalive") for t in threading.enumerate())


def test_bad_create_options(fake):
    with pytest.raises(InvalidArgument) as info:
        Sandbox.create(url=fake.url, memory_mb=1)
    assert "memory_mb" in info.value.message and info.value.code == "bad_request"
    with pytest.raises(InvalidArgument):
        Sandbox.create(url=fake.url, runtime="microvm")


def test_auth(fake_auth):
    with pytest.raises(AuthError) as info:
        Sandbox.create(url=fake_auth.url, api_key="wrong")
    assert info.value.status == 401 and "Invalid API key" in str(info.value)
    with pytest.raises(AuthError):
        Sandbox.create(url=fake_auth.url)
    assert Sandbox(url=fake_auth.url).health()["status"] == "ok"  # healthz needs no key


def test_tenants_are_isolated(fake_auth):
    with Sandbox.create(url=fake_auth.url, api_key="key-a") as env:
        other = Sandbox(url=fake_auth.url, api_key="key-b")
        with pytest.raises(SandboxNotFound):
            other.connect(env.id)
        assert other.list() == []


def test_daemon_down_names_the_url(dead_url):
    with pytest.raises(DaemonUnreachable) as info:
        Sandbox(url=dead_url).run("print(1)")
    assert dead_url in str(info.value) and info.value.url == dead_url
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, SandboxError)
    with pytest.raises(DaemonUnreachable):
        Sandbox.create(url=dead_url)


def test_invalid_url():
    with pytest.raises(SandboxError):
        Sandbox(url="ftp://example")


def test_request_timeout_is_sandbox_timeout():
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # accepts the TCP connection but never answers
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(SandboxTimeout) as info:
            Sandbox(url=url, request_timeout=0.5).health()
        assert isinstance(info.value, TimeoutError)
    finally:
        srv.close()


def test_error_mapping():
    e = error_from_response(429, {"error": True, "code": "too_many_requests",
                                  "message": "slow down"}, retry_after="3")
    assert isinstance(e, RateLimited) and e.retry_after == 3.0 and e.message == "slow down"
    from agentbox import InsufficientStorage, PermissionDenied
    assert isinstance(error_from_response(403, {"code": "forbidden", "message": "no"}),
                      PermissionDenied)
    assert isinstance(error_from_response(507, {}), InsufficientStorage)
    e2 = error_from_response(502, "<html>bad gateway</html>", context="GET /x")
    assert e2.status == 502 and "bad gateway" in e2.message


def test_sse_parser():
    raw = (b": comment\n\nevent: stdout\ndata: {\"data\": \"a\"}\n\n"
           b"event: result\r\ndata: {\"exit_code\": 0,\r\ndata:  \"x\": 1}\r\n\r\n")
    events = list(parse_sse(io.BytesIO(raw)))
    assert [(e.event, e.data) for e in events] == [("stdout", {"data": "a"}),
                                                   ("result", {"exit_code": 0, "x": 1})]


def test_raising_callback_aborts_the_stream(fake):
    with Sandbox.create(url=fake.url) as env:
        def boom(chunk):
            raise KeyError("callback failed")
        with pytest.raises(KeyError):
            env.commands.run("echo a; sleep 5; echo b", on_stdout=boom)
        assert env.commands.run("echo still-usable").stdout == "still-usable\n"


def test_cancel_token_kills_the_command(fake):
    from agentbox import CancelToken, Cancelled
    with Sandbox.create(url=fake.url) as env:
        token = CancelToken()
        threading.Timer(0.4, token.cancel).start()
        t0 = time.monotonic()
        with pytest.raises(Cancelled):
            env.commands.run("for i in $(seq 20); do echo $i; sleep 0.1; done; touch marker",
                             cancel=token)
        assert time.monotonic() - t0 < 2
        time.sleep(2.6)
        assert not env.files.exists("marker")


def test_make_dir_rename_remove(fake):
    with Sandbox.create(url=fake.url) as env:
        env.commands.run("mkdir elsewhere && cd elsewhere")  # relative paths ignore the cwd
        assert env.files.make_dir("x/y") is True
        assert env.files.make_dir("x/y") is False  # mkdir -p: already a directory
        env.files.write("x/y/f.txt", "1")
        env.files.rename("x/y/f.txt", "x/g.txt")
        assert env.files.read("x/g.txt") == "1" and not env.files.exists("x/y/f.txt")
        env.files.remove("x")
        assert not env.files.exists("x")
        with pytest.raises(SandboxNotFound):
            env.files.rename("nope", "other")


def test_file_operations_use_the_rest_endpoints_not_the_shell(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.make_dir("d")
        env.files.write("d/a.txt", "a")
        env.files.stat("d/a.txt")
        env.files.rename("d/a.txt", "d/b.txt")
        env.files.remove("d")
        base = f"/environments/{env.id}"
        for route in ("files/mkdir", "files/rename", "files/remove"):
            assert ("POST", f"{base}/{route}") in fake.requests
        assert ("GET", f"{base}/files/stat") in fake.requests
        assert ("POST", f"{base}/execute") not in fake.requests


def test_files_stat(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("s/a.txt", "abc")
        info = env.files.stat("s/a.txt")
        assert (info.name, info.type, info.size, info.path) == ("a.txt", "file", 3, "s/a.txt")
        assert info.mode == "0644" and info.mtime.endswith("Z")
        assert env.files.stat("s").type == "dir"
        with pytest.raises(SandboxNotFound):
            env.files.stat("s/none")


def test_files_errors_are_typed_by_the_servers_code(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("f.txt", "1")
        env.files.write("g.txt", "2")
        env.files.write("d/inner.txt", "3")
        with pytest.raises(Conflict):
            env.files.make_dir("f.txt")  # a file is there
        with pytest.raises(Conflict):
            env.files.rename("f.txt", "g.txt")  # no overwrite by default
        env.files.rename("f.txt", "g.txt", overwrite=True)
        assert env.files.read("g.txt") == "1" and not env.files.exists("f.txt")
        with pytest.raises(Conflict):
            env.files.remove("d", recursive=False)  # not empty
        with pytest.raises(SandboxNotFound):
            env.files.remove("none")
        with pytest.raises(InvalidArgument):
            env.files.make_dir("../escape")
        env.files.remove("d")
        assert not env.files.exists("d")


def test_volumes_create_mount_list_and_delete(fake):
    box = Sandbox(url=fake.url)
    vol = box.create_volume("data", 64)
    assert vol["name"] == "data" and vol["size_mb"] == 64 and vol["mounted_by"] is None
    with pytest.raises(Conflict):
        box.create_volume("data", 64)
    env = box.create(volumes=[{"name": "data", "path": "/mnt/data"}])
    assert fake.create_bodies[-1]["volumes"] == [{"name": "data", "path": "/mnt/data"}]
    assert [v["mounted_by"] for v in box.list_volumes()] == [env.id]
    with pytest.raises(Conflict):
        box.delete_volume("data")  # refused while mounted
    env.kill()
    assert box.list_volumes()[0]["mounted_by"] is None
    box.delete_volume("data")
    assert box.list_volumes() == []
    with pytest.raises(SandboxNotFound):
        box.delete_volume("data")
