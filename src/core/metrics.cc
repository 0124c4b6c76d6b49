#include "core/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace esb {

namespace {

// Distinct DLP rule labels kept (custom patterns are per environment: bounded cardinality).
constexpr size_t kMaxDlpRuleLabels = 256;

// A Prometheus label value: backslash, double quote and newline escaped.
std::string LabelValue(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

void Histogram::Observe(double seconds) {
  size_t i = 0;
  while (i < bounds_.size() && seconds > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_micros_.fetch_add(static_cast<uint64_t>(seconds * 1e6), std::memory_order_relaxed);
}

std::string Histogram::Render(const std::string& name, const std::string& help) const {
  std::string out = absl::StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    absl::StrAppend(&out, name, "_bucket{le=\"", absl::StrFormat("%g", bounds_[i]), "\"} ",
                    cumulative, "\n");
  }
  cumulative += buckets_[bounds_.size()].load(std::memory_order_relaxed);
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

void Metrics::CountEgress(std::string_view decision, const std::vector<std::string>& rule_ids,
                          int64_t added_latency_us) {
  if (added_latency_us > 0) egress_added_latency.Observe(added_latency_us / 1e6);
  std::lock_guard<std::mutex> lock(mu_);
  ++egress_decisions_[std::string(decision)];
  for (const std::string& rule : rule_ids) {
    if (!rule.starts_with("dlp:")) continue;
    if (dlp_hits_.size() >= kMaxDlpRuleLabels && !dlp_hits_.count(rule)) {
      ++dlp_hits_["other"];
    } else {
      ++dlp_hits_[rule];
    }
  }
}

void Metrics::CountToolCall(std::string_view server, std::string_view decision,
                            const std::vector<std::string>& rule_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  ++tool_calls_[{std::string(server), std::string(decision)}];
  for (const std::string& rule : rule_ids) {
    if (tool_dlp_hits_.size() >= kMaxDlpRuleLabels && !tool_dlp_hits_.count(rule)) {
      ++tool_dlp_hits_["other"];
    } else {
      ++tool_dlp_hits_[rule];
    }
  }
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
  out += egress_added_latency.Render("esb_egress_added_latency_seconds",
                                     "Time the egress proxy added to a request.");
  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP esb_http_requests_total HTTP requests by status.\n"
         "# TYPE esb_http_requests_total counter\n";
  for (const auto& [code, n] : http_)
    absl::StrAppend(&out, "esb_http_requests_total{code=\"", code, "\"} ", n, "\n");
  out += "# HELP esb_errors_total Errors by kind.\n# TYPE esb_errors_total counter\n";
  for (const auto& [kind, n] : errors_)
    absl::StrAppend(&out, "esb_errors_total{kind=\"", kind, "\"} ", n, "\n");
  out +=
      "# HELP esb_egress_requests_total Egress requests by decision.\n"
      "# TYPE esb_egress_requests_total counter\n";
  for (const auto& [decision, n] : egress_decisions_)
    absl::StrAppend(&out, "esb_egress_requests_total{decision=\"", LabelValue(decision), "\"} ", n,
                    "\n");
  out +=
      "# HELP esb_dlp_hits_total Egress requests in which a DLP rule fired, by rule.\n"
      "# TYPE esb_dlp_hits_total counter\n";
  for (const auto& [rule, n] : dlp_hits_)
    absl::StrAppend(&out, "esb_dlp_hits_total{rule=\"", LabelValue(rule), "\"} ", n, "\n");
  out +=
      "# HELP esb_tool_calls_total Tool calls (MCP, REST) through the tool gate, by server and "
      "decision.\n# TYPE esb_tool_calls_total counter\n";
  for (const auto& [key, n] : tool_calls_)
    absl::StrAppend(&out, "esb_tool_calls_total{server=\"", LabelValue(key.first), "\",decision=\"",
                    LabelValue(key.second), "\"} ", n, "\n");
  out +=
      "# HELP esb_tool_dlp_hits_total Tool calls in which a DLP rule fired, by rule.\n"
      "# TYPE esb_tool_dlp_hits_total counter\n";
  for (const auto& [rule, n] : tool_dlp_hits_)
    absl::StrAppend(&out, "esb_tool_dlp_hits_total{rule=\"", LabelValue(rule), "\"} ", n, "\n");
  return out;
}

}  // namespace esb
