// Renders an egress compliance report (Store::ReportEgress) as JSON, CSV or a printable HTML
// page (GET /reports, `esb report`). Every host, path and rule id in a report comes from
// sandbox traffic: CSV cells are quoted (and formula-neutralised), HTML text is escaped.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "boost/json.hpp"
#include "storage/store.h"

namespace esb::api {

struct ReportMeta {
  std::string tenant;
  std::string period;          // "daily" | "weekly"
  std::string environment_id;  // "" = every environment
  int64_t from_ms = 0;
  int64_t to_ms = 0;  // exclusive
  int64_t generated_ms = 0;
};

boost::json::object ReportToJson(const EgressReport& report, const ReportMeta& meta);
// One table: section,name,requests,allowed,blocked,redacted,opaque,errors,bytes_up,bytes_down
// (sections: total, environment, day, host, blocked_rule, dlp_finding; a cell that does not
// apply to a section is empty). CRLF line ends (RFC 4180).
std::string ReportToCsv(const EgressReport& report, const ReportMeta& meta);
// A self-contained page (inline CSS, no scripts, no external assets) that prints on A4/Letter.
std::string ReportToHtml(const EgressReport& report, const ReportMeta& meta);

// An RFC 4180 cell: quoted when it holds ',', '"', CR or LF (quotes doubled); a cell starting
// with '=', '+', '-', '@', TAB or CR gets a leading "'" so spreadsheets do not run it as a
// formula. Invalid UTF-8 and control characters other than TAB, LF and CR become U+FFFD.
std::string CsvCell(std::string_view text);
// &, <, >, " and ' as entities; invalid UTF-8 and control characters as in CsvCell.
std::string HtmlEscape(std::string_view text);

}  // namespace esb::api
