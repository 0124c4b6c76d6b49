"""The synchronous client: :class:`Sandbox` (seed 002's front door) and :class:`Environment`
(a stateful sandbox with ``commands`` and ``files``, named after E2B's Python SDK)."""

from __future__ import annotations

import base64
import codecs
import functools
import math
import os
import posixpath
import secrets
import shlex
import threading
import time
import warnings
from typing import (Any, BinaryIO, Callable, Generic, Iterable, Literal, Mapping, Optional,
                    Sequence, TypeVar, Union, overload)

from ._http import DEFAULT_URL, CancelToken, SseEvent, Transport, quote_id
from .errors import (CommandExitError, CommandTimeout, InvalidArgument, PayloadTooLarge,
                     SandboxError, SandboxNotFound, error_from_response)
from .steps import Step, check_step_number, check_steps_option, fetch_detail
from .models import (Artifact, CommandResult, EntryInfo, SandboxConfig, SandboxResult,
                     WriteInfo, check_figure_formats, parse_artifacts, parse_traceback)

__all__ = ["Sandbox", "Environment", "Commands", "Files", "Artifacts", "OutputHandler",
           "CancelToken", "IntentScope", "NetworkPolicy"]

OutputHandler = Callable[[str], Any]
"""A streaming callback: receives each chunk of output text as it arrives."""

PathLike = Union[str, "os.PathLike[str]"]

NetworkPolicy = Union[str, Mapping[str, Any]]
"""An environment's network: ``"none"`` (no network at all, the default) or a policy dict
such as ``{"mode": "allowlist", "allow": ["pypi.org", "*.github.com"], "deny": [...],
"tls_inspect": True, "dlp": {...}}`` (docs/api.md "Network policy"); egress then goes only
through esbd's governance proxy."""

#: Bytes up to this size go through the JSON ``files/write`` endpoint as base64; larger ones
#: through the raw ``PUT files/raw`` endpoint (JSON bodies are capped at 16 MiB).
RAW_WRITE_THRESHOLD = 8 * 1024 * 1024
_CHUNK = 64 * 1024
_T = TypeVar("_T")
_R = TypeVar("_R")


def _check_network(network: Any, what: str) -> Union[str, dict[str, Any]]:
    """``network`` as it goes on the wire: ``"none"`` or a copy of the policy dict. The
    policy's content is the daemon's to validate (it answers 400 with the field at fault)."""
    if isinstance(network, str):
        if network != "none":
            raise InvalidArgument(f'{what}: network must be "none" or a policy dict such as '
                                  '{"mode": "allowlist", "allow": ["pypi.org"]}, not '
                                  f"{network!r}")
        return network
    if isinstance(network, Mapping):
        return dict(network)
    raise InvalidArgument(f'{what}: network must be "none" or a policy dict, not '
                          f"{type(network).__name__}")


def _network_from_answer(answer: Mapping[str, Any]) -> Union[str, dict[str, Any]]:
    """The policy from a ``GET``/``PUT /environments/{id}/network`` answer (``{"network":
    "none" | {...}}``)."""
    network = answer.get("network")
    if isinstance(network, (str, dict)):
        return network
    raise SandboxError(f"esbd answered a network request without 'network': {answer!r:.200}")


def _check_intent(intent: Any, what: str) -> Optional[str]:
    if intent is None:
        return None
    if not isinstance(intent, str) or not intent:
        raise InvalidArgument(f"{what}: intent must be a non-empty string (an intent name "
                              "from the daemon's catalogue)")
    return intent


def _env_url(url: Optional[str]) -> str:
    return url or os.environ.get("AGENTBOX_URL") or DEFAULT_URL


def _env_key(api_key: Optional[str]) -> Optional[str]:
    if api_key is not None:
        return api_key or None
    return os.environ.get("AGENTBOX_API_KEY") or None


class _hybridmethod(Generic[_T, _R]):
    """A method callable on the class (``Sandbox.create(...)``) and on an instance
    (``box.create(...)``, which reuses the instance's URL, key and config)."""

    def __init__(self, func: Callable[..., _R]) -> None:
        self.func = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, owner: Any) -> Callable[..., _R]:
        bound = obj if obj is not None else owner
        func = self.func

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> _R:
            return func(bound, *args, **kwargs)
        return call


class Commands:
    """Shell commands in an environment (``env.commands``)."""

    def __init__(self, env: "Environment") -> None:
        self._env = env

    def run(self, cmd: str, *, timeout: float = 60, envs: Optional[Mapping[str, str]] = None,
            on_stdout: Optional[OutputHandler] = None,
            on_stderr: Optional[OutputHandler] = None, stream: Optional[bool] = None,
            check: bool = False, request_timeout: Optional[float] = None,
            cancel: Optional[CancelToken] = None,
            intent: Optional[str] = None) -> CommandResult:
        """Run ``cmd`` with ``bash`` as ``appuser`` in the environment's session.

        The session is stateful: ``cd``, ``export``, shell variables and functions persist
        between calls.

        Args:
            cmd: the shell command line.
            timeout: seconds before the daemon kills the command's whole process group
                (1–3600, default 60; fractions round up). A timeout is not an exception:
                the result has ``exit_code == 124`` and ``timed_out == True``.
            envs: extra environment variables for this command only.
            on_stdout / on_stderr: called with each chunk of output text as it arrives
                (SSE streaming). Chunks of one stream are delivered in order; bytes that are
                not valid UTF-8 are replaced with U+FFFD.
            stream: force streaming on (or off) regardless of callbacks.
            check: raise :class:`CommandExitError` (or :class:`CommandTimeout`) when the
                exit code is not 0. Off by default (unlike E2B) so the result mirrors seed
                004's ``{error, stdout, stderr, exit_code}``.
            request_timeout: HTTP timeout in seconds (default ``timeout + 30``).
            cancel: a :class:`CancelToken`; calling its ``cancel()`` from another thread
                drops the connection, the daemon kills the command, and this call raises
                :class:`agentbox.Cancelled`. Implies streaming (the daemon notices a
                streaming client leave at once).
            intent: the name of an intent from the daemon's catalogue, active for this
                command only (its hosts are allowed while the command runs; see
                :meth:`Environment.intent`). Needs a network policy on the environment.

        Returns:
            the :class:`CommandResult`.
        """
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgument("commands.run: cmd must be a non-empty string")
        seconds = max(1, math.ceil(float(timeout)))
        payload: dict[str, Any] = {"command": cmd, "timeout_seconds": seconds}
        if _check_intent(intent, "commands.run"):
            payload["intent"] = intent
        if envs:
            payload["env"] = {str(k): str(v) for k, v in envs.items()}
        path = f"/environments/{quote_id(self._env.environment_id)}/execute"
        http_timeout = request_timeout if request_timeout is not None else seconds + 30.0
        streaming = stream if stream is not None else (on_stdout is not None
                                                       or on_stderr is not None
                                                       or cancel is not None)
        if streaming:
            result = self._run_streaming(path, payload, http_timeout, on_stdout, on_stderr,
                                         cancel)
        else:
            data = self._env._transport.json("POST", path, payload, timeout=http_timeout,
                                             cancel=cancel)
            result = CommandResult.from_answer(data)
        if check and result.exit_code != 0:
            if result.timed_out:
                raise CommandTimeout(f"command timed out after {seconds} s: {cmd}",
                                     result=result)
            raise CommandExitError(f"command exited with code {result.exit_code}: {cmd}"
                                   + (f"\n{result.stderr.strip()[-2000:]}"
                                      if result.stderr.strip() else ""), result=result)
        return result

    def _run_streaming(self, path: str, payload: Mapping[str, Any], http_timeout: float,
                       on_stdout: Optional[OutputHandler],
                       on_stderr: Optional[OutputHandler],
                       cancel: Optional[CancelToken] = None) -> CommandResult:
        events = self._env._transport.sse("POST", path, payload, timeout=http_timeout,
                                          cancel=cancel)
        data = _consume_stream(events, {"stdout": on_stdout, "stderr": on_stderr},
                               context="execute (stream)")
        return CommandResult.from_answer(data)


def _consume_stream(events: Iterable[SseEvent], handlers: Mapping[str, Optional[OutputHandler]],
                    *, context: str) -> dict[str, Any]:
    """Drive an esbd event stream to its end and return the ``result`` event's data.

    Output events (``stdout``, ``stderr``, ``install``: ``{"data": text}`` or
    ``{"data_b64": ...}``) are decoded as UTF-8 incrementally per stream (a character split
    across chunks is not mangled; invalid bytes become U+FFFD) and passed to the handler of
    that name, in arrival order. A daemon that answered plain JSON instead of a stream
    (no streaming for that endpoint) gets its whole ``stdout``/``stderr`` delivered once, at
    the end. An ``error`` event raises the typed :class:`SandboxError`
    matching its ``code``; a stream that ends without ``result`` raises too.
    """
    decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in handlers}

    def deliver(name: str, chunk: bytes, final: bool = False) -> None:
        text = decoders[name].decode(chunk, final)
        handler = handlers[name]
        if text and handler is not None:
            handler(text)

    result: Optional[dict[str, Any]] = None
    for ev in events:
        if ev.event in handlers:
            data = ev.data if isinstance(ev.data, dict) else {"data": str(ev.data)}
            if isinstance(data.get("data_b64"), str):
                chunk = base64.b64decode(data["data_b64"])
            else:
                chunk = str(data.get("data", "")).encode("utf-8")
            deliver(ev.event, chunk)
        elif ev.event == "result":
            if not isinstance(ev.data, dict):
                raise SandboxError(f"malformed result event from esbd: {ev.data!r:.200}")
            if ev.data.get("error") is True and "exit_code" not in ev.data:
                raise _error_event(ev.data, context)
            result = ev.data
            if ev.synthetic:  # the daemon did not stream: hand over the output in one piece
                for name in ("stdout", "stderr"):
                    if name in handlers and isinstance(result.get(name), str):
                        deliver(name, result[name].encode("utf-8"))
        elif ev.event == "error":
            raise _error_event(ev.data, context)
    for name in handlers:
        deliver(name, b"", True)
    if result is None:
        raise SandboxError("esbd closed the event stream without a result event")
    return result


#: Machine codes esbd puts in error bodies (ErrorCodeForStatus) and the status they stand for.
_CODE_STATUS = {"bad_request": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404,
                "method_not_allowed": 405, "conflict": 409, "payload_too_large": 413,
                "unsupported_media_type": 415, "unprocessable": 422,
                "too_many_requests": 429, "internal": 500, "unavailable": 503,
                "insufficient_storage": 507}


def _error_event(data: Any, context: str = "execute (stream)") -> SandboxError:
    if isinstance(data, dict):
        status = _CODE_STATUS.get(str(data.get("code")), 500)
        return error_from_response(status, data, context=context)
    return SandboxError(f"esbd reported an error mid-stream: {data!r:.300}")


def _download(transport: Transport, path: str, query: Optional[Mapping[str, Any]],
              dest: Optional[Union[PathLike, BinaryIO]]) -> Union[bytes, int]:
    """``GET path`` as a raw byte stream: the bytes when ``dest`` is None, else write them to
    a local path or binary file object in 64 KiB chunks and return the byte count."""
    conn, resp = transport.send("GET", path, query=query,
                                headers={"Accept": "application/octet-stream, */*"},
                                timeout=max(transport.timeout, 300.0))
    try:
        transport.raise_for("GET", path, resp)
        if dest is None:
            return resp.read()
        out: Any
        if isinstance(dest, (str, os.PathLike)):
            out = open(os.fspath(dest), "wb")
        else:
            out = dest
        total = 0
        try:
            while True:
                chunk = resp.read(_CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                total += len(chunk)
        finally:
            if out is not dest:
                out.close()
        return total
    finally:
        conn.close()


def _artifact_path(artifact: Union[Artifact, Mapping[str, Any]],
                   environment_id: Optional[str] = None) -> str:
    """The daemon path of an artifact's bytes, built from its environment and id (each quoted
    as one path segment), falling back to its ``url`` when it names no environment."""
    if isinstance(artifact, Mapping):
        parsed = Artifact.from_answer(artifact, environment_id)
        if parsed is None:
            raise InvalidArgument("artifact: the mapping has no 'id'")
        artifact = parsed
    if not isinstance(artifact, Artifact):
        raise InvalidArgument(f"artifact: expected an Artifact, not {type(artifact).__name__}")
    env = artifact.environment_id or environment_id
    if env:
        return f"/environments/{quote_id(env)}/artifacts/{quote_id(artifact.id)}"
    if artifact.url.startswith("/environments/"):
        return artifact.url
    raise InvalidArgument(f"artifact {artifact.id}: no environment id and no url to fetch "
                          "it from")


def _run_python(transport: Transport, path: str, payload: Mapping[str, Any], *,
                http_timeout: float, streaming: bool,
                handlers: Mapping[str, Optional[OutputHandler]],
                cancel: Optional[CancelToken]) -> tuple[dict[str, Any], float]:
    """``POST`` a run request (``/run`` or ``/environments/{id}/run``), as JSON or as an event
    stream; returns the answer and the client-side elapsed milliseconds."""
    started = time.monotonic()
    if streaming:
        events = transport.sse("POST", path, payload, timeout=http_timeout, cancel=cancel)
        answer = _consume_stream(events, handlers, context=f"POST {path} (stream)")
    else:
        answer = transport.json("POST", path, payload, timeout=http_timeout, cancel=cancel)
    return answer, (time.monotonic() - started) * 1000.0


def _run_timeout(timeout_ms: int, packages: Any) -> float:
    """HTTP timeout for a run: the code's limit plus slack, plus time for pip when packages
    are to be installed first."""
    return timeout_ms / 1000.0 + 30.0 + (300.0 if packages else 0.0)


class Artifacts:
    """Artifacts of an environment (``env.artifacts``): matplotlib figures and files written
    under ``/workspace/artifacts`` by its runs. Artifacts can be passed as
    :class:`~agentbox.Artifact` objects or by id."""

    def __init__(self, env: "Environment") -> None:
        self._env = env

    def list(self) -> list[Artifact]:
        """Every artifact of the environment (``GET /environments/{id}/artifacts``)."""
        answer = self._env._transport.json(
            "GET", f"/environments/{quote_id(self._env.environment_id)}/artifacts")
        return parse_artifacts(answer.get("artifacts"), self._env.environment_id)

    def _path(self, artifact: Union[str, Artifact, Mapping[str, Any]]) -> str:
        if isinstance(artifact, str):
            if not artifact:
                raise InvalidArgument("artifacts: the artifact id must not be empty")
            return (f"/environments/{quote_id(self._env.environment_id)}/artifacts/"
                    f"{quote_id(artifact)}")
        return _artifact_path(artifact, self._env.environment_id)

    def get(self, artifact: Union[str, Artifact, Mapping[str, Any]]) -> bytes:
        """The artifact's bytes. A missing (or expired) artifact raises
        :class:`SandboxNotFound`."""
        data = _download(self._env._transport, self._path(artifact), None, None)
        assert isinstance(data, bytes)
        return data

    def download(self, artifact: Union[str, Artifact, Mapping[str, Any]],
                 dest: Union[PathLike, BinaryIO]) -> int:
        """Stream the artifact into a local path or binary file object; returns the byte
        count."""
        count = _download(self._env._transport, self._path(artifact), None, dest)
        assert isinstance(count, int)
        return count


class Files:
    """Files in an environment (``env.files``). Relative paths are relative to
    ``/workspace``."""

    def __init__(self, env: "Environment") -> None:
        self._env = env

    def _path(self, suffix: str) -> str:
        return f"/environments/{quote_id(self._env.environment_id)}/files/{suffix}"

    def write(self, path: str, data: Union[str, bytes, bytearray, memoryview]) -> WriteInfo:
        """Create or overwrite ``path`` with ``data`` (parent directories are created).

        ``str`` is stored as UTF-8 text; bytes are sent base64-encoded in JSON, or through the
        streamed raw endpoint when larger than 8 MiB.
        """
        if isinstance(data, str):
            payload: dict[str, Any] = {"path": path, "content": data, "encoding": "utf-8"}
            if len(data) * 4 > RAW_WRITE_THRESHOLD:  # cheap bound before encoding
                encoded = data.encode("utf-8")
                if len(encoded) > RAW_WRITE_THRESHOLD:
                    return self.upload(path, encoded)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
            if len(raw) > RAW_WRITE_THRESHOLD:
                return self.upload(path, raw)
            payload = {"path": path, "content": base64.b64encode(raw).decode("ascii"),
                       "encoding": "base64"}
        else:
            raise InvalidArgument(f"files.write: data must be str or bytes, not "
                                  f"{type(data).__name__}")
        answer = self._env._transport.json("POST", self._path("write"), payload)
        return WriteInfo(path=path, bytes=int(answer.get("bytes", 0) or 0))

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, format: Literal["text", "bytes"] = "text") -> Union[str, bytes]:
        """Read a whole file.

        Args:
            path: the file to read.
            format: ``"text"`` (decoded as UTF-8, invalid bytes replaced) or ``"bytes"``.

        Files above the daemon's JSON read limit are fetched from the raw endpoint
        transparently. A missing file raises :class:`SandboxNotFound`.
        """
        if format not in ("text", "bytes"):
            raise InvalidArgument(f"files.read: format must be 'text' or 'bytes', not "
                                  f"{format!r}")
        try:
            answer = self._env._transport.json("GET", self._path("read"), query={"path": path})
        except PayloadTooLarge:
            raw = self.download(path)
            return raw if format == "bytes" else raw.decode("utf-8", "replace")
        content = answer.get("content", "")
        if not isinstance(content, str):
            content = ""
        if answer.get("encoding") == "base64":
            raw = base64.b64decode(content)
            return raw if format == "bytes" else raw.decode("utf-8", "replace")
        return content.encode("utf-8") if format == "bytes" else content

    def upload(self, path: str, src: Union[bytes, bytearray, PathLike, BinaryIO]) -> WriteInfo:
        """Stream ``src`` into ``path`` through ``PUT files/raw``.

        ``src`` may be bytes, a local file path, or a binary file object (read in 64 KiB
        chunks; a non-seekable stream is sent with chunked transfer encoding).
        """
        transport = self._env._transport
        close_after = False
        body: Any
        headers = {"Content-Type": "application/octet-stream"}
        chunked = False
        if isinstance(src, (bytes, bytearray)):
            body = bytes(src)
            headers["Content-Length"] = str(len(body))
        elif isinstance(src, (str, os.PathLike)):
            body = open(os.fspath(src), "rb")
            close_after = True
            headers["Content-Length"] = str(os.fstat(body.fileno()).st_size)
        elif hasattr(src, "read"):
            body = src
            size = _remaining_size(src)
            if size is None:
                chunked = True
                body = iter(lambda: src.read(_CHUNK), b"")
            else:
                headers["Content-Length"] = str(size)
        else:
            raise InvalidArgument("files.upload: src must be bytes, a path or a binary file")
        try:
            conn, resp = transport.send("PUT", self._path("raw"), query={"path": path},
                                        body=body, headers=headers, chunked=chunked,
                                        timeout=max(transport.timeout, 300.0))
            try:
                transport.raise_for("PUT", self._path("raw"), resp)
                answer = Transport._decode(resp.read())
            finally:
                conn.close()
        finally:
            if close_after:
                body.close()
        count = answer.get("bytes", 0) if isinstance(answer, dict) else 0
        return WriteInfo(path=path, bytes=int(count or 0))

    @overload
    def download(self, path: str) -> bytes: ...

    @overload
    def download(self, path: str, dest: Union[PathLike, BinaryIO]) -> int: ...

    def download(self, path: str,
                 dest: Optional[Union[PathLike, BinaryIO]] = None) -> Union[bytes, int]:
        """Stream ``path`` out of the environment through ``GET files/raw``.

        With no ``dest`` the bytes are returned; with a local path or a binary file object
        they are written there in 64 KiB chunks and the byte count is returned.
        """
        return _download(self._env._transport, self._path("raw"), {"path": path}, dest)

    def list(self, path: str = ".") -> list[EntryInfo]:
        """List the directory ``path`` (default: the workspace)."""
        answer = self._env._transport.json("GET", self._path("list"), query={"path": path})
        base = answer.get("path") if isinstance(answer.get("path"), str) else path
        entries = []
        for e in answer.get("entries") or []:
            if not isinstance(e, dict):
                continue
            name = str(e.get("name", ""))
            entries.append(EntryInfo(name=name, path=posixpath.join(str(base), name),
                                     type=str(e.get("type", "other")),
                                     size=int(e.get("size", 0) or 0),
                                     mode=str(e.get("mode", "")),
                                     mtime=str(e.get("mtime", ""))))
        return entries

    def stat(self, path: str) -> EntryInfo:
        """Metadata of ``path`` (``GET files/stat``; symlinks are followed, a dangling one is
        shown as ``type == "symlink"``). A missing path raises :class:`SandboxNotFound`."""
        e = self._env._transport.json("GET", self._path("stat"), query={"path": path})
        return EntryInfo(name=str(e.get("name", "")), path=path,
                         type=str(e.get("type", "other")), size=int(e.get("size", 0) or 0),
                         mode=str(e.get("mode", "")), mtime=str(e.get("mtime", "")))

    def exists(self, path: str) -> bool:
        """True if ``path`` names an entry (file, directory, ...) in the environment."""
        try:
            self.stat(path)
            return True
        except SandboxNotFound:
            return False

    def make_dir(self, path: str) -> bool:
        """Create directory ``path`` and its parents (like ``mkdir -p``; E2B's name).

        Returns True if it was created, False if it already was a directory; an existing
        file there raises :class:`Conflict`. Only inside ``/workspace``; a symlink among the
        parents raises :class:`InvalidArgument`."""
        answer = self._env._transport.json("POST", self._path("mkdir"), {"path": path})
        return bool(answer.get("created", False))

    def remove(self, path: str, *, recursive: bool = True) -> None:
        """Delete a file, a symlink (the link, never its target) or a directory tree (E2B's
        name). With ``recursive=False`` a non-empty directory raises :class:`Conflict`.
        A missing path raises :class:`SandboxNotFound`. Only inside ``/workspace``."""
        self._env._transport.json("POST", self._path("remove"),
                                  {"path": path, "recursive": bool(recursive)})

    def rename(self, old_path: str, new_path: str, *, overwrite: bool = False) -> None:
        """Move ``old_path`` to ``new_path`` (E2B's name). An existing ``new_path`` raises
        :class:`Conflict` unless ``overwrite``; the destination's directory must exist.
        Both paths must lie inside ``/workspace``."""
        self._env._transport.json("POST", self._path("rename"),
                                  {"source": old_path, "destination": new_path,
                                   "overwrite": bool(overwrite)})


def _remaining_size(f: Any) -> Optional[int]:
    try:
        if not f.seekable():
            return None
        pos = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(pos)
        return int(end - pos)
    except (AttributeError, OSError, ValueError):
        return None


class Environment:
    """A stateful sandbox environment on esbd (seed 004): a shell session plus a
    ``/workspace``. Create one with :meth:`Sandbox.create`; use it as a context manager so it
    is always deleted::

        with Sandbox.create() as env:
            env.commands.run("echo hi").stdout

    Attributes:
        environment_id: the daemon's id (``env_...``).
        commands: :class:`Commands`. files: :class:`Files`. artifacts: :class:`Artifacts`.
        data: the environment record from the last create/info call.
    """

    def __init__(self, transport: Transport, environment_id: str,
                 data: Optional[Mapping[str, Any]] = None, *,
                 keep_alive: Union[bool, float] = False,
                 ttl_seconds: Optional[int] = None) -> None:
        self._transport = transport
        self.environment_id = environment_id
        self.data: dict[str, Any] = dict(data or {})
        self.commands = Commands(self)
        self.files = Files(self)
        self.artifacts = Artifacts(self)
        self._closed = False
        self._ttl = ttl_seconds
        self._stop = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self.keep_alive_error: Optional[BaseException] = None
        if keep_alive:
            interval = (float(keep_alive) if not isinstance(keep_alive, bool)
                        else min(60.0, max(1.0, (ttl_seconds or 180) / 3.0)))
            self.start_keep_alive(interval)

    @property
    def id(self) -> str:
        """Alias of :attr:`environment_id`."""
        return self.environment_id

    @property
    def sandbox_id(self) -> str:
        """Alias of :attr:`environment_id` (E2B's name)."""
        return self.environment_id

    @property
    def url(self) -> str:
        """The daemon URL this environment lives on."""
        return self._transport.url

    def __repr__(self) -> str:
        return f"Environment({self.environment_id!r}, url={self._transport.url!r})"

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except SandboxError as cleanup:  # never hide the body's own exception
            warnings.warn(f"agentbox: could not delete {self.environment_id}: {cleanup}",
                          RuntimeWarning, stacklevel=2)

    def run_code(self, code: str, *, timeout_ms: int = 30_000,
                 memory_limit_mb: Optional[int] = None,
                 allowed_modules: Optional[Sequence[str]] = None,
                 packages: Optional[Sequence[str]] = None,
                 figure_formats: Optional[Sequence[str]] = None,
                 on_stdout: Optional[OutputHandler] = None,
                 on_stderr: Optional[OutputHandler] = None,
                 on_install: Optional[OutputHandler] = None, stream: Optional[bool] = None,
                 request_timeout: Optional[float] = None,
                 cancel: Optional[CancelToken] = None,
                 intent: Optional[str] = None) -> SandboxResult:
        """Run Python ``code`` in the environment's stateful interpreter
        (``POST /environments/{id}/run``): globals, imports and definitions persist between
        calls, like notebook cells.

        Args:
            code: the cell's source.
            timeout_ms: the cell's time limit (1–600 000 ms). A timeout is not an exception:
                the result has ``timed_out == True`` and exit code 124.
            memory_limit_mb, allowed_modules: as in :class:`SandboxConfig`.
            packages: requirement strings pip installs from the daemon's package index before
                the cell runs (container environments); see ``result.packages``.
            figure_formats: ``["png"]`` (daemon default) or ``["png", "svg"]``.
            on_stdout / on_stderr: called with output text as it arrives (SSE streaming).
            on_install: called with pip's output text while ``packages`` install.
            stream: force streaming on (or off) regardless of callbacks.
            request_timeout: HTTP timeout in seconds (default: the time limit plus 30 s,
                plus 300 s when ``packages`` are given).
            cancel: a :class:`CancelToken` to abort from another thread (implies streaming).
            intent: an intent name from the daemon's catalogue, active for this cell only.

        Returns:
            a :class:`SandboxResult` with ``value`` (the final expression's ``repr``),
            ``table`` (a final pandas DataFrame as data) and ``artifacts``; download those
            with :attr:`artifacts`.
        """
        if not isinstance(code, str):
            raise InvalidArgument("run_code: code must be a string")
        cfg = SandboxConfig(timeout_ms=timeout_ms, memory_limit_mb=memory_limit_mb,
                            allowed_modules=allowed_modules, packages=packages,
                            figure_formats=figure_formats)  # validates every option
        payload = _run_payload(code, cfg, runtime=False)
        if _check_intent(intent, "run_code"):
            payload["intent"] = intent
        streaming = stream if stream is not None else (
            on_stdout is not None or on_stderr is not None or on_install is not None
            or cancel is not None)
        answer, elapsed = _run_python(
            self._transport, f"/environments/{quote_id(self.environment_id)}/run", payload,
            http_timeout=request_timeout if request_timeout is not None
            else _run_timeout(cfg.timeout_ms, cfg.packages),
            streaming=streaming,
            handlers={"stdout": on_stdout, "stderr": on_stderr, "install": on_install},
            cancel=cancel)
        answer.setdefault("environment_id", self.environment_id)
        return SandboxResult.from_run_answer(answer, elapsed_ms=elapsed)

    run = run_code

    # -- network governance ---------------------------------------------------------------
    @property
    def network(self) -> Union[str, dict[str, Any]]:
        """The environment's network policy as the daemon holds it now (``GET
        /environments/{id}/network``): ``"none"`` or the policy dict, defaults filled in.
        Assigning to it is :meth:`set_network`."""
        return _network_from_answer(self._transport.json(
            "GET", f"/environments/{quote_id(self.environment_id)}/network"))

    @network.setter
    def network(self, policy: NetworkPolicy) -> None:
        self.set_network(policy)

    def set_network(self, policy: NetworkPolicy) -> Union[str, dict[str, Any]]:
        """Replace the network policy live (``PUT /environments/{id}/network``); new
        connections and requests follow it at once. Returns the policy as stored. Whether an
        environment has egress at all is fixed at create: ``"none"`` on a governed one (or a
        policy on a ``"none"`` one) raises :class:`Conflict`; to cut all egress set
        ``{"mode": "blocked"}``."""
        body = {"network": _check_network(policy, "set_network")}
        return _network_from_answer(self._transport.json(
            "PUT", f"/environments/{quote_id(self.environment_id)}/network", body))

    def intent(self, name: str, *, ttl_seconds: Optional[int] = None) -> "IntentScope":
        """A context manager that keeps the catalogue intent ``name`` active while its block
        runs: its hosts join the allowlist on entry and leave it on exit (or when
        ``ttl_seconds`` runs out, whichever comes first)::

            with env.intent("check-weather", ttl_seconds=300):
                env.commands.run("curl -s https://weather.example/today")
        """
        return IntentScope(self, name, ttl_seconds)

    def activate_intent(self, name: str, *, ttl_seconds: Optional[int] = None
                        ) -> dict[str, Any]:
        """``POST /environments/{id}/intents``: activate a catalogue intent (until
        ``ttl_seconds`` pass — the daemon's default, 300 s, if omitted — or until
        :meth:`deactivate_intent`). Activating an active intent extends it. Returns the
        daemon's answer: ``{"environment_id", "network", "intents": [...]}``. An intent not in
        the catalogue raises :class:`InvalidArgument`; on a ``"none"`` environment,
        :class:`Conflict`."""
        _check_intent(name, "activate_intent")
        body: dict[str, Any] = {"intent": name}
        if ttl_seconds is not None:
            if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) \
                    or ttl_seconds < 1:
                raise InvalidArgument("activate_intent: ttl_seconds must be a positive int")
            body["ttl_seconds"] = ttl_seconds
        return self._transport.json(
            "POST", f"/environments/{quote_id(self.environment_id)}/intents", body)

    def deactivate_intent(self, name: str) -> bool:
        """``DELETE /environments/{id}/intents/{name}``. True if it was active, False if the
        daemon did not have it (already expired or never activated)."""
        _check_intent(name, "deactivate_intent")
        try:
            self._transport.json("DELETE", f"/environments/{quote_id(self.environment_id)}"
                                 f"/intents/{quote_id(name)}")
        except SandboxNotFound:
            return False
        return True

    def intents(self) -> list[dict[str, Any]]:
        """``GET /environments/{id}/intents``: the intents active now (``{"intent", "allow",
        "scope": "environment"|"call", "expires_at", "expires_in_seconds"}``)."""
        answer = self._transport.json(
            "GET", f"/environments/{quote_id(self.environment_id)}/intents")
        found = answer.get("intents")
        return [i for i in found if isinstance(i, dict)] if isinstance(found, list) else []

    def ca_pem(self) -> str:
        """``GET /environments/{id}/ca.pem``: the environment's own CA certificate (PEM), the
        one its governance proxy signs inspected TLS with; the sandbox already trusts it."""
        data = _download(self._transport, f"/environments/{quote_id(self.environment_id)}"
                         "/ca.pem", None, None)
        assert isinstance(data, bytes)
        return data.decode("ascii", "replace")

    # -- time travel (docs/api.md "Steps") ------------------------------------------------
    def steps(self, *, limit: Optional[int] = None, before: Optional[int] = None
              ) -> list[Step]:
        """The step log, newest first (``GET /environments/{id}/steps``): at most ``limit``
        steps (the daemon's default: 50) numbered below ``before``. Each :class:`Step` has
        the summary; its ``variables``, ``files``, ... are fetched when first read."""
        query: dict[str, Any] = {}
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise InvalidArgument("steps: limit must be a positive int")
            query["limit"] = limit
        if before is not None:
            query["before"] = check_step_number(before, "steps(before=)")
        answer = self._transport.json(
            "GET", f"/environments/{quote_id(self.environment_id)}/steps", query=query or None)
        found = answer.get("steps")
        if not isinstance(found, list):
            raise SandboxError(f"esbd answered the step log without 'steps': {answer!r:.200}")
        return [Step(self._transport, self.environment_id, s) for s in found
                if isinstance(s, dict)]

    def step(self, n: int) -> Step:
        """Step ``n`` with its detail (``GET /environments/{id}/steps/{n}``): ``.variables``,
        ``.files`` (the /workspace tree then), ``.changes``, ``.input``, ``.output``,
        ``.shell``; ``.file(path)`` and ``.diff(path)`` read its files. Raises
        :class:`SandboxNotFound` for an unknown step."""
        check_step_number(n, "step")
        data = fetch_detail(self._transport,
                            f"/environments/{quote_id(self.environment_id)}/steps/{n}")
        return Step(self._transport, self.environment_id, data, detailed=True)

    def rewind(self, n: int) -> dict[str, Any]:
        """Make the environment what it was after step ``n``, in place (``POST
        /environments/{id}/rewind``); the steps after it stay as a branch. Returns ``{"head",
        "memory": "snapshot"|"none", "environment"}``: with ``"none"`` the files and shell
        state are back but running processes and the Python session's memory are not.
        Raises :class:`Conflict` when the step has no state to go back to (capture off)."""
        check_step_number(n, "rewind")
        answer = self._transport.json(
            "POST", f"/environments/{quote_id(self.environment_id)}/rewind", {"step": n})
        env = answer.get("environment")
        if isinstance(env, dict):
            self.data = env
        return answer

    def fork(self, n: int, *, keep_alive: Union[bool, float] = False) -> "Environment":
        """A new, independent environment at step ``n`` (``POST /environments/{id}/fork``);
        this one is untouched. The new one's ``data`` has ``forked_from`` and ``memory``."""
        check_step_number(n, "fork")
        data = self._transport.json(
            "POST", f"/environments/{quote_id(self.environment_id)}/fork", {"step": n})
        env_id = data.get("environment_id")
        if not isinstance(env_id, str) or not env_id:
            raise SandboxError(f"esbd forked an environment without an id: {data!r:.200}")
        return Environment(self._transport, env_id, data, keep_alive=keep_alive,
                           ttl_seconds=self._ttl)

    def info(self) -> dict[str, Any]:
        """Fetch the environment record (state, limits, timestamps, usage)."""
        self.data = self._transport.json("GET", f"/environments/{quote_id(self.environment_id)}")
        return self.data

    def is_running(self) -> bool:
        """True while the daemon reports the environment as ``running``."""
        try:
            return self.info().get("state") == "running"
        except SandboxNotFound:
            return False

    def heartbeat(self, ttl_seconds: Optional[int] = None) -> str:
        """Extend the lease to now + ``ttl_seconds`` (daemon default if omitted); returns the
        new ``expires_at``."""
        payload = {"ttl_seconds": int(ttl_seconds)} if ttl_seconds is not None else None
        answer = self._transport.json(
            "POST", f"/environments/{quote_id(self.environment_id)}/heartbeat", payload)
        return str(answer.get("expires_at", ""))

    set_timeout = heartbeat

    def start_keep_alive(self, interval: float) -> None:
        """Send a heartbeat every ``interval`` seconds from a daemon thread until
        :meth:`close`. The thread stops by itself if the environment is gone; the last
        failure is kept in :attr:`keep_alive_error`."""
        if self._keeper is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.heartbeat(self._ttl)
                    self.keep_alive_error = None
                except SandboxNotFound as exc:
                    self.keep_alive_error = exc
                    return
                except SandboxError as exc:
                    self.keep_alive_error = exc

        self._keeper = threading.Thread(target=loop, daemon=True,
                                        name=f"agentbox-keepalive-{self.environment_id}")
        self._keeper.start()

    def stop_keep_alive(self) -> None:
        """Stop the keep-alive thread, if any."""
        self._stop.set()
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=5)

    def kill(self) -> bool:
        """Destroy the environment. Returns True if the daemon confirmed it (also when it was
        already destroyed), False if the daemon does not know it (404)."""
        self.stop_keep_alive()
        try:
            self._transport.json("DELETE", f"/environments/{quote_id(self.environment_id)}")
        except SandboxNotFound:
            self._closed = True
            return False
        self._closed = True
        return True

    def close(self) -> None:
        """Destroy the environment; safe to call more than once."""
        if self._closed:
            self.stop_keep_alive()
            return
        self.kill()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`kill` succeeded."""
        return self._closed


class IntentScope:
    """``with env.intent("check-weather"):`` — activates the intent on entry (``POST
    .../intents``) and deactivates it on exit (``DELETE .../intents/{name}``), also when the
    block raises. ``info`` holds the daemon's answer to the activation (``{"environment_id",
    "network", "intents": [...]}``, each intent with its hosts and expiry)."""

    def __init__(self, env: Environment, name: str, ttl_seconds: Optional[int]) -> None:
        _check_intent(name, "intent")
        self.env = env
        self.name = name
        self.ttl_seconds = ttl_seconds
        self.info: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"IntentScope({self.name!r}, environment={self.env.environment_id!r})"

    def __enter__(self) -> "IntentScope":
        self.info = self.env.activate_intent(self.name, ttl_seconds=self.ttl_seconds)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.env.deactivate_intent(self.name)  # False when the TTL already ended it
            return
        try:
            self.env.deactivate_intent(self.name)
        except SandboxError as cleanup:  # never hide the body's own exception
            warnings.warn(f"agentbox: could not deactivate intent {self.name!r} on "
                          f"{self.env.environment_id}: {cleanup}", RuntimeWarning,
                          stacklevel=2)


def _run_payload(code: str, cfg: SandboxConfig, *, runtime: bool) -> dict[str, Any]:
    """The JSON body of ``POST /run`` (``runtime=True``) or ``POST /environments/{id}/run``
    (which takes no ``runtime``) for ``code`` under ``cfg``; unset options are left out."""
    payload: dict[str, Any] = {"code": code, "timeout_ms": cfg.timeout_ms}
    if runtime:
        payload["runtime"] = cfg.runtime
    if cfg.memory_limit_mb is not None:
        payload["memory_limit_mb"] = cfg.memory_limit_mb
    if cfg.allowed_modules is not None:
        payload["allowed_modules"] = list(cfg.allowed_modules)
    if cfg.packages:
        payload["packages"] = list(cfg.packages)
    if cfg.figure_formats is not None:
        payload["figure_formats"] = check_figure_formats(cfg.figure_formats,
                                                         "figure_formats")
    return payload


class Sandbox:
    """The client for one esbd daemon, and seed 002's front door::

        from agentbox import Sandbox
        print(Sandbox().run("print(1 + 1)").stdout)

    Args:
        config: how :meth:`run` executes code (:class:`SandboxConfig`).
        url: the daemon's base URL (default: ``$AGENTBOX_URL``, else http://127.0.0.1:8080).
        api_key: the Bearer key (default: ``$AGENTBOX_API_KEY``; none in dev mode).
        request_timeout: seconds to wait for an ordinary HTTP answer (default 30).
    """

    def __init__(self, config: Optional[SandboxConfig] = None, *, url: Optional[str] = None,
                 api_key: Optional[str] = None, request_timeout: float = 30.0) -> None:
        self.config = config or SandboxConfig()
        self._transport = Transport(_env_url(url), _env_key(api_key), request_timeout)
        self._has_run_endpoint: Optional[bool] = None

    @property
    def url(self) -> str:
        """The daemon's base URL."""
        return self._transport.url

    def __repr__(self) -> str:
        return f"Sandbox(url={self.url!r}, runtime={self.config.runtime!r})"

    # -- one-shot code ----------------------------------------------------------------------
    def run(self, code: str, *, config: Optional[SandboxConfig] = None,
            on_stdout: Optional[OutputHandler] = None,
            on_stderr: Optional[OutputHandler] = None,
            on_install: Optional[OutputHandler] = None, stream: Optional[bool] = None,
            cancel: Optional[CancelToken] = None) -> SandboxResult:
        """Run Python ``code`` once, in a fresh sandbox, and return its output.

        Uses ``POST /run`` when the daemon has it. A daemon without it (404/405), or whose
        ``/run`` answers 400 with the error code ``"tier_unavailable"`` while ``runtime`` is
        not ``"nano"``, gets the container fallback: create an environment, write the code to a
        file, run ``python3`` on it with the configured timeout, and delete the environment.
        ``result.via`` tells which path ran.

        Args:
            code: the Python source.
            config: overrides this client's :class:`SandboxConfig` for this call.
            on_stdout / on_stderr: called with output text as it arrives; giving either makes
                the request stream (SSE). Chunks of one stream arrive in order; invalid UTF-8
                becomes U+FFFD.
            on_install: called with pip's output while ``config.packages`` install.
            stream: force streaming on (or off) regardless of callbacks.
            cancel: a :class:`CancelToken` to abort from another thread (implies streaming).

        Returns:
            the :class:`SandboxResult`; its ``artifacts`` (figures, files under
            ``/workspace/artifacts``) are fetched with :meth:`download_artifact` or
            :meth:`save_artifact`.
        """
        cfg = config or self.config
        if not isinstance(code, str):
            raise InvalidArgument("run: code must be a string")
        streaming = stream if stream is not None else (
            on_stdout is not None or on_stderr is not None or on_install is not None
            or cancel is not None)
        if self._has_run_endpoint is not False:
            payload = _run_payload(code, cfg, runtime=True)
            try:
                answer, elapsed = _run_python(
                    self._transport, "/run", payload,
                    http_timeout=_run_timeout(cfg.timeout_ms, cfg.packages),
                    streaming=streaming,
                    handlers={"stdout": on_stdout, "stderr": on_stderr,
                              "install": on_install},
                    cancel=cancel)
            except SandboxError as exc:
                if exc.status in (404, 405):
                    self._has_run_endpoint = False  # no such route: never ask again
                elif not (exc.status == 400 and exc.code == "tier_unavailable"
                          and cfg.runtime != "nano"):
                    raise
                # else: the route exists but the run's tier is missing (esbd answers 400 with
                # the code "tier_unavailable"); fall back to an environment for this call.
            else:
                self._has_run_endpoint = True
                return SandboxResult.from_run_answer(answer, elapsed_ms=elapsed)
        return self._run_in_environment(code, cfg, on_stdout=on_stdout, on_stderr=on_stderr,
                                         cancel=cancel)

    # -- artifacts --------------------------------------------------------------------------
    def download_artifact(self, artifact: Union[Artifact, Mapping[str, Any]]) -> bytes:
        """The bytes of an artifact from a run's result (``GET
        /environments/{env}/artifacts/{id}``). Works after the environment is gone, until the
        daemon expires the artifact (then :class:`SandboxNotFound`)."""
        data = _download(self._transport, _artifact_path(artifact), None, None)
        assert isinstance(data, bytes)
        return data

    def save_artifact(self, artifact: Union[Artifact, Mapping[str, Any]],
                      dest: Union[PathLike, BinaryIO, None] = None) -> int:
        """Stream an artifact into ``dest`` (a local path, a directory — the artifact's name
        is used inside it —, or a binary file object; default: its name in the current
        directory). Returns the byte count."""
        if isinstance(artifact, Mapping):
            parsed = Artifact.from_answer(artifact)
            if parsed is None:
                raise InvalidArgument("save_artifact: the mapping has no 'id'")
            artifact = parsed
        if dest is None or (isinstance(dest, (str, os.PathLike))
                            and os.path.isdir(os.fspath(dest))):
            name = posixpath.basename(artifact.name.replace("\\", "/")) or artifact.id
            if name in (".", ".."):
                name = artifact.id
            dest = os.path.join(os.fspath(dest) if dest is not None else ".", name)
        count = _download(self._transport, _artifact_path(artifact), None, dest)
        assert isinstance(count, int)
        return count

    def _run_in_environment(self, code: str, cfg: SandboxConfig, *,
                            on_stdout: Optional[OutputHandler] = None,
                            on_stderr: Optional[OutputHandler] = None,
                            cancel: Optional[CancelToken] = None) -> SandboxResult:
        started = time.monotonic()
        seconds = max(1, math.ceil(cfg.timeout_ms / 1000.0))
        options: dict[str, Any] = {"ttl_seconds": min(86400, max(60, seconds + 120))}
        if cfg.runtime == "nano":
            options["runtime"] = "nano"
        if cfg.memory_limit_mb is not None:
            options["memory_mb"] = max(32, cfg.memory_limit_mb)
        env = self._create(options, keep_alive=False)
        try:
            if cfg.packages:
                missing = self._missing_packages(env, cfg.packages)
                if missing:
                    msg = (f"packages not installed in the sandbox image: {', '.join(missing)} "
                           "(this daemon has no POST /run, so the SDK ran the code in a "
                           "container environment, which cannot install packages)\n")
                    return SandboxResult(stdout="", stderr=msg, exit_code=1, error=True,
                                         duration_ms=(time.monotonic() - started) * 1000.0,
                                         runtime=str(env.data.get("runtime") or "container"),
                                         via="environment")
            script = f".agentbox/run_{secrets.token_hex(6)}.py"
            env.files.write(script, code)
            result = env.commands.run(f"python3 {shlex.quote(script)}", timeout=seconds,
                                      on_stdout=on_stdout, on_stderr=on_stderr,
                                      cancel=cancel)
            exception = parse_traceback(result.stderr) if result.exit_code != 0 else None
            return SandboxResult(stdout=result.stdout, stderr=result.stderr,
                                 exit_code=result.exit_code, error=result.exit_code != 0,
                                 duration_ms=result.duration_ms or
                                 (time.monotonic() - started) * 1000.0,
                                 timed_out=result.timed_out, truncated=result.truncated,
                                 exception=exception,
                                 runtime=str(env.data.get("runtime") or "container"),
                                 reason="POST /run not available; ran in a container "
                                        "environment", via="environment", raw=result.raw)
        finally:
            try:
                env.kill()
            except SandboxError as exc:
                warnings.warn(f"agentbox: could not delete {env.environment_id}: {exc}",
                              RuntimeWarning, stacklevel=3)

    @staticmethod
    def _missing_packages(env: Environment, packages: Any) -> list[str]:
        probe = ("import sys, importlib.metadata as m\n"
                 "for n in sys.argv[1:]:\n"
                 "    try: m.distribution(n)\n"
                 "    except m.PackageNotFoundError: print(n)\n")
        cmd = "python3 -c " + shlex.quote(probe) + " " + " ".join(
            shlex.quote(p) for p in packages)
        res = env.commands.run(cmd, timeout=60)
        if res.exit_code != 0:
            return list(packages)
        return [line.strip() for line in res.stdout.splitlines() if line.strip()]

    # -- environments -----------------------------------------------------------------------
    def _create(self, options: Mapping[str, Any], *, keep_alive: Union[bool, float],
                ) -> Environment:
        data = self._transport.json("POST", "/environments", dict(options))
        env_id = data.get("environment_id")
        if not isinstance(env_id, str) or not env_id:
            raise SandboxError(f"esbd created an environment without an id: {data!r:.200}")
        ttl = options.get("ttl_seconds")
        return Environment(self._transport, env_id, data, keep_alive=keep_alive,
                           ttl_seconds=int(ttl) if ttl is not None else None)

    @_hybridmethod
    def create(self_or_cls: Any, *, image: Optional[str] = None,
               runtime: Optional[str] = None, cpu: Optional[float] = None,
               memory_mb: Optional[int] = None, pids: Optional[int] = None,
               disk_mb: Optional[int] = None, ttl_seconds: Optional[int] = None,
               envs: Optional[Mapping[str, str]] = None,
               network: Optional[NetworkPolicy] = None,
               volumes: Optional[Sequence[Mapping[str, Any]]] = None,
               steps: Optional[Union[bool, Mapping[str, Any]]] = None,
               keep_alive: Union[bool, float] = False, url: Optional[str] = None,
               api_key: Optional[str] = None, request_timeout: float = 30.0) -> Environment:
        """Create a stateful :class:`Environment` (``POST /environments``).

        Callable on the class (``Sandbox.create(url=...)``) or on a client instance
        (``box.create()``, which reuses its URL and key). Only the options you pass are sent;
        the daemon applies its defaults to the rest.

        Args:
            image: rootfs image name. runtime: ``"container"``, ``"gvisor"``, ``"nano"``,
                ``"auto"`` or ``"microvm"``; ``"heavy"`` is accepted as ``"container"``.
            cpu, memory_mb, pids, disk_mb: resource limits. ttl_seconds: lease length.
            envs: environment variables for every command.
            network: ``"none"`` (the daemon's default: no network) or a policy dict, e.g.
                ``{"mode": "allowlist", "allow": ["pypi.org", "files.pythonhosted.org"]}``:
                egress then goes only through esbd's governance proxy (allow/deny rules,
                TLS inspection, DLP, audit); see :attr:`Environment.network`.
            volumes: persistent volumes to mount, e.g. ``[{"name": "data", "path":
                "/mnt/data", "read_only": False}]`` (see :meth:`create_volume`).
            steps: the step log (time travel; on by default): ``False`` turns capture off,
                a dict sets its limits, e.g. ``{"max_steps": 100, "max_bytes": 64 << 20}``
                (also ``capture``, ``max_live_memory``, ``ttl_s``); see
                :meth:`Environment.steps`.
            keep_alive: ``True`` (heartbeat every ttl/3 s, at most 60 s) or an interval in
                seconds; the thread stops at :meth:`Environment.close`.
        """
        if isinstance(self_or_cls, Sandbox):
            client = self_or_cls
            if url is not None or api_key is not None:
                client = Sandbox(client.config, url=url or client.url,
                                 api_key=api_key if api_key is not None
                                 else client._transport.api_key,
                                 request_timeout=request_timeout)
        else:
            client = Sandbox(url=url, api_key=api_key, request_timeout=request_timeout)
        options: dict[str, Any] = {}
        if runtime == "heavy":
            runtime = "container"
        for key, value in (("image", image), ("runtime", runtime), ("cpu", cpu),
                           ("memory_mb", memory_mb), ("pids", pids), ("disk_mb", disk_mb),
                           ("ttl_seconds", ttl_seconds)):
            if value is not None:
                options[key] = value
        if network is not None:
            options["network"] = _check_network(network, "create")
        if envs:
            options["env"] = {str(k): str(v) for k, v in envs.items()}
        if volumes:
            options["volumes"] = [dict(v) for v in volumes]
        if steps is not None and steps is not True:
            options["steps"] = check_steps_option(steps)
        return client._create(options, keep_alive=keep_alive)

    @_hybridmethod
    def connect(self_or_cls: Any, environment_id: str, *, url: Optional[str] = None,
                api_key: Optional[str] = None, keep_alive: Union[bool, float] = False,
                request_timeout: float = 30.0) -> Environment:
        """Attach to an existing environment by id (raises :class:`SandboxNotFound` if the
        daemon does not know it or it is destroyed)."""
        if isinstance(self_or_cls, Sandbox) and url is None and api_key is None:
            transport = self_or_cls._transport
        else:
            transport = Transport(_env_url(url), _env_key(api_key), request_timeout)
        env = Environment(transport, environment_id)
        data = env.info()
        if data.get("state") != "running":
            raise SandboxNotFound(f"environment {environment_id} is {data.get('state')}"
                                  + (f" ({data.get('destroy_reason')})"
                                     if data.get("destroy_reason") else ""),
                                  code="not_found", status=404, body=data)
        if keep_alive:
            env.start_keep_alive(float(keep_alive) if not isinstance(keep_alive, bool)
                                 else 60.0)
        return env

    def list(self, *, all: bool = False) -> list[dict[str, Any]]:
        """The caller's environments (``GET /environments``); ``all=True`` includes
        destroyed ones."""
        answer = self._transport.json("GET", "/environments", query={"all": 1} if all else None)
        envs = answer.get("environments")
        return [e for e in envs if isinstance(e, dict)] if isinstance(envs, list) else []

    # -- volumes ----------------------------------------------------------------------------
    def create_volume(self, name: str, size_mb: int) -> dict[str, Any]:
        """``POST /volumes``: a persistent volume of this tenant (ext4, hard cap ``size_mb``)
        that outlives environments; mount it with ``create(volumes=[...])``."""
        return self._transport.json("POST", "/volumes", {"name": name, "size_mb": size_mb})

    def list_volumes(self) -> list[dict[str, Any]]:
        """``GET /volumes``: this tenant's volumes with ``mounted_by`` (an environment id or
        None)."""
        answer = self._transport.json("GET", "/volumes")
        vols = answer.get("volumes")
        return [v for v in vols if isinstance(v, dict)] if isinstance(vols, list) else []

    def delete_volume(self, name: str) -> None:
        """``DELETE /volumes/{name}``: deletes it and its contents (409 while mounted)."""
        self._transport.json("DELETE", "/volumes/" + quote_id(name))

    def audit(self, *, since: Optional[str] = None, until: Optional[str] = None,
              environment_id: Optional[str] = None, q: Optional[str] = None,
              limit: Optional[int] = None) -> list[dict[str, Any]]:
        """``GET /audit``: this tenant's audit rows (``since``/``until`` RFC 3339 times,
        ``q`` an FTS5 keyword query over action and detail, ``limit`` 1–1000)."""
        answer = self._transport.json("GET", "/audit", query={
            "since": since, "until": until, "environment_id": environment_id, "q": q,
            "limit": limit})
        entries = answer.get("entries")
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: daemon status, version and drivers."""
        return self._transport.json("GET", "/healthz")

    def tools(self) -> Any:
        """``GET /tools``: the meta-tool catalogue as the daemon serves it."""
        return self._transport.json("GET", "/tools")
