#include "drivers/env_limits.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"

namespace esb {

EnvLimitTable EnvLimits(const EnvLimitCaps& caps) {
  return EnvLimitTable{
      {"cpu", kMinCpu, static_cast<double>(std::max<int64_t>(1, caps.cpus)), ""},
      {"memory_mb", kMinMemoryMb, static_cast<double>(caps.max_memory_mb), "max_memory_mb"},
      {"pids", kMinPids, static_cast<double>(caps.max_pids), "max_pids"},
      {"disk_mb", kMinDiskMb, static_cast<double>(caps.max_disk_mb), "max_disk_mb"},
  };
}

EnvLimitCaps HostEnvLimitCaps(int64_t max_memory_mb, int64_t max_pids, int64_t max_disk_mb) {
  EnvLimitCaps caps;
  caps.cpus = std::max<int64_t>(1, std::thread::hardware_concurrency());
  caps.max_memory_mb = max_memory_mb;
  caps.max_pids = max_pids;
  caps.max_disk_mb = max_disk_mb;
  return caps;
}

absl::Status CheckEnvLimits(const EnvSpec& spec, const EnvLimitCaps& caps) {
  EnvLimitTable t = EnvLimits(caps);
  const std::pair<const LimitRange*, double> checks[] = {
      {&t.cpu, spec.cpu},
      {&t.memory_mb, static_cast<double>(spec.memory_mb)},
      {&t.pids, static_cast<double>(spec.pids)},
      {&t.disk_mb, static_cast<double>(spec.disk_mb)},
  };
  for (const auto& [range, value] : checks) {
    // Written so that NaN (which fails every comparison) is refused.
    if (!(value >= range->min && value <= range->max)) {
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(range->field), " ", value, " is outside ", range->min, "..", range->max,
          range->cap.empty() ? " (the host's CPUs)"
                             : absl::StrCat(" (", std::string(range->cap), ")")));
    }
  }
  return absl::OkStatus();
}

}  // namespace esb
