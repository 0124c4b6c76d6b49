// The MCP endpoint's protocol logic, driven through McpEndpoint::Handle without a server: both
// eras, sessions and their isolation, cancellation, progress, pagination, and hostile input.
#include "api/mcp/mcp_endpoint.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "api/mcp/conformance_fixtures.h"

namespace esb::api::mcp {
namespace {
namespace json = boost::json;

// Tools for the tests: echo, a slow one that runs until cancelled (reporting progress), a
// failing one, and enough of them to page.
class TestTools : public tools::ToolProvider {
 public:
  std::atomic<bool> slow_started{false};
  std::atomic<bool> slow_saw_cancel{false};
  std::mutex mu;
  std::string last_tenant, last_channel;

  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller&) override {
    std::vector<tools::ToolDefinition> out;
    for (const char* n : {"echo", "slow", "fail", "t3", "t4"}) {
      out.push_back(json::object{{"name", n},
                                 {"description", "test tool"},
                                 {"inputSchema", json::object{{"type", "object"}}}});
    }
    return out;
  }
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name, const json::object& args,
                                             const tools::CallContext& ctx) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      last_tenant = ctx.caller.tenant;
      last_channel = ctx.caller.channel;
    }
    tools::ToolResult r;
    if (name == "echo") {
      r.content.push_back(json::object{{"type", "text"}, {"text", json::serialize(args)}});
      return r;
    }
    if (name == "fail") {
      r.is_error = true;
      r.content.push_back(json::object{{"type", "text"}, {"text", "it failed"}});
      return r;
    }
    if (name == "slow") {
      slow_started = true;
      for (int i = 1; i <= 500; ++i) {
        if (ctx.cancelled && ctx.cancelled()) {
          slow_saw_cancel = true;
          break;
        }
        if (ctx.progress) ctx.progress({static_cast<double>(i), 500.0, "tick"});
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      r.content.push_back(json::object{{"type", "text"}, {"text", "done"}});
      return r;
    }
    return absl::NotFoundError("unknown tool");
  }
};

// Captures a streamed answer; can pretend the client left.
class FakeWriter : public ResponseWriter {
 public:
  std::mutex mu;
  std::string data;
  std::atomic<bool> gone{false};
  bool Write(std::string_view d) override {
    if (gone) return false;
    std::lock_guard<std::mutex> lock(mu);
    data.append(d);
    return true;
  }
  bool ok() const override { return !gone; }
  bool ClientGone() override { return gone; }
  uint64_t bytes_written() const override { return data.size(); }
};

class McpEndpointTest : public ::testing::Test {
 protected:
  void SetUp() override { Make({}); }

  void Make(McpEndpointOptions o, std::shared_ptr<tools::ToolProvider> p = nullptr) {
    if (o.page_size == 100) o.page_size = 2;
    provider_ = p ? p : tools_;
    auto provider = provider_;
    endpoint_ = NewMcpEndpoint(
        {.admit = [](Request& req) -> std::optional<Response> {
           auto t = req.Header("X-Tenant");
           if (!t) return ErrorResponse(401, "no tenant");
           req.principal_ = *t;
           return std::nullopt;
         },
         .caller_of = [](const Request& req) { return Caller(req.principal(), "key", "rest"); }},
        [provider](const Request&, const Caller&)
            -> absl::StatusOr<std::shared_ptr<tools::ToolProvider>> { return provider; },
        o);
  }

  Request Req(std::string method, std::string body,
              std::vector<std::pair<std::string, std::string>> headers = {},
              std::string tenant = "acme") {
    Request r;
    r.method_ = std::move(method);
    r.path_ = r.target_ = "/mcp";
    r.body_ = std::move(body);
    r.headers_ = std::move(headers);
    if (!tenant.empty()) r.headers_.emplace_back("X-Tenant", tenant);
    if (!r.body_.empty()) r.headers_.emplace_back("Content-Type", "application/json");
    r.peer_.is_loopback = true;
    return r;
  }

  Response Post(const json::value& msg,
                std::vector<std::pair<std::string, std::string>> headers = {},
                std::string tenant = "acme") {
    Request r = Req("POST", json::serialize(msg), std::move(headers), std::move(tenant));
    return endpoint_->Handle(r);
  }

  static json::object Body(const Response& r) {
    json::error_code ec;
    json::value v = json::parse(r.body, ec);
    EXPECT_FALSE(ec) << r.body;
    return v.is_object() ? v.as_object() : json::object();
  }
  static int64_t Code(const Response& r) {
    json::object b = Body(r);
    const json::value* e = b.if_contains("error");
    return e ? e->as_object().at("code").as_int64() : 0;
  }

  // initialize; returns the session id.
  std::string Initialize(std::string tenant = "acme") {
    Response r = Post(
        json::object{{"jsonrpc", "2.0"},
                     {"id", 1},
                     {"method", "initialize"},
                     {"params",
                      json::object{{"protocolVersion", "2025-06-18"},
                                   {"capabilities", json::object()},
                                   {"clientInfo", json::object{{"name", "t"}, {"version", "1"}}}}}},
        {}, tenant);
    EXPECT_EQ(r.status, 200) << r.body;
    for (const auto& [k, v] : r.headers) {
      if (k == "Mcp-Session-Id") return v;
    }
    ADD_FAILURE() << "no Mcp-Session-Id";
    return "";
  }

  Response Legacy(const std::string& sid, std::string method, json::object params = {},
                  json::value id = 7, std::string tenant = "acme") {
    json::object msg{{"jsonrpc", "2.0"}, {"method", std::move(method)}, {"params", params}};
    if (!id.is_null()) msg["id"] = id;
    return Post(msg, {{"Mcp-Session-Id", sid}, {"MCP-Protocol-Version", "2025-06-18"}}, tenant);
  }

  static json::object ModernMeta(std::string version = "2026-07-28") {
    return json::object{
        {"io.modelcontextprotocol/protocolVersion", version},
        {"io.modelcontextprotocol/clientCapabilities", json::object()},
        {"io.modelcontextprotocol/clientInfo", json::object{{"name", "t"}, {"version", "1"}}}};
  }
  Response Modern(std::string method, json::object params = {},
                  std::vector<std::pair<std::string, std::string>> extra = {},
                  bool standard_headers = true) {
    if (!params.contains("_meta")) params["_meta"] = ModernMeta();
    std::vector<std::pair<std::string, std::string>> h;
    if (standard_headers) {
      h = {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", method}};
      if (method == "tools/call") h.emplace_back("Mcp-Name", params["name"].as_string().c_str());
    }
    for (auto& e : extra) h.push_back(e);
    return Post(json::object{{"jsonrpc", "2.0"}, {"id", 5}, {"method", method}, {"params", params}},
                h);
  }

  std::shared_ptr<TestTools> tools_ = std::make_shared<TestTools>();
  std::shared_ptr<tools::ToolProvider> provider_;
  std::shared_ptr<McpEndpoint> endpoint_;
};

// --- 2025-11-25 ---------------------------------------------------------------------------

TEST_F(McpEndpointTest, InitializeOpensASessionAndEchoesASupportedVersion) {
  Response r = Post(json::object{{"jsonrpc", "2.0"},
                                 {"id", "init"},
                                 {"method", "initialize"},
                                 {"params", json::object{{"protocolVersion", "2025-06-18"},
                                                         {"capabilities", json::object()}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  json::object b = Body(r);
  EXPECT_EQ(b["id"], "init");
  EXPECT_EQ(b["result"].at("protocolVersion"), "2025-06-18");
  EXPECT_TRUE(b["result"].at("capabilities").as_object().contains("tools"));
  EXPECT_EQ(b["result"].at("serverInfo").at("name"), "esbd");
  EXPECT_EQ(endpoint_->session_count(), 1);
  // An unknown version gets the newest legacy one.
  r = Post(json::object{{"jsonrpc", "2.0"},
                        {"id", 2},
                        {"method", "initialize"},
                        {"params", json::object{{"protocolVersion", "1999-01-01"}}}});
  EXPECT_EQ(Body(r)["result"].at("protocolVersion"), "2025-11-25");
}

TEST_F(McpEndpointTest, SessionIdsAreLongAndRandom) {
  std::string a = Initialize(), b = Initialize();
  EXPECT_GE(a.size(), 32u);
  EXPECT_NE(a, b);
  for (char c : a) EXPECT_TRUE(c > 0x20 && c < 0x7f);
}

TEST_F(McpEndpointTest, RequestsNeedTheSession) {
  Response r = Post(json::object{{"jsonrpc", "2.0"}, {"id", 1}, {"method", "tools/list"}},
                    {{"MCP-Protocol-Version", "2025-06-18"}});
  EXPECT_EQ(r.status, 400) << r.body;
  r = Legacy("0123456789abcdef0123456789abcdef", "tools/list");
  EXPECT_EQ(r.status, 404) << r.body;
}

TEST_F(McpEndpointTest, AnotherTenantUsingASessionIdGetsNotFound) {
  std::string sid = Initialize("acme");
  Response r = Legacy(sid, "tools/list", {}, 1, "evil");
  EXPECT_EQ(r.status, 404) << r.body;
  Request del = Req("DELETE", "", {{"Mcp-Session-Id", sid}}, "evil");
  EXPECT_EQ(endpoint_->Handle(del).status, 404);
  // Still the owner's.
  EXPECT_EQ(Legacy(sid, "ping").status, 200);
}

TEST_F(McpEndpointTest, InitializedPingAndUnknownMethods) {
  std::string sid = Initialize();
  Response r = Legacy(sid, "notifications/initialized", {}, nullptr);
  EXPECT_EQ(r.status, 202);
  EXPECT_TRUE(r.body.empty());
  r = Legacy(sid, "ping");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(Body(r)["result"].as_object().empty());
  EXPECT_EQ(Code(Legacy(sid, "resources/list")), -32601);
  EXPECT_EQ(Code(Legacy(sid, "prompts/list")), -32601);
  r = Legacy(sid, "logging/setLevel", {{"level", "warning"}});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(Code(Legacy(sid, "logging/setLevel", {{"level", "loud"}})), -32602);
}

TEST_F(McpEndpointTest, UnsupportedProtocolVersionHeaderIs400) {
  std::string sid = Initialize();
  Response r = Post(json::object{{"jsonrpc", "2.0"}, {"id", 1}, {"method", "ping"}},
                    {{"Mcp-Session-Id", sid}, {"MCP-Protocol-Version", "1999-01-01"}});
  EXPECT_EQ(r.status, 400);
}

TEST_F(McpEndpointTest, ToolsListPages) {
  std::string sid = Initialize();
  std::vector<std::string> names;
  json::value cursor;
  for (int page = 0; page < 10; ++page) {
    json::object params;
    if (!cursor.is_null()) params["cursor"] = cursor;
    json::object b = Body(Legacy(sid, "tools/list", params));
    for (const auto& t : b["result"].at("tools").as_array())
      names.emplace_back(t.at("name").as_string());
    const json::value* next = b["result"].as_object().if_contains("nextCursor");
    if (!next) break;
    cursor = *next;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"echo", "slow", "fail", "t3", "t4"}));
  EXPECT_EQ(Code(Legacy(sid, "tools/list", {{"cursor", "garbage"}})), -32602);
  EXPECT_EQ(Code(Legacy(sid, "tools/list", {{"cursor", "o999"}})), -32602);
  EXPECT_EQ(Code(Legacy(sid, "tools/list", {{"cursor", 5}})), -32602);
}

TEST_F(McpEndpointTest, ToolsCallResultsAndErrors) {
  std::string sid = Initialize();
  json::object b = Body(Legacy(sid, "tools/call", {{"name", "echo"}, {"arguments", {{"x", 1}}}}));
  EXPECT_EQ(b["result"].at("content").at(0).at("text"), "{\"x\":1}");
  EXPECT_EQ(b["result"].at("isError"), false);
  {
    std::lock_guard<std::mutex> lock(tools_->mu);
    EXPECT_EQ(tools_->last_tenant, "acme");
    EXPECT_EQ(tools_->last_channel, "mcp");
  }
  b = Body(Legacy(sid, "tools/call", {{"name", "fail"}}));
  EXPECT_EQ(b["result"].at("isError"), true);
  EXPECT_EQ(Code(Legacy(sid, "tools/call", {{"name", "nope"}})), -32602);
  EXPECT_EQ(Code(Legacy(sid, "tools/call", {{"name", "echo"}, {"arguments", "x"}})), -32602);
  EXPECT_EQ(Code(Legacy(sid, "tools/call", {{"name", 3}})), -32602);
  EXPECT_EQ(Code(Legacy(sid, "tools/call", {})), -32602);
}

TEST_F(McpEndpointTest, DeleteEndsTheSession) {
  std::string sid = Initialize();
  Request del = Req("DELETE", "", {{"Mcp-Session-Id", sid}});
  EXPECT_EQ(endpoint_->Handle(del).status, 204);
  EXPECT_EQ(Legacy(sid, "ping").status, 404);
  EXPECT_EQ(endpoint_->session_count(), 0);
}

TEST_F(McpEndpointTest, GetWithoutSessionIs405AndWithOneStreamsUntilDeleted) {
  Request get = Req("GET", "", {{"Accept", "text/event-stream"}});
  EXPECT_EQ(endpoint_->Handle(get).status, 405);
  std::string sid = Initialize();
  Request get2 = Req("GET", "", {{"Accept", "text/event-stream"}, {"Mcp-Session-Id", sid}});
  Response r = endpoint_->Handle(get2);
  ASSERT_TRUE(r.stream);
  FakeWriter w;
  std::thread t([&] { r.stream(w); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // One GET stream per session.
  Request get3 = Req("GET", "", {{"Accept", "text/event-stream"}, {"Mcp-Session-Id", sid}});
  EXPECT_EQ(endpoint_->Handle(get3).status, 409);
  Request del = Req("DELETE", "", {{"Mcp-Session-Id", sid}});
  EXPECT_EQ(endpoint_->Handle(del).status, 204);
  t.join();  // the stream ends with the session
  EXPECT_NE(w.data.find("id: 0"), std::string::npos);
}

TEST_F(McpEndpointTest, IdleSessionsExpire) {
  McpEndpointOptions o;
  o.session_idle_timeout_ms = 50;
  Make(o);
  std::string sid = Initialize();
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_EQ(Legacy(sid, "ping").status, 404);
}

TEST_F(McpEndpointTest, SessionsAreBoundedPerTenantAndInAll) {
  McpEndpointOptions o;
  o.max_sessions = 3;
  o.max_sessions_per_tenant = 2;
  Make(o);
  Initialize("a");
  Initialize("a");
  Response r = Post(json::object{{"jsonrpc", "2.0"},
                                 {"id", 1},
                                 {"method", "initialize"},
                                 {"params", json::object{{"protocolVersion", "2025-11-25"}}}},
                    {}, "a");
  EXPECT_EQ(r.status, 429) << r.body;
  Initialize("b");
  r = Post(json::object{{"jsonrpc", "2.0"},
                        {"id", 1},
                        {"method", "initialize"},
                        {"params", json::object{{"protocolVersion", "2025-11-25"}}}},
           {}, "c");
  EXPECT_EQ(r.status, 503) << r.body;
}

TEST_F(McpEndpointTest, CancelledNotificationStopsTheCallAndItGetsNoResponse) {
  std::string sid = Initialize();
  Response call;
  std::thread t([&] { call = Legacy(sid, "tools/call", {{"name", "slow"}}, "c1"); });
  for (int i = 0; i < 200 && !tools_->slow_started; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(tools_->slow_started);
  Response c =
      Legacy(sid, "notifications/cancelled", {{"requestId", "c1"}, {"reason", "x"}}, nullptr);
  EXPECT_EQ(c.status, 202);
  t.join();
  EXPECT_TRUE(tools_->slow_saw_cancel);
  EXPECT_EQ(call.status, 202);
  EXPECT_TRUE(call.body.empty()) << call.body;
}

TEST_F(McpEndpointTest, ProgressTokenAnswersAsSseWithProgressThenTheResult) {
  auto fx = NewConformanceFixtures();
  Make({}, fx);
  std::string sid = Initialize();
  json::object msg{{"jsonrpc", "2.0"},
                   {"id", 3},
                   {"method", "tools/call"},
                   {"params", json::object{{"name", "test_tool_with_progress"},
                                           {"_meta", json::object{{"progressToken", "p1"}}}}}};
  Response r =
      Post(msg, {{"Mcp-Session-Id", sid}, {"Accept", "application/json, text/event-stream"}});
  ASSERT_TRUE(r.stream) << r.body;
  FakeWriter w;
  r.stream(w);
  size_t p0 = w.data.find("\"progress\":0");
  size_t p100 = w.data.find("\"progress\":100");
  size_t result = w.data.find("\"result\"");
  ASSERT_NE(p0, std::string::npos) << w.data;
  ASSERT_NE(p100, std::string::npos) << w.data;
  ASSERT_NE(result, std::string::npos) << w.data;
  EXPECT_LT(p0, p100);
  EXPECT_LT(p100, result);
  EXPECT_NE(w.data.find("\"progressToken\":\"p1\""), std::string::npos);
}

// A client may reuse a request id as soon as it has the response. The server destroys a stream's
// function object only after it sent the last chunk, so the call's in-flight entry must be gone
// when the response is written, not when the stream is destroyed (CI saw 409 "a call with this
// id is already in progress" for a reused id).
TEST_F(McpEndpointTest, AStreamedCallsIdIsFreeOnceItsResponseIsWritten) {
  auto fx = NewConformanceFixtures();
  Make({}, fx);
  std::string sid = Initialize();
  std::vector<std::pair<std::string, std::string>> h{
      {"Mcp-Session-Id", sid}, {"Accept", "application/json, text/event-stream"}};
  json::object msg{{"jsonrpc", "2.0"},
                   {"id", 7},
                   {"method", "tools/call"},
                   {"params", json::object{{"name", "test_tool_with_progress"},
                                           {"_meta", json::object{{"progressToken", "p1"}}}}}};
  Response first = Post(msg, h);
  ASSERT_TRUE(first.stream) << first.body;
  FakeWriter w;
  first.stream(w);  // `first` (and its stream function) is still alive, as in the server
  ASSERT_NE(w.data.find("\"result\""), std::string::npos) << w.data;
  Response again = Post(msg, h);
  EXPECT_NE(again.status, 409) << again.body;
  ASSERT_TRUE(again.stream) << again.body;
  FakeWriter w2;
  again.stream(w2);
  EXPECT_NE(w2.data.find("\"result\""), std::string::npos) << w2.data;
}

TEST_F(McpEndpointTest, SilentLongCallsGetKeepAlivesOnTheirStream) {
  McpEndpointOptions o;
  o.keepalive_ms = 20;
  Make(o);
  std::string sid = Initialize();
  Response r = Post(json::object{{"jsonrpc", "2.0"},
                                 {"id", 3},
                                 {"method", "tools/call"},
                                 {"params", json::object{{"name", "slow"}}}},
                    {{"Mcp-Session-Id", sid}, {"Accept", "application/json, text/event-stream"}});
  ASSERT_TRUE(r.stream);
  FakeWriter w;
  std::thread t([&] { r.stream(w); });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  Response c = Legacy(sid, "notifications/cancelled", {{"requestId", 3}}, nullptr);
  EXPECT_EQ(c.status, 202);
  t.join();
  std::lock_guard<std::mutex> lock(w.mu);
  EXPECT_NE(w.data.find(": keep-alive"), std::string::npos) << w.data;
  EXPECT_EQ(w.data.find("\"result\""), std::string::npos);  // cancelled: no response
}

TEST_F(McpEndpointTest, LoggingToolSendsLogMessagesOnTheStream) {
  Make({}, NewConformanceFixtures());
  std::string sid = Initialize();
  Response r = Post(json::object{{"jsonrpc", "2.0"},
                                 {"id", 3},
                                 {"method", "tools/call"},
                                 {"params", json::object{{"name", "test_tool_with_logging"}}}},
                    {{"Mcp-Session-Id", sid}, {"Accept", "application/json, text/event-stream"}});
  ASSERT_TRUE(r.stream);
  FakeWriter w;
  r.stream(w);
  EXPECT_NE(w.data.find("notifications/message"), std::string::npos) << w.data;
}

// --- 2026-07-28 ---------------------------------------------------------------------------

TEST_F(McpEndpointTest, ModernDiscover) {
  Response r = Modern("server/discover");
  ASSERT_EQ(r.status, 200) << r.body;
  json::object b = Body(r);
  EXPECT_EQ(b["result"].at("resultType"), "complete");
  EXPECT_EQ(b["result"].at("supportedVersions").at(0), "2026-07-28");
  EXPECT_TRUE(b["result"].at("capabilities").as_object().contains("tools"));
  EXPECT_EQ(b["result"].at("_meta").at("io.modelcontextprotocol/serverInfo").at("name"), "esbd");
  bool has_session = false;
  for (const auto& [k, v] : r.headers) has_session |= k == "Mcp-Session-Id";
  EXPECT_FALSE(has_session);
}

TEST_F(McpEndpointTest, ModernMissingMetaFieldsAre400InvalidParams) {
  for (json::object meta :
       {json::object(),
        json::object{{"io.modelcontextprotocol/clientCapabilities", json::object()}},
        json::object{{"io.modelcontextprotocol/protocolVersion", "2026-07-28"}}}) {
    Response r = Modern("server/discover", {{"_meta", meta}});
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(Code(r), -32602);
    EXPECT_EQ(Body(r)["id"], 5);
  }
  Response r = Post(json::object{{"jsonrpc", "2.0"}, {"id", 9}, {"method", "server/discover"}},
                    {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "server/discover"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), -32602);
}

TEST_F(McpEndpointTest, ModernVersionHeaderRules) {
  // Header and _meta disagree: HeaderMismatch.
  Response r = Modern("server/discover", {{"_meta", ModernMeta("v999")}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), -32020);
  // Both name an unsupported version: UnsupportedProtocolVersion with the supported list.
  json::object params{{"_meta", ModernMeta("v999")}};
  r = Post(
      json::object{
          {"jsonrpc", "2.0"}, {"id", 4}, {"method", "server/discover"}, {"params", params}},
      {{"MCP-Protocol-Version", "v999"}, {"Mcp-Method", "server/discover"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), -32022);
  json::object data = Body(r)["error"].at("data").as_object();
  EXPECT_EQ(data["requested"], "v999");
  EXPECT_EQ(data["supported"].at(0), "2026-07-28");
}

TEST_F(McpEndpointTest, ModernMethodAndNameHeadersMustMatchTheBody) {
  EXPECT_EQ(Code(Modern("tools/list", {}, {}, false)), -32020);
  Response r = Modern("tools/list", {}, {{"Mcp-Method", "prompts/list"}}, false);
  EXPECT_EQ(Code(r), -32020);
  r = Modern("tools/list", {},
             {{"MCP-Protocol-Version", "2026-07-28"}, {"mcp-method", "  tools/list  "}}, false);
  EXPECT_EQ(r.status, 200) << r.body;
  r = Modern("tools/list", {},
             {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "TOOLS/LIST"}}, false);
  EXPECT_EQ(Code(r), -32020);
  r = Modern(
      "tools/call", {{"name", "echo"}},
      {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "tools/call"}, {"Mcp-Name", "fail"}},
      false);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), -32020);
}

TEST_F(McpEndpointTest, ModernUnknownAndRemovedMethodsAre404) {
  for (const char* m :
       {"initialize", "ping", "logging/setLevel", "resources/subscribe", "unknown/method"}) {
    Response r = Modern(m);
    EXPECT_EQ(r.status, 404) << m;
    EXPECT_EQ(Code(r), -32601) << m;
  }
}

TEST_F(McpEndpointTest, ModernListsCarryCachingHintsAndCallsResultType) {
  json::object b = Body(Modern("tools/list"));
  EXPECT_EQ(b["result"].at("resultType"), "complete");
  EXPECT_TRUE(b["result"].at("ttlMs").is_int64());
  EXPECT_EQ(b["result"].at("cacheScope"), "private");
  b = Body(Modern("tools/call", {{"name", "echo"}, {"arguments", json::object{{"a", "b"}}}}));
  EXPECT_EQ(b["result"].at("resultType"), "complete");
  EXPECT_EQ(b["result"].at("content").at(0).at("text"), "{\"a\":\"b\"}");
}

TEST_F(McpEndpointTest, ModernGetAndDeleteAre405) {
  Request get = Req("GET", "", {{"MCP-Protocol-Version", "2026-07-28"}});
  EXPECT_EQ(endpoint_->Handle(get).status, 405);
  Request del = Req("DELETE", "", {{"MCP-Protocol-Version", "2026-07-28"}});
  EXPECT_EQ(endpoint_->Handle(del).status, 405);
}

TEST_F(McpEndpointTest, ModernClientClosingTheStreamCancelsTheCall) {
  json::object params{{"name", "slow"}, {"_meta", [] {
                                           json::object m = ModernMeta();
                                           m["progressToken"] = 1;
                                           return m;
                                         }()}};
  Response r = Modern("tools/call", params, {{"Accept", "application/json, text/event-stream"}});
  ASSERT_TRUE(r.stream) << r.body;
  FakeWriter w;
  std::thread t([&] { r.stream(w); });
  for (int i = 0; i < 200 && !tools_->slow_started; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  w.gone = true;
  t.join();
  EXPECT_TRUE(tools_->slow_saw_cancel);
  EXPECT_EQ(w.data.find("\"result\""), std::string::npos);
}

TEST_F(McpEndpointTest, ModernMissingClientCapabilityIs32021) {
  Make({}, NewConformanceFixtures());
  Response r = Modern("tools/call", {{"name", "test_missing_capability"}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(Code(r), -32021);
  EXPECT_TRUE(
      Body(r)["error"].at("data").at("requiredCapabilities").as_object().contains("sampling"));
}

TEST_F(McpEndpointTest, ModernParamHeadersAreValidated) {
  Make({}, NewConformanceFixtures());
  json::object params{{"name", "test_custom_headers"},
                      {"arguments", json::object{{"region", "Hello"}}}};
  EXPECT_EQ(Code(Modern("tools/call", params)), -32020);  // header missing
  EXPECT_EQ(Code(Modern("tools/call", params, {{"Mcp-Param-Region", "=?base64?SGVsbG8?="}})),
            -32020);  // bad padding
  EXPECT_EQ(Code(Modern("tools/call", params, {{"Mcp-Param-Region", "=?base64?SGVs!!bG8=?="}})),
            -32020);
  EXPECT_EQ(Modern("tools/call", params, {{"Mcp-Param-Region", "=?base64?SGVsbG8=?="}}).status,
            200);
  EXPECT_EQ(Modern("tools/call", params, {{"Mcp-Param-Region", "Hello"}}).status, 200);
}

TEST_F(McpEndpointTest, ModernInputRequiredRoundTripsASignedRequestState) {
  Make({}, NewConformanceFixtures());
  const char* tool = "test_input_required_result_request_state";
  json::object b = Body(Modern("tools/call", {{"name", tool}}));
  ASSERT_EQ(b["result"].at("resultType"), "input_required") << json::serialize(b);
  EXPECT_TRUE(b["result"].at("inputRequests").as_object().contains("confirm"));
  std::string state(b["result"].at("requestState").as_string());
  json::object answers{
      {"confirm", json::object{{"action", "accept"}, {"content", json::object{{"ok", true}}}}}};
  b = Body(
      Modern("tools/call", {{"name", tool}, {"inputResponses", answers}, {"requestState", state}}));
  EXPECT_EQ(b["result"].at("resultType"), "complete") << json::serialize(b);
  EXPECT_NE(json::serialize(b).find("state-ok"), std::string::npos);
  // Without the state the tool asks again (it never trusts answers alone).
  b = Body(Modern("tools/call", {{"name", tool}, {"inputResponses", answers}}));
  EXPECT_EQ(b["result"].at("resultType"), "input_required");
  // An answer that is not an object is refused.
  Response r = Modern("tools/call", {{"name", tool},
                                     {"inputResponses", json::object{{"confirm", "yes"}}},
                                     {"requestState", state}});
  EXPECT_EQ(Code(r), -32602);
}

TEST_F(McpEndpointTest, TamperedOrForeignRequestStateIsRefused) {
  Make({}, NewConformanceFixtures());
  const char* tool = "test_input_required_result_tampered_state";
  json::object b = Body(Modern("tools/call", {{"name", tool}}));
  std::string state(b["result"].at("requestState").as_string());
  json::object answers{{"confirm", json::object{{"action", "accept"}}}};
  std::string forged = state;
  forged[0] = forged[0] == 'A' ? 'B' : 'A';
  Response r =
      Modern("tools/call", {{"name", tool}, {"inputResponses", answers}, {"requestState", forged}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), -32602);
  // A state made for one tool is not valid for another.
  r = Modern("tools/call", {{"name", "test_input_required_result_request_state"},
                            {"inputResponses", answers},
                            {"requestState", state}});
  EXPECT_EQ(Code(r), -32602);
  for (const char* junk : {"", ".", "x.y", "no-dot-at-all"}) {
    r = Modern("tools/call", {{"name", tool}, {"requestState", junk}});
    EXPECT_EQ(Code(r), -32602) << junk;
  }
}

TEST_F(McpEndpointTest, RequestStateReplayedOnAnotherHostedPathIsRefused) {
  Make({}, NewConformanceFixtures());
  const char* tool = "test_input_required_result_request_state";
  auto post = [&](const std::string& path, json::object params) {
    params["name"] = tool;
    params["_meta"] = ModernMeta();
    Request r = Req(
        "POST",
        json::serialize(json::object{
            {"jsonrpc", "2.0"}, {"id", 5}, {"method", "tools/call"}, {"params", params}}),
        {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "tools/call"}, {"Mcp-Name", tool}});
    r.path_ = r.target_ = path;
    return endpoint_->Handle(r);
  };
  // Minted for server x's tool, replayed on server y's tool of the same name and tenant.
  json::object b = Body(post("/environments/e1/mcp/x", {}));
  std::string state(b["result"].at("requestState").as_string());
  json::object answers{
      {"confirm", json::object{{"action", "accept"}, {"content", json::object{{"ok", true}}}}}};
  Response r =
      post("/environments/e1/mcp/y", {{"inputResponses", answers}, {"requestState", state}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(Code(r), -32602);
  // On its own path it holds.
  b = Body(post("/environments/e1/mcp/x", {{"inputResponses", answers}, {"requestState", state}}));
  EXPECT_EQ(b["result"].at("resultType"), "complete") << json::serialize(b);
  // A forged issue time (a fresh one on an old state) breaks the MAC.
  size_t dot = state.rfind('.'), dot2 = state.rfind('.', dot - 1);
  std::string later = state.substr(0, dot2 + 1) +
                      std::to_string(std::stoll(state.substr(dot2 + 1, dot - dot2 - 1)) + 1) +
                      state.substr(dot);
  EXPECT_EQ(
      Code(post("/environments/e1/mcp/x", {{"inputResponses", answers}, {"requestState", later}})),
      -32602);
}

TEST_F(McpEndpointTest, ExpiredRequestStateReplayIsRefused) {
  McpEndpointOptions o;
  o.request_state_ttl_ms = 200;
  Make(o, NewConformanceFixtures());
  const char* tool = "test_input_required_result_request_state";
  json::object b = Body(Modern("tools/call", {{"name", tool}}));
  std::string state(b["result"].at("requestState").as_string());
  json::object answers{
      {"confirm", json::object{{"action", "accept"}, {"content", json::object{{"ok", true}}}}}};
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  Response r =
      Modern("tools/call", {{"name", tool}, {"inputResponses", answers}, {"requestState", state}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(Code(r), -32602);
}

TEST_F(McpEndpointTest, InputRequestsNeedTheModernProtocol) {
  Make({}, NewConformanceFixtures());
  std::string sid = Initialize();
  json::object b =
      Body(Legacy(sid, "tools/call", {{"name", "test_input_required_result_elicitation"}}));
  EXPECT_EQ(b["result"].at("isError"), true) << json::serialize(b);
}

// --- Hostile input ------------------------------------------------------------------------

TEST_F(McpEndpointTest, DeeplyNestedJsonIsAParseError) {
  std::string deep(10000, '[');
  Request r = Req("POST", deep);
  Response a = endpoint_->Handle(r);
  EXPECT_EQ(a.status, 400);
  EXPECT_EQ(Code(a), -32700);
  std::string nested =
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"x\",\"params\":{\"a\":" + std::string(100, '[') +
      std::string(100, ']') + "}}";
  Request r2 = Req("POST", nested);
  EXPECT_EQ(Code(endpoint_->Handle(r2)), -32700);
}

TEST_F(McpEndpointTest, OversizedMessageIs413) {
  McpEndpointOptions o;
  o.max_message_bytes = 1000;
  Make(o);
  Request r = Req("POST", "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{\"x\":\"" +
                              std::string(2000, 'a') + "\"}}");
  EXPECT_EQ(endpoint_->Handle(r).status, 413);
}

TEST_F(McpEndpointTest, BatchesAndMalformedMessagesAreRefused) {
  struct Case {
    std::string body;
    int64_t code;
  } cases[] = {
      {"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}]", -32600},
      {"not json", -32700},
      {"\"a string\"", -32600},
      {"{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"ping\"}", -32600},
      {"{\"id\":1,\"method\":\"ping\"}", -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":1.5,\"method\":\"ping\"}", -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":{},\"method\":\"ping\"}", -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"ping\"}", -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":\"" + std::string(1000, 'x') + "\",\"method\":\"ping\"}",
       -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}", -32600},
      {"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":[1]}", -32602},
      {"{\"jsonrpc\":\"2.0\",\"id\":1}", -32600},
  };
  for (const Case& c : cases) {
    Request r = Req("POST", c.body);
    Response a = endpoint_->Handle(r);
    EXPECT_EQ(a.status, 400) << c.body.substr(0, 80);
    EXPECT_EQ(Code(a), c.code) << c.body.substr(0, 80);
  }
}

TEST_F(McpEndpointTest, DuplicateMethodKeyToFoolAGatewayIsRefused) {
  // A gateway reading the first "method" sees server/discover; esbd would read the last.
  const std::string meta = json::serialize(ModernMeta());
  std::vector<std::string> bodies = {
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"server/discover\",\"method\":\"tools/list\","
      "\"params\":{\"_meta\":" +
          meta + "}}",
      // In params (the tool's name) and deeper (the arguments a DLP gateway scans).
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"fail\","
      "\"name\":\"echo\",\"_meta\":" +
          meta + "}}",
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"echo\","
      "\"arguments\":{\"cmd\":\"ls\",\"c\\u006dd\":\"rm -rf /\"},\"_meta\":" +
          meta + "}}",
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"id\":2,\"method\":\"tools/list\",\"params\":{\"_meta\":" +
          meta + "}}",
  };
  for (const std::string& body : bodies) {
    Request r = Req("POST", body,
                    {{"MCP-Protocol-Version", "2026-07-28"},
                     {"Mcp-Method", "tools/list"},
                     {"Mcp-Name", "echo"}});
    Response a = endpoint_->Handle(r);
    EXPECT_EQ(a.status, 400) << body << " -> " << a.body;
    EXPECT_EQ(Code(a), -32600) << a.body;
    EXPECT_NE(a.body.find("duplicate key"), std::string::npos) << a.body;
  }
  // The same keys in different objects are fine.
  Request ok =
      Req("POST",
          "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\",\"params\":{\"_meta\":" + meta +
              ",\"x\":{\"method\":1}}}",
          {{"MCP-Protocol-Version", "2026-07-28"}, {"Mcp-Method", "tools/list"}});
  EXPECT_EQ(endpoint_->Handle(ok).status, 200) << ok.body_;
}

TEST_F(McpEndpointTest, DnsRebindingHostIsRefusedOnALoopbackListener) {
  const std::string body =
      "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\","
      "\"params\":{\"protocolVersion\":\"2025-11-25\"}}";
  // A rebinding page without an Origin (e.g. a same-origin GET) names itself in Host.
  for (const char* bad : {"evil.com", "evil.com:8080", "localhost.evil.com", "127.0.0.1.evil.com",
                          "10.0.0.1", "[::2]:80", "127.0.0.1:80@evil.com", "localhost:"}) {
    Request r = Req("POST", body, {{"Host", bad}});
    Response a = endpoint_->Handle(r);
    EXPECT_EQ(a.status, 403) << bad;
    Request g = Req("GET", "", {{"Host", bad}, {"Mcp-Session-Id", "x"}});
    EXPECT_EQ(endpoint_->Handle(g).status, 403) << bad;
  }
  // A second Host cannot hide behind a good first one.
  Request two = Req("POST", body, {{"Host", "127.0.0.1:4000"}, {"Host", "evil.com"}});
  EXPECT_EQ(endpoint_->Handle(two).status, 403);
  for (const char* ok : {"127.0.0.1:4000", "localhost", "LOCALHOST:1", "[::1]:4000", "127.9.9.9"}) {
    Request r = Req("POST", body, {{"Host", ok}});
    EXPECT_EQ(endpoint_->Handle(r).status, 200) << ok;
  }
  // Unix-socket clients are not browsers.
  Request unix_req = Req("POST", body, {{"Host", "evil.com"}});
  unix_req.peer_.is_loopback = false;
  unix_req.peer_.is_unix = true;
  EXPECT_EQ(endpoint_->Handle(unix_req).status, 200);
  // The hosts of allowed origins are accepted; on a public listener Host is not checked.
  McpEndpointOptions o;
  o.allowed_origins = {"https://app.example:8443"};
  Make(o);
  Request allowed = Req("POST", body, {{"Host", "app.example:8443"}});
  EXPECT_EQ(endpoint_->Handle(allowed).status, 200);
  Request other = Req("POST", body, {{"Host", "app.example"}});
  EXPECT_EQ(endpoint_->Handle(other).status, 403);
  o.loopback_listener = false;
  Make(o);
  Request pub = Req("POST", body, {{"Host", "esbd.example.org"}});
  EXPECT_EQ(endpoint_->Handle(pub).status, 200);
}

TEST_F(McpEndpointTest, NonJsonContentTypeIs415) {
  Request r = Req("POST", "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}");
  for (auto& [k, v] : r.headers_) {
    if (k == "Content-Type") v = "text/plain";
  }
  EXPECT_EQ(endpoint_->Handle(r).status, 415);
}

TEST_F(McpEndpointTest, CrossSiteOriginIs403) {
  Request r = Req("POST",
                  "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\","
                  "\"params\":{\"protocolVersion\":\"2025-11-25\"}}",
                  {{"Origin", "http://evil.example.com"}});
  EXPECT_EQ(endpoint_->Handle(r).status, 403);
  // A second Origin header cannot hide behind a good first one.
  Request r2 = Req("POST", r.body_,
                   {{"Origin", "http://localhost:3000"}, {"Origin", "http://evil.example.com"}});
  EXPECT_EQ(endpoint_->Handle(r2).status, 403);
  for (const char* ok : {"http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"}) {
    Request good = Req("POST", r.body_, {{"Origin", ok}});
    EXPECT_EQ(endpoint_->Handle(good).status, 200) << ok;
  }
  for (const char* bad : {"http://localhost.evil.com", "http://127.0.0.1.evil.com", "null",
                          "http://128.0.0.1", "file://", "http://localhost:"}) {
    Request b = Req("POST", r.body_, {{"Origin", bad}});
    EXPECT_EQ(endpoint_->Handle(b).status, 403) << bad;
  }
  McpEndpointOptions o;
  o.allowed_origins = {"https://app.example"};
  Make(o);
  Request allowed = Req("POST", r.body_, {{"Origin", "https://app.example"}});
  EXPECT_EQ(endpoint_->Handle(allowed).status, 200);
}

TEST_F(McpEndpointTest, UnauthenticatedRequestsAreRefused) {
  Request r = Req("POST", "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}", {}, "");
  EXPECT_EQ(endpoint_->Handle(r).status, 401);
}

TEST_F(McpEndpointTest, MergedProvidersListBothAndRouteCalls) {
  auto merged = MergeProviders(tools_, NewConformanceFixtures());
  auto list = merged->ListTools(Caller("t"));
  ASSERT_TRUE(list.ok());
  EXPECT_EQ((*list)[0].at("name"), "echo");
  bool has_fixture = false;
  for (const auto& t : *list) has_fixture |= t.at("name") == "test_simple_text";
  EXPECT_TRUE(has_fixture);
  tools::CallContext ctx{.caller = Caller("t")};
  auto r = merged->CallTool("test_simple_text", {}, ctx);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->content.at(0).at("text"), "This is a simple text response for testing.");
  EXPECT_TRUE(absl::IsNotFound(merged->CallTool("none", {}, ctx).status()));
}

}  // namespace
}  // namespace esb::api::mcp
