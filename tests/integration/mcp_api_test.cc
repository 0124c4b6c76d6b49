// MCP through the real esbd (docs/api.md "MCP"): /mcp with the REST API keys and tenants, tenant
// isolation of sessions, Origin protection, both protocol eras, the test-only conformance
// fixtures flag, and `esbd mcp-stdio` bridging stdin/stdout to /mcp.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr const char* kKeyA = kTenantKeyA;
constexpr const char* kKeyB = kTenantKeyB;

class McpApiTest : public SharedDaemonTest<McpApiTest> {
 public:
  static Daemon::Options SuiteOptions() {
    Daemon::Options o;
    o.config_json = TwoTenantsConfig();
    o.extra_args = {"--mcp-conformance-fixtures"};
    return o;
  }

 protected:
  HttpResult Mcp(const json::object& msg, std::map<std::string, std::string> headers,
                 const std::string& key = kKeyA) {
    if (!key.empty()) headers["Authorization"] = "Bearer " + key;
    headers["Accept"] = "application/json, text/event-stream";
    return Http(daemon_->port(), "POST", "/mcp", json::serialize(msg), headers);
  }
  std::string Initialize(const std::string& key = kKeyA) {
    HttpResult r = Mcp(json::object{{"jsonrpc", "2.0"},
                                    {"id", 1},
                                    {"method", "initialize"},
                                    {"params", json::object{{"protocolVersion", "2025-11-25"},
                                                            {"capabilities", json::object()}}}},
                       {}, key);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.headers["mcp-session-id"];
  }
  static json::object Call(const char* method, json::object params = {}, int id = 2) {
    return json::object{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", params}};
  }
};

TEST_F(McpApiTest, McpNeedsAnApiKey) {
  HttpResult r = Mcp(Call("initialize", {{"protocolVersion", "2025-11-25"}}), {}, "");
  EXPECT_EQ(r.status, 401) << r.body;
  r = Mcp(Call("initialize", {{"protocolVersion", "2025-11-25"}}), {}, "esb_not_a_key");
  EXPECT_EQ(r.status, 401) << r.body;
}

TEST_F(McpApiTest, LegacySessionListsAndCallsTools) {
  std::string sid = Initialize();
  ASSERT_FALSE(sid.empty());
  std::map<std::string, std::string> h{{"Mcp-Session-Id", sid},
                                       {"MCP-Protocol-Version", "2025-11-25"}};
  HttpResult r = Mcp(json::object{{"jsonrpc", "2.0"}, {"method", "notifications/initialized"}}, h);
  EXPECT_EQ(r.status, 202);
  r = Mcp(Call("tools/list"), h);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("test_simple_text"), std::string::npos) << r.body;
  r = Mcp(Call("tools/call", {{"name", "test_simple_text"}}), h);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("This is a simple text response for testing."), std::string::npos);
  // Progress comes as SSE: three notifications, then the result.
  r = Mcp(Call("tools/call", {{"name", "test_tool_with_progress"},
                              {"_meta", json::object{{"progressToken", "t1"}}}}),
          h);
  ASSERT_EQ(r.status, 200) << r.body;
  int progress = 0;
  bool result = false;
  for (const SseEvent& e : ParseSse(r.body)) {
    if (!e.data.is_object()) continue;
    if (e.data.as_object().contains("method")) progress += 1;
    if (e.data.as_object().contains("result")) result = true;
  }
  EXPECT_EQ(progress, 3) << r.body;
  EXPECT_TRUE(result) << r.body;
  Http(daemon_->port(), "DELETE", "/mcp", "",
       {{"Mcp-Session-Id", sid}, {"Authorization", std::string("Bearer ") + kKeyA}});
}

TEST_F(McpApiTest, AnotherTenantCannotUseASession) {
  std::string sid = Initialize(kKeyA);
  std::map<std::string, std::string> h{{"Mcp-Session-Id", sid}};
  HttpResult r = Mcp(Call("tools/list"), h, kKeyB);
  EXPECT_EQ(r.status, 404) << r.body;
  r = Http(daemon_->port(), "DELETE", "/mcp", "",
           {{"Mcp-Session-Id", sid}, {"Authorization", std::string("Bearer ") + kKeyB}});
  EXPECT_EQ(r.status, 404);
  r = Mcp(Call("tools/list"), h, kKeyA);
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST_F(McpApiTest, CrossSiteOriginIsRefusedEvenWithAKey) {
  HttpResult r = Mcp(Call("initialize", {{"protocolVersion", "2025-11-25"}}),
                     {{"Origin", "https://evil.example.com"}});
  EXPECT_EQ(r.status, 403) << r.body;
}

TEST_F(McpApiTest, ModernRequestsAreStateless) {
  json::object meta{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"},
                    {"io.modelcontextprotocol/clientCapabilities", json::object()}};
  HttpResult r = Mcp(Call("server/discover", {{"_meta", meta}}),
                     {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "server/discover"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.count("mcp-session-id"), 0u);
  r = Mcp(Call("tools/call", {{"name", "test_simple_text"}, {"_meta", meta}}),
          {{"MCP-Protocol-Version", "2026-07-28"},
           {"Mcp-Method", "tools/call"},
           {"Mcp-Name", "test_simple_text"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("\"resultType\":\"complete\""), std::string::npos) << r.body;
  r = Http(
      daemon_->port(), "GET", "/mcp", "",
      {{"Authorization", std::string("Bearer ") + kKeyA}, {"MCP-Protocol-Version", "2026-07-28"}});
  EXPECT_EQ(r.status, 405);
}

// esbd's own tools on /mcp act as the key's tenant: another tenant's environment is not there.
TEST_F(McpApiTest, EsbdToolsKeepTenantsApart) {
  json::object meta{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"},
                    {"io.modelcontextprotocol/clientCapabilities", json::object()}};
  HttpResult r = Mcp(Call("tools/list", {{"_meta", meta}}),
                     {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "tools/list"}});
  ASSERT_EQ(r.status, 200) << r.body;
  for (const char* tool : {"create_environment", "execute_command", "list_environments"})
    EXPECT_NE(r.body.find(std::string("\"") + tool + "\""), std::string::npos) << tool;
  daemon_->api_key = kKeyA;
  std::string env = daemon_->CreateEnv();
  daemon_->api_key.clear();
  ASSERT_FALSE(env.empty());
  auto exec = [&](const std::string& key) {
    return Mcp(
        Call("tools/call",
             {{"name", "execute_command"},
              {"arguments", json::object{{"environment_id", env}, {"command", "echo mcp-hello"}}},
              {"_meta", meta}}),
        {{"MCP-Protocol-Version", "2026-07-28"},
         {"Mcp-Method", "tools/call"},
         {"Mcp-Name", "execute_command"}},
        key);
  };
  HttpResult other = exec(kKeyB);
  EXPECT_EQ(other.body.find("mcp-hello\n"), std::string::npos) << other.body;
  EXPECT_TRUE(other.obj().contains("error") ||
              (other.obj().contains("result") &&
               other.obj().at("result").as_object().at("isError") == true))
      << other.body;
  HttpResult mine = exec(kKeyA);
  ASSERT_EQ(mine.status, 200) << mine.body;
  EXPECT_NE(mine.body.find("mcp-hello"), std::string::npos) << mine.body;
  EXPECT_EQ(mine.obj().at("result").as_object().at("isError"), false) << mine.body;
  Http(daemon_->port(), "DELETE", "/environments/" + env, "",
       {{"Authorization", std::string("Bearer ") + kKeyA}});
}

// Runs `esbd mcp-stdio` with `args`, writes `input` lines to it, and reads its stdout until
// `lines` lines came or 20 s passed; then closes stdin and waits for it to exit.
std::vector<json::object> RunBridge(const std::vector<std::string>& args,
                                    const std::vector<std::string>& input, size_t lines,
                                    const std::string& key, int* exit_code) {
  int in[2], out[2];
  EXPECT_EQ(pipe(in), 0);
  EXPECT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    setenv("ESB_API_KEY", key.c_str(), 1);
    std::vector<std::string> argv_s = {std::string(ESB_BUILD_DIR) + "/esbd", "mcp-stdio"};
    for (const auto& a : args) argv_s.push_back(a);
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  for (const std::string& l : input) {
    std::string line = l + "\n";
    EXPECT_EQ(write(in[1], line.data(), line.size()), static_cast<ssize_t>(line.size()));
  }
  std::vector<json::object> got;
  std::string buf;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (got.size() < lines && std::chrono::steady_clock::now() < deadline) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char chunk[4096];
    ssize_t n = read(out[0], chunk, sizeof chunk);
    if (n <= 0) break;
    buf.append(chunk, n);
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      json::error_code ec;
      json::value v = json::parse(buf.substr(0, nl), ec);
      EXPECT_FALSE(ec) << "stdout carried a non-JSON line: " << buf.substr(0, nl);
      if (!ec && v.is_object()) got.push_back(v.as_object());
      buf.erase(0, nl + 1);
    }
  }
  close(in[1]);
  int st = 0;
  for (int i = 0; i < 200; ++i) {
    if (waitpid(pid, &st, WNOHANG) == pid) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (i == 199) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
    }
  }
  close(out[0]);
  *exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return got;
}

const json::object* ById(const std::vector<json::object>& msgs, int id) {
  for (const auto& m : msgs) {
    if (const json::value* v = m.if_contains("id"); v && v->is_int64() && v->as_int64() == id)
      return &m;
  }
  return nullptr;
}

TEST_F(McpApiTest, StdioBridgeOverTcpCarriesSessionsProgressAndModernCalls) {
  std::vector<std::string> input = {
      R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}})",
      R"({"jsonrpc":"2.0","method":"notifications/initialized"})",
      R"({"jsonrpc":"2.0","id":2,"method":"tools/list"})",
      R"({"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"test_tool_with_progress","_meta":{"progressToken":"p"}}})",
      R"({"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"test_simple_text","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}}})",
      R"(this is not json)",
  };
  int code = -1;
  auto got = RunBridge({"--url", "http://127.0.0.1:" + std::to_string(daemon_->port())}, input, 8,
                       kKeyA, &code);
  EXPECT_EQ(code, 0);
  const json::object* init = ById(got, 1);
  ASSERT_NE(init, nullptr);
  EXPECT_EQ(init->at("result").at("protocolVersion"), "2025-11-25");
  const json::object* list = ById(got, 2);
  ASSERT_NE(list, nullptr);
  EXPECT_NE(json::serialize(*list).find("test_simple_text"), std::string::npos);
  ASSERT_NE(ById(got, 3), nullptr);
  EXPECT_EQ(ById(got, 3)->at("result").at("isError"), false);
  int progress = 0, parse_errors = 0;
  for (const auto& m : got) {
    if (m.contains("method") && m.at("method") == "notifications/progress") ++progress;
    if (m.contains("error") && m.at("error").at("code") == -32700) ++parse_errors;
  }
  EXPECT_EQ(progress, 3);
  EXPECT_EQ(parse_errors, 1);
  const json::object* modern = ById(got, 4);
  ASSERT_NE(modern, nullptr);
  EXPECT_EQ(modern->at("result").at("resultType"), "complete");
}

TEST_F(McpApiTest, StdioBridgeOverTheUnixSocketUsesTheKeyFromTheEnvironment) {
  std::vector<std::string> input = {
      R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{}}})",
      R"({"jsonrpc":"2.0","id":2,"method":"ping"})",
  };
  int code = -1;
  auto got = RunBridge({"--socket", daemon_->state_dir() + "/esbd.sock"}, input, 2, kKeyB, &code);
  ASSERT_NE(ById(got, 2), nullptr);
  EXPECT_TRUE(ById(got, 2)->contains("result"));
  // Without a key the daemon refuses, and the bridge says so as a JSON-RPC error.
  got = RunBridge({"--socket", daemon_->state_dir() + "/esbd.sock"}, input, 2, "", &code);
  ASSERT_NE(ById(got, 1), nullptr);
  EXPECT_TRUE(ById(got, 1)->contains("error")) << json::serialize(*ById(got, 1));
}

TEST(McpFixturesFlagTest, FixturesAreOffByDefault) {
  std::string why = Daemon::SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult r = Http(
      d.port(), "POST", "/mcp",
      R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25"}})",
      {{"Accept", "application/json, text/event-stream"}});
  ASSERT_EQ(r.status, 200) << r.body;
  std::string sid = r.headers["mcp-session-id"];
  r = Http(d.port(), "POST", "/mcp", R"({"jsonrpc":"2.0","id":2,"method":"tools/list"})",
           {{"Mcp-Session-Id", sid}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body.find("test_"), std::string::npos) << r.body;
  EXPECT_EQ(d.Log().find("TEST ONLY"), std::string::npos);
  d.StopAndCleanup();
}

}  // namespace
}  // namespace esb::testing
