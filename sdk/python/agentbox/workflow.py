"""Seed 004's Plan → Execute → Review loop on one environment.

::

    provision (POST /environments)
      └─ repeat up to max_iterations:
           plan   = planner(PlanRequest(task, iteration, feedback, previous_log))
           log    = execute every tool call of the plan (inputs, outputs, exit codes, timings)
           review = reviewer(log)         # default: fail on the first exit_code != 0
           approved? stop : feed review.feedback and the log back to the planner
    finally: de-provision (DELETE /environments/{id}) — even when a step or the planner raises

A planner is any callable taking a :class:`PlanRequest` and returning a list of tool calls
(:class:`ToolCall`, ``{"name": ..., "arguments": {...}}`` dicts or ``(name, arguments)``
pairs). :class:`ScriptedPlanner` replays fixed plans (for tests);
``examples/openai_planner.py`` asks an OpenAI-compatible chat endpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from . import tools as _tools
from .errors import ReviewFailed, SandboxError
from .sandbox import Environment, Sandbox

__all__ = ["ToolCall", "StepLog", "ExecutionLog", "Review", "PlanRequest", "WorkflowReport",
           "Planner", "Reviewer", "ScriptedPlanner", "Executor", "default_reviewer",
           "run_workflow", "execute_plan"]


@dataclass
class ToolCall:
    """One planned step: a meta-tool name (any spelling :func:`agentbox.tools.dispatch`
    accepts) and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def coerce(cls, item: Any) -> "ToolCall":
        """Accept a :class:`ToolCall`, a ``{"name", "arguments"}`` mapping (arguments may be
        a JSON string) or a ``(name, arguments)`` pair."""
        if isinstance(item, ToolCall):
            return item
        if isinstance(item, Mapping):
            args = item.get("arguments", item.get("input", {}))
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            return cls(str(item["name"]), dict(args or {}))
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return cls(str(item[0]), dict(item[1] or {}))
        raise TypeError(f"not a tool call: {item!r}")


@dataclass
class StepLog:
    """What happened in one step.

    Attributes:
        index: 1-based position in the plan. tool: the canonical tool name.
        arguments: the inputs. output: the tool's seed-004 output dict (``None`` if the step
        raised). exit_code: for ``execute_command``, the command's exit code, else ``None``.
        error: the output's ``error`` flag (true also when the step raised).
        started_at: RFC 3339 UTC start time. duration_ms: wall-clock duration.
        exception: ``"Type: message"`` when the step raised instead of answering.
    """

    index: int
    tool: str
    arguments: dict[str, Any]
    output: Optional[dict[str, Any]]
    exit_code: Optional[int]
    error: bool
    started_at: str
    duration_ms: float
    exception: Optional[str] = None

    def describe(self) -> str:
        """A one-line human description, e.g. ``step 2 (environment.execute_command: make)``."""
        detail = self.arguments.get("command") or self.arguments.get("path") or ""
        return f"step {self.index} ({self.tool}{': ' + str(detail)[:120] if detail else ''})"


ExecutionLog = list
"""An execution log is a ``list[StepLog]`` in execution order."""


@dataclass
class Review:
    """A reviewer's verdict. ``failed_step`` is the 1-based index of the step blamed, if
    any."""

    approved: bool
    feedback: str = ""
    failed_step: Optional[int] = None


@dataclass
class PlanRequest:
    """What a planner gets: the task, the iteration number (1-based), and — on a revision —
    the reviewer's feedback and the previous execution log."""

    task: str
    iteration: int
    feedback: Optional[str] = None
    previous_log: Optional[list[StepLog]] = None
    environment_id: Optional[str] = None


Planner = Callable[[PlanRequest], Sequence[Union[ToolCall, Mapping[str, Any], tuple]]]
"""Any callable from :class:`PlanRequest` to a list of tool calls."""

Reviewer = Callable[[list], Review]
"""Any callable from an execution log (``list[StepLog]``) to a :class:`Review`."""


@dataclass
class WorkflowReport:
    """The outcome of :func:`run_workflow`.

    Attributes:
        task: the request. environment_id: the environment used (already deleted).
        approved: the last review's verdict. review: the last :class:`Review`.
        iterations: one execution log per Plan → Execute → Review round.
        deprovisioned: true if the environment was deleted (or already gone).
        duration_ms: total wall-clock time.
    """

    task: str
    environment_id: Optional[str] = None
    approved: bool = False
    review: Optional[Review] = None
    iterations: list[list[StepLog]] = field(default_factory=list)
    deprovisioned: bool = False
    duration_ms: float = 0.0

    @property
    def log(self) -> list[StepLog]:
        """The last iteration's execution log."""
        return self.iterations[-1] if self.iterations else []

    @property
    def final_output(self) -> Optional[dict[str, Any]]:
        """The last step's output (seed 004: what the reviewer checks against the request)."""
        return self.log[-1].output if self.log else None

    def to_dict(self) -> dict[str, Any]:
        """The whole report as plain JSON-compatible data."""
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """The whole report as JSON text."""
        return json.dumps(self.to_dict(), **kwargs)

    def raise_for_review(self) -> "WorkflowReport":
        """Raise :class:`ReviewFailed` unless the work was approved; returns ``self``."""
        if not self.approved:
            feedback = self.review.feedback if self.review else "not reviewed"
            raise ReviewFailed(f"workflow not approved: {feedback}", report=self)
        return self


def default_reviewer(log: list[StepLog]) -> Review:
    """Seed 004's mechanical check: reject the first step whose ``exit_code != 0`` (or whose
    tool reported ``error: true``, or that raised), naming the step; approve otherwise."""
    for step in log:
        if step.exception is not None:
            return Review(False, f"{step.describe()} raised {step.exception}", step.index)
        if step.exit_code is not None and step.exit_code != 0:
            out = step.output or {}
            tail = str(out.get("stderr") or out.get("stdout") or "").strip()[-500:]
            return Review(False, f"{step.describe()} exited with code {step.exit_code}"
                          + (f": {tail}" if tail else ""), step.index)
        if step.error:
            out = step.output or {}
            msg = out.get("message") or out.get("content") or out.get("stderr") or ""
            return Review(False, f"{step.describe()} failed: {msg}", step.index)
    if not log:
        return Review(False, "the plan was empty", None)
    return Review(True, "all steps succeeded", None)


class ScriptedPlanner:
    """A planner that returns fixed plans: the first call gets ``plans[0]``, a revision gets
    ``plans[1]``, and so on (the last plan repeats). Records every :class:`PlanRequest` in
    :attr:`requests`."""

    def __init__(self, *plans: Sequence[Any]) -> None:
        if not plans:
            raise ValueError("ScriptedPlanner needs at least one plan")
        self.plans = [list(p) for p in plans]
        self.requests: list[PlanRequest] = []

    def __call__(self, request: PlanRequest) -> list[Any]:
        self.requests.append(request)
        return self.plans[min(request.iteration - 1, len(self.plans) - 1)]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Executor:
    """Runs plans against one environment and builds the execution log (seed 004's
    Executor Activity).

    Args:
        env: the :class:`agentbox.Environment`.
        stop_on_failure: stop at the first failing step (default True: later steps usually
            depend on earlier ones).
        on_step: optional callback receiving each :class:`StepLog` as soon as it is done.
    """

    def __init__(self, env: Environment, *, stop_on_failure: bool = True,
                 on_step: Optional[Callable[[StepLog], Any]] = None) -> None:
        self.env = env
        self.stop_on_failure = stop_on_failure
        self.on_step = on_step

    def execute(self, plan: Sequence[Any],
                log: Optional[list[StepLog]] = None) -> list[StepLog]:
        """Execute every tool call of ``plan`` in order and return the log (appending to
        ``log`` if given, so a caller keeps the steps done before an exception).
        Infrastructure errors (daemon down, bad key) are recorded in the step and re-raised."""
        log = [] if log is None else log
        for i, raw in enumerate(plan, start=1):
            started, t0 = _now(), time.monotonic()
            try:
                call = ToolCall.coerce(raw)
            except (TypeError, KeyError, ValueError) as exc:
                step = StepLog(i, "invalid", {"raw": repr(raw)[:500]},
                               {"error": True, "message": f"invalid tool call: {exc}"}, None,
                               True, started, 0.0)
                log.append(step)
                self._emit(step)
                if self.stop_on_failure:
                    break
                continue
            try:
                name = _tools.canonical_name(call.name)
            except KeyError:
                name = call.name
            try:
                output = _tools.dispatch(self.env, call.name, call.arguments)
            except BaseException as exc:
                step = StepLog(i, name, call.arguments, None, None, True, started,
                               (time.monotonic() - t0) * 1000.0,
                               exception=f"{type(exc).__name__}: {exc}")
                log.append(step)
                self._emit(step)
                raise
            exit_code = output.get("exit_code") if name == "environment.execute_command" \
                else None
            step = StepLog(i, name, call.arguments, output,
                           int(exit_code) if isinstance(exit_code, int) else None,
                           bool(output.get("error")), started, (time.monotonic() - t0) * 1000.0)
            log.append(step)
            self._emit(step)
            if step.error and self.stop_on_failure:
                break
        return log

    def _emit(self, step: StepLog) -> None:
        if self.on_step is not None:
            self.on_step(step)


def execute_plan(env: Environment, plan: Sequence[Any], *,
                 stop_on_failure: bool = True) -> list[StepLog]:
    """Execute ``plan`` on ``env`` and return the execution log (see :class:`Executor`)."""
    return Executor(env, stop_on_failure=stop_on_failure).execute(plan)


def run_workflow(task: str, planner: Planner, *, reviewer: Reviewer = default_reviewer,
                 max_iterations: int = 1, sandbox: Optional[Sandbox] = None,
                 environment: Optional[Mapping[str, Any]] = None,
                 stop_on_failure: bool = True,
                 on_step: Optional[Callable[[StepLog], Any]] = None,
                 on_provisioned: Optional[Callable[[Environment], Any]] = None,
                 ) -> WorkflowReport:
    """Provision an environment, run Plan → Execute → Review up to ``max_iterations`` times,
    and always de-provision.

    Args:
        task: the user's request, passed to the planner.
        planner: any callable ``PlanRequest -> list of tool calls``.
        reviewer: any callable ``list[StepLog] -> Review`` (default :func:`default_reviewer`).
        max_iterations: how many plan/execute/review rounds before giving up.
        sandbox: the client to use (default ``Sandbox()``, i.e. ``$AGENTBOX_URL``).
        environment: keyword arguments for :meth:`Sandbox.create` (image, limits, ttl...).
        stop_on_failure: stop a plan at its first failing step.
        on_step: called with each :class:`StepLog` as it completes.
        on_provisioned: called with the environment right after it is created.

    Returns:
        the :class:`WorkflowReport` (``approved`` tells the verdict; use
        :meth:`WorkflowReport.raise_for_review` to turn a rejection into an exception).

    Raises:
        Whatever a planner, reviewer or infrastructure step raised — after the environment
        was deleted.
    """
    if max_iterations < 1:
        raise ValueError("max_iterations must be >= 1")
    client = sandbox or Sandbox()
    report = WorkflowReport(task=task)
    t0 = time.monotonic()
    env: Optional[Environment] = None
    finished = False
    try:
        env = client.create(**dict(environment or {}))
        report.environment_id = env.environment_id
        if on_provisioned is not None:
            on_provisioned(env)
        executor = Executor(env, stop_on_failure=stop_on_failure, on_step=on_step)
        feedback: Optional[str] = None
        previous: Optional[list[StepLog]] = None
        for iteration in range(1, max_iterations + 1):
            plan = planner(PlanRequest(task, iteration, feedback, previous,
                                       env.environment_id))
            log: list[StepLog] = []
            report.iterations.append(log)
            executor.execute(list(plan), log)
            review = reviewer(log)
            report.review, report.approved = review, review.approved
            if review.approved:
                break
            feedback, previous = review.feedback, log
        finished = True
        return report
    finally:
        if env is not None:
            try:
                env.kill()
                report.deprovisioned = True
            except SandboxError:
                report.deprovisioned = False
                if finished:  # nothing else in flight: say loudly that it may leak
                    raise
        report.duration_ms = (time.monotonic() - t0) * 1000.0
