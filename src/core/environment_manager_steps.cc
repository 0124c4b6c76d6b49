// Time travel (issue 13; docs/design.md "Time travel"): the step log of EnvironmentManager.
// A step is recorded after each mutating call on an environment whose capture is on: the
// driver captures the state (Driver::CaptureStep: a workspace manifest whose file contents are
// blobs, the shell state, the variables' summary, maybe an honest memory snapshot), the core
// stores the manifest, the summary and the shell state as blobs and the step as a row. A capture
// failure never fails the user's call: the step then records memory "none" and why.
#include <sys/stat.h>

#include <algorithm>
#include <boost/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/utf8.h"
#include "common/util.h"
#include "core/environment_manager.h"
#include "core/snapshots/blob_store.h"
#include "core/snapshots/step_guard.h"

namespace esb {

namespace json = boost::json;

namespace {

constexpr char kStepCollectedUrl[] = "type.entersandbox/step-collected";
// A call waits at most this long for the environment's previous mutating call to finish.
constexpr auto kStepLockWait = std::chrono::minutes(15);
constexpr auto kStepReadWait = std::chrono::milliseconds(100);
// After a capture was refused (a tenant's share full) the sweep runs this soon (at most).
constexpr int64_t kUrgentSweepIntervalMs = 1000;

// The environment this thread is inside a step of (nested calls make no steps).
thread_local const void* tl_step_env = nullptr;

// Cut at a UTF-8 boundary at most `max` bytes from the start / the end.
std::string HeadBytes(std::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return absl::StrCat(AbslView(s.substr(0, n)), "…");
}
std::string TailBytes(std::string_view s, size_t max, bool* cut) {
  if (s.size() <= max) return std::string(s);
  *cut = true;
  size_t start = s.size() - max;
  while (start < s.size() && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) ++start;
  return std::string(s.substr(start));
}

json::object ParseObject(std::string_view text) {
  boost::system::error_code ec;
  json::value v = json::parse(json::string_view(text.data(), text.size()), ec);
  if (ec || !v.is_object()) return {};
  return std::move(v.as_object());
}

std::string StringField(const json::object& o, std::string_view key) {
  const json::value* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : "";
}

json::object SnapshotToJson(const SnapshotRef& s) {
  return json::object{{"id", s.id},
                      {"driver", s.driver},
                      {"content", std::string(SnapshotContentName(s.content))},
                      {"source_id", s.source_id},
                      {"state", s.state},
                      {"bytes", s.bytes},
                      {"live", s.live}};
}

std::optional<SnapshotRef> SnapshotFromJson(const json::object& state) {
  const json::value* m = state.if_contains("memory");
  if (!m || !m->is_object()) return std::nullopt;
  const json::object& o = m->as_object();
  SnapshotRef s;
  s.id = StringField(o, "id");
  s.driver = StringField(o, "driver");
  std::string content = StringField(o, "content");
  s.content = content == "memory" ? SnapshotContent::kMemory
              : content == "disk" ? SnapshotContent::kDisk
                                  : SnapshotContent::kMemoryAndDisk;
  s.source_id = StringField(o, "source_id");
  s.state = StringField(o, "state");
  if (const json::value* b = o.if_contains("bytes"); b && b->is_int64()) s.bytes = b->as_int64();
  if (const json::value* l = o.if_contains("live"); l && l->is_bool()) s.live = l->as_bool();
  return s;
}

// The cwd a driver's shell state says, when it is a JSON object with one.
std::string CwdOf(std::string_view shell_state) {
  return StringField(ParseObject(shell_state), "cwd");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Settings and errors

std::string StepSettingsToJson(const StepSettings& s) {
  return json::serialize(json::object{{"capture", s.capture},
                                      {"max_steps", s.max_steps},
                                      {"max_bytes", s.max_bytes},
                                      {"max_live_memory", s.max_live_memory},
                                      {"ttl_s", s.ttl_s}});
}

absl::StatusOr<StepSettings> StepSettingsFromJson(const std::string& text) {
  json::object o = ParseObject(text);
  StepSettings s;
  if (const json::value* v = o.if_contains("capture"); v && v->is_bool()) s.capture = v->as_bool();
  auto num = [&](const char* key, int64_t* out) {
    if (const json::value* v = o.if_contains(key); v && v->is_int64()) *out = v->as_int64();
  };
  num("max_steps", &s.max_steps);
  num("max_bytes", &s.max_bytes);
  num("max_live_memory", &s.max_live_memory);
  num("ttl_s", &s.ttl_s);
  if (absl::Status st = ValidateStepSettings(s); !st.ok()) return st;
  return s;
}

absl::Status ValidateStepSettings(const StepSettings& s) {
  auto range = [](const char* name, int64_t v, int64_t lo, int64_t hi) -> absl::Status {
    if (v < lo || v > hi)
      return absl::InvalidArgumentError(
          absl::StrCat("steps.", name, " must be between ", lo, " and ", hi));
    return absl::OkStatus();
  };
  if (auto st = range("max_steps", s.max_steps, 1, kMaxStepsSetting); !st.ok()) return st;
  if (auto st = range("max_bytes", s.max_bytes, 0, kMaxStepBytesSetting); !st.ok()) return st;
  if (auto st = range("max_live_memory", s.max_live_memory, 0, kMaxLiveMemorySetting); !st.ok())
    return st;
  return range("ttl_s", s.ttl_s, 0, kMaxStepTtlSetting);
}

absl::Status StepCollectedError(std::string_view message) {
  absl::Status st = absl::NotFoundError(AbslView(message));
  st.SetPayload(kStepCollectedUrl, absl::Cord("1"));
  return st;
}

bool IsStepCollected(const absl::Status& status) {
  return status.GetPayload(kStepCollectedUrl).has_value();
}

// A stored part of a step's state that cannot be read: gone (NotFound: 410 "collected") or
// failing verification (DataLoss: logged, 410 "corrupt"); other errors pass unchanged.
absl::Status StepStateGone(const absl::Status& st, std::string_view what) {
  if (absl::IsNotFound(st))
    return StepCollectedError(absl::StrCat(AbslView(what), " was collected by retention"));
  if (absl::IsDataLoss(st)) {
    LogError(absl::StrCat("step state: ", AbslView(what), " is corrupt: ", st.message()));
    return absl::DataLossError(absl::StrCat(AbslView(what), " is corrupt (it fails verification)"));
  }
  return st;
}

namespace {
// A driver that cannot bring a step's state back because part of it is gone (a blob or image
// collected, a live snapshot lost, contents that do not match) answers 410 "collected", as the
// files route does; other errors pass unchanged.
absl::Status StepRestoreError(const absl::Status& st, int64_t n) {
  if (!absl::IsFailedPrecondition(st) && !absl::IsNotFound(st) && !absl::IsDataLoss(st)) return st;
  if (IsStepCollected(st)) return st;
  return StepCollectedError(absl::StrCat("step ", n, " cannot be restored: ", st.message()));
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Recording

StepGuard::~StepGuard() {
  if (thread_marked) tl_step_env = previous;
}

void ResetStepThread(const void* previous) { tl_step_env = previous; }

void ApplyStepOutcome(StepGuard& g, const StepOutcome& o) {
  StepRecord& r = g.rec;
  r.duration_ms = MonotonicMs() - g.t0_mono;
  r.exit_code = o.exit_code;
  const bool failed = !o.status.ok() || (o.exit_code && *o.exit_code != 0) || !o.error.empty();
  r.status = failed ? "error" : "ok";
  if (!o.status.ok())
    r.error = HeadBytes(o.status.ToString(), kMaxStepSummaryBytes);
  else if (!o.error.empty())
    r.error = HeadBytes(o.error, kMaxStepSummaryBytes);
  else if (o.exit_code && *o.exit_code != 0)
    r.error = absl::StrCat("exit code ", *o.exit_code);
  if (!o.tier.empty()) r.tier = o.tier;
  json::object detail = ParseObject(r.detail_json);
  bool cut = o.truncated;
  std::string out = TailBytes(o.stdout_data, kMaxStepOutputBytes, &cut);
  std::string err = TailBytes(o.stderr_data, kMaxStepOutputBytes, &cut);
  detail["output"] = json::object{
      {"stdout", SanitizeUtf8(out)}, {"stderr", SanitizeUtf8(err)}, {"truncated", cut}};
  if (!o.artifacts_json.empty()) {
    boost::system::error_code ec;
    json::value a = json::parse(o.artifacts_json, ec);
    if (!ec && a.is_array()) detail["artifacts"] = std::move(a);
  }
  r.detail_json = json::serialize(detail);
}

absl::StatusOr<std::unique_ptr<StepGuard>> EnvironmentManager::BeginStep(
    const std::shared_ptr<LiveEnv>& env, std::string kind, std::string summary,
    std::string input_json) {
  if (tl_step_env == env.get()) return nullptr;  // inside a (composite) step of it already
  auto g = std::make_unique<StepGuard>();
  g->lock = std::unique_lock<std::recursive_timed_mutex>(env->step_mu, std::defer_lock);
  // Whether it captures is read under step_mu; a call that finds it off goes on unserialised.
  if (!g->lock.try_lock_for(kStepLockWait))
    return absl::UnavailableError(
        "another call on this environment has been running for too long (calls on an "
        "environment that records steps run one at a time)");
  if (!env->steps_loaded) LoadSteps(*env);
  if (!env->capture) return nullptr;
  g->env = env;
  g->t0_mono = MonotonicMs();
  g->rec.kind = std::move(kind);
  g->rec.summary = SanitizeUtf8(HeadBytes(summary, kMaxStepSummaryBytes));
  g->rec.started_ms = Now();
  g->rec.tier = env->driver->name();
  if (input_json.size() > kMaxStepInputBytes) {
    input_json = json::serialize(json::object{
        {"truncated", true}, {"text", SanitizeUtf8(HeadBytes(input_json, kMaxStepInputBytes))}});
  }
  json::object detail;
  boost::system::error_code ec;
  json::value input = json::parse(input_json, ec);
  detail["input"] = ec ? json::value(json::object{}) : std::move(input);
  g->rec.detail_json = json::serialize(detail);
  g->previous = tl_step_env;
  tl_step_env = env.get();
  g->thread_marked = true;
  return g;
}

void EnvironmentManager::RecordStepLocked(LiveEnv& env, StepRecord rec) {
  {
    std::lock_guard<std::mutex> elock(env.mu);
    if (env.record.state != EnvState::kRunning) return;  // being destroyed: its log is gone
  }
  rec.env_id = env.record.id;  // immutable
  rec.tenant = env.tenant;
  rec.n = env.next_step;
  rec.parent = env.head;
  if (rec.tier.empty()) rec.tier = env.driver->name();
  const StepMemorySupport support = env.driver->StepMemory();
  // The base's blobs must still be there for a capture to reuse them: a base whose step was
  // collected (after steps without state) may have been swept, so everything is read again.
  if (env.head_manifest) {
    auto base = env.head_manifest_step ? env.steps.find(*env.head_manifest_step) : env.steps.end();
    if (base == env.steps.end() || !base->second.has_state) env.head_manifest.reset();
  }
  CaptureOptions opts;
  opts.previous = env.head_manifest.get();
  opts.memory = support.available && env.step_settings.max_live_memory > 0;
  opts.max_bytes = std::max<int64_t>(1, env.step_settings.max_bytes);
  InstanceRef ref;
  {
    std::lock_guard<std::mutex> elock(env.mu);
    ref = env.ref;
  }
  // The tenant's namespace of the blob store: what this capture stores or finds stays pinned
  // (never swept) until its step is written, and is charged to the tenant's share.
  DiskBlobStore::Tenant blobs = options_.blobs->ForTenant(env.tenant);
  const int64_t t0 = MonotonicMs();
  absl::StatusOr<StepState> state =
      options_.blobs->tenant_bytes(env.tenant) >= options_.blobs->tenant_cap()
          ? absl::ResourceExhaustedError(
                absl::StrCat("capture refused: this tenant's share of the step store is full (",
                             options_.blobs->tenant_cap(), " bytes)"))
          : env.driver->CaptureStep(ref, opts, blobs);
  json::object state_json;
  std::shared_ptr<const WorkspaceManifest> manifest;
  LiveEnv::StepBrief brief;
  if (state.ok()) {
    absl::Status st = ValidateManifest(state->workspace);
    std::string manifest_text;
    absl::StatusOr<std::string> sha = absl::UnknownError("unset");
    if (st.ok()) {
      manifest_text = EncodeManifest(state->workspace);
      sha = blobs.Put(manifest_text);
    } else {
      sha = st;
    }
    if (!sha.ok()) {
      state = sha.status();
    } else {
      rec.manifest_sha = *sha;
      brief.has_state = true;
      rec.bytes += static_cast<int64_t>(manifest_text.size());
      if (!state->shell_state.empty()) {
        if (auto s = blobs.Put(state->shell_state); s.ok()) state_json["shell"] = *s;
      }
      if (!state->variables_json.empty()) {
        if (auto s = blobs.Put(state->variables_json); s.ok()) state_json["vars"] = *s;
      }
      // Blob bytes this step adds: its manifest and the file contents its parent did not have
      // (memory snapshots are bounded by max_live_memory, not by max_bytes).
      const WorkspaceManifest empty;
      const WorkspaceManifest& parent = env.head_manifest ? *env.head_manifest : empty;
      for (const ManifestEntry& e : state->workspace.entries) {
        if (e.type != ManifestEntry::Type::kFile) continue;
        const ManifestEntry* before = FindEntry(parent, e.path);
        if (!before || before->sha256 != e.sha256) rec.bytes += e.size;
      }
      rec.files_changed = static_cast<int64_t>(DiffManifests(parent, state->workspace).size());
      if (state->memory) {
        state_json["memory"] = SnapshotToJson(*state->memory);
        rec.memory = "snapshot";
        rec.memory_live = state->memory->live;  // bounded by max_live_memory, not max_bytes
        // An image on disk (gVisor's checkpoint) counts towards max_bytes like file contents.
        if (!state->memory->live) rec.bytes += std::max<int64_t>(0, state->memory->bytes);
        brief.memory = true;
        brief.live = state->memory->live;
      } else {
        rec.memory = "none";
        rec.memory_detail =
            env.step_settings.max_live_memory == 0 || !support.available
                ? (support.available ? "off" : absl::StrCat("unsupported: ", support.reason))
            : !state->memory_reason.empty()
                ? HeadBytes(absl::StrCat("unsupported: ", state->memory_reason), 512)
                : "unsupported: the driver took no memory snapshot";
      }
      manifest = std::make_shared<const WorkspaceManifest>(std::move(state->workspace));
      std::string cwd = CwdOf(state->shell_state);
      if (!cwd.empty()) {
        json::object detail = ParseObject(rec.detail_json);
        detail["cwd"] = cwd;
        rec.detail_json = json::serialize(detail);
      }
    }
  }
  if (!state.ok()) {
    // The call itself succeeded or failed on its own: its step stays, without state.
    metrics_->CountError("step_capture");
    LogWarn(absl::StrCat("step capture of ", rec.env_id, " failed: ", state.status().ToString()));
    const bool refused = absl::IsResourceExhausted(state.status()) &&
                         absl::StartsWith(state.status().message(), "capture refused");
    rec.memory = "none";
    rec.memory_detail =
        HeadBytes(absl::StrCat(refused ? "unsupported: " : "unsupported: capture failed: ",
                               state.status().message()),
                  512);
    rec.manifest_sha.clear();
    // What it stored before failing is referenced by no step: swept at the next sweep (its
    // pins go with `blobs`), not held for a grace period.
    sweep_needed_ = true;
    if (refused) RelieveStepPressureLocked(env);
  }
  rec.capture_ms = MonotonicMs() - t0;
  rec.created_ms = Now();
  rec.state_json = json::serialize(state_json);
  absl::Status stored;
  {
    // SECURITY: a Destroy during the capture (it does not wait for step_mu) has dropped this
    // environment's log and instance: the step is not written and what the capture made (a
    // memory snapshot: e.g. a frozen nano worker) is released, never left running. Checked and
    // written under env.mu, which Destroy takes to change the state before it drops the log:
    // either the row is in the store before DropSteps reads it, or it is never written.
    std::lock_guard<std::mutex> elock(env.mu);
    stored = env.record.state == EnvState::kRunning
                 ? store_->PutStep(rec)
                 : EnvironmentNotFoundError(absl::StrCat("environment ", rec.env_id,
                                                         " was destroyed during the capture"));
  }
  if (!stored.ok()) {
    if (!IsEnvironmentNotFound(stored))
      LogError(absl::StrCat("storing step ", rec.n, " of ", rec.env_id, ": ", stored.ToString()));
    if (state.ok() && state->memory) env.driver->DeleteSnapshot(*state->memory).IgnoreError();
    return;
  }
  brief.parent = rec.parent;
  brief.bytes = rec.bytes;
  brief.created_ms = rec.created_ms;
  env.steps[rec.n] = brief;
  env.head = rec.n;
  env.next_step = rec.n + 1;
  // A step without state keeps the last manifest as the base of the next capture (its files
  // are still the best guess for what did not change) until that step is collected.
  if (manifest) {
    env.head_manifest = std::move(manifest);
    env.head_manifest_step = rec.n;
  }
  store_
      ->PutStepLog({env.record.id, env.tenant, StepSettingsToJson(env.step_settings), env.head,
                    env.next_step, Now()})
      .IgnoreError();
  EnforceRetentionLocked(env);
  StepsStatusOf(env);  // refreshes what reads show while the next call runs
}

void EnvironmentManager::InitSteps(LiveEnv& env, const StepSettings& settings,
                                   const std::string& kind, const std::string& summary,
                                   const std::string& input_json) {
  std::unique_lock<std::recursive_timed_mutex> lock(env.step_mu);
  env.step_settings = ClampStepSettings(settings);
  env.steps_loaded = true;
  const bool has_steps = env.driver->Capabilities().Has(Capability::kSteps);
  env.capture = settings.capture && has_steps && options_.blobs != nullptr;
  if (!settings.capture)
    env.capture_reason = "capture is off for this environment";
  else if (!has_steps)
    env.capture_reason =
        absl::StrCat("the '", env.driver->name(), "' runtime does not record steps");
  else if (options_.blobs == nullptr)
    env.capture_reason = "this daemon keeps no step state";
  else if (StepMemorySupport m = env.driver->StepMemory(); !m.available)
    env.capture_reason = m.reason;
  store_
      ->PutStepLog({env.record.id, env.tenant, StepSettingsToJson(env.step_settings), std::nullopt,
                    0, Now()})
      .IgnoreError();
  if (!env.capture) return;
  StepRecord rec;
  rec.kind = kind;
  rec.summary = SanitizeUtf8(HeadBytes(summary, kMaxStepSummaryBytes));
  rec.started_ms = Now();
  rec.detail_json = json::serialize(json::object{{"input", ParseObject(input_json)}});
  RecordStepLocked(env, std::move(rec));
}

void EnvironmentManager::LoadSteps(LiveEnv& env) {
  // Caller holds env.step_mu.
  env.steps_loaded = true;
  StepSettings settings;
  auto log = store_->GetStepLog(env.tenant, env.record.id);
  if (log.ok()) {
    if (auto s = StepSettingsFromJson(log->settings_json); s.ok()) settings = ClampStepSettings(*s);
    env.head = log->head;
    env.next_step = log->next_step;
  }
  env.step_settings = settings;
  const bool has_steps = env.driver->Capabilities().Has(Capability::kSteps);
  env.capture = settings.capture && has_steps && options_.blobs != nullptr;
  if (!env.capture)
    env.capture_reason = !settings.capture ? "capture is off for this environment"
                                           : "this runtime or daemon does not record steps";
  else if (StepMemorySupport m = env.driver->StepMemory(); !m.available)
    env.capture_reason = m.reason;
  env.steps.clear();
  int64_t before = -1;
  while (true) {
    auto page = store_->ListSteps(env.tenant, env.record.id, before, kMaxStepsListed);
    if (!page.ok() || page->empty()) break;
    for (const StepRecord& r : *page) {
      LiveEnv::StepBrief b;
      b.parent = r.parent;
      b.bytes = r.bytes;
      b.created_ms = r.created_ms;
      b.has_state = !r.manifest_sha.empty() && !r.collected;
      b.memory = r.memory == "snapshot";
      b.live = r.memory_live;
      env.steps[r.n] = b;
      before = r.n;
    }
  }
  env.head_manifest.reset();
  env.head_manifest_step = env.head;
  if (env.head && options_.blobs) {
    auto rec = store_->GetStep(env.tenant, env.record.id, *env.head);
    if (rec.ok() && !rec->manifest_sha.empty()) {
      auto text = options_.blobs->ForTenant(env.tenant).Get(rec->manifest_sha);
      if (text.ok()) {
        auto m = DecodeManifest(*text);
        if (m.ok()) env.head_manifest = std::make_shared<const WorkspaceManifest>(*std::move(m));
      }
    }
  }
}

StepsStatus EnvironmentManager::StepsStatusOf(LiveEnv& env) {
  std::unique_lock<std::recursive_timed_mutex> lock(env.step_mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    // A call is running: what it was before it (never waits behind it).
    std::lock_guard<std::mutex> elock(env.mu);
    return env.steps_status;
  }
  if (!env.steps_loaded) LoadSteps(env);
  StepsStatus s;
  s.capture = env.capture;
  s.head = env.head;
  s.count = static_cast<int64_t>(env.steps.size());
  const StepMemorySupport m = env.driver->StepMemory();
  s.memory =
      env.capture && m.available && env.step_settings.max_live_memory > 0 ? "snapshot" : "none";
  s.memory_reason = s.memory == "snapshot" ? "" : env.capture_reason;
  if (s.memory_reason.empty() && s.memory == "none")
    s.memory_reason = m.available ? "memory snapshots are off (max_live_memory 0)" : m.reason;
  std::lock_guard<std::mutex> elock(env.mu);
  env.steps_status = s;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Retention

void EnvironmentManager::CollectStepLocked(LiveEnv& env, int64_t n, const std::string& why) {
  auto it = env.steps.find(n);
  if (it == env.steps.end()) return;
  auto rec = store_->GetStep(env.tenant, env.record.id, n);
  if (!rec.ok()) return;
  json::object state = ParseObject(rec->state_json);
  if (auto snap = SnapshotFromJson(state)) {
    if (absl::Status st = env.driver->DeleteSnapshot(*snap); !st.ok())
      LogWarn(absl::StrCat("releasing the snapshot of step ", n, " of ", env.record.id, ": ",
                           st.ToString()));
    state.erase("memory");
  }
  rec->collected = true;
  rec->memory = "none";
  rec->memory_live = false;
  rec->memory_detail = "collected";
  rec->state_json = json::serialize(state);
  store_->PutStep(*rec).IgnoreError();
  it->second.has_state = false;
  it->second.memory = it->second.live = false;
  it->second.bytes = 0;
  sweep_needed_ = true;
  LogInfo(absl::StrCat("step ", n, " of ", env.record.id, " collected (", why, ")"));
}

void EnvironmentManager::CompactStepMemory(int budget) {
  // A driver that released live snapshots on its own (e.g. nano over its live-memory budget,
  // possibly another environment's) has steps to reconcile even when nothing was flagged.
  bool released = false;
  for (const auto& [kind, d] : drivers_) released = released || d->HasReleasedSnapshots();
  if (!compact_needed_.exchange(false) && !released) return;
  std::vector<std::shared_ptr<LiveEnv>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : envs_) live.push_back(e);
  }
  for (auto& env : live) {
    if (budget <= 0 || steps_stop_) {
      compact_needed_ = true;  // the rest at the next tick
      break;
    }
    std::unique_lock<std::recursive_timed_mutex> lock(env->step_mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      compact_needed_ = true;  // busy with a call: next tick (its own step re-flags it anyway)
      continue;
    }
    if (released && !env->driver->ReleasedSnapshots(env->record.id).empty()) {
      env->compact_pending = true;
    }
    if (!env->compact_pending) continue;
    env->compact_pending = false;
    EnforceRetentionLocked(*env, &budget);  // re-flags it when the budget ran out
    StepsStatusOf(*env);
  }
}

void EnvironmentManager::ExpireSteps() {
  std::vector<std::shared_ptr<LiveEnv>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : envs_) live.push_back(e);
  }
  const int64_t now = Now();
  for (auto& env : live) {
    if (steps_stop_) return;
    std::unique_lock<std::recursive_timed_mutex> lock(env->step_mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;  // a call is running: its own step applies the ttl
    if (!env->steps_loaded) {
      // Re-attached after a restart and not used since; one still being created (no log yet)
      // is left to its InitSteps.
      if (!store_->GetStepLog(env->tenant, env->record.id).ok()) continue;
      LoadSteps(*env);
    }
    if (!env->capture || env->step_settings.ttl_s <= 0) continue;
    bool due = false;
    for (const auto& [n, b] : env->steps) {
      if ((b.has_state || b.memory) && (!env->head || n != *env->head) &&
          now - b.created_ms > env->step_settings.ttl_s * 1000) {
        due = true;
        break;
      }
    }
    if (!due) continue;
    EnforceRetentionLocked(*env);
    StepsStatusOf(*env);
  }
}

void EnvironmentManager::RelieveStepPressureLocked(LiveEnv& env) {
  std::vector<int64_t> kept;
  for (const auto& [n, b] : env.steps) {
    if ((b.has_state || b.memory) && (!env.head || n != *env.head)) kept.push_back(n);
  }
  // The older half (at least one): what this environment holds goes first, and the tenant's
  // other environments keep theirs.
  const size_t drop = (kept.size() + 1) / 2;
  for (size_t i = 0; i < drop; ++i) CollectStepLocked(env, kept[i], "the tenant's share is full");
  sweep_needed_ = true;
  sweep_urgent_ = true;
  wake_cv_.notify_all();
}

StepSettings EnvironmentManager::ClampStepSettings(StepSettings settings) const {
  if (options_.blobs != nullptr)
    settings.max_bytes = std::min(settings.max_bytes, options_.blobs->tenant_cap());
  return settings;
}

void EnvironmentManager::EnforceRetentionLocked(LiveEnv& env, int* budget) {
  const StepSettings& s = env.step_settings;
  const int64_t now = Now();
  // Oldest first; the head is referenced (the environment is at it) and never collected.
  auto collectable = [&](int64_t n) {
    if (env.head && n == *env.head) return false;
    std::lock_guard<std::mutex> elock(env.mu);
    return !env.fork_pins.count(n);  // a fork is copying from it
  };
  // 1. Live memory snapshots over the cap: compacted (or released) oldest first — by the
  // compactor thread, not on the call's path.
  int64_t live = 0;
  for (const auto& [n, b] : env.steps) live += b.live ? 1 : 0;
  if (live > s.max_live_memory && budget == nullptr) {
    env.compact_pending = true;
    compact_needed_ = true;
    live = 0;  // skip step 1 now
  }
  // Live snapshots the driver already compacted or released on its own (over its host memory
  // budget) are reconciled at once, the head's too (CompactSnapshot only adopts the result).
  std::set<std::string> released = env.driver->ReleasedSnapshots(env.record.id);
  for (auto& [n, b] : env.steps) {
    if (live <= s.max_live_memory && released.empty()) break;
    if (!b.live) continue;
    const bool over = live > s.max_live_memory && collectable(n);
    if (!over && released.empty()) continue;
    auto rec = store_->GetStep(env.tenant, env.record.id, n);
    if (!rec.ok()) continue;
    json::object state = ParseObject(rec->state_json);
    std::optional<SnapshotRef> snap = SnapshotFromJson(state);
    if (!snap) continue;
    const bool was_released = released.erase(snap->id) > 0;
    if (!over && !was_released) continue;
    if (!was_released) {  // a compaction (over implies the compactor's budget is set)
      if (*budget <= 0 || steps_stop_) {
        env.compact_pending = true;  // the rest at the next tick
        compact_needed_ = true;
        if (released.empty()) break;
        continue;
      }
      --*budget;
    }
    absl::StatusOr<SnapshotRef> compact = env.driver->CompactSnapshot(*snap);
    if (compact.ok()) {
      state["memory"] = SnapshotToJson(*compact);
      rec->memory_live = compact->live;
      b.live = compact->live;
    } else {
      LogWarn(absl::StrCat("step ", n, " of ", env.record.id,
                           ": memory not kept (collected): ", compact.status().message()));
      env.driver->DeleteSnapshot(*snap).IgnoreError();
      state.erase("memory");
      rec->memory = "none";
      rec->memory_live = false;
      rec->memory_detail = "collected";
      b.memory = b.live = false;
    }
    rec->state_json = json::serialize(state);
    store_->PutStep(*rec).IgnoreError();
    --live;
  }
  // 2. Steps with state over max_steps or max_bytes, or older than ttl_s: collected.
  int64_t with_state = 0, bytes = 0;
  for (const auto& [n, b] : env.steps) {
    if (b.has_state || b.memory) ++with_state, bytes += b.bytes;
  }
  for (auto& [n, b] : env.steps) {
    if (!(b.has_state || b.memory) || !collectable(n)) continue;
    const bool expired = s.ttl_s > 0 && now - b.created_ms > s.ttl_s * 1000;
    if (!expired && with_state <= s.max_steps && bytes <= s.max_bytes) continue;
    const int64_t freed = b.bytes;
    CollectStepLocked(env, n,
                      expired                    ? "ttl"
                      : with_state > s.max_steps ? "max_steps"
                                                 : "max_bytes");
    --with_state;
    bytes -= freed;
  }
  // 3. Rows: beyond the cap the oldest collected summaries go (step 0 stays).
  int64_t rows = static_cast<int64_t>(env.steps.size());
  if (rows > kMaxStepRowsPerEnvironment) {
    std::vector<int64_t> drop;
    for (const auto& [n, b] : env.steps) {
      if (rows - static_cast<int64_t>(drop.size()) <= kMaxStepRowsPerEnvironment) break;
      if (n != 0 && !b.has_state && !b.memory && collectable(n)) drop.push_back(n);
    }
    for (int64_t n : drop) {
      env.steps.erase(n);
      store_->DeleteStep(env.record.id, n).IgnoreError();
    }
  }
}

void EnvironmentManager::ReleaseLoggedSnapshots(const std::string& tenant,
                                                const std::string& env_id, Driver* driver) {
  int64_t before = -1;
  while (true) {
    auto page = store_->ListSteps(tenant, env_id, before, kMaxStepsListed);
    if (!page.ok() || page->empty()) break;
    for (const StepRecord& r : *page) {
      before = r.n;
      std::optional<SnapshotRef> snap = SnapshotFromJson(ParseObject(r.state_json));
      if (!snap) continue;
      Driver* d = driver;
      for (const auto& [kind, candidate] : drivers_) {
        if (d == nullptr && candidate->name() == snap->driver) d = candidate;
      }
      if (d != nullptr) d->DeleteSnapshot(*snap).IgnoreError();
    }
  }
}

void EnvironmentManager::DropSteps(LiveEnv& env) {
  // From the store, not under step_mu: a destroy never waits for a running call (whose step,
  // should it finish later, is not written: RecordStepLocked checks the state).
  ReleaseLoggedSnapshots(env.tenant, env.record.id, env.driver);
  store_->DeleteSteps(env.record.id).IgnoreError();
  sweep_needed_ = true;
}

void EnvironmentManager::RecoverSteps() {
  // Live memory snapshots were held by processes of the previous esbd (or worker): gone.
  if (auto lost = store_->ListLiveMemorySteps(); lost.ok()) {
    for (StepRecord& r : *lost) {
      json::object state = ParseObject(r.state_json);
      state.erase("memory");
      r.state_json = json::serialize(state);
      r.memory = "none";
      r.memory_live = false;
      r.memory_detail = "lost_on_restart";
      store_->PutStep(r).IgnoreError();
    }
    if (!lost->empty())
      LogInfo(absl::StrCat(lost->size(), " live step memory snapshot(s) lost on restart"));
  }
  // Step logs of environments that are no longer alive.
  if (auto logs = store_->ListStepLogs(); logs.ok()) {
    std::set<std::string> alive;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, e] : envs_) alive.insert(id);
    }
    for (const StepLogRecord& l : *logs) {
      if (!alive.count(l.env_id)) {
        // Their snapshots that outlive a process (e.g. nano's compacted images on disk) go too.
        ReleaseLoggedSnapshots(l.tenant, l.env_id, nullptr);
        store_->DeleteSteps(l.env_id).IgnoreError();
        sweep_needed_ = true;
      }
    }
  }
}

void EnvironmentManager::SweepBlobs(bool force) {
  if (options_.blobs == nullptr) return;
  if (!force && !sweep_needed_.load()) return;
  std::lock_guard<std::mutex> lock(sweep_mu_);
  const int64_t now_real = NowUnixMs();
  const bool urgent = sweep_urgent_.exchange(false);
  const int64_t interval = urgent
                               ? std::min(kUrgentSweepIntervalMs, options_.blob_sweep_interval_ms)
                               : options_.blob_sweep_interval_ms;
  if (!force && now_real - last_sweep_ms_ < interval) {
    if (urgent) sweep_urgent_ = true;
    return;
  }
  last_sweep_ms_ = now_real;
  sweep_needed_ = false;
  DiskBlobStore& store = *options_.blobs;
  // From here every blob a capture pins (stores or re-finds) is kept by this sweep, whether
  // its step was written before or after the steps are read below.
  store.BeginSweep();
  struct EndSweep {
    DiskBlobStore& s;
    ~EndSweep() { s.EndSweep(); }
  } end{store};
  auto refs = store_->ListStepBlobRefs();
  if (!refs.ok()) {
    sweep_needed_ = true;
    return;
  }
  // Per tenant (each has its own namespace): every step's manifest, shell state and variables
  // (kept as long as the environment), and the file contents of steps that are not collected.
  std::map<std::string, std::vector<const StepRecord*>> by_tag;
  for (const StepRecord& r : *refs) by_tag[DiskBlobStore::TenantTag(r.tenant)].push_back(&r);
  int64_t removed = 0, freed = 0;
  for (const std::string& tag : store.TenantTags()) {
    if (steps_stop_) {
      sweep_needed_ = true;
      return;
    }
    std::set<std::string> marked;
    std::set<std::string> decoded;
    bool unsure = false;
    std::string why;
    for (const StepRecord* r : by_tag[tag]) {
      if (steps_stop_ || unsure) break;
      json::object state = ParseObject(r->state_json);
      for (const char* k : {"shell", "vars"}) {
        std::string sha = StringField(state, k);
        if (!sha.empty()) marked.insert(sha);
      }
      if (r->manifest_sha.empty()) continue;
      marked.insert(r->manifest_sha);
      if (r->collected || !decoded.insert(r->manifest_sha).second) continue;
      auto text = store.ForTenant(r->tenant).Get(r->manifest_sha);
      // A manifest that is not there names nothing that could be restored; any other failure
      // (an I/O error, corrupt bytes, a manifest this build cannot decode) may hide blobs a
      // step still needs: the tenant keeps everything this time (fails closed).
      if (absl::IsNotFound(text.status())) continue;
      absl::StatusOr<WorkspaceManifest> m =
          text.ok() ? DecodeManifest(*text) : absl::StatusOr<WorkspaceManifest>(text.status());
      if (!m.ok()) {
        unsure = true;
        why = absl::StrCat("step ", r->n, " of ", r->env_id, ": ", m.status().ToString());
        break;
      }
      for (const ManifestEntry& e : m->entries) {
        if (e.type == ManifestEntry::Type::kFile) marked.insert(e.sha256);
      }
    }
    if (steps_stop_) {
      sweep_needed_ = true;
      return;
    }
    if (unsure) {
      sweep_needed_ = true;  // tried again at the next sweep
      LogWarn(absl::StrCat("step blobs: a manifest cannot be read (", why,
                           "); nothing of its tenant is swept"));
      continue;
    }
    auto all = store.List(tag);
    if (!all.ok()) {
      sweep_needed_ = true;
      continue;
    }
    for (const DiskBlobStore::Entry& e : *all) {
      if (marked.count(e.key)) continue;
      if (int64_t size = store.RemoveUnused(tag, e.key); size > 0) ++removed, freed += size;
    }
  }
  if (removed) LogInfo(absl::StrCat("step blobs: ", removed, " swept (", freed, " bytes)"));
}

void EnvironmentManager::CompactorLoop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(wake_mu_);
      wake_cv_.wait_for(lock, std::chrono::milliseconds(options_.steps_worker_interval_ms),
                        [this] { return stopping_; });
      if (stopping_) return;
    }
    CompactStepMemory();  // live memory snapshots over an environment's cap (bounded per tick)
  }
}

void EnvironmentManager::SweeperLoop() {
  bool throttled = false;  // an urgent sweep had to wait: no early wake-up for it again
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(wake_mu_);
      wake_cv_.wait_for(lock, std::chrono::milliseconds(options_.steps_worker_interval_ms),
                        [&] { return stopping_ || (!throttled && sweep_urgent_.load()); });
      if (stopping_) return;
    }
    ExpireSteps();                // steps older than their ttl_s, without a new step
    SweepBlobs(/*force=*/false);  // unreferenced step blobs (throttled; cheap when none)
    throttled = sweep_urgent_.load();
  }
}

// ---------------------------------------------------------------------------------------------
// Reads

std::set<int64_t> EnvironmentManager::AncestorsOfHeadLocked(const LiveEnv& env) const {
  std::set<int64_t> out;
  std::optional<int64_t> at = env.head;
  while (at && out.insert(*at).second) {
    auto it = env.steps.find(*at);
    if (it == env.steps.end()) break;
    at = it->second.parent;
  }
  return out;
}

std::set<int64_t> EnvironmentManager::AncestorsFromStore(const std::string& tenant,
                                                         const std::string& id,
                                                         std::optional<int64_t>* head) {
  std::set<int64_t> out;
  auto log = store_->GetStepLog(tenant, id);
  if (!log.ok()) return out;
  *head = log->head;
  std::map<int64_t, std::optional<int64_t>> parents;
  int64_t before = -1;
  while (true) {
    auto page = store_->ListSteps(tenant, id, before, kMaxStepsListed);
    if (!page.ok() || page->empty()) break;
    for (const StepRecord& r : *page) parents[r.n] = r.parent, before = r.n;
  }
  std::optional<int64_t> at = log->head;
  while (at && out.insert(*at).second) {
    auto it = parents.find(*at);
    if (it == parents.end()) break;
    at = it->second;
  }
  return out;
}

absl::StatusOr<StepPage> EnvironmentManager::ListSteps(const Caller& caller, const std::string& id,
                                                       int64_t before, int limit) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (limit < 1 || limit > kMaxStepsListed)
    return absl::InvalidArgumentError(
        absl::StrCat("limit must be between 1 and ", kMaxStepsListed));
  StepPage page;
  std::set<int64_t> on_head;
  {
    std::unique_lock<std::recursive_timed_mutex> lock((*env)->step_mu, std::defer_lock);
    if (lock.try_lock_for(kStepReadWait)) {
      if (!(*env)->steps_loaded) LoadSteps(**env);
      page.head = (*env)->head;
      on_head = AncestorsOfHeadLocked(**env);
    } else {
      // A call is running: the stored log (a read never waits for a call to finish).
      on_head = AncestorsFromStore(caller.tenant, id, &page.head);
    }
  }
  auto rows = store_->ListSteps(caller.tenant, id, before, limit);
  if (!rows.ok()) return rows.status();
  if (static_cast<int>(rows->size()) == limit) {
    auto more = store_->ListSteps(caller.tenant, id, rows->back().n, 1);
    if (more.ok() && !more->empty()) page.next_before = rows->back().n;
  }
  page.steps = *std::move(rows);
  for (const StepRecord& r : page.steps) page.on_head.push_back(on_head.count(r.n) > 0);
  return page;
}

absl::StatusOr<StepState> EnvironmentManager::StateOfStep(const StepRecord& rec,
                                                          WorkspaceManifest* manifest) {
  if (options_.blobs == nullptr) return absl::AbortedError("this daemon keeps no step state");
  if (rec.collected)
    return absl::AbortedError(
        absl::StrCat("step ", rec.n, " was collected by retention: its state is gone"));
  if (rec.manifest_sha.empty())
    return absl::AbortedError(absl::StrCat("step ", rec.n, " has no captured state (",
                                           rec.memory_detail.value_or("none"), ")"));
  auto text = options_.blobs->ForTenant(rec.tenant).Get(rec.manifest_sha);
  if (!text.ok())
    return StepStateGone(text.status(), absl::StrCat("step ", rec.n, ": its manifest"));
  auto m = DecodeManifest(*text);
  if (!m.ok())
    return StepStateGone(absl::DataLossError(m.status().message()),
                         absl::StrCat("step ", rec.n, ": its manifest"));
  StepState state;
  state.workspace = *std::move(m);
  json::object st = ParseObject(rec.state_json);
  state.memory = SnapshotFromJson(st);
  if (std::string sha = StringField(st, "shell"); !sha.empty()) {
    if (auto s = options_.blobs->ForTenant(rec.tenant).Get(sha); s.ok())
      state.shell_state = *std::move(s);
  }
  if (std::string sha = StringField(st, "vars"); !sha.empty()) {
    if (auto s = options_.blobs->ForTenant(rec.tenant).Get(sha); s.ok())
      state.variables_json = *std::move(s);
  }
  if (manifest) *manifest = state.workspace;
  return state;
}

namespace {
// The window of `v` (sorted by path) after `w.after`, at most `w.limit`.
template <typename T, typename PathOf>
void ApplyWindow(std::vector<T>* v, const StepListWindow& w, PathOf path_of, int64_t* total,
                 std::optional<std::string>* next) {
  *total = static_cast<int64_t>(v->size());
  auto begin = v->begin();
  if (!w.after.empty()) {
    begin = std::upper_bound(v->begin(), v->end(), w.after,
                             [&](const std::string& a, const T& e) { return a < path_of(e); });
  }
  const int64_t limit = std::clamp<int64_t>(w.limit, 1, kMaxStepFilesListed);
  const int64_t available = v->end() - begin;
  const int64_t take = std::min(limit, available);
  std::vector<T> out(std::make_move_iterator(begin), std::make_move_iterator(begin + take));
  if (take < available && !out.empty()) *next = path_of(out.back());
  *v = std::move(out);
}
}  // namespace

absl::StatusOr<StepDetail> EnvironmentManager::GetStep(const Caller& caller, const std::string& id,
                                                       int64_t n, const StepListWindow& files,
                                                       const StepListWindow& changes) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (n < 0) return absl::InvalidArgumentError("a step number is 0 or more");
  auto rec = store_->GetStep(caller.tenant, id, n);
  if (!rec.ok()) return rec.status();
  StepDetail d;
  d.record = *rec;
  {
    std::unique_lock<std::recursive_timed_mutex> lock((*env)->step_mu, std::defer_lock);
    if (lock.try_lock_for(kStepReadWait)) {
      if (!(*env)->steps_loaded) LoadSteps(**env);
      d.on_head = AncestorsOfHeadLocked(**env).count(n) > 0;
    } else {
      std::optional<int64_t> head;
      d.on_head = AncestorsFromStore(caller.tenant, id, &head).count(n) > 0;
    }
  }
  json::object st = ParseObject(rec->state_json);
  if (options_.blobs) {
    if (std::string sha = StringField(st, "vars"); !sha.empty()) {
      if (auto v = options_.blobs->ForTenant(caller.tenant).Get(sha); v.ok())
        d.variables_json = *std::move(v);
    }
    if (std::string sha = StringField(st, "shell"); !sha.empty()) {
      if (auto v = options_.blobs->ForTenant(caller.tenant).Get(sha); v.ok()) d.cwd = CwdOf(*v);
    }
    if (!rec->manifest_sha.empty()) {
      if (auto text = options_.blobs->ForTenant(caller.tenant).Get(rec->manifest_sha); text.ok()) {
        if (auto m = DecodeManifest(*text); m.ok()) {
          d.files = *std::move(m);
          d.has_files = true;
        }
      }
    }
  }
  if (d.has_files) {
    WorkspaceManifest parent;
    if (rec->parent) {
      auto p = store_->GetStep(caller.tenant, id, *rec->parent);
      if (p.ok() && !p->manifest_sha.empty() && options_.blobs) {
        if (auto text = options_.blobs->ForTenant(caller.tenant).Get(p->manifest_sha); text.ok()) {
          if (auto m = DecodeManifest(*text); m.ok()) parent = *std::move(m);
        }
      }
    }
    d.changes = DiffManifests(parent, d.files);
    // SECURITY: a workspace of 100,000 entries is shown in windows, not rendered at once.
    ApplyWindow(
        &d.files.entries, files,
        [](const ManifestEntry& e) -> const std::string& { return e.path; }, &d.files_total,
        &d.files_next);
    ApplyWindow(
        &d.changes, changes, [](const ManifestChange& c) -> const std::string& { return c.path; },
        &d.changes_total, &d.changes_next);
  }
  if (d.cwd.empty()) d.cwd = StringField(ParseObject(rec->detail_json), "cwd");
  // What the step caused: the environment's audit and egress rows in its time window.
  AuditQuery q;
  q.tenant = caller.tenant;
  q.environment_id = id;
  q.since_ms = rec->started_ms;
  q.until_ms = rec->created_ms + 1;
  q.limit = 100;
  if (auto rows = store_->QueryAudit(q); rows.ok()) {
    for (AuditEntry& e : *rows) {
      if (e.action != "egress") d.audit.push_back(std::move(e));
    }
  }
  q.kind = "egress";
  if (auto rows = store_->QueryAudit(q); rows.ok()) d.egress = *std::move(rows);
  return d;
}

namespace {
absl::StatusOr<std::string> CheckStepPath(const std::string& path) {
  std::string p = path;
  if (absl::StartsWith(p, "/workspace/"))
    p = p.substr(11);
  else if (!p.empty() && p.front() == '/')
    return absl::InvalidArgumentError(
        "path must be inside /workspace (relative or /workspace/...)");
  if (!IsValidManifestPath(p))
    return absl::InvalidArgumentError(
        absl::StrCat("bad path '", HeadBytes(path, 256),
                     "': relative to /workspace, without empty, '.' or '..' components"));
  return p;
}
}  // namespace

absl::StatusOr<StepFile> EnvironmentManager::OpenStepFile(const Caller& caller,
                                                          const std::string& id, int64_t n,
                                                          const std::string& path) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  auto rel = CheckStepPath(path);
  if (!rel.ok()) return rel.status();
  if (n < 0) return absl::InvalidArgumentError("a step number is 0 or more");
  auto rec = store_->GetStep(caller.tenant, id, n);
  if (!rec.ok()) return rec.status();
  if (rec->manifest_sha.empty() || options_.blobs == nullptr)
    return absl::AbortedError(absl::StrCat("step ", n, " has no captured files"));
  auto text = options_.blobs->ForTenant(caller.tenant).Get(rec->manifest_sha);
  if (!text.ok()) return StepStateGone(text.status(), absl::StrCat("step ", n, ": its manifest"));
  auto m = DecodeManifest(*text);
  if (!m.ok())
    return StepStateGone(absl::DataLossError(m.status().message()),
                         absl::StrCat("step ", n, ": its manifest"));
  const ManifestEntry* e = FindEntry(*m, *rel);
  if (!e) return absl::NotFoundError(absl::StrCat("'", *rel, "' did not exist at step ", n));
  if (e->type == ManifestEntry::Type::kDir)
    return absl::InvalidArgumentError(absl::StrCat("'", *rel, "' is a directory"));
  StepFile f;
  if (e->type == ManifestEntry::Type::kSymlink) {
    f.symlink = true;
    f.target = e->target;
    f.size = static_cast<int64_t>(e->target.size());
    return f;
  }
  f.size = e->size;
  f.read = [blobs = options_.blobs, tenant = caller.tenant, sha = e->sha256,
            what = absl::StrCat("the contents of '", *rel, "' at step ", n)](
               int64_t offset, int64_t length) -> absl::StatusOr<std::string> {
    auto data = blobs->ForTenant(tenant).ReadRange(sha, offset, length);
    if (!data.ok()) return StepStateGone(data.status(), what);
    return data;
  };
  return f;
}

absl::StatusOr<std::string> EnvironmentManager::ReadStepFile(const Caller& caller,
                                                             const std::string& id, int64_t n,
                                                             const std::string& path) {
  auto f = OpenStepFile(caller, id, n, path);
  if (!f.ok()) return f.status();
  if (f->symlink) return f->target;
  const int64_t cap = options_.blobs->options().max_blob_bytes;
  auto data = f->read(0, cap + 1);
  if (data.ok() && static_cast<int64_t>(data->size()) > cap)
    return absl::OutOfRangeError("larger than one blob");
  return data;
}

absl::StatusOr<StepFileDiff> EnvironmentManager::DiffStepFile(const Caller& caller,
                                                              const std::string& id, int64_t n,
                                                              const std::string& path) {
  auto rel = CheckStepPath(path);
  if (!rel.ok()) return rel.status();
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (n < 0) return absl::InvalidArgumentError("a step number is 0 or more");
  auto rec = store_->GetStep(caller.tenant, id, n);
  if (!rec.ok()) return rec.status();
  auto side = [&](const StepRecord& r, std::optional<ManifestEntry>* entry) -> absl::Status {
    if (r.manifest_sha.empty() || options_.blobs == nullptr)
      return absl::AbortedError(absl::StrCat("step ", r.n, " has no captured files"));
    auto text = options_.blobs->ForTenant(caller.tenant).Get(r.manifest_sha);
    if (!text.ok())
      return StepStateGone(text.status(), absl::StrCat("step ", r.n, ": its manifest"));
    auto m = DecodeManifest(*text);
    if (!m.ok())
      return StepStateGone(absl::DataLossError(m.status().message()),
                           absl::StrCat("step ", r.n, ": its manifest"));
    if (const ManifestEntry* e = FindEntry(*m, *rel)) *entry = *e;
    return absl::OkStatus();
  };
  std::optional<ManifestEntry> after, before;
  if (absl::Status st = side(*rec, &after); !st.ok()) return st;
  if (rec->parent) {
    auto p = store_->GetStep(caller.tenant, id, *rec->parent);
    if (p.ok()) {
      if (absl::Status st = side(*p, &before); !st.ok()) return st;
    }
  }
  if (!after && !before)
    return absl::NotFoundError(
        absl::StrCat("'", *rel, "' exists neither at step ", n, " nor at its parent"));
  if ((after && after->type == ManifestEntry::Type::kDir) ||
      (before && before->type == ManifestEntry::Type::kDir))
    return absl::InvalidArgumentError(absl::StrCat("'", *rel, "' is a directory"));
  StepFileDiff d;
  d.path = *rel;
  d.change = !before ? "added" : !after ? "deleted" : "modified";
  if (before && after && before->type == after->type && before->sha256 == after->sha256 &&
      before->target == after->target && before->mode == after->mode) {
    d.change.clear();  // the same at both: no change, no diff
    return d;
  }
  auto contents = [&](const std::optional<ManifestEntry>& e) -> absl::StatusOr<std::string> {
    if (!e) return std::string();
    if (e->type == ManifestEntry::Type::kSymlink) return e->target;
    if (e->size > kMaxStepDiffFileBytes) return absl::OutOfRangeError("too large");
    auto data = options_.blobs->ForTenant(caller.tenant).Get(e->sha256);
    if (!data.ok())
      return StepStateGone(data.status(), absl::StrCat("the contents of '", *rel, "'"));
    return data;
  };
  auto a = contents(before);
  auto b = contents(after);
  if (!a.ok() || !b.ok()) {
    const absl::Status& st = !a.ok() ? a.status() : b.status();
    if (!absl::IsOutOfRange(st)) return st;
    d.binary = true;  // too large to diff: said, not shown
    d.truncated = true;
    return d;
  }
  if (a->find('\0') != std::string::npos || b->find('\0') != std::string::npos) {
    d.binary = true;
    return d;
  }
  d.diff = UnifiedDiff(*rel, *a, *b, kMaxStepDiffBytes, &d.truncated);
  d.diff = SanitizeUtf8(d.diff);
  return d;
}

// ---------------------------------------------------------------------------------------------
// Rewind and fork

absl::StatusOr<RewindInfo> EnvironmentManager::Rewind(const Caller& caller, const std::string& id,
                                                      int64_t n) {
  const int64_t t0 = MonotonicMs();
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  absl::StatusOr<RewindInfo> out = [&]() -> absl::StatusOr<RewindInfo> {
    if (n < 0) return absl::InvalidArgumentError("a step number is 0 or more");
    LiveEnv& e = **env;
    std::unique_lock<std::recursive_timed_mutex> lock(e.step_mu, std::defer_lock);
    if (!lock.try_lock_for(kStepLockWait)) return absl::UnavailableError("environment is busy");
    if (!e.steps_loaded) LoadSteps(e);
    if (!e.capture)
      return absl::AbortedError(
          absl::StrCat("this environment records no steps: ", e.capture_reason));
    auto rec = store_->GetStep(caller.tenant, id, n);
    if (!rec.ok()) return rec.status();
    WorkspaceManifest manifest;
    auto state = StateOfStep(*rec, &manifest);
    if (!state.ok()) return state.status();
    InstanceRef ref;
    {
      std::lock_guard<std::mutex> elock(e.mu);
      if (e.record.state != EnvState::kRunning)
        return EnvironmentNotFoundError(absl::StrCat("environment ", id, " is being destroyed"));
      ref = e.ref;
    }
    // Processes end first (terminals' shells, hosted MCP servers and what they started are
    // killed): nothing started in one outlives the rewind, and none starts until it is done
    // (OpenTerminal and SpawnProcess take step_mu). core/mcp_hosts restarts its servers after.
    CloseProcesses(id, absl::StrCat("environment rewound to step ", n));
    DiskBlobStore::Tenant blobs = options_.blobs->ForTenant(e.tenant);
    auto restored = e.driver->RestoreStep(ref, *state, blobs);
    if (!restored.ok()) return StepRestoreError(restored.status(), n);
    {
      std::lock_guard<std::mutex> elock(e.mu);
      if (e.record.state != EnvState::kRunning) {
        // SECURITY: destroyed during the restore: a driver that installs a new instance under
        // the id (nano) would leave it running with nobody to destroy it.
        e.driver->Destroy(*restored).IgnoreError();
        return EnvironmentNotFoundError(absl::StrCat("environment ", id, " was destroyed"));
      }
      e.ref = *restored;
      e.record.driver_state = restored->state;
    }
    PersistLive(e);
    e.head = n;
    e.head_manifest = std::make_shared<const WorkspaceManifest>(std::move(manifest));
    e.head_manifest_step = n;
    store_
        ->PutStepLog(
            {id, e.tenant, StepSettingsToJson(e.step_settings), e.head, e.next_step, Now()})
        .IgnoreError();
    StepsStatusOf(e);
    RewindInfo info;
    info.head = n;
    info.memory = state->memory ? "snapshot" : "none";
    return info;
  }();
  audit_.Record(caller, {.environment_id = id,
                         .action = "steps.rewind",
                         .detail = absl::StrCat("step ", n),
                         .duration_ms = MonotonicMs() - t0,
                         .outcome = out.status()});
  if (!out.ok()) return out;
  auto info = Get(caller, id);
  if (info.ok()) out->environment = *std::move(info);
  return out;
}

absl::StatusOr<ForkInfo> EnvironmentManager::Fork(const Caller& caller, const std::string& id,
                                                  int64_t n) {
  const int64_t t0 = MonotonicMs();
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  std::string new_id;
  absl::StatusOr<ForkInfo> out = [&]() -> absl::StatusOr<ForkInfo> {
    if (n < 0) return absl::InvalidArgumentError("a step number is 0 or more");
    LiveEnv& e = **env;
    StepSettings settings;
    StepState state;
    {
      // step_mu only while the step is read: the source keeps working during the fork. The
      // step is pinned instead (retention neither compacts nor collects it, so the snapshot
      // and blobs ForkStep copies from stay) until the fork exists.
      std::unique_lock<std::recursive_timed_mutex> lock(e.step_mu, std::defer_lock);
      if (!lock.try_lock_for(kStepLockWait)) return absl::UnavailableError("environment is busy");
      if (!e.steps_loaded) LoadSteps(e);
      if (!e.capture)
        return absl::AbortedError(
            absl::StrCat("this environment records no steps: ", e.capture_reason));
      auto rec = store_->GetStep(caller.tenant, id, n);
      if (!rec.ok()) return rec.status();
      auto s = StateOfStep(*rec, nullptr);
      if (!s.ok()) return s.status();
      state = *std::move(s);
      settings = e.step_settings;
      std::lock_guard<std::mutex> elock(e.mu);
      ++e.fork_pins[n];
    }
    struct Unpin {
      LiveEnv& e;
      int64_t n;
      ~Unpin() {
        std::lock_guard<std::mutex> elock(e.mu);
        if (--e.fork_pins[n] <= 0) e.fork_pins.erase(n);
      }
    } unpin{e, n};
    if (e.governed)
      return absl::AbortedError(
          "forking an environment with a governed network is not supported yet: fork needs "
          "its own CA and proxy listener");
    EnvironmentRecord src;
    {
      std::lock_guard<std::mutex> elock(e.mu);
      src = e.record;
    }
    int64_t ttl_s = options_.default_ttl_s;
    auto spec = SpecFromJson(src.spec_json, &ttl_s);
    if (!spec.ok()) return spec.status();
    if (!spec->volumes.empty())
      return absl::AbortedError(
          "forking an environment that mounts volumes is not supported (a volume is mounted by "
          "one environment at a time)");
    // The snapshot is handed to the driver while the step keeps it (ForkStep copies from it).
    DiskBlobStore::Tenant blobs = options_.blobs->ForTenant(caller.tenant);
    InstanceMaker make = [&](Driver& d, const std::string& nid,
                             const EnvSpec& s) -> absl::StatusOr<InstanceRef> {
      absl::StatusOr<InstanceRef> forked = d.ForkStep(state, s, nid, blobs);
      if (!forked.ok()) return StepRestoreError(forked.status(), n);
      return forked;
    };
    std::shared_ptr<LiveEnv> created;
    auto info =
        CreateEnvironment(caller.tenant, *spec, ttl_s, nullptr, make, &created, [&](LiveEnv& fe) {
          InitSteps(fe, settings, "fork", absl::StrCat("fork of ", id, " at step ", n),
                    json::serialize(json::object{{"environment_id", id}, {"step", n}}));
        });
    if (!info.ok()) return info.status();
    new_id = info->record.id;
    ForkInfo f;
    f.environment = *std::move(info);
    f.environment.steps = StepsStatusOf(*created);
    f.source_id = id;
    f.step = n;
    f.memory = state.memory ? "snapshot" : "none";
    return f;
  }();
  audit_.Record(caller, {.environment_id = id,
                         .action = "steps.fork",
                         .detail = absl::StrCat("step ", n, out.ok() ? " -> " : "", new_id),
                         .duration_ms = MonotonicMs() - t0,
                         .outcome = out.status()});
  return out;
}

// ---------------------------------------------------------------------------------------------
// Composite steps

std::unique_ptr<EnvironmentManager::CompositeStep> EnvironmentManager::BeginCompositeStep(
    const Caller& caller, const std::string& id, const std::string& kind,
    const std::string& summary) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return nullptr;
  auto guard = BeginStep(*env, kind, summary,
                         json::serialize(json::object{{"summary", SanitizeUtf8(summary)}}));
  if (!guard.ok() || *guard == nullptr) return nullptr;
  std::unique_ptr<CompositeStep> c(new CompositeStep());
  c->manager_ = this;
  c->guard_ = *std::move(guard);
  return c;
}

EnvironmentManager::CompositeStep::~CompositeStep() {
  if (!guard_) return;
  ApplyStepOutcome(*guard_, {.status = outcome_});
  manager_->RecordStepLocked(*guard_->env, std::move(guard_->rec));
}

}  // namespace esb
