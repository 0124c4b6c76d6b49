// esbd's own MCP tools through the real daemon (docs/api.md "Meta-tools and MCP tools"): /mcp
// lists the catalogue, creates environments and works in them with real containers, streams
// output as progress, blocks a planted AWS key before the command runs (and audits it), keeps
// tenants apart, and answers bad arguments as tool errors.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "api/tools_catalog.h"
#include "governance/dlp/dlp_test_util.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr const char* kKeyA = kTenantKeyA;
constexpr const char* kKeyB = kTenantKeyB;

class McpToolsApiTest : public SharedDaemonTest<McpToolsApiTest> {
 public:
  static Daemon::Options SuiteOptions() {
    Daemon::Options o;
    o.config_json = TwoTenantsConfig();
    return o;
  }

 protected:
  // One stateless (2026-07-28) request: no session to keep.
  HttpResult Mcp(const std::string& method, json::object params, const std::string& key = kKeyA) {
    params["_meta"] = json::object{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"},
                                   {"io.modelcontextprotocol/clientCapabilities", json::object()}};
    std::map<std::string, std::string> h{{"Authorization", "Bearer " + key},
                                         {"Accept", "application/json, text/event-stream"},
                                         {"MCP-Protocol-Version", "2026-07-28"},
                                         {"Mcp-Method", method}};
    if (method == "tools/call") h["Mcp-Name"] = std::string(params.at("name").as_string());
    json::object msg{{"jsonrpc", "2.0"}, {"id", ++id_}, {"method", method}, {"params", params}};
    return Http(daemon_->port(), "POST", "/mcp", json::serialize(msg), h);
  }
  // tools/call → its result object (from JSON or the last SSE event); progress messages in
  // *progress when asked for with a token.
  json::object Tool(const std::string& name, json::object args, const std::string& key = kKeyA,
                    std::vector<std::string>* progress = nullptr) {
    json::object params{{"name", name}, {"arguments", std::move(args)}};
    HttpResult r = progress ? McpWithToken(params, key) : Mcp("tools/call", params, key);
    EXPECT_EQ(r.status, 200) << r.body;
    json::object result;
    if (absl::StartsWith(r.headers["content-type"], "text/event-stream")) {
      for (const SseEvent& e : ParseSse(r.body)) {
        if (!e.data.is_object()) continue;
        const json::object& o = e.data.as_object();
        if (o.contains("result")) result = o.at("result").as_object();
        if (progress && o.contains("method") && o.at("method") == "notifications/progress") {
          const json::value* m = o.at("params").as_object().if_contains("message");
          if (m && m->is_string()) progress->emplace_back(m->as_string());
        }
      }
    } else {
      boost::system::error_code ec;
      json::value v = json::parse(r.body, ec);
      if (!ec && v.is_object() && v.as_object().contains("result"))
        result = v.at("result").as_object();
    }
    EXPECT_FALSE(result.empty()) << r.body;
    return result;
  }
  HttpResult McpWithToken(json::object params, const std::string& key) {
    params["_meta"] = json::object{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"},
                                   {"io.modelcontextprotocol/clientCapabilities", json::object()},
                                   {"progressToken", "p1"}};
    std::map<std::string, std::string> h{{"Authorization", "Bearer " + key},
                                         {"Accept", "application/json, text/event-stream"},
                                         {"MCP-Protocol-Version", "2026-07-28"},
                                         {"Mcp-Method", "tools/call"},
                                         {"Mcp-Name", std::string(params.at("name").as_string())}};
    json::object msg{
        {"jsonrpc", "2.0"}, {"id", ++id_}, {"method", "tools/call"}, {"params", params}};
    return Http(daemon_->port(), "POST", "/mcp", json::serialize(msg), h);
  }
  static std::string TextOf(const json::object& result) {
    return std::string(result.at("content").at(0).at("text").as_string());
  }
  static bool IsError(const json::object& result) {
    const json::value* e = result.if_contains("isError");
    return e && e->is_bool() && e->as_bool();
  }
  std::string NewEnv(const std::string& key = kKeyA) {
    json::object r = Tool("create_environment", json::object{{"ttl_seconds", 300}}, key);
    EXPECT_FALSE(IsError(r)) << json::serialize(r);
    return std::string(r.at("structuredContent").at("environment_id").as_string());
  }

  int id_ = 0;
};

TEST_F(McpToolsApiTest, ListsTheCatalogue) {
  HttpResult r = Mcp("tools/list", {});
  ASSERT_EQ(r.status, 200) << r.body;
  json::array tools = json::parse(r.body).at("result").at("tools").as_array();
  json::array want = api::McpTools();
  ASSERT_EQ(tools.size(), want.size()) << r.body;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(tools[i].at("name"), want[i].at("name"));
    EXPECT_EQ(tools[i].at("inputSchema"), want[i].at("inputSchema"));
  }
}

TEST_F(McpToolsApiTest, CreateExecuteWriteReadListDelete) {
  const std::string env = NewEnv();
  std::vector<std::string> progress;
  json::object x = Tool("execute_command",
                        json::object{{"environment_id", env},
                                     {"command", "echo one; sleep 0.3; echo two >&2; echo three"}},
                        kKeyA, &progress);
  ASSERT_FALSE(IsError(x)) << json::serialize(x);
  EXPECT_EQ(x.at("structuredContent").at("stdout"), "one\nthree\n");
  EXPECT_EQ(x.at("structuredContent").at("stderr"), "two\n");
  EXPECT_EQ(x.at("structuredContent").at("exit_code"), 0);
  std::string streamed;
  for (const std::string& p : progress) streamed += p;
  EXPECT_TRUE(absl::StrContains(streamed, "one")) << streamed;
  EXPECT_TRUE(absl::StrContains(streamed, "[stderr] two")) << streamed;

  json::object w = Tool("write_file", json::object{{"environment_id", env},
                                                   {"path", "src/main.py"},
                                                   {"content", "print(6 * 7)\n"}});
  EXPECT_EQ(w.at("structuredContent").at("message"), "File saved successfully.");
  json::object run = Tool(
      "execute_command", json::object{{"environment_id", env}, {"command", "python3 src/main.py"}});
  EXPECT_EQ(run.at("structuredContent").at("stdout"), "42\n");
  json::object rd =
      Tool("read_file", json::object{{"environment_id", env}, {"path", "src/main.py"}});
  EXPECT_EQ(rd.at("structuredContent").at("content"), "print(6 * 7)\n");
  json::object ls = Tool("list_files", json::object{{"environment_id", env}, {"path", "src"}});
  ASSERT_FALSE(IsError(ls)) << json::serialize(ls);
  EXPECT_EQ(ls.at("structuredContent").at("entries").at(0).at("name"), "main.py");
  json::object failed =
      Tool("execute_command", json::object{{"environment_id", env}, {"command", "exit 4"}});
  EXPECT_TRUE(IsError(failed));
  EXPECT_EQ(failed.at("structuredContent").at("exit_code"), 4);

  json::object del = Tool("delete_environment", json::object{{"environment_id", env}});
  EXPECT_FALSE(IsError(del)) << json::serialize(del);
  EXPECT_TRUE(IsError(Tool("read_file", json::object{{"environment_id", env}, {"path", "x"}})));
}

TEST_F(McpToolsApiTest, APlantedAwsKeyIsBlockedBeforeTheCommandRunsAndAudited) {
  const std::string env = NewEnv();
  const std::string key = governance::dlp::testing::AwsKeyId();
  json::object r =
      Tool("execute_command",
           json::object{{"environment_id", env}, {"command", "echo " + key + " > planted.txt"}});
  EXPECT_TRUE(IsError(r));
  EXPECT_TRUE(absl::StrContains(TextOf(r), "dlp:aws_access_key")) << TextOf(r);
  EXPECT_FALSE(absl::StrContains(json::serialize(r), key));
  // Nothing ran: the file the command would have written is not there.
  EXPECT_TRUE(
      IsError(Tool("read_file", json::object{{"environment_id", env}, {"path", "planted.txt"}})));
  HttpResult audit =
      Http(daemon_->port(), "GET", "/audit?kind=tool&decision=blocked&environment_id=" + env, "",
           {{"Authorization", std::string("Bearer ") + kKeyA}});
  ASSERT_EQ(audit.status, 200) << audit.body;
  ASSERT_EQ(audit.obj().at("entries").as_array().size(), 1u) << audit.body;
  const json::value& row = audit.obj().at("entries").at(0);
  EXPECT_EQ(row.at("tool_call").at("tool"), "execute_command");
  EXPECT_EQ(row.at("tool_call").at("rule_ids"), (json::array{"dlp:aws_access_key"}));
  EXPECT_FALSE(absl::StrContains(audit.body, key)) << audit.body;
  Tool("delete_environment", json::object{{"environment_id", env}});
}

TEST_F(McpToolsApiTest, TenantsNeverSeeEachOthersEnvironments) {
  const std::string env = NewEnv(kKeyA);
  json::object theirs =
      Tool("execute_command", json::object{{"environment_id", env}, {"command", "id"}}, kKeyB);
  json::object missing =
      Tool("execute_command",
           json::object{{"environment_id", "env_0000000000000000"}, {"command", "id"}}, kKeyB);
  EXPECT_TRUE(IsError(theirs));
  EXPECT_TRUE(IsError(missing));
  EXPECT_EQ(absl::StrReplaceAll(TextOf(theirs), {{env, "X"}}),
            absl::StrReplaceAll(TextOf(missing), {{"env_0000000000000000", "X"}}));
  json::object list = Tool("list_environments", {}, kKeyB);
  EXPECT_FALSE(absl::StrContains(json::serialize(list), env));
  EXPECT_TRUE(IsError(Tool("delete_environment", json::object{{"environment_id", env}}, kKeyB)));
  EXPECT_TRUE(absl::StrContains(json::serialize(Tool("list_environments", {}, kKeyA)), env));
  Tool("delete_environment", json::object{{"environment_id", env}});
}

// The smallest stdio MCP server (2025-11-25, standard library only): one tool, "echo".
constexpr char kEchoServerPy[] = R"PY(
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    r = {"jsonrpc": "2.0", "id": m["id"]}
    if m["method"] == "initialize":
        r["result"] = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                       "serverInfo": {"name": "echo", "version": "1"}}
    elif m["method"] == "tools/list":
        r["result"] = {"tools": [{"name": "echo", "description": "echoes",
                                  "inputSchema": {"type": "object"}}]}
    elif m["method"] == "tools/call":
        r["result"] = {"content": [{"type": "text", "text": "echo:" + json.dumps(
            m["params"].get("arguments") or {}, sort_keys=True)}]}
    else:
        r["error"] = {"code": -32601, "message": "Method not found"}
    sys.stdout.write(json.dumps(r) + "\n"); sys.stdout.flush()
)PY";

// One connection to /mcp reaches the sandbox's hosted tools too, through the same gate.
TEST_F(McpToolsApiTest, HostedToolsAreListedAndCalledThroughEsbdsTools) {
  const std::string env = NewEnv();
  Tool("write_file",
       json::object{{"environment_id", env}, {"path", "echo.py"}, {"content", kEchoServerPy}});
  HttpResult started = Http(
      daemon_->port(), "POST", "/environments/" + env + "/mcp-servers",
      json::serialize(json::object{
          {"name", "py"}, {"command", "python3"}, {"args", json::array{"-u", "echo.py"}}}),
      {{"Authorization", std::string("Bearer ") + kKeyA}, {"Content-Type", "application/json"}});
  ASSERT_EQ(started.status, 201) << started.body;
  json::object list = Tool("list_environment_tools", json::object{{"environment_id", env}});
  ASSERT_FALSE(IsError(list)) << json::serialize(list);
  EXPECT_TRUE(absl::StrContains(json::serialize(list.at("structuredContent")), "py.echo"))
      << json::serialize(list);
  json::object call =
      Tool("call_environment_tool", json::object{{"environment_id", env},
                                                 {"name", "py.echo"},
                                                 {"arguments", json::object{{"x", 1}}}});
  ASSERT_FALSE(IsError(call)) << json::serialize(call);
  EXPECT_EQ(TextOf(call), "echo:{\"x\": 1}");
  // A planted key in a hosted call is blocked before the server sees it, audited once as the
  // hosted server's call.
  const std::string key = governance::dlp::testing::AwsKeyId();
  json::object blocked =
      Tool("call_environment_tool", json::object{{"environment_id", env},
                                                 {"name", "py.echo"},
                                                 {"arguments", json::object{{"k", key}}}});
  EXPECT_TRUE(IsError(blocked));
  EXPECT_FALSE(absl::StrContains(json::serialize(blocked), "echo:")) << json::serialize(blocked);
  HttpResult audit =
      Http(daemon_->port(), "GET", "/audit?kind=tool&decision=blocked&environment_id=" + env, "",
           {{"Authorization", std::string("Bearer ") + kKeyA}});
  ASSERT_EQ(audit.status, 200) << audit.body;
  ASSERT_EQ(audit.obj().at("entries").as_array().size(), 1u) << audit.body;
  EXPECT_EQ(audit.obj().at("entries").at(0).at("tool_call").at("server"), "py");
  EXPECT_FALSE(absl::StrContains(audit.body, key));
  // Another tenant reaches none of it.
  EXPECT_TRUE(
      IsError(Tool("list_environment_tools", json::object{{"environment_id", env}}, kKeyB)));
  Tool("delete_environment", json::object{{"environment_id", env}});
}

TEST_F(McpToolsApiTest, BadArgumentsAreToolErrorsNotCrashes) {
  for (const json::object& args :
       {json::object{}, json::object{{"environment_id", 5}, {"command", "ls"}},
        json::object{{"environment_id", "e"}, {"command", "ls"}, {"timeout_seconds", 1e12}},
        json::object{{"environment_id", "e"}, {"command", json::array{"ls"}}},
        json::object{{"environment_id", "e"}, {"command", "ls"}, {"extra", json::object{}}}}) {
    json::object r = Tool("execute_command", args);
    EXPECT_TRUE(IsError(r)) << json::serialize(args) << " " << json::serialize(r);
  }
  HttpResult health = Http(daemon_->port(), "GET", "/healthz", "", {});
  EXPECT_EQ(health.status, 200);
}

}  // namespace
}  // namespace esb::testing
