// Process-wide counters rendered as Prometheus text. Owned by main and passed down; no globals.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace esb {

// Fixed-bucket histogram (seconds), lock-free increments.
class Histogram {
 public:
  static constexpr std::array<double, 12> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1.0,  5.0,   30.0};
  // Sub-millisecond buckets, for time a hop adds (the egress proxy's target is 0.5 ms).
  static constexpr std::array<double, 12> kFineBounds = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0};
  explicit Histogram(const std::array<double, 12>& bounds = kBounds) : bounds_(bounds) {}
  void Observe(double seconds);
  std::string Render(const std::string& name, const std::string& help) const;

 private:
  const std::array<double, 12> bounds_;
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_micros_{0};
};

class Metrics {
 public:
  Histogram exec_duration;
  Histogram create_duration;
  std::atomic<uint64_t> exec_total{0};
  std::atomic<uint64_t> exec_timeouts{0};
  std::atomic<uint64_t> creates_pooled{0};
  std::atomic<uint64_t> creates_cold{0};
  std::atomic<uint64_t> reaped_total{0};
  Histogram egress_added_latency{Histogram::kFineBounds};

  void CountHttp(int status);
  // One egress audit row: its decision, the DLP rules that fired ("dlp:*" ids in `rule_ids`)
  // and the time the proxy added (microseconds; <= 0: unknown, not observed).
  void CountEgress(std::string_view decision, const std::vector<std::string>& rule_ids,
                   int64_t added_latency_us);
  // One tool call through the ToolCallGate (core/tools/tool_gate.h): `server` is "esbd" or
  // "hosted" (hosted servers' names are not labels: unbounded), `decision` the audit row's
  // (allowed | redacted | blocked | error), `rule_ids` the DLP rules hit (arguments and result).
  void CountToolCall(std::string_view server, std::string_view decision,
                     const std::vector<std::string>& rule_ids);
  void CountError(const std::string& kind);
  // `env_states` comes from the manager at render time.
  std::string Render(const std::map<std::string, int64_t>& env_states, int64_t pool_ready) const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> http_;
  std::map<std::string, uint64_t> errors_;
  std::map<std::string, uint64_t> egress_decisions_;
  std::map<std::string, uint64_t> dlp_hits_;  // at most kMaxDlpRuleLabels rules, then "other"
  std::map<std::pair<std::string, std::string>, uint64_t> tool_calls_;  // (server, decision)
  std::map<std::string, uint64_t> tool_dlp_hits_;  // as dlp_hits_, for tool calls
};

}  // namespace esb
