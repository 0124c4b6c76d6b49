// Host cgroup layout detection and per-container cgroup bookkeeping (v1, hybrid and v2).
// The OCI runtime creates and removes a container's cgroups; this file only finds them, reads
// usage from them and cleans up what a crashed runtime may have left behind.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb::container {

enum class CgroupMode {
  kV1,      // only cgroup v1 hierarchies
  kHybrid,  // v1 controllers plus a cgroup2 mount (usually /sys/fs/cgroup/unified)
  kV2,      // unified hierarchy at /sys/fs/cgroup
};

struct CgroupLayout {
  CgroupMode mode = CgroupMode::kV2;
  // v1: controller (or "name=systemd") -> mount point. One mount may serve several controllers.
  std::map<std::string, std::string> v1_mounts;
  // The cgroup2 mount point ("" when there is none).
  std::string v2_mount;
  // v2: whether memory.swap.max exists (swap accounting); v1: whether memory.memsw.* exists.
  bool swap_accounting = false;
};

const char* CgroupModeName(CgroupMode mode);

// Reads /proc/self/mountinfo.
absl::StatusOr<CgroupLayout> DetectCgroups();

// Every directory a container whose OCI cgroupsPath is `path` (absolute, e.g. "/esb/x") may own.
std::vector<std::string> CgroupDirs(const CgroupLayout& layout, const std::string& path);

// Memory, CPU and pid usage of the cgroup (v1: memory/cpuacct/pids controllers; v2: unified).
absl::StatusOr<Usage> ReadCgroupUsage(const CgroupLayout& layout, const std::string& path);

// Pids listed in any of the cgroup's cgroup.procs files.
std::vector<int> CgroupPids(const CgroupLayout& layout, const std::string& path);

// SIGKILLs whatever is left in the cgroup and removes its directories (deepest first).
// Succeeds when none of them exist afterwards.
absl::Status RemoveCgroup(const CgroupLayout& layout, const std::string& path, int timeout_ms);

}  // namespace esb::container
