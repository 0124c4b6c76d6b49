#!/usr/bin/env python3
"""A tour of the agentbox SDK. Needs a running esbd (AGENTBOX_URL, default
http://127.0.0.1:8080; AGENTBOX_API_KEY if the daemon has keys).

    python3 sdk/python/examples/quickstart.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agentbox import Sandbox, SandboxConfig, tools  # noqa: E402
from agentbox.workflow import ScriptedPlanner, run_workflow  # noqa: E402


def main() -> None:
    # 1. One-shot code (seed 002 §5)
    box = Sandbox()
    print("health:", box.health())
    result = box.run('import json\nprint(json.dumps({"status": "ok"}))')
    print("run:", result.stdout.strip(), "| exit", result.exit_code, "| via", result.via)
    timed = box.run("while True: pass", config=SandboxConfig(timeout_ms=1000))
    print("timeout:", timed.timed_out, timed.exit_code)

    # 2. A stateful environment (deleted when the block ends, even on error)
    with Sandbox.create(ttl_seconds=300) as env:
        env.commands.run("mkdir -p demo && cd demo && export NAME=world")
        print(env.commands.run('pwd; echo "hello $NAME"').stdout, end="")
        env.commands.run("for i in 1 2 3; do echo tick $i; sleep 0.3; done",
                         on_stdout=lambda chunk: print("stream:", chunk, end=""))
        env.files.write("demo/data.bin", bytes(range(8)))
        print("bytes:", env.files.read("demo/data.bin", format="bytes"))
        print("ls:", [(e.name, e.type, e.size) for e in env.files.list("demo")])

        # 3. What an LLM's tool call looks like when dispatched
        print(tools.dispatch(env, "environment_execute_command", '{"command": "echo 42"}'))

    # 4. Plan → Execute → Review
    plan = ScriptedPlanner([
        ("environment.write_file", {"path": "hello.py", "content": "print('hi from a plan')"}),
        ("environment.execute_command", {"command": "python3 hello.py"}),
    ])
    report = run_workflow("say hi", plan)
    print("workflow approved:", report.approved, report.final_output)


if __name__ == "__main__":
    main()
