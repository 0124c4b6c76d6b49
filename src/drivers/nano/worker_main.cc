// esb-nano-worker / nano-test-worker: the fork server process that esbd's nano driver starts.
// The guest module is whatever was linked in (see guest.h).
#include <cstdio>

#include "drivers/nano/worker.h"

int main(int argc, char** argv) {
  esb::nano::ServerOptions options;
  if (absl::Status s = esb::nano::ParseServerArgs(argc, argv, &options); !s.ok()) {
    fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  return esb::nano::RunForkServer(options);
}
