// The nano worker's seccomp allowlist: what the WASI host and wasm2c runtime need, nothing else.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::nano {

// Applies the allowlist to the calling process (anything else kills the process with SIGSYS).
// Requires no_new_privs (or CAP_SYS_ADMIN). `allow_fork`: permit clone(CLONE_PARENT|SIGCHLD)
// and prctl(PR_SET_PDEATHSIG), used by session snapshots.
absl::Status ApplyWorkerSeccomp(bool allow_fork);

// The same filter as classic BPF, built once (by the fork server) and loaded per worker with
// LoadSeccompBpf (no libseccomp work in the hot path).
absl::StatusOr<std::string> BuildWorkerSeccompBpf(bool allow_fork);
absl::Status LoadSeccompBpf(const std::string& bpf);

}  // namespace esb::nano
