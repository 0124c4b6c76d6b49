// Drives an OCI runtime binary (crun, runc or runsc) as a short-lived child process.
// Every call has a deadline; the runtime never inherits esbd's stdio or other descriptors.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::container {

enum class RuntimeKind { kCrun, kRunc, kRunsc };

const char* RuntimeName(RuntimeKind kind);
bool ParseRuntimeKind(const std::string& name, RuntimeKind* kind);

struct ProcessResult {
  int exit_code = -1;  // -1 when killed by a signal
  int term_signal = 0;
  bool timed_out = false;
  std::string output;  // captured stdout+stderr (when not redirected), at most 64 KiB
};

struct SpawnOptions {
  int timeout_ms = 10000;
  // When >= 0, the child's stdout and stderr go to this fd and nothing is captured.
  int output_fd = -1;
  // Run the child in a private mount namespace in which this cgroup2 mount point is
  // unmounted (lets crun treat a hybrid v1+v2 host as plain v1). Empty: no namespace change.
  std::string hide_mount;
  // When >= 0, this descriptor becomes the child's fd 3 (everything else above 2 is closed).
  int pass_fd = -1;
};

// fork+exec `argv` (argv[0] is an absolute path) with stdin = /dev/null and all other
// descriptors closed. On timeout the child's process group is SIGKILLed.
absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv,
                                         const SpawnOptions& options);

struct ContainerState {
  std::string status;  // creating | created | running | stopped | paused
  int pid = 0;
  std::string bundle;
};

class OciRuntime {
 public:
  // `root` is the runtime's state directory (--root). `hide_mount`: see SpawnOptions.
  OciRuntime(RuntimeKind kind, std::string binary, std::string root, std::string hide_mount);

  RuntimeKind kind() const { return kind_; }
  const std::string& binary() const { return binary_; }
  const std::string& root() const { return root_; }
  // First line of `<binary> --version`, e.g. "crun version 1.8.1".
  std::string Version() const;

  // Creates and starts the container, detached. The container's stdio goes to `log_path`;
  // the runtime's own diagnostics go to `runtime_log_path` (crun/runc) or the same log.
  // Returns the pid of the container's init process (on the host) from --pid-file.
  // `listen_fd` >= 0: handed to the container's init as its fd 3 (`--preserve-fds 1`; crun
  // and runc only, runsc has no such option: InvalidArgument).
  absl::StatusOr<int> RunDetached(const std::string& id, const std::string& bundle,
                                  const std::string& log_path, const std::string& runtime_log_path,
                                  int timeout_ms, int listen_fd = -1) const;
  // runsc only (gVisor): saves the container's whole state (memory and its tmpfs mounts) to
  // `image_dir`; the container is stopped afterwards, whether it worked or not.
  // DeadlineExceeded (the runtime was killed) after `timeout_ms`.
  absl::Status Checkpoint(const std::string& id, const std::string& image_dir,
                          int timeout_ms) const;
  // runsc only: starts container `id` (no container of that id may exist) from a checkpoint
  // image with `bundle`, detached, like RunDetached; returns its pid.
  absl::StatusOr<int> RestoreDetached(const std::string& id, const std::string& bundle,
                                      const std::string& image_dir, const std::string& log_path,
                                      int timeout_ms) const;
  // Runs the container in the foreground until it exits (used by the probe).
  absl::StatusOr<ProcessResult> RunForeground(const std::string& id, const std::string& bundle,
                                              const std::string& log_path, int timeout_ms) const;
  // NotFound when the runtime does not know the container.
  absl::StatusOr<ContainerState> State(const std::string& id, int timeout_ms = 5000) const;
  absl::Status Kill(const std::string& id, const std::string& signal) const;
  // `delete --force`; OK when the container does not exist.
  absl::Status Delete(const std::string& id, int timeout_ms = 10000) const;

 private:
  std::vector<std::string> BaseArgs() const;
  // RunDetached and RestoreDetached: `args` up to the container id; reads the pid file.
  absl::StatusOr<int> StartDetached(std::vector<std::string> args, const std::string& what,
                                    const std::string& id, const std::string& bundle,
                                    const std::string& log_path,
                                    const std::string& runtime_log_path, int timeout_ms,
                                    int listen_fd) const;
  absl::StatusOr<ProcessResult> Invoke(std::vector<std::string> args, int timeout_ms,
                                       int output_fd = -1, int pass_fd = -1) const;

  RuntimeKind kind_;
  std::string binary_;
  std::string root_;
  std::string hide_mount_;
};

// Absolute path of an executable found on PATH (plus /usr/sbin and /sbin), or "".
std::string FindExecutable(const std::string& name);

}  // namespace esb::container
