"""Plain data types returned and accepted by the agentbox SDK."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

from .errors import InvalidArgument

__all__ = [
    "Runtime",
    "SandboxConfig",
    "ExecutionError",
    "SandboxResult",
    "CommandResult",
    "EntryInfo",
    "WriteInfo",
]

Runtime = Literal["auto", "nano", "heavy"]
_RUNTIMES = ("auto", "nano", "heavy")


@dataclass
class SandboxConfig:
    """How :meth:`agentbox.Sandbox.run` executes code (seed 002 §5).

    Attributes:
        runtime: ``"auto"`` (the daemon picks the tier), ``"nano"`` (WebAssembly tier) or
            ``"heavy"`` (full Linux container).
        timeout_ms: wall-clock limit for one ``run``, in milliseconds (default 30 000).
        memory_limit_mb: memory cap in MiB; ``None`` keeps the daemon's default.
        allowed_modules: modules the code may import (enforced by the nano tier; ignored by the
            container fallback, which is isolated by the kernel instead).
        packages: distributions the code needs (e.g. ``["pandas"]``); forces the heavy tier.
            The container fallback checks that they are installed in the image and fails the
            run with a clear message if one is missing (it cannot download: no network).
    """

    runtime: Runtime = "auto"
    timeout_ms: int = 30_000
    memory_limit_mb: Optional[int] = None
    allowed_modules: Optional[Sequence[str]] = None
    packages: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        if self.runtime not in _RUNTIMES:
            raise InvalidArgument(f"SandboxConfig.runtime must be one of {_RUNTIMES}, "
                                  f"not {self.runtime!r}")
        if not isinstance(self.timeout_ms, int) or self.timeout_ms <= 0:
            raise InvalidArgument(f"SandboxConfig.timeout_ms must be a positive integer, "
                                  f"not {self.timeout_ms!r}")
        if self.memory_limit_mb is not None and (
                not isinstance(self.memory_limit_mb, int) or self.memory_limit_mb <= 0):
            raise InvalidArgument(f"SandboxConfig.memory_limit_mb must be a positive integer, "
                                  f"not {self.memory_limit_mb!r}")
        for name in ("allowed_modules", "packages"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise InvalidArgument(f"SandboxConfig.{name} must be a list of names")
            setattr(self, name, list(value))


@dataclass
class ExecutionError:
    """A Python exception raised by code run with :meth:`agentbox.Sandbox.run`.

    Attributes:
        name: the exception type, e.g. ``"ZeroDivisionError"``.
        value: the exception message.
        traceback: the formatted traceback text.
    """

    name: str
    value: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.value}" if self.value else self.name


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|"
                       r"StopIteration|[A-Z]\w*))(?::\s?(.*))?$")


def parse_traceback(stderr: str) -> Optional[ExecutionError]:
    """Extract the final exception from CPython's ``Traceback ...`` text in ``stderr``."""
    start = stderr.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    text = stderr[start:].rstrip()
    lines = text.splitlines()
    for line in reversed(lines):
        if line.startswith((" ", "\t")) or not line.strip():
            continue
        m = _EXC_LINE.match(line.strip())
        if m:
            return ExecutionError(m.group(1), m.group(2) or "", text)
        break
    return ExecutionError("Error", lines[-1].strip() if lines else "", text)


@dataclass
class SandboxResult:
    """The outcome of :meth:`agentbox.Sandbox.run`.

    Attributes:
        stdout: everything the code printed to standard output.
        stderr: everything it printed to standard error.
        exit_code: the interpreter's exit code (124 after a timeout).
        error: true iff the run failed (``exit_code != 0``), as in seed 004's shapes.
        duration_ms: run time measured by the daemon (wall clock on the client if absent).
        timed_out: true when the time limit stopped the code.
        truncated: true when output was cut at the daemon's cap.
        exception: the Python exception that ended the run, when there was one.
        runtime: where the code ran (``"nano"``, ``"container"``, ...), when known.
        reason: why the router chose that tier, when the daemon says.
        via: ``"run"`` when ``POST /run`` answered, ``"environment"`` for the container
            fallback (create an environment, write the file, run ``python3``, delete).
        raw: the daemon's answer as received.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    error: bool = False
    duration_ms: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    exception: Optional[ExecutionError] = None
    runtime: Optional[str] = None
    reason: Optional[str] = None
    via: str = "run"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True when the code exited with code 0."""
        return self.exit_code == 0 and not self.error

    @classmethod
    def from_run_answer(cls, data: Mapping[str, Any], *, elapsed_ms: float) -> "SandboxResult":
        """Build a result from a ``POST /run`` answer, tolerating both a boolean ``error`` and
        a structured one (``{"type", "message", "traceback"}``)."""
        stdout = _text(data.get("stdout"))
        stderr = _text(data.get("stderr"))
        exit_code = _int(data.get("exit_code"), 0)
        raw_error = data.get("error")
        exception: Optional[ExecutionError] = None
        for key in ("exception", "python_error", "error"):
            value = data.get(key)
            if isinstance(value, Mapping):
                exception = ExecutionError(
                    _text(value.get("type") or value.get("name") or "Error"),
                    _text(value.get("message") or value.get("value")),
                    _text(value.get("traceback")))
                break
        if exception is None and exit_code != 0:
            exception = parse_traceback(stderr)
        error = bool(raw_error) if raw_error is not None else exit_code != 0
        tier = data.get("tier") if isinstance(data.get("tier"), str) else None
        runtime = data.get("runtime") if isinstance(data.get("runtime"), str) else tier
        reason = data.get("reason") if isinstance(data.get("reason"), str) else None
        route = data.get("route")
        if isinstance(route, Mapping):
            runtime = runtime or _opt_text(route.get("tier"))
            reason = reason or _opt_text(route.get("reason"))
        duration = data.get("duration_ms")
        return cls(stdout=stdout, stderr=stderr, exit_code=exit_code,
                   error=error or exit_code != 0 or exception is not None,
                   duration_ms=float(duration) if isinstance(duration, (int, float))
                   else elapsed_ms,
                   timed_out=bool(data.get("timed_out", False)),
                   truncated=bool(data.get("truncated", False)), exception=exception,
                   runtime=runtime, reason=reason, via="run", raw=dict(data))


@dataclass
class CommandResult:
    """The outcome of one shell command (``POST /environments/{id}/execute``).

    ``error`` is a boolean as in seed 004 (true iff ``exit_code != 0``), not a message: read
    ``stderr`` for the text. After a timeout ``exit_code`` is 124 and ``timed_out`` is true.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    error: bool = False
    duration_ms: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True when the command exited with code 0."""
        return self.exit_code == 0

    @classmethod
    def from_answer(cls, data: Mapping[str, Any]) -> "CommandResult":
        """Build a result from the daemon's JSON answer (or SSE ``result`` event)."""
        exit_code = _int(data.get("exit_code"), -1)
        raw_error = data.get("error")
        duration = data.get("duration_ms")
        return cls(stdout=_text(data.get("stdout")), stderr=_text(data.get("stderr")),
                   exit_code=exit_code,
                   error=bool(raw_error) if isinstance(raw_error, bool) else exit_code != 0,
                   duration_ms=float(duration) if isinstance(duration, (int, float)) else 0.0,
                   timed_out=bool(data.get("timed_out", False)),
                   truncated=bool(data.get("truncated", False)), raw=dict(data))

    def to_tool_output(self) -> dict[str, Any]:
        """Seed 004's output shape: ``{error, stdout, stderr, exit_code}``."""
        return {"error": self.exit_code != 0, "stdout": self.stdout, "stderr": self.stderr,
                "exit_code": self.exit_code}


@dataclass
class EntryInfo:
    """One entry of a directory listing (``files.list``).

    Attributes:
        name: the entry's name. path: its path (listing path joined with the name).
        type: ``"file"``, ``"dir"``, ``"symlink"`` or ``"other"``.
        size: size in bytes. mode: octal permission string, e.g. ``"0644"``.
        mtime: modification time (RFC 3339).
    """

    name: str
    path: str
    type: str
    size: int = 0
    mode: str = ""
    mtime: str = ""


@dataclass
class WriteInfo:
    """What ``files.write``/``files.upload`` stored: the path and the byte count the daemon
    reported."""

    path: str
    bytes: int


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def _opt_text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def _int(value: Any, default: int) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    return default
