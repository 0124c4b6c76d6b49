#include "core/run/run_pipeline.h"

#include <algorithm>
#include <functional>
#include <map>
#include <regex>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "drivers/heavy_kernel.h"
#include "router/imports.h"

namespace esb::run {
namespace {

constexpr char kArtifactsDir[] = "/workspace/artifacts";

// "type/subtype" made of safe characters, else application/octet-stream (the value becomes
// a Content-Type header).
std::string SafeMimeType(const std::string& mime) {
  static const std::regex kMime(R"([a-z0-9][a-z0-9.+-]{0,63}/[a-z0-9][a-z0-9.+-]{0,127})");
  return std::regex_match(mime, kMime) ? mime : "application/octet-stream";
}

std::string MimeTypeForName(std::string_view name) {
  static const std::map<std::string, std::string> kTypes = {
      {"png", "image/png"},         {"jpg", "image/jpeg"},  {"jpeg", "image/jpeg"},
      {"gif", "image/gif"},         {"webp", "image/webp"}, {"svg", "image/svg+xml"},
      {"csv", "text/csv"},          {"txt", "text/plain"},  {"md", "text/markdown"},
      {"json", "application/json"}, {"html", "text/html"},  {"pdf", "application/pdf"}};
  size_t dot = name.rfind('.');
  if (dot == std::string_view::npos) return "application/octet-stream";
  std::string ext(name.substr(dot + 1));
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto it = kTypes.find(ext);
  return it == kTypes.end() ? "application/octet-stream" : it->second;
}

// Files under /workspace/artifacts as {path: (mtime_ms, size)}, for environments whose runs
// cannot report artifacts themselves (nano sessions: no kernel.py there). Bounded: three
// directory levels, 500 entries.
using FileStamps = std::map<std::string, std::pair<int64_t, int64_t>>;
FileStamps ScanArtifactFiles(EnvironmentManager* manager, const Caller& step,
                             const std::string& id) {
  FileStamps out;
  size_t seen = 0;
  std::function<void(const std::string&, int)> walk = [&](const std::string& dir, int depth) {
    auto entries = manager->ListDir(step, id, dir);
    if (!entries.ok()) return;  // no artifacts directory: nothing to report
    for (const FileEntry& e : entries->entries) {
      if (++seen > 500) return;
      const std::string path = absl::StrCat(dir, "/", e.name);
      if (e.type == "file")
        out[path] = {e.mtime_ms, e.size};
      else if (e.type == "dir" && depth < 3)
        walk(path, depth + 1);
    }
  };
  walk(std::string(kArtifactsDir), 1);
  return out;
}

// What changed between two scans, as reported artifacts.
std::vector<ReportedArtifact> ChangedArtifactFiles(const FileStamps& before,
                                                   const FileStamps& after) {
  std::vector<ReportedArtifact> out;
  const std::string prefix = absl::StrCat(kArtifactsDir, "/");
  for (const auto& [path, stamp] : after) {
    auto it = before.find(path);
    if (it != before.end() && it->second == stamp) continue;
    ReportedArtifact a;
    a.path = path;
    a.name = path.substr(prefix.size());
    a.mime_type = MimeTypeForName(path);
    a.kind = a.mime_type.rfind("image/", 0) == 0 ? "image" : "file";
    out.push_back(std::move(a));
  }
  return out;
}

RunRequest ToRunRequest(const RunSpec& spec, bool once) {
  RunRequest rr;
  rr.code = spec.code;
  rr.timeout_ms = spec.timeout_ms;
  rr.memory_limit_mb = once ? spec.memory_mb : 0;
  rr.once = once;
  rr.figure_formats = spec.figure_formats;
  return rr;
}

}  // namespace

// The payload's type URL marks the refusal; the message stays the human one.
constexpr char kTierUnavailableUrl[] = "esb/run/tier_unavailable";

absl::Status TierUnavailableError(std::string_view message) {
  absl::Status status = absl::InvalidArgumentError(AbslView(message));
  status.SetPayload(kTierUnavailableUrl, absl::Cord());
  return status;
}

bool IsTierUnavailable(const absl::Status& status) {
  return status.GetPayload(kTierUnavailableUrl).has_value();
}

absl::StatusOr<RunPlan> RunPipeline::Prepare(const Caller& caller, RunSpec spec) const {
  EnvironmentManager* manager = deps_.manager;
  const bool one_shot = spec.environment_id.empty();
  if (spec.timeout_ms < 1 || spec.timeout_ms > kMaxRunTimeoutMs)
    return absl::InvalidArgumentError(
        absl::StrCat("'timeout_ms' must be an integer in 1..", kMaxRunTimeoutMs));
  if (spec.memory_mb != 0 && (spec.memory_mb < 16 || spec.memory_mb > 16384))
    return absl::InvalidArgumentError("'memory_limit_mb' must be an integer in 16..16384");
  for (const std::string& fmt : spec.figure_formats)
    if (fmt != "png" && fmt != "svg")
      return absl::InvalidArgumentError(absl::StrCat(
          "'figure_formats' entries must be \"png\" or \"svg\", not \"", fmt.substr(0, 40), "\""));
  if (spec.figure_formats.empty()) spec.figure_formats = {"png"};
  if (!spec.intent.empty() && one_shot)
    return absl::InvalidArgumentError(
        "'intent' needs an environment with a network policy (POST /environments/{id}/run): "
        "one-shot runs have no network");
  if (spec.runtime.empty()) spec.runtime = one_shot ? "auto" : "nano";
  if (spec.runtime != "auto" && spec.runtime != "nano" && spec.runtime != "heavy" &&
      spec.runtime != "container")
    return absl::InvalidArgumentError(
        "'runtime' must be one of \"auto\", \"nano\", \"heavy\", \"container\"");
  if (!spec.packages.empty()) {
    if (one_shot && spec.runtime == "nano")
      return absl::InvalidArgumentError(
          "'packages' need the heavy tier: the nano tier cannot install packages (use runtime "
          "\"auto\" or \"heavy\")");
    if (deps_.installer == nullptr)
      return absl::InvalidArgumentError("this daemon cannot install 'packages'");
    if (absl::Status st = deps_.installer->Validate(spec.packages); !st.ok()) return st;
  }

  const router::ImportScan scan = router::ExtractImports(spec.code);
  if (spec.allowed_modules) {
    std::vector<std::string> refused;
    for (const std::string& m : scan.modules)
      if (std::find(spec.allowed_modules->begin(), spec.allowed_modules->end(), m) ==
          spec.allowed_modules->end())
        refused.push_back(m);
    if (!refused.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("imports not in allowed_modules: ", absl::StrJoin(refused, ", ")));
    if (scan.has_dynamic_import)
      return absl::InvalidArgumentError(
          "dynamic imports (__import__, importlib, exec, eval) cannot be checked against "
          "allowed_modules");
  }

  RunPlan plan;
  if (!one_shot) {
    // Stateful run in an existing environment: its driver must have a Python session.
    absl::StatusOr<DriverKind> runtime = manager->RuntimeOf(caller, spec.environment_id);
    if (!runtime.ok()) return runtime.status();
    if (!manager->CapabilitiesOf(*runtime).Has(Capability::kPythonSession))
      return MissingCapabilityError(ToString(*runtime), Capability::kPythonSession);
    if (*runtime == kNanoRuntime && !spec.packages.empty())
      return absl::InvalidArgumentError(
          "'packages' cannot be installed in a nano environment (create the environment with "
          "runtime \"container\")");
    plan.kind = RunPlan::Kind::kEnvironment;
    plan.env_runtime = *runtime;
    plan.reason = *runtime == kNanoRuntime
                      ? "stateful nano session"
                      : absl::StrCat("stateful ", AbslView(ToString(*runtime)), " kernel");
    plan.spec = std::move(spec);
    return plan;
  }

  // One-shot: pick the tier; auto may fall back from nano to heavy.
  const bool nano = manager->CapabilitiesOf(kNanoRuntime).Has(Capability::kPythonOneShot);
  bool use_nano = false;
  if (spec.runtime == "nano") {
    if (!nano)
      return TierUnavailableError(
          "runtime 'nano' is not available on this daemon (see GET /healthz)");
    use_nano = true;
    plan.reason = "runtime nano requested";
  } else if (spec.runtime != "auto") {
    plan.reason = absl::StrCat("runtime ", spec.runtime, " requested");
  } else if (!nano) {
    plan.reason = "auto: nano tier not available on this daemon";
  } else if (deps_.rules) {
    router::RouteDecision d =
        deps_.rules->Current()->Decide(scan, router::RouteRequest{"auto", spec.packages, ""});
    use_nano = d.tier == router::Tier::kNano;
    plan.may_fall_back = true;
    plan.reason = d.reason;
  } else if (!spec.packages.empty()) {
    plan.reason = "auto: packages requested";
  } else {
    use_nano = plan.may_fall_back = true;
    plan.reason = "auto: no routing rules, nano first";
  }
  if (!use_nano && !manager->HasDriver(kHeavyRuntime))
    return TierUnavailableError("no tier can run this here: the container driver is not available");
  plan.kind = use_nano ? RunPlan::Kind::kNanoOnce : RunPlan::Kind::kHeavyOnce;
  plan.spec = std::move(spec);
  return plan;
}

absl::StatusOr<RunOutcome> RunPipeline::Execute(const Caller& caller, const RunPlan& plan,
                                                const RunStreams& streams) const {
  const int64_t t0 = MonotonicMs();
  absl::Status refused;
  std::unique_ptr<EnvironmentManager::CallIntent> call_intent;  // ends when the run does
  if (!plan.spec.intent.empty()) {
    auto begun = deps_.manager->BeginCallIntent(caller, plan.spec.environment_id, plan.spec.intent,
                                                plan.spec.timeout_ms, "run");
    if (begun.ok())
      call_intent = *std::move(begun);
    else
      refused = begun.status();
  }
  absl::StatusOr<RunOutcome> outcome = refused.ok() ? ExecutePlan(caller.Step(), plan, streams)
                                                    : absl::StatusOr<RunOutcome>(refused);
  deps_.manager->audit().Record(
      caller,
      {.environment_id = plan.spec.environment_id,
       .action = "run",
       .detail =
           outcome.ok() ? absl::StrCat("[", outcome->tier, "] ", plan.spec.code) : plan.spec.code,
       .exit_code = outcome.ok() ? std::optional<int64_t>(outcome->result.exit_code) : std::nullopt,
       .duration_ms = MonotonicMs() - t0,
       .bytes = static_cast<int64_t>(plan.spec.code.size()),
       .outcome = outcome.status()});
  return outcome;
}

absl::StatusOr<RunOutcome> RunPipeline::ExecutePlan(const Caller& step, const RunPlan& plan,
                                                    const RunStreams& streams) const {
  EnvironmentManager* manager = deps_.manager;
  const RunSpec& spec = plan.spec;
  switch (plan.kind) {
    case RunPlan::Kind::kEnvironment: {
      if (plan.env_runtime != kNanoRuntime)
        return RunInEnvironment(step, spec.environment_id, plan, /*once=*/false, streams,
                                plan.reason);
      // A nano session cannot report artifacts itself: what changed under
      // /workspace/artifacts during the run is one.
      const FileStamps before = ScanArtifactFiles(manager, step, spec.environment_id);
      auto r =
          manager->RunCode(step, spec.environment_id, ToRunRequest(spec, false), streams.output);
      if (!r.ok()) return r.status();
      RunOutcome o;
      o.result = std::move(*r);
      o.tier = "nano";
      o.reason = plan.reason;
      if (!o.result.instance_reset)
        CollectArtifacts(
            step, spec.environment_id,
            ChangedArtifactFiles(before, ScanArtifactFiles(manager, step, spec.environment_id)),
            &o);
      return o;
    }
    case RunPlan::Kind::kNanoOnce: {
      auto r = manager->RunOneShot(step, kNanoRuntime, ToRunRequest(spec, true), streams.output);
      if (!r.ok()) return r.status();
      RunOutcome o;
      o.result = std::move(*r);
      o.tier = "nano";
      o.reason = plan.reason;
      // Fallback (seed P2-013): a one-shot nano run has no effects beyond its own instance,
      // so rerunning on heavy is safe.
      if (plan.may_fall_back && !o.result.unsupported_module.empty() &&
          manager->HasDriver(kHeavyRuntime))
        return RunHeavyOnce(step, plan,
                            absl::StrCat(plan.reason, "; nano cannot provide '",
                                         o.result.unsupported_module, "', reran on heavy"),
                            streams);
      return o;
    }
    case RunPlan::Kind::kHeavyOnce:
      return RunHeavyOnce(step, plan, plan.reason, streams);
  }
  return absl::InternalError("unknown run plan");
}

absl::StatusOr<RunOutcome> RunPipeline::RunHeavyOnce(const Caller& step, const RunPlan& plan,
                                                     const std::string& reason,
                                                     const RunStreams& streams) const {
  // A throw-away heavy environment of the caller's tenant (it counts against the quotas like
  // any other), running the code once through the kernel; destroyed on every path.
  EnvironmentManager* manager = deps_.manager;
  EnvSpec spec = manager->options().default_spec;
  spec.runtime = kHeavyRuntime;
  if (plan.spec.memory_mb > 0) spec.memory_mb = plan.spec.memory_mb;
  const int64_t timeout_s = std::max<int64_t>(1, (plan.spec.timeout_ms + 999) / 1000);
  // Thrown away after the run: nothing to travel back to.
  StepSettings no_steps;
  no_steps.capture = false;
  auto env = manager->Create(step, spec, std::max<int64_t>(60, timeout_s + 60), nullptr, &no_steps);
  if (!env.ok()) return env.status();
  const std::string id = env->record.id;
  struct DestroyOnExit {
    const std::function<void()> fn;
    ~DestroyOnExit() { fn(); }
  } destroy{[&] { manager->Destroy(step, id, "run_finished").IgnoreError(); }};
  return RunInEnvironment(step, id, plan, /*once=*/true, streams, reason);
}

absl::StatusOr<RunOutcome> RunPipeline::RunInEnvironment(const Caller& step, const std::string& id,
                                                         const RunPlan& plan, bool once,
                                                         const RunStreams& streams,
                                                         const std::string& reason) const {
  RunOutcome o;
  if (!plan.spec.packages.empty()) {
    const int64_t t0 = MonotonicMs();
    // The install's execs and writes are one step (packages.install) of the environment.
    auto composite = deps_.manager->BeginCompositeStep(
        step, id, "packages.install",
        absl::StrCat("pip install ", absl::StrJoin(plan.spec.packages, " ")));
    auto installed = deps_.installer->Install(step, id, plan.spec.packages, streams.install);
    if (composite) composite->Finish(installed.status());
    composite.reset();
    if (!installed.ok()) return installed.status();
    o.packages = std::move(*installed);
    o.install_ms = MonotonicMs() - t0;
  }
  RunRequest rr = ToRunRequest(plan.spec, once);
  rr.on_artifacts = [&](const std::vector<ReportedArtifact>& reported) {
    CollectArtifacts(step, id, reported, &o);
  };
  auto r = deps_.manager->RunCode(step, id, rr, streams.output);
  if (!r.ok()) return r.status();
  o.result = std::move(*r);
  o.tier = "heavy";
  o.reason = reason;
  return o;
}

void RunPipeline::CollectArtifacts(const Caller& step, const std::string& id,
                                   const std::vector<ReportedArtifact>& reported,
                                   RunOutcome* o) const {
  if (reported.empty()) return;
  EnvironmentManager* manager = deps_.manager;
  ArtifactStore* store = deps_.artifacts;
  int64_t seq = 0;
  if (auto info = manager->Get(step, id); info.ok()) seq = info->record.exec_count;
  for (const ReportedArtifact& a : reported) {
    if (o->artifacts.size() + o->artifact_errors.size() >= kMaxArtifactsPerRun) {
      o->artifact_errors.push_back(absl::StrCat("more than ", kMaxArtifactsPerRun,
                                                " artifacts in one run: the rest were not kept"));
      break;
    }
    if (!a.error.empty()) {
      o->artifact_errors.push_back(a.error);
      continue;
    }
    if (a.path.empty()) continue;
    if (store == nullptr) {
      o->artifact_errors.push_back(absl::StrCat(a.name, ": this daemon keeps no artifacts"));
      continue;
    }
    absl::StatusOr<std::string> data = ReadWholeSandboxFile(
        [&](int64_t offset, int64_t length) {
          return manager->ReadFile(step, id, a.path, offset, length);
        },
        store->options().max_artifact_bytes);
    ArtifactMeta meta;
    meta.tenant = step.tenant;
    meta.environment_id = id;
    meta.kind = a.kind == "image" ? "image" : "file";
    meta.name = a.name;
    meta.mime_type = SafeMimeType(a.mime_type);
    meta.title = a.title;
    meta.step = seq;
    absl::StatusOr<ArtifactMeta> kept =
        data.ok() ? store->Put(meta, *data) : absl::StatusOr<ArtifactMeta>(data.status());
    if (kept.ok()) {
      o->artifacts.push_back(*kept);
    } else {
      o->artifact_errors.push_back(
          absl::StrCat(meta.name, ": not kept: ", kept.status().message()));
    }
  }
}

}  // namespace esb::run
