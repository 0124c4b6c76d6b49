// Process-wide counters rendered as Prometheus text. Owned by main and passed down; no globals.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace esb {

// Fixed-bucket histogram (seconds), lock-free increments.
class Histogram {
 public:
  static constexpr std::array<double, 12> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1.0,  5.0,   30.0};
  void Observe(double seconds);
  std::string Render(const std::string& name, const std::string& help) const;

 private:
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

  void CountHttp(int status);
  void CountError(const std::string& kind);
  // `env_states` comes from the manager at render time.
  std::string Render(const std::map<std::string, int64_t>& env_states, int64_t pool_ready) const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> http_;
  std::map<std::string, uint64_t> errors_;
};

}  // namespace esb
