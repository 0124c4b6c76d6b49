"""Low-level HTTP transport for the esbd REST API (standard library only).

One short-lived ``http.client`` connection per request keeps the client trivially thread-safe
and lets streams (SSE, raw downloads) own their socket. Everything here is private; the public
surface lives in :mod:`agentbox.sandbox`.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator, Mapping, Optional, Union

from . import __version__
from .errors import (Cancelled, DaemonUnreachable, SandboxError, SandboxTimeout,
                     error_from_response)

DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = f"agentbox-python/{__version__}"
_CHUNK = 64 * 1024

Body = Union[None, bytes, BinaryIO, Iterable[bytes]]


@dataclass
class SseEvent:
    """One server-sent event: its ``event`` name and the JSON-decoded ``data``.
    ``synthetic`` marks the ``result`` event made from a plain JSON answer (a daemon that
    does not stream that endpoint)."""

    event: str
    data: Any
    synthetic: bool = False


class CancelToken:
    """Cancels a request in flight from another thread: :meth:`cancel` shuts the request's
    socket down, so a blocked read returns at once and the request raises
    :class:`agentbox.Cancelled`. esbd kills a command whose client went away."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self.cancelled = False

    def attach(self, sock: Optional[socket.socket]) -> None:
        """Remember the socket of the request in flight (called by the transport)."""
        with self._lock:
            self._sock = sock
            if self.cancelled:
                self._shutdown()

    def cancel(self) -> None:
        """Abort the request in flight (and any later one using this token)."""
        with self._lock:
            self.cancelled = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def quote_id(value: str) -> str:
    """Quote an identifier for use as one path segment (nothing can escape the segment)."""
    return urllib.parse.quote(str(value), safe="")


class Transport:
    """Talks HTTP/1.1 to one esbd base URL with an optional Bearer key."""

    def __init__(self, url: str, api_key: Optional[str], timeout: float) -> None:
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise SandboxError(f"invalid daemon URL {url!r}: expected http://host:port or "
                               "https://host:port")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")
        self.api_key = api_key or None
        self.timeout = timeout

    # -- plumbing ---------------------------------------------------------------------------
    def _connection(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        t = self.timeout if timeout is None else timeout
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=t,
                                               context=ssl.create_default_context(),
                                               blocksize=_CHUNK)
        return http.client.HTTPConnection(self._host, self._port, timeout=t, blocksize=_CHUNK)

    def _headers(self, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if extra:
            headers.update(extra)
        return headers

    def target(self, path: str, query: Optional[Mapping[str, Any]] = None) -> str:
        """The request target (path plus query string) for ``path`` under the base URL."""
        target = self._prefix + path
        if query:
            clean = {k: v for k, v in query.items() if v is not None}
            if clean:
                target += "?" + urllib.parse.urlencode(clean)
        return target

    def send(self, method: str, path: str, *, query: Optional[Mapping[str, Any]] = None,
             body: Body = None, headers: Optional[Mapping[str, str]] = None,
             timeout: Optional[float] = None, chunked: bool = False,
             cancel: Optional[CancelToken] = None,
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send one request and return the open connection and its response (status not yet
        checked). The caller must close the connection."""
        where = f"{self.url}{path}"
        conn = self._connection(timeout)
        try:
            conn.connect()
        except socket.timeout as exc:
            conn.close()
            raise DaemonUnreachable(f"timed out connecting to esbd at {self.url} ({exc})",
                                    url=self.url) from exc
        except OSError as exc:
            conn.close()
            raise DaemonUnreachable(
                f"cannot connect to esbd at {self.url}: {exc.strerror or exc}. Is the daemon "
                "running? (set AGENTBOX_URL or pass url=...)", url=self.url) from exc
        if cancel is not None:
            cancel.attach(conn.sock)
        try:
            conn.request(method, self.target(path, query), body=body,
                         headers=self._headers(headers), encode_chunked=chunked)
            resp = conn.getresponse()
        except (http.client.HTTPException, OSError) as exc:
            conn.close()
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"{method} {where}: cancelled") from exc
            if isinstance(exc, socket.timeout):
                raise SandboxTimeout(f"{method} {where}: no answer from esbd within "
                                     f"{conn.timeout} s") from exc
            raise DaemonUnreachable(f"{method} {where}: connection to esbd failed: {exc}",
                                    url=self.url) from exc
        return conn, resp

    @staticmethod
    def _decode(raw: bytes) -> Any:
        if not raw:
            return {}
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return raw.decode("utf-8", "replace")

    def raise_for(self, method: str, path: str, resp: http.client.HTTPResponse) -> None:
        """Raise the matching :class:`SandboxError` if ``resp`` is not a 2xx answer."""
        if 200 <= resp.status < 300:
            return
        try:
            raw = resp.read()
        except (http.client.HTTPException, OSError):
            raw = b""
        raise error_from_response(resp.status, self._decode(raw), context=f"{method} {path}",
                                  retry_after=resp.getheader("Retry-After"))

    # -- request shapes ---------------------------------------------------------------------
    def _stream_error(self, method: str, path: str, exc: BaseException,
                      cancel: Optional[CancelToken], what: str) -> SandboxError:
        """The exception for a failure while reading an answer body."""
        if cancel is not None and cancel.cancelled:
            return Cancelled(f"{method} {self.url}{path}: cancelled")
        if isinstance(exc, socket.timeout):
            return SandboxTimeout(f"{method} {self.url}{path}: {what} stalled")
        return DaemonUnreachable(f"{method} {self.url}{path}: connection lost while reading "
                                 f"the {what}: {exc}", url=self.url)

    def json(self, method: str, path: str, payload: Optional[Mapping[str, Any]] = None, *,
             query: Optional[Mapping[str, Any]] = None, timeout: Optional[float] = None,
             cancel: Optional[CancelToken] = None) -> Any:
        """Send a JSON request and return the decoded JSON answer (raises on non-2xx)."""
        body: Optional[bytes] = None
        headers: dict[str, str] = {}
        if payload is not None:
            body = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        conn, resp = self.send(method, path, query=query, body=body, headers=headers,
                               timeout=timeout, cancel=cancel)
        try:
            self.raise_for(method, path, resp)
            try:
                raw = resp.read()
            except (http.client.HTTPException, OSError) as exc:
                raise self._stream_error(method, path, exc, cancel, "answer") from exc
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"{method} {self.url}{path}: cancelled")
            data = self._decode(raw)
            if not isinstance(data, dict):
                raise SandboxError(f"{method} {path}: esbd answered something that is not a "
                                   f"JSON object: {str(data)[:200]!r}", status=resp.status)
            return data
        finally:
            conn.close()

    def sse(self, method: str, path: str, payload: Mapping[str, Any], *,
            timeout: Optional[float] = None,
            cancel: Optional[CancelToken] = None) -> Iterator[SseEvent]:
        """Send a JSON request asking for ``text/event-stream`` and yield its events.

        If the daemon answers with plain JSON instead (no streaming support), one synthetic
        ``result`` event carrying that JSON is yielded.
        """
        body = json.dumps(payload).encode("utf-8")
        conn, resp = self.send(method, path, body=body, timeout=timeout, cancel=cancel,
                               headers={"Content-Type": "application/json",
                                        "Accept": "text/event-stream"})
        try:
            self.raise_for(method, path, resp)
            ctype = (resp.getheader("Content-Type") or "").lower()
            try:
                if "text/event-stream" not in ctype:
                    yield SseEvent("result", self._decode(resp.read()), synthetic=True)
                    return
                yield from parse_sse(resp)
            except (http.client.HTTPException, OSError) as exc:
                raise self._stream_error(method, path, exc, cancel, "event stream") from exc
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"{method} {self.url}{path}: cancelled")
        finally:
            conn.close()


def parse_sse(stream: Any) -> Iterator[SseEvent]:
    """Parse a ``text/event-stream`` body from anything with ``readline()``.

    Implements the parts of the SSE format esbd uses: ``event:`` and (possibly repeated)
    ``data:`` fields, comment lines starting with ``:``, and a blank line ending each event.
    ``data`` is decoded as JSON when possible, else kept as text.
    """
    event = ""
    data: list[str] = []
    while True:
        raw = stream.readline()
        if not raw:
            break
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line == "":
            if data or event:
                text = "\n".join(data)
                try:
                    value: Any = json.loads(text) if text else {}
                except json.JSONDecodeError:
                    value = text
                yield SseEvent(event or "message", value)
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        name, sep, value_text = line.partition(":")
        if sep and value_text.startswith(" "):
            value_text = value_text[1:]
        if name == "event":
            event = value_text
        elif name == "data":
            data.append(value_text)
    if data:
        text = "\n".join(data)
        try:
            yield SseEvent(event or "message", json.loads(text))
        except json.JSONDecodeError:
            yield SseEvent(event or "message", text)
