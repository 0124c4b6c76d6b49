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
    "Artifact",
    "Table",
    "SandboxResult",
    "CommandResult",
    "EntryInfo",
    "WriteInfo",
]

Runtime = Literal["auto", "nano", "heavy"]
_RUNTIMES = ("auto", "nano", "heavy")
_FIGURE_FORMATS = ("png", "svg")


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
        packages: requirement strings the code needs (e.g. ``["pandas"]``,
            ``["tabulate==0.9.0"]``); forces the heavy tier. A daemon with ``POST /run``
            installs them with pip from its configured package index before running (the
            answer lists them in :attr:`SandboxResult.packages`). The container fallback
            only checks that they are installed in the image and fails the run with a clear
            message if one is missing (it cannot download: no network).
        figure_formats: formats for matplotlib figures captured as artifacts: ``["png"]``
            (the daemon's default when ``None``) or ``["png", "svg"]``.
    """

    runtime: Runtime = "auto"
    timeout_ms: int = 30_000
    memory_limit_mb: Optional[int] = None
    allowed_modules: Optional[Sequence[str]] = None
    packages: Optional[Sequence[str]] = None
    figure_formats: Optional[Sequence[str]] = None

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
        if self.figure_formats is not None:
            self.figure_formats = check_figure_formats(self.figure_formats,
                                                       "SandboxConfig.figure_formats")


def check_figure_formats(value: Any, what: str) -> list[str]:
    """Validate a ``figure_formats`` list (``"png"`` and/or ``"svg"``, not empty)."""
    if (isinstance(value, str) or not isinstance(value, Sequence) or not value
            or not all(isinstance(v, str) and v in _FIGURE_FORMATS for v in value)):
        raise InvalidArgument(f"{what} must be a non-empty list drawn from {_FIGURE_FORMATS}, "
                              f"not {value!r}")
    return list(dict.fromkeys(value))  # keep order, drop duplicates


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
class Artifact:
    """A file produced by a run: a matplotlib figure (``kind == "image"``) or a file the
    code wrote under ``/workspace/artifacts`` (``kind == "file"``).

    The bytes stay on the daemon; fetch them with :meth:`agentbox.Sandbox.download_artifact`
    / :meth:`agentbox.Sandbox.save_artifact` or ``env.artifacts.get(...)``. They remain
    downloadable for a while after the environment is gone (one-shot ``run`` destroys its
    environment at once).

    Attributes:
        id: the daemon's id (``art_<hex>``). kind: ``"image"`` or ``"file"``.
        name: file name, e.g. ``"figure-1.png"``. mime_type: e.g. ``"image/png"``.
        size: byte count. title: the figure's title, when it had one.
        step: which run (cell) of the environment produced it.
        environment_id: the environment it belongs to.
        url: the daemon path of its bytes, ``/environments/{env}/artifacts/{id}``.
    """

    id: str
    kind: str = "file"
    name: str = ""
    mime_type: str = "application/octet-stream"
    size: int = 0
    title: Optional[str] = None
    step: int = 0
    environment_id: str = ""
    url: str = ""

    @classmethod
    def from_answer(cls, data: Mapping[str, Any],
                    environment_id: Optional[str] = None) -> Optional["Artifact"]:
        """Build one from an entry of ``artifacts`` (``None`` if it has no usable id).
        ``environment_id`` fills in a missing ``environment_id`` field."""
        aid = data.get("id")
        if not isinstance(aid, str) or not aid:
            return None
        env = _opt_text(data.get("environment_id")) or environment_id or ""
        url = _opt_text(data.get("url")) or ""
        return cls(id=aid, kind=_text(data.get("kind") or "file"),
                   name=_text(data.get("name") or aid),
                   mime_type=_text(data.get("mime_type") or "application/octet-stream"),
                   size=_int(data.get("size"), 0), title=_opt_text(data.get("title")),
                   step=_int(data.get("step"), 0), environment_id=env, url=url)


def parse_artifacts(value: Any, environment_id: Optional[str] = None) -> list[Artifact]:
    """Parse an ``artifacts`` list, skipping malformed entries."""
    if not isinstance(value, list):
        return []
    out = []
    for item in value:
        if isinstance(item, Mapping):
            art = Artifact.from_answer(item, environment_id)
            if art is not None:
                out.append(art)
    return out


@dataclass
class Table:
    """A pandas DataFrame that was the final value of a run, as data (its text ``repr`` stays
    in :attr:`SandboxResult.value`). Large frames arrive cut: ``truncated`` is true and
    ``total_rows``/``total_columns`` give the full shape.

    Attributes:
        columns: column labels (as strings). index: the row labels of the rows sent.
        rows: the rows sent, each a list of cell values in column order.
        total_rows, total_columns: the DataFrame's full shape.
        truncated: true when fewer rows or columns were sent than the frame has.
    """

    columns: list[str] = field(default_factory=list)
    index: list[Any] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    total_rows: int = 0
    total_columns: int = 0
    truncated: bool = False

    def to_records(self) -> list[dict[str, Any]]:
        """The rows as ``[{column: value, ...}, ...]`` (a later duplicate column label wins;
        the index is not included)."""
        return [dict(zip(self.columns, row)) for row in self.rows]

    @classmethod
    def from_answer(cls, data: Any) -> Optional["Table"]:
        """Build one from the answer's ``table`` field (``None`` when absent or malformed)."""
        if not isinstance(data, Mapping):
            return None
        columns = data.get("columns")
        rows = data.get("rows")
        if not isinstance(columns, list) or not isinstance(rows, list):
            return None
        index = data.get("index")
        clean_rows = [list(r) for r in rows if isinstance(r, list)]
        return cls(columns=[_text(c) for c in columns],
                   index=list(index) if isinstance(index, list) else [],
                   rows=clean_rows,
                   total_rows=_int(data.get("total_rows"), len(clean_rows)),
                   total_columns=_int(data.get("total_columns"), len(columns)),
                   truncated=bool(data.get("truncated", False)))


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
        via: ``"run"`` when ``POST /run`` (or an environment's ``POST .../run``) answered,
            ``"environment"`` for the container fallback (create an environment, write the
            file, run ``python3``, delete).
        artifacts: figures and ``/workspace/artifacts`` files the run produced.
        table: the final value as data when it was a pandas DataFrame.
        value: ``repr`` of the final expression (heavy tier), when the daemon sent one.
        packages: what was installed for ``packages=``: ``[{"name", "version",
            "from_cache"}]``. install_ms: how long installing took, when reported.
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
    artifacts: list[Artifact] = field(default_factory=list)
    table: Optional[Table] = None
    value: Optional[str] = None
    packages: list[dict[str, Any]] = field(default_factory=list)
    install_ms: Optional[float] = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True when the code exited with code 0."""
        return self.exit_code == 0 and not self.error

    @property
    def images(self) -> list[Artifact]:
        """The artifacts that are figures (``kind == "image"``)."""
        return [a for a in self.artifacts if a.kind == "image"]

    def to_tool_output(self, *, max_table_rows: int = 20) -> dict[str, Any]:
        """A JSON-ready summary for an LLM tool result: seed 004's ``{error, stdout, stderr,
        exit_code}`` plus, when present, ``value``, ``table`` (at most ``max_table_rows``
        rows as records) and ``artifacts`` (name, kind, mime type, size, title and url; the
        bytes are not included)."""
        out: dict[str, Any] = {"error": not self.ok, "stdout": self.stdout,
                               "stderr": self.stderr, "exit_code": self.exit_code}
        if self.value is not None:
            out["value"] = self.value
        if self.table is not None:
            records = self.table.to_records()
            out["table"] = {"columns": self.table.columns,
                            "records": records[:max(0, max_table_rows)],
                            "total_rows": self.table.total_rows,
                            "total_columns": self.table.total_columns,
                            "truncated": self.table.truncated
                            or len(records) > max(0, max_table_rows)}
        if self.artifacts:
            out["artifacts"] = [{"name": a.name, "kind": a.kind, "mime_type": a.mime_type,
                                 "size": a.size, "title": a.title, "url": a.url}
                                for a in self.artifacts]
        return out

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
        packages = data.get("packages")
        install_ms = data.get("install_ms")
        value = data.get("value")
        return cls(stdout=stdout, stderr=stderr, exit_code=exit_code,
                   error=error or exit_code != 0 or exception is not None,
                   duration_ms=float(duration) if isinstance(duration, (int, float))
                   else elapsed_ms,
                   timed_out=bool(data.get("timed_out", False)),
                   truncated=bool(data.get("truncated", False)), exception=exception,
                   runtime=runtime, reason=reason, via="run",
                   artifacts=parse_artifacts(data.get("artifacts"),
                                             _opt_text(data.get("environment_id"))),
                   table=Table.from_answer(data.get("table")),
                   value=value if isinstance(value, str) else None,
                   packages=[dict(p) for p in packages if isinstance(p, Mapping)]
                   if isinstance(packages, list) else [],
                   install_ms=float(install_ms)
                   if isinstance(install_ms, (int, float)) and not isinstance(install_ms, bool)
                   else None,
                   raw=dict(data))


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
