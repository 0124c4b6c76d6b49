// Tool-call audit rows and the tool catalogue through the real daemon (issue 14): rows written by
// the ToolCallGate (core/tools/tool_gate.h, the one path every tool call takes) into a daemon's
// state, then read back over HTTP with GET /audit?kind=tool; GET /tools serves the MCP view of
// sdk/tools.json.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "api/tools_catalog.h"
#include "core/audit.h"
#include "core/metrics.h"
#include "core/tools/tool_gate.h"
#include "governance/dlp/dlp_test_util.h"
#include "integration/daemon.h"
#include "storage/store.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

const std::string kConfig = TwoTenantsConfig();
const auto kGood = BearerAuth(kTenantKeyA);  // tenant "a"
const auto kEvil = BearerAuth(kTenantKeyB);  // tenant "b"

class ToolCallsApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    // A state made by a daemon (its schema), then rows written as esbd's gate writes them.
    ASSERT_TRUE(d_.Start({.config_json = kConfig}));
    const std::string state = d_.state_dir();
    d_.Stop();
    key_ = governance::dlp::testing::AwsKeyId();
    {
      auto store = Store::Open(state + "/esbd.db");
      ASSERT_TRUE(store.ok()) << store.status();
      Metrics metrics;
      AuditLog audit(store->get(), &metrics);
      tools::ToolCallGate gate(&audit, nullptr);  // the built-in DLP defaults
      auto call = [&](const char* tenant, const char* tool, const char* env, json::object args) {
        tools::CallContext ctx{Caller(tenant, "key_x", "mcp")};
        auto r = gate.Call({tool, "esbd", env}, args, ctx,
                           [](const json::object&) -> absl::StatusOr<tools::ToolResult> {
                             tools::ToolResult ok;
                             ok.content.push_back(json::object{{"type", "text"}, {"text", "ok"}});
                             return ok;
                           });
        ASSERT_TRUE(r.ok()) << r.status();
      };
      call("a", "execute_command", "env_a", {{"command", "ls"}});
      call("a", "execute_command", "env_a", {{"command", "export K=" + key_}});
      call("b", "list_environments", "", {});
    }  // closing the store writes everything queued
    ASSERT_TRUE(d2_.Start({.config_json = kConfig}, state));
  }
  void TearDown() override { d2_.StopAndCleanup(); }

  HttpResult Get(const std::string& target, const std::map<std::string, std::string>& who) {
    return d2_.Call("GET", target, nullptr, who);
  }
  static std::vector<std::string> Decisions(const HttpResult& r) {
    std::vector<std::string> out;
    for (const auto& e : r.obj().at("entries").as_array())
      out.emplace_back(e.at("tool_call").at("decision").as_string());
    return out;
  }

  Daemon d_, d2_;
  std::string key_;
};

TEST_F(ToolCallsApiTest, ToolRowsAreSearchableAndNeverHoldTheSecret) {
  HttpResult all = Get("/audit?kind=tool", kGood);
  ASSERT_EQ(all.status, 200) << all.body;
  EXPECT_EQ(Decisions(all), (std::vector<std::string>{"blocked", "allowed"}));
  EXPECT_EQ(all.body.find(key_), std::string::npos) << all.body;
  const json::object& blocked = all.obj().at("entries").at(0).as_object();
  EXPECT_EQ(blocked.at("action"), "tool.call");
  EXPECT_EQ(blocked.at("status"), 403);
  EXPECT_EQ(blocked.at("environment_id"), "env_a");
  EXPECT_EQ(blocked.at("principal"), "key_x");
  const json::object& t = blocked.at("tool_call").as_object();
  EXPECT_EQ(t.at("tool"), "execute_command");
  EXPECT_EQ(t.at("server"), "esbd");
  EXPECT_EQ(t.at("rule_ids"), (json::array{"dlp:aws_access_key"}));
  EXPECT_EQ(t.at("arguments"), R"({"command":"export K=[REDACTED:dlp:aws_access_key]"})");
  EXPECT_EQ(Decisions(Get("/audit?kind=tool&decision=blocked", kGood)),
            std::vector<std::string>{"blocked"});
  EXPECT_EQ(Decisions(Get("/audit?kind=tool&q=aws_access_key", kGood)),
            std::vector<std::string>{"blocked"});
  // The unfiltered log shows them too; egress searches do not.
  EXPECT_EQ(Get("/audit", kGood).obj().at("entries").as_array().size(), 2u);
  EXPECT_TRUE(Get("/audit?kind=egress", kGood).obj().at("entries").as_array().empty());
  for (const char* bad : {"/audit?kind=tools", "/audit?kind=tool&decision=opaque",
                          "/audit?kind=tool&decision=denied"}) {
    HttpResult r = Get(bad, kGood);
    EXPECT_EQ(r.status, 400) << bad << " " << r.body;
  }
}

TEST_F(ToolCallsApiTest, TenantsSeeOnlyTheirOwnToolRows) {
  HttpResult evil = Get("/audit?kind=tool", kEvil);
  ASSERT_EQ(evil.status, 200) << evil.body;
  ASSERT_EQ(evil.obj().at("entries").as_array().size(), 1u);
  EXPECT_EQ(evil.obj().at("entries").at(0).at("tool_call").at("tool"), "list_environments");
  EXPECT_TRUE(
      Get("/audit?kind=tool&q=aws_access_key", kEvil).obj().at("entries").as_array().empty());
}

TEST_F(ToolCallsApiTest, ToolsServesThePlannerFormatsAndTheMcpView) {
  HttpResult r = d2_.Call("GET", "/tools", nullptr, {});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.obj().at("mcp"), api::McpTools());
  EXPECT_EQ(r.obj().at("mcp").as_array().size(), 10u);
  EXPECT_EQ(r.obj().at("tools").as_array().size(), 4u);
  EXPECT_EQ(r.obj().at("openai").as_array().size(), 4u);
}

}  // namespace
}  // namespace esb::testing
