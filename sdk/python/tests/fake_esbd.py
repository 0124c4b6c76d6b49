"""A small in-process fake of esbd implementing docs/api.md, for the SDK's fast tests.

It is a test double, not a sandbox: commands run with the host's bash inside a temporary
directory that plays /workspace. Only the test suite's own commands ever reach it.
Shell state (cd, exported and plain variables, functions) persists between calls through a
state file, which is enough to exercise the SDK's contract.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import io
import json
import mimetypes
import os
import queue
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

CAP = 1024 * 1024
_SKIP_VARS = ("BASH", "BASHOPTS", "BASHPID", "BASH_ALIASES", "BASH_ARGC", "BASH_ARGV",
              "BASH_ARGV0", "BASH_CMDS", "BASH_COMMAND", "BASH_LINENO", "BASH_SOURCE",
              "BASH_SUBSHELL", "BASH_VERSINFO", "BASH_VERSION", "EUID", "PPID", "SHELLOPTS",
              "UID", "_", "FUNCNAME", "GROUPS", "__rc", "__S", "DIRSTACK", "HISTCMD",
              "LINENO", "RANDOM", "SECONDS", "SRANDOM", "EPOCHREALTIME", "EPOCHSECONDS",
              "PIPESTATUS", "OLDPWD", "PWD", "SHLVL", "COLUMNS", "LINES", "HOSTNAME",
              "HOSTTYPE", "MACHTYPE", "OSTYPE", "IFS", "OPTIND", "OPTERR", "PS4", "PS1", "PS2")
_ENV_FIELDS = {"image", "runtime", "cpu", "memory_mb", "pids", "disk_mb", "ttl_seconds", "env",
               "network", "volumes", "steps"}
_STEPS_FIELDS = {"capture", "max_steps", "max_bytes", "max_live_memory", "ttl_s"}
# Routes that are steps (docs/api.md "Steps"): (method, route) -> kind.
_STEP_KINDS = {("POST", ("execute",)): "execute", ("POST", ("run",)): "run",
               ("POST", ("files", "write")): "files.write", ("PUT", ("files", "raw")): "files.write",
               ("POST", ("files", "mkdir")): "files.mkdir",
               ("POST", ("files", "remove")): "files.remove",
               ("POST", ("files", "rename")): "files.rename"}
_RUN_FIELDS = {"code", "timeout_ms", "memory_limit_mb", "allowed_modules", "packages",
               "figure_formats", "intent"}
_POLICY_FIELDS = {"mode", "allow", "deny", "tls_inspect", "tls_exclude", "dlp",
                  "max_body_bytes"}
FAKE_CA_PEM = ("-----BEGIN CERTIFICATE-----\nMIIBfakefakefakeFAKECAforthefakeesbd\n"
               "-----END CERTIFICATE-----\n")


def check_network(network: Any) -> Any:
    """Like esbd: "none" or a policy object (docs/api.md "Network policy"), defaults filled."""
    if network == "none":
        return network
    if not isinstance(network, dict):
        raise ApiError(400, "bad_request", "network must be \"none\" or a policy object")
    unknown = sorted(set(network) - _POLICY_FIELDS)
    if unknown:
        raise ApiError(400, "bad_request", f"network: unknown field '{unknown[0]}'")
    if network.get("mode", "allowlist") not in ("allowlist", "open", "blocked"):
        raise ApiError(400, "bad_request", "network.mode must be allowlist, open or blocked")
    full = {"mode": "allowlist", "allow": [], "deny": [], "tls_inspect": True,
            "tls_exclude": [], "dlp": {}, "max_body_bytes": 10 << 20}
    full.update(network)
    return full

# Runs a cell like esbd's heavy kernel: executes the code and, when the last statement is an
# expression, records its repr as "value" and, for anything that looks like a pandas
# DataFrame (type named DataFrame with columns/index/values), a "table". argv: code file,
# meta file, max table rows.
_CELL_RUNNER = r"""
import ast, json, sys
src = open(sys.argv[1]).read()
tree = ast.parse(src)
last = None
if tree.body and isinstance(tree.body[-1], ast.Expr):
    last = ast.Expression(tree.body.pop().value)
g = {"__name__": "__main__"}
exec(compile(tree, "<cell>", "exec"), g)
meta = {"value": None, "table": None}
if last is not None:
    v = eval(compile(last, "<cell>", "eval"), g)
    if v is not None:
        meta["value"] = repr(v)
    if type(v).__name__ == "DataFrame":
        cap = int(sys.argv[3])
        rows = [list(r) for r in (v.values.tolist() if hasattr(v.values, "tolist") else v.values)]
        cols = [str(c) for c in v.columns]
        meta["table"] = {"columns": cols, "index": list(v.index)[:cap], "rows": rows[:cap],
                         "total_rows": len(rows), "total_columns": len(cols),
                         "truncated": len(rows) > cap}
with open(sys.argv[2], "w") as f:
    json.dump(meta, f)
"""


def now_iso(delta: float = 0.0) -> str:
    t = datetime.now(timezone.utc) + timedelta(seconds=delta)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


@dataclass
class FakeEnv:
    id: str
    tenant: str
    workspace: str
    state_file: str
    options: dict[str, Any]
    created_at: str = field(default_factory=now_iso)
    expires_at: str = ""
    destroyed_at: Optional[str] = None
    destroy_reason: Optional[str] = None
    exec_count: int = 0
    heartbeats: int = 0
    run_steps: int = 0
    reported: set = field(default_factory=set)  # artifact files already reported
    network: Any = "none"
    intents: dict = field(default_factory=dict)  # name -> docs/api.md's intent object
    # The step log: number -> step JSON (with "_files": path -> bytes | None for a dir, and
    # "_state": the shell state file's bytes), the head, whether capture is on.
    steps: dict = field(default_factory=dict)
    head: Optional[int] = None
    capture: bool = True
    last_exec: Optional[dict] = None
    forked_from: Optional[dict] = None

    def record(self) -> dict[str, Any]:
        return {"environment_id": self.id,
                "state": "destroyed" if self.destroyed_at else "running",
                "runtime": self.options.get("runtime", "container"),
                "image": self.options.get("image", "default"),
                "limits": {"cpu": self.options.get("cpu", 1.0),
                           "memory_mb": self.options.get("memory_mb", 512),
                           "pids": self.options.get("pids", 256),
                           "disk_mb": self.options.get("disk_mb", 1024)},
                "created_at": self.created_at, "last_used_at": self.created_at,
                "expires_at": self.expires_at, "destroyed_at": self.destroyed_at,
                "destroy_reason": self.destroy_reason,
                "usage": {"memory_bytes": 0, "cpu_ms": 0, "pids": 0,
                          "exec_count": self.exec_count},
                "steps": {"capture": self.capture, "head": self.head,
                          "count": len(self.steps), "memory": "none",
                          "memory_reason": "the fake keeps files and shell state only"}}


class FakeEsbd:
    """Start with :meth:`start`; ``url`` is then the base URL. ``keys`` maps API keys to
    tenants (None = dev mode, no auth). ``run_endpoint`` enables ``POST /run`` (True), or
    makes it answer 400 "tier_unavailable" like esbd without the run's tier ("unavailable"), or
    a plain 400 whose text only sounds like it ("unavailable_text").

    Runs (``POST /run`` and ``POST /environments/{id}/run``) follow the artifacts contract:
    files written under ``/workspace/artifacts`` become ``file`` artifacts; the fake cannot run
    matplotlib, so a test queues figures in ``next_figures`` (``(title, png_bytes)``), which
    the next run reports as ``image`` artifacts in each of its ``figure_formats``. Packages
    install from ``package_index`` (name → version; others fail with an ``error`` event);
    ``run_error_event``, when set, is sent after the output instead of the result.
    Environment runs are not stateful in the fake (each cell is a fresh interpreter)."""

    def __init__(self, keys: Optional[dict[str, str]] = None, run_endpoint: Any = False,
                 read_limit: int = 16 * 1024 * 1024) -> None:
        self.keys = keys
        self.run_endpoint = run_endpoint
        self.read_limit = read_limit
        self.envs: dict[str, FakeEnv] = {}
        # Variables the next step reports (the fake runs no kernel): a list of
        # {"name", "type", "repr"}; and (env id, step, path) whose content is "collected".
        self.next_variables: Optional[list] = None
        self.collected: set = set()
        # (tenant, name) -> {"name", "size_mb", "created_at", "mounted_by"} (docs/api.md Volumes)
        self.volumes: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.run_bodies: list[dict[str, Any]] = []
        self.execute_bodies: list[dict[str, Any]] = []
        # The intent catalogue (esbd's config "intents"); which intents were active during
        # each execute (name lists), so tests see a per-call intent applied.
        self.intent_catalogue: dict[str, dict[str, Any]] = {
            "check-weather": {"allow": ["weather.example"]}}
        self.intents_during_execute: list[list[str]] = []
        self.create_bodies: list[dict[str, Any]] = []
        self.audit: list[dict[str, Any]] = []
        self.next_figures: list[tuple[Optional[str], bytes]] = []
        self.package_index: dict[str, str] = {"tabulate": "0.9.0", "pandas": "2.1.4"}
        self.package_cache: set[str] = set()
        self.run_error_event: Optional[dict[str, Any]] = None
        self.table_max_rows = 50
        self.stream_runs = True  # False: run endpoints ignore Accept (an older daemon)
        # env id → {"tenant": str, "items": {artifact id: (metadata, bytes)}}; kept after the
        # environment is destroyed, like esbd's artifact retention.
        self.artifact_store: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.root = tempfile.mkdtemp(prefix="fake-esbd-")
        self.server: Optional[ThreadingHTTPServer] = None
        self.url = ""

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "FakeEsbd":
        fake = self

        class Handler(_Handler):
            esbd = fake

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        shutil.rmtree(self.root, ignore_errors=True)

    def live(self) -> list[FakeEnv]:
        return [e for e in self.envs.values() if e.destroyed_at is None]

    # -- helpers ------------------------------------------------------------------------
    def tenant_for(self, auth: Optional[str]) -> str:
        if self.keys is None:
            return "default"
        if not auth or not auth.startswith("Bearer "):
            raise ApiError(401, "unauthorized", "Missing API key (Authorization: Bearer ...).")
        tenant = self.keys.get(auth[len("Bearer "):])
        if tenant is None:
            raise ApiError(401, "unauthorized", "Invalid API key.")
        return tenant

    def env_for(self, tenant: str, env_id: str, *, allow_destroyed: bool = False) -> FakeEnv:
        env = self.envs.get(env_id)
        if env is None or env.tenant != tenant or (env.destroyed_at and not allow_destroyed):
            raise ApiError(404, "not_found", f"Environment {env_id} not found.")
        return env

    def resolve(self, env: FakeEnv, path: Optional[str]) -> str:
        if not path:
            raise ApiError(400, "bad_request", "Missing 'path'.")
        if path.startswith("/workspace"):
            path = path[len("/workspace"):].lstrip("/") or "."
        elif path.startswith("/"):
            raise ApiError(400, "bad_request", "The fake only serves /workspace paths.")
        full = os.path.realpath(os.path.join(env.workspace, path))
        if full != env.workspace and not full.startswith(env.workspace + os.sep):
            raise ApiError(400, "bad_request", f"Path escapes the workspace: {path}")
        return full

    def create(self, tenant: str, body: dict[str, Any]) -> FakeEnv:
        unknown = sorted(set(body) - _ENV_FIELDS)
        if unknown:
            raise ApiError(400, "bad_request", f"Unknown field '{unknown[0]}'.")
        runtime = body.get("runtime", "container")
        if runtime not in ("container",):
            raise ApiError(400, "bad_request", f"Runtime '{runtime}' is not available.")
        mem = body.get("memory_mb", 512)
        if not isinstance(mem, int) or not 32 <= mem <= 16384:
            raise ApiError(400, "bad_request", "memory_mb must be between 32 and 16384.")
        ttl = body.get("ttl_seconds", 900)
        if not isinstance(ttl, int) or not 10 <= ttl <= 86400:
            raise ApiError(400, "bad_request", "ttl_seconds must be between 10 and 86400.")
        env_id = "env_" + secrets.token_hex(8)
        with self.lock:
            for v in body.get("volumes") or []:
                vol = self.volumes.get((tenant, v.get("name")))
                if vol is None:
                    raise ApiError(404, "not_found", f"volume {v.get('name')} not found")
                if vol["mounted_by"]:
                    raise ApiError(409, "conflict", f"volume {v['name']} is mounted by "
                                   f"environment {vol['mounted_by']}")
            for v in body.get("volumes") or []:
                self.volumes[(tenant, v["name"])]["mounted_by"] = env_id
        ws = os.path.realpath(os.path.join(self.root, env_id))
        os.makedirs(ws)
        network = check_network(body.get("network", "none"))
        steps = body.get("steps", {})
        if steps is not False and not isinstance(steps, dict):
            raise ApiError(400, "bad_request", "'steps' must be false or an object")
        if isinstance(steps, dict):
            unknown_steps = sorted(set(steps) - _STEPS_FIELDS)
            if unknown_steps:
                raise ApiError(400, "bad_request", f"steps: unknown field '{unknown_steps[0]}'")
        env = FakeEnv(env_id, tenant, ws, os.path.join(self.root, env_id + ".state"),
                      dict(body), expires_at=now_iso(ttl), network=network,
                      capture=steps is not False and steps.get("capture", True) is not False)
        with self.lock:
            self.envs[env_id] = env
            self.create_bodies.append(dict(body))
        self.record_step(env, "create", "", None)
        return env

    # -- the step log (docs/api.md "Steps") ------------------------------------------------
    def snapshot(self, env: FakeEnv) -> tuple[dict[str, Optional[bytes]], bytes]:
        files: dict[str, Optional[bytes]] = {}
        for root, dirs, names in os.walk(env.workspace):
            rel = os.path.relpath(root, env.workspace)
            for d in dirs:
                files[os.path.normpath(os.path.join(rel, d))] = None
            for n in names:
                with open(os.path.join(root, n), "rb") as f:
                    files[os.path.normpath(os.path.join(rel, n))] = f.read()
        state = b""
        if os.path.exists(env.state_file):
            with open(env.state_file, "rb") as f:
                state = f.read()
        return files, state

    def record_step(self, env: FakeEnv, kind: str, summary: str, result: Optional[dict],
                    variables: Optional[list] = None) -> None:
        if not env.capture and kind not in ("create", "fork"):
            return
        files, state = self.snapshot(env)
        n = len(env.steps)
        parent = env.head
        parent_files = env.steps[parent]["_files"] if parent is not None else {}
        changes = []
        for path in sorted(set(files) | set(parent_files)):
            if path not in parent_files:
                changes.append({"path": path, "change": "added"})
            elif path not in files:
                changes.append({"path": path, "change": "deleted"})
            elif files[path] != parent_files[path]:
                changes.append({"path": path, "change": "modified"})
        result = result or {}
        rc = result.get("exit_code")
        env.steps[n] = {
            "step": n, "parent": parent, "kind": kind, "summary": summary[:200],
            "status": "error" if rc not in (None, 0) else "ok", "exit_code": rc,
            "error": None, "duration_ms": result.get("duration_ms", 0), "capture_ms": 1,
            "tier": "container", "memory": "none",
            "memory_detail": None if env.capture else "off",
            "files_changed": len(changes), "created_at": int(time.time() * 1000),
            "input": {"command": summary} if kind == "execute" else {},
            "output": {"stdout": result.get("stdout", ""), "stderr": result.get("stderr", ""),
                       "truncated": False},
            "variables": variables if variables is not None else self.next_variables,
            "changes": changes, "artifacts": [], "audit": [], "egress": [],
            "shell": {"cwd": "/workspace"}, "_files": files, "_state": state}
        self.next_variables = None
        env.head = n

    def step_json(self, env: FakeEnv, n: int, detail: bool) -> dict[str, Any]:
        s = env.steps[n]
        out = {k: v for k, v in s.items() if not k.startswith("_")}
        out["on_head"] = self.on_head(env, n)
        if detail:
            out["files"] = [{"path": p, "type": "dir" if b is None else "file",
                             "size": 0 if b is None else len(b), "mode": 0o755 if b is None
                             else 0o644,
                             "sha256": None if b is None else hashlib.sha256(b).hexdigest()}
                            for p, b in sorted(s["_files"].items())]
        else:
            for k in ("input", "output", "variables", "changes", "artifacts", "audit",
                      "egress", "shell"):
                out.pop(k)
        return out

    def on_head(self, env: FakeEnv, n: int) -> bool:
        cur = env.head
        while cur is not None:
            if cur == n:
                return True
            cur = env.steps[cur]["parent"]
        return False

    def restore(self, env: FakeEnv, n: int) -> None:
        shutil.rmtree(env.workspace, ignore_errors=True)
        os.makedirs(env.workspace)
        for path, data in sorted(env.steps[n]["_files"].items()):
            full = os.path.join(env.workspace, path)
            if data is None:
                os.makedirs(full, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
        with open(env.state_file, "wb") as f:
            f.write(env.steps[n]["_state"])

    def step_of(self, env: FakeEnv, raw: Any) -> int:
        if isinstance(raw, str):
            if not raw.isdigit():
                raise ApiError(400, "bad_request", f"step must be an integer >= 0, not {raw!r}")
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
            raise ApiError(400, "bad_request", "'step' must be an integer >= 0")
        if raw not in env.steps:
            raise ApiError(404, "not_found", f"environment {env.id} has no step {raw}")
        if not env.capture:
            raise ApiError(409, "conflict", "step capture is off for this environment")
        return raw

    def destroy(self, env: FakeEnv, reason: str = "deleted") -> None:
        if env.destroyed_at is None:
            env.destroyed_at, env.destroy_reason = now_iso(), reason
            shutil.rmtree(env.workspace, ignore_errors=True)
            for vol in self.volumes.values():
                if vol["mounted_by"] == env.id:
                    vol["mounted_by"] = None

    def spawn(self, env: FakeEnv, command: str, extra_env: dict[str, str]) -> subprocess.Popen:
        # The fake's /workspace is a temporary directory: never touch the host's /workspace.
        command = command.replace("/workspace", env.workspace)
        skip = "|".join(list(_SKIP_VARS) + list(extra_env))
        script = (
            f"__S={_q(env.state_file)}\n"
            '[ -f "$__S" ] && source "$__S" >/dev/null 2>&1\n'
            "trap '__rc=$?; { declare -p | grep -v -E \"^declare -[a-zA-Z]*r\" "
            f"| grep -v -E \"^declare -[-a-zA-Z]* ({skip})(=|$)\"; declare -f; "
            'echo "cd $(printf %q "$PWD")"; } > "$__S.tmp" 2>/dev/null; '
            "mv \"$__S.tmp\" \"$__S\"; exit $__rc' EXIT\n"
            + command + "\n")
        child_env = {"PATH": "/usr/bin:/bin", "HOME": env.workspace,
                     "LANG": "C.UTF-8"}
        child_env.update(env.options.get("env") or {})
        child_env.update(extra_env)
        return subprocess.Popen(["bash", "-c", script], cwd=env.workspace, env=child_env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class _Handler(BaseHTTPRequestHandler):
    esbd: FakeEsbd
    server_version = "fake-esbd/0.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing -----------------------------------------------------------------------
    def open_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(b": stream open\n\n")

    def send_head(self, status: int, content_type: str, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def send_bytes(self, status: int, content_type: str, raw: bytes) -> None:
        self.send_head(status, content_type, len(raw))
        self.wfile.write(raw)

    def send_json(self, status: int, body: dict[str, Any]) -> None:
        self.send_bytes(status, "application/json", json.dumps(body).encode())

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                out += self.rfile.read(size)
                self.rfile.readline()
            return bytes(out)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def json_body(self) -> dict[str, Any]:
        if self._body_cache is not None:  # already read (a step route reads it first)
            return self._body_cache
        raw = self.read_body()
        if not raw:
            return {}
        # Like esbd: a JSON body must be labelled so (415 otherwise), which catches any SDK
        # request path that forgets the header.
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, "unsupported_media_type",
                           "request body must be JSON: send Content-Type: application/json")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ApiError(400, "bad_request", f"Malformed JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "bad_request", "Body must be a JSON object.")
        return body

    def handle_any(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        parts = [urllib.parse.unquote(p) for p in parsed.path.split("/") if p]
        self.esbd.requests.append((method, parsed.path))
        self._body_cache: Optional[dict[str, Any]] = None
        try:
            self.route(method, parts, query)
        except ApiError as exc:
            body = {"error": True, "code": exc.code, "message": exc.message}
            body.update(exc.extra)
            self.send_json(exc.status, body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:  # noqa: N802
        self.handle_any("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.handle_any("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self.handle_any("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self.handle_any("DELETE")

    # -- routes -------------------------------------------------------------------------
    def route(self, method: str, parts: list[str], query: dict[str, str]) -> None:
        esbd = self.esbd
        if parts == ["healthz"] and method == "GET":
            return self.send_json(200, {"status": "ok", "version": "fake",
                                        "drivers": {"container": "fake"}})
        tenant = esbd.tenant_for(self.headers.get("Authorization"))
        if parts == ["run"] and method == "POST":
            if not esbd.run_endpoint:
                raise ApiError(404, "not_found", "No route for POST /run.")
            if esbd.run_endpoint == "unavailable":  # what esbd says without the run's tier
                raise ApiError(400, "tier_unavailable", "runtime 'nano' is not available on "
                               "this daemon (see GET /healthz)")
            if esbd.run_endpoint == "unavailable_text":  # a plain 400 that only reads alike
                raise ApiError(400, "bad_request", "'allowed_modules': module 'x' is not "
                               "available")
            return self.run_code(tenant, self.json_body())
        if parts == ["audit"] and method == "GET":
            rows = [r for r in esbd.audit if r["tenant"] == tenant
                    and (not query.get("environment_id")
                         or r["environment_id"] == query["environment_id"])
                    and (not query.get("q") or query["q"] in r["action"] + " " + r["detail"])]
            return self.send_json(200, {"entries": rows[: int(query.get("limit", 100))]})
        if parts == ["volumes"] and method == "POST":
            body = self.json_body()
            name, size = body.get("name"), body.get("size_mb")
            if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", name):
                raise ApiError(400, "bad_request", "volume name must be 1-63 of a-z, 0-9, '-'")
            if not isinstance(size, int) or not 16 <= size <= 4096:
                raise ApiError(400, "bad_request", "size_mb is outside 16..4096")
            with esbd.lock:
                if (tenant, name) in esbd.volumes:
                    raise ApiError(409, "conflict", f"volume {name} already exists")
                vol = {"name": name, "size_mb": size, "created_at": now_iso(0),
                       "mounted_by": None}
                esbd.volumes[(tenant, name)] = vol
            return self.send_json(201, vol)
        if parts == ["volumes"] and method == "GET":
            return self.send_json(200, {"volumes": [v for (t, _), v in
                                                    sorted(esbd.volumes.items()) if t == tenant]})
        if len(parts) == 2 and parts[0] == "volumes" and method == "DELETE":
            with esbd.lock:
                vol = esbd.volumes.get((tenant, parts[1]))
                if vol is None:
                    raise ApiError(404, "not_found", f"volume {parts[1]} not found")
                if vol["mounted_by"]:
                    raise ApiError(409, "conflict", f"volume {parts[1]} is mounted by "
                                   f"environment {vol['mounted_by']}; delete that first")
                del esbd.volumes[(tenant, parts[1])]
            return self.send_json(200, {"error": False, "message": "Volume deleted."})
        if parts == ["environments"]:
            if method == "POST":
                env = esbd.create(tenant, self.json_body())
                rec = env.record()
                rec["pooled"] = False
                return self.send_json(201, rec)
            if method == "GET":
                show_all = query.get("all") == "1"
                return self.send_json(200, {"environments": [
                    e.record() for e in esbd.envs.values()
                    if e.tenant == tenant and (show_all or not e.destroyed_at)]})
            raise ApiError(405, "method_not_allowed", "Method not allowed.")
        if len(parts) >= 2 and parts[0] == "environments":
            env_id, rest = parts[1], parts[2:]
            if rest[:1] == ["artifacts"] and method == "GET" and len(rest) <= 2:
                return self.artifacts(tenant, env_id, rest[1] if len(rest) == 2 else None)
            if not rest:
                if method == "GET":
                    env = esbd.env_for(tenant, env_id, allow_destroyed=True)
                    return self.send_json(200, env.record())
                if method == "DELETE":
                    env = esbd.env_for(tenant, env_id, allow_destroyed=True)
                    esbd.destroy(env)
                    return self.send_json(200, {"error": False,
                                                "message": "Environment destroyed."})
                raise ApiError(405, "method_not_allowed", "Method not allowed.")
            env = esbd.env_for(tenant, env_id)
            if rest[:1] in (["steps"], ["rewind"], ["fork"]):
                return self.steps_route(tenant, env, method, rest, query)
            kind = _STEP_KINDS.get((method, tuple(rest)))
            if kind is not None:
                env.last_exec = None
                body = self.json_body() if method == "POST" else {}
                self._body_cache = body
                summary = (body.get("command") or body.get("code") or body.get("path")
                           or query.get("path") or body.get("source") or "")
                if "text/event-stream" in (self.headers.get("Accept") or ""):
                    self.route_env(env, method, rest, query)  # streamed: recorded after
                    esbd.record_step(env, kind, str(summary), env.last_exec)
                    return None
                # Like esbd, the step is in the log before the answer is sent.
                real, self.wfile = self.wfile, io.BytesIO()
                try:
                    self.route_env(env, method, rest, query)
                    answer = self.wfile.getvalue()
                finally:
                    self.wfile = real
                esbd.record_step(env, kind, str(summary), env.last_exec)
                real.write(answer)
                return None
            return self.route_env(env, method, rest, query)
        raise ApiError(404, "not_found", f"No route for {method} /{'/'.join(parts)}.")

    def steps_route(self, tenant: str, env: FakeEnv, method: str, rest: list[str],
                    query: dict[str, str]) -> None:
        esbd = self.esbd
        if rest == ["steps"] and method == "GET":
            limit = int(query.get("limit", 50))
            before = int(query["before"]) if "before" in query else None
            nums = sorted((n for n in env.steps if before is None or n < before), reverse=True)
            page = nums[:limit]
            more = len(nums) > limit
            return self.send_json(200, {"steps": [esbd.step_json(env, n, False) for n in page],
                                        "head": env.head,
                                        "next_before": page[-1] if more else None})
        if len(rest) >= 2 and rest[0] == "steps" and method == "GET":
            if not rest[1].isdigit() or int(rest[1]) not in env.steps:
                raise ApiError(404, "not_found", f"environment {env.id} has no step {rest[1]}")
            n = int(rest[1])
            if len(rest) == 2:
                return self.send_json(200, esbd.step_json(env, n, True))
            path = query.get("path")
            if not path:
                raise ApiError(400, "bad_request", "Missing 'path'.")
            path = os.path.normpath(path[len("/workspace/"):] if path.startswith("/workspace/")
                                    else path)
            files = env.steps[n]["_files"]
            if rest[2:] == ["files"]:
                if path not in files:
                    raise ApiError(404, "not_found", f"{path} did not exist at step {n}")
                if files[path] is None:
                    raise ApiError(400, "bad_request", f"{path} is a directory")
                if (env.id, n, path) in esbd.collected:
                    raise ApiError(410, "gone", f"the content of {path} at step {n} was "
                                   "garbage-collected", detail="collected")
                return self.send_bytes(200, "application/octet-stream", files[path])
            if rest[2:] == ["diff"]:
                parent = env.steps[n]["parent"]
                old = env.steps[parent]["_files"].get(path) if parent is not None else None
                new = files.get(path)
                change = ("added" if old is None and new is not None else
                          "deleted" if new is None and old is not None else
                          "modified" if old != new else None)
                text = "".join(difflib.unified_diff(
                    (old or b"").decode(errors="replace").splitlines(True),
                    (new or b"").decode(errors="replace").splitlines(True),
                    f"a/{path}", f"b/{path}"))
                return self.send_json(200, {"path": path, "change": change, "binary": False,
                                            "truncated": False, "diff": text})
        if rest == ["rewind"] and method == "POST":
            body = self.json_body()
            self._fields(body, {"step"})
            n = esbd.step_of(env, body.get("step"))
            esbd.restore(env, n)
            env.head = n
            return self.send_json(200, {"head": n, "memory": "none",
                                        "environment": env.record()})
        if rest == ["fork"] and method == "POST":
            body = self.json_body()
            self._fields(body, {"step"})
            n = esbd.step_of(env, body.get("step"))
            options = {k: v for k, v in env.options.items() if k != "volumes"}
            new = esbd.create(tenant, options)
            # The new environment's step 0 is the fork of step n.
            new.steps.clear()
            new.head = None
            src = env.steps[n]
            for path, data in sorted(src["_files"].items()):
                full = os.path.join(new.workspace, path)
                if data is None:
                    os.makedirs(full, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(full), exist_ok=True)
                    with open(full, "wb") as f:
                        f.write(data)
            with open(new.state_file, "wb") as f:
                f.write(src["_state"])
            new.forked_from = {"environment_id": env.id, "step": n}
            esbd.record_step(new, "fork", f"fork of {env.id} at step {n}", None)
            rec = new.record()
            rec.update({"forked_from": new.forked_from, "memory": "none"})
            return self.send_json(201, rec)
        raise ApiError(404, "not_found", f"No route for {method} {'/'.join(rest)}.")

    def route_env(self, env: FakeEnv, method: str, rest: list[str],
                  query: dict[str, str]) -> None:
        esbd = self.esbd
        if True:
            if rest == ["heartbeat"] and method == "POST":
                body = self.json_body()
                ttl = body.get("ttl_seconds", 900)
                env.expires_at, env.heartbeats = now_iso(ttl), env.heartbeats + 1
                return self.send_json(200, {"error": False, "expires_at": env.expires_at})
            if rest == ["execute"] and method == "POST":
                return self.execute(env, self.json_body())
            if rest == ["network"] and method == "GET":
                return self.send_json(200, self.network_answer(env))
            if rest == ["network"] and method == "PUT":
                body = self.json_body()
                self._fields(body, {"network"})
                network = check_network(body.get("network"))
                if (network == "none") != (env.network == "none"):
                    raise ApiError(409, "conflict", "whether an environment has egress is "
                                   "fixed at create")
                env.network = network
                return self.send_json(200, self.network_answer(env))
            if rest == ["ca.pem"] and method == "GET":
                if env.network == "none":
                    raise ApiError(404, "not_found", "this environment has no network policy")
                return self.send_bytes(200, "application/x-pem-file", FAKE_CA_PEM.encode())
            if rest[:1] == ["intents"]:
                return self.intents(env, method, rest[1:])
            if rest == ["run"] and method == "POST":
                return self.run_code(env.tenant, self.json_body(), env)
            if rest == ["files", "write"] and method == "POST":
                return self.write_file(env, self.json_body())
            if rest == ["files", "read"] and method == "GET":
                return self.read_file(env, query.get("path"))
            if rest == ["files", "raw"] and method == "PUT":
                full = esbd.resolve(env, query.get("path"))
                data = self.read_body()
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
                return self.send_json(200, {"error": False,
                                            "message": "File saved successfully.",
                                            "bytes": len(data)})
            if rest == ["files", "raw"] and method == "GET":
                full = esbd.resolve(env, query.get("path"))
                if not os.path.isfile(full):
                    raise ApiError(404, "not_found", f"File not found: {query.get('path')}")
                self.send_head(200, "application/octet-stream", os.path.getsize(full))
                with open(full, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 65536)
                return None
            if rest == ["files", "list"] and method == "GET":
                return self.list_dir(env, query.get("path", "."))
            if rest == ["files", "stat"] and method == "GET":
                return self.stat_path(env, query.get("path"))
            if rest == ["files", "mkdir"] and method == "POST":
                return self.make_dir(env, self.json_body())
            if rest == ["files", "remove"] and method == "POST":
                return self.remove(env, self.json_body())
            if rest == ["files", "rename"] and method == "POST":
                return self.rename(env, self.json_body())
        raise ApiError(404, "not_found", f"No route for {method} /environments/{env.id}/"
                       f"{'/'.join(rest)}.")

    def artifacts(self, tenant: str, env_id: str, aid: Optional[str]) -> None:
        esbd = self.esbd
        store = esbd.artifact_store.get(env_id)
        if store is None or store["tenant"] != tenant:
            env = esbd.envs.get(env_id)
            if env is None or env.tenant != tenant or env.destroyed_at:
                raise ApiError(404, "not_found", f"Environment {env_id} not found.")
            store = {"tenant": tenant, "items": {}}
        if aid is None:
            return self.send_json(200, {"artifacts": [m for m, _ in store["items"].values()]})
        item = store["items"].get(aid)
        if item is None:
            raise ApiError(404, "not_found", f"Artifact {aid} not found.")
        meta, data = item
        self.send_bytes(200, meta["mime_type"], data)

    def add_artifact(self, tenant: str, env_id: str, kind: str, name: str, mime: str,
                     data: bytes, title: Optional[str], step: int) -> dict[str, Any]:
        aid = "art_" + secrets.token_hex(6)
        meta = {"id": aid, "kind": kind, "name": name, "mime_type": mime, "size": len(data),
                "title": title, "step": step, "environment_id": env_id,
                "url": f"/environments/{env_id}/artifacts/{aid}"}
        with self.esbd.lock:
            store = self.esbd.artifact_store.setdefault(env_id, {"tenant": tenant, "items": {}})
            store["items"][aid] = (meta, data)
        return meta

    def send_event(self, name: str, data: dict[str, Any]) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def active_intents(self, env: FakeEnv) -> list[dict[str, Any]]:
        now = time.time()
        for name in [n for n, i in env.intents.items() if i["_expires"] <= now]:
            del env.intents[name]
        return [{k: v for k, v in env.intents[n].items() if not k.startswith("_")}
                | {"expires_in_seconds": max(0, int(env.intents[n]["_expires"] - now))}
                for n in sorted(env.intents)]

    def network_answer(self, env: FakeEnv) -> dict[str, Any]:
        """GET /environments/{id}/network (also the answer of PUT and of the intent calls)."""
        return {"environment_id": env.id, "network": env.network,
                "intents": self.active_intents(env)}

    def check_intent(self, env: Optional[FakeEnv], name: Any) -> None:
        if env is None:  # like esbd: a one-shot run has no network to open
            raise ApiError(400, "bad_request", "'intent' needs an environment with a network "
                           "policy; POST /run has none")
        if not isinstance(name, str) or name not in self.esbd.intent_catalogue:
            raise ApiError(400, "bad_request", f"intent {name!r} is not in the catalogue "
                           f"({', '.join(sorted(self.esbd.intent_catalogue))})")
        if env.network == "none":
            raise ApiError(409, "conflict", "intents need a governed environment (its network "
                           "is \"none\")")

    def intents(self, env: FakeEnv, method: str, rest: list[str]) -> None:
        if not rest and method == "GET":
            return self.send_json(200, {
                "environment_id": env.id, "intents": self.active_intents(env),
                "available": [{"intent": n, **d} for n, d in
                              sorted(self.esbd.intent_catalogue.items())]})
        if not rest and method == "POST":
            body = self.json_body()
            self._fields(body, {"intent", "ttl_seconds"})
            self.check_intent(env, body.get("intent"))
            ttl = body.get("ttl_seconds", 300)
            if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= 604800:
                raise ApiError(400, "bad_request", "ttl_seconds must be 1..604800")
            name = body["intent"]
            expires = time.time() + ttl
            env.intents[name] = {"intent": name,
                                 "allow": self.esbd.intent_catalogue[name]["allow"],
                                 "scope": "environment", "expires_at": now_iso(ttl),
                                 "_expires": expires}
            return self.send_json(200, self.network_answer(env))
        if len(rest) == 1 and method == "DELETE":
            self.active_intents(env)
            if env.intents.pop(rest[0], None) is None:
                raise ApiError(404, "not_found", f"intent {rest[0]} is not active")
            return self.send_json(200, self.network_answer(env))
        raise ApiError(405, "method_not_allowed", "Method not allowed.")

    def run_code(self, tenant: str, body: dict[str, Any], env: Optional[FakeEnv] = None) -> None:
        esbd = self.esbd
        esbd.run_bodies.append(body)
        allowed = _RUN_FIELDS | ({"runtime"} if env is None else set())
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, "bad_request", f"Unknown field '{unknown[0]}'.")
        if "intent" in body:
            self.check_intent(env, body["intent"])
        code = body.get("code")
        if not isinstance(code, str):
            raise ApiError(400, "bad_request", "'code' must be a string.")
        formats = body.get("figure_formats", ["png"])
        if (not isinstance(formats, list) or not formats
                or any(f not in ("png", "svg") for f in formats)):
            raise ApiError(400, "bad_request", "figure_formats must be drawn from png, svg.")
        packages = body.get("packages") or []
        streaming = esbd.stream_runs and "text/event-stream" in (self.headers.get("Accept")
                                                                 or "")
        if streaming:
            self.open_sse()
        t0 = time.monotonic()
        installed = []
        for req in packages:
            name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()
            if streaming:
                self.send_event("install", {"data": f"Collecting {req}\n"})
            if name not in esbd.package_index:
                err = {"error": True, "code": "bad_request",
                       "message": f"pip could not install {req!r}: No matching distribution "
                                  "found"}
                if streaming:
                    return self.send_event("error", err)
                raise ApiError(400, "bad_request", err["message"])
            version = esbd.package_index[name]
            installed.append({"name": name, "version": version,
                              "from_cache": name in esbd.package_cache})
            esbd.package_cache.add(name)
            if streaming:
                self.send_event("install", {"data": f"Successfully installed {name}-{version}\n"})
        install_ms = (time.monotonic() - t0) * 1000.0
        if env is not None:
            env.run_steps += 1
            env_id, step, work = env.id, env.run_steps, env.workspace
        else:
            env_id, step = "env_" + secrets.token_hex(8), 1
            work = os.path.realpath(os.path.join(esbd.root, env_id))
            os.makedirs(work)
        try:
            cell = os.path.join(esbd.root, f"cell_{secrets.token_hex(4)}.py")
            meta_file = cell + ".json"
            with open(cell, "w") as f:
                f.write(code.replace("/workspace", work))
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CELL_RUNNER, cell, meta_file,
                 str(esbd.table_max_rows)], cwd=work, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            collected = self.collect(proc, body.get("timeout_ms", 30000) / 1000.0, streaming)
            if collected is None:
                return
            bufs, truncated, timed_out = collected
            rc = 124 if timed_out else proc.returncode
            meta: dict[str, Any] = {}
            if os.path.exists(meta_file):
                with open(meta_file) as f:
                    meta = json.load(f)
            for path in (cell, meta_file):
                if os.path.exists(path):
                    os.unlink(path)
            artifacts = []
            art_dir = os.path.join(work, "artifacts")
            for dirpath, _, names in os.walk(art_dir):
                for name in sorted(names):
                    full = os.path.join(dirpath, name)
                    st = os.stat(full)
                    key = (full, st.st_mtime_ns, st.st_size)
                    if env is not None and key in env.reported:
                        continue
                    if env is not None:
                        env.reported.add(key)
                    with open(full, "rb") as f:
                        data = f.read()
                    mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
                    artifacts.append(self.add_artifact(tenant, env_id, "file",
                                                       os.path.relpath(full, art_dir), mime,
                                                       data, None, step))
            figures, esbd.next_figures = esbd.next_figures, []
            for i, (title, png) in enumerate(figures, 1):
                for fmt in formats:
                    if fmt == "png":
                        data, mime = png, "image/png"
                    else:
                        data = (f'<svg xmlns="http://www.w3.org/2000/svg"><title>{title or ""}'
                                "</title></svg>").encode()
                        mime = "image/svg+xml"
                    artifacts.append(self.add_artifact(tenant, env_id, "image",
                                                       f"figure-{i}.{fmt}", mime, data, title,
                                                       step))
        finally:
            if env is None:
                shutil.rmtree(work, ignore_errors=True)
        answer: dict[str, Any] = {
            "stdout": bufs["stdout"].decode(errors="replace"),
            "stderr": bufs["stderr"].decode(errors="replace"), "exit_code": rc,
            "error": None, "timed_out": timed_out, "truncated": truncated,
            "duration_ms": (time.monotonic() - t0) * 1000.0,
            "tier": "heavy" if (packages or body.get("runtime") == "heavy") else "nano",
            "reason": "fake", "environment_id": env_id, "artifacts": artifacts,
            "table": meta.get("table"), "value": meta.get("value")}
        if packages:
            answer["packages"], answer["install_ms"] = installed, install_ms
        if rc != 0 and "Traceback" in answer["stderr"]:
            last = answer["stderr"].strip().splitlines()[-1]
            name, _, msg = last.partition(": ")
            answer["error"] = {"type": name, "message": msg, "traceback": answer["stderr"]}
        if streaming:
            if esbd.run_error_event is not None:
                return self.send_event("error", esbd.run_error_event)
            return self.send_event("result", answer)
        self.send_json(200, answer)

    def collect(self, proc: subprocess.Popen, timeout: float, streaming: bool,
                ) -> Optional[tuple[dict[str, bytearray], bool, bool]]:
        """Read a child's stdout/stderr until both close (capped at CAP bytes each), sending
        them as SSE events when ``streaming``; kill its process group after ``timeout``
        seconds. Returns (buffers, truncated, timed_out), or None if the client went away."""
        events: "queue.Queue[tuple[str, bytes]]" = queue.Queue()

        def pump(name: str, pipe: Any) -> None:
            while True:
                chunk = os.read(pipe.fileno(), 4096)
                if not chunk:
                    break
                events.put((name, chunk))
            events.put((name, b""))

        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            threading.Thread(target=pump, args=(name, pipe), daemon=True).start()
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        truncated, timed_out, open_streams = False, False, 2
        deadline = time.monotonic() + timeout
        while open_streams:
            try:
                name, chunk = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                continue
            if not chunk:
                open_streams -= 1
                continue
            room = CAP - len(bufs[name])
            if len(chunk) > room:
                truncated, chunk = True, chunk[:room]
            if not chunk:
                continue
            bufs[name] += chunk
            if streaming:
                try:
                    data = {"data": chunk.decode("utf-8")}
                except UnicodeDecodeError:
                    data = {"data_b64": base64.b64encode(chunk).decode()}
                try:
                    self.send_event(name, data)
                except (BrokenPipeError, ConnectionResetError):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return None
        proc.wait()
        return bufs, truncated, timed_out

    def execute(self, env: FakeEnv, body: dict[str, Any]) -> None:
        unknown = sorted(set(body) - {"command", "timeout_seconds", "env", "intent"})
        if unknown:
            raise ApiError(400, "bad_request", f"Unknown field '{unknown[0]}'.")
        self.esbd.execute_bodies.append(body)
        if "intent" in body:
            self.check_intent(env, body["intent"])
        self.esbd.intents_during_execute.append(
            sorted({i["intent"] for i in self.active_intents(env)}
                   | ({body["intent"]} if "intent" in body else set())))
        command = body.get("command")
        if not isinstance(command, str) or not command:
            raise ApiError(400, "bad_request", "'command' must be a non-empty string.")
        timeout = body.get("timeout_seconds", 60)
        if not isinstance(timeout, int) or not 1 <= timeout <= 3600:
            raise ApiError(400, "bad_request", "timeout_seconds must be 1..3600.")
        env.exec_count += 1
        self.esbd.audit.append({"id": len(self.esbd.audit) + 1, "time": now_iso(),
                                "tenant": env.tenant, "environment_id": env.id,
                                "action": "execute", "detail": command})
        streaming = "text/event-stream" in (self.headers.get("Accept") or "")
        t0 = time.monotonic()
        proc = self.esbd.spawn(env, command, {str(k): str(v)
                                              for k, v in (body.get("env") or {}).items()})
        if streaming:
            self.open_sse()
        collected = self.collect(proc, timeout, streaming)
        if collected is None:
            return
        bufs, truncated, timed_out = collected
        rc = proc.wait()
        if timed_out:
            rc = 124
        result = {"error": rc != 0, "stdout": bufs["stdout"].decode(errors="replace"),
                  "stderr": bufs["stderr"].decode(errors="replace"), "exit_code": rc,
                  "duration_ms": int((time.monotonic() - t0) * 1000), "timed_out": timed_out,
                  "truncated": truncated}
        env.last_exec = result
        if streaming:
            self.wfile.write(f"event: result\ndata: {json.dumps(result)}\n\n".encode())
            self.wfile.flush()
        else:
            self.send_json(200, result)

    def write_file(self, env: FakeEnv, body: dict[str, Any]) -> None:
        unknown = sorted(set(body) - {"path", "content", "encoding"})
        if unknown:
            raise ApiError(400, "bad_request", f"Unknown field '{unknown[0]}'.")
        full = self.esbd.resolve(env, body.get("path"))
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "bad_request", "'content' must be a string.")
        encoding = body.get("encoding", "utf-8")
        if encoding == "base64":
            data = base64.b64decode(content)
        elif encoding == "utf-8":
            data = content.encode()
        else:
            raise ApiError(400, "bad_request", f"Unknown encoding '{encoding}'.")
        if os.path.isdir(full):
            raise ApiError(400, "bad_request", "Path is a directory.")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
        self.send_json(200, {"error": False, "message": "File saved successfully.",
                             "bytes": len(data)})

    def read_file(self, env: FakeEnv, path: Optional[str]) -> None:
        full = self.esbd.resolve(env, path)
        if not os.path.exists(full):
            msg = f"File not found: {path}"
            raise ApiError(404, "not_found", msg, content=msg)
        if not os.path.isfile(full):
            raise ApiError(400, "bad_request", f"Not a regular file: {path}")
        if os.path.getsize(full) > self.esbd.read_limit:
            raise ApiError(413, "payload_too_large", "File too large for files/read; use "
                           "files/raw.")
        with open(full, "rb") as f:
            data = f.read()
        try:
            body = {"content": data.decode("utf-8"), "encoding": "utf-8"}
        except UnicodeDecodeError:
            body = {"content": base64.b64encode(data).decode(), "encoding": "base64"}
        self.send_json(200, {"error": False, **body, "size": len(data)})

    @staticmethod
    def _fields(body: dict[str, Any], allowed: set[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, "bad_request", f"unknown field '{unknown[0]}'")

    @staticmethod
    def _entry(full: str, st: os.stat_result) -> dict[str, Any]:
        kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
        return {"name": os.path.basename(full), "type": kind, "size": st.st_size,
                "mode": f"{stat.S_IMODE(st.st_mode):04o}",
                "mtime": datetime.fromtimestamp(st.st_mtime, timezone.utc)
                .isoformat(timespec="milliseconds").replace("+00:00", "Z")}

    def stat_path(self, env: FakeEnv, path: Optional[str]) -> None:
        full = self.esbd.resolve(env, path)
        if not os.path.lexists(full):
            raise ApiError(404, "not_found", f"stat {path}: No such file or directory (ENOENT)")
        self.send_json(200, {"error": False, "path": path, **self._entry(full, os.stat(full))})

    def make_dir(self, env: FakeEnv, body: dict[str, Any]) -> None:
        self._fields(body, {"path"})
        full = self.esbd.resolve(env, body.get("path"))
        if os.path.lexists(full) and not os.path.isdir(full):
            raise ApiError(409, "conflict", f"mkdir {body['path']}: exists and is not a directory")
        created = not os.path.isdir(full)
        os.makedirs(full, exist_ok=True)
        self.send_json(200, {"error": False, "path": body["path"], "created": created})

    def remove(self, env: FakeEnv, body: dict[str, Any]) -> None:
        self._fields(body, {"path", "recursive"})
        full = self.esbd.resolve(env, body.get("path"))
        if full == env.workspace:
            raise ApiError(400, "bad_request", "remove: refused: the workspace itself")
        if not os.path.lexists(full):
            raise ApiError(404, "not_found", f"remove {body['path']}: No such file (ENOENT)")
        if os.path.isdir(full) and not os.path.islink(full):
            if body.get("recursive"):
                shutil.rmtree(full)
            elif os.listdir(full):
                raise ApiError(409, "conflict", f"remove {body['path']}: directory not empty")
            else:
                os.rmdir(full)
        else:
            os.unlink(full)
        self.send_json(200, {"error": False, "path": body["path"]})

    def rename(self, env: FakeEnv, body: dict[str, Any]) -> None:
        self._fields(body, {"source", "destination", "overwrite"})
        src = self.esbd.resolve(env, body.get("source"))
        dst = self.esbd.resolve(env, body.get("destination"))
        if not os.path.lexists(src):
            raise ApiError(404, "not_found", f"rename {body['source']}: No such file (ENOENT)")
        if os.path.lexists(dst) and not body.get("overwrite"):
            raise ApiError(409, "conflict", f"rename: {body['destination']} exists")
        os.replace(src, dst)
        self.send_json(200, {"error": False, "source": body["source"],
                             "destination": body["destination"]})

    def list_dir(self, env: FakeEnv, path: str) -> None:
        full = self.esbd.resolve(env, path)
        if not os.path.isdir(full):
            raise ApiError(404, "not_found", f"Directory not found: {path}")
        entries = []
        for name in sorted(os.listdir(full)):
            st = os.lstat(os.path.join(full, name))
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
            entries.append({"name": name, "type": kind, "size": st.st_size,
                            "mode": f"{stat.S_IMODE(st.st_mode):04o}",
                            "mtime": datetime.fromtimestamp(st.st_mtime, timezone.utc)
                            .isoformat(timespec="milliseconds").replace("+00:00", "Z")})
        rel = os.path.relpath(full, env.workspace)
        shown = "/workspace" if rel == "." else "/workspace/" + rel
        self.send_json(200, {"error": False, "path": shown, "entries": entries})


if __name__ == "__main__":  # python3 fake_esbd.py [--port N] [--key KEY=TENANT ...] [--run]
    import argparse

    parser = argparse.ArgumentParser(description="Run the fake esbd used by the SDK tests.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", action="append", default=[], help="KEY=TENANT")
    parser.add_argument("--run", action="store_true", help="serve POST /run")
    ns = parser.parse_args()
    fake_server = FakeEsbd(keys=dict(k.split("=", 1) for k in ns.key) or None,
                           run_endpoint=ns.run)
    fake_server.server = ThreadingHTTPServer(("127.0.0.1", ns.port), type(
        "H", (_Handler,), {"esbd": fake_server}))
    fake_server.server.daemon_threads = True
    print(f"fake esbd on http://127.0.0.1:{fake_server.server.server_address[1]}", flush=True)
    try:
        fake_server.server.serve_forever()
    finally:
        shutil.rmtree(fake_server.root, ignore_errors=True)
