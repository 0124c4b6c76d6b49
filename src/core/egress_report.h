// Compliance report periods (issue 12, P3-013): which time window a daily or weekly egress
// report covers. The store aggregates (Store::ReportEgress); the API renders.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/statusor.h"

namespace esb {

enum class ReportPeriod { kDaily, kWeekly };
std::string_view ToString(ReportPeriod period);  // "daily" | "weekly"
std::optional<ReportPeriod> ParseReportPeriod(std::string_view name);

struct ReportWindow {
  int64_t from_ms = 0;  // inclusive, UTC midnight
  int64_t to_ms = 0;    // exclusive
};

// Daily: the UTC day that contains `at_ms`. Weekly: the ISO week (Monday 00:00 UTC to the next
// Monday) that contains it.
ReportWindow WindowFor(ReportPeriod period, int64_t at_ms);

// "YYYY-MM-DD" (a UTC day) → unix ms of its midnight. InvalidArgument otherwise.
absl::StatusOr<int64_t> ParseReportDate(std::string_view date);

}  // namespace esb
