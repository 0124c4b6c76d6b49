"""Fast tests of agentbox.tools (meta-tool schemas and dispatch)."""

from __future__ import annotations

import json
import os

import pytest

from agentbox import DaemonUnreachable, Environment, Sandbox, tools


def test_openai_format():
    defs = tools.openai_tools()
    assert [d["function"]["name"] for d in defs] == [
        "environment_execute_command", "environment_write_file", "environment_read_file",
        "environment_list_files"]
    ex = defs[0]["function"]
    assert ex["parameters"]["required"] == ["command"]
    assert ex["parameters"]["properties"]["command"]["description"] == \
        "The full shell command to execute."
    assert ex["parameters"]["properties"]["timeout_seconds"]["default"] == 60
    assert ex["description"].startswith("Executes any shell command within the secure, "
                                        "stateful environment.")
    assert all(d["type"] == "function" for d in defs)
    json.dumps(defs)


def test_anthropic_format():
    defs = tools.anthropic_tools()
    names = [d["name"] for d in defs]
    assert names == ["environment_execute_command", "environment_write_file",
                     "environment_read_file", "environment_list_files"]
    write = defs[1]["input_schema"]
    assert write["required"] == ["path", "content"]
    assert write["properties"]["path"]["description"] == \
        "The relative path within the workspace (e.g., 'src/main.py')."
    assert defs[2]["input_schema"]["properties"]["path"]["description"] == \
        "The relative path of the file to read."
    import re
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", n) for n in names)


def test_names():
    assert tools.canonical_name("environment_read_file") == "environment.read_file"
    assert tools.canonical_name("read_file") == "environment.read_file"
    assert tools.wire_name("environment.write_file") == "environment_write_file"
    with pytest.raises(KeyError):
        tools.canonical_name("rm_rf")
    defs = tools.tool_definitions()
    defs[0]["name"] = "changed"
    assert tools.TOOLS[0]["name"] == "environment.execute_command"


def test_dispatch_shapes(fake):
    with Sandbox.create(url=fake.url) as env:
        w = tools.dispatch(env, "environment.write_file",
                           {"path": "src/main.py", "content": "print(40 + 2)\n"})
        assert w == {"error": False, "message": "File saved successfully."}
        x = tools.dispatch(env, "environment_execute_command",
                           json.dumps({"command": "python3 src/main.py"}))
        assert x == {"error": False, "stdout": "42\n", "stderr": "", "exit_code": 0}
        r = tools.dispatch(env, "read_file", {"path": "src/main.py"})
        assert r == {"error": False, "content": "print(40 + 2)\n"}
        listing = tools.dispatch(env, "list_files", {"path": "src"})
        assert listing["error"] is False and listing["truncated"] is False
        assert [(e["name"], e["type"]) for e in listing["entries"]] == [("main.py", "file")]
        assert listing["entries"][0]["size"] == len("print(40 + 2)\n")
        assert tools.dispatch(env, "environment_list_files", {})["error"] is False
        bad = tools.dispatch(env, "environment.execute_command", {"command": "exit 4"})
        assert bad["error"] is True and bad["exit_code"] == 4
        t = tools.dispatch(env, "environment.execute_command",
                           {"command": "sleep 20", "timeout_seconds": 1})
        assert t["exit_code"] == 124 and t["error"] is True


def test_dispatch_errors_come_back_as_data(fake):
    with Sandbox.create(url=fake.url) as env:
        missing = tools.dispatch(env, "environment.read_file", {"path": "nope.txt"})
        assert missing["error"] is True and "nope.txt" in missing["content"]
        assert set(missing) == {"error", "content"}
        esc = tools.dispatch(env, "environment.write_file", {"path": "../../x", "content": ""})
        assert esc["error"] is True and set(esc) == {"error", "message"}
        assert tools.dispatch(env, "rm_rf", {})["error"] is True
        assert tools.dispatch(env, "environment.execute_command", "{not json")["error"]
        assert tools.dispatch(env, "environment.execute_command", {})["error"]
        assert "Unknown argument" in tools.dispatch(
            env, "environment.read_file", {"path": "a", "x": 1})["content"]
        assert tools.dispatch(env, "environment.write_file", {"path": "a"})["error"]
        gone = tools.dispatch(env, "list_files", {"path": "no/such/dir"})
        assert gone["error"] is True and set(gone) == {"error", "message"}
        # MCP-only tools are not the planner's: the dispatcher names the planner tools.
        assert "Unknown tool" in tools.dispatch(env, "create_environment", {})["message"]


def test_dispatch_raises_infrastructure_errors(dead_url):
    env = Environment(Sandbox(url=dead_url)._transport, "env_x")
    with pytest.raises(DaemonUnreachable):
        tools.dispatch(env, "environment.execute_command", {"command": "true"})


def test_result_message_helpers():
    out = {"error": True, "content": "File not found: x"}
    msg = tools.openai_tool_message("call_1", out)
    assert msg == {"role": "tool", "tool_call_id": "call_1",
                   "content": '{"error": true, "content": "File not found: x"}'}
    block = tools.anthropic_tool_result("toolu_1", out)
    assert block["type"] == "tool_result" and block["is_error"] is True
    assert json.loads(block["content"]) == out


# -- the one catalogue file ------------------------------------------------------------------
_REPO_CATALOGUE = os.path.join(os.path.dirname(__file__), "..", "..", "tools.json")


def test_tools_come_from_the_one_catalogue_file():
    # esbd embeds sdk/tools.json at build time (src/api/tools_catalog_test.cc checks that
    # side); the SDK must read the very same file, not a copy.
    packaged = os.path.join(os.path.dirname(tools.__file__), "tools.json")
    assert os.path.samefile(os.path.realpath(packaged), _REPO_CATALOGUE)
    with open(_REPO_CATALOGUE, encoding="utf-8") as f:
        everything = json.load(f)["tools"]
    assert tools.CATALOGUE == everything
    assert tools.TOOLS == [t for t in everything if t["planner"]]
    assert [t["name"] for t in tools.TOOLS] == list(tools.TOOL_NAMES)


def test_mcp_view_follows_the_catalogue_rule():
    mcp = tools.mcp_tools()
    assert [t["name"] for t in mcp] == [
        "create_environment", "list_environments", "delete_environment", "execute_command",
        "write_file", "read_file", "list_files", "run_code", "list_environment_tools",
        "call_environment_tool"]
    for entry, t in zip(tools.CATALOGUE, mcp):
        props = t["inputSchema"]["properties"]
        if entry["scope"] == "environment":
            assert list(props)[0] == "environment_id"
            assert t["inputSchema"]["required"][0] == "environment_id"
            assert list(props)[1:] == list(entry["input_schema"]["properties"])
        else:
            assert t["inputSchema"] == entry["input_schema"]
        assert t["description"] == entry["description"] + " " + entry["output_description"]
        assert t.get("annotations") == entry.get("annotations")
    assert mcp[7]["inputSchema"]["properties"]["tier"]["enum"] == ["auto", "nano", "heavy"]


def test_vendor_descriptions_follow_the_catalogue_rule():
    with open(_REPO_CATALOGUE, encoding="utf-8") as f:
        neutral = [t for t in json.load(f)["tools"] if t["planner"]]
    assert len(neutral) == len(tools.openai_tools()) == len(tools.anthropic_tools()) == 4
    for t, o, a in zip(neutral, tools.openai_tools(), tools.anthropic_tools()):
        want = t["description"] + " " + t["output_description"]
        assert o["function"]["description"] == want
        assert a["description"] == want
        assert o["function"]["name"] == a["name"] == t["name"].replace(".", "_")


def test_wheel_and_sdist_carry_the_catalogue_content(tmp_path):
    import importlib.util
    import tarfile
    import zipfile
    backend_path = os.path.join(os.path.dirname(__file__), "..", "_build_backend",
                                "agentbox_build.py")
    spec = importlib.util.spec_from_file_location("agentbox_build_under_test", backend_path)
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    with open(_REPO_CATALOGUE, "rb") as f:
        want = f.read()
    wheel = backend.build_wheel(str(tmp_path))
    with zipfile.ZipFile(tmp_path / wheel) as zf:
        assert zf.read("agentbox/tools.json") == want
    sdist = backend.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / sdist) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("agentbox/tools.json"))
        assert member.isfile(), "the sdist must hold the catalogue, not a link out of it"
        assert tf.extractfile(member).read() == want
