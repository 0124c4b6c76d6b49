"""Run artifacts, DataFrame tables, package installs and streamed runs, against the fake
esbd (tests/fake_esbd.py implements the daemon's contract for them)."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from agentbox import (Artifact, AsyncSandbox, InvalidArgument, Sandbox, SandboxConfig,
                      SandboxNotFound, SandboxResult, ServerError, Table, Unavailable)
from fake_esbd import FakeEsbd

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4

# A stand-in for a pandas DataFrame (the fake's cell runner reads columns/index/values).
FRAME = """
class DataFrame:
    columns = ["team", "pts"]
    index = [0, 1, 2]
    values = [["a", 9], ["b", 6], ["c", 7]]
    def __repr__(self):
        return "  team  pts\\n0    a    9\\n1    b    6\\n2    c    7"
DataFrame()
"""


# -- parsing ------------------------------------------------------------------------------
def test_from_run_answer_parses_new_fields_tolerantly():
    answer = {
        "stdout": "", "stderr": "", "exit_code": 0, "error": None, "tier": "heavy",
        "environment_id": "env_1",
        "artifacts": [
            {"id": "art_1", "kind": "image", "name": "figure-1.png", "mime_type": "image/png",
             "size": 12, "title": "Sales", "step": 2, "environment_id": "env_1",
             "url": "/environments/env_1/artifacts/art_1"},
            {"id": "art_2", "name": "out.csv"},      # sparse: defaults fill in
            {"kind": "file"},                          # no id: skipped
            "garbage",                                 # not an object: skipped
        ],
        "table": {"columns": ["a", "b"], "index": [0, 1], "rows": [[1, "x"], [2, "y"]],
                  "total_rows": 10, "total_columns": 2, "truncated": True},
        "value": "'done'",
        "packages": [{"name": "tabulate", "version": "0.9.0", "from_cache": True}, 3],
        "install_ms": 812,
    }
    r = SandboxResult.from_run_answer(answer, elapsed_ms=1.0)
    assert r.ok and r.runtime == "heavy"
    assert r.artifacts[0] == Artifact(id="art_1", kind="image", name="figure-1.png",
                                      mime_type="image/png", size=12, title="Sales", step=2,
                                      environment_id="env_1",
                                      url="/environments/env_1/artifacts/art_1")
    sparse = r.artifacts[1]
    assert (sparse.id, sparse.kind, sparse.name, sparse.mime_type, sparse.environment_id,
            sparse.title) == ("art_2", "file", "out.csv", "application/octet-stream", "env_1",
                              None)
    assert len(r.artifacts) == 2
    assert [a.id for a in r.images] == ["art_1"]
    assert r.table == Table(columns=["a", "b"], index=[0, 1], rows=[[1, "x"], [2, "y"]],
                            total_rows=10, total_columns=2, truncated=True)
    assert r.table.to_records() == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    assert r.value == "'done'"
    assert r.packages == [{"name": "tabulate", "version": "0.9.0", "from_cache": True}]
    assert r.install_ms == 812.0


def test_from_run_answer_without_new_fields_or_with_bad_ones():
    r = SandboxResult.from_run_answer({"stdout": "1\n", "exit_code": 0}, elapsed_ms=1.0)
    assert (r.artifacts, r.table, r.value, r.packages, r.install_ms) == ([], None, None, [],
                                                                          None)
    r = SandboxResult.from_run_answer({"exit_code": 0, "artifacts": {"id": "x"},
                                       "table": {"columns": "ab", "rows": []}, "value": 3,
                                       "packages": "pandas", "install_ms": True},
                                      elapsed_ms=1.0)
    assert (r.artifacts, r.table, r.value, r.packages, r.install_ms) == ([], None, None, [],
                                                                          None)


def test_figure_formats_validation():
    assert SandboxConfig(figure_formats=("png", "svg", "png")).figure_formats == ["png", "svg"]
    for bad in ("png", [], ["jpeg"], [1]):
        with pytest.raises(InvalidArgument, match="figure_formats"):
            SandboxConfig(figure_formats=bad)


def test_to_tool_output_lists_artifacts_and_table():
    r = SandboxResult.from_run_answer({
        "stdout": "ok\n", "exit_code": 0, "value": "df",
        "artifacts": [{"id": "art_1", "kind": "image", "name": "figure-1.png",
                       "mime_type": "image/png", "size": 3, "environment_id": "env_9",
                       "url": "/environments/env_9/artifacts/art_1"}],
        "table": {"columns": ["n"], "index": [0, 1, 2], "rows": [[1], [2], [3]],
                  "total_rows": 3, "total_columns": 1, "truncated": False}},
        elapsed_ms=1.0)
    out = r.to_tool_output(max_table_rows=2)
    assert out["error"] is False and out["stdout"] == "ok\n" and out["value"] == "df"
    assert out["table"] == {"columns": ["n"], "records": [{"n": 1}, {"n": 2}],
                            "total_rows": 3, "total_columns": 1, "truncated": True}
    assert out["artifacts"] == [{"name": "figure-1.png", "kind": "image",
                                 "mime_type": "image/png", "size": 3, "title": None,
                                 "url": "/environments/env_9/artifacts/art_1"}]


# -- one-shot runs --------------------------------------------------------------------------
def test_file_artifact_download_and_save(fake_run, tmp_path):
    box = Sandbox(url=fake_run.url)
    r = box.run("import os\nos.makedirs('/workspace/artifacts', exist_ok=True)\n"
                "open('/workspace/artifacts/out.csv', 'w').write('a,b\\n1,2\\n')\n"
                "print('wrote')")
    assert r.ok, r.stderr
    assert r.stdout == "wrote\n"
    [art] = r.artifacts
    assert (art.kind, art.name, art.mime_type, art.size, art.step) == (
        "file", "out.csv", "text/csv", 8, 1)
    assert art.id.startswith("art_") and art.environment_id.startswith("env_")
    assert art.url == f"/environments/{art.environment_id}/artifacts/{art.id}"
    # The one-shot environment is gone, the artifact is still there.
    assert box.download_artifact(art) == b"a,b\n1,2\n"
    assert box.save_artifact(art, tmp_path) == 8                       # into a directory
    assert (tmp_path / "out.csv").read_bytes() == b"a,b\n1,2\n"
    assert box.save_artifact(art, tmp_path / "copy.csv") == 8          # to a path
    assert (tmp_path / "copy.csv").read_bytes() == b"a,b\n1,2\n"
    buf = io.BytesIO()
    assert box.save_artifact(art, buf) == 8                            # to a file object
    assert buf.getvalue() == b"a,b\n1,2\n"
    # A plain mapping from the raw answer works too.
    assert box.download_artifact(r.raw["artifacts"][0]) == b"a,b\n1,2\n"


def test_save_artifact_default_name_cannot_escape(fake_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    box = Sandbox(url=fake_run.url)
    r = box.run("import os\nos.makedirs('/workspace/artifacts', exist_ok=True)\n"
                "open('/workspace/artifacts/r.txt', 'w').write('x')")
    art = r.artifacts[0]
    art.name = "../../evil.txt"  # a hostile name must not leave the target directory
    assert box.save_artifact(art) == 1
    assert (tmp_path / "evil.txt").read_bytes() == b"x"


def test_figures_in_requested_formats(fake_run):
    fake_run.next_figures = [("Sales", PNG), (None, PNG[:20])]
    box = Sandbox(SandboxConfig(runtime="heavy", figure_formats=["png", "svg"]),
                  url=fake_run.url)
    r = box.run("print('plotted')")
    assert fake_run.run_bodies[-1]["figure_formats"] == ["png", "svg"]
    assert [(a.name, a.mime_type, a.title) for a in r.images] == [
        ("figure-1.png", "image/png", "Sales"), ("figure-1.svg", "image/svg+xml", "Sales"),
        ("figure-2.png", "image/png", None), ("figure-2.svg", "image/svg+xml", None)]
    assert box.download_artifact(r.images[0]) == PNG
    assert box.download_artifact(r.images[1]).startswith(b"<svg")
    # Not asked for: the field is left out and the daemon's default (png) applies.
    fake_run.next_figures = [("t", PNG)]
    r = Sandbox(url=fake_run.url).run("pass")
    assert "figure_formats" not in fake_run.run_bodies[-1]
    assert [a.name for a in r.artifacts] == ["figure-1.png"]


def test_dataframe_table_and_value(fake_run):
    fake_run.table_max_rows = 2
    r = Sandbox(url=fake_run.url).run(FRAME)
    assert r.ok, r.stderr
    assert r.value is not None and r.value.startswith("  team  pts")
    assert r.table is not None
    assert r.table.columns == ["team", "pts"]
    assert r.table.rows == [["a", 9], ["b", 6]]
    assert (r.table.total_rows, r.table.total_columns, r.table.truncated) == (3, 2, True)
    assert r.table.to_records() == [{"team": "a", "pts": 9}, {"team": "b", "pts": 6}]
    plain = Sandbox(url=fake_run.url).run("x = 2\nx * 21")
    assert plain.value == "42" and plain.table is None


def test_missing_artifact_is_not_found(fake_run):
    box = Sandbox(url=fake_run.url)
    with pytest.raises(SandboxNotFound):
        box.download_artifact(Artifact(id="art_nope", environment_id="env_nope"))
    with pytest.raises(InvalidArgument):
        box.download_artifact(Artifact(id="art_x"))  # no environment, no url


def test_artifacts_are_per_tenant():
    fake = FakeEsbd(keys={"key-a": "a", "key-b": "b"}, run_endpoint=True).start()
    try:
        a = Sandbox(url=fake.url, api_key="key-a")
        r = a.run("import os\nos.makedirs('/workspace/artifacts')\n"
                  "open('/workspace/artifacts/s.txt', 'w').write('secret')")
        assert a.download_artifact(r.artifacts[0]) == b"secret"
        with pytest.raises(SandboxNotFound):
            Sandbox(url=fake.url, api_key="key-b").download_artifact(r.artifacts[0])
    finally:
        fake.stop()


# -- streaming ------------------------------------------------------------------------------
def test_streaming_callbacks_arrive_in_order(fake_run):
    got: list[tuple[str, str]] = []
    code = ("import sys, time\n"
            "print('out1', flush=True); time.sleep(0.3)\n"
            "print('err1', file=sys.stderr, flush=True); time.sleep(0.3)\n"
            "print('out2', flush=True)\n"
            "'final'")
    r = Sandbox(url=fake_run.url).run(code, on_stdout=lambda t: got.append(("out", t)),
                                      on_stderr=lambda t: got.append(("err", t)))
    assert got == [("out", "out1\n"), ("err", "err1\n"), ("out", "out2\n")]
    assert r.ok and r.stdout == "out1\nout2\n" and r.stderr == "err1\n"
    assert r.value == "'final'" and r.via == "run"


def test_callbacks_get_output_once_from_a_daemon_that_does_not_stream(fake_run):
    fake_run.stream_runs = False
    got: list[tuple[str, str]] = []
    r = Sandbox(url=fake_run.url).run("import sys\nprint('a')\nprint('b', file=sys.stderr)",
                                      on_stdout=lambda t: got.append(("out", t)),
                                      on_stderr=lambda t: got.append(("err", t)))
    assert r.ok and r.stdout == "a\n"
    assert got == [("out", "a\n"), ("err", "b\n")]


def test_streaming_install_then_output_and_packages(fake_run):
    got: list[tuple[str, str]] = []
    cfg = SandboxConfig(runtime="heavy", packages=["tabulate==0.9.0"])
    box = Sandbox(cfg, url=fake_run.url)
    r = box.run("print('ran')", on_install=lambda t: got.append(("install", t)),
                on_stdout=lambda t: got.append(("out", t)))
    assert fake_run.run_bodies[-1]["packages"] == ["tabulate==0.9.0"]
    assert got == [("install", "Collecting tabulate==0.9.0\n"),
                   ("install", "Successfully installed tabulate-0.9.0\n"), ("out", "ran\n")]
    assert r.packages == [{"name": "tabulate", "version": "0.9.0", "from_cache": False}]
    assert r.install_ms is not None and r.runtime == "heavy"
    again = box.run("print('ran')")  # not streamed: same answer shape
    assert again.packages == [{"name": "tabulate", "version": "0.9.0", "from_cache": True}]


def test_error_event_raises_typed_exception(fake_run):
    box = Sandbox(SandboxConfig(packages=["no-such-dist"]), url=fake_run.url)
    installs: list[str] = []
    with pytest.raises(InvalidArgument, match="No matching distribution") as info:
        box.run("print(1)", on_install=installs.append)
    assert info.value.status == 400 and info.value.code == "bad_request"
    assert installs == ["Collecting no-such-dist\n"]
    with pytest.raises(InvalidArgument, match="No matching distribution"):
        box.run("print(1)")  # the JSON form answers 400 with the same message

    plain = Sandbox(url=fake_run.url)
    fake_run.run_error_event = {"error": True, "code": "internal", "message": "kernel died"}
    out: list[str] = []
    with pytest.raises(ServerError, match="kernel died") as err:
        plain.run("print('partial')", on_stdout=out.append)
    assert out == ["partial\n"] and err.value.status == 500
    fake_run.run_error_event = {"error": True, "code": "unavailable", "message": "busy"}
    with pytest.raises(Unavailable, match="busy"):
        plain.run("pass", stream=True)


def test_fallback_streams_through_commands(fake):
    got: list[str] = []
    r = Sandbox(url=fake.url).run("print('via env')", on_stdout=got.append)
    assert r.via == "environment" and r.stdout == "via env\n"
    assert "".join(got) == "via env\n"
    assert r.artifacts == [] and r.table is None


# -- environments ---------------------------------------------------------------------------
def test_environment_run_code_and_artifacts(fake_run, tmp_path):
    box = Sandbox(url=fake_run.url)
    with box.create() as env:
        got: list[str] = []
        r1 = env.run_code("import os\nos.makedirs('/workspace/artifacts', exist_ok=True)\n"
                          "open('/workspace/artifacts/a.txt', 'w').write('one')\nprint('c1')",
                          on_stdout=got.append)
        assert got == ["c1\n"] and r1.ok
        assert "runtime" not in fake_run.run_bodies[-1]
        fake_run.next_figures = [("Fig", PNG)]
        r2 = env.run("open('/workspace/artifacts/b.txt', 'w').write('two')\n1 + 1")
        assert r2.value == "2"
        assert [(a.name, a.step) for a in r1.artifacts] == [("a.txt", 1)]
        assert [(a.name, a.step) for a in r2.artifacts] == [("b.txt", 2), ("figure-1.png", 2)]
        assert all(a.environment_id == env.environment_id for a in r2.artifacts)
        listed = env.artifacts.list()
        assert sorted(a.name for a in listed) == ["a.txt", "b.txt", "figure-1.png"]
        fig = next(a for a in listed if a.kind == "image")
        assert env.artifacts.get(fig) == PNG
        assert env.artifacts.get(fig.id) == PNG
        assert env.artifacts.download(r1.artifacts[0], tmp_path / "a.txt") == 3
        assert (tmp_path / "a.txt").read_text() == "one"
        with pytest.raises(SandboxNotFound):
            env.artifacts.get("art_missing")
    # Kept after the environment is destroyed.
    assert box.download_artifact(r2.artifacts[0]) == b"two"


def test_environment_run_code_validates_options(fake_run):
    with Sandbox.create(url=fake_run.url) as env:
        with pytest.raises(InvalidArgument):
            env.run_code("pass", figure_formats=["gif"])
        with pytest.raises(InvalidArgument):
            env.run_code(b"print(1)")  # type: ignore[arg-type]
        r = env.run_code("pass", figure_formats=["svg"], packages=["tabulate"])
        assert fake_run.run_bodies[-1] == {"code": "pass", "timeout_ms": 30000,
                                           "figure_formats": ["svg"],
                                           "packages": ["tabulate"]}
        assert r.packages[0]["name"] == "tabulate"


# -- async ----------------------------------------------------------------------------------
def test_async_run_streams_and_downloads(fake_run):
    async def main() -> None:
        box = AsyncSandbox(url=fake_run.url)
        seen: list[str] = []

        async def on_out(text: str) -> None:
            seen.append(text)

        r = await box.run("import os\nos.makedirs('/workspace/artifacts')\n"
                          "open('/workspace/artifacts/x.bin', 'wb').write(bytes(range(5)))\n"
                          "print('hi')", on_stdout=on_out)
        assert seen == ["hi\n"]
        assert await box.download_artifact(r.artifacts[0]) == bytes(range(5))
        env = await box.create()
        async with env:
            got: list[str] = []
            fake_run.next_figures = [("t", PNG)]
            r2 = await env.run_code("print('cell')", on_stdout=got.append)
            assert got == ["cell\n"]
            assert [a.name for a in await env.artifacts.list()] == ["figure-1.png"]
            assert await env.artifacts.get(r2.artifacts[0]) == PNG

    asyncio.run(main())


def test_save_artifact_into_cwd_by_default(fake_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run.next_figures = [("t", PNG)]
    box = Sandbox(url=fake_run.url)
    r = box.run("pass")
    assert box.save_artifact(r.artifacts[0]) == len(PNG)
    assert os.listdir(tmp_path) == ["figure-1.png"]
