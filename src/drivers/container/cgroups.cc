#include "drivers/container/cgroups.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/util.h"

#ifndef CGROUP2_SUPER_MAGIC
#define CGROUP2_SUPER_MAGIC 0x63677270
#endif

namespace esb::container {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool ReadInt(const std::string& path, int64_t* value) {
  std::string text;
  if (!ReadFileToString(path, &text).ok()) return false;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), value);
}

// Value of `key` in a flat-keyed file such as cpu.stat ("usage_usec 1234").
bool ReadKeyedInt(const std::string& path, absl::string_view key, int64_t* value) {
  std::string text;
  if (!ReadFileToString(path, &text).ok()) return false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (parts.size() == 2 && parts[0] == key) return absl::SimpleAtoi(parts[1], value);
  }
  return false;
}

// The distinct hierarchy directories of `path` (one per v1 mount, plus the v2 one).
std::vector<std::string> HierarchyDirs(const CgroupLayout& layout, const std::string& path) {
  std::set<std::string> mounts;
  for (const auto& [controller, mount] : layout.v1_mounts) mounts.insert(mount);
  if (!layout.v2_mount.empty()) mounts.insert(layout.v2_mount);
  std::vector<std::string> dirs;
  for (const std::string& mount : mounts) dirs.push_back(mount + path);
  return dirs;
}

// rmdir()s a cgroup directory and any child cgroups below it, deepest first. In cgroupfs only
// directories can be removed (the interface files vanish with them).
bool RemoveCgroupTree(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    std::vector<std::string> children;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (e->d_type == DT_DIR && name != "." && name != "..") children.push_back(dir + "/" + name);
    }
    ::closedir(d);
    for (const std::string& child : children) RemoveCgroupTree(child);
  }
  return ::rmdir(dir.c_str()) == 0;
}

}  // namespace

const char* CgroupModeName(CgroupMode mode) {
  switch (mode) {
    case CgroupMode::kV1:
      return "cgroup v1";
    case CgroupMode::kHybrid:
      return "cgroup hybrid (v1 controllers + cgroup2)";
    case CgroupMode::kV2:
      return "cgroup v2";
  }
  return "cgroup ?";
}

absl::StatusOr<CgroupLayout> DetectCgroups() {
  std::string mountinfo;
  if (absl::Status s = ReadFileToString("/proc/self/mountinfo", &mountinfo); !s.ok()) return s;
  CgroupLayout layout;
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    // "<id> <parent> <maj:min> <root> <mountpoint> <opts> [optional...] - <fstype> <src> <super>"
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
    auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    absl::string_view fstype = dash[1];
    std::string mountpoint(f[4]);
    if (fstype == "cgroup2") {
      // Prefer the canonical location if there are several.
      if (layout.v2_mount.empty() || mountpoint == "/sys/fs/cgroup") layout.v2_mount = mountpoint;
    } else if (fstype == "cgroup") {
      for (absl::string_view opt : absl::StrSplit(dash[3], ',')) {
        if (opt == "rw" || opt == "ro" || opt == "clone_children" || opt == "noprefix" ||
            absl::StartsWith(opt, "release_agent") || absl::StartsWith(opt, "xattr")) {
          continue;
        }
        layout.v1_mounts.emplace(std::string(opt), mountpoint);
      }
    }
  }
  struct statfs sfs;
  if (::statfs("/sys/fs/cgroup", &sfs) == 0 && sfs.f_type == CGROUP2_SUPER_MAGIC) {
    layout.mode = CgroupMode::kV2;
    layout.v2_mount = "/sys/fs/cgroup";
    layout.v1_mounts.clear();  // a v2 host may still have stray named v1 hierarchies; ignore
    layout.swap_accounting = Exists("/sys/fs/cgroup/init.scope/memory.swap.max") ||
                             Exists("/sys/fs/cgroup/system.slice/memory.swap.max") ||
                             Exists("/sys/fs/cgroup/user.slice/memory.swap.max");
  } else if (!layout.v1_mounts.empty()) {
    layout.mode = layout.v2_mount.empty() ? CgroupMode::kV1 : CgroupMode::kHybrid;
    auto memory = layout.v1_mounts.find("memory");
    layout.swap_accounting =
        memory != layout.v1_mounts.end() && Exists(memory->second + "/memory.memsw.limit_in_bytes");
  } else if (!layout.v2_mount.empty()) {
    layout.mode = CgroupMode::kV2;
  } else {
    return absl::UnavailableError("no cgroup filesystem is mounted (see /proc/self/mountinfo)");
  }
  return layout;
}

std::vector<std::string> CgroupDirs(const CgroupLayout& layout, const std::string& path) {
  return HierarchyDirs(layout, path);
}

absl::StatusOr<Usage> ReadCgroupUsage(const CgroupLayout& layout, const std::string& path) {
  Usage usage;
  bool any = false;
  int64_t value = 0;
  if (layout.mode == CgroupMode::kV2) {
    std::string dir = layout.v2_mount + path;
    if (ReadInt(dir + "/memory.current", &value)) usage.memory_bytes = value, any = true;
    if (ReadKeyedInt(dir + "/cpu.stat", "usage_usec", &value)) usage.cpu_ms = value / 1000;
    if (ReadInt(dir + "/pids.current", &value)) usage.pids = value;
  } else {
    auto dir = [&](const char* controller) {
      auto it = layout.v1_mounts.find(controller);
      return it == layout.v1_mounts.end() ? std::string("/nonexistent") : it->second + path;
    };
    if (ReadInt(dir("memory") + "/memory.usage_in_bytes", &value)) {
      usage.memory_bytes = value;
      any = true;
    }
    if (ReadInt(dir("cpuacct") + "/cpuacct.usage", &value)) usage.cpu_ms = value / 1000000;
    if (ReadInt(dir("pids") + "/pids.current", &value)) usage.pids = value;
  }
  if (!any) return absl::NotFoundError(absl::StrCat("cgroup ", path, " not found"));
  return usage;
}

std::vector<int> CgroupPids(const CgroupLayout& layout, const std::string& path) {
  std::set<int> pids;
  for (const std::string& dir : HierarchyDirs(layout, path)) {
    std::ifstream in(dir + "/cgroup.procs");
    int pid;
    while (in >> pid) pids.insert(pid);
  }
  return {pids.begin(), pids.end()};
}

absl::Status RemoveCgroup(const CgroupLayout& layout, const std::string& path, int timeout_ms) {
  if (path.empty() || path == "/" || path.find("..") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("refusing to remove cgroup '", path, "'"));
  }
  const int64_t deadline = MonotonicMs() + timeout_ms;
  std::vector<std::string> dirs = HierarchyDirs(layout, path);
  while (true) {
    // SECURITY: only pids inside this container's own cgroup are signalled.
    for (int pid : CgroupPids(layout, path)) ::kill(pid, SIGKILL);
    std::string remaining;
    for (const std::string& dir : dirs) {
      if (!Exists(dir)) continue;
      if (!RemoveCgroupTree(dir) && errno != ENOENT) {
        absl::StrAppend(&remaining, remaining.empty() ? "" : ", ", dir, " (", strerror(errno), ")");
      }
    }
    if (remaining.empty()) return absl::OkStatus();
    if (MonotonicMs() >= deadline) {
      return absl::InternalError(absl::StrCat("cgroup directories remain: ", remaining));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace esb::container
