// Builds the OCI runtime config (config.json) of one sandbox container.
#pragma once

#include <boost/json.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace esb::container {

struct BindMount {
  std::string source;       // host path
  std::string destination;  // path inside the container
  bool readonly = true;
};

// A persistent volume's host mount bound into the sandbox below /mnt.
struct VolumeBind {
  std::string source;       // host path (the volume's file system, mounted by the driver)
  std::string destination;  // below /mnt inside the container
  bool readonly = false;
  // crun's idmapped bind: files keep their on-disk ids whatever the sandbox's uid range is.
  bool idmap = false;
};

// Where a governed sandbox finds its trust bundle (Debian's system bundle path).
inline constexpr char kCaBundleMountpoint[] = "/etc/ssl/certs/ca-certificates.crt";

// One extent of a user namespace's uid or gid map (OCI linux.uidMappings/gidMappings).
struct IdMapping {
  uint32_t container_id = 0;
  uint32_t host_id = 0;
  uint32_t size = 0;
};

struct BundleParams {
  std::string rootfs;  // absolute host path of the image directory (mounted read-only)
  std::vector<std::string> args = {"/sbin/esb-agent"};
  std::vector<std::string> env;  // "KEY=value"
  std::string cwd = "/";
  uint32_t uid = 1000;
  uint32_t gid = 1000;
  // Non-empty: the container gets a user namespace with this map for both uids and gids, and
  // uid/gid above (and the tmpfs uid=/gid= options) are ids inside it. Empty: no user namespace.
  std::vector<IdMapping> id_mappings;
  std::string hostname = "sandbox";

  int64_t memory_bytes = 512LL << 20;
  bool limit_swap = true;  // memory+swap = memory (only where swap accounting exists)
  int64_t pids = 256;
  double cpu = 1.0;  // cores; quota = cpu * period
  int64_t workspace_bytes = 1024LL << 20;
  int64_t tmp_bytes = 256LL << 20;
  int64_t shm_bytes = 64LL << 20;
  int64_t nofile = 4096;
  std::string cgroups_path;  // absolute, e.g. "/esb/<id>"
  bool cgroup_namespace = true;
  bool mqueue = true;  // mount /dev/mqueue

  std::string run_dir;          // host dir bound at /run/esb ("" = none; runsc only)
  int64_t run_tmpfs_bytes = 0;  // else: a tmpfs of this size (uid/gid, 0700) at /run/esb
  std::string agent_binary;     // host file bound read-only at /sbin/esb-agent ("" = none)
  std::string hostname_file;    // host file bound read-only at /etc/hostname ("" = none)
  // Host file bound read-only at /usr/lib/esb/kernel.py: the heavy tier's Python kernel
  // (drivers/heavy_kernel.h), code the sandbox runs but cannot change ("" = none).
  std::string python_kernel_file;
  std::vector<BindMount> extra_binds;
  // Non-empty: the container joins this network namespace (made by esbd with loopback only,
  // drivers/container/netns.h) instead of getting a fresh one.
  std::string netns_path;
  // With netns_path and id_mappings: the user namespace esbd made with those mappings, which
  // owns that network namespace (netns.h); the runtime joins it instead of creating one.
  std::string userns_path;
  // Host file bound read-only over /etc/ssl/certs/ca-certificates.crt: a governed sandbox's
  // trust bundle (the system roots + its environment's CA) ("" = none).
  std::string ca_bundle_file;
  // Non-empty: /mnt is a small tmpfs of the sandbox's own (the image is read-only, so the
  // runtime makes the mount points there) and each volume is bound at its destination.
  std::vector<VolumeBind> volume_binds;
  bool seccomp = true;
  bool seccomp_explicit_denies = true;
  // clone3 -> ENOSYS (glibc then falls back to the filtered clone). gVisor ignores per-rule
  // errno values (the agent's first pthread_create fails with EPERM) but does not implement
  // clone3 itself, so for runsc the rule is left out and clone3 is allowed to reach ENOSYS.
  bool seccomp_clone3_enosys = true;
};

// Paths the image must provide as mount points (the rootfs is read-only, so the runtime
// cannot create them): directories end with '/'.
std::vector<std::string> RequiredMountpoints(const BundleParams& params);

boost::json::object BuildOciConfig(const BundleParams& params);

}  // namespace esb::container
