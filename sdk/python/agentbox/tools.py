"""Seed 004's meta-tools for LLM planners, in OpenAI and Anthropic formats, and a dispatcher.

The planner tools (seed 004's three, with its wording, and ``list_files``) act on one
environment:

===============================  =================================  ==========================
canonical name                   name sent to OpenAI / Anthropic    output shape
===============================  =================================  ==========================
``environment.execute_command``  ``environment_execute_command``    ``{error, stdout, stderr,
                                                                    exit_code}``
``environment.write_file``       ``environment_write_file``         ``{error, message}``
``environment.read_file``        ``environment_read_file``          ``{error, content}``
``environment.list_files``       ``environment_list_files``         ``{error, entries,
                                                                    truncated}``
===============================  =================================  ==========================

The catalogue file also holds the tools of esbd's MCP server (``/mcp``): :data:`CATALOGUE` is
every entry, :func:`mcp_tools` their MCP form exactly as esbd lists them (``environment_id``
added to the environment tools).

Both vendors only accept tool names matching ``^[a-zA-Z0-9_-]+$``, so the ``.`` becomes
``_`` on the wire. :func:`dispatch` accepts the canonical name, the wire name and the bare
name (``execute_command``).

Example (OpenAI-compatible chat completion)::

    from agentbox import Sandbox, tools
    with Sandbox.create() as env:
        for call in message["tool_calls"]:
            out = tools.dispatch(env, call["function"]["name"], call["function"]["arguments"])
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping, Optional, Union

from .errors import AuthError, DaemonUnreachable, SandboxError, ServerError

__all__ = ["TOOLS", "TOOL_NAMES", "CATALOGUE", "canonical_name", "wire_name", "openai_tools",
           "anthropic_tools", "mcp_tools", "dispatch", "tool_definitions", "openai_tool_message",
           "anthropic_tool_result"]

_EXECUTE = "environment.execute_command"
_WRITE = "environment.write_file"
_READ = "environment.read_file"
_LIST = "environment.list_files"


def _load_catalogue() -> list[dict[str, Any]]:
    # The one catalogue (sdk/tools.json, packaged as agentbox/tools.json): esbd embeds the same
    # file at build time, so the daemon's GET /tools and this module cannot drift apart.
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools.json"),
              encoding="utf-8") as f:
        return json.load(f)["tools"]


#: Every tool of the catalogue (planner tools and the MCP server's), in the file's order.
CATALOGUE: list[dict[str, Any]] = _load_catalogue()

#: The planner's meta-tools in a neutral form: name, description and JSON schema of the
#: inputs (what ``GET /tools`` serves as ``tools``). Descriptions are seed 004's words.
TOOLS: list[dict[str, Any]] = [t for t in CATALOGUE if t["planner"]]

#: Canonical (seed 004) tool names.
TOOL_NAMES: tuple[str, ...] = tuple(t["name"] for t in TOOLS)


def wire_name(name: str) -> str:
    """The name sent to OpenAI/Anthropic: ``environment.execute_command`` →
    ``environment_execute_command``."""
    return canonical_name(name).replace(".", "_")


def canonical_name(name: str) -> str:
    """Map any accepted spelling (canonical, wire or bare) to the canonical name; raises
    :class:`KeyError` for unknown tools."""
    for canon in TOOL_NAMES:
        bare = canon.split(".", 1)[1]
        if name in (canon, canon.replace(".", "_"), bare):
            return canon
    raise KeyError(name)


def tool_definitions() -> list[dict[str, Any]]:
    """A deep copy of :data:`TOOLS` (name, description, input_schema, output_description)."""
    return copy.deepcopy(TOOLS)


def _description(tool: Mapping[str, Any]) -> str:
    return f"{tool['description']} {tool['output_description']}"


def openai_tools() -> list[dict[str, Any]]:
    """The meta-tools in OpenAI's function-calling format (``tools=`` of
    ``/chat/completions``)."""
    return [{"type": "function",
             "function": {"name": wire_name(t["name"]), "description": _description(t),
                          "parameters": copy.deepcopy(t["input_schema"])}} for t in TOOLS]


def anthropic_tools() -> list[dict[str, Any]]:
    """The meta-tools in Anthropic's Messages API tool format (``tools=``)."""
    return [{"name": wire_name(t["name"]), "description": _description(t),
             "input_schema": copy.deepcopy(t["input_schema"])} for t in TOOLS]


def mcp_tools() -> list[dict[str, Any]]:
    """Every catalogue tool as esbd's MCP server lists it (``tools/list`` on ``/mcp``, and
    ``GET /tools`` ``mcp``): MCP name (after the first ``.``), description, ``inputSchema``
    with ``environment_id`` added first and required on environment tools, annotations."""
    out = []
    for t in CATALOGUE:
        schema = copy.deepcopy(t["input_schema"])
        if t["scope"] == "environment":
            schema["properties"] = {"environment_id": _ENVIRONMENT_ID, **schema["properties"]}
            schema["required"] = ["environment_id", *schema.get("required", [])]
        tool = {"name": t["name"].split(".", 1)[1], "description": _description(t),
                "inputSchema": schema}
        if "annotations" in t:
            tool["annotations"] = copy.deepcopy(t["annotations"])
        out.append(tool)
    return out


# The property the MCP view adds to environment tools (src/api/tools_catalog.cc says the same).
_ENVIRONMENT_ID = {"type": "string", "minLength": 1, "maxLength": 64,
                   "description": "The environment to act on: an id from create_environment "
                                  "or list_environments."}


def _failure(tool: Optional[str], message: str) -> dict[str, Any]:
    if tool == _EXECUTE:
        return {"error": True, "stdout": "", "stderr": message, "exit_code": -1}
    if tool == _READ:
        return {"error": True, "content": message}
    return {"error": True, "message": message}  # write_file, list_files, unknown tools


def dispatch(env: Any, name: str, arguments: Union[str, Mapping[str, Any], None]) -> dict[str, Any]:
    """Execute one tool call from a model against ``env`` and return seed 004's output shape.

    Args:
        env: an :class:`agentbox.Environment`.
        name: the tool name in any accepted spelling.
        arguments: the call's arguments, as a mapping or as the JSON string OpenAI sends.

    Returns:
        ``{error, stdout, stderr, exit_code}``, ``{error, message}``, ``{error, content}`` or
        ``{error, entries, truncated}``.
        Problems the model can fix (unknown tool, bad arguments, missing file, bad path) come
        back as ``error: true`` with the daemon's message, so the model can read them.

    Raises:
        AuthError, DaemonUnreachable, ServerError: infrastructure failures the model cannot
        fix are raised, not returned.
    """
    try:
        tool = canonical_name(name)
    except KeyError:
        return _failure(None, f"Unknown tool {name!r}. Available: "
                              + ", ".join(wire_name(n) for n in TOOL_NAMES))
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return _failure(tool, f"Arguments are not valid JSON: {exc}")
    else:
        args = dict(arguments or {})
    if not isinstance(args, dict):
        return _failure(tool, "Arguments must be a JSON object.")
    allowed = set(next(t for t in TOOLS if t["name"] == tool)["input_schema"]["properties"])
    unknown = sorted(set(args) - allowed)
    if unknown:
        return _failure(tool, f"Unknown argument(s): {', '.join(unknown)}.")
    try:
        if tool == _EXECUTE:
            command = args.get("command")
            if not isinstance(command, str) or not command.strip():
                return _failure(tool, "'command' must be a non-empty string.")
            timeout = args.get("timeout_seconds", 60)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                return _failure(tool, "'timeout_seconds' must be a number of seconds.")
            return env.commands.run(command, timeout=timeout).to_tool_output()
        if tool == _WRITE:
            path, content = args.get("path"), args.get("content")
            if not isinstance(path, str) or not path:
                return _failure(tool, "'path' must be a non-empty string.")
            if not isinstance(content, str):
                return _failure(tool, "'content' must be a string.")
            env.files.write(path, content)
            return {"error": False, "message": "File saved successfully."}
        if tool == _LIST:
            path = args.get("path", ".")
            if not isinstance(path, str) or not path:
                return _failure(tool, "'path' must be a non-empty string.")
            # The raw answer (not files.list): it also says whether the listing was cut.
            answer = env._transport.json("GET", env.files._path("list"), query={"path": path})
            entries = [{"name": str(e.get("name", "")), "type": str(e.get("type", "other")),
                        "size": int(e.get("size", 0) or 0)}
                       for e in answer.get("entries") or [] if isinstance(e, dict)]
            return {"error": False, "entries": entries,
                    "truncated": bool(answer.get("truncated", False))}
        path = args.get("path")
        if not isinstance(path, str) or not path:
            return _failure(tool, "'path' must be a non-empty string.")
        return {"error": False, "content": env.files.read(path, format="text")}
    except (AuthError, DaemonUnreachable, ServerError):
        raise
    except SandboxError as exc:
        return _failure(tool, exc.message)


def openai_tool_message(tool_call_id: str, output: Mapping[str, Any]) -> dict[str, Any]:
    """The ``{"role": "tool", ...}`` chat message that returns ``output`` (from
    :func:`dispatch`) to an OpenAI-compatible model for the call ``tool_call_id``."""
    return {"role": "tool", "tool_call_id": tool_call_id,
            "content": json.dumps(dict(output), ensure_ascii=False)}


def anthropic_tool_result(tool_use_id: str, output: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tool_result`` content block that returns ``output`` (from :func:`dispatch`) to
    an Anthropic model for the ``tool_use`` block ``tool_use_id``."""
    return {"type": "tool_result", "tool_use_id": tool_use_id,
            "content": json.dumps(dict(output), ensure_ascii=False),
            "is_error": bool(output.get("error"))}
