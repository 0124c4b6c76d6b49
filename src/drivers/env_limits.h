// The one table of the resource limits an environment may ask for (cpu, memory_mb, pids,
// disk_mb): one range each, read by the API (400 for a request outside it), the config (its
// `defaults` must fit) and the drivers (which refuse anything outside it, whoever calls them).
// The minimums are what a sandbox needs to start its agent and a shell; the maximums are this
// daemon's caps (host CPUs, max_memory_mb, max_pids, max_disk_mb).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "drivers/driver.h"

namespace esb {

struct EnvLimitCaps {
  int64_t cpus = 1;  // host CPUs (at least 1)
  int64_t max_memory_mb = 16384;
  int64_t max_pids = 4096;
  int64_t max_disk_mb = 65536;
};

struct LimitRange {
  std::string_view field;  // the EnvSpec / API field
  double min;
  double max;
  std::string_view cap;  // the configuration key that sets max ("" for the host's CPUs)
};

struct EnvLimitTable {
  LimitRange cpu, memory_mb, pids, disk_mb;
};

inline constexpr double kMinCpu = 0.1;
inline constexpr int64_t kMinMemoryMb = 32;
inline constexpr int64_t kMinPids = 16;
inline constexpr int64_t kMinDiskMb = 16;

EnvLimitTable EnvLimits(const EnvLimitCaps& caps);
// The caps with the host's CPU count filled in.
EnvLimitCaps HostEnvLimitCaps(int64_t max_memory_mb, int64_t max_pids, int64_t max_disk_mb);
// InvalidArgument naming the first limit of `spec` outside the table ("memory_mb 8 is outside
// 32..4096 (max_memory_mb)"); NaN is outside every range.
absl::Status CheckEnvLimits(const EnvSpec& spec, const EnvLimitCaps& caps);

}  // namespace esb
