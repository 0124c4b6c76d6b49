// EnvironmentManager: egress governance (issue 12). A governed environment's policy, intents
// and CA live in its LiveEnv (under egress_mu) and in the store (env_egress, schema v5); every
// change is stored first, then pushed to the proxy through EgressControl, then audited.
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "core/environment_manager.h"
#include "core/snapshots/step_guard.h"

namespace esb {

namespace json = boost::json;
using governance::ActiveIntent;
using governance::EgressPolicy;

namespace {

// A call-scoped intent outlives its call's timeout by this much at most (the removal runs when
// the call returns; this only bounds it should that never happen).
constexpr int64_t kCallIntentGraceMs = 60'000;

std::string IntentsToJson(const std::vector<ActiveIntent>& intents) {
  json::array arr;
  for (const ActiveIntent& i : intents) arr.push_back(governance::ToJson(i));
  return json::serialize(arr);
}

absl::StatusOr<std::vector<ActiveIntent>> IntentsFromJson(const std::string& text) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_array()) return absl::InvalidArgumentError("stored intents are not an array");
  std::vector<ActiveIntent> out;
  for (const json::value& item : v.as_array()) {
    auto intent = governance::ParseActiveIntent(item);
    if (!intent.ok()) return intent.status();
    out.push_back(*std::move(intent));
  }
  return out;
}

absl::Status NotGoverned(const std::string& id) {
  return absl::AbortedError(absl::StrCat(
      "environment ", id,
      " was created with network \"none\": it has no egress to govern (the network is fixed at "
      "create; create a new environment with a network policy)"));
}

}  // namespace

std::function<absl::StatusOr<UniqueFd>()> EnvironmentManager::ListenerOpener(const LiveEnv& env) {
  // The driver and the instance outlive the attachment: Detach runs before the driver's Destroy.
  return [driver = env.driver, ref = env.ref]() { return driver->OpenEgressListener(ref); };
}

bool EnvironmentManager::PruneIntentsLocked(LiveEnv& env, int64_t now) {
  auto expired = [now](const ActiveIntent& i) { return !i.ActiveAt(now); };
  size_t before = env.intents.size();
  env.intents.erase(std::remove_if(env.intents.begin(), env.intents.end(), expired),
                    env.intents.end());
  return env.intents.size() != before;
}

std::vector<ActiveIntent> EnvironmentManager::EffectiveIntentsLocked(const LiveEnv& env,
                                                                     int64_t now) const {
  std::vector<ActiveIntent> out;
  for (const ActiveIntent& i : env.intents)
    if (i.ActiveAt(now)) out.push_back(i);
  for (const auto& [name, call] : env.call_intents)
    if (call.refs > 0 && call.intent.ActiveAt(now)) out.push_back(call.intent);
  return out;
}

NetworkInfo EnvironmentManager::NetworkInfoLocked(const LiveEnv& env, int64_t now) const {
  NetworkInfo info;
  info.governed = true;
  info.policy = env.policy;
  for (const ActiveIntent& i : env.intents)
    if (i.ActiveAt(now)) info.intents.push_back({i, "environment"});
  for (const auto& [name, call] : env.call_intents)
    if (call.refs > 0 && call.intent.ActiveAt(now)) info.intents.push_back({call.intent, "call"});
  return info;
}

absl::Status EnvironmentManager::PersistEgressLocked(const LiveEnv& env) {
  EgressRecord rec;
  rec.env_id = env.record.id;  // immutable
  rec.tenant = env.tenant;
  rec.policy_json = json::serialize(governance::ToJson(env.policy));
  rec.intents_json = IntentsToJson(env.intents);
  rec.ca_cert_pem = env.ca.cert_pem;
  rec.ca_key_pem = env.ca.key_pem;
  rec.updated_ms = Now();
  absl::Status st = store_->PutEgress(rec);
  if (!st.ok()) {
    metrics_->CountError("store");
    return absl::UnavailableError(absl::StrCat("storing the egress state: ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status EnvironmentManager::CommitEgressLocked(LiveEnv& env) {
  if (absl::Status st = PersistEgressLocked(env); !st.ok()) return st;
  if (options_.egress == nullptr)
    return absl::UnavailableError("egress is not available on this daemon (no egress proxy)");
  absl::Status st =
      options_.egress->Update(env.record.id, env.policy, EffectiveIntentsLocked(env, Now()));
  if (!st.ok()) {
    metrics_->CountError("egress");
    // Stored: a re-attach (proxy restart) sends it; retrying the call is harmless.
    return absl::UnavailableError(
        absl::StrCat("stored, but the egress proxy did not take the change yet: ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status EnvironmentManager::AttachNewEgress(LiveEnv& env, const EgressPolicy& policy,
                                                 const EgressCaPem& ca) {
  std::lock_guard<std::mutex> glock(env.egress_mu);
  env.governed = true;
  env.policy = policy;
  env.ca = ca;
  {
    std::lock_guard<std::mutex> elock(env.mu);
    env.tenant = env.record.tenant;
  }
  if (absl::Status st = PersistEgressLocked(env); !st.ok()) return st;
  return options_.egress->Attach(EgressAttachment{env.record.id,
                                                  env.tenant,
                                                  env.policy,
                                                  {},
                                                  env.ca.cert_pem,
                                                  env.ca.key_pem,
                                                  ListenerOpener(env)});
}

void EnvironmentManager::ReattachEgress(LiveEnv& env) {
  std::lock_guard<std::mutex> glock(env.egress_mu);
  const std::string& id = env.record.id;
  auto rec = store_->GetEgress(id);
  absl::Status problem;
  if (rec.ok()) {
    boost::system::error_code ec;
    json::value policy_json = json::parse(rec->policy_json, ec);
    auto policy = ec ? absl::StatusOr<EgressPolicy>(absl::InvalidArgumentError(ec.message()))
                     : governance::ParseEgressPolicy(policy_json);
    auto intents = IntentsFromJson(rec->intents_json);
    if (policy.ok() && intents.ok()) {
      env.policy = *std::move(policy);
      env.intents = *std::move(intents);
      env.ca = EgressCaPem{rec->ca_cert_pem, rec->ca_key_pem};
    } else {
      problem = policy.ok() ? intents.status() : policy.status();
    }
  } else {
    problem = rec.status();
  }
  if (!problem.ok()) {
    // Fail closed: without its state the environment gets no listener, so no egress at all.
    LogError(absl::StrCat("environment ", id, ": cannot restore its egress state (",
                          problem.ToString(), "); its egress stays off"));
    env.policy = EgressPolicy{};
    env.policy.mode = governance::EgressMode::kBlocked;
    return;
  }
  if (PruneIntentsLocked(env, Now())) PersistEgressLocked(env).IgnoreError();
  if (options_.egress == nullptr) {
    LogError(absl::StrCat("environment ", id,
                          " has a network policy but this daemon has no egress proxy: its "
                          "egress stays off"));
    return;
  }
  absl::Status st = options_.egress->Attach(
      EgressAttachment{id, env.tenant, env.policy, EffectiveIntentsLocked(env, Now()),
                       env.ca.cert_pem, env.ca.key_pem, ListenerOpener(env)});
  if (!st.ok()) {
    metrics_->CountError("egress");
    LogError(absl::StrCat("environment ", id,
                          ": re-attaching to the egress proxy failed: ", st.ToString()));
  }
}

absl::StatusOr<NetworkInfo> EnvironmentManager::GetNetwork(const Caller& caller,
                                                           const std::string& id) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (!(*env)->governed) return NetworkInfo{};
  std::lock_guard<std::mutex> glock((*env)->egress_mu);
  return NetworkInfoLocked(**env, Now());
}

absl::StatusOr<NetworkInfo> EnvironmentManager::SetNetwork(const Caller& caller,
                                                           const std::string& id,
                                                           const EgressPolicy* policy) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  const int64_t t0 = MonotonicMs();
  auto step =
      BeginStep(*env, "network", std::string(policy ? "network.update" : "network.update none"),
                json::serialize(json::object{
                    {"change", std::string(policy ? "network.update" : "network.update none")}}));
  if (!step.ok()) return step.status();
  absl::StatusOr<NetworkInfo> result = [&]() -> absl::StatusOr<NetworkInfo> {
    LiveEnv& e = **env;
    if (!e.governed) {
      if (policy == nullptr) return NetworkInfo{};  // "none" stays "none"
      return NotGoverned(id);
    }
    if (policy == nullptr)
      return absl::AbortedError(absl::StrCat(
          "environment ", id,
          " was created with a network policy; its network cannot become \"none\" (fixed at "
          "create). To cut all egress, set {\"mode\": \"blocked\"}"));
    std::lock_guard<std::mutex> glock(e.egress_mu);
    e.policy = *policy;
    PruneIntentsLocked(e, Now());
    if (absl::Status st = CommitEgressLocked(e); !st.ok()) return st;
    return NetworkInfoLocked(e, Now());
  }();
  audit_.Record(caller,
                {.environment_id = id,
                 .action = "network.update",
                 .detail = policy ? json::serialize(governance::ToDisplayJson(*policy)) : "none",
                 .duration_ms = MonotonicMs() - t0,
                 .outcome = result.status()});
  if (*step) {
    ApplyStepOutcome(**step, {.status = result.status()});
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  return result;
}

absl::StatusOr<NetworkInfo> EnvironmentManager::ActivateIntent(const Caller& caller,
                                                               const std::string& id,
                                                               const std::string& name,
                                                               int64_t ttl_s) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  const int64_t t0 = MonotonicMs();
  auto step = BeginStep(*env, "network", absl::StrCat("intent.activate ", name.substr(0, 64)),
                        json::serialize(json::object{
                            {"change", absl::StrCat("intent.activate ", name.substr(0, 64))}}));
  if (!step.ok()) return step.status();
  absl::StatusOr<NetworkInfo> result = [&]() -> absl::StatusOr<NetworkInfo> {
    LiveEnv& e = **env;
    if (!e.governed) return NotGoverned(id);
    governance::IntentCatalogue catalogue = options_.egress_config.IntentsFor(caller.tenant);
    auto def = catalogue.find(name);
    if (def == catalogue.end()) {
      std::vector<std::string> names;
      for (const auto& [n, d] : catalogue) names.push_back(n);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown intent '", name.substr(0, 64),
          "' (the catalogue has: ", names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
    }
    if (ttl_s == 0)
      ttl_s = std::min(governance::kDefaultIntentTtlSeconds, def->second.max_ttl_seconds);
    if (ttl_s < 1 || ttl_s > def->second.max_ttl_seconds)
      return absl::InvalidArgumentError(absl::StrCat(
          "'ttl_seconds' must be 1..", def->second.max_ttl_seconds, " for intent '", name, "'"));
    std::lock_guard<std::mutex> glock(e.egress_mu);
    const int64_t now = Now();
    PruneIntentsLocked(e, now);
    const int64_t expires = now + ttl_s * 1000;
    auto it = std::find_if(e.intents.begin(), e.intents.end(),
                           [&](const ActiveIntent& i) { return i.name == name; });
    if (it != e.intents.end()) {
      it->expires_ms = std::max(it->expires_ms, expires);  // re-activation extends
      it->allow = def->second.allow;
    } else {
      if (e.intents.size() >= governance::kMaxActiveIntents)
        return absl::ResourceExhaustedError(absl::StrCat("at most ", governance::kMaxActiveIntents,
                                                         " intents may be active at once"));
      e.intents.push_back(ActiveIntent{name, def->second.allow, expires});
      std::sort(e.intents.begin(), e.intents.end(),
                [](const ActiveIntent& a, const ActiveIntent& b) { return a.name < b.name; });
    }
    if (absl::Status st = CommitEgressLocked(e); !st.ok()) return st;
    return NetworkInfoLocked(e, now);
  }();
  audit_.Record(caller, {.environment_id = id,
                         .action = "network.intent.activate",
                         .detail = absl::StrCat(name.substr(0, 64), " ttl_seconds=", ttl_s),
                         .duration_ms = MonotonicMs() - t0,
                         .outcome = result.status()});
  if (*step) {
    ApplyStepOutcome(**step, {.status = result.status()});
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  return result;
}

absl::StatusOr<NetworkInfo> EnvironmentManager::DeactivateIntent(const Caller& caller,
                                                                 const std::string& id,
                                                                 const std::string& name) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  const int64_t t0 = MonotonicMs();
  auto step = BeginStep(*env, "network", absl::StrCat("intent.deactivate ", name.substr(0, 64)),
                        json::serialize(json::object{
                            {"change", absl::StrCat("intent.deactivate ", name.substr(0, 64))}}));
  if (!step.ok()) return step.status();
  absl::StatusOr<NetworkInfo> result = [&]() -> absl::StatusOr<NetworkInfo> {
    LiveEnv& e = **env;
    if (!e.governed) return NotGoverned(id);
    std::lock_guard<std::mutex> glock(e.egress_mu);
    const int64_t now = Now();
    PruneIntentsLocked(e, now);
    auto it = std::find_if(e.intents.begin(), e.intents.end(),
                           [&](const ActiveIntent& i) { return i.name == name; });
    if (it == e.intents.end())
      return absl::NotFoundError(
          absl::StrCat("intent '", name.substr(0, 64), "' is not active on environment ", id));
    e.intents.erase(it);
    if (absl::Status st = CommitEgressLocked(e); !st.ok()) return st;
    return NetworkInfoLocked(e, now);
  }();
  audit_.Record(caller, {.environment_id = id,
                         .action = "network.intent.deactivate",
                         .detail = name.substr(0, 64),
                         .duration_ms = MonotonicMs() - t0,
                         .outcome = result.status()});
  if (*step) {
    ApplyStepOutcome(**step, {.status = result.status()});
    RecordStepLocked(**env, std::move((*step)->rec));
  }
  return result;
}

absl::StatusOr<std::string> EnvironmentManager::CaCertificate(const Caller& caller,
                                                              const std::string& id) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (!(*env)->governed)
    return absl::NotFoundError(absl::StrCat(
        "environment ", id, " has network \"none\": it has no CA (only governed environments do)"));
  std::lock_guard<std::mutex> glock((*env)->egress_mu);
  if ((*env)->ca.cert_pem.empty())
    return absl::UnavailableError(
        absl::StrCat("environment ", id, ": its CA could not be restored"));
  return (*env)->ca.cert_pem;
}

absl::StatusOr<std::optional<EnvironmentManager::HostFetchEgress>>
EnvironmentManager::HostFetchEgressFor(const Caller& caller, const std::string& id) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  std::shared_ptr<LiveEnv> e = *env;
  if (!e->governed) return std::optional<HostFetchEgress>();
  HostFetchEgress out;
  {
    std::lock_guard<std::mutex> glock(e->egress_mu);
    if (e->ca.cert_pem.empty())
      return absl::UnavailableError(
          absl::StrCat("environment ", id, ": its CA could not be restored"));
    out.ca_cert_pem = e->ca.cert_pem;
  }
  // The driver and the instance outlive the install that uses this (it holds the LiveEnv).
  // The listener is made by esbd and accepted on by the proxy: only sockets of those two may
  // answer (not a sandbox process's, should one hold the port while the proxy is down).
  std::vector<uid_t> owners = {::geteuid()};
  if (options_.egress != nullptr)
    if (std::optional<uid_t> uid = options_.egress->ProxyUid()) owners.push_back(*uid);
  out.connect = [driver = e->driver, ref = e->ref, owners](std::chrono::milliseconds timeout) {
    return driver->ConnectEgressProxy(ref, timeout, owners);
  };
  out.check = [this, e](const std::string& scheme, const std::string& host, uint16_t port,
                        const std::string& path) -> absl::Status {
    governance::Decision d;
    std::vector<std::string> intent_names;
    {
      std::lock_guard<std::mutex> glock(e->egress_mu);
      const int64_t now = Now();
      std::vector<ActiveIntent> intents = EffectiveIntentsLocked(*e, now);
      d = governance::Decide(e->policy, intents, now, host, port);
      for (const ActiveIntent& i : intents) intent_names.push_back(i.name);
    }
    if (d.allowed) return absl::OkStatus();
    const std::string reason = absl::StrCat(
        "the environment's egress policy refuses ", host, ":", port, " (rule '", d.rule,
        "'): esbd's host cache holds the file, but the environment may not fetch it from there");
    EgressAuditRow row;
    row.tenant = e->tenant;
    row.environment_id = e->record.id;  // immutable
    row.intents = std::move(intent_names);
    row.method = "GET";
    row.scheme = scheme;
    row.host = host;
    row.port = port;
    row.path = path;
    row.status = 403;
    row.decision = EgressDecision::kBlocked;
    row.rule_ids = {d.rule};
    row.reason = reason;
    audit_.RecordEgress(row);
    return absl::PermissionDeniedError(reason);
  };
  return std::optional<HostFetchEgress>(std::move(out));
}

absl::StatusOr<std::unique_ptr<EnvironmentManager::CallIntent>> EnvironmentManager::BeginCallIntent(
    const Caller& caller, const std::string& id, const std::string& name, int64_t max_call_ms,
    const std::string& action) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  LiveEnv& e = **env;
  if (!e.governed) return NotGoverned(id);
  governance::IntentCatalogue catalogue = options_.egress_config.IntentsFor(caller.tenant);
  auto def = catalogue.find(name);
  if (def == catalogue.end())
    return absl::InvalidArgumentError(
        absl::StrCat("unknown intent '", name.substr(0, 64), "' in 'intent'"));
  {
    std::lock_guard<std::mutex> glock(e.egress_mu);
    const int64_t expires = Now() + std::max<int64_t>(max_call_ms, 0) + kCallIntentGraceMs;
    LiveEnv::CallScoped& call = e.call_intents[name];
    if (call.refs == 0) call.intent = ActiveIntent{name, def->second.allow, expires};
    call.intent.expires_ms = std::max(call.intent.expires_ms, expires);
    call.intent.allow = def->second.allow;
    ++call.refs;
    if (absl::Status st = CommitEgressLocked(e); !st.ok()) {
      if (--call.refs == 0) e.call_intents.erase(name);
      return st;
    }
  }
  std::unique_ptr<CallIntent> out(new CallIntent());
  out->manager_ = this;
  out->env_ = *env;
  out->caller_ = caller;
  out->name_ = name;
  out->action_ = action;
  out->start_ms_ = MonotonicMs();
  return out;
}

EnvironmentManager::CallIntent::~CallIntent() {
  if (manager_ != nullptr) manager_->EndCallIntent(*this);
}

void EnvironmentManager::EndCallIntent(CallIntent& call) {
  LiveEnv& e = *call.env_;
  absl::Status st;
  {
    std::lock_guard<std::mutex> glock(e.egress_mu);
    auto it = e.call_intents.find(call.name_);
    if (it != e.call_intents.end() && --it->second.refs <= 0) {
      e.call_intents.erase(it);
      // The push only: nothing of a call-scoped intent is stored.
      if (options_.egress != nullptr) {
        st = options_.egress->Update(e.record.id, e.policy, EffectiveIntentsLocked(e, Now()));
        if (!st.ok()) {
          metrics_->CountError("egress");
          LogError(absl::StrCat("environment ", e.record.id, ": removing call intent '", call.name_,
                                "' from the egress proxy failed (it expires by ",
                                "itself): ", st.ToString()));
        }
      }
    }
  }
  audit_.Record(call.caller_, {.environment_id = e.record.id,
                               .action = "network.intent.call",
                               .detail = absl::StrCat(call.name_, " for ", call.action_),
                               .duration_ms = MonotonicMs() - call.start_ms_,
                               .outcome = st});
}

}  // namespace esb
