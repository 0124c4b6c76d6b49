"""Fast tests of the network-governance surface (network policy, intents, CA) against the
fake esbd: what goes on the wire and how answers and errors come back."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentbox import (AsyncSandbox, Conflict, IntentScope, InvalidArgument, Sandbox,
                      SandboxNotFound)

POLICY = {"mode": "allowlist", "allow": ["pypi.test", "*.git.test"], "deny": ["evil.test"]}


def test_create_sends_the_policy_and_network_reads_it_back(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        assert fake.create_bodies[-1]["network"] == POLICY
        got = env.network
        assert got["mode"] == "allowlist" and got["allow"] == POLICY["allow"]
        assert got["deny"] == ["evil.test"] and got["tls_inspect"] is True  # defaults filled
        assert ("GET", f"/environments/{env.id}/network") in fake.requests


def test_create_without_network_sends_none_of_it_and_reads_none(fake):
    with Sandbox.create(url=fake.url) as env:
        assert "network" not in fake.create_bodies[-1]
        assert env.network == "none"
        assert env.set_network("none") == "none"
        with pytest.raises(Conflict):  # egress or not is fixed at create
            env.set_network(POLICY)
        with pytest.raises(Conflict):
            env.activate_intent("check-weather")
    with Sandbox.create(url=fake.url, network="none") as env:
        assert fake.create_bodies[-1]["network"] == "none"


def test_bad_network_values_are_refused_before_any_request(fake):
    for bad in ("open", "", 3, ["pypi.org"]):
        with pytest.raises(InvalidArgument) as info:
            Sandbox.create(url=fake.url, network=bad)
        assert "network" in str(info.value)
    assert ("POST", "/environments") not in fake.requests


def test_the_daemons_policy_validation_error_surfaces(fake):
    with pytest.raises(InvalidArgument) as info:
        Sandbox.create(url=fake.url, network={"mode": "wide-open"})
    assert info.value.status == 400 and "mode" in str(info.value)


def test_set_network_replaces_the_policy_live(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        stored = env.set_network({"mode": "blocked"})
        assert stored["mode"] == "blocked"
        assert env.network["mode"] == "blocked"
        env.network = {"mode": "open", "deny": ["evil.test"]}  # the property setter
        assert env.network["mode"] == "open"
        with pytest.raises(Conflict):  # a governed environment stays governed
            env.set_network("none")
        puts = [r for r in fake.requests if r == ("PUT", f"/environments/{env.id}/network")]
        assert len(puts) == 3
        with pytest.raises(InvalidArgument):
            env.set_network("everything")


def test_intent_context_manager_activates_then_deactivates(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        assert env.intents() == []
        with env.intent("check-weather", ttl_seconds=120) as scope:
            assert isinstance(scope, IntentScope)
            assert scope.info["environment_id"] == env.id
            (active,) = scope.info["intents"]
            assert active["intent"] == "check-weather" and active["allow"] == ["weather.example"]
            assert active["expires_in_seconds"] > 100
            assert [i["intent"] for i in env.intents()] == ["check-weather"]
            env.commands.run("true")
        assert env.intents() == []
        assert fake.intents_during_execute[-1] == ["check-weather"]
        env.commands.run("true")
        assert fake.intents_during_execute[-1] == []
        path = f"/environments/{env.id}/intents"
        assert ("POST", path) in fake.requests
        assert ("DELETE", path + "/check-weather") in fake.requests


def test_intent_is_deactivated_when_the_block_raises(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        with pytest.raises(RuntimeError):
            with env.intent("check-weather"):
                raise RuntimeError("the task failed")
        assert env.intents() == []


def test_intent_that_expired_inside_the_block_exits_quietly(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        with env.intent("check-weather", ttl_seconds=1):
            time.sleep(1.2)
            assert env.intents() == []  # the TTL ended it before the block did
        assert env.deactivate_intent("check-weather") is False


def test_unknown_intent_and_bad_ttl_are_errors(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        with pytest.raises(InvalidArgument) as info:
            with env.intent("exfiltrate-everything"):
                pass
        assert "catalogue" in str(info.value)
        for bad in (0, -5, True, 1.5):
            with pytest.raises(InvalidArgument):
                env.activate_intent("check-weather", ttl_seconds=bad)
        with pytest.raises(InvalidArgument):
            env.intent("")


def test_intent_on_a_command_and_run_code(fake_run):
    box = Sandbox(url=fake_run.url)
    with box.create(network=POLICY) as env:
        env.commands.run("true", intent="check-weather")
        assert fake_run.execute_bodies[-1]["intent"] == "check-weather"
        assert fake_run.intents_during_execute[-1] == ["check-weather"]
        env.commands.run("true")
        assert "intent" not in fake_run.execute_bodies[-1]
        env.run_code("1 + 1", intent="check-weather")
        assert fake_run.run_bodies[-1]["intent"] == "check-weather"
        with pytest.raises(InvalidArgument):
            env.commands.run("true", intent="")
    with box.create() as env:  # no network policy: the daemon refuses the intent
        with pytest.raises(Conflict):
            env.commands.run("true", intent="check-weather")


def test_ca_pem_returns_the_environment_ca(fake):
    with Sandbox.create(url=fake.url, network=POLICY) as env:
        pem = env.ca_pem()
        assert pem.startswith("-----BEGIN CERTIFICATE-----\n")
        assert pem.rstrip().endswith("-----END CERTIFICATE-----")
    with Sandbox.create(url=fake.url) as env:
        with pytest.raises(SandboxNotFound):
            env.ca_pem()


def test_async_twins(fake):
    async def main() -> None:
        box = AsyncSandbox(url=fake.url)
        async with await box.create(network=POLICY) as env:
            assert (await env.get_network())["allow"] == POLICY["allow"]
            assert (await env.set_network({"mode": "blocked"}))["mode"] == "blocked"
            await env.set_network(POLICY)
            async with env.intent("check-weather", ttl_seconds=60) as scope:
                assert scope.info["intents"][0]["intent"] == "check-weather"
                assert [i["intent"] for i in await env.intents()] == ["check-weather"]
                await env.commands.run("true")
            assert await env.intents() == []
            assert fake.intents_during_execute[-1] == ["check-weather"]
            await env.commands.run("true", intent="check-weather")
            assert fake.execute_bodies[-1]["intent"] == "check-weather"
            assert (await env.ca_pem()).startswith("-----BEGIN CERTIFICATE-----")
    asyncio.run(main())

