// The container driver: OCI bundles written by esbd, run by an OCI runtime from the
// distribution (crun or runc; runsc = gVisor as the hardened option). No Docker engine.
//
// Per environment:   <state_dir>/envs/<id>/config.json    OCI bundle (root = image, read-only)
//                                         /run/agent.sock the agent's listening socket, bound
//                                                         by esbd in a root-only directory and
//                                                         handed to the agent as fd 3 (crun,
//                                                         runc). runsc: run/ is a 16 MiB tmpfs
//                                                         (uid 1000) bound at /run/esb.
//                                         /agent.log      container stdio until the agent is
//                                                         up (start-up errors only, capped)
//                                         /runtime.log    the runtime's own diagnostics
//                                         /container.pid  init pid from the runtime
//                                         /current.json   runsc: pid of the container now
//                                                         running under the id (after a
//                                                         restore from a step's image)
//                                         /images/<hex>/  runsc: a step's checkpoint image
//                                                         (0700; removed with the step)
// Runtime state:     <state_dir>/runtime/<crun|runc|runsc>/   (--root)
// Shared files:      /run/entersandbox/share-<hash(state_dir)>/ (a tmpfs of its own, so
//                    mountinfo inside a sandbox shows no host path; outside the 0700 state
//                    directory, so a runtime inside a user namespace can reach it):
//                    esb-agent-<hash>-x (0711: PID 1 becomes non-dumpable), the hostname file
//                    bound at /etc/hostname, and the start-up probe's bundle
// cgroups:           <cgroup_parent>/<hash(state_dir)>-<id> in every hierarchy
// User namespaces:   <userns_registry>/<first host id> (host-wide, shared by every esbd on
//                    the host): one file per allocated uid range, holding the owning
//                    environment directory; the environment runs with sandbox uids 0..65533
//                    mapped to host ids <first host id> + (0..65533), where first host id =
//                    userns_uid_base + slot * 65536 (recorded as "userns_host_id").
// Containers run detached: they are not esbd's children and survive a daemon restart.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb {

struct ContainerDriverOptions {
  std::string state_dir;
  std::string agent_binary;                   // static esb-agent, bound at /sbin/esb-agent
  std::map<std::string, std::string> images;  // image name -> rootfs directory
  std::string runtime = "auto";               // auto | crun | runc | runsc
  // Additions beyond the original brief (all optional):
  std::string cgroup_parent = "/esb";  // containers' cgroups live below this path
  int agent_timeout_ms = 20000;        // Create: wait this long for the agent's first ping
  int runtime_timeout_ms = 30000;      // deadline of each runtime invocation
  bool probe = true;                   // start a trivial container in NewContainerDriver
  // gVisor step memory (`runsc checkpoint` after each step, docs/design.md "Time travel"): an
  // image larger than this is not kept (the step's memory is "none", the environment runs
  // on), and each checkpoint or restore is killed after step_snapshot_timeout_ms.
  int64_t max_step_image_mb = 1024;
  int step_snapshot_timeout_ms = 30000;
  // Largest pids limit one environment may have (Create answers InvalidArgument above it).
  int64_t max_pids = 4096;
  // pids.max of cgroup_parent, over all sandboxes together. 0: half of min(kernel.pid_max,
  // kernel.threads-max), so sandboxes can never take the host's last pids.
  int64_t total_pids = 0;
  // Largest memory_mb / disk_mb of one environment (Create answers InvalidArgument above).
  // 0: DeriveMemoryBudget(host RAM).max_env_mb (common/host_memory.h).
  int64_t max_memory_mb = 0;
  int64_t max_disk_mb = 0;
  // Memory limit (MiB) of cgroup_parent, over all sandboxes together (their /workspace, /tmp
  // and /dev/shm tmpfs pages included), so that their memory pressure ends in an OOM inside
  // cgroup_parent, never a host-wide one. 0: DeriveMemoryBudget(host RAM).sandboxes_mb.
  int64_t total_memory_mb = 0;
  // User namespaces (crun/runc only): every environment gets its own range of 65536 host uids
  // and gids, slot N = [userns_uid_base + N * 65536, +65534), allocated in userns_registry.
  // userns_uid_base must be a multiple of 65536 (ranges of all daemons stay aligned).
  // Off, or where the host or runtime cannot do it, sandboxes run with host uids as before
  // (UsernsStatus says why).
  bool user_namespaces = true;
  uint32_t userns_uid_base = 0x70000000;  // 1879048192; slots up to 0x7fffffff by default
  uint32_t userns_slots = 4096;
  std::string userns_registry = "/run/entersandbox/userns";
};

// Whether a container driver puts sandboxes in user namespaces, and why not when it does not.
struct UsernsStatus {
  bool enabled = false;
  std::string reason;  // what was probed / why it is off
};
// The status of a driver made by NewContainerDriver (disabled "not a container driver" else).
UsernsStatus ContainerUsernsStatus(const Driver& driver);

// Probes the host (starts a trivial container under a deadline) and returns a driver for the
// first runtime that works: "auto" tries crun, then runc. runtime "runsc" gives the gVisor
// driver (name() "gvisor"); Unavailable with the reason when a runtime cannot work here.
absl::StatusOr<std::unique_ptr<Driver>> NewContainerDriver(ContainerDriverOptions options);

// Test helper: everything a destroyed environment could have left behind — live processes
// of its container, mounts mentioning its directory in /proc/self/mountinfo, cgroup
// directories, its environment directory and the runtime's state. Empty when clean.
std::vector<std::string> FindContainerLeaks(const ContainerDriverOptions& options,
                                            const InstanceRef& ref);

}  // namespace esb
