#include "api/report_render.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::api {
namespace json = boost::json;
namespace {

std::string Day(int64_t ms) { return FormatRfc3339(ms).substr(0, 10); }

// Valid UTF-8 with control characters (other than TAB, LF, CR) replaced by U+FFFD: a report
// printed to a terminal carries no escape sequence from a host name.
std::string CleanText(std::string_view text) {
  std::string out;
  for (char c : SanitizeUtf8(text)) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t' && c != '\n' && c != '\r') || u == 0x7f) {
      out += "\xEF\xBF\xBD";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

json::object SummaryJson(const EgressReport::Summary& s) {
  json::object o{{"requests", s.requests}, {"allowed", s.allowed},      {"blocked", s.blocked},
                 {"redacted", s.redacted}, {"opaque", s.opaque},        {"errors", s.errors},
                 {"bytes_up", s.bytes_up}, {"bytes_down", s.bytes_down}};
  if (!s.environment_id.empty()) o["environment_id"] = SanitizeUtf8(s.environment_id);
  return o;
}

json::array CountsJson(const std::vector<EgressReport::Count>& counts, const char* key) {
  json::array out;
  for (const auto& c : counts)
    out.push_back(json::object{{key, SanitizeUtf8(c.key)}, {"count", c.count}});
  return out;
}

// A CSV row of `cells` (already numbers or text to quote).
void CsvRow(std::string* out, const std::vector<std::string>& cells) {
  for (size_t i = 0; i < cells.size(); ++i) {
    if (i > 0) out->push_back(',');
    *out += cells[i];
  }
  *out += "\r\n";
}

std::string N(int64_t n) { return std::to_string(n); }

std::vector<std::string> SummaryCells(std::string_view section, const EgressReport::Summary& s) {
  return {CsvCell(section), CsvCell(s.environment_id),
          N(s.requests),    N(s.allowed),
          N(s.blocked),     N(s.redacted),
          N(s.opaque),      N(s.errors),
          N(s.bytes_up),    N(s.bytes_down)};
}

// One HTML table: `head` cells and rows of cells (text escaped here; numbers right-aligned).
struct HtmlTable {
  std::vector<std::string> head;
  std::vector<std::vector<std::string>> rows;
  std::vector<bool> numeric;  // per column
};

void AppendTable(std::string* out, std::string_view title, const HtmlTable& t,
                 std::string_view empty) {
  absl::StrAppend(out, "<h2>", HtmlEscape(title), "</h2>\n");
  if (t.rows.empty()) {
    absl::StrAppend(out, "<p class=\"empty\">", HtmlEscape(empty), "</p>\n");
    return;
  }
  *out += "<table>\n<thead><tr>";
  for (size_t i = 0; i < t.head.size(); ++i) {
    absl::StrAppend(out, t.numeric[i] ? "<th class=\"n\">" : "<th>", HtmlEscape(t.head[i]),
                    "</th>");
  }
  *out += "</tr></thead>\n<tbody>\n";
  for (const auto& row : t.rows) {
    *out += "<tr>";
    for (size_t i = 0; i < row.size(); ++i) {
      absl::StrAppend(out, t.numeric[i] ? "<td class=\"n\">" : "<td>", HtmlEscape(row[i]), "</td>");
    }
    *out += "</tr>\n";
  }
  *out += "</tbody>\n</table>\n";
}

HtmlTable SummaryTable(const std::vector<EgressReport::Summary>& rows, bool with_env) {
  HtmlTable t;
  if (with_env) t.head.push_back("Environment");
  for (const char* h : {"Requests", "Allowed", "Blocked", "Redacted", "Opaque", "Errors",
                        "Bytes up", "Bytes down"}) {
    t.head.push_back(h);
  }
  t.numeric.assign(t.head.size(), true);
  if (with_env) t.numeric[0] = false;
  for (const auto& s : rows) {
    std::vector<std::string> r;
    if (with_env) r.push_back(s.environment_id);
    for (int64_t v : {s.requests, s.allowed, s.blocked, s.redacted, s.opaque, s.errors, s.bytes_up,
                      s.bytes_down}) {
      r.push_back(N(v));
    }
    t.rows.push_back(std::move(r));
  }
  return t;
}

HtmlTable CountTable(const char* what, const std::vector<EgressReport::Count>& counts) {
  HtmlTable t{{what, "Requests"}, {}, {false, true}};
  for (const auto& c : counts) t.rows.push_back({c.key, N(c.count)});
  return t;
}

constexpr const char* kStyle = R"css(
body { font: 11pt/1.4 system-ui, sans-serif; color: #111; margin: 2em; }
h1 { font-size: 16pt; margin: 0 0 .2em; }
h2 { font-size: 12pt; margin: 1.4em 0 .4em; border-bottom: 1px solid #999; }
p.meta { color: #444; margin: 0; }
p.empty { color: #666; font-style: italic; }
table { border-collapse: collapse; width: 100%; page-break-inside: auto; }
tr { page-break-inside: avoid; }
th, td { border: 1px solid #bbb; padding: .2em .5em; text-align: left; word-break: break-all; }
th { background: #eee; }
.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
@media print { body { margin: 0; } th { background: #ddd !important; } }
@page { size: auto; margin: 15mm; }
)css";

}  // namespace

std::string CsvCell(std::string_view text) {
  std::string s = CleanText(text);
  if (!s.empty() &&
      (s[0] == '=' || s[0] == '+' || s[0] == '-' || s[0] == '@' || s[0] == '\t' || s[0] == '\r')) {
    s.insert(s.begin(), '\'');
  }
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out.push_back('"');
    out.push_back(c);
  }
  out.push_back('"');
  return out;
}

std::string HtmlEscape(std::string_view text) {
  std::string out;
  for (char c : CleanText(text)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

json::object ReportToJson(const EgressReport& r, const ReportMeta& meta) {
  json::array envs, hosts, days;
  for (const auto& s : r.environments) envs.push_back(SummaryJson(s));
  for (const auto& h : r.top_hosts) {
    hosts.push_back(json::object{{"host", SanitizeUtf8(h.host)},
                                 {"requests", h.requests},
                                 {"blocked", h.blocked},
                                 {"bytes_up", h.bytes_up},
                                 {"bytes_down", h.bytes_down}});
  }
  for (const auto& d : r.days) {
    days.push_back(json::object{{"date", Day(d.day_start_ms)},
                                {"requests", d.requests},
                                {"blocked", d.blocked},
                                {"bytes_up", d.bytes_up},
                                {"bytes_down", d.bytes_down}});
  }
  return json::object{
      {"tenant", meta.tenant},
      {"period", meta.period},
      {"environment_id",
       meta.environment_id.empty() ? json::value() : json::value(meta.environment_id)},
      {"from", FormatRfc3339(meta.from_ms)},
      {"to", FormatRfc3339(meta.to_ms)},
      {"generated_at", FormatRfc3339(meta.generated_ms)},
      {"totals", SummaryJson(r.totals)},
      {"environments", std::move(envs)},
      {"days", std::move(days)},
      {"blocks_by_rule", CountsJson(r.blocks_by_rule, "rule")},
      {"top_hosts", std::move(hosts)},
      {"dlp_findings", CountsJson(r.dlp_findings, "rule")}};
}

std::string ReportToCsv(const EgressReport& r, const ReportMeta& meta) {
  std::string out;
  CsvRow(&out, {"section", "name", "requests", "allowed", "blocked", "redacted", "opaque", "errors",
                "bytes_up", "bytes_down"});
  CsvRow(&out, SummaryCells("total", r.totals));
  for (const auto& s : r.environments) CsvRow(&out, SummaryCells("environment", s));
  for (const auto& d : r.days) {
    CsvRow(&out, {"day", Day(d.day_start_ms), N(d.requests), "", N(d.blocked), "", "", "",
                  N(d.bytes_up), N(d.bytes_down)});
  }
  for (const auto& h : r.top_hosts) {
    CsvRow(&out, {"host", CsvCell(h.host), N(h.requests), "", N(h.blocked), "", "", "",
                  N(h.bytes_up), N(h.bytes_down)});
  }
  for (const auto& c : r.blocks_by_rule) {
    CsvRow(&out, {"blocked_rule", CsvCell(c.key), N(c.count), "", N(c.count), "", "", "", "", ""});
  }
  for (const auto& c : r.dlp_findings) {
    CsvRow(&out, {"dlp_finding", CsvCell(c.key), N(c.count), "", "", "", "", "", "", ""});
  }
  return out;
}

std::string ReportToHtml(const EgressReport& r, const ReportMeta& meta) {
  const std::string period = meta.period == "weekly" ? "Weekly" : "Daily";
  const std::string range = meta.period == "weekly"
                                ? absl::StrCat(Day(meta.from_ms), " to ", Day(meta.to_ms - 1))
                                : Day(meta.from_ms);
  std::string out =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
      "style-src 'unsafe-inline'\">\n";
  absl::StrAppend(&out, "<title>",
                  HtmlEscape(absl::StrCat(period, " egress report: ", meta.tenant, ", ", range)),
                  "</title>\n<style>", kStyle, "</style>\n</head>\n<body>\n");
  absl::StrAppend(&out, "<h1>", HtmlEscape(absl::StrCat(period, " egress report")), "</h1>\n");
  absl::StrAppend(&out, "<p class=\"meta\">Tenant: ", HtmlEscape(meta.tenant), "</p>\n");
  absl::StrAppend(&out, "<p class=\"meta\">Environment: ",
                  HtmlEscape(meta.environment_id.empty() ? "all" : meta.environment_id), "</p>\n");
  absl::StrAppend(
      &out, "<p class=\"meta\">Period (UTC): ",
      HtmlEscape(absl::StrCat(FormatRfc3339(meta.from_ms), " to ", FormatRfc3339(meta.to_ms))),
      "</p>\n");
  absl::StrAppend(&out,
                  "<p class=\"meta\">Generated: ", HtmlEscape(FormatRfc3339(meta.generated_ms)),
                  "</p>\n");
  AppendTable(&out, "Totals", SummaryTable({r.totals}, false), "");
  AppendTable(&out, "Environments", SummaryTable(r.environments, true), "No egress requests.");
  HtmlTable days{{"Day", "Requests", "Blocked", "Bytes up", "Bytes down"},
                 {},
                 {false, true, true, true, true}};
  for (const auto& d : r.days) {
    days.rows.push_back(
        {Day(d.day_start_ms), N(d.requests), N(d.blocked), N(d.bytes_up), N(d.bytes_down)});
  }
  AppendTable(&out, "Days", days, "No egress requests.");
  AppendTable(&out, "Blocks by rule", CountTable("Rule", r.blocks_by_rule), "Nothing was blocked.");
  HtmlTable hosts{{"Host", "Requests", "Blocked", "Bytes up", "Bytes down"},
                  {},
                  {false, true, true, true, true}};
  for (const auto& h : r.top_hosts) {
    hosts.rows.push_back({h.host, N(h.requests), N(h.blocked), N(h.bytes_up), N(h.bytes_down)});
  }
  AppendTable(&out, "Top hosts", hosts, "No egress requests.");
  AppendTable(&out, "DLP findings by type", CountTable("Rule", r.dlp_findings), "No DLP findings.");
  out += "</body>\n</html>\n";
  return out;
}

}  // namespace esb::api
