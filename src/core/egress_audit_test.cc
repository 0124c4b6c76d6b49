// core/audit.h RecordEgress (the one path egress rows take) and core/egress_report.h windows.
#include <gtest/gtest.h>

#include "core/audit.h"
#include "core/egress_report.h"
#include "core/metrics.h"
#include "storage/store.h"

namespace esb {
namespace {

constexpr int64_t kDay = 86'400'000;
constexpr int64_t kNov20 = 1795132800000;  // 2026-11-20T00:00:00Z, a Friday

TEST(ReportWindowTest, DailyIsTheUtcDay) {
  ReportWindow w = WindowFor(ReportPeriod::kDaily, kNov20 + 13 * 3600 * 1000);
  EXPECT_EQ(w.from_ms, kNov20);
  EXPECT_EQ(w.to_ms, kNov20 + kDay);
  w = WindowFor(ReportPeriod::kDaily, kNov20);
  EXPECT_EQ(w.from_ms, kNov20);
}

TEST(ReportWindowTest, WeeklyIsTheIsoWeekMondayToMonday) {
  const int64_t monday = kNov20 - 4 * kDay;  // 2026-11-16
  for (int64_t at : {monday, kNov20, monday + 7 * kDay - 1}) {
    ReportWindow w = WindowFor(ReportPeriod::kWeekly, at);
    EXPECT_EQ(w.from_ms, monday) << at;
    EXPECT_EQ(w.to_ms, monday + 7 * kDay) << at;
  }
  EXPECT_EQ(WindowFor(ReportPeriod::kWeekly, monday + 7 * kDay).from_ms, monday + 7 * kDay);
  // 1970-01-01 was a Thursday: its week began on Monday 1969-12-29.
  EXPECT_EQ(WindowFor(ReportPeriod::kWeekly, 0).from_ms, -3 * kDay);
}

TEST(ReportWindowTest, DatesAndPeriodsAreParsedStrictly) {
  EXPECT_EQ(*ParseReportDate("2026-11-20"), kNov20);
  for (const char* bad : {"2026-11-2", "2026/11/20", "2026-02-31", "20261120", "2026-11-20T00", "",
                          "abcd-ef-gh", "2026-13-01"}) {
    EXPECT_FALSE(ParseReportDate(bad).ok()) << bad;
  }
  EXPECT_EQ(ParseReportPeriod("weekly"), ReportPeriod::kWeekly);
  EXPECT_EQ(ParseReportPeriod("daily"), ReportPeriod::kDaily);
  EXPECT_FALSE(ParseReportPeriod("monthly").has_value());
}

TEST(EgressDecisionTest, NamesRoundTrip) {
  for (EgressDecision d :
       {EgressDecision::kAllowed, EgressDecision::kBlocked, EgressDecision::kRedacted,
        EgressDecision::kOpaque, EgressDecision::kError}) {
    EXPECT_EQ(ParseEgressDecision(ToString(d)), d);
  }
  EXPECT_FALSE(ParseEgressDecision("denied").has_value());
}

TEST(RecordEgressTest, StoresTheRowWithCredentialsMaskedAndCountsMetrics) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  Metrics metrics;
  AuditLog audit(store->get(), &metrics);
  EgressAuditRow row;
  row.time_ms = kNov20;
  row.tenant = "acme";
  row.environment_id = "env_1";
  row.intents = {"check-weather"};
  row.method = "POST";
  row.scheme = "https";
  row.host = "api.example";
  row.port = 443;
  row.path = "/v1/upload?access_token=SECRET-QUERY&x=1";
  row.status = 403;
  row.decision = EgressDecision::kBlocked;
  row.rule_ids = {"allow:api.example", "dlp:aws_access_key"};
  row.bytes_up = 100;
  row.added_latency_us = 300;
  row.request_headers =
      "Authorization: Bearer SECRET-BEARER\r\nCookie: sid=SECRET-COOKIE\nX-Api-Key:SECRET-KEY\n"
      "Content-Type: application/json\nSECRET-NOT-A-HEADER-LINE\n";
  row.body = "{\"k\":\"[REDACTED:dlp:aws_access_key]\"}";
  row.body_bytes = 40;
  row.body_sha256 = std::string(64, 'c');
  audit.RecordEgress(row);

  AuditQuery q;
  q.tenant = "acme";
  q.kind = "egress";
  auto rows = (*store)->QueryAudit(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  const AuditEntry& e = (*rows)[0];
  EXPECT_EQ(e.action, "egress");
  EXPECT_EQ(e.principal, "proxy");
  EXPECT_EQ(e.status, 403);
  ASSERT_TRUE(e.egress.has_value());
  EXPECT_EQ(e.egress->decision, "blocked");
  EXPECT_EQ(e.egress->path, "/v1/upload?access_token=[masked]&x=1");
  EXPECT_EQ(e.egress->headers,
            "Authorization: Bearer [masked]\nCookie: sid=[masked]\nX-Api-Key: [masked]\n"
            "Content-Type: application/json\n[masked]\n");
  for (const std::string& text : {e.detail, e.egress->headers, e.egress->path, e.egress->body}) {
    EXPECT_EQ(text.find("SECRET"), std::string::npos) << text;
  }
  EXPECT_EQ(e.egress->body_sha256, std::string(64, 'c'));

  const std::string m = metrics.Render({}, 0);
  EXPECT_NE(m.find("esb_egress_requests_total{decision=\"blocked\"} 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("esb_dlp_hits_total{rule=\"dlp:aws_access_key\"} 1\n"), std::string::npos);
  EXPECT_EQ(m.find("esb_dlp_hits_total{rule=\"allow:"), std::string::npos);
  EXPECT_NE(m.find("esb_egress_added_latency_seconds_bucket{le=\"0.0005\"} 1\n"),
            std::string::npos);
  EXPECT_NE(m.find("esb_egress_added_latency_seconds_bucket{le=\"0.00025\"} 0\n"),
            std::string::npos);
}

TEST(RecordEgressTest, ABodyTheProxyCutIsMarkedAsCut) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok());
  Metrics metrics;
  AuditLog audit(store->get(), &metrics);
  EgressAuditRow row;
  row.tenant = "acme";
  row.host = "x.test";
  row.body = "abc";
  row.body_truncated = true;
  audit.RecordEgress(row);
  row.body_truncated = false;
  row.host = "y.test";
  audit.RecordEgress(row);
  AuditQuery q;
  q.tenant = "acme";
  q.kind = "egress";
  auto rows = (*store)->QueryAudit(q);
  ASSERT_TRUE(rows.ok() && rows->size() == 2u);
  for (const AuditEntry& e : *rows) {
    EXPECT_EQ(e.egress->body, e.egress->host == "x.test" ? "abc…[truncated]" : "abc");
  }
}

TEST(RecordEgressTest, ARowWithoutATenantIsNotStoredAndIsCountedAsAnError) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok());
  Metrics metrics;
  AuditLog audit(store->get(), &metrics);
  EgressAuditRow row;
  row.host = "x.test";
  audit.RecordEgress(row);
  EXPECT_EQ(*(*store)->CountAudit(""), 0);
  EXPECT_NE(metrics.Render({}, 0).find("esb_errors_total{kind=\"audit\"} 1"), std::string::npos);
}

TEST(MetricsTest, DlpRuleLabelsAreEscapedAndBounded) {
  Metrics metrics;
  metrics.CountEgress("blocked", {"dlp:custom:a\"b\\c\nd"}, -1);
  for (int i = 0; i < 300; ++i)
    metrics.CountEgress("allowed", {"dlp:custom:r" + std::to_string(i)}, -1);
  const std::string m = metrics.Render({}, 0);
  EXPECT_NE(m.find("esb_dlp_hits_total{rule=\"dlp:custom:a\\\"b\\\\c\\nd\"} 1"), std::string::npos);
  EXPECT_NE(m.find("esb_dlp_hits_total{rule=\"other\"} 45"), std::string::npos);
  EXPECT_NE(m.find("esb_egress_added_latency_seconds_count 0"), std::string::npos)
      << "unknown latency (-1) is not observed";
}

}  // namespace
}  // namespace esb
