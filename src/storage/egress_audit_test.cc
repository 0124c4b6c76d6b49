// Egress audit rows (issue 12): schema v6 (audit_egress + egress_fts), the kind/decision/
// cursor filters of audit searches, and the report aggregation.
#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "storage/sqlite_store.h"
#include "storage/store.h"
#include "storage/store_test_util.h"

namespace esb {
namespace {

constexpr int64_t kDay = 86'400'000;
constexpr int64_t kNov20 = 1795132800000;  // 2026-11-20T00:00:00Z

using store_test::RawExec;
using store_test::RawQuery;
using store_test::TempDir;

AuditEntry Egress(const std::string& tenant, const std::string& env, int64_t t,
                  const std::string& host, const std::string& decision,
                  std::vector<std::string> rules, int64_t up, int64_t down,
                  const std::string& path = "/", const std::string& headers = "",
                  const std::string& body = "") {
  AuditEntry e;
  e.tenant = tenant;
  e.environment_id = env;
  e.time_ms = t;
  e.action = "egress";
  e.principal = "proxy";
  e.detail = absl::StrCat("GET ", host, path, " ", decision);
  e.status = decision == "blocked" ? 403 : 200;
  e.bytes = up + down;
  EgressFields& f = e.egress.emplace();
  f.method = "GET";
  f.scheme = "https";
  f.host = host;
  f.port = 443;
  f.path = path;
  f.decision = decision;
  f.rule_ids = std::move(rules);
  f.bytes_up = up;
  f.bytes_down = down;
  f.headers = headers;
  f.body = body;
  f.body_bytes = static_cast<int64_t>(body.size());
  f.intents = {"check-weather"};
  return e;
}

AuditEntry Api(const std::string& tenant, const std::string& env, int64_t t,
               const std::string& detail) {
  AuditEntry e;
  e.tenant = tenant;
  e.environment_id = env;
  e.time_ms = t;
  e.action = "execute";
  e.detail = detail;
  e.status = 200;
  return e;
}

std::unique_ptr<Store> Open(const std::string& path, StoreOptions o = {}) {
  auto s = Store::Open(path, o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::vector<std::string> Hosts(const std::vector<AuditEntry>& rows) {
  std::vector<std::string> out;
  for (const auto& r : rows) out.push_back(r.egress ? r.egress->host : "-" + r.action);
  return out;
}

class EgressAuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = Open(":memory:");
    ASSERT_NE(store_, nullptr);
    Add(Api("acme", "env_1", kNov20 + 1000, "pip install requests"));
    Add(Egress("acme", "env_1", kNov20 + 2000, "pypi.org", "allowed", {"allow:pypi.org"}, 300, 9000,
               "/simple/requests/", "User-Agent: pip/23\nAuthorization: Bearer [masked]\n"));
    Add(Egress("acme", "env_1", kNov20 + 3000, "evil.test", "blocked", {"not_allowed"}, 120, 0,
               "/exfil?data=1"));
    Add(Egress("acme", "env_2", kNov20 + 4000, "api.github.com", "blocked",
               {"allow:*.github.com", "dlp:github_token"}, 800, 0, "/gists", "",
               "{\"content\":\"[REDACTED:dlp:github_token] planted-marker\"}"));
    Add(Egress("acme", "env_2", kNov20 + 5000, "api.github.com", "redacted",
               {"allow:*.github.com", "dlp:email"}, 500, 700, "/user"));
    Add(Egress("globex", "env_9", kNov20 + 2500, "evil.test", "blocked", {"not_allowed"}, 1, 0));
  }
  void Add(const AuditEntry& e) { ASSERT_TRUE(store_->AppendAudit(e).ok()); }
  std::vector<AuditEntry> Query(AuditQuery q) {
    if (q.tenant.empty()) q.tenant = "acme";
    auto r = store_->QueryAudit(q);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::vector<AuditEntry>{};
  }
  std::unique_ptr<Store> store_;
};

TEST_F(EgressAuditTest, KindEgressListsOnlyEgressRowsWithTheirFields) {
  AuditQuery q;
  q.kind = "egress";
  auto rows = Query(q);
  EXPECT_EQ(Hosts(rows), (std::vector<std::string>{"api.github.com", "api.github.com", "evil.test",
                                                   "pypi.org"}));
  const EgressFields& f = *rows[3].egress;
  EXPECT_EQ(f.method, "GET");
  EXPECT_EQ(f.scheme, "https");
  EXPECT_EQ(f.port, 443);
  EXPECT_EQ(f.path, "/simple/requests/");
  EXPECT_EQ(f.decision, "allowed");
  EXPECT_EQ(f.rule_ids, std::vector<std::string>{"allow:pypi.org"});
  EXPECT_EQ(f.intents, std::vector<std::string>{"check-weather"});
  EXPECT_EQ(f.bytes_up, 300);
  EXPECT_EQ(f.bytes_down, 9000);
  EXPECT_EQ(rows[3].principal, "proxy");
  // Without kind: every row, the API's without egress fields.
  auto all = Query(AuditQuery{});
  ASSERT_EQ(all.size(), 5u);
  EXPECT_FALSE(all[4].egress.has_value());
}

TEST_F(EgressAuditTest, DecisionEnvironmentAndTimeFilters) {
  AuditQuery q;
  q.decision = "blocked";
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"api.github.com", "evil.test"}));
  q.environment_id = "env_1";
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"evil.test"}));
  AuditQuery t;
  t.kind = "egress";
  t.since_ms = kNov20 + 2500;
  t.until_ms = kNov20 + 4000;
  EXPECT_EQ(Hosts(Query(t)), (std::vector<std::string>{"api.github.com", "evil.test"}));
  AuditQuery bad;
  bad.tenant = "acme";
  bad.kind = "dns";
  EXPECT_EQ(store_->QueryAudit(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EgressAuditTest, KeywordSearchReachesHostPathHeadersAndBody) {
  AuditQuery q;
  q.kind = "egress";
  q.keyword = "\"evil.test\"";
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"evil.test"}));
  q.keyword = "exfil";  // path
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"evil.test"}));
  q.keyword = "pip";  // the User-Agent header
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"pypi.org"}));
  q.keyword = "\"planted-marker\"";  // the redacted body
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"api.github.com"}));
  q.keyword = "github AND planted";  // host and body of the same row
  EXPECT_EQ(Query(q).size(), 1u);
  q.keyword = "evil OR pypi";
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"evil.test", "pypi.org"}));
  // Without kind the same search also finds the API rows ("pip install requests").
  AuditQuery any;
  any.keyword = "pip";
  EXPECT_EQ(Query(any).size(), 2u);
}

TEST_F(EgressAuditTest, SearchIsTenantScoped) {
  AuditQuery q;
  q.tenant = "globex";
  q.kind = "egress";
  EXPECT_EQ(Hosts(Query(q)), (std::vector<std::string>{"evil.test"}));
  q.keyword = "pypi OR github OR planted";
  EXPECT_TRUE(Query(q).empty()) << "another tenant's hosts, headers and bodies are not found";
  q.tenant = "acme";
  q.keyword = "";
  q.environment_id = "env_9";  // globex's environment named by acme
  EXPECT_TRUE(Query(q).empty());
}

TEST_F(EgressAuditTest, CursorPagesThroughRowsOfTheSameMillisecond) {
  for (int i = 0; i < 5; ++i) {
    Add(Egress("acme", "env_3", kNov20 + 9000, absl::StrCat("h", i, ".test"), "allowed", {}, 1, 1));
  }
  AuditQuery q;
  q.environment_id = "env_3";
  q.limit = 2;
  std::vector<std::string> seen;
  for (int page = 0; page < 5; ++page) {
    auto rows = Query(q);
    for (const auto& r : rows) seen.push_back(r.egress->host);
    if (rows.size() < 2) break;
    q.before_time_ms = rows.back().time_ms;
    q.before_id = rows.back().id;
  }
  EXPECT_EQ(seen,
            (std::vector<std::string>{"h4.test", "h3.test", "h2.test", "h1.test", "h0.test"}));
}

TEST_F(EgressAuditTest, ReportAggregatesTheSeededRowsExactly) {
  Add(Egress("acme", "env_1", kNov20 + kDay + 10, "pypi.org", "allowed", {"allow:pypi.org"}, 10,
             20));  // the next day
  EgressReportQuery q;
  q.tenant = "acme";
  q.from_ms = kNov20;
  q.to_ms = kNov20 + kDay;
  auto r = store_->ReportEgress(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->totals.requests, 4);
  EXPECT_EQ(r->totals.allowed, 1);
  EXPECT_EQ(r->totals.blocked, 2);
  EXPECT_EQ(r->totals.redacted, 1);
  EXPECT_EQ(r->totals.opaque, 0);
  EXPECT_EQ(r->totals.bytes_up, 300 + 120 + 800 + 500);
  EXPECT_EQ(r->totals.bytes_down, 9000 + 700);
  ASSERT_EQ(r->environments.size(), 2u);
  EXPECT_EQ(r->environments[0].environment_id, "env_1");  // 2 rows each: by id
  EXPECT_EQ(r->environments[0].requests, 2);
  EXPECT_EQ(r->environments[0].blocked, 1);
  EXPECT_EQ(r->environments[1].environment_id, "env_2");
  EXPECT_EQ(r->environments[1].bytes_down, 700);
  // Blocks by rule: the permitting "allow:*.github.com" of the DLP-blocked row is not one.
  ASSERT_EQ(r->blocks_by_rule.size(), 2u);
  EXPECT_EQ(r->blocks_by_rule[0].key, "dlp:github_token");
  EXPECT_EQ(r->blocks_by_rule[0].count, 1);
  EXPECT_EQ(r->blocks_by_rule[1].key, "not_allowed");
  EXPECT_EQ(r->blocks_by_rule[1].count, 1);
  ASSERT_EQ(r->top_hosts.size(), 3u);
  EXPECT_EQ(r->top_hosts[0].host, "api.github.com");
  EXPECT_EQ(r->top_hosts[0].requests, 2);
  EXPECT_EQ(r->top_hosts[0].blocked, 1);
  EXPECT_EQ(r->top_hosts[0].bytes_up, 1300);
  EXPECT_EQ(r->top_hosts[1].host, "evil.test");
  EXPECT_EQ(r->top_hosts[2].host, "pypi.org");
  ASSERT_EQ(r->dlp_findings.size(), 2u);
  EXPECT_EQ(r->dlp_findings[0].key, "dlp:email");
  EXPECT_EQ(r->dlp_findings[1].key, "dlp:github_token");
  ASSERT_EQ(r->days.size(), 1u);
  EXPECT_EQ(r->days[0].day_start_ms, kNov20);
  EXPECT_EQ(r->days[0].requests, 4);

  // Two days, one environment; top_n bounds the lists.
  q.to_ms = kNov20 + 2 * kDay;
  q.environment_id = "env_1";
  q.top_n = 1;
  r = store_->ReportEgress(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->totals.requests, 3);
  EXPECT_EQ(r->totals.bytes_up, 430);
  ASSERT_EQ(r->top_hosts.size(), 1u);
  EXPECT_EQ(r->top_hosts[0].host, "pypi.org");
  EXPECT_EQ(r->top_hosts[0].requests, 2);
  ASSERT_EQ(r->days.size(), 2u);
  EXPECT_EQ(r->days[1].day_start_ms, kNov20 + kDay);
  EXPECT_EQ(r->days[1].requests, 1);
  EXPECT_TRUE(r->dlp_findings.empty());
}

TEST_F(EgressAuditTest, ReportIsTenantScopedAndValidated) {
  EgressReportQuery q;
  q.tenant = "globex";
  q.from_ms = kNov20;
  q.to_ms = kNov20 + kDay;
  auto r = store_->ReportEgress(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->totals.requests, 1);
  EXPECT_EQ(r->top_hosts.size(), 1u);
  q.environment_id = "env_1";  // acme's environment named by globex
  EXPECT_EQ(store_->ReportEgress(q)->totals.requests, 0);
  q.to_ms = q.from_ms;
  EXPECT_EQ(store_->ReportEgress(q).status().code(), absl::StatusCode::kInvalidArgument);
  q.to_ms = kNov20 + kDay;
  q.top_n = 0;
  EXPECT_EQ(store_->ReportEgress(q).status().code(), absl::StatusCode::kInvalidArgument);
  q.top_n = 10;
  q.tenant = "";
  EXPECT_EQ(store_->ReportEgress(q).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EgressAuditStoreTest, BodyAndHeadersAreCappedAndTheCutMarked) {
  auto store = Open(":memory:");
  const std::string body(100 * 1024, 'b');
  AuditEntry e = Egress("acme", "env_1", kNov20, "up.test", "allowed", {}, 1, 1, "/",
                        std::string(20 * 1024, 'h'), body);
  e.egress->body_sha256 = std::string(64, 'a');
  ASSERT_TRUE(store->AppendAudit(e).ok());
  AuditQuery q;
  q.tenant = "acme";
  q.kind = "egress";
  auto rows = store->QueryAudit(q);
  ASSERT_TRUE(rows.ok() && rows->size() == 1u);
  const EgressFields& f = *(*rows)[0].egress;
  EXPECT_EQ(f.body, std::string(kMaxEgressBodyBytes, 'b') + "…[truncated 36864 bytes]");
  EXPECT_EQ(f.body_bytes, 100 * 1024) << "the original size";
  EXPECT_EQ(f.body_sha256, std::string(64, 'a'));
  EXPECT_EQ(f.headers, std::string(kMaxEgressHeadersBytes, 'h') + "…[truncated 4096 bytes]");
}

TEST(EgressAuditStoreTest, ResultBodiesAreBoundedPerSearch) {
  auto store = Open(":memory:");
  const std::string body(kMaxEgressBodyBytes, 'x');
  const int n = static_cast<int>(kMaxAuditResultBodyBytes / kMaxEgressBodyBytes) + 3;
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(store
                    ->AppendAudit(Egress("acme", "e", kNov20 + i, "h.test", "allowed", {}, 1, 1,
                                         "/", "", body))
                    .ok());
  }
  AuditQuery q;
  q.tenant = "acme";
  q.limit = 1000;
  auto rows = store->QueryAudit(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), static_cast<size_t>(n));
  size_t total = 0, omitted = 0;
  for (const auto& r : *rows) {
    total += r.egress->body.size();
    omitted += r.egress->body_omitted ? 1 : 0;
  }
  EXPECT_LE(total, kMaxAuditResultBodyBytes);
  EXPECT_EQ(omitted, 3u);
}

// Egress rows have their own bucket: a pip install's hundreds of requests are all stored while
// the API's rows of the same tenant are rate limited, and the other way round.
TEST(EgressAuditStoreTest, EgressRowsHaveTheirOwnRateBucket) {
  StoreOptions o;
  o.write_behind_ms = 0;
  o.audit_rate_per_s = 0.001;
  o.audit_burst = 5;
  o.egress_rate_per_s = 0.001;
  o.egress_burst = 300;
  int64_t now = kNov20;
  o.now_ms = [&now] { return now; };
  auto store = Open(":memory:", o);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(store->AppendAudit(Api("acme", "e", now, "x")).ok());
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(store->AppendAudit(Egress("acme", "e", now, "h.test", "allowed", {}, 1, 1)).ok());
  }
  EXPECT_EQ(*store->CountAudit("acme"), 5 + 300);
  ASSERT_TRUE(store->AppendAudit(Egress("acme", "e", now, "h.test", "allowed", {}, 1, 1)).ok());
  EXPECT_EQ(*store->CountAudit("acme"), 305) << "the egress burst is spent";
}

TEST(EgressAuditStoreTest, RowCapAndRetentionDeleteTheSideRowsAndTheirIndex) {
  TempDir dir;
  const std::string path = dir.File("esb.db");
  StoreOptions o;
  o.write_behind_ms = 0;
  o.max_audit_rows_per_tenant = 10;
  int64_t now = kNov20;
  o.now_ms = [&now] { return now; };
  {
    auto store = Open(path, o);
    for (int i = 0; i < 30; ++i) {
      ASSERT_TRUE(store
                      ->AppendAudit(Egress("acme", "e", now + i, absl::StrCat("host", i, ".test"),
                                           "allowed", {}, 1, 1, "/", "", "bodymarker"))
                      .ok());
    }
    EXPECT_EQ(*store->CountAudit("acme"), 10);
    AuditQuery q;
    q.tenant = "acme";
    q.keyword = "host0";
    EXPECT_TRUE(store->QueryAudit(q)->empty()) << "the oldest rows are gone from the index too";
  }
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM audit_egress"), "10");
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM egress_fts WHERE egress_fts MATCH 'bodymarker'"),
            "10");
  {
    now += 31LL * kDay;  // past the default 30-day retention
    auto store = Open(path, o);
    ASSERT_TRUE(store->Maintain().ok());
    EXPECT_EQ(*store->CountAudit("acme"), 0);
  }
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM audit_egress"), "0");
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM egress_fts WHERE egress_fts MATCH 'bodymarker'"),
            "0");
  EXPECT_EQ(RawQuery(path, "PRAGMA integrity_check"), "ok");
}

// A tenant that sends 64 KiB bodies at the egress rate would store max_audit_rows_per_tenant ×
// 80 KiB; its stored headers and bodies have a budget instead, freed as rows go.
TEST(EgressAuditStoreTest, StoredBodiesHaveAPerTenantBudget) {
  StoreOptions o;
  o.write_behind_ms = 0;
  o.max_egress_stored_bytes_per_tenant = 100'000;
  o.max_audit_rows_per_tenant = 100;
  auto store = Open(":memory:", o);
  const std::string body(40'000, 'b');
  auto add = [&](const std::string& tenant, int i) {
    AuditEntry e = Egress(tenant, "e", kNov20 + i, absl::StrCat("h", i, ".test"), "allowed", {}, 1,
                          1, "/", "X-H: v\n", body);
    e.egress->body_sha256 = std::string(64, 'f');
    ASSERT_TRUE(store->AppendAudit(e).ok());
  };
  for (int i = 0; i < 3; ++i) add("acme", i);
  add("globex", 0);  // another tenant's budget is its own
  AuditQuery q;
  q.tenant = "acme";
  q.limit = 1000;
  auto rows = store->QueryAudit(q);
  ASSERT_TRUE(rows.ok() && rows->size() == 3u);
  EXPECT_EQ((*rows)[2].egress->body, body);
  EXPECT_EQ((*rows)[1].egress->body, body);
  EXPECT_EQ((*rows)[0].egress->body, kEgressBudgetFullMarker) << "the third is over 100 kB";
  EXPECT_EQ((*rows)[0].egress->headers, "");
  EXPECT_EQ((*rows)[0].egress->host, "h2.test") << "the row itself is kept";
  EXPECT_EQ((*rows)[0].egress->body_bytes, 40'000);
  EXPECT_EQ((*rows)[0].egress->body_sha256, std::string(64, 'f'));
  q.tenant = "globex";
  EXPECT_EQ((*store->QueryAudit(q))[0].egress->body, body);
  // Many small rows push the big ones out (row cap 100): the budget is free again.
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(
        store->AppendAudit(Egress("acme", "e", kNov20 + 100 + i, "s.test", "allowed", {}, 1, 1))
            .ok());
  }
  add("acme", 1000);
  q.tenant = "acme";
  q.limit = 1;
  EXPECT_EQ((*store->QueryAudit(q))[0].egress->body, body);
}

// A database written by the previous release (schema v4, audit rows already there) migrates
// to the latest schema: old rows stay searchable, egress rows are stored and found.
TEST(EgressAuditStoreTest, MigrationFromV4AddsTheEgressTables) {
  TempDir dir;
  const std::string path = dir.File("v4.db");
  ::close(::open(path.c_str(), O_CREAT | O_WRONLY, 0600));
  std::string sql =
      "CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT "
      "NULL); INSERT INTO schema_version VALUES (1, 4);";
  sql += MigrationSql(1);
  RawExec(path, sql);
  // v2 cuts old details with a function the store registers: v1 → v4 here without it.
  for (int v = 2; v <= 4; ++v) {
    std::string m = MigrationSql(v);
    const std::string cut =
        "UPDATE audit SET detail = esb_cap_detail(detail) WHERE "
        "esb_cap_detail(detail) != detail;";
    if (size_t at = m.find(cut); at != std::string::npos) m.erase(at, cut.size());
    RawExec(path, m);
  }
  RawExec(path,
          "INSERT INTO audit (time_ms, tenant, action, detail, principal) VALUES "
          "(1, 'acme', 'execute', 'old-row pip install', 'dev')");
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM sqlite_master WHERE name = 'audit_egress'"), "0");
  {
    auto store = Open(path);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(RawQuery(path, "SELECT version FROM schema_version"),
              std::to_string(LatestSchemaVersion()));
    AuditQuery q;
    q.tenant = "acme";
    q.keyword = "old";
    ASSERT_EQ(store->QueryAudit(q)->size(), 1u) << "old rows stay searchable";
    ASSERT_TRUE(store
                    ->AppendAudit(Egress("acme", "env_1", kNov20, "files.pythonhosted.org",
                                         "allowed", {"allow:*.pythonhosted.org"}, 5, 6))
                    .ok());
    q.keyword = "pythonhosted";
    q.kind = "egress";
    auto rows = store->QueryAudit(q);
    ASSERT_TRUE(rows.ok() && rows->size() == 1u);
    EXPECT_EQ((*rows)[0].egress->rule_ids, std::vector<std::string>{"allow:*.pythonhosted.org"});
    q.keyword = "";
    EXPECT_EQ(store->QueryAudit(q)->size(), 1u) << "the old execute row is not an egress row";
  }
  EXPECT_EQ(RawQuery(path, "PRAGMA integrity_check"), "ok");
}

}  // namespace
}  // namespace esb
