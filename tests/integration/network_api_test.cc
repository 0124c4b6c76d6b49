// Egress governance surfaces (issue 12; docs/api.md "Network policy", "Intents") against the
// real daemon: `network` on create, GET/PUT .../network, the intents routes, "intent" on
// execute and run, GET .../ca.pem — bad input (400 with a message), the fixed-at-create rule
// (409), runtimes without egress (400), tenant isolation (404) and restart survival.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr const char* kKeyA = kTenantKeyA;
constexpr const char* kKeyB = kTenantKeyB;

// Two tenants and an intent catalogue (tenant b gets its own entry for "pip").
const std::string kConfig = TwoTenantsConfig(R"(
  "intents": {"check-weather": {"allow": ["weather.test", "*.weather.test"],
                                "max_ttl_seconds": 600, "description": "weather lookups"},
              "pip": {"allow": ["pypi.test"]}},
  "egress": {"default": {"deny": ["*.evil.test"]},
             "tenants": {"b": {"intents": {"pip": {"allow": ["mirror.b.test"]}}}}})");

json::object Policy(std::string_view text) { return json::parse(text).as_object(); }

class NetworkApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_TRUE(d_.Start({.config_json = kConfig})) << d_.Log();
    d_.api_key = kKeyA;
  }
  // Message of an error answer.
  static std::string Message(const HttpResult& r) { return r.str("message"); }
  HttpResult As(const char* key, const std::string& method, const std::string& target,
                const json::value& body = nullptr) {
    std::string saved = d_.api_key;
    d_.api_key = key;
    HttpResult r = d_.Call(method, target, body);
    d_.api_key = saved;
    return r;
  }
  // Creates an environment with a policy; "" and a skip reason when this daemon has no egress
  // proxy (a branch without the proxy plumbing): the governed tests then say so and skip.
  std::string CreateGoverned(const json::object& policy, std::string* skip) {
    HttpResult r = d_.Call("POST", "/environments", json::object{{"network", policy}});
    // A build without the egress plumbing (proxy supervision, the container driver's netns)
    // says so in its answer: these tests need it.
    if ((r.status == 503 && absl::StrContains(Message(r), "no egress proxy")) ||
        (r.status == 400 &&
         absl::StrContains(Message(r), "'container' runtime lacks the capability 'egress'"))) {
      *skip = absl::StrCat("this esbd cannot make governed environments yet: ", Message(r));
      return "";
    }
    EXPECT_EQ(r.status, 201) << r.body;
    return r.str("environment_id");
  }
  Daemon d_;
};

TEST_F(NetworkApiTest, NoneIsTheDefaultAndEveryNetworkRouteAnswersForIt) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty()) << d_.Log();
  HttpResult env = d_.Call("GET", "/environments/" + id);
  EXPECT_EQ(env.str("network"), "none") << env.body;
  const std::string base = "/environments/" + id;
  HttpResult net = d_.Call("GET", base + "/network");
  ASSERT_EQ(net.status, 200) << net.body;
  EXPECT_EQ(net.str("network"), "none");
  EXPECT_TRUE(net.obj().at("intents").as_array().empty());
  // "none" stays "none"; a policy cannot be added after create (the netns is made at create).
  EXPECT_EQ(d_.Call("PUT", base + "/network", json::object{{"network", "none"}}).status, 200);
  HttpResult put =
      d_.Call("PUT", base + "/network", json::object{{"network", Policy(R"({"mode": "open"})")}});
  EXPECT_EQ(put.status, 409) << put.body;
  EXPECT_TRUE(absl::StrContains(Message(put), "fixed at create")) << put.body;
  // Intents need a governed network.
  HttpResult act = d_.Call("POST", base + "/intents", json::object{{"intent", "pip"}});
  EXPECT_EQ(act.status, 409) << act.body;
  EXPECT_TRUE(absl::StrContains(Message(act), "network \"none\"")) << act.body;
  EXPECT_EQ(d_.Call("DELETE", base + "/intents/pip").status, 409);
  HttpResult exec =
      d_.Call("POST", base + "/execute", json::object{{"command", "echo ran"}, {"intent", "pip"}});
  EXPECT_EQ(exec.status, 409) << exec.body;
  // The catalogue is listed (tenant a: the daemon's).
  HttpResult list = d_.Call("GET", base + "/intents");
  ASSERT_EQ(list.status, 200) << list.body;
  EXPECT_TRUE(list.obj().at("intents").as_array().empty());
  const json::array& available = list.obj().at("available").as_array();
  ASSERT_EQ(available.size(), 2u) << list.body;
  EXPECT_EQ(available[0].as_object().at("intent"), "check-weather");
  EXPECT_EQ(available[0].as_object().at("max_ttl_seconds"), 600);
  EXPECT_EQ(available[1].as_object().at("allow").as_array()[0], "pypi.test");
  // Tenant b sees its own override of "pip".
  HttpResult id_b = As(kKeyB, "POST", "/environments", json::object{});
  ASSERT_EQ(id_b.status, 201) << id_b.body;
  HttpResult list_b = As(kKeyB, "GET", "/environments/" + id_b.str("environment_id") + "/intents");
  EXPECT_TRUE(absl::StrContains(list_b.body, "mirror.b.test")) << list_b.body;
  // No CA without a governed network.
  HttpResult ca = d_.Call("GET", base + "/ca.pem");
  EXPECT_EQ(ca.status, 404) << ca.body;
  EXPECT_TRUE(absl::StrContains(Message(ca), "no CA")) << ca.body;
}

TEST_F(NetworkApiTest, BadNetworkInputIs400WithAMessageNamingIt) {
  struct Case {
    json::value network;
    const char* message;
  } cases[] = {
      {json::value("open"), "'network' must be \"none\" or a policy object"},
      {json::value(5), "'network' must be \"none\" or a policy object"},
      {Policy(R"({"mode": "wide"})"), "network.mode must be one of: blocked, allowlist, open"},
      {Policy(R"({"allow": "a.test"})"), "network.allow must be an array"},
      {Policy(R"({"allow": ["ok.test", "*"]})"), "network.allow[1]: '*'"},
      {Policy(R"({"deny": ["*."]})"), "empty suffix"},
      {Policy(R"({"allow": ["a.*.test"]})"), "leading '*.'"},
      {Policy(R"({"allow": ["a.test:0"]})"), "port must be 1..65535"},
      {Policy(R"({"allow": ["127.1"]})"), "numeric"},
      {Policy(R"({"tls_inspect": "yes"})"), "network.tls_inspect must be true or false"},
      {Policy(R"({"max_body_bytes": -1})"), "network.max_body_bytes must be between"},
      {Policy(R"({"dlp": "on"})"), "network.dlp must be an object"},
      {Policy(R"({"allowlist": []})"), "unknown field 'network.allowlist'"},
  };
  for (const Case& c : cases) {
    HttpResult r = d_.Call("POST", "/environments", json::object{{"network", c.network}});
    EXPECT_EQ(r.status, 400) << json::serialize(c.network) << " -> " << r.body;
    EXPECT_TRUE(absl::StrContains(Message(r), c.message))
        << json::serialize(c.network) << " -> " << r.body;
  }
  // Limits: rule count and name lengths.
  json::array many;
  for (int i = 0; i <= 256; ++i) many.emplace_back(absl::StrCat("h", i, ".test"));
  HttpResult too_many =
      d_.Call("POST", "/environments", json::object{{"network", json::object{{"allow", many}}}});
  EXPECT_EQ(too_many.status, 400);
  EXPECT_TRUE(absl::StrContains(Message(too_many), "at most 256 rules")) << too_many.body;
  HttpResult long_label = d_.Call(
      "POST", "/environments",
      json::object{{"network", json::object{{"allow", json::array{std::string(64, 'a') + ".t"}}}}});
  EXPECT_EQ(long_label.status, 400);
  EXPECT_TRUE(absl::StrContains(Message(long_label), "label longer than 63")) << long_label.body;

  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  const std::string base = "/environments/" + id;
  HttpResult no_field = d_.Call("PUT", base + "/network", json::object{{"mode", "open"}});
  EXPECT_EQ(no_field.status, 400) << no_field.body;
  HttpResult empty_put = d_.Call("PUT", base + "/network", json::object{});
  EXPECT_EQ(empty_put.status, 400) << empty_put.body;
  EXPECT_TRUE(absl::StrContains(Message(empty_put), "'network' is required"));
  HttpResult bad_put =
      d_.Call("PUT", base + "/network", json::object{{"network", Policy(R"({"mode": 1})")}});
  EXPECT_EQ(bad_put.status, 400) << bad_put.body;
  HttpResult text_put = d_.Call("PUT", base + "/network", "not json");
  EXPECT_EQ(text_put.status, 400) << text_put.body;
  // Intents: missing name, bad name, TTL out of range, an unknown field.
  EXPECT_EQ(d_.Call("POST", base + "/intents", json::object{{"ttl_seconds", 5}}).status, 400);
  HttpResult bad_name =
      d_.Call("POST", base + "/intents", json::object{{"intent", "Check Weather"}});
  EXPECT_EQ(bad_name.status, 400);
  EXPECT_TRUE(absl::StrContains(Message(bad_name), "must start with [a-z0-9]")) << bad_name.body;
  HttpResult zero_ttl =
      d_.Call("POST", base + "/intents", json::object{{"intent", "pip"}, {"ttl_seconds", 0}});
  EXPECT_EQ(zero_ttl.status, 400) << zero_ttl.body;
  EXPECT_EQ(
      d_.Call("POST", base + "/intents", json::object{{"intent", "pip"}, {"until", 5}}).status,
      400);
  EXPECT_EQ(d_.Call("DELETE", base + "/intents/NOT_A_NAME").status, 400);
  HttpResult exec_bad =
      d_.Call("POST", base + "/execute", json::object{{"command", "true"}, {"intent", "bad name"}});
  EXPECT_EQ(exec_bad.status, 400) << exec_bad.body;
  // One-shot runs have no network: an intent there is a mistake.
  HttpResult run = d_.Call("POST", "/run", json::object{{"code", "1"}, {"intent", "pip"}});
  EXPECT_EQ(run.status, 400) << run.body;
  EXPECT_TRUE(absl::StrContains(Message(run), "needs an environment")) << run.body;
  // The daemon is still fine.
  EXPECT_EQ(d_.Call("GET", "/healthz").status, 200);
}

TEST_F(NetworkApiTest, RuntimesWithoutEgressRefuseAPolicyWithAClearMessage) {
  for (const char* runtime : {"nano", "gvisor"}) {
    HttpResult r = d_.Call(
        "POST", "/environments",
        json::object{{"runtime", runtime}, {"network", Policy(R"({"allow": ["pypi.test"]})")}});
    EXPECT_EQ(r.status, 400) << runtime << ": " << r.body;
    // Either the runtime is not installed here (its own 400), or it lacks egress.
    if (!absl::StrContains(Message(r), "not available")) {
      EXPECT_TRUE(absl::StrContains(Message(r), "lacks the capability 'egress'")) << r.body;
      EXPECT_TRUE(absl::StrContains(Message(r), "runtime 'container'")) << r.body;
    }
  }
  // "none" on the same runtimes is fine (nano shown; it has no network at all anyway).
  HttpResult nano =
      d_.Call("POST", "/environments", json::object{{"runtime", "nano"}, {"network", "none"}});
  EXPECT_TRUE(nano.status == 201 || absl::StrContains(Message(nano), "not available")) << nano.body;
}

TEST_F(NetworkApiTest, AnotherTenantsEnvironmentIsNotFoundOnEveryNetworkRoute) {
  std::string skip;
  std::string id = CreateGoverned(Policy(R"({"allow": ["pypi.test"]})"), &skip);
  if (id.empty() && !skip.empty()) id = d_.CreateEnv();  // the routes are the same for "none"
  ASSERT_FALSE(id.empty()) << d_.Log();
  const std::string base = "/environments/" + id;
  struct Call {
    std::string method, target;
    json::value body;
  } calls[] = {
      {"GET", base + "/network", nullptr},
      {"PUT", base + "/network", json::object{{"network", Policy(R"({"mode": "open"})")}}},
      {"POST", base + "/intents", json::object{{"intent", "pip"}}},
      {"GET", base + "/intents", nullptr},
      {"DELETE", base + "/intents/pip", nullptr},
      {"GET", base + "/ca.pem", nullptr},
      {"POST", base + "/execute", json::object{{"command", "true"}, {"intent", "pip"}}},
  };
  for (const Call& c : calls) {
    HttpResult r = As(kKeyB, c.method, c.target, c.body);
    EXPECT_EQ(r.status, 404) << c.method << " " << c.target << " -> " << r.body;
    EXPECT_FALSE(absl::StrContains(r.body, "pypi.test")) << r.body;
  }
  // Unchanged for its owner.
  HttpResult mine = d_.Call("GET", base + "/network");
  EXPECT_EQ(mine.status, 200);
  if (skip.empty()) EXPECT_EQ(mine.obj().at("network").as_object().at("mode"), "allowlist");
}

TEST_F(NetworkApiTest, GovernedEnvironmentPolicyIntentsAndCaSurviveARestart) {
  std::string skip;
  std::string id =
      CreateGoverned(Policy(R"({"allow": ["pypi.test", "*.pythonhosted.test:443"]})"), &skip);
  if (id.empty() && !skip.empty()) GTEST_SKIP() << skip;
  ASSERT_FALSE(id.empty()) << d_.Log();
  const std::string base = "/environments/" + id;
  // The environment object shows the policy, laid over the daemon default (deny *.evil.test).
  HttpResult env = d_.Call("GET", base);
  const json::object& policy = env.obj().at("network").as_object();
  EXPECT_EQ(policy.at("mode"), "allowlist");
  EXPECT_EQ(json::serialize(policy.at("allow")), R"(["pypi.test","*.pythonhosted.test:443"])");
  EXPECT_EQ(json::serialize(policy.at("deny")), R"(["*.evil.test"])") << "the daemon default";
  // The CA.
  HttpResult ca = d_.Call("GET", base + "/ca.pem");
  ASSERT_EQ(ca.status, 200) << ca.body;
  EXPECT_TRUE(absl::StartsWith(ca.body, "-----BEGIN CERTIFICATE-----")) << ca.body;
  EXPECT_EQ(ca.headers["content-type"], "application/x-pem-file");
  // Live change.
  HttpResult put = d_.Call("PUT", base + "/network",
                           json::object{{"network", Policy(R"({"mode": "open", "deny": []})")}});
  ASSERT_EQ(put.status, 200) << put.body;
  EXPECT_EQ(put.obj().at("network").as_object().at("mode"), "open");
  HttpResult to_none = d_.Call("PUT", base + "/network", json::object{{"network", "none"}});
  EXPECT_EQ(to_none.status, 409) << to_none.body;
  EXPECT_TRUE(absl::StrContains(Message(to_none), "\"mode\": \"blocked\"")) << to_none.body;
  // Intents: several at once, re-activation extends, unknown → 400, TTL above the intent's max.
  HttpResult a1 = d_.Call("POST", base + "/intents",
                          json::object{{"intent", "check-weather"}, {"ttl_seconds", 300}});
  ASSERT_EQ(a1.status, 200) << a1.body;
  HttpResult a2 = d_.Call("POST", base + "/intents", json::object{{"intent", "pip"}});
  ASSERT_EQ(a2.status, 200) << a2.body;
  EXPECT_EQ(a2.obj().at("intents").as_array().size(), 2u) << a2.body;
  HttpResult extend = d_.Call("POST", base + "/intents",
                              json::object{{"intent", "check-weather"}, {"ttl_seconds", 600}});
  ASSERT_EQ(extend.status, 200);
  EXPECT_GT(
      extend.obj().at("intents").as_array()[0].as_object().at("expires_in_seconds").as_int64(),
      500);
  HttpResult unknown = d_.Call("POST", base + "/intents", json::object{{"intent", "nope"}});
  EXPECT_EQ(unknown.status, 400);
  EXPECT_TRUE(absl::StrContains(Message(unknown), "check-weather, pip")) << unknown.body;
  HttpResult over = d_.Call("POST", base + "/intents",
                            json::object{{"intent", "check-weather"}, {"ttl_seconds", 601}});
  EXPECT_EQ(over.status, 400);
  EXPECT_TRUE(absl::StrContains(Message(over), "1..600")) << over.body;
  EXPECT_EQ(d_.Call("DELETE", base + "/intents/pip").status, 200);
  EXPECT_EQ(d_.Call("DELETE", base + "/intents/pip").status, 404);
  // Per call: active during the call only.
  HttpResult exec =
      d_.Call("POST", base + "/execute", json::object{{"command", "echo ok"}, {"intent", "pip"}});
  EXPECT_EQ(exec.status, 200) << exec.body;
  HttpResult after = d_.Call("GET", base + "/intents");
  ASSERT_EQ(after.obj().at("intents").as_array().size(), 1u) << after.body;
  EXPECT_EQ(after.obj().at("intents").as_array()[0].as_object().at("intent"), "check-weather");
  // Every change audited.
  HttpResult audit = d_.Call("GET", "/audit?environment_id=" + id + "&limit=50");
  for (const char* action : {"network.update", "network.intent.activate",
                             "network.intent.deactivate", "network.intent.call"})
    EXPECT_TRUE(absl::StrContains(audit.body, action)) << action << ": " << audit.body;

  // Restart: the policy, the intent with its expiry and the CA come back.
  std::string state = d_.state_dir();
  d_.Stop();
  Daemon d2;
  ASSERT_TRUE(d2.Start({.config_json = kConfig}, state)) << d2.Log();
  d2.api_key = kKeyA;
  HttpResult net = d2.Call("GET", base + "/network");
  ASSERT_EQ(net.status, 200) << net.body;
  EXPECT_EQ(net.obj().at("network").as_object().at("mode"), "open");
  ASSERT_EQ(net.obj().at("intents").as_array().size(), 1u) << net.body;
  EXPECT_EQ(net.obj().at("intents").as_array()[0].as_object().at("intent"), "check-weather");
  HttpResult ca2 = d2.Call("GET", base + "/ca.pem");
  EXPECT_EQ(ca2.body, ca.body) << "the same CA";
  d2.StopAndCleanup();
}

}  // namespace
}  // namespace esb::testing
