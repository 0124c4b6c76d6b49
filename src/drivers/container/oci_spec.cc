#include "drivers/container/oci_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "drivers/container/seccomp_profile.h"

namespace esb::container {
namespace {

using boost::json::array;
using boost::json::object;

array Strings(const std::vector<std::string>& v) {
  array a;
  for (const std::string& s : v) a.emplace_back(s);
  return a;
}

object Mount(const std::string& dest, const std::string& type, const std::string& source,
             std::vector<std::string> options) {
  return {{"destination", dest}, {"type", type}, {"source", source}, {"options", Strings(options)}};
}

std::string SizeOpt(int64_t bytes) { return absl::StrCat("size=", bytes / 1024, "k"); }

object Device(const char* type, int64_t major, int64_t minor, const char* access) {
  object d = {{"allow", true}, {"type", type}, {"major", major}, {"access", access}};
  if (minor >= 0) d["minor"] = minor;
  return d;
}

}  // namespace

std::vector<std::string> RequiredMountpoints(const BundleParams& p) {
  std::vector<std::string> v = {"proc/", "dev/", "sys/", "tmp/", "run/", "workspace/"};
  if (!p.agent_binary.empty()) v.push_back("sbin/esb-agent");
  if (!p.hostname_file.empty()) v.push_back("etc/hostname");
  if (!p.python_kernel_file.empty()) v.push_back("usr/lib/esb/kernel.py");
  if (!p.ca_bundle_file.empty()) v.push_back(std::string(kCaBundleMountpoint).substr(1));
  for (const BindMount& b : p.extra_binds) {
    if (b.destination.size() > 1) v.push_back(b.destination.substr(1) + "/");
  }
  if (!p.volume_binds.empty()) v.push_back("mnt/");
  return v;
}

object BuildOciConfig(const BundleParams& p) {
  // --- process: unprivileged user, no capabilities, no privilege gain ---
  array no_caps;
  object caps = {{"bounding", no_caps},
                 {"effective", no_caps},
                 {"inheritable", no_caps},
                 {"permitted", no_caps},
                 {"ambient", no_caps}};
  array rlimits = {
      object{{"type", "RLIMIT_NOFILE"}, {"hard", p.nofile}, {"soft", p.nofile}},
      object{{"type", "RLIMIT_CORE"}, {"hard", 0}, {"soft", 0}},
  };
  object process = {
      {"terminal", false},
      {"user", object{{"uid", p.uid}, {"gid", p.gid}, {"additionalGids", array{p.gid}}}},
      {"args", Strings(p.args)},
      {"env", Strings(p.env)},
      {"cwd", p.cwd},
      {"capabilities", caps},
      {"rlimits", rlimits},
      {"noNewPrivileges", true},
      {"oomScoreAdj", 500},
  };

  // --- mounts ---
  array mounts = {
      Mount("/proc", "proc", "proc", {"nosuid", "noexec", "nodev"}),
      Mount("/dev", "tmpfs", "tmpfs", {"nosuid", "strictatime", "mode=755", "size=64k"}),
      Mount("/dev/pts", "devpts", "devpts",
            {"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}),
      Mount("/dev/shm", "tmpfs", "shm",
            {"nosuid", "noexec", "nodev", "mode=1777", SizeOpt(p.shm_bytes)}),
  };
  if (p.mqueue)
    mounts.push_back(Mount("/dev/mqueue", "mqueue", "mqueue", {"nosuid", "noexec", "nodev"}));
  mounts.push_back(Mount("/sys", "sysfs", "sysfs", {"nosuid", "noexec", "nodev", "ro"}));
  mounts.push_back(
      Mount("/tmp", "tmpfs", "tmpfs", {"nosuid", "nodev", "mode=1777", SizeOpt(p.tmp_bytes)}));
  // /run is a small tmpfs so /run/esb needs no mount point in the read-only image.
  mounts.push_back(
      Mount("/run", "tmpfs", "tmpfs", {"nosuid", "nodev", "noexec", "mode=755", "size=1024k"}));
  // The per-environment disk: a size-capped tmpfs. Its pages are charged to the container's
  // memory cgroup, so it cannot be used to escape the memory limit either.
  mounts.push_back(Mount("/workspace", "tmpfs", "tmpfs",
                         {"nosuid", "nodev", SizeOpt(p.workspace_bytes),
                          absl::StrCat("uid=", p.uid), absl::StrCat("gid=", p.gid), "mode=0755"}));
  if (!p.run_dir.empty()) {
    mounts.push_back(
        Mount("/run/esb", "bind", p.run_dir, {"rbind", "nosuid", "nodev", "noexec", "rw"}));
  } else if (p.run_tmpfs_bytes > 0) {
    // The agent's state and log: inside the sandbox only, no host path behind it.
    mounts.push_back(Mount("/run/esb", "tmpfs", "tmpfs",
                           {"nosuid", "nodev", "noexec", "mode=0700", SizeOpt(p.run_tmpfs_bytes),
                            absl::StrCat("uid=", p.uid), absl::StrCat("gid=", p.gid)}));
  }
  if (!p.agent_binary.empty()) {
    mounts.push_back(
        Mount("/sbin/esb-agent", "bind", p.agent_binary, {"bind", "ro", "nosuid", "nodev"}));
  }
  if (!p.hostname_file.empty()) {
    mounts.push_back(Mount("/etc/hostname", "bind", p.hostname_file,
                           {"bind", "ro", "nosuid", "nodev", "noexec"}));
  }
  if (!p.python_kernel_file.empty()) {
    mounts.push_back(Mount("/usr/lib/esb/kernel.py", "bind", p.python_kernel_file,
                           {"bind", "ro", "nosuid", "nodev", "noexec"}));
  }
  if (!p.ca_bundle_file.empty()) {
    mounts.push_back(Mount(kCaBundleMountpoint, "bind", p.ca_bundle_file,
                           {"bind", "ro", "nosuid", "nodev", "noexec"}));
  }
  for (const BindMount& b : p.extra_binds) {
    std::vector<std::string> opts = {"rbind", "nosuid", "nodev"};
    if (b.readonly) opts.push_back("ro");
    mounts.push_back(Mount(b.destination, "bind", b.source, opts));
  }
  if (!p.volume_binds.empty()) {
    mounts.push_back(
        Mount("/mnt", "tmpfs", "tmpfs", {"nosuid", "nodev", "noexec", "mode=755", "size=64k"}));
  }
  for (const VolumeBind& b : p.volume_binds) {
    // Not rbind: nothing mounted below the volume on the host comes along.
    std::vector<std::string> opts = {"bind", "nosuid", "nodev", b.readonly ? "ro" : "rw"};
    if (b.idmap) opts.push_back("idmap");
    mounts.push_back(Mount(b.destination, "bind", b.source, opts));
  }

  // --- namespaces: a fresh network namespace has only loopback (a governed sandbox joins the
  // one esbd made, loopback only as well). With id mappings also a user namespace (created
  // first by the runtime, so it owns all the others but the joined network namespace) ---
  object network = {{"type", "network"}};
  if (!p.netns_path.empty()) network["path"] = p.netns_path;
  array namespaces = {object{{"type", "pid"}}, network, object{{"type", "ipc"}},
                      object{{"type", "uts"}}, object{{"type", "mount"}}};
  if (p.cgroup_namespace) namespaces.push_back(object{{"type", "cgroup"}});
  array id_mappings;
  for (const IdMapping& m : p.id_mappings) {
    id_mappings.push_back(
        object{{"containerID", m.container_id}, {"hostID", m.host_id}, {"size", m.size}});
  }
  if (!id_mappings.empty()) {
    object user = {{"type", "user"}};
    if (!p.userns_path.empty()) user["path"] = p.userns_path;
    namespaces.push_back(user);
  }

  // --- resources ---
  constexpr int64_t kPeriod = 100000;
  int64_t quota = static_cast<int64_t>(std::llround(p.cpu * kPeriod));
  if (quota < 1000) quota = 1000;
  object memory = {{"limit", p.memory_bytes}};
  if (p.limit_swap) memory["swap"] = p.memory_bytes;
  array devices = {
      object{{"allow", false}, {"access", "rwm"}},
      Device("c", 1, 3, "rwm"),     // null
      Device("c", 1, 5, "rwm"),     // zero
      Device("c", 1, 7, "rwm"),     // full
      Device("c", 1, 8, "rwm"),     // random
      Device("c", 1, 9, "rwm"),     // urandom
      Device("c", 5, 0, "rwm"),     // tty
      Device("c", 5, 2, "rwm"),     // ptmx
      Device("c", 136, -1, "rwm"),  // pts
  };
  object resources = {
      {"memory", memory},
      {"pids", object{{"limit", p.pids}}},
      {"cpu", object{{"quota", quota}, {"period", kPeriod}}},
      {"devices", devices},
  };

  object linux_section = {
      {"namespaces", namespaces},
      {"resources", resources},
      {"cgroupsPath", p.cgroups_path},
      {"maskedPaths",
       Strings({"/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
                "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"})},
      {"readonlyPaths",
       Strings({"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"})},
      {"rootfsPropagation", "private"},
  };
  if (!id_mappings.empty()) {
    linux_section["uidMappings"] = id_mappings;
    linux_section["gidMappings"] = id_mappings;
  }
  if (p.seccomp) {
    linux_section["seccomp"] =
        BuildSeccompProfile(p.seccomp_explicit_denies, p.seccomp_clone3_enosys);
  }

  return {
      {"ociVersion", "1.0.2"},
      {"process", process},
      {"root", object{{"path", p.rootfs}, {"readonly", true}}},
      {"hostname", p.hostname},
      {"mounts", mounts},
      {"linux", linux_section},
  };
}

}  // namespace esb::container
