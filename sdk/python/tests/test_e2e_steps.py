"""End-to-end tests of time travel in the SDK (docs/api.md "Steps") against a REAL esbd.

Needs ``AGENTBOX_E2E_URL`` (see test_e2e.py).
"""

from __future__ import annotations

import os

import pytest

from conftest import E2E_SKIP_REASON, E2E_URL
from agentbox import Conflict, InvalidArgument, Sandbox, SandboxError, SandboxNotFound

if not E2E_URL:
    pytest.skip(E2E_SKIP_REASON, allow_module_level=True)

KEY = os.environ.get("AGENTBOX_E2E_API_KEY") or None


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(url=E2E_URL, api_key=KEY, request_timeout=120)


@pytest.fixture
def env(box):
    with box.create(ttl_seconds=600) as e:
        yield e


def test_each_change_is_a_step_with_its_files(box, env):
    env.files.write("notes.txt", "first\n")
    env.commands.run("mkdir -p sub && cd sub && echo second >> ../notes.txt")
    steps = env.steps()
    kinds = [s.kind for s in steps]
    assert kinds[:2] == ["execute", "files.write"], kinds
    assert steps[-1].step == 0
    last = env.step(steps[0].step)
    assert last.status == "ok" and last.exit_code == 0
    assert "mkdir -p sub" in last.summary
    paths = {f["path"]: f for f in last.files}
    assert any(p.endswith("notes.txt") for p in paths), paths
    assert env.step(steps[1].step).file("notes.txt") == b"first\n"
    assert last.file("notes.txt") == b"first\nsecond\n"
    d = last.diff("notes.txt")
    assert d["change"] == "modified" and "+second" in d["diff"]


def test_failing_step_then_rewind_and_a_corrected_retry(env):
    env.files.write("data.csv", "a,b\n1,2\n")
    good = env.steps()[0].step
    env.commands.run("cd /tmp && export MODE=broken && rm /workspace/data.csv && false")
    bad = env.steps()[0]
    assert bad.status == "error" and bad.exit_code == 1
    answer = env.rewind(good)
    assert answer["head"] == good and answer["memory"] in ("snapshot", "none")
    assert env.files.read("data.csv") == "a,b\n1,2\n"
    res = env.commands.run("pwd; echo mode=${MODE:-unset}")
    assert res.stdout.split() == ["/workspace", "mode=unset"]
    retry = env.steps()[0]
    assert retry.parent == good
    assert any(s.step == bad.step and not s.on_head for s in env.steps(limit=50))


def test_two_forks_of_one_step_diverge(env):
    env.commands.run("echo base > f.txt && export WHO=origin")
    n = env.steps()[0].step
    env.commands.run("echo later > f.txt")
    with env.fork(n) as a, env.fork(n) as b:
        assert a.data["forked_from"] == {"environment_id": env.id, "step": n}
        assert a.files.read("f.txt") == "base\n" and b.files.read("f.txt") == "base\n"
        a.commands.run("echo a > f.txt")
        assert b.files.read("f.txt") == "base\n"
        assert env.files.read("f.txt") == "later\n"
        assert a.commands.run("echo $WHO").stdout.strip() == "origin"


def test_python_variables_are_recorded(env):
    env.run_code("import math\nanswer = 6 * 7\nname = 'deep'\n")
    s = env.step(env.steps()[0].step)
    assert s.kind == "run"
    names = {v["name"]: v for v in (s.variables or [])}
    assert names.get("answer", {}).get("repr") == "42", s.variables
    assert names["name"]["type"] == "str"


def test_capture_off_refuses_rewind_and_fork(box):
    with box.create(ttl_seconds=120, steps=False) as off:
        off.files.write("x.txt", "1")
        assert off.info()["steps"]["capture"] is False
        with pytest.raises(Conflict):
            off.rewind(0)
        with pytest.raises(Conflict):
            off.fork(0)


def test_unknown_steps_and_bad_input(env):
    with pytest.raises(SandboxNotFound):
        env.step(10_000)
    with pytest.raises(SandboxNotFound):
        env.rewind(10_000)
    with pytest.raises(InvalidArgument):
        env.step(-1)
    with pytest.raises(SandboxError):
        env.step(0).file("no/such/file")
