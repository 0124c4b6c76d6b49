"""Shared fixtures: the SDK is imported from this checkout, and fake esbd servers."""

from __future__ import annotations

import os
import socket
import sys
from typing import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # sdk/python, so `import agentbox` uses the checkout
sys.path.insert(0, HERE)

from fake_esbd import FakeEsbd  # noqa: E402

E2E_URL = os.environ.get("AGENTBOX_E2E_URL", "")
E2E_SKIP_REASON = ("AGENTBOX_E2E_URL is not set: end-to-end tests against a real esbd were "
                   "skipped (set AGENTBOX_E2E_URL=http://127.0.0.1:8080 and, if the daemon has "
                   "keys, AGENTBOX_E2E_API_KEY)")


def pytest_report_header(config: pytest.Config) -> str:
    if E2E_URL:
        return f"agentbox e2e: against {E2E_URL}"
    return f"agentbox e2e: {E2E_SKIP_REASON}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not E2E_URL:
        terminalreporter.write_line(f"NOTE: {E2E_SKIP_REASON}", yellow=True)


@pytest.fixture(autouse=True)
def _clean_agentbox_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests pass url/api_key explicitly; the developer's shell must not leak in."""
    monkeypatch.delenv("AGENTBOX_URL", raising=False)
    monkeypatch.delenv("AGENTBOX_API_KEY", raising=False)


@pytest.fixture
def fake() -> Iterator[FakeEsbd]:
    """A fake esbd in dev mode (no keys), without POST /run."""
    server = FakeEsbd().start()
    yield server
    server.stop()


@pytest.fixture
def fake_auth() -> Iterator[FakeEsbd]:
    """A fake esbd with two tenants: key-a → tenant a, key-b → tenant b."""
    server = FakeEsbd(keys={"key-a": "a", "key-b": "b"}).start()
    yield server
    server.stop()


@pytest.fixture
def fake_run() -> Iterator[FakeEsbd]:
    """A fake esbd that implements POST /run."""
    server = FakeEsbd(run_endpoint=True).start()
    yield server
    server.stop()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
