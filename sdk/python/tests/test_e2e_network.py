"""End-to-end tests of the SDK's network-governance surface against a REAL esbd with egress.

Needs ``AGENTBOX_E2E_URL`` (see test_e2e.py). The cases that send traffic also need
``AGENTBOX_E2E_EGRESS_HOST``: a host name the daemon maps to a local upstream
(``--egress-resolve``) that answers 200, and that the daemon's intent catalogue allows under
``AGENTBOX_E2E_INTENT`` (default ``check-weather``). scripts/test.sh sets all of this up
(tests/integration/egress/upstream.py as the upstream).
"""

from __future__ import annotations

import os
import time

import pytest

from conftest import E2E_SKIP_REASON, E2E_URL
from agentbox import InvalidArgument, Sandbox

if not E2E_URL:
    pytest.skip(E2E_SKIP_REASON, allow_module_level=True)

KEY = os.environ.get("AGENTBOX_E2E_API_KEY") or None
HOST = os.environ.get("AGENTBOX_E2E_EGRESS_HOST", "")
INTENT = os.environ.get("AGENTBOX_E2E_INTENT", "check-weather")
NO_HOST = ("AGENTBOX_E2E_EGRESS_HOST is not set: the daemon under test maps no host to a local "
           "upstream, so the cases that send traffic were skipped (scripts/test.sh sets it)")
CURL = "curl -sS -o /dev/null -w '%{http_code}' "


@pytest.fixture(scope="module")
def box() -> Sandbox:
    b = Sandbox(url=E2E_URL, api_key=KEY, request_timeout=60)
    egress = b.health().get("egress")
    if not isinstance(egress, dict) or egress.get("state") != "up":
        pytest.fail(f"the daemon's egress is not up (GET /healthz egress: {egress!r})")
    return b


@pytest.fixture
def env(box):
    with box.create(ttl_seconds=600, network={"mode": "allowlist",
                                              "allow": ["allowed.example"]}) as e:
        yield e


def test_network_policy_round_trip(box, env):
    got = env.network
    assert got["mode"] == "allowlist" and got["allow"] == ["allowed.example"]
    stored = env.set_network({"mode": "allowlist", "allow": ["a.example", "*.b.example"],
                              "deny": ["x.b.example"]})
    assert stored["allow"] == ["a.example", "*.b.example"] and stored["deny"] == ["x.b.example"]
    assert env.network == stored
    with box.create(ttl_seconds=120) as plain:
        assert plain.network == "none"


def test_bad_policy_is_a_clear_400(box):
    with pytest.raises(InvalidArgument) as info:
        box.create(ttl_seconds=60, network={"mode": "allowlist", "allow": ["*."]})
    assert info.value.status == 400 and "allow" in str(info.value)


def test_ca_pem_is_the_ca_the_sandbox_trusts(env):
    pem = env.ca_pem()
    assert pem.startswith("-----BEGIN CERTIFICATE-----")
    body = "".join(pem.strip().splitlines()[1:-1])
    bundle = env.commands.run("tr -d '\\n' < /etc/ssl/certs/ca-certificates.crt").stdout
    assert body in bundle


def test_denied_host_gets_403_with_the_rule_inside_the_sandbox(env):
    r = env.commands.run("curl -sS -D - -o /dev/null http://denied.example/x")
    assert r.stdout.startswith("HTTP/1.1 403"), r.stdout
    assert "x-esb-blocked: not_allowed" in r.stdout.lower(), r.stdout


def test_intent_context_manager_opens_the_host_only_inside_the_block(env):
    if not HOST:
        pytest.skip(NO_HOST)
    url = f"http://{HOST}/sdk-intent"
    assert env.commands.run(CURL + url).stdout == "403"
    with env.intent(INTENT, ttl_seconds=60) as scope:
        assert scope.info  # the daemon's record of the activation
        assert [i.get("intent", i.get("name")) for i in env.intents()] == [INTENT]
        assert env.commands.run(CURL + url).stdout == "200"
    assert env.intents() == []
    assert env.commands.run(CURL + url).stdout == "403"


def test_intent_ttl_ends_it(env):
    if not HOST:
        pytest.skip(NO_HOST)
    with env.intent(INTENT, ttl_seconds=2):
        assert env.commands.run(CURL + f"http://{HOST}/sdk-ttl").stdout == "200"
        time.sleep(2.5)
        assert env.commands.run(CURL + f"http://{HOST}/sdk-ttl").stdout == "403"


def test_intent_for_one_command(env):
    if not HOST:
        pytest.skip(NO_HOST)
    assert env.commands.run(CURL + f"http://{HOST}/sdk-call", intent=INTENT).stdout == "200"
    assert env.commands.run(CURL + f"http://{HOST}/sdk-call").stdout == "403"
