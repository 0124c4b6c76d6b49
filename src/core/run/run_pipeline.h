// The run pipeline: POST /run (one-shot Python) and POST /environments/{id}/run (stateful
// Python in an environment), decided here in the core; the API only parses the request into a
// RunRequest, calls Prepare and Execute, and renders the RunOutcome.
//
// One-shot runs go to the nano tier when it can serve them and to a throw-away heavy
// environment otherwise:
//   runtime "nano"              → nano only (an unsupported module is reported, not rerouted)
//   runtime "heavy"/"container" → a fresh heavy environment, destroyed afterwards
//   runtime "auto" (default)    → the adaptive router (router/rules.h) reads the code's imports
//                                 without running it and picks a tier from config/router.json;
//                                 if nano then reports a module or capability it cannot
//                                 provide, the code reruns on heavy — safe because a one-shot
//                                 nano run has no effects outside its own instance.
//                                 `packages` force heavy.
// Routing is an optimisation, never a security decision: both tiers are isolated.
// Every outcome says where it ran and why ({tier, reason}).
//
// Everything goes through the EnvironmentManager's accounted operations (quota, leases,
// capability checks, metrics): the tiers' Python sits behind Driver::RunCode (nano sessions
// and one-shot interpreters; the heavy tier's kernel.py). The throw-away environment of a
// heavy one-shot run is destroyed on every path, success or failure. A run is ONE audited
// action ("run", detail "[tier] code"): its steps (create, install, run, artifact copies,
// destroy) write no rows of their own; wheels fetched over the network add "package.fetch".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/artifact_store.h"
#include "core/audit.h"
#include "core/environment_manager.h"
#include "drivers/driver.h"
#include "packages/installer.h"
#include "router/rules.h"

namespace esb::run {

// The drivers of the two tiers.
inline constexpr DriverKind kNanoRuntime = DriverKind::kNano;
inline constexpr DriverKind kHeavyRuntime = DriverKind::kContainer;

// Prepare's typed refusal of a one-shot run whose tier is not on this daemon (runtime "nano"
// without the nano tier; a run only heavy could serve without the container driver):
// InvalidArgument carrying a payload that IsTierUnavailable recognises. The API answers it 400
// with the code "tier_unavailable" (docs/api.md), which clients test instead of the message.
absl::Status TierUnavailableError(std::string_view message);
bool IsTierUnavailable(const absl::Status& status);

struct RunSpec {
  std::string environment_id;  // empty: a one-shot run
  std::string code;
  // auto | nano | heavy | container; empty: "auto" for one-shot runs, the environment's own
  // for environment runs.
  std::string runtime;
  int64_t timeout_ms = 30000;  // 1..600000
  int64_t memory_mb = 0;       // one-shot only; 0: the tier's default
  std::vector<std::string> packages;
  std::vector<std::string> figure_formats{"png"};
  // A policy check on what the code imports (static, like the router): not a sandbox boundary.
  std::optional<std::vector<std::string>> allowed_modules;
  // An intent of the tenant's catalogue active for this run only (environment runs on a
  // governed environment; EnvironmentManager::BeginCallIntent).
  std::string intent;
};

// Where output goes while the code runs: the code's own stdout/stderr, and pip's output while
// packages are installed.
struct RunStreams {
  OutputSink output;
  OutputSink install;
};

struct RunOutcome {
  RunResult result;                          // stdout/stderr, exit code, error, value, table, ...
  std::string tier;                          // "nano" | "heavy"
  std::string reason;                        // why that tier
  std::vector<ArtifactMeta> artifacts;       // kept in the host's ArtifactStore
  std::vector<std::string> artifact_errors;  // why some were not kept
  std::vector<packages::InstalledPackage> packages;
  int64_t install_ms = 0;
};

// What Prepare decided: everything refusable with a plain 4xx is refused before running (and
// so before an SSE stream starts).
struct RunPlan {
  RunSpec spec;
  enum class Kind { kEnvironment, kNanoOnce, kHeavyOnce } kind = Kind::kNanoOnce;
  DriverKind env_runtime = kNanoRuntime;  // kEnvironment: the environment's runtime
  bool may_fall_back = false;
  std::string reason;
};

struct RunDeps {
  EnvironmentManager* manager = nullptr;
  router::RulesHolder* rules = nullptr;             // null: auto tries nano first, falls back
  ArtifactStore* artifacts = nullptr;               // null: artifacts are reported as not kept
  packages::PackageInstaller* installer = nullptr;  // null: `packages` is refused
};

class RunPipeline {
 public:
  explicit RunPipeline(RunDeps deps) : deps_(deps) {}

  // Validates and decides (tier, environment, packages): InvalidArgument / NotFound /
  // MissingCapabilityError for what cannot run.
  absl::StatusOr<RunPlan> Prepare(const Caller& caller, RunSpec spec) const;
  // Runs a plan; writes the run's one audit row whatever happens.
  absl::StatusOr<RunOutcome> Execute(const Caller& caller, const RunPlan& plan,
                                     const RunStreams& streams) const;

 private:
  absl::StatusOr<RunOutcome> ExecutePlan(const Caller& step, const RunPlan& plan,
                                         const RunStreams& streams) const;
  absl::StatusOr<RunOutcome> RunHeavyOnce(const Caller& step, const RunPlan& plan,
                                          const std::string& reason,
                                          const RunStreams& streams) const;
  absl::StatusOr<RunOutcome> RunInEnvironment(const Caller& step, const std::string& id,
                                              const RunPlan& plan, bool once,
                                              const RunStreams& streams,
                                              const std::string& reason) const;
  void CollectArtifacts(const Caller& step, const std::string& id,
                        const std::vector<ReportedArtifact>& reported, RunOutcome* o) const;

  RunDeps deps_;
};

// Caps of the pipeline (exposed for tests).
inline constexpr size_t kMaxArtifactsPerRun = 64;
inline constexpr int64_t kMaxRunTimeoutMs = 600000;

}  // namespace esb::run
