#include "common/host_memory.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace esb {

int64_t HostMemoryMb() {
  FILE* f = std::fopen("/proc/meminfo", "re");
  if (!f) return 0;
  char line[256];
  long long kb = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, "MemTotal: %lld kB", &kb) == 1) break;
    kb = 0;
  }
  std::fclose(f);
  return kb > 0 ? kb / 1024 : 0;
}

MemoryBudget DeriveMemoryBudget(int64_t host_mb) {
  MemoryBudget b;
  if (host_mb <= 0) return b;
  b.reserve_mb = std::min(std::max<int64_t>(2048, host_mb / 4), host_mb * 3 / 4);
  const int64_t all = std::max<int64_t>(host_mb - b.reserve_mb, 128);
  b.nano_mb = std::clamp<int64_t>(all / 8, 64, 16384);
  b.sandboxes_mb = std::max<int64_t>(all - b.nano_mb, 64);
  b.max_env_mb = std::max<int64_t>(b.sandboxes_mb / 2, 64);
  return b;
}

}  // namespace esb
