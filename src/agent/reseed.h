// The `reseed` op's machinery (docs/agent-protocol.md, "reseed"): after a restore, every clone
// of a snapshot starts with the same kernel RNG state and the same userspace generators;
// mixing fresh host-provided bytes into the kernel pool makes them diverge, and hooks tell the
// userspace processes that cache entropy.
//
// Kernel: RNDADDENTROPY (mixes and credits the bytes; needs CAP_SYS_ADMIN), else a plain write
// to /dev/urandom (mixes without credit; anyone may), then RNDRESEEDCRNG (reseeds the CRNG from
// the pool at once; CAP_SYS_ADMIN, Linux ≥ 4.17; newer kernels reseed on credited entropy
// anyway). Each mechanism is reported with what happened.
// Userspace: processes that seeded a generator from the kernel once and keep its state
// (Python's `random`, numpy's default generator, a language runtime's hash seed) do not see
// the kernel change. The op runs the hooks registered with AddHook, in order, and reports
// each one; a hook is the extension point for such a process (e.g. signal the Python kernel
// process to call random.seed()). Nothing is registered by default.
//
// No Abseil: the agent is a static binary.
#pragma once

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace esb::agent {

struct ReseedStep {
  std::string name;    // "RNDADDENTROPY", "write /dev/urandom", "RNDRESEEDCRNG", or a hook's
  std::string status;  // "ok", "skipped" (not needed), or "failed"
  std::string detail;  // why it failed/skipped ("Operation not permitted"), or a hook's note
  std::string errno_name;
};

struct ReseedResult {
  bool ok = false;  // the bytes reached the kernel pool (RNDADDENTROPY or the write worked)
  std::string error;
  std::string errno_name;
  std::vector<ReseedStep> kernel;
  std::vector<ReseedStep> hooks;
};

class Reseeder {
 public:
  static constexpr size_t kMinBytes = 16;
  static constexpr size_t kMaxBytes = 4096;

  // Returns true when the hook did its work; `detail` (optional) says what it did or why not.
  using Hook = std::function<bool(std::string* detail)>;

  explicit Reseeder(std::string device = "/dev/urandom") : device_(std::move(device)) {}

  // Runs after the kernel steps of every later Reseed, in registration order. Thread-safe.
  void AddHook(std::string name, Hook hook);

  // Mixes `host_bytes` (kMinBytes..kMaxBytes of fresh randomness from the host; EINVAL
  // otherwise) into the kernel pool, then runs the hooks. Thread-safe; calls are serialised.
  ReseedResult Reseed(std::string_view host_bytes);

 private:
  const std::string device_;
  std::mutex mu_;
  std::vector<std::pair<std::string, Hook>> hooks_;
};

}  // namespace esb::agent
