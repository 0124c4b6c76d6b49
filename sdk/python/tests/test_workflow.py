"""Fast tests of agentbox.workflow (Plan → Execute → Review)."""

from __future__ import annotations

import pytest

from agentbox import ReviewFailed, Sandbox
from agentbox.workflow import (Review, ScriptedPlanner, ToolCall, default_reviewer,
                               run_workflow)


def test_plan_execute_review_approves(fake):
    planner = ScriptedPlanner([
        ToolCall("environment.write_file", {"path": "job/run.py", "content": "print(7*6)"}),
        {"name": "environment_execute_command", "arguments": '{"command": "cd job"}'},
        ("execute_command", {"command": "python3 run.py"}),
    ])
    seen = []
    report = run_workflow("compute 42", planner, sandbox=Sandbox(url=fake.url),
                          on_step=seen.append)
    assert report.approved and report.deprovisioned
    assert [s.tool for s in report.log] == ["environment.write_file",
                                            "environment.execute_command",
                                            "environment.execute_command"]
    assert report.final_output == {"error": False, "stdout": "42\n", "stderr": "",
                                   "exit_code": 0}
    assert [s.exit_code for s in report.log] == [None, 0, 0]
    assert all(s.duration_ms >= 0 and s.started_at.endswith("Z") for s in report.log)
    assert len(seen) == 3
    assert fake.live() == []
    assert '"approved": true' in report.to_json()
    assert planner.requests[0].task == "compute 42" and planner.requests[0].iteration == 1


def test_default_reviewer_names_failing_step_and_revision_loop(fake):
    planner = ScriptedPlanner(
        [{"name": "environment.execute_command", "arguments": {"command": "echo a"}},
         {"name": "environment.execute_command", "arguments": {"command": "make"}},
         {"name": "environment.execute_command", "arguments": {"command": "echo never"}}],
        [{"name": "environment.execute_command", "arguments": {"command": "echo fixed"}}])
    report = run_workflow("t", planner, sandbox=Sandbox(url=fake.url), max_iterations=2)
    first = report.iterations[0]
    assert len(first) == 2  # stopped at the failing step
    assert report.approved and len(report.iterations) == 2
    feedback = planner.requests[1].feedback
    assert feedback.startswith("step 2 (environment.execute_command: make) exited with code ")
    assert planner.requests[1].previous_log is first
    assert fake.live() == []


def test_rejection_and_raise_for_review(fake):
    planner = ScriptedPlanner([{"name": "environment.read_file", "arguments": {"path": "x"}}])
    report = run_workflow("t", planner, sandbox=Sandbox(url=fake.url))
    assert not report.approved and report.review.failed_step == 1
    with pytest.raises(ReviewFailed) as info:
        report.raise_for_review()
    assert info.value.report is report
    assert fake.live() == []


def test_cleanup_when_planner_raises(fake):
    def planner(request):
        raise RuntimeError("model offline")
    with pytest.raises(RuntimeError):
        run_workflow("t", planner, sandbox=Sandbox(url=fake.url))
    assert len(fake.envs) == 1 and fake.live() == []


def test_cleanup_when_step_raises(fake):
    class Exploding:
        name = "x"

    def planner(request):
        return [{"name": "environment.execute_command", "arguments": {"command": "true"}},
                Exploding()]
    report = run_workflow("t", planner, sandbox=Sandbox(url=fake.url), stop_on_failure=False)
    assert report.log[1].tool == "invalid" and fake.live() == []

    def reviewer(log):
        raise ValueError("reviewer crashed")
    with pytest.raises(ValueError):
        run_workflow("t", ScriptedPlanner([("execute_command", {"command": "true"})]),
                     sandbox=Sandbox(url=fake.url), reviewer=reviewer)
    assert fake.live() == []


def test_cleanup_when_env_deleted_underneath(fake):
    def planner(request):
        Sandbox(url=fake.url).connect(request.environment_id).kill()
        return [("execute_command", {"command": "true"})]
    report = run_workflow("t", planner, sandbox=Sandbox(url=fake.url))
    assert not report.approved and "not found" in report.review.feedback.lower()


def test_custom_reviewer_and_env_options(fake):
    def reviewer(log):
        ok = log[-1].output["stdout"].strip() == "512"
        return Review(ok, "wrong memory" if not ok else "fine")
    planner = ScriptedPlanner([("execute_command", {"command": "echo 512"})])
    report = run_workflow("t", planner, sandbox=Sandbox(url=fake.url), reviewer=reviewer,
                          environment={"memory_mb": 512, "ttl_seconds": 60})
    assert report.approved and fake.create_bodies[-1] == {"memory_mb": 512, "ttl_seconds": 60}


def test_default_reviewer_edge_cases():
    assert not default_reviewer([]).approved


def test_openai_planner_example_against_a_fake_chat_endpoint(fake):
    """examples/openai_planner.py drives the loop from an OpenAI-compatible endpoint."""
    import importlib.util
    import json
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Chat(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            revision = any("rejected" in m["content"] for m in body["messages"]
                           if m["role"] == "user")
            cmd = "echo fixed" if revision else "exit 9"
            calls = [{"id": "c1", "type": "function", "function": {
                "name": "environment_execute_command",
                "arguments": json.dumps({"command": cmd})}}]
            raw = json.dumps({"choices": [{"message": {"role": "assistant", "content": None,
                                                       "tool_calls": calls}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    chat = ThreadingHTTPServer(("127.0.0.1", 0), Chat)
    threading.Thread(target=chat.serve_forever, daemon=True).start()
    try:
        path = os.path.join(os.path.dirname(__file__), "..", "examples", "openai_planner.py")
        spec = importlib.util.spec_from_file_location("openai_planner", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        planner = mod.OpenAIPlanner(f"http://127.0.0.1:{chat.server_address[1]}/v1", "sk-x",
                                    "test-model")
        report = run_workflow("do it", planner, sandbox=Sandbox(url=fake.url), max_iterations=2)
    finally:
        chat.shutdown()
        chat.server_close()
    assert report.approved and report.final_output["stdout"] == "fixed\n"
    assert [s[0] for s in seen] == ["/v1/chat/completions"] * 2
    assert seen[0][1] == "Bearer sk-x" and seen[0][2]["model"] == "test-model"
    assert [t["function"]["name"] for t in seen[0][2]["tools"]][0] == \
        "environment_execute_command"
    assert "exit 9" in seen[1][2]["messages"][-1]["content"]
    assert fake.live() == []
