#include "core/environment_manager.h"

#include <algorithm>
#include <boost/json.hpp>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "common/util.h"
#include "core/recovery.h"
#include "core/snapshots/step_guard.h"
#include "core/volumes.h"

namespace esb {

namespace {
constexpr char kEnvironmentNotFoundUrl[] = "type.entersandbox/environment-not-found";
}  // namespace

absl::Status EnvironmentNotFoundError(std::string_view message) {
  absl::Status st = absl::NotFoundError(AbslView(message));
  st.SetPayload(kEnvironmentNotFoundUrl, absl::Cord("1"));
  return st;
}

bool IsEnvironmentNotFound(const absl::Status& status) {
  return absl::IsNotFound(status) && status.GetPayload(kEnvironmentNotFoundUrl).has_value();
}

namespace json = boost::json;

std::string SpecToJson(const EnvSpec& spec, int64_t ttl_s) {
  json::object env;
  for (const auto& [k, v] : spec.env) env[k] = v;
  json::object o{{"image", spec.image},
                 {"runtime", ToString(spec.runtime)},
                 {"cpu", spec.cpu},
                 {"memory_mb", spec.memory_mb},
                 {"pids", spec.pids},
                 {"disk_mb", spec.disk_mb},
                 {"network", NetworkPolicyName(spec.network)},
                 {"ttl_seconds", ttl_s},
                 {"env", std::move(env)}};
  if (!spec.volumes.empty()) {
    json::array volumes;
    for (const VolumeMount& v : spec.volumes) {
      volumes.push_back(json::object{{"name", v.name},
                                     {"path", v.path},
                                     {"read_only", v.read_only},
                                     {"key", v.key},
                                     {"size_mb", v.size_mb}});
    }
    o["volumes"] = std::move(volumes);
  }
  return json::serialize(o);
}

absl::StatusOr<EnvSpec> SpecFromJson(const std::string& text, int64_t* ttl_s) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_object()) return absl::InvalidArgumentError("bad spec json");
  const json::object& o = v.as_object();
  EnvSpec spec;
  try {
    if (auto* p = o.if_contains("image")) spec.image = json::value_to<std::string>(*p);
    if (auto* p = o.if_contains("runtime")) {
      auto kind = ParseDriverKind(json::value_to<std::string>(*p));
      if (!kind) return absl::InvalidArgumentError("bad spec json: unknown runtime");
      spec.runtime = *kind;
    }
    if (auto* p = o.if_contains("cpu")) spec.cpu = p->to_number<double>();
    if (auto* p = o.if_contains("memory_mb")) spec.memory_mb = p->to_number<int64_t>();
    if (auto* p = o.if_contains("pids")) spec.pids = p->to_number<int64_t>();
    if (auto* p = o.if_contains("disk_mb")) spec.disk_mb = p->to_number<int64_t>();
    if (auto* p = o.if_contains("network")) {
      auto policy = ParseNetworkPolicy(json::value_to<std::string>(*p));
      if (!policy) return absl::InvalidArgumentError("bad spec json: unknown network policy");
      spec.network = *policy;
    }
    if (auto* p = o.if_contains("ttl_seconds"); p && ttl_s) *ttl_s = p->to_number<int64_t>();
    if (auto* p = o.if_contains("env"); p && p->is_object()) {
      for (const auto& kv : p->as_object())
        spec.env[std::string(kv.key())] = json::value_to<std::string>(kv.value());
    }
    if (auto* p = o.if_contains("volumes"); p && p->is_array()) {
      for (const auto& item : p->as_array()) {
        const json::object& v = item.as_object();
        VolumeMount m;
        m.name = json::value_to<std::string>(v.at("name"));
        m.path = json::value_to<std::string>(v.at("path"));
        m.read_only = v.at("read_only").as_bool();
        m.key = json::value_to<std::string>(v.at("key"));
        m.size_mb = v.at("size_mb").to_number<int64_t>();
        spec.volumes.push_back(std::move(m));
      }
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad spec json: ", e.what()));
  }
  return spec;
}

namespace {

// Pooled instances are interchangeable only if everything but `env` matches.
bool SameShape(const EnvSpec& a, const EnvSpec& b) {
  return a.image == b.image && a.runtime == b.runtime && a.cpu == b.cpu &&
         a.memory_mb == b.memory_mb && a.pids == b.pids && a.disk_mb == b.disk_mb &&
         a.network == b.network && a.volumes == b.volumes;
}

constexpr char kPoolTenant[] = "";

}  // namespace

EnvironmentManager::EnvironmentManager(Store* store, std::map<std::string, Driver*> drivers,
                                       Metrics* metrics, ManagerOptions options)
    : store_(store), metrics_(metrics), options_(std::move(options)), audit_(store, metrics) {
  if (!options_.now_ms) options_.now_ms = NowUnixMs;
  for (const auto& [name, driver] : drivers) {
    std::optional<DriverKind> kind = ParseDriverKind(name);
    if (kind)
      drivers_[*kind] = driver;
    else
      LogError(absl::StrCat("environment manager: unknown driver kind '", name, "' ignored"));
  }
}

EnvironmentManager::~EnvironmentManager() { Stop(); }

void EnvironmentManager::Persist(const EnvironmentRecord& record) {
  absl::Status st = store_->PutEnvironment(record);
  if (!st.ok()) {
    metrics_->CountError("store");
    LogError(absl::StrCat("persisting environment ", record.id, ": ", st.ToString()));
  }
}

void EnvironmentManager::PersistLive(LiveEnv& env, bool deferred) {
  // The store may be slow (its writer mutex is shared with audit inserts, row-cap deletes and
  // retention): wait for it holding only this environment's persist_mu, which no lookup takes.
  std::lock_guard<std::mutex> plock(env.persist_mu);
  EnvironmentRecord snapshot;
  {
    std::lock_guard<std::mutex> elock(env.mu);
    snapshot = env.record;
  }
  if (!deferred) return Persist(snapshot);
  absl::Status st = store_->PutEnvironmentDeferred(snapshot);
  if (!st.ok()) {
    metrics_->CountError("store");
    LogError(absl::StrCat("persisting environment ", snapshot.id, ": ", st.ToString()));
  }
}

absl::Status EnvironmentManager::Start() {
  std::map<std::string, Driver*> by_name;
  for (const auto& [kind, driver] : drivers_) by_name[std::string(ToString(kind))] = driver;
  auto recovered = RecoverEnvironments(store_, by_name, RecoveryMode::kReattach, Now());
  if (!recovered.ok()) return recovered.status();
  size_t attached = recovered->attached.size();
  size_t cleaned = recovered->destroyed.size() + recovered->destroy_failed.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (RecoveredEnvironment& r : recovered->attached) {
      auto env = std::make_shared<LiveEnv>();
      env->record = std::move(r.record);
      env->ref = std::move(r.ref);
      env->driver = r.driver;
      env->kind = *ParseDriverKind(env->record.runtime);  // recovery found its driver by name
      envs_[env->record.id] = env;
    }
    // The volumes of every environment that still exists (or still has to be destroyed) stay
    // claimed by it.
    auto claim = [&](const EnvironmentRecord& rec) {
      auto spec = SpecFromJson(rec.spec_json, nullptr);
      if (!spec.ok()) return;
      for (const VolumeMount& v : spec->volumes) volume_users_[v.key] = rec.id;
    };
    for (const auto& [id, env] : envs_) claim(env->record);
    // The reaper retries the destroys the driver refused (they stay "destroying" meanwhile).
    for (RecoveredEnvironment& r : recovered->destroy_failed) {
      auto env = std::make_shared<LiveEnv>();
      env->record = std::move(r.record);
      env->ref = std::move(r.ref);
      env->driver = r.driver;
      env->kind = *ParseDriverKind(env->record.runtime);
      env->tenant = env->record.tenant;
      claim(env->record);
      destroy_retry_.push_back(env);
    }
  }
  if (attached || cleaned) {
    LogInfo(absl::StrCat("recovered state: ", attached, " environment(s) re-attached, ", cleaned,
                         " cleaned up"));
  }
  {
    // Re-attached environments are published with their owner outside the mutable record
    // (before any request or the reaper can see them).
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, e] : envs_) {
      std::lock_guard<std::mutex> elock(e->mu);  // not contended: nothing else runs yet
      e->tenant = e->record.tenant;
    }
  }
  // Governed environments: their policy, intents and CA come back from the store, and they
  // go back to the proxy (before any request can reach them).
  {
    std::vector<std::shared_ptr<LiveEnv>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, e] : envs_) all.push_back(e);
      for (auto& e : destroy_retry_) all.push_back(e);
    }
    for (auto& e : all) {
      auto spec = SpecFromJson(e->record.spec_json, nullptr);
      if (spec.ok() && spec->network.kind == NetworkPolicy::Kind::kGoverned) {
        e->governed = true;
        if (e->record.state == EnvState::kRunning) ReattachEgress(*e);
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    stopping_ = false;
  }
  RecoverSteps();
  steps_stop_ = false;
  reaper_ = std::thread([this] { ReaperLoop(); });
  pooler_ = std::thread([this] { PoolLoop(); });
  compactor_ = std::thread([this] { CompactorLoop(); });
  sweeper_ = std::thread([this] { SweeperLoop(); });
  return absl::OkStatus();
}

void EnvironmentManager::Stop() {
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    if (stopping_ && !reaper_.joinable()) return;
    stopping_ = true;
  }
  steps_stop_ = true;  // a sweep in progress stops at its next manifest
  wake_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  if (pooler_.joinable()) pooler_.join();
  if (compactor_.joinable()) compactor_.join();  // after the compaction under way, if any
  if (sweeper_.joinable()) sweeper_.join();
  std::vector<std::shared_ptr<LiveEnv>> pooled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rt, q] : pool_)
      for (auto& e : q) pooled.push_back(e);
    pool_.clear();
  }
  for (auto& e : pooled) DestroyLive(e, "pool_discarded_on_shutdown");
}

EnvironmentInfo EnvironmentManager::InfoOf(const EnvironmentRecord& record, bool pooled) const {
  EnvironmentInfo info;
  info.record = record;
  int64_t ttl = options_.default_ttl_s;
  auto spec = SpecFromJson(record.spec_json, &ttl);
  if (spec.ok()) info.spec = *spec;
  info.ttl_s = ttl;
  info.pooled = pooled;
  return info;
}

absl::StatusOr<std::shared_ptr<EnvironmentManager::LiveEnv>> EnvironmentManager::CreateInstance(
    const EnvSpec& spec, const std::string& tenant, EnvState state, int64_t ttl_s,
    const InstanceMaker& make) {
  auto it = drivers_.find(spec.runtime);
  if (it == drivers_.end())
    return absl::InvalidArgumentError(absl::StrCat("runtime '", AbslView(ToString(spec.runtime)),
                                                   "' is not available on this host"));
  auto env = std::make_shared<LiveEnv>();
  env->driver = it->second;
  env->kind = spec.runtime;
  EnvironmentRecord& rec = env->record;
  rec.id = absl::StrCat("env_", RandomHex(12));
  rec.tenant = tenant;
  rec.state = EnvState::kCreating;
  rec.runtime = std::string(ToString(spec.runtime));
  rec.image = spec.image;
  rec.spec_json = SpecToJson(spec, ttl_s);
  rec.created_ms = rec.last_used_ms = Now();
  rec.expires_ms = rec.created_ms + ttl_s * 1000;
  Persist(rec);
  auto ref = make ? make(*env->driver, rec.id, spec) : env->driver->Create(rec.id, spec);
  if (!ref.ok()) {
    rec.state = EnvState::kDestroyed;
    rec.destroyed_ms = Now();
    rec.destroy_reason = absl::StrCat("create_failed: ", ref.status().message());
    Persist(rec);
    metrics_->CountError("create");
    return ref.status();
  }
  env->ref = *ref;
  rec.driver_state = ref->state;
  rec.state = state;
  Persist(rec);
  return env;
}

std::shared_ptr<EnvironmentManager::LiveEnv> EnvironmentManager::TakePooled(
    const EnvSpec& spec) {
  EnvSpec shape = options_.default_spec;
  shape.runtime = spec.runtime;
  if (!SameShape(spec, shape))
    return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pool_.find(spec.runtime);
  if (it == pool_.end() || it->second.empty()) return nullptr;
  auto env = it->second.front();
  it->second.pop_front();
  return env;
}

absl::StatusOr<EnvironmentInfo> EnvironmentManager::Create(const Caller& caller,
                                                           const EnvSpec& spec, int64_t ttl_s,
                                                           const governance::EgressPolicy* egress,
                                                           const StepSettings* steps) {
  const int64_t t0 = MonotonicMs();
  std::shared_ptr<LiveEnv> created;
  // Step 0: the environment's initial state, recorded before anyone can see the environment.
  absl::StatusOr<EnvironmentInfo> info =
      CreateEnvironment(caller.tenant, spec, ttl_s, egress, nullptr, &created, [&](LiveEnv& env) {
        InitSteps(env, steps ? *steps : StepSettings{}, "create",
                  absl::StrCat("create ", AbslView(ToString(spec.runtime)), " ", spec.image),
                  json::serialize(
                      json::object{{"runtime", ToString(spec.runtime)}, {"image", spec.image}}));
      });
  if (info.ok() && created) info->steps = StepsStatusOf(*created);
  audit_.Record(
      caller,
      {.environment_id = info.ok() ? info->record.id : "",
       .action = "environment.create",
       .detail = absl::StrCat(
           "runtime=", AbslView(ToString(spec.runtime)), " image=", spec.image,
           egress ? absl::StrCat(" network=", json::serialize(governance::ToDisplayJson(*egress)))
                  : ""),
       .duration_ms = MonotonicMs() - t0,
       .outcome = info.status()});
  return info;
}

absl::StatusOr<EnvironmentInfo> EnvironmentManager::CreateEnvironment(
    const std::string& tenant, const EnvSpec& requested, int64_t ttl_s,
    const governance::EgressPolicy* egress, const InstanceMaker& make,
    std::shared_ptr<LiveEnv>* created_out, const std::function<void(LiveEnv&)>& before_publish) {
  EnvSpec spec = requested;
  spec.network = NetworkPolicy{};
  // A governed network: the runtime must be able to build it, the daemon must have a proxy to
  // hand it to, and the environment gets its own CA (its certificate goes to the driver for the
  // sandbox's trust bundle; the pair to the proxy).
  std::optional<EgressCaPem> ca;
  if (egress != nullptr) {
    auto d = drivers_.find(spec.runtime);
    if (d == drivers_.end())
      return absl::InvalidArgumentError(absl::StrCat("runtime '", AbslView(ToString(spec.runtime)),
                                                     "' is not available on this host"));
    if (!d->second->Capabilities().Has(Capability::kEgress))
      return MissingCapabilityError(d->second->name(), Capability::kEgress);
    if (options_.egress == nullptr || !options_.make_ca)
      return absl::UnavailableError(
          "egress is not available on this daemon (no egress proxy): create the environment "
          "with \"network\": \"none\"");
    auto made = options_.make_ca();
    if (!made.ok())
      return absl::UnavailableError(
          absl::StrCat("cannot make the environment's CA: ", made.status().message()));
    ca = *std::move(made);
    spec.network = NetworkPolicy{NetworkPolicy::Kind::kGoverned, ca->cert_pem};
  }
  // Volumes are claimed for this create until the environment exists (then for its id), so
  // a concurrent create or delete of the same volume is refused rather than racing.
  std::string volume_claim;
  if (!spec.volumes.empty()) {
    if (!drivers_.count(spec.runtime)) {
      return absl::InvalidArgumentError(absl::StrCat("runtime '", AbslView(ToString(spec.runtime)),
                                                     "' is not available on this host"));
    }
    volume_claim = absl::StrCat("#create-", RandomHex(8));
    if (absl::Status st = ClaimVolumes(tenant, spec, volume_claim); !st.ok()) return st;
  }
  struct ReleaseClaimOnExit {
    EnvironmentManager* self;
    std::string* claim;
    ~ReleaseClaimOnExit() {
      if (!claim->empty()) self->ReleaseVolumes(*claim);
    }
  } release_claim{this, &volume_claim};
  if (ttl_s <= 0) ttl_s = options_.default_ttl_s;
  ttl_s = std::min(ttl_s, options_.max_ttl_s);
  if (!drivers_.count(spec.runtime))
    return absl::InvalidArgumentError(absl::StrCat("runtime '", AbslView(ToString(spec.runtime)),
                                                   "' is not available on this host"));
  // The quota check takes a reservation in the same critical section, so concurrent creates
  // cannot all pass the check before any of them is counted. The reservation turns into the
  // environment (under mu_ again) or is released on failure.
  {
    std::lock_guard<std::mutex> lock(mu_);
    int total = static_cast<int>(envs_.size()) + reserved_total_;
    int mine = reserved_[tenant];
    // env->tenant is immutable once published: no environment's mutex is taken under mu_.
    for (const auto& [id, e] : envs_) {
      if (e->tenant == tenant) ++mine;
    }
    if (total >= options_.max_environments)
      return absl::ResourceExhaustedError(absl::StrCat(
          "this daemon already runs ", total, " environments (max_environments)"));
    if (mine >= options_.max_environments_per_tenant)
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant already has ", mine, " environments (max_environments_per_tenant)"));
    ++reserved_total_;
    ++reserved_[tenant];
  }
  bool reserved = true;
  auto release = [&]() {  // caller holds mu_
    if (!reserved) return;
    reserved = false;
    --reserved_total_;
    if (--reserved_[tenant] == 0) reserved_.erase(tenant);
  };
  struct ReleaseOnExit {
    EnvironmentManager* self;
    std::function<void()> release;
    ~ReleaseOnExit() {
      std::lock_guard<std::mutex> lock(self->mu_);
      release();
    }
  } release_on_exit{this, release};
  int64_t start = MonotonicMs();
  std::shared_ptr<LiveEnv> env;
  bool pooled = false;
  while (auto candidate = make ? nullptr : TakePooled(spec)) {
    {
      std::lock_guard<std::mutex> lock(wake_mu_);
      pool_kick_ = true;  // refill in the background
    }
    wake_cv_.notify_all();
    // One agent round trip both proves the instance is alive and sets its environment
    // (Attach would also ask the OCI runtime: a process spawn on the fast path).
    absl::Status st = candidate->driver->Configure(candidate->ref, spec.env);
    if (st.ok()) {
      env = candidate;
      pooled = true;
      break;
    }
    LogWarn(absl::StrCat("discarding broken pooled instance ", candidate->record.id, ": ",
                         st.ToString()));
    DestroyLive(candidate, "pool_instance_broken");
  }
  if (env) {
    {
      std::lock_guard<std::mutex> elock(env->mu);
      EnvironmentRecord& rec = env->record;
      rec.tenant = tenant;
      rec.state = EnvState::kRunning;
      rec.spec_json = SpecToJson(spec, ttl_s);
      rec.created_ms = rec.last_used_ms = Now();
      rec.expires_ms = rec.created_ms + ttl_s * 1000;
    }
    PersistLive(*env);
    metrics_->creates_pooled++;
  } else {
    auto created = CreateInstance(spec, tenant, EnvState::kRunning, ttl_s, make);
    if (!created.ok()) return created.status();
    env = *created;
    metrics_->creates_cold++;
  }
  metrics_->create_duration.Observe((MonotonicMs() - start) / 1000.0);
  if (egress != nullptr) {
    // Not published yet: nobody else can see it. A failed attach destroys it (fail closed).
    if (absl::Status st = AttachNewEgress(*env, *egress, *ca); !st.ok()) {
      env->tenant = tenant;
      DestroyLive(env, "egress_attach_failed");
      return absl::UnavailableError(
          absl::StrCat("the egress proxy did not take the environment: ", st.message()));
    }
  }
  EnvironmentRecord snapshot;
  {
    std::lock_guard<std::mutex> elock(env->mu);
    snapshot = env->record;
  }
  env->tenant = tenant;  // before publication; never changed after
  if (before_publish) before_publish(*env);
  {
    std::lock_guard<std::mutex> lock(mu_);
    envs_[snapshot.id] = env;
    release();  // the environment itself counts from here on
    for (auto& [key, user] : volume_users_) {
      if (!volume_claim.empty() && user == volume_claim) user = snapshot.id;
    }
    volume_claim.clear();
  }
  EnvironmentInfo info = InfoOf(snapshot, pooled);
  if (env->governed) info.egress = *egress;
  if (created_out) *created_out = env;
  return info;
}

absl::StatusOr<std::shared_ptr<EnvironmentManager::LiveEnv>> EnvironmentManager::Lookup(
    const std::string& tenant, const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = envs_.find(id);
    if (it != envs_.end()) {
      if (it->second->tenant == tenant) return it->second;
      return EnvironmentNotFoundError(absl::StrCat("environment ", id, " not found"));
    }
  }
  auto rec = store_->GetEnvironment(id);
  if (rec.ok() && rec->tenant == tenant && rec->state == EnvState::kDestroyed) {
    return EnvironmentNotFoundError(absl::StrCat("environment ", id, " was destroyed at ",
                                            FormatRfc3339(rec->destroyed_ms), " (",
                                            rec->destroy_reason, ")"));
  }
  return EnvironmentNotFoundError(absl::StrCat("environment ", id, " not found"));
}

void EnvironmentManager::Touch(LiveEnv& env) {
  std::lock_guard<std::mutex> elock(env.mu);
  int64_t now = Now();
  env.record.last_used_ms = now;
  // Using an environment keeps it alive: the lease never ends in the middle of active work.
  int64_t ttl = options_.default_ttl_s;
  SpecFromJson(env.record.spec_json, &ttl).IgnoreError();
  env.record.expires_ms = std::max(env.record.expires_ms, now + ttl * 1000);
}

void EnvironmentManager::DestroyLive(const std::shared_ptr<LiveEnv>& env,
                                     const std::string& reason) {
  EnvironmentRecord rec;
  {
    std::lock_guard<std::mutex> elock(env->mu);
    env->record.state = EnvState::kDestroying;
    env->record.destroy_reason = reason;
    rec = env->record;
  }
  // A heartbeat or exec that finishes now cannot write an older state over this one: every
  // write of a live environment is a snapshot taken in persist_mu order (PersistLive).
  PersistLive(*env);
  if (env->governed && options_.egress != nullptr) options_.egress->Detach(rec.id);
  if (!env->tenant.empty()) DropSteps(*env);  // pooled instances have none
  absl::Status st = env->driver->Destroy(env->ref);
  if (!st.ok()) {
    LogError(absl::StrCat("destroying ", rec.id, " failed (will retry): ", st.ToString()));
    metrics_->CountError("destroy");
    std::lock_guard<std::mutex> lock(mu_);
    destroy_retry_.push_back(env);
    return;
  }
  {
    std::lock_guard<std::mutex> elock(env->mu);
    env->record.state = EnvState::kDestroyed;
    env->record.destroyed_ms = Now();
  }
  PersistLive(*env);
  ReleaseVolumes(rec.id);  // the driver unmounted them: free for the next environment
  if (env->governed) {
    // The CA key must not outlive its environment.
    if (absl::Status del = store_->DeleteEgress(rec.id); !del.ok()) {
      metrics_->CountError("store");
      LogError(absl::StrCat("deleting egress state of ", rec.id, ": ", del.ToString()));
    }
  }
}

Driver* EnvironmentManager::VolumeDriver() const {
  auto it = drivers_.find(DriverKind::kContainer);
  return it == drivers_.end() ? nullptr : it->second;
}

absl::Status EnvironmentManager::ClaimVolumes(const std::string& tenant, EnvSpec& spec,
                                              const std::string& claimant) {
  Driver* driver = drivers_.at(spec.runtime);
  if (!driver->Capabilities().Has(Capability::kVolumes) || driver != VolumeDriver()) {
    return MissingCapabilityError(driver->name(), Capability::kVolumes);
  }
  if (static_cast<int>(spec.volumes.size()) > options_.max_volumes_per_environment) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most ", options_.max_volumes_per_environment, " volumes per environment"));
  }
  auto records = store_->ListVolumes(tenant);
  if (!records.ok()) return records.status();
  for (size_t i = 0; i < spec.volumes.size(); ++i) {
    VolumeMount& v = spec.volumes[i];
    if (absl::Status st = ValidateVolumeName(v.name); !st.ok()) return st;
    if (absl::Status st = ValidateVolumePath(v.path); !st.ok()) return st;
    for (size_t j = 0; j < i; ++j) {
      const VolumeMount& o = spec.volumes[j];
      if (o.name == v.name) {
        return absl::InvalidArgumentError(absl::StrCat("volume ", v.name, " is listed twice"));
      }
      // Neither mount point may lie inside the other (one would hide or shadow the other).
      auto inside = [](const std::string& a, const std::string& b) {
        return a == b ||
               (a.size() > b.size() && a.compare(0, b.size(), b) == 0 && a[b.size()] == '/');
      };
      if (inside(v.path, o.path) || inside(o.path, v.path)) {
        return absl::InvalidArgumentError(
            absl::StrCat("volume paths ", o.path, " and ", v.path, " overlap"));
      }
    }
    auto rec = std::find_if(records->begin(), records->end(),
                            [&](const VolumeRecord& r) { return r.name == v.name; });
    if (rec == records->end()) {
      return absl::NotFoundError(absl::StrCat("volume ", v.name, " not found"));
    }
    v.key = VolumeKey(tenant, v.name);
    v.size_mb = rec->size_mb;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const VolumeMount& v : spec.volumes) {
    auto it = volume_users_.find(v.key);
    if (it == volume_users_.end()) continue;
    if (it->second.rfind("#", 0) == 0) {
      return absl::AbortedError(absl::StrCat(
          "volume ", v.name, " is being created, deleted or mounted by another request"));
    }
    return absl::AbortedError(absl::StrCat("volume ", v.name, " is mounted by environment ",
                                           it->second,
                                           " (a volume is mounted by one environment at a time)"));
  }
  for (const VolumeMount& v : spec.volumes) volume_users_[v.key] = claimant;
  return absl::OkStatus();
}

void EnvironmentManager::ReleaseVolumes(const std::string& claimant) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = volume_users_.begin(); it != volume_users_.end();) {
    if (it->second == claimant)
      it = volume_users_.erase(it);
    else
      ++it;
  }
}

absl::StatusOr<VolumeRecord> EnvironmentManager::CreateVolume(const Caller& caller,
                                                              const std::string& name,
                                                              int64_t size_mb) {
  const int64_t t0 = MonotonicMs();
  auto create = [&]() -> absl::StatusOr<VolumeRecord> {
    if (absl::Status st = ValidateVolumeName(name); !st.ok()) return st;
    if (absl::Status st = ValidateVolumeSize(size_mb, options_.max_volume_mb); !st.ok()) return st;
    Driver* driver = VolumeDriver();
    if (driver == nullptr) {
      return absl::InvalidArgumentError("runtime 'container' is not available on this host");
    }
    if (!driver->Capabilities().Has(Capability::kVolumes)) {
      return MissingCapabilityError(driver->name(), Capability::kVolumes);
    }
    const std::string key = VolumeKey(caller.tenant, name);
    const std::string marker = absl::StrCat("#volume-create-", RandomHex(8));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (volume_users_.count(key)) {
        return absl::AlreadyExistsError(absl::StrCat("volume ", name, " already exists"));
      }
      volume_users_[key] = marker;
    }
    VolumeClaimRelease release{this, marker};
    // Count and insert under one lock, so concurrent creates cannot overshoot the quota.
    std::unique_lock<std::mutex> quota_lock(volume_quota_mu_);
    auto existing = store_->ListVolumes(caller.tenant);
    if (!existing.ok()) return existing.status();
    if (static_cast<int>(existing->size()) >= options_.max_volumes_per_tenant) {
      return absl::ResourceExhaustedError(absl::StrCat("tenant already has ", existing->size(),
                                                       " volumes (max_volumes_per_tenant)"));
    }
    VolumeRecord rec{caller.tenant, name, size_mb, Now()};
    if (absl::Status st = store_->InsertVolume(rec); !st.ok()) return st;
    quota_lock.unlock();
    if (absl::Status st = driver->CreateVolume(key, size_mb); !st.ok()) {
      store_->DeleteVolume(caller.tenant, name).IgnoreError();
      return st;
    }
    return rec;
  };
  absl::StatusOr<VolumeRecord> rec = create();
  audit_.Record(caller, {.action = "volume.create",
                         .detail = absl::StrCat(name, " size_mb=", size_mb),
                         .duration_ms = MonotonicMs() - t0,
                         .outcome = rec.status()});
  return rec;
}

absl::StatusOr<std::vector<VolumeInfo>> EnvironmentManager::ListVolumes(const Caller& caller) {
  auto records = store_->ListVolumes(caller.tenant);
  if (!records.ok()) return records.status();
  std::vector<VolumeInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (VolumeRecord& r : *records) {
    VolumeInfo info{std::move(r), ""};
    auto it = volume_users_.find(VolumeKey(caller.tenant, info.record.name));
    if (it != volume_users_.end() && it->second.rfind("#", 0) != 0) info.mounted_by = it->second;
    out.push_back(std::move(info));
  }
  return out;
}

absl::Status EnvironmentManager::DeleteVolume(const Caller& caller, const std::string& name) {
  const int64_t t0 = MonotonicMs();
  auto remove = [&]() -> absl::Status {
    if (absl::Status st = ValidateVolumeName(name); !st.ok()) return st;
    auto records = store_->ListVolumes(caller.tenant);
    if (!records.ok()) return records.status();
    if (std::none_of(records->begin(), records->end(),
                     [&](const VolumeRecord& r) { return r.name == name; })) {
      return absl::NotFoundError(absl::StrCat("volume ", name, " not found"));
    }
    Driver* driver = VolumeDriver();
    if (driver == nullptr) {
      return absl::InvalidArgumentError("runtime 'container' is not available on this host");
    }
    const std::string key = VolumeKey(caller.tenant, name);
    const std::string marker = absl::StrCat("#volume-delete-", RandomHex(8));
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = volume_users_.find(key);
      if (it != volume_users_.end()) {
        if (it->second.rfind("#", 0) == 0) {
          return absl::AbortedError(
              absl::StrCat("volume ", name, " is busy (another request uses it)"));
        }
        return absl::AbortedError(absl::StrCat("volume ", name, " is mounted by environment ",
                                               it->second, "; delete that first"));
      }
      volume_users_[key] = marker;
    }
    VolumeClaimRelease release{this, marker};
    if (absl::Status st = driver->DeleteVolume(key); !st.ok()) return st;
    return store_->DeleteVolume(caller.tenant, name);
  };
  absl::Status st = remove();
  if (st.code() != absl::StatusCode::kNotFound) {
    audit_.Record(caller, {.action = "volume.delete",
                           .detail = name,
                           .duration_ms = MonotonicMs() - t0,
                           .outcome = st});
  }
  return st;
}

absl::Status EnvironmentManager::Destroy(const Caller& caller, const std::string& id,
                                         const std::string& reason) {
  const std::string& tenant = caller.tenant;
  const int64_t t0 = MonotonicMs();
  std::shared_ptr<LiveEnv> env;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = envs_.find(id);
    if (it != envs_.end()) {
      if (it->second->tenant == tenant) {
        env = it->second;
        envs_.erase(it);  // from here on, nobody else can find or destroy it
      }
    }
  }
  if (!env) {
    auto rec = store_->GetEnvironment(id);
    if (rec.ok() && rec->tenant == tenant &&
        (rec->state == EnvState::kDestroyed || rec->state == EnvState::kDestroying))
      return absl::OkStatus();  // idempotent
    return EnvironmentNotFoundError(absl::StrCat("environment ", id, " not found"));
  }
  DestroyLive(env, reason);
  audit_.Record(caller, {.environment_id = id,
                         .action = "environment.delete",
                         .detail = reason,
                         .duration_ms = MonotonicMs() - t0});
  return absl::OkStatus();
}

void EnvironmentManager::Reap(const std::shared_ptr<LiveEnv>& env, const std::string& reason) {
  const int64_t t0 = MonotonicMs();
  DestroyLive(env, reason);
  audit_.Record(Caller::System(env->tenant),
                {.environment_id = env->record.id,  // id is immutable
                 .action = reason == "ttl_expired" ? "environment.expire" : "environment.reap",
                 .detail = reason,
                 .duration_ms = MonotonicMs() - t0});
}

absl::StatusOr<EnvironmentInfo> EnvironmentManager::Get(const Caller& caller,
                                                        const std::string& id) {
  const std::string& tenant = caller.tenant;
  std::shared_ptr<LiveEnv> env;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = envs_.find(id);
    if (it != envs_.end() && it->second->tenant == tenant) env = it->second;
  }
  if (env) {
    EnvironmentRecord snapshot;
    {
      std::lock_guard<std::mutex> elock(env->mu);
      snapshot = env->record;
    }
    EnvironmentInfo info = InfoOf(snapshot, false);
    if (env->governed) {
      std::lock_guard<std::mutex> glock(env->egress_mu);
      info.egress = env->policy;
    }
    info.steps = StepsStatusOf(*env);
    return info;
  }
  auto rec = store_->GetEnvironment(id);
  if (!rec.ok() || rec->tenant != tenant)
    return EnvironmentNotFoundError(absl::StrCat("environment ", id, " not found"));
  return InfoOf(*rec, false);
}

absl::StatusOr<std::vector<EnvironmentInfo>> EnvironmentManager::List(const Caller& caller,
                                                                      bool include_destroyed) {
  const std::string& tenant = caller.tenant;
  std::vector<EnvironmentInfo> out;
  std::map<std::string, EnvironmentRecord> live;
  std::vector<std::shared_ptr<LiveEnv>> mine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : envs_) {
      if (e->tenant == tenant) mine.push_back(e);
    }
  }
  std::map<std::string, governance::EgressPolicy> policies;
  std::map<std::string, StepsStatus> steps;
  for (const auto& e : mine) {
    steps[e->record.id] = StepsStatusOf(*e);  // id is immutable
    {
      std::lock_guard<std::mutex> elock(e->mu);
      live[e->record.id] = e->record;
    }
    if (e->governed) {
      std::lock_guard<std::mutex> glock(e->egress_mu);
      policies[e->record.id] = e->policy;
    }
  }
  auto stored = store_->ListEnvironments(tenant, include_destroyed);
  if (!stored.ok()) return stored.status();
  for (const auto& rec : *stored) {
    auto it = live.find(rec.id);
    if (it != live.end()) {
      out.push_back(InfoOf(it->second, false));
      live.erase(it);
    } else if (include_destroyed || rec.state != EnvState::kDestroyed) {
      if (rec.state == EnvState::kRunning)
        continue;  // stale row of an env being destroyed right now
      out.push_back(InfoOf(rec, false));
    }
  }
  for (const auto& [id, rec] : live) out.push_back(InfoOf(rec, false));
  for (EnvironmentInfo& info : out) {
    if (auto it = policies.find(info.record.id); it != policies.end()) info.egress = it->second;
    if (auto it = steps.find(info.record.id); it != steps.end()) info.steps = it->second;
  }
  std::sort(out.begin(), out.end(), [](const EnvironmentInfo& a, const EnvironmentInfo& b) {
    return a.record.created_ms > b.record.created_ms;
  });
  return out;
}

absl::StatusOr<int64_t> EnvironmentManager::Heartbeat(const Caller& caller, const std::string& id,
                                                      int64_t ttl_s) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  int64_t expires_ms;
  {
    std::lock_guard<std::mutex> elock((*env)->mu);
    // The reaper may have taken it (expired) between Lookup and here: a heartbeat never
    // revives an environment that is being destroyed, nor rewrites its stored state (the
    // write below is a snapshot: it carries the destroy if one comes first).
    if ((*env)->record.state != EnvState::kRunning)
      return EnvironmentNotFoundError(absl::StrCat("environment ", id, " is being destroyed (",
                                                   (*env)->record.destroy_reason, ")"));
    int64_t ttl = options_.default_ttl_s;
    SpecFromJson((*env)->record.spec_json, &ttl).IgnoreError();
    if (ttl_s > 0) ttl = std::min(ttl_s, options_.max_ttl_s);
    int64_t now = Now();
    (*env)->record.last_used_ms = now;
    (*env)->record.expires_ms = expires_ms = now + ttl * 1000;
  }
  PersistLive(**env);
  return expires_ms;
}

absl::StatusOr<std::shared_ptr<EnvironmentManager::LiveEnv>> EnvironmentManager::LookupFor(
    const Caller& caller, const std::string& id, Capability needed) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (!(*env)->driver->Capabilities().Has(needed))
    return MissingCapabilityError((*env)->driver->name(), needed);
  Touch(**env);
  return env;
}

absl::StatusOr<ExecResult> EnvironmentManager::Exec(const Caller& caller, const std::string& id,
                                                    const ExecRequest& request,
                                                    const OutputSink& sink,
                                                    const std::string& intent) {
  auto env = LookupFor(caller, id, Capability::kExec);
  std::unique_ptr<CallIntent> call_intent;  // removed when the call returns, however it ends
  if (env.ok() && !intent.empty()) {
    auto begun = BeginCallIntent(caller, id, intent, request.timeout.count(), "execute");
    if (begun.ok())
      call_intent = *std::move(begun);
    else
      env = begun.status();
  }
  if (!env.ok()) {
    if (!IsEnvironmentNotFound(env.status()))
      audit_.Record(caller, {.environment_id = id,
                             .action = "execute",
                             .detail = request.command,
                             .outcome = env.status()});
    return env.status();
  }
  auto step = BeginStep(
      *env, "execute", request.command,
      json::serialize(json::object{{"command", SanitizeUtf8(request.command)},
                                   {"timeout_ms", static_cast<int64_t>(request.timeout.count())}}));
  if (!step.ok()) {
    audit_.Record(caller, {.environment_id = id,
                           .action = "execute",
                           .detail = request.command,
                           .outcome = step.status()});
    return step.status();
  }
  int64_t start = MonotonicMs();
  InstanceRef exec_ref;
  {
    std::lock_guard<std::mutex> elock((*env)->mu);
    exec_ref = (*env)->ref;  // a rewind may replace it
  }
  auto result = (*env)->driver->Exec(exec_ref, request, sink);
  if (*step) {
    StepOutcome o{.status = result.status()};
    if (result.ok()) {
      o.exit_code = result->exit_code;
      o.stdout_data = result->stdout_data;
      o.stderr_data = result->stderr_data;
      o.truncated = result->truncated;
      if (result->timed_out) o.error = "timed out";
    }
    ApplyStepOutcome(**step, o);
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  metrics_->exec_total++;
  metrics_->exec_duration.Observe((MonotonicMs() - start) / 1000.0);
  if (!result.ok()) {
    metrics_->CountError("exec");
    audit_.Record(caller, {.environment_id = id,
                           .action = "execute",
                           .detail = request.command,
                           .duration_ms = MonotonicMs() - start,
                           .outcome = result.status()});
    return result.status();
  }
  if (result->timed_out) metrics_->exec_timeouts++;
  bool running;
  {
    std::lock_guard<std::mutex> elock((*env)->mu);
    (*env)->record.exec_count++;
    (*env)->record.last_used_ms = Now();
    running = (*env)->record.state == EnvState::kRunning;
  }
  // Destroyed while the command ran: its final row is already written; keep it. The counters
  // (exec_count, last_used_ms) are written behind the reply (a crash may lose the last
  // StoreOptions::write_behind_ms of them; the TTL lease is kept in memory and by heartbeats).
  if (running) PersistLive(**env, /*deferred=*/true);
  audit_.Record(caller, {.environment_id = id,
                         .action = "execute",
                         .detail = request.command,
                         .exit_code = result->exit_code,
                         .duration_ms = result->duration_ms,
                         .bytes = static_cast<int64_t>(result->stdout_data.size() +
                                                       result->stderr_data.size())});
  return result;
}

absl::StatusOr<std::unique_ptr<EnvironmentManager::FileTransfer>> EnvironmentManager::OpenTransfer(
    const Caller& caller, const std::string& id, const std::string& path,
    const std::string& action) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  std::unique_ptr<FileTransfer> t(new FileTransfer());
  t->manager_ = this;
  t->caller_ = caller;
  t->id_ = id;
  t->path_ = path;
  t->action_ = action;
  t->start_ms_ = MonotonicMs();
  if (!(*env)->driver->Capabilities().Has(Capability::kFiles)) {
    // Refused, and still one audited action (the transfer records the refusal).
    t->outcome_ = MissingCapabilityError((*env)->driver->name(), Capability::kFiles);
    return t->outcome_;
  }
  t->env_ = *env;
  if (action == "files.write" || action == "files.upload") {
    auto step =
        BeginStep(*env, "files.write", path,
                  json::serialize(json::object{{"path", SanitizeUtf8(path)}, {"action", action}}));
    if (!step.ok()) {
      t->outcome_ = step.status();
      t->env_.reset();
      return step.status();
    }
    if (*step) {
      t->step_ = *std::move(step);
      // A transfer's calls may run on other threads than this one: it marks none.
      if (t->step_->thread_marked) {
        ResetStepThread(t->step_->previous);
        t->step_->thread_marked = false;
      }
    }
  }
  return t;
}

EnvironmentManager::FileTransfer::~FileTransfer() {
  if (manager_ == nullptr) return;
  if (step_) {
    // The write's step, at the transfer's end (after its last chunk).
    ApplyStepOutcome(*step_, {.status = outcome_});
    manager_->RecordStepLocked(*step_->env, std::move(step_->rec));
    step_.reset();
  }
  manager_->audit_.Record(caller_, {.environment_id = id_,
                                    .action = action_,
                                    .detail = path_,
                                    .duration_ms = MonotonicMs() - start_ms_,
                                    .bytes = bytes_,
                                    .outcome = outcome_});
}

absl::Status EnvironmentManager::FileTransfer::Write(std::string_view data, int64_t offset,
                                                     bool truncate) {
  if (!env_) return outcome_;
  manager_->Touch(*env_);
  InstanceRef ref;
  {
    std::lock_guard<std::mutex> elock(env_->mu);
    ref = env_->ref;
  }
  absl::Status st = env_->driver->WriteFile(ref, path_, data, offset, truncate);
  if (st.ok())
    bytes_ += static_cast<int64_t>(data.size());
  else
    outcome_ = st;
  return st;
}

absl::StatusOr<FileChunk> EnvironmentManager::FileTransfer::Read(int64_t offset, int64_t length) {
  if (!env_) return outcome_;
  manager_->Touch(*env_);
  absl::StatusOr<FileChunk> chunk = env_->driver->ReadFile(env_->ref, path_, offset, length);
  if (chunk.ok())
    bytes_ += static_cast<int64_t>(chunk->data.size());
  else
    outcome_ = chunk.status();
  return chunk;
}

absl::Status EnvironmentManager::WriteFile(const Caller& caller, const std::string& id,
                                           const std::string& path, std::string_view data,
                                           int64_t offset, bool truncate) {
  auto t = OpenTransfer(caller, id, path, "files.write");
  if (!t.ok()) return t.status();
  return (*t)->Write(data, offset, truncate);
}

absl::StatusOr<FileChunk> EnvironmentManager::ReadFile(const Caller& caller, const std::string& id,
                                                       const std::string& path, int64_t offset,
                                                       int64_t length) {
  auto t = OpenTransfer(caller, id, path, "files.read");
  if (!t.ok()) return t.status();
  return (*t)->Read(offset, length);
}

absl::StatusOr<DirListing> EnvironmentManager::ListDir(const Caller& caller, const std::string& id,
                                                       const std::string& path) {
  const int64_t t0 = MonotonicMs();
  auto env = LookupFor(caller, id, Capability::kFiles);
  absl::StatusOr<DirListing> out =
      env.ok() ? (*env)->driver->ListDir((*env)->ref, path) : env.status();
  if (!IsEnvironmentNotFound(out.status()))
    audit_.Record(caller, {.environment_id = id,
                           .action = "files.list",
                           .detail = path,
                           .duration_ms = MonotonicMs() - t0,
                           .bytes = out.ok() ? static_cast<int64_t>(out->entries.size()) : 0,
                           .outcome = out.status()});
  return out;
}

absl::StatusOr<FileEntry> EnvironmentManager::StatFile(const Caller& caller,
                                                       const std::string& id,
                                                       const std::string& path) {
  auto env = LookupFor(caller, id, Capability::kFiles);
  if (!env.ok()) return env.status();
  return (*env)->driver->Stat((*env)->ref, path);
}

template <typename Fn>
auto EnvironmentManager::AuditedFileOp(const Caller& caller, const std::string& id,
                                       std::string_view action, std::string_view detail, Fn op)
    -> decltype(op(std::declval<LiveEnv&>())) {
  const int64_t t0 = MonotonicMs();
  auto env = LookupFor(caller, id, Capability::kFiles);
  absl::StatusOr<std::unique_ptr<StepGuard>> step = std::unique_ptr<StepGuard>();
  if (env.ok()) {
    step = BeginStep(*env, std::string(action), std::string(detail),
                     json::serialize(json::object{{"detail", SanitizeUtf8(detail)}}));
    if (!step.ok()) env = step.status();
  }
  decltype(op(std::declval<LiveEnv&>())) out = env.ok() ? op(**env) : env.status();
  if (step.ok() && *step) {
    absl::Status st;
    if constexpr (std::is_same_v<decltype(out), absl::Status>) {
      st = out;
    } else {
      st = out.status();
    }
    ApplyStepOutcome(**step, {.status = st});
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  absl::Status st;
  if constexpr (std::is_same_v<decltype(out), absl::Status>) {
    st = out;
  } else {
    st = out.status();
  }
  if (!IsEnvironmentNotFound(st))
    audit_.Record(caller, {.environment_id = id,
                           .action = std::string(action),
                           .detail = std::string(detail),
                           .duration_ms = MonotonicMs() - t0,
                           .outcome = st});
  return out;
}

absl::StatusOr<bool> EnvironmentManager::MakeDir(const Caller& caller, const std::string& id,
                                                 const std::string& path) {
  return AuditedFileOp(caller, id, "files.mkdir", path, [&](LiveEnv& env) {
    return env.driver->MakeDir(env.ref, path);
  });
}

absl::Status EnvironmentManager::RemoveFile(const Caller& caller, const std::string& id,
                                            const std::string& path, bool recursive) {
  return AuditedFileOp(caller, id, "files.remove", path, [&](LiveEnv& env) {
    return env.driver->Remove(env.ref, path, recursive);
  });
}

absl::Status EnvironmentManager::RenameFile(const Caller& caller, const std::string& id,
                                            const std::string& source,
                                            const std::string& destination, bool overwrite) {
  return AuditedFileOp(caller, id, "files.rename", absl::StrCat(source, " -> ", destination),
                       [&](LiveEnv& env) {
                         return env.driver->Rename(env.ref, source, destination, overwrite);
                       });
}

absl::StatusOr<Usage> EnvironmentManager::Stats(const Caller& caller, const std::string& id) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  return (*env)->driver->Stats((*env)->ref);
}

namespace {
std::string RunDetail(const std::string& runtime, const RunRequest& request) {
  return absl::StrCat("[", runtime, "] ", request.code);
}
}  // namespace

absl::StatusOr<RunResult> EnvironmentManager::RunCode(const Caller& caller, const std::string& id,
                                                      const RunRequest& request,
                                                      const OutputSink& sink) {
  const int64_t t0 = MonotonicMs();
  auto env = LookupFor(caller, id, Capability::kPythonSession);
  if (!env.ok()) {
    if (!IsEnvironmentNotFound(env.status()))
      audit_.Record(
          caller,
          {.environment_id = id, .action = "run", .detail = request.code, .outcome = env.status()});
    return env.status();
  }
  auto step = BeginStep(*env, "run", request.code,
                        json::serialize(json::object{{"code", SanitizeUtf8(request.code)}}));
  if (!step.ok()) {
    audit_.Record(
        caller,
        {.environment_id = id, .action = "run", .detail = request.code, .outcome = step.status()});
    return step.status();
  }
  InstanceRef ref;
  {
    // Counted as it starts: artifacts captured during the run carry its sequence number.
    std::lock_guard<std::mutex> elock((*env)->mu);
    (*env)->record.exec_count++;
    ref = (*env)->ref;
  }
  absl::StatusOr<RunResult> r = (*env)->driver->RunCode(&ref, request, sink);
  if (*step) {
    StepOutcome o{.status = r.status()};
    if (r.ok()) {
      o.exit_code = r->exit_code;
      o.stdout_data = r->stdout_data;
      o.stderr_data = r->stderr_data;
      o.truncated = r->truncated;
      if (r->error) o.error = absl::StrCat(r->error->type, ": ", r->error->message);
      if (r->timed_out) o.error = "timed out";
      if (!r->artifacts.empty()) {
        json::array arts;
        for (const ReportedArtifact& a : r->artifacts) {
          arts.push_back(json::object{{"path", SanitizeUtf8(a.path)},
                                      {"name", SanitizeUtf8(a.name)},
                                      {"kind", a.kind},
                                      {"mime_type", a.mime_type}});
          if (arts.size() >= 64) break;
        }
        o.artifacts_json = json::serialize(arts);
      }
    }
    ApplyStepOutcome(**step, o);
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  bool running;
  {
    std::lock_guard<std::mutex> elock((*env)->mu);
    (*env)->record.last_used_ms = Now();
    running = (*env)->record.state == EnvState::kRunning;
  }
  if (running) PersistLive(**env, /*deferred=*/true);  // counters: written behind, as Exec
  audit_.Record(caller, {.environment_id = id,
                         .action = "run",
                         .detail = RunDetail((*env)->driver->name(), request),
                         .exit_code = r.ok() ? std::optional<int64_t>(r->exit_code) : std::nullopt,
                         .duration_ms = MonotonicMs() - t0,
                         .bytes = static_cast<int64_t>(request.code.size()),
                         .outcome = r.status()});
  return r;
}

absl::StatusOr<RunResult> EnvironmentManager::RunOneShot(const Caller& caller, DriverKind runtime,
                                                         const RunRequest& request,
                                                         const OutputSink& sink) {
  const int64_t t0 = MonotonicMs();
  absl::StatusOr<RunResult> r;
  auto it = drivers_.find(runtime);
  if (it == drivers_.end()) {
    r = absl::InvalidArgumentError(
        absl::StrCat("runtime '", AbslView(ToString(runtime)), "' is not available on this host"));
  } else if (!it->second->Capabilities().Has(Capability::kPythonOneShot)) {
    r = MissingCapabilityError(ToString(runtime), Capability::kPythonOneShot);
  } else {
    r = it->second->RunCode(nullptr, request, sink);
  }
  audit_.Record(caller, {.action = "run",
                         .detail = RunDetail(std::string(ToString(runtime)), request),
                         .exit_code = r.ok() ? std::optional<int64_t>(r->exit_code) : std::nullopt,
                         .duration_ms = MonotonicMs() - t0,
                         .bytes = static_cast<int64_t>(request.code.size()),
                         .outcome = r.status()});
  return r;
}

absl::StatusOr<DriverKind> EnvironmentManager::RuntimeOf(const Caller& caller,
                                                         const std::string& id) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  return (*env)->kind;
}

CapabilitySet EnvironmentManager::CapabilitiesOf(DriverKind runtime) const {
  auto it = drivers_.find(runtime);
  return it == drivers_.end() ? CapabilitySet() : it->second->Capabilities();
}

std::map<std::string, int64_t> EnvironmentManager::StateCounts() {
  const std::string running(ToString(EnvState::kRunning)), pooled(ToString(EnvState::kPooled));
  std::map<std::string, int64_t> counts{{running, 0}, {pooled, 0}};
  std::lock_guard<std::mutex> lock(mu_);
  counts[running] = static_cast<int64_t>(envs_.size());
  for (const auto& [rt, q] : pool_) counts[pooled] += static_cast<int64_t>(q.size());
  return counts;
}

int64_t EnvironmentManager::PoolReady() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [rt, q] : pool_) n += static_cast<int64_t>(q.size());
  return n;
}

void EnvironmentManager::ReaperLoop() {
  int64_t last_health = MonotonicMs();
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(wake_mu_);
      wake_cv_.wait_for(lock, std::chrono::milliseconds(options_.reaper_interval_ms),
                        [this] { return stopping_; });
      if (stopping_) return;
    }
    int64_t now = Now();
    bool health = MonotonicMs() - last_health >= options_.health_interval_ms;
    if (health) last_health = MonotonicMs();
    std::vector<std::pair<std::shared_ptr<LiveEnv>, std::string>> doomed;
    std::vector<std::shared_ptr<LiveEnv>> retry;
    std::vector<std::shared_ptr<LiveEnv>> check;
    std::vector<std::shared_ptr<LiveEnv>> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, e] : envs_) live.push_back(e);
      retry.swap(destroy_retry_);
    }
    // Each environment's mutex is taken without mu_ held (a slow one never stalls lookups).
    std::vector<std::shared_ptr<LiveEnv>> expired;
    for (auto& env : live) {
      std::lock_guard<std::mutex> elock(env->mu);
      if (env->record.state != EnvState::kRunning) continue;  // a Destroy has it
      if (env->record.expires_ms <= now) {
        // Decided under env->mu: a heartbeat from here on sees it going (NotFound).
        env->record.state = EnvState::kDestroying;
        env->record.destroy_reason = "ttl_expired";
        expired.push_back(env);
      } else if (health) {
        check.push_back(env);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& env : expired) {
        auto it = envs_.find(env->record.id);  // id is immutable
        // Not there: a concurrent Destroy took it first and destroys it itself.
        if (it != envs_.end() && it->second == env) {
          envs_.erase(it);
          doomed.emplace_back(env, "ttl_expired");
        }
      }
    }
    for (auto& env : check) {
      auto usage = env->driver->Stats(env->ref);
      if (usage.ok() && usage->alive) continue;
      bool erased;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = envs_.find(env->record.id);
        erased = it != envs_.end() && it->second == env;
        if (erased) envs_.erase(it);
      }
      if (erased) {
        {
          std::lock_guard<std::mutex> elock(env->mu);
          env->record.state = EnvState::kDestroying;
          env->record.destroy_reason = "died";
        }
        LogWarn(absl::StrCat("environment ", env->record.id, " died; cleaning up"));
        doomed.emplace_back(env, "died");
      }
    }
    for (auto& [env, reason] : doomed) {
      LogInfo(absl::StrCat("reaping ", env->record.id, ": ", reason));
      metrics_->reaped_total++;
      Reap(env, reason);
    }
    for (auto& env : retry) {
      std::string reason;
      {
        std::lock_guard<std::mutex> elock(env->mu);
        reason = env->record.destroy_reason;
      }
      DestroyLive(env, reason);
    }
    // Audit retention and rate-limit summaries (cheap when there is nothing to do).
    if (absl::Status st = store_->Maintain(); !st.ok()) {
      metrics_->CountError("store");
      LogError(absl::StrCat("store maintenance: ", st.ToString()));
    }
  }
}

void EnvironmentManager::PoolLoop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(wake_mu_);
      if (stopping_) return;
    }
    bool made = false, failed = false;
    for (DriverKind runtime : options_.pooled_runtimes) {
      if (!drivers_.count(runtime) || options_.pool_size <= 0) continue;
      size_t have;
      {
        std::lock_guard<std::mutex> lock(mu_);
        have = pool_[runtime].size();
      }
      if (have >= static_cast<size_t>(options_.pool_size)) continue;
      EnvSpec spec = options_.default_spec;
      spec.runtime = runtime;
      auto env = CreateInstance(spec, kPoolTenant, EnvState::kPooled, options_.default_ttl_s);
      if (!env.ok()) {
        LogWarn(absl::StrCat("warm pool (", AbslView(ToString(runtime)),
                             "): ", env.status().ToString()));
        failed = true;
        continue;
      }
      bool stop;
      {
        std::lock_guard<std::mutex> lock(wake_mu_);
        stop = stopping_;
      }
      if (stop) {
        DestroyLive(*env, "pool_discarded_on_shutdown");
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      pool_[runtime].push_back(*env);
      made = true;
    }
    if (!made) {
      std::unique_lock<std::mutex> lock(wake_mu_);
      // Back off after a failure so a broken image does not spin and flood the log.
      wake_cv_.wait_for(lock, std::chrono::milliseconds(failed ? 15000 : 1000),
                        [this] { return stopping_ || pool_kick_; });
      pool_kick_ = false;
    }
  }
}

}  // namespace esb
