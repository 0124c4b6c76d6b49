#include "api/report_render.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>

namespace esb::api {
namespace {

constexpr int64_t kNov20 = 1795132800000;  // 2026-11-20T00:00:00Z

// A report as the store would return it, with attacker-chosen hosts and rule ids.
EgressReport Hostile() {
  EgressReport r;
  r.totals = {"", 5, 2, 2, 1, 0, 0, 1000, 2000};
  r.environments = {{"env_1", 5, 2, 2, 1, 0, 0, 1000, 2000}};
  r.top_hosts = {{"<script>alert(1)</script>", 3, 1, 10, 20},
                 {"a,b\"c\nd", 1, 1, 1, 2},
                 {"=HYPERLINK(\"http://x\")", 1, 0, 0, 0}};
  r.blocks_by_rule = {{"deny:<img src=x onerror=alert(1)>", 2}};
  r.dlp_findings = {{"dlp:credit_card", 1}};
  r.days = {{kNov20, 5, 2, 1000, 2000}};
  return r;
}

ReportMeta Meta() {
  return ReportMeta{"acme<&>", "daily", "", kNov20, kNov20 + 86400000, kNov20 + 3600000};
}

TEST(ReportRenderTest, CsvCellsAreQuotedAndFormulasNeutralised) {
  EXPECT_EQ(CsvCell("plain.host"), "plain.host");
  EXPECT_EQ(CsvCell("a,b"), "\"a,b\"");
  EXPECT_EQ(CsvCell("say \"hi\""), "\"say \"\"hi\"\"\"");
  EXPECT_EQ(CsvCell("line\nbreak"), "\"line\nbreak\"");
  EXPECT_EQ(CsvCell("=1+2"), "'=1+2");
  EXPECT_EQ(CsvCell("@SUM(A1)"), "'@SUM(A1)");
  EXPECT_EQ(CsvCell("-cmd"), "'-cmd");
  EXPECT_EQ(CsvCell("+x,y"), "\"'+x,y\"");
  EXPECT_EQ(CsvCell("a\x1b[2Jb"), "a\xEF\xBF\xBD[2Jb") << "no terminal escapes";
}

TEST(ReportRenderTest, CsvHasOneHeaderAndExactRows) {
  const std::string csv = ReportToCsv(Hostile(), Meta());
  const std::string expected =
      "section,name,requests,allowed,blocked,redacted,opaque,errors,bytes_up,bytes_down\r\n"
      "total,,5,2,2,1,0,0,1000,2000\r\n"
      "environment,env_1,5,2,2,1,0,0,1000,2000\r\n"
      "day,2026-11-20,5,,2,,,,1000,2000\r\n"
      "host,<script>alert(1)</script>,3,,1,,,,10,20\r\n"
      "host,\"a,b\"\"c\nd\",1,,1,,,,1,2\r\n"
      "host,\"'=HYPERLINK(\"\"http://x\"\")\",1,,0,,,,0,0\r\n"
      "blocked_rule,deny:<img src=x onerror=alert(1)>,2,,2,,,,,\r\n"
      "dlp_finding,dlp:credit_card,1,,,,,,,\r\n";
  EXPECT_EQ(csv, expected);
}

TEST(ReportRenderTest, HtmlEscapesEveryAttackerValueAndLoadsNothing) {
  const std::string html = ReportToHtml(Hostile(), Meta());
  EXPECT_EQ(html.find("<script"), std::string::npos) << "a host named <script> is escaped";
  EXPECT_NE(html.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<img"), std::string::npos);
  EXPECT_NE(html.find("deny:&lt;img src=x onerror=alert(1)&gt;"), std::string::npos);
  EXPECT_NE(html.find("a,b&quot;c\nd"), std::string::npos);
  EXPECT_NE(html.find("acme&lt;&amp;&gt;"), std::string::npos) << "the tenant too";
  // Self-contained: the only tags are the page's own, with no attribute that loads anything.
  const std::set<std::string> allowed = {"!DOCTYPE", "html", "head", "meta", "title", "style",
                                         "body",     "h1",   "h2",   "p",    "table", "thead",
                                         "tbody",    "tr",   "th",   "td"};
  const std::regex tag("<(/?)([!A-Za-z][A-Za-z0-9]*)([^>]*)>");
  int tags = 0;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), tag); it != std::sregex_iterator();
       ++it, ++tags) {
    EXPECT_TRUE(allowed.count((*it)[2].str())) << (*it)[0].str();
    std::string attrs = (*it)[3].str();
    // The page's own CSP names default-src: it forbids loading anything.
    const std::string csp =
        " http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'\"";
    if (attrs == csp) continue;
    for (const char* bad : {"src", "href", "on", "url(", "action"}) {
      if (std::string(bad) == "on") {
        EXPECT_FALSE(std::regex_search(attrs, std::regex("\\son[a-z]+="))) << attrs;
      } else {
        EXPECT_EQ(attrs.find(bad), std::string::npos) << attrs;
      }
    }
  }
  EXPECT_GT(tags, 50);
  const std::string style =
      html.substr(html.find("<style>"), html.find("</style>") - html.find("<style>"));
  EXPECT_EQ(style.find("url("), std::string::npos);
  EXPECT_EQ(style.find("@import"), std::string::npos);
  EXPECT_NE(html.find("@media print"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"n\">1000</td>"), std::string::npos);
}

TEST(ReportRenderTest, HtmlEscapeCoversTheFiveCharactersAndBadUtf8) {
  EXPECT_EQ(HtmlEscape("<a href='x'>&\"</a>"), "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;");
  EXPECT_EQ(HtmlEscape(std::string("\xff<", 2)), "\xEF\xBF\xBD&lt;");
}

TEST(ReportRenderTest, JsonCarriesEveryTable) {
  boost::json::object o = ReportToJson(Hostile(), Meta());
  EXPECT_EQ(o["period"].as_string(), "daily");
  EXPECT_EQ(o["from"].as_string(), "2026-11-20T00:00:00.000Z");
  EXPECT_EQ(o["totals"].as_object().at("blocked").as_int64(), 2);
  EXPECT_EQ(o["top_hosts"].as_array().size(), 3u);
  EXPECT_EQ(o["top_hosts"].as_array()[0].as_object().at("host").as_string(),
            "<script>alert(1)</script>");  // JSON is data: escaping is the reader's
  EXPECT_EQ(o["blocks_by_rule"].as_array()[0].as_object().at("count").as_int64(), 2);
  EXPECT_EQ(o["dlp_findings"].as_array()[0].as_object().at("rule").as_string(), "dlp:credit_card");
  EXPECT_EQ(o["days"].as_array()[0].as_object().at("date").as_string(), "2026-11-20");
  EXPECT_TRUE(o["environment_id"].is_null());
}

}  // namespace
}  // namespace esb::api
