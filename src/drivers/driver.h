// The one interface every isolation driver implements (container, nano, microvm).
// The core decides *what* happens to an environment; a driver only knows *how* to do it in
// its isolation technology. Drivers never run user code in esbd's process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "common/env_types.h"
#include "common/util.h"
#include "drivers/step_state.h"

namespace esb {

// What an environment may reach over the network. Today only kNone (no network namespace
// route at all); the egress-governance work adds the governed kinds and their rules here.
// What the driver must build for an environment's network. kNone: loopback only, nothing else.
// kGoverned (capability kEgress): loopback only too, in a network namespace the driver keeps
// (so a listener can be opened in it for the egress proxy, core/egress.h); what may be reached
// is the proxy's business (governance/policy.h), never the driver's.
struct NetworkPolicy {
  enum class Kind { kNone, kGoverned };
  Kind kind = Kind::kNone;
  // kGoverned: the environment's CA certificate (PEM, public), for the sandbox's trust bundle.
  // Set by the core before Create; not stored in the spec (the core keeps it with the policy).
  std::string ca_cert_pem;

  bool operator==(const NetworkPolicy&) const = default;
};
// "none" | "governed" <-> NetworkPolicy::Kind, at the storage edge (the API shows the policy).
std::string_view NetworkPolicyName(const NetworkPolicy& policy);
std::optional<NetworkPolicy> ParseNetworkPolicy(std::string_view name);

// A persistent volume mounted into an environment (issue 11). The API gives name, path and
// read_only; the core resolves the tenant's volume and fills key and size_mb.
struct VolumeMount {
  std::string name;  // the volume's name within its tenant ([a-z0-9-]{1,63})
  std::string path;  // mount point inside the sandbox (core/volumes.h: ValidateVolumePath)
  bool read_only = false;
  std::string key;  // the driver's name for it: "<tenant hash>/<name>" (VolumeKey)
  int64_t size_mb = 0;

  bool operator==(const VolumeMount&) const = default;
};

// What an environment is asked to be. Validated by the API layer before it gets here.
struct EnvSpec {
  std::string image = "default";
  DriverKind runtime = DriverKind::kContainer;
  double cpu = 1.0;                   // CPU cores (CFS quota)
  int64_t memory_mb = 512;
  int64_t pids = 256;
  int64_t disk_mb = 1024;             // size cap of /workspace
  std::map<std::string, std::string> env;
  NetworkPolicy network;
  std::vector<VolumeMount> volumes;  // capability kVolumes
};

// A live environment as the driver knows it. `state` is the driver's own serialised data
// (JSON), stored in SQLite so a restarted daemon can re-attach.
struct InstanceRef {
  std::string id;          // environment id
  std::string driver;      // driver name
  std::string state;       // driver-private JSON
};

struct ExecRequest {
  std::string command;
  std::chrono::milliseconds timeout{60000};
  int64_t max_output_bytes = 1 << 20;  // per stream
  std::map<std::string, std::string> env;
  // Bytes the command reads on stdin (then EOF); none: stdin is at EOF from the start.
  std::optional<std::string> stdin_data;
};

enum class Stream { kStdout = 1, kStderr = 2 };
// Called for each output chunk as it arrives (from the thread that called Exec), and with an
// empty chunk at least every ~250 ms while the command is silent (a liveness tick).
// Returning false cancels the command (e.g. the SSE client went away).
using OutputSink = std::function<bool(Stream, std::string_view)>;

struct ExecResult {
  int exit_code = -1;
  bool timed_out = false;
  bool truncated = false;
  int64_t duration_ms = 0;
  std::string stdout_data;
  std::string stderr_data;
};

struct FileEntry {
  std::string name;
  std::string type;  // file | dir | symlink | other
  int64_t size = 0;
  uint32_t mode = 0;
  int64_t mtime_ms = 0;
};

// A directory's entries; `truncated` when the listing was cut at the protocol's limit
// (proto::kMaxListEntries entries).
struct DirListing {
  std::vector<FileEntry> entries;
  bool truncated = false;
};

struct FileChunk {
  std::string data;
  int64_t file_size = 0;  // size of the whole file
  bool eof = false;
};

struct Usage {
  int64_t memory_bytes = 0;
  int64_t cpu_ms = 0;
  int64_t pids = 0;
  bool alive = false;
};

// A file the run produced inside the sandbox (a figure, a file under /workspace/artifacts),
// as the guest reported it: sandbox-controlled text, bounded but not trusted.
struct ReportedArtifact {
  std::string path;  // inside the sandbox
  std::string name;
  std::string kind;  // image | file
  std::string mime_type;
  std::string title;
  std::string error;  // non-empty: the guest could not capture it (and says why)
};

// One Python run (POST /run, POST /environments/{id}/run), whatever tier serves it: a nano
// session or one-shot interpreter, or the heavy tier's Python kernel (kernel.py) in a sandbox.
struct RunRequest {
  std::string code;
  int64_t timeout_ms = 0;        // 0: driver default
  int64_t memory_limit_mb = 0;   // 0: driver default (sessions: fixed at Create)
  int64_t max_output_bytes = 0;  // per stream; 0: driver default
  // Heavy kernel: run the cell in a fresh process (one-shot) instead of the environment's
  // persistent kernel, and the formats figures are saved in.
  bool once = false;
  std::vector<std::string> figure_formats{"png"};
  // Called with the artifacts a run reported, before the driver removes its staging files,
  // so the caller can copy them out of the sandbox.
  std::function<void(const std::vector<ReportedArtifact>&)> on_artifacts;
  // Test programs only: argv for this run (empty: the driver's argv).
  std::vector<std::string> argv;
  // Tests only (honoured by test worker binaries): the guest is never interrupted, so only the
  // driver's SIGKILL backstop can stop it.
  bool test_no_interrupt = false;
};

struct RunError {
  std::string type;  // e.g. "ZeroDivisionError"
  std::string message;
  std::string traceback;
};

struct RunResult {
  std::string stdout_data;
  std::string stderr_data;
  int exit_code = -1;
  int64_t duration_ms = 0;
  double duration_exact_ms = 0;  // guest run time measured in the worker (nano)
  bool timed_out = false;
  bool truncated = false;
  std::optional<RunError> error;
  // Non-empty when the run failed on something nano cannot provide: a module name ("numpy")
  // for an import, or a feature ("socket", "subprocess", "threads", "signal", "ctypes").
  std::string unsupported_module;
  // The guest instance was discarded (timeout, trap, exit): a session lost its globals.
  bool instance_reset = false;
  // Heavy kernel only: the repr of the final expression, whether the kernel had to be killed
  // (its state is gone), a final DataFrame/Series as a table (JSON object text, empty: none),
  // and the artifacts the cell reported.
  bool kernel = false;
  std::optional<std::string> value;
  bool kernel_restarted = false;
  std::string table_json;
  std::vector<ReportedArtifact> artifacts;
  // The output already went to the caller's sink as it was produced.
  bool streamed = false;
};

// A process started inside an instance (Driver::SpawnProcess): with pipes for stdin, stdout and
// stderr (capability kProcesses: e.g. an MCP server hosted in the sandbox, core/mcp_hosts), or
// on a PTY (capability kTerminal: the interactive shell of core/terminal.cc). It runs as the
// sandbox user in its own process group and dies with the instance.
struct ProcessRequest {
  std::vector<std::string> argv;  // run directly (argv[0] looked up in PATH); not empty
  std::map<std::string, std::string> env;
  std::string cwd;  // relative to /workspace; empty: /workspace
  bool pty = false;
  int rows = 24, cols = 80;  // with pty: 1-1000 each
};

// One running process. Thread-safe: one thread may Wait (the output) while others call Input,
// Resize or Kill. Destroying it kills the process and everything it started.
class ProcessSession {
 public:
  virtual ~ProcessSession() = default;
  // Bytes for its stdin (or the PTY: keystrokes); `eof` closes stdin afterwards. Unavailable
  // when the guest's input queue is full (retry later) or the instance is gone.
  virtual absl::Status Input(std::string_view data, bool eof = false) = 0;
  // PTY only (InvalidArgument otherwise).
  virtual absl::Status Resize(int rows, int cols) = 0;
  // Delivers the output to `sink` (stdout and stderr apart; a PTY's is all Stream::kStdout) until
  // the process exits (its exit code, 128+N for signal N) or `timeout_ms` passes (nullopt:
  // still running). The sink returning false ends this wait early (nullopt), not the process.
  // One Wait at a time.
  virtual absl::StatusOr<std::optional<int>> Wait(int timeout_ms, const OutputSink& sink) = 0;
  // Kills the process and everything it started. Idempotent.
  virtual absl::Status Kill() = 0;
};

// What a driver can do beyond the basic lifecycle. The core checks these before calling
// and refuses a missing one with MissingCapabilityError (a 4xx naming it); the default
// implementations below answer the same error, so nothing is ever silently a no-op.
enum class Capability {
  kExec,           // shell commands (Exec)
  kFiles,          // WriteFile / ReadFile / ListDir
  kPythonSession,  // RunCode on an environment (state persists between runs)
  kPythonOneShot,  // RunCode without an environment (a fresh interpreter, thrown away)
  kSnapshot,       // Snapshot + Restore
  kFork,           // Fork a live environment into a second one
  kPause,          // Pause + Resume
  kEgress,         // a governed network (NetworkPolicy other than none)
  kTerminal,       // interactive PTY sessions (SpawnProcess with pty)
  kVolumes,        // persistent volumes (CreateVolume/DeleteVolume, EnvSpec::volumes)
  kSteps,          // time travel: CaptureStep + RestoreStep (step_state.h)
  kProcesses,      // long-lived processes with stdio pipes (SpawnProcess without pty)
};
inline constexpr Capability kAllCapabilities[] = {
    Capability::kExec,          Capability::kFiles,    Capability::kPythonSession,
    Capability::kPythonOneShot, Capability::kSnapshot, Capability::kFork,
    Capability::kPause,         Capability::kEgress,   Capability::kTerminal,
    Capability::kVolumes,       Capability::kSteps,    Capability::kProcesses};
std::string_view CapabilityName(Capability capability);  // "exec", "python_session", ...

class CapabilitySet {
 public:
  CapabilitySet() = default;
  CapabilitySet(std::initializer_list<Capability> caps) {
    for (Capability c : caps) Add(c);
  }
  CapabilitySet& Add(Capability c) {
    bits_ |= Bit(c);
    return *this;
  }
  bool Has(Capability c) const { return (bits_ & Bit(c)) != 0; }
  std::vector<std::string> Names() const;  // for /healthz and messages

 private:
  static uint32_t Bit(Capability c) { return 1u << static_cast<int>(c); }
  uint32_t bits_ = 0;
};

// The refusal of an operation the environment's driver cannot do: Unimplemented (a 400 at the
// API) whose message names the driver and the capability; marked so callers can tell it.
absl::Status MissingCapabilityError(std::string_view driver, Capability capability);
bool IsMissingCapability(const absl::Status& status);

// Errors use absl canonical codes, which the API maps to HTTP with HttpStatusFor
// (common/util.h; e.g. NotFound → 404, InvalidArgument → 400, Unavailable → 503).
// Attach's answer for an instance that is alive but was created by an older esbd whose
// sandbox layout lacks protections the current one relies on (so it must not be adopted).
// The core destroys such an instance and records destroy_reason "sandbox_outdated".
inline constexpr char kSandboxOutdatedPayload[] = "type.entersandbox/sandbox_outdated";
inline absl::Status SandboxOutdatedError(const std::string& message) {
  absl::Status status = absl::FailedPreconditionError(message);
  status.SetPayload(kSandboxOutdatedPayload, absl::Cord("1"));
  return status;
}
inline bool IsSandboxOutdated(const absl::Status& status) {
  return status.GetPayload(kSandboxOutdatedPayload).has_value();
}

class Driver {
 public:
  virtual ~Driver() = default;

  virtual std::string name() const = 0;
  // What this driver can do (see Capability); the core refuses the rest.
  virtual CapabilitySet Capabilities() const = 0;
  // Human-readable description of the backend in use (e.g. "crun 1.8.1 (cgroup v1)").
  virtual std::string Describe() const = 0;

  // Creates and starts an environment ready to execute. Must clean up after itself on failure.
  virtual absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) = 0;
  // Destroys everything the instance owns (processes, mounts, cgroups, directories).
  // Idempotent: destroying a dead or half-created instance succeeds.
  virtual absl::Status Destroy(const InstanceRef& ref) = 0;
  // After a daemon restart: checks the instance is still alive and usable. An instance whose
  // sandbox layout is older than the driver's answers SandboxOutdatedError.
  virtual absl::Status Attach(const InstanceRef& ref) = 0;

  virtual absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& request,
                                          const OutputSink& sink) = 0;
  // Writes `data` at `offset` (truncating first when `truncate`); parent dirs are created.
  virtual absl::Status WriteFile(const InstanceRef& ref, const std::string& path,
                                 std::string_view data, int64_t offset, bool truncate) = 0;
  virtual absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path,
                                             int64_t offset, int64_t length) = 0;
  virtual absl::StatusOr<DirListing> ListDir(const InstanceRef& ref, const std::string& path) = 0;
  // The files API's other operations (docs/api.md "Files"). Stat follows read's path rules;
  // MakeDir, Remove and Rename act only inside /workspace and never follow a symlink.
  // Stat: the entry at `path` (its `name` is the last component). NotFound when absent.
  virtual absl::StatusOr<FileEntry> Stat(const InstanceRef& ref, const std::string& path) = 0;
  // mkdir -p: true when created, false when `path` already was a directory.
  virtual absl::StatusOr<bool> MakeDir(const InstanceRef& ref, const std::string& path) = 0;
  // A file, symlink or empty directory; with `recursive` a whole tree.
  virtual absl::Status Remove(const InstanceRef& ref, const std::string& path, bool recursive) = 0;
  // Without `overwrite` an existing destination is AlreadyExists.
  virtual absl::Status Rename(const InstanceRef& ref, const std::string& source,
                              const std::string& destination, bool overwrite) = 0;
  virtual absl::StatusOr<Usage> Stats(const InstanceRef& ref) = 0;
  // Sets the base environment variables of an instance (used when a pooled instance is
  // handed to a request with its own `env`).
  virtual absl::Status Configure(const InstanceRef& ref,
                                 const std::map<std::string, std::string>& env) = 0;

  // Runs Python: in environment `ref` (kPythonSession), or with `ref` == nullptr in a fresh
  // interpreter thrown away afterwards (kPythonOneShot). Output goes to `sink` as it comes
  // when the driver can stream it (RunResult::streamed), else it is only in the result.
  virtual absl::StatusOr<RunResult> RunCode(const InstanceRef* ref, const RunRequest& request,
                                            const OutputSink& sink);
  // kSnapshot: captures `ref` (what `content` asks for) / starts a new instance `new_id` from
  // a snapshot / discards one.
  virtual absl::StatusOr<SnapshotRef> Snapshot(const InstanceRef& ref, SnapshotContent content);
  virtual absl::StatusOr<InstanceRef> Restore(const SnapshotRef& snapshot,
                                              const std::string& new_id);
  virtual absl::Status DeleteSnapshot(const SnapshotRef& snapshot);
  // kFork: a live copy of `source` as a new, independent instance `new_id`.
  virtual absl::StatusOr<InstanceRef> Fork(const InstanceRef& source, const std::string& new_id);
  // kPause: stops / restarts the instance's processes without losing their state.
  virtual absl::Status Pause(const InstanceRef& ref);
  virtual absl::Status Resume(const InstanceRef& ref);
  // kVolumes: makes the empty volume `key` (VolumeMount::key) with a hard cap of `size_mb`
  // (AlreadyExists when it exists) / deletes it and its contents (Aborted while an
  // instance mounts it; OK when it does not exist). Mounting is Create's (EnvSpec::volumes).
  virtual absl::Status CreateVolume(const std::string& key, int64_t size_mb);
  virtual absl::Status DeleteVolume(const std::string& key);
  // kSteps (time travel, docs/design.md "Time travel"; types in step_state.h). The core calls
  // these with the environment's operations quiesced (no other call on `ref` in flight).
  // CaptureStep: the state of `ref` after a step — /workspace as a manifest whose new file
  // contents go into `blobs`, the shell state, the Python variables' summary and, when
  // options.memory and StepMemory().available, an honest memory snapshot.
  virtual absl::StatusOr<StepState> CaptureStep(const InstanceRef& ref,
                                                const CaptureOptions& options, BlobStore& blobs);
  // Rewind in place: makes `ref` what `state` was (with state.memory: memory and disk come
  // back; without: /workspace exactly as the manifest says, the shell state restored, the
  // Python session restarted fresh). Returns the instance's ref afterwards: a driver whose
  // restore replaces the instance (same id) returns the new ref and has destroyed the old one.
  virtual absl::StatusOr<InstanceRef> RestoreStep(const InstanceRef& ref, const StepState& state,
                                                  BlobStore& blobs);
  // Fork of a step: a new, independent instance `new_id` (created with `spec`, the source's)
  // at `state`; several forks of one state are independent. Default: Create + RestoreStep.
  virtual absl::StatusOr<InstanceRef> ForkStep(const StepState& state, const EnvSpec& spec,
                                               const std::string& new_id, BlobStore& blobs);
  // Moves a live memory snapshot (SnapshotRef::live) to compact storage (e.g. page diffs on
  // disk) and returns its new ref; the old one is released. Default: Unimplemented (the core
  // then releases snapshots it cannot keep live, and the step's memory becomes "none").
  virtual absl::StatusOr<SnapshotRef> CompactSnapshot(const SnapshotRef& snapshot);
  // What memory capture this driver has on this host (and why not). Default: none.
  virtual StepMemorySupport StepMemory() const;
  // Ids of live memory snapshots taken from instance `source_id` that the driver compacted or
  // released on its own (e.g. over a host memory budget). The core reconciles each through
  // CompactSnapshot (→ the compact form, or an error: the step's memory is "collected").
  // HasReleasedSnapshots: whether any instance has some (the reaper then visits them).
  // Default: none.
  virtual std::set<std::string> ReleasedSnapshots(const std::string& source_id);
  virtual bool HasReleasedSnapshots();

  // kProcesses (pipes) / kTerminal (request.pty): starts request.argv in the instance as the
  // sandbox user. The default refuses with the missing capability.
  virtual absl::StatusOr<std::unique_ptr<ProcessSession>> SpawnProcess(
      const InstanceRef& ref, const ProcessRequest& request);

  // kEgress: a new listening TCP socket on 127.0.0.1:3128 inside the network namespace of the
  // kGoverned environment `ref`, for the egress proxy (core/egress.h). Each call opens a fresh
  // one (the previous one may have died with a proxy); the caller owns the descriptor.
  virtual absl::StatusOr<UniqueFd> OpenEgressListener(const InstanceRef& ref);
  // kEgress: a new TCP socket created inside the network namespace of the kGoverned
  // environment `ref` and connected there to its egress listener 127.0.0.1:3128 (so the proxy
  // sees the connection as that environment's own egress), within `timeout`. For esbd's
  // fetches on the environment's behalf (packages); the caller owns the descriptor. The
  // socket that took the connection must be owned by one of `owners` (the listener's maker
  // and the proxy that accepts on it), else PermissionDenied: a sandbox process may bind the
  // port while the proxy is down.
  virtual absl::StatusOr<UniqueFd> ConnectEgressProxy(const InstanceRef& ref,
                                                      std::chrono::milliseconds timeout,
                                                      const std::vector<uid_t>& owners);
};

}  // namespace esb
