// `packages` for a governed environment (issue 12, docs/design.md "Host-side wheel cache"): the
// wheels esbd fetches on the host for such an environment are that environment's egress. A real
// esbd (with esb-proxy) and crun containers; the package index is egress/upstream.py's, reached
// only as https://pypi.test (--egress-resolve), so esbd itself could not fetch from it directly
// even if it tried: every page and wheel goes through the environment's proxy (policy, DLP,
// audit), and a host-cache hit is handed over only if the policy allows the index now.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

#include "integration/daemon.h"
#include "integration/egress/egress_rows.h"
#include "integration/egress/upstream.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

const std::vector<std::string> kNames = {"pypi.test", "other.test"};

// A field of an egress audit row: top level or under "egress".
std::string Field(const json::object& row, const char* key) {
  const json::value* v = nullptr;
  if (const json::value* e = row.if_contains("egress"); e && e->is_object())
    v = e->as_object().if_contains(key);
  if (v == nullptr) v = row.if_contains(key);
  if (v == nullptr) return "";
  return v->is_string() ? std::string(v->as_string()) : json::serialize(*v);
}

class WheelEgressTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Daemon::SkipReason().empty()) return;
    upstream_ = new EgressUpstream();
    setup_error_ = upstream_->Start(kNames);
    if (!setup_error_.empty()) return;
    daemon_ = new Daemon();
    Daemon::Options o;
    // The index by a name only the proxy can resolve (no DNS for pypi.test on the host).
    o.config_json = json::serialize(json::object{
        {"packages", json::object{{"index_url", "https://pypi.test:" + Port() + "/simple/"},
                                  {"timeout_seconds", 120}}}});
    o.extra_args = upstream_->ResolveArgs(kNames);
    o.extra_args.push_back("--egress-upstream-ca");
    o.extra_args.push_back(upstream_->root_ca());
    if (!daemon_->Start(o)) setup_error_ = "esbd did not start with the egress and packages flags";
  }
  static void TearDownTestSuite() {
    if (daemon_) daemon_->StopAndCleanup();
    delete daemon_;
    daemon_ = nullptr;
    delete upstream_;
    upstream_ = nullptr;
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_EQ(setup_error_, "") << (daemon_ ? daemon_->Log() : "");
  }

  static std::string Port() { return std::to_string(upstream_->port()); }
  static json::object Allow(const std::vector<std::string>& hosts) {
    json::array allow;
    for (const auto& h : hosts) allow.emplace_back(h);
    return json::object{{"mode", "allowlist"}, {"allow", allow}};
  }
  std::string Governed(const json::object& policy) {
    HttpResult r =
        daemon_->Call("POST", "/environments",
                      json::object{{"network", policy}, {"memory_mb", 512}, {"ttl_seconds", 600}});
    EXPECT_EQ(r.status, 201) << r.body << "\n" << daemon_->Log();
    return r.str("environment_id");
  }
  HttpResult Install(const std::string& env, const std::string& package, const std::string& code) {
    return daemon_->Call("POST", "/environments/" + env + "/run",
                         json::object{{"code", code}, {"packages", json::array{package.c_str()}}});
  }
  std::vector<json::object> Rows(
      const std::string& env, const EgressRowsReady& ready = [](const auto&) { return true; }) {
    return WaitForEgressRows(*daemon_, env, ready);
  }
  static std::function<bool(const std::vector<json::object>&)> Has(std::string path,
                                                                   std::string decision) {
    return [=](const std::vector<json::object>& rows) {
      for (const auto& row : rows)
        if (Field(row, "path").find(path) == 0 && Field(row, "decision") == decision) return true;
      return false;
    };
  }
  // How many requests the index answered whose path starts with `prefix`.
  static int IndexRequests(const std::string& prefix) {
    int n = 0;
    for (const json::object& row : upstream_->Requests())
      if (std::string(row.at("path").as_string()).rfind(prefix, 0) == 0) ++n;
    return n;
  }

  static Daemon* daemon_;
  static EgressUpstream* upstream_;
  static std::string setup_error_;
};
Daemon* WheelEgressTest::daemon_ = nullptr;
EgressUpstream* WheelEgressTest::upstream_ = nullptr;
std::string WheelEgressTest::setup_error_;

// (a) The policy allows the index: the install works, and every page and wheel esbd fetched
// for the environment is in the audit log as that environment's egress, decided "allowed".
TEST_F(WheelEgressTest, GovernedInstallGoesThroughTheEnvironmentsProxyAndIsAudited) {
  std::string env = Governed(Allow({"pypi.test"}));
  ASSERT_FALSE(env.empty());
  HttpResult r = Install(env, "esbtestpkg==1.0", "import esbtestpkg\nprint(esbtestpkg.hello())");
  ASSERT_EQ(r.status, 200) << r.body << "\n" << daemon_->Log();
  EXPECT_EQ(r.num("exit_code"), 0) << r.body;
  EXPECT_EQ(r.str("stdout"), "hello from esbtestpkg 1.0 with dep 1.1\n") << r.body;
  for (const char* path : {"/simple/esbtestpkg/", "/files/esbtestpkg-1.0-py3-none-any.whl",
                           "/simple/esbtestdep/", "/files/esbtestdep-1.1"}) {
    auto rows = Rows(env, Has(path, "allowed"));
    EXPECT_TRUE(Has(path, "allowed")(rows)) << path << " not audited for " << env;
  }
  auto rows = Rows(env, Has("/simple/esbtestpkg/", "allowed"));
  for (const auto& row : rows) {
    if (Field(row, "path") != "/simple/esbtestpkg/") continue;
    EXPECT_EQ(Field(row, "host"), "pypi.test");
    EXPECT_EQ(Field(row, "scheme"), "https") << "inspected TLS with the environment's CA";
  }
  // The index saw them over TLS for pypi.test (the proxy's upstream connection).
  bool tls = false;
  for (const json::object& row : upstream_->Requests())
    if (row.at("path").as_string() == "/simple/esbtestpkg/" && row.at("tls").as_bool()) tls = true;
  EXPECT_TRUE(tls);
}

// (b) The policy does not allow the index: a clear 4xx naming the rule, the index received
// nothing, and the refusal is an egress row of the environment ("blocked").
TEST_F(WheelEgressTest, PolicyNotAllowingTheIndexFailsNamingTheRuleAndTheIndexSeesNothing) {
  std::string env = Governed(Allow({"other.test"}));
  ASSERT_FALSE(env.empty());
  const int before = IndexRequests("/simple/esbtestextra/") + IndexRequests("/files/esbtestextra");
  HttpResult r = Install(env, "esbtestextra", "import esbtestextra");
  EXPECT_GE(r.status, 400) << r.body;
  EXPECT_LT(r.status, 500) << r.body;
  EXPECT_NE(r.body.find("pypi.test"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("not_allowed"), std::string::npos) << r.body;
  EXPECT_EQ(IndexRequests("/simple/esbtestextra/") + IndexRequests("/files/esbtestextra"), before)
      << "the index received a request the policy refused";
  auto rows = Rows(env, [](const std::vector<json::object>& rows) {
    for (const auto& row : rows)
      if (Field(row, "host") == "pypi.test" && Field(row, "decision") == "blocked") return true;
    return false;
  });
  bool blocked = false;
  for (const auto& row : rows)
    blocked =
        blocked || (Field(row, "host") == "pypi.test" && Field(row, "decision") == "blocked" &&
                    Field(row, "rule_ids").find("not_allowed") != std::string::npos);
  EXPECT_TRUE(blocked) << "no blocked egress row for " << env;
}

// (c) The host cache holds the wheel (another environment fetched it), then this
// environment's policy changes to deny the index: the cache hit is refused like a fetch would
// be, audited, and the index is not asked either.
TEST_F(WheelEgressTest, CacheHitAfterThePolicyChangedToDenyIsRefused) {
  std::string filler = Governed(Allow({"pypi.test"}));
  std::string env = Governed(Allow({"pypi.test"}));
  ASSERT_FALSE(filler.empty());
  ASSERT_FALSE(env.empty());
  HttpResult r = Install(filler, "esbtestdep", "import esbtestdep");
  ASSERT_EQ(r.status, 200) << r.body;
  HttpResult put =
      daemon_->Call("PUT", "/environments/" + env + "/network",
                    json::object{{"network", json::object{{"mode", "allowlist"},
                                                          {"allow", json::array{"pypi.test"}},
                                                          {"deny", json::array{"pypi.test"}}}}});
  ASSERT_EQ(put.status, 200) << put.body;
  const int before = IndexRequests("/");
  r = Install(env, "esbtestdep", "import esbtestdep");
  EXPECT_GE(r.status, 400) << r.body;
  EXPECT_LT(r.status, 500) << r.body;
  EXPECT_NE(r.body.find("deny:pypi.test"), std::string::npos) << r.body;
  EXPECT_EQ(IndexRequests("/"), before) << "a refused hit asks the index nothing";
  auto rows = Rows(env, [](const std::vector<json::object>& rows) {
    for (const auto& row : rows)
      if (Field(row, "decision") == "blocked" &&
          Field(row, "rule_ids").find("deny:pypi.test") != std::string::npos)
        return true;
    return false;
  });
  bool audited = false;
  for (const auto& row : rows)
    audited = audited || (Field(row, "decision") == "blocked" &&
                          Field(row, "rule_ids").find("deny:pypi.test") != std::string::npos);
  EXPECT_TRUE(audited) << "no blocked egress row for the refused cache hit of " << env;
  // Allowed again: the same hit is handed over (no new request to the index either).
  put = daemon_->Call("PUT", "/environments/" + env + "/network",
                      json::object{{"network", Allow({"pypi.test"})}});
  ASSERT_EQ(put.status, 200) << put.body;
  r = Install(env, "esbtestdep", "import esbtestdep\nprint(esbtestdep.VALUE)");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("stdout"), "dep 1.1\n") << r.body;
  EXPECT_EQ(IndexRequests("/"), before);
}

// Attack: a hostile index redirects esbd's fetch for a governed environment to an internal
// address (here: localhost, where the index itself listens). The redirect target is allowed
// by the policy and by packages.allowed_hosts, so only the proxy stands in the way: it
// resolves the name, refuses the loopback address, and nothing is requested there.
class WheelEgressRedirectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_EQ(upstream_.Start({"pypi.test"}), "");
    const std::string port = std::to_string(upstream_.port());
    Daemon::Options o;
    o.config_json = json::serialize(json::object{
        {"packages", json::object{{"index_url", "https://pypi.test:" + port +
                                                    "/redirect?code=302&to=https://localhost:" +
                                                    port + "/simple/"},
                                  {"allowed_hosts", json::array{("localhost:" + port).c_str()}}}}});
    o.extra_args = upstream_.ResolveArgs({"pypi.test"});
    o.extra_args.push_back("--egress-upstream-ca");
    o.extra_args.push_back(upstream_.root_ca());
    ASSERT_TRUE(daemon_.Start(o)) << daemon_.Log();
  }
  void TearDown() override { daemon_.StopAndCleanup(); }
  EgressUpstream upstream_;
  Daemon daemon_;
};

TEST_F(WheelEgressRedirectTest, RedirectToAPrivateAddressIsRefused) {
  HttpResult created = daemon_.Call(
      "POST", "/environments",
      json::object{{"network", json::object{{"mode", "allowlist"},
                                            {"allow", json::array{"pypi.test", "localhost"}}}},
                   {"memory_mb", 512},
                   {"ttl_seconds", 600}});
  ASSERT_EQ(created.status, 201) << created.body;
  const std::string env = created.str("environment_id");
  HttpResult r = daemon_.Call(
      "POST", "/environments/" + env + "/run",
      json::object{{"code", "import esbtestpkg"}, {"packages", json::array{"esbtestpkg"}}});
  EXPECT_GE(r.status, 400) << r.body;
  EXPECT_LT(r.status, 500) << r.body;
  EXPECT_NE(r.body.find("addr:private"), std::string::npos) << r.body;
  bool redirected = false;
  for (const json::object& row : upstream_.Requests()) {
    const std::string path(row.at("path").as_string());
    if (path.rfind("/redirect", 0) == 0) redirected = true;
    EXPECT_NE(path.rfind("/simple/", 0), 0u) << "the internal target was requested: " << path;
  }
  EXPECT_TRUE(redirected) << "the index's redirect was never fetched (test setup)";
}

}  // namespace
}  // namespace esb::testing
