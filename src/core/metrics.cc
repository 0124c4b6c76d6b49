#include "core/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace esb {

void Histogram::Observe(double seconds) {
  size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_micros_.fetch_add(static_cast<uint64_t>(seconds * 1e6), std::memory_order_relaxed);
}

std::string Histogram::Render(const std::string& name, const std::string& help) const {
  std::string out = absl::StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kBounds.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    absl::StrAppend(&out, name, "_bucket{le=\"", absl::StrFormat("%g", kBounds[i]), "\"} ",
                    cumulative, "\n");
  }
  cumulative += buckets_[kBounds.size()].load(std::memory_order_relaxed);
  absl::StrAppend(&out, name, "_bucket{le=\"+Inf\"} ", cumulative, "\n");
  absl::StrAppend(&out, name, "_sum ",
                  absl::StrFormat("%.6f", sum_micros_.load(std::memory_order_relaxed) / 1e6),
                  "\n", name, "_count ", count_.load(std::memory_order_relaxed), "\n");
  return out;
}

void Metrics::CountHttp(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++http_[status];
}

void Metrics::CountError(const std::string& kind) {
  std::lock_guard<std::mutex> lock(mu_);
  ++errors_[kind];
}

std::string Metrics::Render(const std::map<std::string, int64_t>& env_states,
                            int64_t pool_ready) const {
  std::string out =
      "# HELP esb_environments Environments known to this daemon, by state.\n"
      "# TYPE esb_environments gauge\n";
  for (const auto& [state, n] : env_states)
    absl::StrAppend(&out, "esb_environments{state=\"", state, "\"} ", n, "\n");
  absl::StrAppend(&out,
                  "# HELP esb_pool_ready Pre-started environments waiting in warm pools.\n"
                  "# TYPE esb_pool_ready gauge\nesb_pool_ready ",
                  pool_ready, "\n");
  absl::StrAppend(&out, "# HELP esb_exec_total Commands executed.\n# TYPE esb_exec_total counter\n",
                  "esb_exec_total ", exec_total.load(), "\n");
  absl::StrAppend(&out,
                  "# HELP esb_exec_timeouts_total Commands killed by their timeout.\n"
                  "# TYPE esb_exec_timeouts_total counter\nesb_exec_timeouts_total ",
                  exec_timeouts.load(), "\n");
  absl::StrAppend(&out,
                  "# HELP esb_creates_total Environments created, by source.\n"
                  "# TYPE esb_creates_total counter\n",
                  "esb_creates_total{source=\"pool\"} ", creates_pooled.load(), "\n",
                  "esb_creates_total{source=\"cold\"} ", creates_cold.load(), "\n");
  absl::StrAppend(&out,
                  "# HELP esb_reaped_total Environments destroyed by the lease reaper.\n"
                  "# TYPE esb_reaped_total counter\nesb_reaped_total ",
                  reaped_total.load(), "\n");
  out += exec_duration.Render("esb_exec_duration_seconds", "Execute latency.");
  out += create_duration.Render("esb_create_duration_seconds", "Environment create latency.");
  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP esb_http_requests_total HTTP requests by status.\n"
         "# TYPE esb_http_requests_total counter\n";
  for (const auto& [code, n] : http_)
    absl::StrAppend(&out, "esb_http_requests_total{code=\"", code, "\"} ", n, "\n");
  out += "# HELP esb_errors_total Errors by kind.\n# TYPE esb_errors_total counter\n";
  for (const auto& [kind, n] : errors_)
    absl::StrAppend(&out, "esb_errors_total{kind=\"", kind, "\"} ", n, "\n");
  return out;
}

}  // namespace esb
