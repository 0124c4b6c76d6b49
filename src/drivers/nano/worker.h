// The nano worker side: the fork server (holds one instantiated guest, forks a worker per
// one-shot run or session) and the worker loop (confined by seccomp, serves run/file requests
// on its own socket). Linked into a worker binary together with exactly one guest module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "drivers/nano/wasi_host.h"

namespace esb::nano {

struct ServerOptions {
  int control_fd = 3;
  // Read-only trees: packed images and/or host directories, with their guest mount points.
  std::vector<std::pair<std::string, std::string>> packs;      // (file, mount)
  std::vector<std::pair<std::string, std::string>> host_dirs;  // (dir, mount)
  // Writable, sharing one size cap (images/python-wasm/README.md: /workspace, /tmp, /.esb).
  std::vector<std::string> writable_dirs = {"/workspace", "/tmp", "/.esb"};
  std::vector<Preopen> preopens = {{"/", "/"}};
  std::vector<std::string> args = {""};
  std::vector<std::string> env;
  // Where the guest leaves a structured error (see images/python-wasm/README.md); read and
  // removed after each run.
  std::string result_path = "/.esb/result.json";
  bool seccomp = true;
  // How many confined one-shot workers to keep forked in advance (--spares=N, --no-prefork).
  int spares = 2;
  // One-shot workers run one empty esb_run before their real run (off the critical path when
  // pre-forked). User-visible only through the runner's per-instance counter (nanobuild's
  // runner names the first run's code "<nano>", later ones "<nano:N>").
  bool warm_oneshot = true;
};

// Parses the worker binary's command line (--server --fd=N --pack=FILE:/mount
// --hostdir=DIR:/mount --preopen=NAME:/path --arg=A --env=K=V --result=/path --no-seccomp --no-prefork --spares=N --no-warm).
absl::Status ParseServerArgs(int argc, char** argv, ServerOptions* out);

// Runs the fork server on `options.control_fd` until the driver closes it. Returns the exit code.
int RunForkServer(const ServerOptions& options);

}  // namespace esb::nano
