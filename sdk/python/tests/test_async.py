"""Fast tests of AsyncSandbox against the fake esbd."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentbox import AsyncSandbox, DaemonUnreachable, SandboxNotFound


def test_async_run(fake):
    async def main():
        return await AsyncSandbox(url=fake.url).run("print(6 * 7)")
    assert asyncio.run(main()).stdout == "42\n"
    assert fake.live() == []


def test_async_environment_and_callbacks(fake):
    chunks: list[tuple[str, str]] = []
    loop_threads = set()

    async def on_out(chunk: str) -> None:  # coroutine callback
        loop_threads.add(threading.get_ident())
        chunks.append(("out", chunk))

    def on_err(chunk: str) -> None:  # plain callback
        loop_threads.add(threading.get_ident())
        chunks.append(("err", chunk))

    async def main():
        async with await AsyncSandbox.create(url=fake.url) as env:
            await env.files.write("a.txt", "hello")
            assert await env.files.read("a.txt") == "hello"
            assert await env.files.read("a.txt", format="bytes") == b"hello"
            assert [e.name for e in await env.files.list()] == ["a.txt"]
            assert await env.files.exists("a.txt")
            await env.files.upload("b.bin", b"\x00\x01")
            assert await env.files.download("b.bin") == b"\x00\x01"
            r = await env.commands.run("echo o1; echo e1 >&2; sleep 0.05; echo o2",
                                       on_stdout=on_out, on_stderr=on_err)
            assert r.exit_code == 0
            assert await env.heartbeat() != ""
            assert await env.is_running()
            return env, threading.get_ident()

    env, loop_thread = asyncio.run(main())
    assert "".join(c for k, c in chunks if k == "out") == "o1\no2\n"
    assert "".join(c for k, c in chunks if k == "err") == "e1\n"
    assert loop_threads == {loop_thread}  # callbacks ran on the event loop's thread
    assert env.closed and fake.envs[env.id].destroyed_at is not None


def test_async_instance_create_and_concurrency(fake):
    async def main():
        box = AsyncSandbox(url=fake.url)
        envs = await asyncio.gather(*(box.create() for _ in range(3)))
        try:
            results = await asyncio.gather(*(e.commands.run(f"echo {i}")
                                             for i, e in enumerate(envs)))
            assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
            assert len(await box.list()) == 3
        finally:
            for e in envs:
                await e.close()
        with pytest.raises(SandboxNotFound):
            await box.connect(envs[0].id)
    asyncio.run(main())
    assert fake.live() == []


def test_async_daemon_down(dead_url):
    async def main():
        await AsyncSandbox(url=dead_url).health()
    with pytest.raises(DaemonUnreachable):
        asyncio.run(main())


def test_async_cancel_kills_the_command(fake):
    async def main():
        async with await AsyncSandbox.create(url=fake.url) as env:
            task = asyncio.create_task(env.commands.run(
                "for i in $(seq 20); do echo $i; sleep 0.1; done; touch marker"))
            await asyncio.sleep(0.4)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(2.6)
            return await env.files.exists("marker")
    assert asyncio.run(main()) is False
