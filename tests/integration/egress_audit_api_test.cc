// Egress audit rows through the real daemon (issue 12): rows recorded with the core's one
// egress audit path (AuditLog::RecordEgress, as esbd does for the proxy's events) into a
// daemon's state, then read back over HTTP with GET /audit?kind=egress and GET /reports.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "core/audit.h"
#include "core/metrics.h"
#include "integration/daemon.h"
#include "storage/store.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

const std::string kConfig = TwoTenantsConfig();
const auto kGood = BearerAuth(kTenantKeyA);  // tenant "a"
const auto kEvil = BearerAuth(kTenantKeyB);  // tenant "b"

EgressAuditRow Row(const std::string& tenant, int64_t t, const std::string& env,
                   const std::string& host, EgressDecision d, std::vector<std::string> rules,
                   int status, int64_t up, int64_t down) {
  EgressAuditRow r;
  r.time_ms = t;
  r.tenant = tenant;
  r.environment_id = env;
  r.method = "POST";
  r.scheme = "https";
  r.host = host;
  r.port = 443;
  r.path = "/upload";
  r.status = status;
  r.decision = d;
  r.rule_ids = std::move(rules);
  r.bytes_up = up;
  r.bytes_down = down;
  r.duration_ms = 5;
  r.added_latency_us = 250;
  return r;
}

class EgressAuditApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_TRUE(d_.Start({.config_json = kConfig}));
    const std::string state = d_.state_dir();
    d_.Stop();
    t_ = NowUnixMs() - 60'000;
    day_ = FormatRfc3339(t_).substr(0, 10);
    {
      auto store = Store::Open(state + "/esbd.db");
      ASSERT_TRUE(store.ok()) << store.status();
      Metrics metrics;
      AuditLog audit(store->get(), &metrics);
      EgressAuditRow a = Row("a", t_, "env_a", "pypi.org", EgressDecision::kAllowed,
                             {"allow:pypi.org"}, 200, 300, 9000);
      a.request_headers = "Authorization: Bearer SECRET-TOKEN-1\nUser-Agent: pip/23.0\n";
      audit.RecordEgress(a);
      audit.RecordEgress(Row("a", t_ + 1, "env_a", "evil.test", EgressDecision::kBlocked,
                             {"not_allowed"}, 403, 120, 0));
      EgressAuditRow c = Row("a", t_ + 2, "env_b", "api.github.com", EgressDecision::kBlocked,
                             {"allow:*.github.com", "dlp:github_token"}, 403, 800, 0);
      c.body = "{\"token\":\"[REDACTED:dlp:github_token]\",\"note\":\"plantedmarker\"}";
      c.body_bytes = 70;
      c.body_sha256 = std::string(64, 'e');
      audit.RecordEgress(c);
      audit.RecordEgress(Row("a", t_ + 3, "env_b", "<script>alert(1)</script>",
                             EgressDecision::kBlocked, {"not_allowed"}, 403, 10, 0));
      audit.RecordEgress(Row("b", t_ + 4, "env_x", "evil-only.test", EgressDecision::kAllowed,
                             {"mode:open"}, 200, 1, 2));
    }  // closing the store writes everything queued
    ASSERT_TRUE(d2_.Start({.config_json = kConfig}, state));
  }
  void TearDown() override { d2_.StopAndCleanup(); }

  HttpResult Get(const std::string& target, const std::map<std::string, std::string>& who) {
    return d2_.Call("GET", target, nullptr, who);
  }
  static std::vector<std::string> Hosts(const HttpResult& r) {
    std::vector<std::string> out;
    for (const auto& e : r.obj().at("entries").as_array())
      out.emplace_back(e.as_object().at("egress").as_object().at("host").as_string());
    return out;
  }

  Daemon d_, d2_;
  int64_t t_ = 0;
  std::string day_;
};

TEST_F(EgressAuditApiTest, RecordedRowsAreSearchableByKindDecisionKeywordAndEnvironment) {
  HttpResult all = Get("/audit?kind=egress", kGood);
  ASSERT_EQ(all.status, 200) << all.body;
  EXPECT_EQ(Hosts(all), (std::vector<std::string>{"<script>alert(1)</script>", "api.github.com",
                                                  "evil.test", "pypi.org"}));
  EXPECT_EQ(all.body.find("SECRET-TOKEN-1"), std::string::npos) << "credentials are masked";
  const json::object& pypi =
      all.obj().at("entries").as_array()[3].as_object().at("egress").as_object();
  EXPECT_EQ(pypi.at("request_headers").as_string(),
            "Authorization: Bearer [masked]\nUser-Agent: pip/23.0\n");
  EXPECT_EQ(pypi.at("decision").as_string(), "allowed");
  EXPECT_EQ(pypi.at("bytes_down").as_int64(), 9000);
  EXPECT_EQ(all.obj().at("entries").as_array()[3].as_object().at("principal").as_string(), "proxy");

  EXPECT_EQ(Hosts(Get("/audit?kind=egress&decision=blocked", kGood)).size(), 3u);
  EXPECT_EQ(Hosts(Get("/audit?kind=egress&q=plantedmarker", kGood)),
            std::vector<std::string>{"api.github.com"});
  EXPECT_EQ(Hosts(Get("/audit?kind=egress&environment_id=env_a&decision=blocked", kGood)),
            std::vector<std::string>{"evil.test"});
  const std::string from = FormatRfc3339(t_ + 1), to = FormatRfc3339(t_ + 2);
  EXPECT_EQ(Hosts(Get("/audit?kind=egress&from=" + from + "&to=" + to, kGood)),
            (std::vector<std::string>{"api.github.com", "evil.test"}));

  // Pages: two rows, then the other two by next_cursor, then nothing more.
  HttpResult p1 = Get("/audit?kind=egress&limit=2", kGood);
  ASSERT_EQ(p1.status, 200) << p1.body;
  ASSERT_TRUE(p1.obj().at("next_cursor").is_string());
  HttpResult p2 = Get(
      "/audit?kind=egress&limit=2&cursor=" + std::string(p1.obj().at("next_cursor").as_string()),
      kGood);
  EXPECT_EQ(Hosts(p2), (std::vector<std::string>{"evil.test", "pypi.org"}));

  for (const char* bad :
       {"/audit?kind=dns", "/audit?kind=egress&decision=denied", "/audit?kind=egress&cursor=abc",
        "/audit?kind=egress&from=yesterday", "/audit?kind=egress&q=host:evil"}) {
    HttpResult r = Get(bad, kGood);
    EXPECT_EQ(r.status, 400) << bad << " " << r.body;
  }
}

TEST_F(EgressAuditApiTest, TenantsSeeOnlyTheirOwnEgressRowsAndReports) {
  EXPECT_EQ(Hosts(Get("/audit?kind=egress", kEvil)), std::vector<std::string>{"evil-only.test"});
  EXPECT_TRUE(
      Hosts(Get("/audit?kind=egress&q=pypi%20OR%20github%20OR%20plantedmarker", kEvil)).empty());
  EXPECT_TRUE(Hosts(Get("/audit?kind=egress&environment_id=env_a", kEvil)).empty());
  HttpResult r = Get("/reports?period=weekly&date=" + day_, kEvil);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.obj().at("totals").as_object().at("requests").as_int64(), 1);
  EXPECT_EQ(r.body.find("pypi"), std::string::npos);
}

TEST_F(EgressAuditApiTest, ReportsAggregateTheRecordedRows) {
  HttpResult r = Get("/reports?period=daily&format=json&date=" + day_, kGood);
  ASSERT_EQ(r.status, 200) << r.body;
  const json::object& totals = r.obj().at("totals").as_object();
  EXPECT_EQ(totals.at("requests").as_int64(), 4);
  EXPECT_EQ(totals.at("allowed").as_int64(), 1);
  EXPECT_EQ(totals.at("blocked").as_int64(), 3);
  EXPECT_EQ(totals.at("bytes_up").as_int64(), 300 + 120 + 800 + 10);
  EXPECT_EQ(totals.at("bytes_down").as_int64(), 9000);
  EXPECT_EQ(r.str("period"), "daily");
  EXPECT_EQ(r.str("from"), day_ + "T00:00:00.000Z");
  const json::array& rules = r.obj().at("blocks_by_rule").as_array();
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].as_object().at("rule").as_string(), "not_allowed");
  EXPECT_EQ(rules[0].as_object().at("count").as_int64(), 2);
  EXPECT_EQ(rules[1].as_object().at("rule").as_string(), "dlp:github_token");
  const json::array& dlp = r.obj().at("dlp_findings").as_array();
  ASSERT_EQ(dlp.size(), 1u);
  EXPECT_EQ(dlp[0].as_object().at("count").as_int64(), 1);
  EXPECT_EQ(r.obj().at("environments").as_array().size(), 2u);
  EXPECT_EQ(r.obj().at("top_hosts").as_array().size(), 4u);

  HttpResult env = Get("/reports?environment_id=env_b&date=" + day_, kGood);
  ASSERT_EQ(env.status, 200) << env.body;
  EXPECT_EQ(env.obj().at("totals").as_object().at("requests").as_int64(), 2);

  HttpResult csv = Get("/reports?period=daily&format=csv&date=" + day_, kGood);
  ASSERT_EQ(csv.status, 200) << csv.body;
  EXPECT_EQ(csv.headers["content-type"], "text/csv; charset=utf-8");
  EXPECT_EQ(csv.body.rfind("section,name,requests,allowed,blocked,redacted,opaque,errors,"
                           "bytes_up,bytes_down\r\ntotal,,4,1,3,0,0,0,1230,9000\r\n",
                           0),
            0u)
      << csv.body;
  EXPECT_NE(csv.body.find("blocked_rule,not_allowed,2,,2,,,,,\r\n"), std::string::npos);

  HttpResult html = Get("/reports?period=weekly&format=html&date=" + day_, kGood);
  ASSERT_EQ(html.status, 200) << html.body;
  EXPECT_EQ(html.headers["content-type"], "text/html; charset=utf-8");
  EXPECT_EQ(html.headers["content-security-policy"],
            "default-src 'none'; style-src 'unsafe-inline'");
  EXPECT_EQ(html.body.find("<script"), std::string::npos) << "a host named <script> is escaped";
  EXPECT_NE(html.body.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);

  for (const char* bad : {"/reports?period=monthly", "/reports?format=pdf",
                          "/reports?date=2026-02-31", "/reports?top=0", "/reports?env=env_a"}) {
    HttpResult b = Get(bad, kGood);
    EXPECT_EQ(b.status, 400) << bad << " " << b.body;
  }
  EXPECT_EQ(Get("/reports", {}).status, 401) << "reports need a key like every tenant route";
}

}  // namespace
}  // namespace esb::testing
