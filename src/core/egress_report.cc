#include "core/egress_report.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {
namespace {
constexpr int64_t kDayMs = 86'400'000;

int64_t FloorDiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
}  // namespace

std::string_view ToString(ReportPeriod period) {
  return period == ReportPeriod::kWeekly ? "weekly" : "daily";
}

std::optional<ReportPeriod> ParseReportPeriod(std::string_view name) {
  if (name == "daily") return ReportPeriod::kDaily;
  if (name == "weekly") return ReportPeriod::kWeekly;
  return std::nullopt;
}

ReportWindow WindowFor(ReportPeriod period, int64_t at_ms) {
  const int64_t day = FloorDiv(at_ms, kDayMs);
  if (period == ReportPeriod::kDaily) return {day * kDayMs, (day + 1) * kDayMs};
  // 1970-01-01 was a Thursday: Monday-based weekday = (day + 3) mod 7.
  const int64_t monday = day - ((day % 7 + 7 + 3) % 7);
  return {monday * kDayMs, (monday + 7) * kDayMs};
}

absl::StatusOr<int64_t> ParseReportDate(std::string_view date) {
  auto bad = [&] { return absl::InvalidArgumentError("'date' must be a UTC day as YYYY-MM-DD"); };
  if (date.size() != 10 || date[4] != '-' || date[7] != '-') return bad();
  for (size_t i : {0, 1, 2, 3, 5, 6, 8, 9}) {
    if (date[i] < '0' || date[i] > '9') return bad();
  }
  int64_t ms = 0;
  if (!ParseTime(absl::StrCat(AbslView(date), "T00:00:00Z"), &ms)) return bad();
  // ParseTime normalises out-of-range days (2026-02-31): refuse what does not round-trip.
  if (FormatRfc3339(ms).substr(0, 10) != date) return bad();
  return ms;
}

}  // namespace esb
