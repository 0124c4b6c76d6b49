"""Time travel in the SDK (docs/api.md "Steps") against the fake esbd: env.steps(),
env.step(n) with .variables/.files/.file()/.diff(), env.rewind(n), env.fork(n),
create(steps=...), the async twins, and how errors come back."""

from __future__ import annotations

import asyncio

import pytest

from agentbox import (AsyncSandbox, Conflict, Environment, Gone, InvalidArgument, Sandbox,
                      SandboxNotFound, Step)


def test_every_change_is_a_step_newest_first(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("a.txt", "one\n")
        env.commands.run("echo two >> a.txt")
        steps = env.steps()
        kinds = [s.kind for s in steps]
        assert kinds[-1] == "create" and steps[-1].step == 0
        assert "files.write" in kinds and "execute" in kinds
        assert [s.step for s in steps] == sorted((s.step for s in steps), reverse=True)
        assert all(isinstance(s, Step) for s in steps)
        assert steps[0].on_head is True
        assert ("GET", f"/environments/{env.id}/steps") in fake.requests


def test_steps_paging_and_bad_arguments(fake):
    with Sandbox.create(url=fake.url) as env:
        for i in range(4):
            env.files.write(f"f{i}.txt", str(i))
        page = env.steps(limit=2)
        assert [s.step for s in page] == [4, 3]
        older = env.steps(limit=2, before=3)
        assert [s.step for s in older] == [2, 1]
        for bad in (0, -1, True, "2"):
            with pytest.raises(InvalidArgument):
                env.steps(limit=bad)
        with pytest.raises(InvalidArgument):
            env.steps(before=-1)


def test_step_detail_variables_files_file_and_diff(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("main.py", "x = 1\n")
        fake.next_variables = [{"name": "x", "type": "int", "repr": "1"}]
        env.files.write("main.py", "x = 2\n")
        s = env.step(2)
        assert s.kind == "files.write" and s.parent == 1
        assert s.variables == [{"name": "x", "type": "int", "repr": "1"}]
        assert {"path": "main.py", "change": "modified"} in s.changes
        paths = {f["path"]: f for f in s.files}
        assert paths["main.py"]["type"] == "file" and paths["main.py"]["size"] == 6
        assert s.file("main.py") == b"x = 2\n"
        assert env.step(1).file("main.py") == b"x = 1\n"  # the content as it was then
        d = s.diff("main.py")
        assert d["change"] == "modified"
        assert "-x = 1" in d["diff"] and "+x = 2" in d["diff"]
        with pytest.raises(SandboxNotFound):
            env.step(0).file("main.py")  # did not exist at step 0
        with pytest.raises(SandboxNotFound):
            env.step(99)
        with pytest.raises(InvalidArgument):
            env.step(-1)


def test_summary_steps_fetch_their_detail_on_first_use(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("a.txt", "hi")
        summary = env.steps()[0]
        assert "files" not in summary.data
        before = len(fake.requests)
        files = summary.files
        assert any(f["path"] == "a.txt" for f in files)
        assert fake.requests[before:] == [("GET", f"/environments/{env.id}/steps/1")]
        with pytest.raises(AttributeError):
            summary.no_such_field


def test_a_collected_file_raises_gone(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("big.bin", b"\x00" * 10)
        fake.collected.add((env.id, 1, "big.bin"))
        with pytest.raises(Gone) as err:
            env.step(1).file("big.bin")
        assert err.value.status == 410 and err.value.body.get("detail") == "collected"


def test_rewind_restores_files_and_shell_state_and_keeps_later_steps(fake):
    with Sandbox.create(url=fake.url) as env:
        env.commands.run("mkdir -p d && cd d && export X=before")
        env.files.write("state.txt", "good")
        good = env.steps()[0].step
        env.commands.run("cd /tmp; export X=after; echo bad > /workspace/d/../state.txt")
        assert env.files.read("state.txt") == "bad\n"
        answer = env.rewind(good)
        assert answer["head"] == good and answer["memory"] == "none"
        assert env.data["steps"]["head"] == good
        assert env.files.read("state.txt") == "good"
        # The later step is still there, off the head now.
        later = [s for s in env.steps() if s.step > good]
        assert later and later[-1].on_head is False
        # The next step continues from the rewound one, with its shell state.
        assert env.commands.run("echo $X; basename $PWD").stdout.split() == ["before", "d"]
        assert env.steps()[0].parent == good


def test_fork_is_a_new_independent_environment(fake):
    with Sandbox.create(url=fake.url) as env:
        env.files.write("shared.txt", "v1")
        n = env.steps()[0].step
        env.files.write("shared.txt", "v2")
        with env.fork(n) as a, env.fork(n) as b:
            assert isinstance(a, Environment) and a.id != env.id and a.id != b.id
            assert a.data["forked_from"] == {"environment_id": env.id, "step": n}
            assert a.files.read("shared.txt") == "v1"
            a.files.write("shared.txt", "a")
            assert b.files.read("shared.txt") == "v1"  # forks diverge independently
            assert env.files.read("shared.txt") == "v2"
            assert a.steps()[-1].kind == "fork"


def test_create_with_steps_option_and_capture_off(fake):
    with Sandbox.create(url=fake.url, steps={"max_steps": 10, "max_bytes": 1 << 20}) as env:
        assert fake.create_bodies[-1]["steps"] == {"max_steps": 10, "max_bytes": 1 << 20}
        assert env.data["steps"]["capture"] is True
    with Sandbox.create(url=fake.url) as env:
        assert "steps" not in fake.create_bodies[-1]
    with Sandbox.create(url=fake.url, steps=False) as env:
        assert fake.create_bodies[-1]["steps"] is False
        env.files.write("a.txt", "x")
        with pytest.raises(Conflict):
            env.rewind(0)
        with pytest.raises(Conflict):
            env.fork(0)
    for bad in ("off", 0, {"max_stepz": 3}):
        with pytest.raises(InvalidArgument):
            Sandbox.create(url=fake.url, steps=bad)


def test_rewind_and_fork_validate_the_step_before_any_request(fake):
    with Sandbox.create(url=fake.url) as env:
        before = len(fake.requests)
        for bad in (-1, "1", 1.5, None, True):
            with pytest.raises(InvalidArgument):
                env.rewind(bad)
            with pytest.raises(InvalidArgument):
                env.fork(bad)
        assert len(fake.requests) == before
        with pytest.raises(SandboxNotFound):
            env.rewind(42)


def test_another_tenants_steps_are_not_found(fake_auth):
    a = Sandbox(url=fake_auth.url, api_key="key-a")
    b = Sandbox(url=fake_auth.url, api_key="key-b")
    with a.create() as env:
        other = Environment(b._transport, env.id)
        for call in (other.steps, lambda: other.step(0), lambda: other.rewind(0),
                     lambda: other.fork(0)):
            with pytest.raises(SandboxNotFound):
                call()


def test_async_twins(fake):
    async def main() -> None:
        box = AsyncSandbox(url=fake.url)
        async with await box.create() as env:
            await env.files.write("a.txt", "1")
            await env.files.write("a.txt", "2")
            steps = await env.steps()
            assert [s.step for s in steps] == [2, 1, 0]
            one = await env.step(1)
            assert await one.file("a.txt") == b"1"
            assert (await one.diff("a.txt"))["change"] == "added"
            assert any(f["path"] == "a.txt" for f in one.files)
            with pytest.raises(AttributeError):
                steps[0].files  # a summary: await refresh() first
            assert any(f["path"] == "a.txt" for f in (await steps[0].refresh()).files)
            assert (await env.rewind(1))["head"] == 1
            assert await env.files.read("a.txt") == "1"
            fork = await env.fork(2)
            try:
                assert await fork.files.read("a.txt") == "2"
            finally:
                await fork.close()
    asyncio.run(main())


def test_step_detail_follows_the_windows_of_a_large_tree():
    """esbd sends a step's files and changes in windows (files_next / changes_next): the
    SDK's detail holds all of them, each once, in order."""
    from agentbox.steps import fetch_detail

    paths = [f"f{i:05d}" for i in range(25)]

    class Windows:
        def __init__(self):
            self.queries = []

        def json(self, method, path, payload=None, *, query=None, **_):
            self.queries.append(dict(query or {}))
            out = {"step": 1}
            for key, limit in (("files", 10), ("changes", 7)):
                after = (query or {}).get(f"{key}_after", "")
                rest = [p for p in paths if p > after]
                window = rest[:limit]
                out[key] = ([{"path": p, "type": "file"} for p in window] if key == "files"
                            else [{"path": p, "change": "added"} for p in window])
                out[f"{key}_next"] = window[-1] if len(rest) > limit else None
                out[f"{key}_total"] = len(paths)
            return out

    t = Windows()
    data = fetch_detail(t, "/environments/e/steps/1")
    assert [f["path"] for f in data["files"]] == paths
    assert [c["path"] for c in data["changes"]] == paths
    assert data["files_next"] is None and data["changes_next"] is None
    assert len(t.queries) == 4  # changes need four windows of 7
    assert all(q["files_limit"] == 10000 for q in t.queries)
