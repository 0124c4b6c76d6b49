"""Exceptions raised by the agentbox SDK.

Every error that comes from the daemon carries the daemon's own message, its machine
``code`` (``not_found``, ``unauthorized``, ...) and the HTTP ``status``. Connection failures
say which URL the SDK tried to reach.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = [
    "SandboxError",
    "InvalidArgument",
    "AuthError",
    "PermissionDenied",
    "SandboxNotFound",
    "Conflict",
    "Gone",
    "PayloadTooLarge",
    "InsufficientStorage",
    "RateLimited",
    "ServerError",
    "Unavailable",
    "SandboxTimeout",
    "DaemonUnreachable",
    "Cancelled",
    "CommandExitError",
    "CommandTimeout",
    "ReviewFailed",
    "error_from_response",
]


class SandboxError(Exception):
    """Base class of every error raised by agentbox.

    Attributes:
        message: the daemon's human-readable message (or the SDK's own).
        code: the daemon's machine code, e.g. ``"not_found"``; ``None`` for client-side errors.
        status: the HTTP status code, or ``None`` when no answer was received.
        body: the decoded error body as the daemon sent it (may be empty).
    """

    def __init__(self, message: str, *, code: Optional[str] = None,
                 status: Optional[int] = None, body: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.body: dict[str, Any] = dict(body or {})

    def __str__(self) -> str:
        if self.status is not None and self.code:
            return f"{self.message} (HTTP {self.status} {self.code})"
        if self.status is not None:
            return f"{self.message} (HTTP {self.status})"
        return self.message


class InvalidArgument(SandboxError, ValueError):
    """The daemon rejected the request as malformed (400, 405, 415 or 422)."""


class AuthError(SandboxError):
    """The API key is missing or wrong (401)."""


class PermissionDenied(SandboxError, PermissionError):
    """The sandbox user may not read or write that path (403). esbd never answers 403 for
    another tenant's environment (that is a 404)."""


class SandboxNotFound(SandboxError):
    """The environment (or file) does not exist, was destroyed, or belongs to another tenant
    (404)."""


class Conflict(SandboxError):
    """The request conflicts with the environment's state (409)."""


class Gone(SandboxError):
    """What was asked for existed but has been collected (410): e.g. a file's content at an
    old step after the step log's garbage collection (``body["detail"] == "collected"``)."""


class PayloadTooLarge(SandboxError):
    """A body or file is larger than the daemon accepts (413)."""


class InsufficientStorage(SandboxError):
    """The environment's disk quota is full (507)."""


class RateLimited(SandboxError):
    """Too many requests or too many environments for this tenant (429).

    ``retry_after`` holds the ``Retry-After`` header in seconds when the daemon sent one.
    """

    def __init__(self, message: str, *, retry_after: Optional[float] = None,
                 **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(SandboxError):
    """The daemon failed internally (500 or another unexpected status)."""


class Unavailable(ServerError):
    """The daemon or a driver is temporarily unavailable (503)."""


class SandboxTimeout(SandboxError, TimeoutError):
    """Something took longer than allowed: an HTTP request to the daemon, or a command."""


class DaemonUnreachable(SandboxError, ConnectionError):
    """The SDK could not talk to the daemon at all. The message names the URL it tried."""

    def __init__(self, message: str, *, url: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.url = url


class Cancelled(SandboxError):
    """The request was cancelled by the caller (a :class:`agentbox.CancelToken`, or an
    asyncio task that was cancelled). The daemon kills a command whose client went away."""


class CommandExitError(SandboxError):
    """A command exited with a non-zero code and the caller asked for ``check=True``.

    ``result`` is the full :class:`agentbox.CommandResult`.
    """

    def __init__(self, message: str, *, result: Any) -> None:
        super().__init__(message)
        self.result = result

    @property
    def exit_code(self) -> int:
        """The command's exit code."""
        return int(self.result.exit_code)

    @property
    def stdout(self) -> str:
        """The command's standard output."""
        return str(self.result.stdout)

    @property
    def stderr(self) -> str:
        """The command's standard error."""
        return str(self.result.stderr)


class CommandTimeout(CommandExitError, SandboxTimeout):
    """A command was killed by its timeout (exit code 124) and the caller asked for
    ``check=True``."""


class ReviewFailed(SandboxError):
    """A workflow's reviewer rejected the execution log. ``report`` holds the
    :class:`agentbox.workflow.WorkflowReport`."""

    def __init__(self, message: str, *, report: Any) -> None:
        super().__init__(message)
        self.report = report


_BY_STATUS: dict[int, type[SandboxError]] = {
    400: InvalidArgument,
    401: AuthError,
    403: PermissionDenied,
    404: SandboxNotFound,
    405: InvalidArgument,
    408: SandboxTimeout,
    409: Conflict,
    410: Gone,
    413: PayloadTooLarge,
    415: InvalidArgument,
    422: InvalidArgument,
    429: RateLimited,
    507: InsufficientStorage,
    503: Unavailable,
    504: SandboxTimeout,
}


def error_from_response(status: int, body: Any, *, context: str = "",
                        retry_after: Optional[str] = None) -> SandboxError:
    """Build the exception that matches an HTTP error answer.

    Args:
        status: the HTTP status code.
        body: the decoded JSON body (``{"error": true, "code": ..., "message": ...}``) or the raw
            text when the body was not JSON.
        context: a short description of the request (``"POST /environments"``), used only when the
            daemon sent no message.
        retry_after: the raw ``Retry-After`` header, if any.
    """
    code: Optional[str] = None
    message = ""
    mapping: dict[str, Any] = {}
    if isinstance(body, dict):
        mapping = body
        code = body.get("code") if isinstance(body.get("code"), str) else None
        raw = body.get("message")
        message = raw if isinstance(raw, str) else ""
    elif isinstance(body, str):
        message = body.strip()[:500]
    if not message:
        message = f"{context or 'request'} failed with HTTP {status}"
    cls = _BY_STATUS.get(status, ServerError)
    if cls is RateLimited:
        seconds: Optional[float] = None
        if retry_after:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = None
        return RateLimited(message, code=code, status=status, body=mapping, retry_after=seconds)
    return cls(message, code=code, status=status, body=mapping)
