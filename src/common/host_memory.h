// The host's RAM and the memory budget of all sandboxes derived from it (one place for the
// arithmetic: the daemon config, the container driver and the tests use it).
#pragma once

#include <cstdint>

namespace esb {

// MemTotal from /proc/meminfo in MiB; 0 if unreadable.
int64_t HostMemoryMb();

struct MemoryBudget {
  int64_t reserve_mb = 0;    // kept for the host and esbd: max(2 GiB, 25% of RAM)
  int64_t sandboxes_mb = 0;  // memory limit of the container sandboxes' cgroup parent (/esb)
  int64_t nano_mb = 0;       // memory limit of the nano fork server's cgroup (esb-nano)
  int64_t max_env_mb = 0;    // largest memory_mb (and disk_mb) of one environment
};

// reserve = max(2048, host/4) (at most host*3/4); the rest is split between the container
// sandboxes and the nano tier (1/8, at most 16 GiB); one environment may have half of the
// sandboxes' share. All values are >= 64 MiB; host_mb <= 0 gives all zeros.
MemoryBudget DeriveMemoryBudget(int64_t host_mb);

}  // namespace esb
