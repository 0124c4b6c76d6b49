// The core: owns environments' lifecycle (create from warm pool or cold, leases, reaper,
// re-attach after restart, destroy) and routes interaction calls to the right driver.
// The API layer parses and authenticates; this class decides. Tenant scoping is enforced here:
// an environment of another tenant is indistinguishable from a missing one (NotFound).
//
// Every action on an environment (create, delete, exec, files, run, expiry) writes exactly one
// audit row through the core's AuditLog, with the Caller's tenant and principal and the
// outcome: entry points pass who is calling, never audit rows. Reads of state (Get, List,
// Stats) and heartbeats are not audited; neither is a call naming an environment that does
// not exist for the caller's tenant (nothing happened to an environment).
// Before calling a driver for anything beyond the lifecycle, the manager checks the driver's
// Capabilities() and refuses a missing one with MissingCapabilityError (400 naming it).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/audit.h"
#include "core/config.h"
#include "core/egress.h"
#include "core/metrics.h"
#include "core/snapshots/steps.h"
#include "drivers/driver.h"
#include "storage/store.h"

namespace esb {

class DiskBlobStore;
struct StepGuard;

// NotFound for an environment that does not exist or is another tenant's (the two look the
// same), marked so that callers can tell it from NotFound for a file inside an environment.
absl::Status EnvironmentNotFoundError(std::string_view message);
bool IsEnvironmentNotFound(const absl::Status& status);

// A governed environment's CA as PEM (the key is a secret: never logged, never in a sandbox).
struct EgressCaPem {
  std::string cert_pem;
  std::string key_pem;
};

struct ManagerOptions {
  int64_t default_ttl_s = 900;
  int64_t max_ttl_s = 86400;
  // Warm pool: this many pre-started environments per pooled runtime, with `default_spec`.
  int pool_size = 2;
  std::vector<DriverKind> pooled_runtimes = {DriverKind::kContainer};
  int64_t reaper_interval_ms = 1000;
  int64_t health_interval_ms = 10000;
  int max_environments = 500;
  int max_environments_per_tenant = 200;
  EnvSpec default_spec;
  // Persistent volumes (core/volumes.h): size cap of one, count per tenant, mounts per
  // environment.
  int64_t max_volume_mb = 4096;
  int max_volumes_per_tenant = 16;
  int max_volumes_per_environment = 8;
  // Interactive terminals (core/terminal.cc): open at once per environment / per tenant (over
  // either: ResourceExhausted, 429; 0 refuses terminals), and the idle close.
  int max_terminals_per_environment = 4;
  int max_terminals_per_tenant = 16;
  int64_t terminal_idle_timeout_ms = 1800'000;
  // How long a terminal's open waits for a step of its environment (a capture, a rewind, a
  // fork) to finish before it is refused (Unavailable, 503).
  int64_t terminal_step_wait_ms = 30'000;
  std::function<int64_t()> now_ms;  // injectable clock; defaults to NowUnixMs
  // Egress governance (issue 12). `egress` carries governed environments to the proxy (not
  // owned; nullptr: a create with a network policy answers 503); `make_ca` makes each governed
  // environment's CA (PEM pair; nullptr: 503 likewise); `egress_config` holds the default
  // policies and the intent catalogues.
  EgressControl* egress = nullptr;
  std::function<absl::StatusOr<EgressCaPem>()> make_ca;
  EgressConfig egress_config;
  // Time travel (docs/design.md "Time travel"): where steps keep their blobs (not owned;
  // nullptr: no environment captures steps, and their JSON says so).
  DiskBlobStore* blobs = nullptr;
  // The steps worker (compaction of live memory snapshots, steps' ttl_s, the blob sweep) runs
  // on its own threads, off the reaper, every this many ms.
  int64_t steps_worker_interval_ms = 1000;
  // The blob sweep runs at most this often (and only after steps were collected or dropped or
  // a capture failed); 1 s at most after a capture was refused for a full share.
  int64_t blob_sweep_interval_ms = 10000;
};

// Snapshot of one environment for the API.
struct EnvironmentInfo {
  EnvironmentRecord record;
  EnvSpec spec;
  int64_t ttl_s = 0;
  bool pooled = false;  // served from the warm pool
  // A live governed environment's current policy (spec.network.kind == kGoverned).
  std::optional<governance::EgressPolicy> egress;
  StepsStatus steps;  // time travel (filled for live environments)
};

// A fork of a step (POST /environments/{id}/fork).
struct ForkInfo {
  EnvironmentInfo environment;  // the new environment
  std::string source_id;
  int64_t step = 0;
  std::string memory;  // "snapshot" | "none"
};

// A rewind (POST /environments/{id}/rewind).
struct RewindInfo {
  int64_t head = 0;
  std::string memory;  // "snapshot" | "none"
  EnvironmentInfo environment;
};

// An intent active on an environment, as the API lists it.
struct IntentInfo {
  governance::ActiveIntent intent;
  // "environment": activated through the API until expiry; "call": for one execute/run call.
  std::string scope;
};

// A governed environment's network as the API shows it.
struct NetworkInfo {
  bool governed = false;  // false: network "none" (nothing else is set)
  governance::EgressPolicy policy;
  std::vector<IntentInfo> intents;  // unexpired, environment ones first, by name
};

// A volume for the API: the record and the environment that mounts it ("" when none).
struct VolumeInfo {
  VolumeRecord record;
  std::string mounted_by;
};

class EnvironmentManager {
  struct LiveEnv;
  friend struct StepGuard;

 public:
  // `drivers`: name → driver ("container", "gvisor", "nano", ...; ParseDriverKind). Not owned.
  EnvironmentManager(Store* store, std::map<std::string, Driver*> drivers, Metrics* metrics,
                     ManagerOptions options);
  ~EnvironmentManager();

  // Re-attaches environments recorded in the store (cleaning up any that died), then starts
  // the reaper and pool threads.
  absl::Status Start();
  // Stops background threads and discards warm-pool instances. Live environments keep
  // running (they survive a daemon restart).
  void Stop();

  // `egress`: the environment's network policy (nullptr: network "none"); the runtime needs the
  // egress capability (else MissingCapabilityError, 400), the daemon an egress proxy (else
  // Unavailable, 503). The API lays the request over DefaultEgressPolicy(tenant).
  // `steps`: time-travel settings (nullptr: the defaults, capture on).
  absl::StatusOr<EnvironmentInfo> Create(const Caller& caller, const EnvSpec& spec, int64_t ttl_s,
                                         const governance::EgressPolicy* egress = nullptr,
                                         const StepSettings* steps = nullptr);
  absl::Status Destroy(const Caller& caller, const std::string& id,
                       const std::string& reason = "deleted");
  absl::StatusOr<EnvironmentInfo> Get(const Caller& caller, const std::string& id);
  absl::StatusOr<std::vector<EnvironmentInfo>> List(const Caller& caller, bool include_destroyed);
  // Extends the lease to now + ttl (ttl_s <= 0: the environment's own ttl). Returns expiry.
  absl::StatusOr<int64_t> Heartbeat(const Caller& caller, const std::string& id, int64_t ttl_s);

  // `intent`: an intent of the tenant's catalogue active for this call only (BeginCallIntent).
  absl::StatusOr<ExecResult> Exec(const Caller& caller, const std::string& id,
                                  const ExecRequest& request, const OutputSink& sink,
                                  const std::string& intent = "");
  absl::Status WriteFile(const Caller& caller, const std::string& id, const std::string& path,
                         std::string_view data, int64_t offset, bool truncate);
  absl::StatusOr<FileChunk> ReadFile(const Caller& caller, const std::string& id,
                                     const std::string& path, int64_t offset, int64_t length);
  absl::StatusOr<DirListing> ListDir(const Caller& caller, const std::string& id,
                                     const std::string& path);
  // The files API's other operations (Driver::Stat, MakeDir, Remove, Rename). mkdir, remove and
  // rename are audited actions (files.mkdir, files.remove, files.rename); stat is not.
  absl::StatusOr<FileEntry> StatFile(const Caller& caller, const std::string& id,
                                     const std::string& path);
  absl::StatusOr<bool> MakeDir(const Caller& caller, const std::string& id,
                               const std::string& path);
  absl::Status RemoveFile(const Caller& caller, const std::string& id, const std::string& path,
                          bool recursive);
  absl::Status RenameFile(const Caller& caller, const std::string& id, const std::string& source,
                          const std::string& destination, bool overwrite);
  absl::StatusOr<Usage> Stats(const Caller& caller, const std::string& id);

  // A file transfer that takes several driver calls (a large read, an upload, a download)
  // and is ONE audited action: the row is written when the transfer is destroyed, with the
  // bytes moved and the outcome (the last failed call's, or what Finish set).
  class FileTransfer {
   public:
    ~FileTransfer();
    FileTransfer(const FileTransfer&) = delete;
    FileTransfer& operator=(const FileTransfer&) = delete;
    absl::Status Write(std::string_view data, int64_t offset, bool truncate);
    absl::StatusOr<FileChunk> Read(int64_t offset, int64_t length);
    // The outcome as the caller saw it (a limit it enforced, a client that went away:
    // absl::CancelledError): it replaces the driver calls' own.
    void Finish(absl::Status outcome) { outcome_ = std::move(outcome); }

   private:
    friend class EnvironmentManager;
    FileTransfer() = default;
    EnvironmentManager* manager_ = nullptr;
    Caller caller_{""};
    std::shared_ptr<LiveEnv> env_;  // kept alive for the transfer
    std::string id_, path_, action_;
    int64_t start_ms_ = 0;
    int64_t bytes_ = 0;
    absl::Status outcome_;
    std::unique_ptr<StepGuard> step_;  // a write's step (recorded when the transfer ends)
  };
  // `action` names the audit row: "files.read", "files.write", "files.upload",
  // "files.download". NotFound (unaudited) when the environment does not exist.
  absl::StatusOr<std::unique_ptr<FileTransfer>> OpenTransfer(const Caller& caller,
                                                             const std::string& id,
                                                             const std::string& path,
                                                             const std::string& action);

  // Python in environment `id` (capability python_session), audited as "run".
  absl::StatusOr<RunResult> RunCode(const Caller& caller, const std::string& id,
                                    const RunRequest& request, const OutputSink& sink);
  // Python in a fresh interpreter of runtime `runtime`, no environment (capability
  // python_oneshot), audited as "run".
  absl::StatusOr<RunResult> RunOneShot(const Caller& caller, DriverKind runtime,
                                       const RunRequest& request, const OutputSink& sink);

  // Persistent volumes of the caller's tenant, kept by the container runtime's driver
  // (capability volumes). Another tenant's volume is NotFound, like a missing one. A volume is
  // mounted by at most one environment at a time (Create with a volume another environment
  // mounts is Aborted: a conflict, 409 at the API), and DeleteVolume refuses one that is
  // mounted (Aborted). Audited as volume.create / volume.delete.
  absl::StatusOr<VolumeRecord> CreateVolume(const Caller& caller, const std::string& name,
                                            int64_t size_mb);
  absl::StatusOr<std::vector<VolumeInfo>> ListVolumes(const Caller& caller);
  absl::Status DeleteVolume(const Caller& caller, const std::string& name);

  // --- Egress governance (issue 12; docs/api.md "Network policy", "Intents") ---
  // What a tenant's policy objects are laid over (config egress.default / egress.tenants).
  const governance::EgressPolicy& DefaultEgressPolicy(const std::string& tenant) const {
    return options_.egress_config.DefaultPolicyFor(tenant);
  }
  absl::StatusOr<NetworkInfo> GetNetwork(const Caller& caller, const std::string& id);
  // Replaces a governed environment's policy live (stored, pushed to the proxy; audited as
  // network.update). policy == nullptr means "none". Whether an environment is governed is
  // fixed at create (its network namespace and proxy listener exist or not): "none" for a
  // governed one, or a policy for a "none" one, is Aborted (409) naming the way out.
  absl::StatusOr<NetworkInfo> SetNetwork(const Caller& caller, const std::string& id,
                                         const governance::EgressPolicy* policy);
  // Activates intent `name` of the tenant's catalogue until now + ttl_s (0: the default,
  // kDefaultIntentTtlSeconds capped at the intent's max_ttl_seconds); activating an active one
  // extends it (never shortens). Audited as network.intent.activate. InvalidArgument for an
  // unknown intent or a bad TTL, Aborted (409) on a "none" environment, ResourceExhausted over
  // governance::kMaxActiveIntents.
  absl::StatusOr<NetworkInfo> ActivateIntent(const Caller& caller, const std::string& id,
                                             const std::string& name, int64_t ttl_s);
  // Ends an environment-scoped intent (NotFound when it is not active). Audited as
  // network.intent.deactivate.
  absl::StatusOr<NetworkInfo> DeactivateIntent(const Caller& caller, const std::string& id,
                                               const std::string& name);
  // The environment CA's certificate (PEM); NotFound for a "none" environment.
  absl::StatusOr<std::string> CaCertificate(const Caller& caller, const std::string& id);

  // The egress of fetches esbd makes on a governed environment's behalf (packages: the host's
  // wheel cache; docs/design.md "Host-side wheel cache"). nullopt for a "none" environment
  // (esbd then fetches directly, as configured).
  struct HostFetchEgress {
    // A new socket connected to the environment's egress listener from inside its network
    // namespace (Driver::ConnectEgressProxy): its proxy decides, DLP-scans and audits each
    // request exactly as for the sandbox's own traffic.
    std::function<absl::StatusOr<UniqueFd>(std::chrono::milliseconds timeout)> connect;
    std::string ca_cert_pem;  // the environment's CA (the proxy intercepts TLS with it)
    // For data handed to the environment without a request (a cache hit) that would have come
    // from scheme://host:port/path: governance::Decide with the environment's policy and
    // active intents at this instant. A refusal writes an egress audit row (decision blocked,
    // AuditLog::RecordEgress) and is PermissionDenied naming the host and the rule.
    std::function<absl::Status(const std::string& scheme, const std::string& host, uint16_t port,
                               const std::string& path)>
        check;
  };
  absl::StatusOr<std::optional<HostFetchEgress>> HostFetchEgressFor(const Caller& caller,
                                                                    const std::string& id);

  // An intent active for one execute/run call: activated by BeginCallIntent, removed (and
  // pushed to the proxy) when this is destroyed, whatever the call's outcome. One audit row
  // (network.intent.call) when it ends. Its expiry (the call's deadline plus a grace) also
  // bounds it should the removal never run (a crash).
  class CallIntent {
   public:
    ~CallIntent();
    CallIntent(const CallIntent&) = delete;
    CallIntent& operator=(const CallIntent&) = delete;

   private:
    friend class EnvironmentManager;
    CallIntent() = default;
    EnvironmentManager* manager_ = nullptr;
    std::shared_ptr<LiveEnv> env_;
    Caller caller_{""};
    std::string name_, action_;
    int64_t start_ms_ = 0;
  };
  // `max_call_ms`: the call's own timeout. `action`: what it is for ("execute", "run"). A
  // refusal (unknown intent, a "none" environment, the proxy refusing) writes no row: the
  // call's own row records it.
  absl::StatusOr<std::unique_ptr<CallIntent>> BeginCallIntent(const Caller& caller,
                                                              const std::string& id,
                                                              const std::string& name,
                                                              int64_t max_call_ms,
                                                              const std::string& action);

  // A process running in environment `id` (core/terminal.cc): an interactive shell on a PTY
  // (OpenTerminal, capability kTerminal) or a command with stdio pipes (SpawnProcess, capability
  // kProcesses: an MCP server hosted in the sandbox, core/mcp_hosts). Destroying it kills the
  // process and everything it started. A rewind ends every process of its environment first
  // (ended_by() then says so). A terminal holds one of the environment's and the tenant's
  // terminal slots until destroyed and writes a "terminal.open" audit row (also for a refusal)
  // and, when destroyed, a "terminal.close" row (exit code, duration, bytes both ways); a
  // spawned process writes no rows of its own (its caller audits what it is for).
  class Process : public ProcessSession {
   public:
    ~Process() override;
    Process(const Process&) = delete;
    Process& operator=(const Process&) = delete;
    // Keystrokes / stdin bytes (`eof`: then close stdin); retried for up to 5 s while the
    // guest's input queue is full.
    absl::Status Input(std::string_view data, bool eof = false) override;
    absl::Status Resize(int rows, int cols) override;
    // The output to `sink` until the process exits (its code) or `timeout_ms` (nullopt).
    absl::StatusOr<std::optional<int>> Wait(int timeout_ms, const OutputSink& sink) override;
    // Kills the process; `reason` goes into a terminal's close row ("client closed", "idle").
    void Close(std::string reason);
    absl::Status Kill() override {
      Close("killed");
      return absl::OkStatus();
    }
    // Neither input nor output for ManagerOptions::terminal_idle_timeout_ms.
    bool Idle() const;
    // Why esbd ended this process (e.g. "environment rewound to step 3"), or "" when it did
    // not (the process exited, the client closed).
    std::string ended_by() const;

   private:
    friend class EnvironmentManager;
    Process() = default;
    EnvironmentManager* manager_ = nullptr;
    bool terminal_ = false;
    Caller caller_{""};
    std::shared_ptr<LiveEnv> env_;
    std::unique_ptr<ProcessSession> session_;
    std::string id_;
    int64_t start_ms_ = 0;
    std::atomic<int64_t> last_activity_ms_{0};
    std::atomic<int64_t> bytes_{0};
    mutable std::mutex mu_;
    std::optional<int> exit_code_;
    std::string close_reason_;
    std::string ended_by_;
  };
  absl::StatusOr<std::unique_ptr<Process>> OpenTerminal(const Caller& caller, const std::string& id,
                                                        int rows, int cols);
  // Starts request.argv (no PTY) in environment `id` of the caller's tenant. Waits for a step of
  // the environment like a terminal (Unavailable after terminal_step_wait_ms). No audit row.
  absl::StatusOr<std::unique_ptr<Process>> SpawnProcess(const Caller& caller, const std::string& id,
                                                        ProcessRequest request);

  // --- Time travel (issue 13; docs/api.md "Steps"; environment_manager_steps.cc) ---
  // Every execute, run, files write/remove/rename/mkdir, package install and network change on
  // an environment whose capture is on (its settings, and a runtime with the steps capability)
  // is a step; mutating calls on it are serialised meanwhile so that its history is linear.
  // Reads are tenant-scoped like everything else: another tenant's environment is NotFound.
  // `before` < 0: from the newest; limit 1..kMaxStepsListed.
  absl::StatusOr<StepPage> ListSteps(const Caller& caller, const std::string& id, int64_t before,
                                     int limit);
  // The step with windows of its file tree and of its changes (StepListWindow).
  absl::StatusOr<StepDetail> GetStep(const Caller& caller, const std::string& id, int64_t n,
                                     const StepListWindow& files = {},
                                     const StepListWindow& changes = {});
  // A file at step n, to be read in ranges: NotFound when absent at n, FailedPrecondition for a
  // directory, Aborted (409) for a step without state, StepCollectedError (410) when its
  // manifest or blob is gone or unreadable.
  absl::StatusOr<StepFile> OpenStepFile(const Caller& caller, const std::string& id, int64_t n,
                                        const std::string& path);
  // The same, whole (at most the blob store's per-blob cap; tools and tests).
  absl::StatusOr<std::string> ReadStepFile(const Caller& caller, const std::string& id, int64_t n,
                                           const std::string& path);
  absl::StatusOr<StepFileDiff> DiffStepFile(const Caller& caller, const std::string& id, int64_t n,
                                            const std::string& path);
  // In place: the environment becomes what it was at step n; later steps stay (a branch) and the
  // next step's parent is n. Aborted (409) when capture is off or the step has no state left.
  absl::StatusOr<RewindInfo> Rewind(const Caller& caller, const std::string& id, int64_t n);
  // A new environment of the caller's tenant with the source's spec at step n.
  absl::StatusOr<ForkInfo> Fork(const Caller& caller, const std::string& id, int64_t n);

  // Deletes the blobs no step refers to now (the sweeper thread does it every few seconds when
  // steps were collected or a capture failed; tests and tools call it directly).
  void SweepStepBlobs() { SweepBlobs(/*force=*/true); }
  // Compacts (or releases) the live memory snapshots over each environment's cap, oldest first
  // (the compactor thread does it when a step went over; tests call it directly), at most
  // `budget` of them per call. An environment busy with a call is left for the next tick.
  void CompactStepMemory(int budget = kCompactionsPerTick);
  // Collects the steps older than their environment's ttl_s (the sweeper thread does it every
  // tick, so a step expires without a new step). An environment busy with a call is left for
  // the next tick.
  void ExpireSteps();
  static constexpr int kCompactionsPerTick = 8;

  // One step for a composite operation (a package install: many execs and writes): the calls
  // made on `id` by this thread until it is destroyed make no steps of their own; its
  // destruction records one step of `kind` with the outcome given to Finish.
  class CompositeStep {
   public:
    ~CompositeStep();
    CompositeStep(const CompositeStep&) = delete;
    CompositeStep& operator=(const CompositeStep&) = delete;
    void Finish(absl::Status outcome) { outcome_ = std::move(outcome); }

   private:
    friend class EnvironmentManager;
    CompositeStep() = default;
    EnvironmentManager* manager_ = nullptr;
    std::unique_ptr<StepGuard> guard_;
    const void* previous_ = nullptr;
    absl::Status outcome_;
  };
  // nullptr when the environment does not capture steps (or does not exist: the calls report
  // that themselves).
  std::unique_ptr<CompositeStep> BeginCompositeStep(const Caller& caller, const std::string& id,
                                                    const std::string& kind,
                                                    const std::string& summary);

  // The runtime of a live environment of the caller's tenant.
  absl::StatusOr<DriverKind> RuntimeOf(const Caller& caller, const std::string& id);
  // What runtime `runtime` can do (empty set: no such driver).
  CapabilitySet CapabilitiesOf(DriverKind runtime) const;

  // The core's audit log, for the core's own composite operations (core/run, packages).
  AuditLog& audit() { return audit_; }

  std::map<std::string, int64_t> StateCounts();
  int64_t PoolReady();
  bool HasDriver(DriverKind kind) const { return drivers_.count(kind) > 0; }
  const ManagerOptions& options() const { return options_; }

 private:
  struct LiveEnv {
    // Guards record. Held only to read or change it, never across a store write or a driver
    // call, and never taken under mu_: a slow store cannot stall lookups through it.
    std::mutex mu;
    // Serialises this environment's store writes (each writes a snapshot taken under mu after
    // it got persist_mu, so rows are written in order and the last one is the newest state).
    std::mutex persist_mu;
    // The owner: set before the environment is published in envs_, never changed after, so
    // lookups and quota counts read it under mu_ alone.
    std::string tenant;
    EnvironmentRecord record;
    InstanceRef ref;
    DriverKind kind = DriverKind::kContainer;
    Driver* driver = nullptr;
    // Egress (governed environments): `governed` is set before publication, never changed.
    // egress_mu serialises a change of policy or intents with its store write and proxy push
    // (in that order); never taken under mu_ or mu.
    bool governed = false;
    std::mutex egress_mu;
    governance::EgressPolicy policy;
    std::vector<governance::ActiveIntent> intents;  // environment-scoped (stored)
    struct CallScoped {
      int refs = 0;
      governance::ActiveIntent intent;  // expires_ms: the latest call's deadline + grace
    };
    std::map<std::string, CallScoped> call_intents;  // per execute/run call (not stored)
    EgressCaPem ca;
    // Time travel. step_mu serialises the mutating calls of an environment that captures
    // steps (each holds it across its driver call and the capture) and guards the fields
    // below; recursive for a composite step's inner calls on the same thread. Never taken
    // under mu_, mu or egress_mu.
    std::recursive_timed_mutex step_mu;
    bool steps_loaded = false;  // the fields below reflect the store
    StepSettings step_settings;
    bool capture = false;        // effective (settings, blob store, driver capability)
    std::string capture_reason;  // why not / memory's reason
    std::optional<int64_t> head;
    int64_t next_step = 0;
    struct StepBrief {
      std::optional<int64_t> parent;
      int64_t bytes = 0;
      int64_t created_ms = 0;
      bool has_state = false;  // a manifest that is not collected
      bool memory = false;     // a memory snapshot is held
      bool live = false;       // ... by a live process
    };
    std::map<int64_t, StepBrief> steps;
    // The base of the next capture (unchanged files are not read again): the manifest of
    // step `head_manifest_step`, `head` or, after a step without state, an older one. Dropped
    // when that step is collected (its blobs may be swept: nothing may reuse them).
    std::shared_ptr<const WorkspaceManifest> head_manifest;
    std::optional<int64_t> head_manifest_step;
    // More live memory snapshots than max_live_memory: the reaper compacts the oldest
    // (CompactStepMemory) off the calls' path (a nano compaction takes tenths of a second).
    bool compact_pending = false;
    // Steps a fork is copying from (how many forks each), guarded by `mu`: retention neither
    // compacts nor collects them meanwhile (a fork holds step_mu only while it reads the step).
    std::map<int64_t, int> fork_pins;
    // The last StepsStatus computed under step_mu, guarded by `mu`: what a read shows while a
    // call holds step_mu (reads never wait for one).
    StepsStatus steps_status;
  };

  // `make`: how the instance is made (nullptr: Driver::Create).
  using InstanceMaker =
      std::function<absl::StatusOr<InstanceRef>(Driver&, const std::string& id, const EnvSpec&)>;
  // Time travel internals (environment_manager_steps.cc).
  // Sets up a new environment's step log and records step 0 (kind "create" or "fork").
  void InitSteps(LiveEnv& env, const StepSettings& settings, const std::string& kind,
                 const std::string& summary, const std::string& input_json);
  // Loads a re-attached environment's step log (after a restart).
  void LoadSteps(LiveEnv& env);
  StepsStatus StepsStatusOf(LiveEnv& env);
  // nullptr when `env` does not capture steps or this thread is inside a step of it already.
  // Error: the environment is busy with another call for too long.
  absl::StatusOr<std::unique_ptr<StepGuard>> BeginStep(const std::shared_ptr<LiveEnv>& env,
                                                       std::string kind, std::string summary,
                                                       std::string input_json);
  // Needs env.step_mu: captures the state and writes the step.
  void RecordStepLocked(LiveEnv& env, StepRecord rec);
  // `compact`: also compact (or release) live memory snapshots over the cap now, at most
  // *budget of them (decremented); without it, they are flagged for the compactor
  // (compact_pending).
  void EnforceRetentionLocked(LiveEnv& env, int* budget = nullptr);
  // A capture was refused because the tenant's share of the blob store is full: the
  // environment gives back the older half of its steps with state (never the head) and the
  // sweeper runs now.
  void RelieveStepPressureLocked(LiveEnv& env);
  // One step setting bounded by what the store can hold: max_bytes ≤ a tenant's share.
  StepSettings ClampStepSettings(StepSettings settings) const;
  void CollectStepLocked(LiveEnv& env, int64_t n, const std::string& why);
  // After a restart: live memory snapshots are gone; step logs of environments that are gone.
  void RecoverSteps();
  // On destroy: releases snapshots, deletes the log.
  void DropSteps(LiveEnv& env);
  // Releases every memory snapshot the stored log of `env_id` holds, through `driver` (nullptr:
  // the driver each snapshot names).
  void ReleaseLoggedSnapshots(const std::string& tenant, const std::string& env_id,
                              Driver* driver);
  // Deletes blobs no step refers to (throttled; the sweeper thread calls it). Per tenant; a
  // tenant one of whose manifests cannot be read keeps everything this time (fails closed).
  void SweepBlobs(bool force);
  // The compactor's and the sweeper's loops (their own threads: a 60 s compaction or a sweep
  // over every manifest never delays the reaper's expiries and health checks).
  void CompactorLoop();
  void SweeperLoop();
  absl::StatusOr<StepState> StateOfStep(const StepRecord& rec, WorkspaceManifest* manifest);
  std::set<int64_t> AncestorsOfHeadLocked(const LiveEnv& env) const;
  // The same from the stored log (when a running call holds step_mu); sets *head.
  std::set<int64_t> AncestorsFromStore(const std::string& tenant, const std::string& id,
                                       std::optional<int64_t>* head);
  int64_t Now() const { return options_.now_ms(); }
  absl::StatusOr<std::shared_ptr<LiveEnv>> Lookup(const std::string& tenant,
                                                  const std::string& id);
  // Lookup + Touch + the capability check of an interaction call.
  // One audited files operation (mkdir, remove, rename): capability check, the driver call,
  // one audit row unless the environment does not exist for the caller.
  template <typename Fn>
  auto AuditedFileOp(const Caller& caller, const std::string& id, std::string_view action,
                     std::string_view detail, Fn op) -> decltype(op(std::declval<LiveEnv&>()));
  absl::StatusOr<std::shared_ptr<LiveEnv>> LookupFor(const Caller& caller, const std::string& id,
                                                     Capability needed);
  void Touch(LiveEnv& env);
  // Create without its audit row (Create writes it, whatever happens here). `before_publish`
  // runs on the new environment before any other call can see it (its step log: a call racing
  // the create never finds it with default step settings).
  absl::StatusOr<EnvironmentInfo> CreateEnvironment(
      const std::string& tenant, const EnvSpec& spec, int64_t ttl_s,
      const governance::EgressPolicy* egress, const InstanceMaker& make = nullptr,
      std::shared_ptr<LiveEnv>* created = nullptr,
      const std::function<void(LiveEnv&)>& before_publish = nullptr);
  // Egress helpers (environment_manager_egress.cc). The *Locked ones need env.egress_mu.
  // Drops expired environment-scoped intents (true if any was dropped).
  bool PruneIntentsLocked(LiveEnv& env, int64_t now);
  std::vector<governance::ActiveIntent> EffectiveIntentsLocked(const LiveEnv& env,
                                                               int64_t now) const;
  NetworkInfo NetworkInfoLocked(const LiveEnv& env, int64_t now) const;
  absl::Status PersistEgressLocked(const LiveEnv& env);
  // Stores, then pushes the current state to the proxy.
  absl::Status CommitEgressLocked(LiveEnv& env);
  // Makes a freshly created environment governed: CA already in spec, state stored, attached.
  absl::Status AttachNewEgress(LiveEnv& env, const governance::EgressPolicy& policy,
                               const EgressCaPem& ca);
  // After a restart: reloads a governed environment's state from the store and re-attaches it.
  void ReattachEgress(LiveEnv& env);
  // EgressAttachment::open_listener for `env` (Driver::OpenEgressListener on its instance).
  static std::function<absl::StatusOr<UniqueFd>()> ListenerOpener(const LiveEnv& env);
  void EndCallIntent(CallIntent& call);
  absl::StatusOr<std::shared_ptr<LiveEnv>> CreateInstance(const EnvSpec& spec,
                                                          const std::string& tenant, EnvState state,
                                                          int64_t ttl_s,
                                                          const InstanceMaker& make = nullptr);
  std::shared_ptr<LiveEnv> TakePooled(const EnvSpec& spec);
  void DestroyLive(const std::shared_ptr<LiveEnv>& env, const std::string& reason);
  // The reaper's destroy of an expired or dead environment, audited as the daemon's action.
  void Reap(const std::shared_ptr<LiveEnv>& env, const std::string& reason);
  void Persist(const EnvironmentRecord& record);
  // Writes the current record of `env` (a snapshot) to the store, off env.mu and mu_.
  // deferred: through the store's write-behind (counters only: exec_count, last_used_ms).
  void PersistLive(LiveEnv& env, bool deferred = false);
  EnvironmentInfo InfoOf(const EnvironmentRecord& record, bool pooled) const;
  void ReaperLoop();
  void PoolLoop();
  // Checks and resolves spec.volumes for `tenant` (names, paths, the tenant's records, the
  // driver's capability) and claims each for `claimant` in volume_users_.
  absl::Status ClaimVolumes(const std::string& tenant, EnvSpec& spec, const std::string& claimant);
  void ReleaseVolumes(const std::string& claimant);
  // Releases the volumes `marker` claimed when it goes out of scope.
  struct VolumeClaimRelease {
    EnvironmentManager* self;
    std::string marker;
    ~VolumeClaimRelease() { self->ReleaseVolumes(marker); }
  };
  Driver* VolumeDriver() const;

  Store* store_;
  std::map<DriverKind, Driver*> drivers_;
  Metrics* metrics_;
  ManagerOptions options_;
  AuditLog audit_;

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<LiveEnv>> envs_;              // running, by id
  std::map<DriverKind, std::deque<std::shared_ptr<LiveEnv>>> pool_;   // runtime → ready
  std::vector<std::shared_ptr<LiveEnv>> destroy_retry_;
  int pool_creating_ = 0;
  // Creates that passed the quota check and are not in envs_ yet (they count against it).
  int reserved_total_ = 0;
  std::map<std::string, int> reserved_;  // tenant → reservations
  // Volume key → who holds it: an environment id (it mounts it), or a marker of a create,
  // delete or environment create on the way ("#..."). Absent: free.
  std::map<std::string, std::string> volume_users_;
  std::mutex volume_quota_mu_;  // a volume create's count check and insert, one at a time
  // Open terminals (core/terminal.cc): environment id → count, tenant → count.
  std::mutex terminals_mu_;
  std::map<std::string, int> terminals_by_env_;
  std::map<std::string, int> terminals_by_tenant_;
  // Environment id → its processes (terminals and spawned ones), under terminals_mu_.
  std::map<std::string, std::set<Process*>> open_processes_;
  // Ends every process of `id` (terminals' shells, hosted servers: each with everything started
  // in it is killed; ended_by() says `reason`). A rewind calls it holding the step_mu, which
  // OpenTerminal and SpawnProcess also take: none starts meanwhile.
  void CloseProcesses(const std::string& id, const std::string& reason);
  // Registers a started process (`p` has its session) in open_processes_.
  void RegisterProcess(Process* p);

  std::mutex sweep_mu_;         // one blob sweep at a time
  std::atomic<bool> sweep_needed_{false};
  std::atomic<bool> sweep_urgent_{false};    // a capture was refused: sweep without waiting
  std::atomic<bool> compact_needed_{false};  // some environment has compact_pending
  std::atomic<bool> steps_stop_{false};      // the steps threads stop (checked between items)
  int64_t last_sweep_ms_ = 0;  // under sweep_mu_

  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool stopping_ = false;
  bool pool_kick_ = false;  // a pooled instance was taken: refill now
  std::thread reaper_;
  std::thread pooler_;
  std::thread compactor_;
  std::thread sweeper_;
};

// EnvSpec (+ ttl) ↔ JSON, as stored in EnvironmentRecord::spec_json.
std::string SpecToJson(const EnvSpec& spec, int64_t ttl_s);
absl::StatusOr<EnvSpec> SpecFromJson(const std::string& json, int64_t* ttl_s);

}  // namespace esb
