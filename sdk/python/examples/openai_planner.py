#!/usr/bin/env python3
"""Plan → Execute → Review with an OpenAI-compatible chat endpoint as the planner.

Environment:
    OPENAI_BASE_URL   e.g. https://api.openai.com/v1 or http://127.0.0.1:11434/v1 (required)
    OPENAI_API_KEY    the endpoint's key (optional for local servers)
    OPENAI_MODEL      model name (default: gpt-4o-mini)
    AGENTBOX_URL      esbd (default http://127.0.0.1:8080); AGENTBOX_API_KEY if it has keys

Usage:
    python3 examples/openai_planner.py "Write a Python script that prints the first 10 primes"

The model sees seed 004's three meta-tools (as OpenAI functions: environment_execute_command,
environment_write_file, environment_read_file). Each round, the tool calls it returns form
the plan; the executor runs them in one environment; on rejection, the reviewer's feedback
and the execution log go back to the model. Standard library only (urllib).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agentbox import tools  # noqa: E402
from agentbox.workflow import PlanRequest, ToolCall, run_workflow  # noqa: E402

SYSTEM = ("You are a software agent working in a stateful Linux sandbox (bash as appuser in "
          "/workspace, no network). Solve the user's task by calling the tools. Return all the "
          "tool calls needed, in order, in one answer; the last command's stdout should show "
          "the result.")


class OpenAIPlanner:
    """A planner that asks an OpenAI-compatible ``/chat/completions`` endpoint for tool
    calls."""

    def __init__(self, base_url: str, api_key: str | None, model: str) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.model = model

    def _chat(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = json.dumps({"model": self.model, "messages": messages,
                           "tools": tools.openai_tools(), "tool_choice": "auto"}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{self.url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc

    def __call__(self, request: PlanRequest) -> list[ToolCall]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": request.task}]
        if request.feedback:
            log = [{"step": s.index, "tool": s.tool, "arguments": s.arguments,
                    "output": s.output} for s in request.previous_log or []]
            messages.append({"role": "user", "content": (
                "Your previous plan was rejected by the reviewer: " + request.feedback
                + "\nExecution log:\n" + json.dumps(log)[:20000]
                + "\nThe environment keeps its state. Send a corrected plan.")})
        answer = self._chat(messages)
        message = answer["choices"][0]["message"]
        calls = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                 for c in message.get("tool_calls") or []]
        if not calls:
            print(f"model answered without tool calls: {message.get('content')!r}")
        return calls


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    base = os.environ.get("OPENAI_BASE_URL")
    if not base:
        print("set OPENAI_BASE_URL (and OPENAI_API_KEY) first", file=sys.stderr)
        return 2
    planner = OpenAIPlanner(base, os.environ.get("OPENAI_API_KEY"),
                            os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    report = run_workflow(" ".join(sys.argv[1:]), planner, max_iterations=3,
                          on_step=lambda s: print(f"{s.describe()} -> exit={s.exit_code} "
                                                  f"error={s.error} ({s.duration_ms:.0f} ms)"))
    print(json.dumps(report.final_output, indent=2))
    print("APPROVED" if report.approved
          else f"REJECTED: {report.review.feedback if report.review else 'not reviewed'}")
    return 0 if report.approved else 1


if __name__ == "__main__":
    sys.exit(main())
