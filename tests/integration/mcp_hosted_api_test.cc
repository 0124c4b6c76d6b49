// MCP servers hosted in sandboxes (docs/api.md "Hosted MCP servers") against the real esbd and
// real containers: a small Python stdio MCP server the test writes into the sandbox is started,
// listed and called through REST; then the hostile cases, each asserting a clear error and
// that esbd and a second environment's server are unaffected: a server killed mid-call (the
// call fails with the exit code and stderr, the server restarts), a hanging call (timeout), a
// server writing garbage on stdout, one flooding stdout, too many servers, another tenant
// (404 everywhere), a runtime without processes (nano: 400), deleting the environment.
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "governance/dlp/dlp_test_util.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr const char* kKeyA = kTenantKeyA;
constexpr const char* kKeyB = kTenantKeyB;

// A legacy-era (2025-11-25) MCP server on stdio, standard library only. argv[1] is a mode:
// "garbage" (prints non-JSON lines on stdout at start), anything else: well-behaved until a
// tool asks otherwise (sleep: hangs; die: crashes mid-call; flood: floods stdout).
constexpr char kServerPy[] = R"PY(
import json, os, sys, time
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "garbage":
    for i in range(100):
        print("hello from a chatty server", i, flush=True)
def send(m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
TOOLS = [{"name": n, "description": d, "inputSchema": {"type": "object"}} for n, d in [
    ("echo", "echoes its arguments"), ("sleep", "never answers"), ("block", "wedges"),
    ("die", "crashes mid-call"), ("flood", "floods stdout"), ("whoami", "the process's env"),
    ("stream", "streams within the limits, then answers"),
    ("echo", "a second echo"), ("a\nb", "a name MCP forbids")]]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    mid, method, params = m.get("id"), m.get("method"), m.get("params") or {}
    if mid is None:
        if method == "notifications/cancelled":
            with open("cancelled.log", "a") as f:
                f.write(json.dumps(params) + "\n")
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": "2025-11-25",
              "capabilities": {"tools": {}}, "serverInfo": {"name": "testpy", "version": "1"}}})
    elif method == "tools/list":
        cur = int(params.get("cursor") or 0)
        page = {"tools": TOOLS[cur:cur + 3]}
        if cur + 3 < len(TOOLS):
            page["nextCursor"] = str(cur + 3)
        send({"jsonrpc": "2.0", "id": mid, "result": page})
    elif method == "tools/call":
        name, args = params.get("name"), params.get("arguments") or {}
        if name == "echo":
            send({"jsonrpc": "2.0", "id": mid, "result": {"content": [
                {"type": "text", "text": "echo:" + json.dumps(args, sort_keys=True)}],
                "structuredContent": args}})
        elif name == "whoami":
            send({"jsonrpc": "2.0", "id": mid, "result": {"content": [
                {"type": "text", "text": "%d %s %s" % (os.getuid(), os.getcwd(),
                                                       os.environ.get("GREETING", ""))}]}})
        elif name == "sleep":
            pass  # never answers (and keeps serving other requests)
        elif name == "block":
            time.sleep(3600)  # wedged: answers nothing any more
        elif name == "die":
            sys.stderr.write("fatal: the test asked me to die\n"); sys.stderr.flush()
            os._exit(7)
        elif name == "stream":
            # About 2 MB/s in 250 lines/s (under this suite's limits) for 2 s, then the answer.
            end = time.time() + 2
            while time.time() < end:
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "data": "s" * 8000}})
                time.sleep(0.004)
            send({"jsonrpc": "2.0", "id": mid, "result": {"content": [
                {"type": "text", "text": "streamed"}]}})
        elif name == "flood":
            while True:
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "data": "x" * 100}})
        else:
            send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32602, "message": "unknown tool"}})
    else:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "Method not found"}})
)PY";

class McpHostedApiTest : public SharedDaemonTest<McpHostedApiTest> {
 public:
  static Daemon::Options SuiteOptions() {
    return {.config_json = TwoTenantsConfig(R"(
      "mcp": {"max_servers_per_environment": 2, "call_timeout_seconds": 3,
              "start_timeout_seconds": 30, "max_restarts": 1, "max_lines_per_second": 500,
              "max_garbage_lines": 3})")};
  }

 protected:
  void SetUp() override {
    SharedDaemonTest::SetUp();
    if (IsSkipped()) return;
    daemon_->api_key = kKeyA;
  }
  std::string NewEnvWithServer(const json::object& create = {}) {
    std::string id = daemon_->CreateEnv(create);
    if (id.empty()) return id;
    HttpResult w = daemon_->Call("POST", "/environments/" + id + "/files/write",
                                 json::object{{"path", "server.py"}, {"content", kServerPy}});
    EXPECT_EQ(w.status, 200) << w.body;
    return id;
  }
  HttpResult StartServer(const std::string& env, const std::string& name,
                         const std::string& mode = "ok") {
    return daemon_->Call("POST", "/environments/" + env + "/mcp-servers",
                         json::object{{"name", name},
                                      {"command", "python3"},
                                      {"args", json::array{"-u", "server.py", mode}},
                                      {"env", json::object{{"GREETING", "hi"}}}});
  }
  HttpResult CallTool(const std::string& env, const std::string& tool,
                      const json::object& args = {}) {
    return daemon_->Call("POST", "/environments/" + env + "/tools/" + tool + "/call",
                         json::object{{"arguments", args}});
  }
  std::string Text(const HttpResult& r) {
    const json::object& o = r.obj();
    if (!o.contains("content") || !o.at("content").is_array() || o.at("content").as_array().empty())
      return "";
    const json::value& c = o.at("content").as_array()[0];
    return c.is_object() && c.as_object().contains("text")
               ? std::string(c.as_object().at("text").as_string())
               : "";
  }
  // Polls GET .../mcp-servers/{name} until `state` (30 s).
  HttpResult WaitState(const std::string& env, const std::string& name, const std::string& state,
                       int64_t restarts = -1) {
    HttpResult r;
    for (int i = 0; i < 300; ++i) {
      r = daemon_->Call("GET", "/environments/" + env + "/mcp-servers/" + name);
      if (r.str("state") == state && (restarts < 0 || r.num("restarts") == restarts)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return r;
  }
  // A healthy server elsewhere still answers (esbd and other environments are unaffected).
  void ExpectOthersUnaffected() {
    if (other_env_.empty()) {
      other_env_ = NewEnvWithServer();
      ASSERT_EQ(StartServer(other_env_, "bystander").str("state"), "ready");
    }
    HttpResult h = daemon_->Call("GET", "/healthz");
    EXPECT_EQ(h.status, 200);
    HttpResult r = CallTool(other_env_, "bystander.echo", json::object{{"still", "here"}});
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(Text(r), "echo:{\"still\": \"here\"}") << r.body;
  }
  static std::string other_env_;
};
std::string McpHostedApiTest::other_env_;

TEST_F(McpHostedApiTest, StartListCallAndStop) {
  const std::string env = NewEnvWithServer();
  ASSERT_FALSE(env.empty());
  HttpResult s = StartServer(env, "py");
  ASSERT_EQ(s.status, 201) << s.body;
  EXPECT_EQ(s.str("state"), "ready") << s.body;
  EXPECT_EQ(s.str("protocol"), "2025-11-25");
  EXPECT_EQ(s.num("tools"), 7);  // three pages; the repeated and the invalid name left out
  EXPECT_EQ(s.num("skipped_tools_count"), 2);
  EXPECT_EQ(s.obj().at("skipped_tools"),
            (json::array{"echo: listed twice (the first one is kept)",
                         "a\\nb: not a valid MCP tool name (1-128 of A-Z a-z 0-9 _ . -)"}))
      << s.body;
  EXPECT_EQ(s.str("url"), "/environments/" + env + "/mcp/py");
  EXPECT_EQ(s.obj().at("env").as_array(), json::array{"GREETING"});  // names only, not values

  HttpResult list = daemon_->Call("GET", "/environments/" + env + "/mcp-servers");
  ASSERT_EQ(list.status, 200);
  ASSERT_EQ(list.obj().at("servers").as_array().size(), 1u);

  HttpResult tools = daemon_->Call("GET", "/environments/" + env + "/tools");
  ASSERT_EQ(tools.status, 200) << tools.body;
  const json::array& t = tools.obj().at("tools").as_array();
  ASSERT_EQ(t.size(), 7u);
  EXPECT_EQ(t[0].at("name"), "py.echo");
  EXPECT_EQ(t[0].at("server"), "py");
  EXPECT_EQ(t[0].at("tool"), "echo");
  EXPECT_EQ(t[0].at("description"), "echoes its arguments");

  HttpResult r = CallTool(env, "py.echo", json::object{{"n", 42}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(r.flag("isError"));
  EXPECT_EQ(Text(r), "echo:{\"n\": 42}");
  EXPECT_EQ(r.obj().at("structuredContent").at("n"), 42);
  // It runs as the sandbox user in /workspace with the env it was given.
  EXPECT_EQ(Text(CallTool(env, "py.whoami")), "1000 /workspace hi");

  EXPECT_EQ(CallTool(env, "py.nope").status, 404);
  EXPECT_EQ(CallTool(env, "nope.echo").status, 404);
  EXPECT_EQ(daemon_
                ->Call("POST", "/environments/" + env + "/tools/py.echo/call",
                       json::object{{"arguments", "not an object"}})
                .status,
            400);

  HttpResult del = daemon_->Call("DELETE", "/environments/" + env + "/mcp-servers/py");
  EXPECT_EQ(del.status, 200) << del.body;
  EXPECT_EQ(daemon_->Call("GET", "/environments/" + env + "/mcp-servers/py").status, 404);
  EXPECT_EQ(CallTool(env, "py.echo").status, 404);
  // The lifecycle is audited.
  HttpResult audit = daemon_->Call("GET", "/audit?environment_id=" + env);
  EXPECT_TRUE(absl::StrContains(audit.body, "mcp.server.start")) << audit.body;
  EXPECT_TRUE(absl::StrContains(audit.body, "mcp.server.stop")) << audit.body;
}

// The hosted server over Streamable HTTP at /environments/{id}/mcp/{name}: its own tools,
// names unchanged, in both eras; another tenant and an unknown server are 404.
TEST_F(McpHostedApiTest, HostedServerIsAnMcpEndpointOfItsOwn) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  const std::string path = "/environments/" + env + "/mcp/py";
  auto mcp = [&](const json::object& msg, std::map<std::string, std::string> h,
                 const std::string& key, const std::string& target) {
    h["Authorization"] = "Bearer " + key;
    h["Accept"] = "application/json, text/event-stream";
    return Http(daemon_->port(), "POST", target, json::serialize(msg), h);
  };
  auto call = [](const char* method, json::object params, int id) {
    return json::object{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", params}};
  };
  // Legacy: a session, tools/list with the server's own names, tools/call.
  HttpResult init = mcp(
      call("initialize", {{"protocolVersion", "2025-11-25"}, {"capabilities", json::object()}}, 1),
      {}, kKeyA, path);
  ASSERT_EQ(init.status, 200) << init.body;
  const std::string sid = init.headers["mcp-session-id"];
  ASSERT_FALSE(sid.empty());
  std::map<std::string, std::string> h{{"Mcp-Session-Id", sid},
                                       {"MCP-Protocol-Version", "2025-11-25"}};
  HttpResult list = mcp(call("tools/list", {}, 2), h, kKeyA, path);
  ASSERT_EQ(list.status, 200) << list.body;
  EXPECT_TRUE(absl::StrContains(list.body, "\"name\":\"echo\"")) << list.body;
  EXPECT_FALSE(absl::StrContains(list.body, "py.echo")) << list.body;
  HttpResult r =
      mcp(call("tools/call", {{"name", "echo"}, {"arguments", {{"x", 1}}}}, 3), h, kKeyA, path);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "echo:{\\\"x\\\": 1}")) << r.body;
  // Modern (stateless).
  json::object meta{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"},
                    {"io.modelcontextprotocol/clientCapabilities", json::object()}};
  r = mcp(
      call("tools/call", {{"name", "echo"}, {"arguments", json::object()}, {"_meta", meta}}, 4),
      {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "tools/call"}, {"Mcp-Name", "echo"}},
      kKeyA, path);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "echo:{}")) << r.body;
  // Another tenant, an unknown server: 404.
  HttpResult other = mcp(
      call("initialize", {{"protocolVersion", "2025-11-25"}, {"capabilities", json::object()}}, 1),
      {}, kKeyB, path);
  EXPECT_EQ(other.status, 404) << other.body;
  HttpResult none = mcp(
      call("initialize", {{"protocolVersion", "2025-11-25"}, {"capabilities", json::object()}}, 1),
      {}, kKeyA, "/environments/" + env + "/mcp/nope");
  EXPECT_EQ(none.status, 404) << none.body;
  // A session of one hosted endpoint is not valid on esbd's own /mcp.
  EXPECT_EQ(mcp(call("tools/list", {}, 5), h, kKeyA, "/mcp").status, 404);
}

TEST_F(McpHostedApiTest, PlantedAwsKeyInArgumentsIsBlockedBeforeTheServerSeesIt) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  const std::string key = governance::dlp::testing::AwsKeyId();
  HttpResult r = CallTool(env, "py.echo", json::object{{"token", key}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("isError")) << r.body;
  EXPECT_TRUE(absl::StrContains(Text(r), "dlp:aws_access_key")) << r.body;
  EXPECT_FALSE(absl::StrContains(r.body, "echo:")) << r.body;  // never dispatched
  EXPECT_FALSE(absl::StrContains(r.body, key)) << r.body;
  // One tool.call row, blocked, naming the hosted server; the key is not in the log.
  HttpResult audit = daemon_->Call("GET", "/audit?kind=tool&environment_id=" + env);
  ASSERT_EQ(audit.status, 200) << audit.body;
  EXPECT_TRUE(absl::StrContains(audit.body, "blocked")) << audit.body;
  EXPECT_TRUE(absl::StrContains(audit.body, "\"py\"")) << audit.body;
  EXPECT_FALSE(absl::StrContains(audit.body, key)) << audit.body;
}

TEST_F(McpHostedApiTest, ServerKilledMidCallFailsTheCallClearlyAndRestarts) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  HttpResult r = CallTool(env, "py.die");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("isError"));
  EXPECT_TRUE(absl::StrContains(Text(r), "exited with code 7")) << r.body;
  EXPECT_TRUE(absl::StrContains(Text(r), "the test asked me to die")) << r.body;
  HttpResult s = WaitState(env, "py", "ready", 1);
  EXPECT_EQ(s.str("state"), "ready") << s.body;
  EXPECT_EQ(s.num("restarts"), 1);
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
  // Again: max_restarts (1) is used up → failed, with the reason and the stderr tail.
  CallTool(env, "py.die");
  s = WaitState(env, "py", "failed");
  EXPECT_EQ(s.str("state"), "failed") << s.body;
  EXPECT_TRUE(absl::StrContains(s.str("error"), "exited with code 7")) << s.body;
  EXPECT_TRUE(absl::StrContains(s.str("stderr_tail"), "asked me to die")) << s.body;
  HttpResult refused = CallTool(env, "py.echo");
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_TRUE(absl::StrContains(refused.body, "failed")) << refused.body;
  ExpectOthersUnaffected();
}

TEST_F(McpHostedApiTest, HangingCallTimesOut) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  const auto t0 = std::chrono::steady_clock::now();
  HttpResult r = CallTool(env, "py.sleep");
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("isError"));
  EXPECT_TRUE(absl::StrContains(Text(r), "did not answer tools/call in time")) << r.body;
  EXPECT_LT(took, std::chrono::seconds(10));
  // The server is still usable.
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
  // A wedged server: its calls time out, and it can still be stopped at once.
  HttpResult b = CallTool(env, "py.block");
  EXPECT_TRUE(b.flag("isError")) << b.body;
  EXPECT_TRUE(absl::StrContains(Text(CallTool(env, "py.echo")), "in time"));
  const auto d0 = std::chrono::steady_clock::now();
  EXPECT_EQ(daemon_->Call("DELETE", "/environments/" + env + "/mcp-servers/py").status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - d0, std::chrono::seconds(5));
  ExpectOthersUnaffected();
}

// Attack: a REST client starts a slow hosted call and hangs up; before, the call held one of
// the server's call slots until mcp.call_timeout_seconds. Now the departed client cancels it.
TEST_F(McpHostedApiTest, RestClientHangingUpMidCallCancelsItAtOnce) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  const std::string body = R"({"arguments": {}})";
  const auto t0 = std::chrono::steady_clock::now();
  // Sends the call, half-closes, waits 1 s for an answer that cannot come, and closes.
  RawExchange(daemon_->port(),
              "POST /environments/" + env +
                  "/tools/py.sleep/call HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  "Authorization: Bearer " +
                  std::string(kKeyA) + "\r\nContent-Type: application/json\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\n\r\n" + body,
              1);
  // The server hears "cancelled by the client" well before the 3 s call timeout.
  std::string log;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(2500)) {
    HttpResult r = daemon_->Call("GET", "/environments/" + env + "/files/read?path=cancelled.log");
    if (r.status == 200 && !r.str("content").empty()) {
      log = r.str("content");
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains(log, "cancelled by the client")) << "cancelled.log: " << log;
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
}

TEST_F(McpHostedApiTest, GarbageOnStdoutFailsTheServerWithAClearReason) {
  const std::string env = NewEnvWithServer();
  HttpResult s = StartServer(env, "noisy", "garbage");
  ASSERT_EQ(s.status, 201) << s.body;
  EXPECT_EQ(s.str("state"), "failed") << s.body;
  EXPECT_TRUE(absl::StrContains(s.str("error"), "not JSON-RPC")) << s.body;
  EXPECT_TRUE(absl::StrContains(s.str("error"), "hello from a chatty server")) << s.body;
  ExpectOthersUnaffected();
}

TEST_F(McpHostedApiTest, FloodingServerIsKilledAndReported) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  HttpResult r = CallTool(env, "py.flood");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("isError"));
  EXPECT_TRUE(absl::StrContains(Text(r), "flooded")) << r.body;
  ExpectOthersUnaffected();
}

// Attack F11 (REVIEW-issue14.md): a hosted server streams its output while esbd, busy on a
// loaded host, reads the agent's connection a moment late (here: esbd stopped for 1.5 s). The
// agent gave a frame up half written once the 1-s wait it belonged to had passed its deadline,
// and its connection went silent for good: every later call of the environment (execute, a
// server start, the step capture) timed out while the environment stayed "running".
TEST_F(McpHostedApiTest, StreamingServerWhileEsbdLagsLeavesTheEnvironmentAnswering) {
  const std::string env = NewEnvWithServer();
  // Two servers: together their output windows are more than the agent's socket holds, so
  // while esbd does not read, some frame is being written when its wait's deadline passes.
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  ASSERT_EQ(StartServer(env, "py2").str("state"), "ready");
  HttpResult streamed[2];
  std::thread call([&] { streamed[0] = CallTool(env, "py.stream"); });
  std::thread call2([&] { streamed[1] = CallTool(env, "py2.stream"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the streams are flowing
  EXPECT_EQ(kill(daemon_->pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(kill(daemon_->pid(), SIGCONT), 0);
  call.join();
  call2.join();
  EXPECT_EQ(streamed[0].status, 200) << streamed[0].body;
  EXPECT_EQ(streamed[1].status, 200) << streamed[1].body;
  const auto t0 = std::chrono::steady_clock::now();
  HttpResult r = daemon_->Exec(env, "echo alive", 10);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("stdout"), "alive\n") << r.body;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // The servers still answer through the same agent connection.
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
  EXPECT_EQ(Text(CallTool(env, "py2.echo")), "echo:{}");
  ExpectOthersUnaffected();
}

TEST_F(McpHostedApiTest, TooManyServersAndBadRequests) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "one").status, 201);
  ASSERT_EQ(StartServer(env, "two").status, 201);
  HttpResult third = StartServer(env, "three");
  EXPECT_EQ(third.status, 429) << third.body;
  EXPECT_TRUE(absl::StrContains(third.body, "max_servers_per_environment")) << third.body;
  EXPECT_EQ(StartServer(env, "one").status, 409);
  EXPECT_EQ(StartServer(env, "Bad/Name").status, 400);
  EXPECT_EQ(daemon_
                ->Call("POST", "/environments/" + env + "/mcp-servers",
                       json::object{{"name", "x"}, {"command", "python3"}, {"args", "nope"}})
                .status,
            400);
  EXPECT_EQ(
      daemon_->Call("POST", "/environments/" + env + "/mcp-servers", json::object{{"name", "x"}})
          .status,
      400);
}

TEST_F(McpHostedApiTest, AnotherTenantCannotReachTheServers) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  std::map<std::string, std::string> as_b = {{"Authorization", absl::StrCat("Bearer ", kKeyB)}};
  const std::string base = "/environments/" + env;
  EXPECT_EQ(daemon_->Call("GET", base + "/mcp-servers", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("GET", base + "/mcp-servers/py", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("DELETE", base + "/mcp-servers/py", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("GET", base + "/tools", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_
                ->Call("POST", base + "/tools/py.echo/call",
                       json::object{{"arguments", json::object()}}, as_b)
                .status,
            404);
  EXPECT_EQ(daemon_
                ->Call("POST", base + "/mcp-servers",
                       json::object{{"name", "evil"}, {"command", "python3"}}, as_b)
                .status,
            404);
  // Unauthenticated: 401.
  daemon_->api_key = "";
  EXPECT_EQ(daemon_->Call("GET", base + "/mcp-servers").status, 401);
  daemon_->api_key = kKeyA;
  // Still there for its owner.
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
}

TEST_F(McpHostedApiTest, NanoEnvironmentsHaveNoProcesses) {
  std::string id = daemon_->CreateEnv(json::object{{"runtime", "nano"}});
  if (id.empty()) GTEST_SKIP() << "no nano runtime on this daemon";
  HttpResult r = daemon_->Call("POST", "/environments/" + id + "/mcp-servers",
                               json::object{{"name", "py"}, {"command", "python3"}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "processes")) << r.body;
}

TEST_F(McpHostedApiTest, RewindRestartsTheServersWithoutCountingACrash) {
  const std::string env = NewEnvWithServer();  // step 1: server.py written
  HttpResult s = StartServer(env, "py");
  ASSERT_EQ(s.str("state"), "ready") << s.body;
  const std::string started = s.str("started_at");
  ASSERT_EQ(daemon_->Exec(env, "echo later > later.txt").status, 200);  // step 2
  HttpResult rw =
      daemon_->Call("POST", "/environments/" + env + "/rewind", json::object{{"step", 1}});
  if (rw.status == 409) GTEST_SKIP() << "this environment records no steps: " << rw.body;
  ASSERT_EQ(rw.status, 200) << rw.body;
  // The rewind ended the server's process; it is started again, not counted as a crash.
  HttpResult after;
  for (int i = 0; i < 300; ++i) {
    after = daemon_->Call("GET", "/environments/" + env + "/mcp-servers/py");
    if (after.str("state") == "ready" && after.str("started_at") != started) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(after.str("state"), "ready") << after.body;
  EXPECT_NE(after.str("started_at"), started) << after.body;
  EXPECT_EQ(after.num("restarts"), 0) << after.body;
  EXPECT_EQ(Text(CallTool(env, "py.echo")), "echo:{}");
  HttpResult audit = daemon_->Call("GET", "/audit?environment_id=" + env);
  EXPECT_TRUE(absl::StrContains(audit.body, "rewound to step 1")) << audit.body;
}

// gVisor has no usable PTY (no terminals) but stdio processes work: servers run there too.
TEST_F(McpHostedApiTest, GvisorEnvironmentsHostServersToo) {
  if (!daemon_->Call("GET", "/healthz").obj().at("drivers").as_object().contains("gvisor"))
    GTEST_SKIP() << "the gvisor runtime is not available here (runsc): see GET /healthz";
  const std::string env = NewEnvWithServer(json::object{{"runtime", "gvisor"}});
  ASSERT_FALSE(env.empty());
  HttpResult s = StartServer(env, "py");
  ASSERT_EQ(s.status, 201) << s.body;
  EXPECT_EQ(s.str("state"), "ready") << s.body;
  EXPECT_EQ(Text(CallTool(env, "py.echo", json::object{{"on", "gvisor"}})),
            "echo:{\"on\": \"gvisor\"}");
  HttpResult r = CallTool(env, "py.die");
  EXPECT_TRUE(absl::StrContains(Text(r), "exited with code 7")) << r.body;
  EXPECT_EQ(WaitState(env, "py", "ready", 1).str("state"), "ready");
  EXPECT_EQ(daemon_->Call("DELETE", "/environments/" + env).status, 200);
}

TEST_F(McpHostedApiTest, DeletingTheEnvironmentEndsItsServers) {
  const std::string env = NewEnvWithServer();
  ASSERT_EQ(StartServer(env, "py").str("state"), "ready");
  ASSERT_EQ(daemon_->Call("DELETE", "/environments/" + env).status, 200);
  EXPECT_EQ(daemon_->Call("GET", "/environments/" + env + "/mcp-servers").status, 404);
  EXPECT_EQ(CallTool(env, "py.echo").status, 404);
  ExpectOthersUnaffected();
}

}  // namespace
}  // namespace esb::testing
