"""The asyncio flavour: :class:`AsyncSandbox` with the same surface as
:class:`agentbox.Sandbox`.

Each call runs the standard-library blocking client in a worker thread
(:func:`asyncio.to_thread`), so the event loop never blocks. Streaming callbacks
(``on_stdout``/``on_stderr``) may be plain functions or coroutine functions; either way they
run on the event loop's thread, one at a time, in the order the chunks arrived.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import (Any, BinaryIO, Callable, Literal, Mapping, Optional, Sequence, Union,
                    overload)

from .models import (Artifact, CommandResult, EntryInfo, SandboxConfig, SandboxResult,
                     WriteInfo)
from ._http import CancelToken
from .sandbox import Environment, NetworkPolicy, PathLike, Sandbox
from .steps import Step

__all__ = ["AsyncSandbox", "AsyncEnvironment", "AsyncCommands", "AsyncFiles",
           "AsyncArtifacts", "AsyncIntentScope", "AsyncStep"]

AsyncOutputHandler = Callable[[str], Any]
"""A streaming callback for the async client: a function or coroutine function taking a
chunk of text."""


def _on_loop(loop: asyncio.AbstractEventLoop,
             handler: Optional[AsyncOutputHandler]) -> Optional[Callable[[str], None]]:
    """Wrap ``handler`` so that a worker thread can call it: the call is scheduled on
    ``loop`` and the worker waits for it, which keeps chunks in order."""
    if handler is None:
        return None

    async def invoke(chunk: str) -> None:
        value = handler(chunk)
        if inspect.isawaitable(value):
            await value

    def call(chunk: str) -> None:
        asyncio.run_coroutine_threadsafe(invoke(chunk), loop).result()

    return call


class AsyncCommands:
    """Async shell commands (``env.commands``); see :class:`agentbox.Commands`."""

    def __init__(self, env: Environment) -> None:
        self._sync = env.commands

    async def run(self, cmd: str, *, timeout: float = 60,
                  envs: Optional[Mapping[str, str]] = None,
                  on_stdout: Optional[AsyncOutputHandler] = None,
                  on_stderr: Optional[AsyncOutputHandler] = None,
                  stream: Optional[bool] = None, check: bool = False,
                  request_timeout: Optional[float] = None,
                  intent: Optional[str] = None) -> CommandResult:
        """Run ``cmd`` in the environment; same arguments and result as
        :meth:`agentbox.Commands.run`. Callbacks may be coroutine functions. Streams by
        default, so that cancelling the awaiting task drops the connection and the daemon
        kills the command."""
        loop = asyncio.get_running_loop()
        token = CancelToken()
        try:
            return await asyncio.to_thread(
                self._sync.run, cmd, timeout=timeout, envs=envs,
                on_stdout=_on_loop(loop, on_stdout), on_stderr=_on_loop(loop, on_stderr),
                stream=True if stream is None else stream, check=check,
                request_timeout=request_timeout, cancel=token, intent=intent)
        except asyncio.CancelledError:
            token.cancel()  # drop the connection: esbd kills the command
            raise


class AsyncFiles:
    """Async file access (``env.files``); see :class:`agentbox.Files`."""

    def __init__(self, env: Environment) -> None:
        self._sync = env.files

    async def write(self, path: str, data: Union[str, bytes, bytearray]) -> WriteInfo:
        """Create or overwrite ``path`` with ``data`` (str → UTF-8, bytes → binary)."""
        return await asyncio.to_thread(self._sync.write, path, data)

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str,
                   format: Literal["text", "bytes"] = "text") -> Union[str, bytes]:
        """Read a whole file as text or bytes."""
        return await asyncio.to_thread(self._sync.read, path, format)  # type: ignore[arg-type]

    async def upload(self, path: str, src: Union[bytes, PathLike, BinaryIO]) -> WriteInfo:
        """Stream bytes, a local file or a binary file object into ``path``."""
        return await asyncio.to_thread(self._sync.upload, path, src)

    async def download(self, path: str,
                       dest: Optional[Union[PathLike, BinaryIO]] = None) -> Union[bytes, int]:
        """Stream ``path`` out; returns bytes, or the byte count when ``dest`` is given."""
        if dest is None:
            return await asyncio.to_thread(self._sync.download, path)
        return await asyncio.to_thread(self._sync.download, path, dest)

    async def list(self, path: str = ".") -> list[EntryInfo]:
        """List a directory."""
        return await asyncio.to_thread(self._sync.list, path)

    async def stat(self, path: str) -> EntryInfo:
        """Metadata of ``path`` (see :meth:`Files.stat`)."""
        return await asyncio.to_thread(self._sync.stat, path)

    async def make_dir(self, path: str) -> bool:
        """Create ``path`` and its parents; True if created (see :meth:`Files.make_dir`)."""
        return await asyncio.to_thread(self._sync.make_dir, path)

    async def remove(self, path: str, *, recursive: bool = True) -> None:
        """Delete a file, symlink or directory tree (see :meth:`Files.remove`)."""
        await asyncio.to_thread(self._sync.remove, path, recursive=recursive)

    async def rename(self, old_path: str, new_path: str, *, overwrite: bool = False) -> None:
        """Move ``old_path`` to ``new_path`` (see :meth:`Files.rename`)."""
        await asyncio.to_thread(self._sync.rename, old_path, new_path, overwrite=overwrite)

    async def exists(self, path: str) -> bool:
        """True if ``path`` exists in the environment."""
        return await asyncio.to_thread(self._sync.exists, path)


class AsyncArtifacts:
    """Async access to an environment's artifacts (``env.artifacts``); see
    :class:`agentbox.Artifacts`."""

    def __init__(self, env: Environment) -> None:
        self._sync = env.artifacts

    async def list(self) -> list[Artifact]:
        """Every artifact of the environment."""
        return await asyncio.to_thread(self._sync.list)

    async def get(self, artifact: Union[str, Artifact, Mapping[str, Any]]) -> bytes:
        """The artifact's bytes."""
        return await asyncio.to_thread(self._sync.get, artifact)

    async def download(self, artifact: Union[str, Artifact, Mapping[str, Any]],
                       dest: Union[PathLike, BinaryIO]) -> int:
        """Stream the artifact into a local path or binary file; returns the byte count."""
        return await asyncio.to_thread(self._sync.download, artifact, dest)


async def _run_cancellable(func: Callable[..., SandboxResult], code: str,
                           loop: asyncio.AbstractEventLoop,
                           on_stdout: Optional[AsyncOutputHandler],
                           on_stderr: Optional[AsyncOutputHandler],
                           on_install: Optional[AsyncOutputHandler],
                           stream: Optional[bool], **kwargs: Any) -> SandboxResult:
    """Run a blocking ``run``/``run_code`` in a worker thread with the callbacks moved onto
    the event loop; cancelling the awaiting task drops the connection."""
    token = CancelToken()
    callbacks = (on_stdout, on_stderr, on_install)
    try:
        return await asyncio.to_thread(
            func, code, on_stdout=_on_loop(loop, on_stdout),
            on_stderr=_on_loop(loop, on_stderr), on_install=_on_loop(loop, on_install),
            stream=stream if stream is not None else any(c is not None for c in callbacks),
            cancel=token, **kwargs)
    except asyncio.CancelledError:
        token.cancel()
        raise


class AsyncEnvironment:
    """Async twin of :class:`agentbox.Environment`; use ``async with`` so it is always
    deleted."""

    def __init__(self, env: Environment) -> None:
        self.sync = env
        self.environment_id = env.environment_id
        self.commands = AsyncCommands(env)
        self.files = AsyncFiles(env)
        self.artifacts = AsyncArtifacts(env)

    @property
    def id(self) -> str:
        """Alias of :attr:`environment_id`."""
        return self.environment_id

    @property
    def data(self) -> dict[str, Any]:
        """The environment record from the last create/info call."""
        return self.sync.data

    def __repr__(self) -> str:
        return f"AsyncEnvironment({self.environment_id!r}, url={self.sync.url!r})"

    async def __aenter__(self) -> "AsyncEnvironment":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await asyncio.to_thread(self.sync.__exit__, exc_type, exc, tb)

    async def run_code(self, code: str, *, timeout_ms: int = 30_000,
                       memory_limit_mb: Optional[int] = None,
                       allowed_modules: Optional[Sequence[str]] = None,
                       packages: Optional[Sequence[str]] = None,
                       figure_formats: Optional[Sequence[str]] = None,
                       on_stdout: Optional[AsyncOutputHandler] = None,
                       on_stderr: Optional[AsyncOutputHandler] = None,
                       on_install: Optional[AsyncOutputHandler] = None,
                       stream: Optional[bool] = None,
                       request_timeout: Optional[float] = None,
                       intent: Optional[str] = None) -> SandboxResult:
        """Run Python in the environment's stateful interpreter; see
        :meth:`agentbox.Environment.run_code`. Callbacks may be coroutine functions."""
        return await _run_cancellable(
            self.sync.run_code, code, asyncio.get_running_loop(), on_stdout, on_stderr,
            on_install, stream, timeout_ms=timeout_ms, memory_limit_mb=memory_limit_mb,
            allowed_modules=allowed_modules, packages=packages, figure_formats=figure_formats,
            request_timeout=request_timeout, intent=intent)

    run = run_code

    # -- network governance (see agentbox.Environment) --------------------------------------
    async def get_network(self) -> Union[str, dict[str, Any]]:
        """The network policy now (``"none"`` or the policy dict); the async spelling of
        :attr:`agentbox.Environment.network`."""
        return await asyncio.to_thread(lambda: self.sync.network)

    async def set_network(self, policy: NetworkPolicy) -> Union[str, dict[str, Any]]:
        """Replace the network policy live; returns it as stored."""
        return await asyncio.to_thread(self.sync.set_network, policy)

    def intent(self, name: str, *, ttl_seconds: Optional[int] = None) -> "AsyncIntentScope":
        """``async with env.intent("check-weather"):`` — the intent is active inside the
        block; see :meth:`agentbox.Environment.intent`."""
        return AsyncIntentScope(self.sync.intent(name, ttl_seconds=ttl_seconds))

    async def activate_intent(self, name: str, *, ttl_seconds: Optional[int] = None
                              ) -> dict[str, Any]:
        """Activate a catalogue intent; returns the daemon's record."""
        return await asyncio.to_thread(
            lambda: self.sync.activate_intent(name, ttl_seconds=ttl_seconds))

    async def deactivate_intent(self, name: str) -> bool:
        """Deactivate an intent (False if it was not active)."""
        return await asyncio.to_thread(self.sync.deactivate_intent, name)

    async def intents(self) -> list[dict[str, Any]]:
        """The intents active now."""
        return await asyncio.to_thread(self.sync.intents)

    async def ca_pem(self) -> str:
        """The environment's CA certificate (PEM)."""
        return await asyncio.to_thread(self.sync.ca_pem)

    # -- time travel (see agentbox.Environment) ---------------------------------------------
    async def steps(self, *, limit: Optional[int] = None, before: Optional[int] = None
                    ) -> list["AsyncStep"]:
        """The step log, newest first; see :meth:`agentbox.Environment.steps`."""
        found = await asyncio.to_thread(lambda: self.sync.steps(limit=limit, before=before))
        return [AsyncStep(s) for s in found]

    async def step(self, n: int) -> "AsyncStep":
        """Step ``n`` with its detail; see :meth:`agentbox.Environment.step`."""
        return AsyncStep(await asyncio.to_thread(self.sync.step, n))

    async def rewind(self, n: int) -> dict[str, Any]:
        """Rewind in place to step ``n``; see :meth:`agentbox.Environment.rewind`."""
        return await asyncio.to_thread(self.sync.rewind, n)

    async def fork(self, n: int) -> "AsyncEnvironment":
        """A new environment at step ``n``; see :meth:`agentbox.Environment.fork`."""
        return AsyncEnvironment(await asyncio.to_thread(self.sync.fork, n))

    async def info(self) -> dict[str, Any]:
        """Fetch the environment record."""
        return await asyncio.to_thread(self.sync.info)

    async def is_running(self) -> bool:
        """True while the daemon reports the environment as running."""
        return await asyncio.to_thread(self.sync.is_running)

    async def heartbeat(self, ttl_seconds: Optional[int] = None) -> str:
        """Extend the lease; returns the new ``expires_at``."""
        return await asyncio.to_thread(self.sync.heartbeat, ttl_seconds)

    async def kill(self) -> bool:
        """Destroy the environment (False if the daemon did not know it)."""
        return await asyncio.to_thread(self.sync.kill)

    async def close(self) -> None:
        """Destroy the environment; safe to call more than once."""
        await asyncio.to_thread(self.sync.close)

    @property
    def closed(self) -> bool:
        """True once the environment was deleted by this client."""
        return self.sync.closed


class AsyncStep:
    """Async twin of :class:`agentbox.Step`: the summary and detail fields read as
    attributes (an async step always has its detail once :meth:`refresh` or
    :meth:`AsyncEnvironment.step` fetched it); ``await step.file(path)``, ``await
    step.diff(path)``."""

    def __init__(self, step: Step) -> None:
        self.sync = step
        self.step = step.step
        self.environment_id = step.environment_id

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    @property
    def data(self) -> dict[str, Any]:
        """The daemon's JSON for this step."""
        return self.sync.data

    def __getattr__(self, name: str) -> Any:
        # Fields already fetched; a detail field not fetched yet needs ``await refresh()``.
        if name in self.sync.data:
            return self.sync.data[name]
        if name in ("variables", "files", "changes", "input", "output", "artifacts", "audit",
                    "egress", "shell"):
            raise AttributeError(f"{name}: await step.refresh() (or env.step(n)) first")
        return getattr(self.sync, name)

    async def refresh(self) -> "AsyncStep":
        """Fetch the step's detail."""
        await asyncio.to_thread(self.sync.refresh)
        return self

    async def file(self, path: str) -> bytes:
        """The bytes of ``path`` at this step."""
        return await asyncio.to_thread(self.sync.file, path)

    async def diff(self, path: str) -> dict[str, Any]:
        """``path``'s change at this step against its parent."""
        return await asyncio.to_thread(self.sync.diff, path)


class AsyncIntentScope:
    """The ``async with`` twin of :class:`agentbox.IntentScope`."""

    def __init__(self, scope: Any) -> None:
        self.sync = scope

    @property
    def info(self) -> dict[str, Any]:
        """The daemon's record from the activation."""
        return self.sync.info

    async def __aenter__(self) -> "AsyncIntentScope":
        await asyncio.to_thread(self.sync.__enter__)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await asyncio.to_thread(self.sync.__exit__, exc_type, exc, tb)


class _AsyncCreate:
    """``AsyncSandbox.create(...)`` on the class (URL/key from arguments or the environment)
    or on an instance (reuses its URL and key); returns a coroutine giving an
    :class:`AsyncEnvironment`. Takes the keyword arguments of :meth:`agentbox.Sandbox.create`.
    """

    def __get__(self, obj: Any, owner: Any) -> Callable[..., Any]:
        async def create(**kwargs: Any) -> AsyncEnvironment:
            target: Any = obj.sync if obj is not None else Sandbox
            env = await asyncio.to_thread(lambda: target.create(**kwargs))
            return AsyncEnvironment(env)
        create.__doc__ = _AsyncCreate.__doc__
        return create


class AsyncSandbox:
    """Async twin of :class:`agentbox.Sandbox`::

        box = AsyncSandbox()
        result = await box.run("print(42)")
        async with await AsyncSandbox.create() as env:
            await env.commands.run("ls", on_stdout=print)
    """

    def __init__(self, config: Optional[SandboxConfig] = None, *, url: Optional[str] = None,
                 api_key: Optional[str] = None, request_timeout: float = 30.0) -> None:
        self.sync = Sandbox(config, url=url, api_key=api_key, request_timeout=request_timeout)

    @property
    def config(self) -> SandboxConfig:
        """The :class:`SandboxConfig` used by :meth:`run`."""
        return self.sync.config

    @property
    def url(self) -> str:
        """The daemon's base URL."""
        return self.sync.url

    async def run(self, code: str, *, config: Optional[SandboxConfig] = None,
                  on_stdout: Optional[AsyncOutputHandler] = None,
                  on_stderr: Optional[AsyncOutputHandler] = None,
                  on_install: Optional[AsyncOutputHandler] = None,
                  stream: Optional[bool] = None) -> SandboxResult:
        """Run Python ``code`` once; see :meth:`agentbox.Sandbox.run`. Callbacks may be
        coroutine functions; giving one makes the request stream."""
        return await _run_cancellable(self.sync.run, code, asyncio.get_running_loop(),
                                      on_stdout, on_stderr, on_install, stream, config=config)

    async def download_artifact(self, artifact: Union[Artifact, Mapping[str, Any]]) -> bytes:
        """The bytes of an artifact from a run's result."""
        return await asyncio.to_thread(self.sync.download_artifact, artifact)

    async def save_artifact(self, artifact: Union[Artifact, Mapping[str, Any]],
                            dest: Union[PathLike, BinaryIO, None] = None) -> int:
        """Stream an artifact into a local path, directory or binary file."""
        return await asyncio.to_thread(self.sync.save_artifact, artifact, dest)

    create = _AsyncCreate()

    async def new_environment(self, **kwargs: Any) -> AsyncEnvironment:
        """Create an environment on this client's daemon with this client's key (same as
        ``await box.create(...)``)."""
        return await self.create(**kwargs)

    async def connect(self, environment_id: str, **kwargs: Any) -> AsyncEnvironment:
        """Attach to an existing environment by id."""
        env = await asyncio.to_thread(lambda: self.sync.connect(environment_id, **kwargs))
        return AsyncEnvironment(env)

    async def list(self, *, all: bool = False) -> list[dict[str, Any]]:
        """The caller's environments."""
        return await asyncio.to_thread(lambda: self.sync.list(all=all))

    async def health(self) -> dict[str, Any]:
        """``GET /healthz``."""
        return await asyncio.to_thread(self.sync.health)
