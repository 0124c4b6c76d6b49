// The `nano` driver: Python (CPython compiled to wasm32-wasi, pre-initialised by Wizer, turned
// into native code by wasm2c) in worker processes forked from a fork server that esbd starts.
// User code never runs in esbd's process: every run happens in a worker confined by seccomp
// (and, when esbd is root, by its own network/IPC/UTS namespaces and uid nobody).
//
// Process model:
//   esbd ──socketpair── fork server (esb-nano-worker --server; holds an instantiated guest)
//     └─ one-shot run:  driver makes a socketpair, passes one end to the server ("spawn"); the
//        server forks a worker that confines itself and serves exactly one "run".
//     └─ session (environment with runtime "nano"): same, but the worker stays alive between
//        runs, so interpreter globals and the in-memory /workspace persist.
//     └─ Fork / Snapshot (Driver interface): the session worker clones itself with
//        CLONE_PARENT: the copy-on-write child has the same interpreter memory and workspace
//        and becomes a sibling that the fork server reaps and can kill. That is how nano
//        memory is copied. A snapshot (memory+disk: interpreter and in-memory /workspace) is
//        such a clone that is never run, held by the driver; Restore forks it again.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "drivers/driver.h"

namespace esb {

struct NanoDriverOptions {
  // The worker binary (one guest linked in) and extra arguments for its fork server, e.g.
  // {"--pack=/path/stdlib.pack:/usr/local/lib/python3.11"}.
  std::string worker_path;
  std::vector<std::string> worker_args;
  int64_t default_timeout_ms = 30000;
  int64_t max_timeout_ms = 600000;
  int64_t default_memory_mb = 256;
  int64_t max_memory_mb = 4095;
  int64_t default_max_output_bytes = 1 << 20;
  // In-memory /workspace cap per instance (also bounded by EnvSpec::disk_mb for sessions).
  int64_t workspace_max_mb = 64;
  int64_t workspace_max_files = 4096;
  // After timeout_ms the guest stops itself (interrupt flag, exit 124); if it has not answered
  // kill_grace_ms later, the worker is SIGKILLed.
  int64_t kill_grace_ms = 1000;
  // Second layer when esbd is root: the fork server and all its workers are put in one cgroup
  // (v2: /sys/fs/cgroup/<name>; v1: memory and pids hierarchies) with these aggregate caps.
  // Empty name or not root: skipped.
  std::string cgroup_name = "esb-nano";
  int64_t cgroup_memory_mb = 16384;
  int64_t cgroup_pids_max = 8192;
  // For plain WASI test programs (no persistent `run` export): argv for every run.
  std::vector<std::string> argv;
  // Time travel: where CompactSnapshot writes its images (created 0700; one 0600 file per
  // image). Empty: CompactSnapshot answers FailedPrecondition (nothing is kept compactly).
  std::string snapshot_dir;
  // Live step snapshots (CaptureStep's frozen clones) are RAM in the nano cgroup. Charged by
  // their PSS (re-measured at every capture of their environment): an environment's together
  // hold at most live_snapshot_env_max_mb (0: its session's memory_mb), all of the driver's at
  // most live_snapshot_max_mb (0: half of cgroup_memory_mb). Over either, the oldest live clone
  // (of that environment, or of any) is compacted to an image, or released when it cannot be.
  int64_t live_snapshot_env_max_mb = 0;
  int64_t live_snapshot_max_mb = 0;
  // Compact images on disk (deflated bytes): per environment and in total. A compaction over
  // either is refused (ResourceExhausted): that step's memory is released ("collected").
  int64_t image_env_max_mb = 1024;
  int64_t image_max_mb = 8192;
};

class NanoDriver : public Driver {
 public:
  explicit NanoDriver(NanoDriverOptions options);
  ~NanoDriver() override;

  std::string name() const override { return "nano"; }
  // Python sessions and one-shot runs, files, fork and snapshots; no shell (Exec), no pause.
  CapabilitySet Capabilities() const override;
  std::string Describe() const override;

  absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) override;
  absl::Status Destroy(const InstanceRef& ref) override;
  absl::Status Attach(const InstanceRef& ref) override;
  absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& request,
                                  const OutputSink& sink) override;
  absl::Status WriteFile(const InstanceRef& ref, const std::string& path, std::string_view data,
                         int64_t offset, bool truncate) override;
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path,
                                     int64_t offset, int64_t length) override;
  absl::StatusOr<DirListing> ListDir(const InstanceRef& ref, const std::string& path) override;
  absl::StatusOr<FileEntry> Stat(const InstanceRef& ref, const std::string& path) override;
  absl::StatusOr<bool> MakeDir(const InstanceRef& ref, const std::string& path) override;
  absl::Status Remove(const InstanceRef& ref, const std::string& path, bool recursive) override;
  absl::Status Rename(const InstanceRef& ref, const std::string& source,
                      const std::string& destination, bool overwrite) override;
  absl::StatusOr<Usage> Stats(const InstanceRef& ref) override;
  absl::Status Configure(const InstanceRef& ref,
                         const std::map<std::string, std::string>& env) override;

  // `POST /run` (session == nullptr: one-shot, fresh interpreter from the snapshot) and
  // `POST /environments/{id}/run` (session: the environment's persistent interpreter). The
  // output is only in the result (nano answers at the end; `sink` is not called).
  absl::StatusOr<RunResult> RunCode(const InstanceRef* session, const RunRequest& request,
                                    const OutputSink& sink) override;

  // Copies a live session (interpreter memory + workspace, copy-on-write) into a new session
  // `new_id`. The copy is independent from then on.
  absl::StatusOr<InstanceRef> Fork(const InstanceRef& source, const std::string& new_id) override;
  // A snapshot is a fork that never runs (memory+disk only: a nano session has nothing else);
  // Restore forks it into a new session; DeleteSnapshot kills it.
  absl::StatusOr<SnapshotRef> Snapshot(const InstanceRef& ref, SnapshotContent content) override;
  absl::StatusOr<InstanceRef> Restore(const SnapshotRef& snapshot,
                                      const std::string& new_id) override;
  absl::Status DeleteSnapshot(const SnapshotRef& snapshot) override;

  // Time travel (kSteps; docs/design.md "Time travel", README.md "Time travel"):
  // CaptureStep: a frozen copy-on-write clone of the session (SnapshotRef::live; `bytes` its
  //   proportional share of memory now, from /proc/<pid>/smaps_rollup Pss), /workspace walked
  //   in that clone (changed files read into `blobs`; unchanged ones, by change key, not read),
  //   and the variables summary (esb_vars.py) run in a throwaway fork of the clone, so the
  //   session itself never runs anything for the capture.
  // RestoreStep: the session becomes a fork of the step's clone (or of its compact image);
  //   the snapshot stays reusable. ForkStep: a new session forked the same way.
  // CompactSnapshot: the clone's whole guest state (4 KiB pages of linear memory that differ
  //   from the instantiated base, the wasm globals, the MemFs, the WASI fd table/args/env) in
  //   one image file under snapshot_dir; the clone is released.
  absl::StatusOr<StepState> CaptureStep(const InstanceRef& ref, const CaptureOptions& options,
                                        BlobStore& blobs) override;
  absl::StatusOr<InstanceRef> RestoreStep(const InstanceRef& ref, const StepState& state,
                                          BlobStore& blobs) override;
  absl::StatusOr<InstanceRef> ForkStep(const StepState& state, const EnvSpec& spec,
                                       const std::string& new_id, BlobStore& blobs) override;
  absl::StatusOr<SnapshotRef> CompactSnapshot(const SnapshotRef& snapshot) override;
  StepMemorySupport StepMemory() const override;
  // Live snapshots the driver compacted or released itself (over a live-memory budget): the
  // core reconciles each through CompactSnapshot (the image, or an error: collected).
  std::set<std::string> ReleasedSnapshots(const std::string& source_id) override;
  bool HasReleasedSnapshots() override;

  // Accounting, for tests and /healthz: live clones' charged bytes (of `source_id`, or all when
  // empty) and image bytes on disk (of `source_id`, or all when empty).
  int64_t LiveSnapshotBytes(const std::string& source_id = "");
  int64_t ImageBytes(const std::string& source_id = "");

  // Test/diagnostic hooks: the worker pid of a session, and how a worker pid ended
  // ("running", "signal 31", "exit 0").
  absl::StatusOr<int> SessionPid(const InstanceRef& ref);
  absl::StatusOr<std::string> WorkerStatus(int pid);
  // Cgroup directories the fork server was put in (empty when not root / unsupported).
  std::vector<std::string> cgroups() const { return cgroups_; }
  // Test worker binaries only: asks a session worker to run a host-side misbehaviour hook.
  absl::Status TestHook(const InstanceRef& ref, const std::string& what);

 private:
  struct Session;
  struct Server;

  absl::Status EnsureServer();
  // Best effort: moves `pid` into the nano cgroup; returns the cgroup paths used.
  std::vector<std::string> JoinCgroup(int pid);
  // Asks the fork server for a worker; returns our end of its channel and its pid.
  absl::Status Spawn(bool session, int64_t memory_mb, int64_t ws_bytes,
                     const std::map<std::string, std::string>& env, int* fd, int* pid);
  absl::Status Kill(int pid);
  absl::StatusOr<std::shared_ptr<Session>> GetSession(const InstanceRef& ref);
  // One files-API request (a wire message) on a session's worker; its reply when ok.
  absl::StatusOr<std::map<std::string, std::string>> FileCall(
      const InstanceRef& ref, const std::map<std::string, std::string>& request,
      const std::string& what);
  absl::StatusOr<RunResult> RunOn(int fd, int pid, const RunRequest& request, bool* worker_dead,
                                  bool oneshot);
  // A copy-on-write clone of session `source_id` as a new (unregistered) session.
  absl::StatusOr<std::shared_ptr<Session>> CloneSession(const std::string& source_id);
  // A session whose worker is the snapshot's state: a clone of a live snapshot, or a fresh
  // worker that loaded a compact image.
  absl::StatusOr<std::shared_ptr<Session>> SessionFromSnapshot(const SnapshotRef& snapshot);
  // A fresh session (new interpreter) whose /workspace is `manifest` (contents from `blobs`).
  absl::StatusOr<std::shared_ptr<Session>> SessionFromManifest(
      const WorkspaceManifest& manifest, int64_t memory_mb, int64_t ws_bytes,
      const std::map<std::string, std::string>& env, BlobStore& blobs);
  // Puts `session` in the table as `id` (replacing and killing a previous one) → its ref.
  InstanceRef Install(const std::string& id, std::shared_ptr<Session> session,
                      const std::string& note);
  // A fresh worker as an (unregistered) session.
  absl::StatusOr<std::shared_ptr<Session>> StartSession(
      int64_t memory_mb, int64_t ws_bytes, const std::map<std::string, std::string>& env);
  // Writes the state of live snapshot `id` (a frozen clone of `source_id`) as an image file
  // named <base><suffix>, within the image caps → the compact snapshot's state (JSON), and the
  // deflated size in `bytes`. The clone is left alone (the caller releases it).
  absl::StatusOr<std::string> DumpImage(const std::string& id, const std::string& source_id,
                                        const std::string& suffix, int64_t* bytes);
  // After a capture of `source_id` made live clone `fresh`: re-measures its environment's live
  // clones and compacts or releases the oldest ones over the budgets. Returns false when
  // `fresh` itself had to go (then *fresh_image is its compact state, or empty: released).
  bool EnforceLiveBudget(const std::string& source_id, const std::string& fresh, int64_t env_budget,
                         std::optional<SnapshotRef>* fresh_image);
  // Compacts (else releases) live clone `id` on the driver's own account (see ReleasedSnapshots).
  void EvictLive(const std::string& id);
  void ForgetImage(const std::string& name);
  void KillSession(const std::shared_ptr<Session>& session);
  // The workspace manifest of a session worker (see CaptureStep).
  absl::StatusOr<WorkspaceManifest> WalkWorkspace(Session& session, const CaptureOptions& options,
                                                  BlobStore& blobs);
  // The variables summary, run in a throwaway clone of session `frozen_id`; "" when unknown.
  std::string SummarizeVariables(const std::string& frozen_id);

  NanoDriverOptions options_;
  std::mutex server_mu_;
  std::unique_ptr<Server> server_;
  std::mutex sessions_mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::string> cgroups_;
  // esb_vars.py compiled once by the guest (marshal, hex) in a fresh one-shot interpreter, so
  // a capture does not compile 30 KB of Python each time. Empty until the first summary.
  std::mutex vars_mu_;
  std::string vars_code_hex_;
  // Live step clones (snapshot id → its environment, age and charged PSS) and those the driver
  // compacted or released itself, until the core reconciles them (CompactSnapshot/Delete).
  struct LiveClone {
    std::string source;
    uint64_t seq = 0;
    int64_t bytes = 0;
  };
  struct Released {
    std::string source;
    std::string image_state;  // the compact state (image file "<name>.e"), or empty: released
    int64_t bytes = 0;
    std::string why;
  };
  std::mutex live_mu_;
  std::map<std::string, LiveClone> live_;
  std::map<std::string, Released> released_;
  uint64_t live_seq_ = 0;
  // Image files in snapshot_dir: name → (environment key, bytes); counted at start-up too.
  std::mutex images_mu_;
  std::map<std::string, std::pair<std::string, int64_t>> images_;
};

std::unique_ptr<NanoDriver> NewNanoDriver(NanoDriverOptions options);

// Options for the CPython guest: `worker_path` = the built esb-nano-worker binary,
// `artefact_dir` = nanobuild's published directory (images/python-wasm/out), whose
// stdlib.pack is mounted read-only at /usr/lib/python3.11. NotFound if a file is missing.
absl::StatusOr<NanoDriverOptions> PythonNanoOptions(const std::string& worker_path,
                                                    const std::string& artefact_dir);

// Parses the guest's structured result (JSON written by the Python guest, see
// images/python-wasm/README.md) into `result`. Exposed for tests.
void ParseGuestResult(const std::string& json, RunResult* result);

}  // namespace esb
