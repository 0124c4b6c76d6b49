"""Time travel (docs/api.md "Steps"): every execute, run, file change, package install and
network change of an environment is a step with the state after it. :class:`Step` is one
entry of ``env.steps()`` / ``env.step(n)``::

    for s in env.steps():
        print(s.step, s.kind, s.status, s.summary)
    before = env.step(3)
    before.variables          # [{"name": "df", "type": "DataFrame", "repr": ..., ...}]
    before.files              # the /workspace tree at step 3
    before.file("data.csv")   # its bytes as they were then
    before.diff("main.py")    # unified diff against step 2
    env.rewind(3)             # in place; later steps stay as a branch
    other = env.fork(3)       # a new environment at step 3
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from ._http import Transport, quote_id
from .errors import InvalidArgument, SandboxError

if TYPE_CHECKING:  # pragma: no cover
    from .sandbox import Environment

__all__ = ["Step", "check_step_number", "check_steps_option", "fetch_detail"]

# The fields of a step in ``GET /environments/{id}/steps`` (the summary).
_SUMMARY_FIELDS = ("parent", "kind", "summary", "status", "exit_code", "error", "duration_ms",
                   "capture_ms", "tier", "memory", "memory_detail", "files_changed",
                   "created_at", "on_head")
# What only ``GET /environments/{id}/steps/{n}`` (the detail) has.
_DETAIL_FIELDS = ("input", "output", "variables", "files", "changes", "artifacts", "audit",
                  "egress", "shell")


def fetch_detail(transport: Transport, path: str) -> dict[str, Any]:
    """``GET /environments/{id}/steps/{n}`` with its whole file tree and all its changes:
    esbd sends them in windows sorted by path (``files_next`` / ``changes_next`` name the
    path to continue after; docs/api.md "Steps"), fetched here until both are done."""
    window = {"files_limit": 10000, "changes_limit": 10000}
    data = transport.json("GET", path, query=window)
    for _ in range(1000):  # a tree has at most 200,000 entries: 20 windows
        if not isinstance(data.get("files_next"), str) and \
                not isinstance(data.get("changes_next"), str):
            break
        query = dict(window)
        for key in ("files", "changes"):
            items = data.get(key)
            if isinstance(items, list) and items and isinstance(items[-1], dict):
                query[f"{key}_after"] = items[-1].get("path", "")
        page = transport.json("GET", path, query=query)
        for key in ("files", "changes"):
            if isinstance(data.get(key), list) and isinstance(page.get(key), list):
                data[key].extend(page[key])
            data[f"{key}_next"] = page.get(f"{key}_next")
    return data


def check_step_number(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidArgument(f"{what}: the step must be an int >= 0, not {n!r}")
    return n


def check_steps_option(steps: Any) -> Any:
    """``steps=`` of create as it goes on the wire: ``False`` (capture off) or a dict of
    ``capture``, ``max_steps``, ``max_bytes``, ``max_live_memory``, ``ttl_s``."""
    if steps is False:
        return False
    if isinstance(steps, Mapping):
        allowed = {"capture", "max_steps", "max_bytes", "max_live_memory", "ttl_s"}
        unknown = sorted(set(steps) - allowed)
        if unknown:
            raise InvalidArgument(f"create: unknown steps option(s) {unknown}; known: "
                                  f"{sorted(allowed)}")
        return dict(steps)
    raise InvalidArgument("create: steps must be False or a dict such as "
                          f'{{"max_steps": 100}}, not {steps!r}')


class Step:
    """One step of an environment's log. The summary fields (``kind``, ``status``,
    ``summary``, ``exit_code``, ``memory``, ...) come with ``env.steps()``; the detail
    (``variables``, ``files``, ``changes``, ``input``, ``output``, ``shell``, ...) is fetched
    on first use (``env.step(n)`` fetches it at once). ``data`` is the daemon's JSON."""

    def __init__(self, transport: Transport, environment_id: str, data: Mapping[str, Any],
                 *, detailed: bool = False) -> None:
        self._transport = transport
        self.environment_id = environment_id
        self.data: dict[str, Any] = dict(data)
        n = self.data.get("step")
        if isinstance(n, bool) or not isinstance(n, int):
            raise SandboxError(f"esbd answered a step without a number: {self.data!r:.200}")
        self.step: int = n
        self._detailed = detailed

    def __repr__(self) -> str:
        return (f"Step({self.step}, kind={self.data.get('kind')!r}, "
                f"status={self.data.get('status')!r}, summary={self.data.get('summary')!r})")

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not set in __init__: the step's JSON fields.
        if name in _SUMMARY_FIELDS:
            if name not in self.data and not self._detailed:
                self.refresh()
            return self.data.get(name)
        if name in _DETAIL_FIELDS:
            if not self._detailed:
                self.refresh()
            return self.data.get(name)
        raise AttributeError(name)

    @property
    def _base(self) -> str:
        return f"/environments/{quote_id(self.environment_id)}/steps/{self.step}"

    def refresh(self) -> "Step":
        """Fetch the step's detail (``GET /environments/{id}/steps/{n}``)."""
        self.data = fetch_detail(self._transport, self._base)
        self._detailed = True
        return self

    def file(self, path: str) -> bytes:
        """The bytes of ``path`` as it was at this step (``GET .../steps/{n}/files``).
        Raises :class:`SandboxNotFound` when it did not exist then, :class:`InvalidArgument`
        for a directory, :class:`Gone` when its content was garbage-collected."""
        from .sandbox import _download  # one download helper for the whole SDK
        if not isinstance(path, str) or not path:
            raise InvalidArgument("step.file: path must be a non-empty string")
        data = _download(self._transport, f"{self._base}/files", {"path": path}, None)
        assert isinstance(data, bytes)
        return data

    def diff(self, path: str) -> dict[str, Any]:
        """``path``'s change at this step against its parent: ``{"path", "change", "binary",
        "truncated", "diff"}`` (``diff`` is a unified diff)."""
        if not isinstance(path, str) or not path:
            raise InvalidArgument("step.diff: path must be a non-empty string")
        return self._transport.json("GET", f"{self._base}/diff", query={"path": path})
