// Egress governance routes (issue 12; docs/api.md "Network policy" and "Intents"): parse,
// call the core (EnvironmentManager), render.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "api/json_util.h"
#include "api/service.h"
#include "common/util.h"

namespace esb::api {

namespace json = boost::json;

namespace {

json::object RenderIntent(const IntentInfo& info, int64_t now_ms) {
  const governance::ActiveIntent& i = info.intent;
  json::array allow;
  for (const governance::HostRule& r : i.allow) allow.emplace_back(r.text);
  return json::object{{"intent", i.name},
                      {"allow", std::move(allow)},
                      {"scope", info.scope},
                      {"expires_at", FormatRfc3339(i.expires_ms)},
                      {"expires_in_seconds", std::max<int64_t>(0, (i.expires_ms - now_ms) / 1000)}};
}

json::object RenderNetwork(const std::string& id, const NetworkInfo& info) {
  json::object o{{"environment_id", id}};
  if (!info.governed) {
    o["network"] = "none";
    o["intents"] = json::array();
    return o;
  }
  o["network"] = governance::ToJson(info.policy);
  json::array intents;
  const int64_t now = NowUnixMs();
  for (const IntentInfo& i : info.intents) intents.push_back(RenderIntent(i, now));
  o["intents"] = std::move(intents);
  return o;
}

}  // namespace

absl::StatusOr<std::optional<governance::EgressPolicy>> ApiService::ParseNetwork(
    const json::value& value, const std::string& tenant) {
  if (value.is_string()) {
    if (value.as_string() == "none") return std::nullopt;
    return absl::InvalidArgumentError(
        "'network' must be \"none\" or a policy object {\"mode\": \"allowlist\"|\"open\"|"
        "\"blocked\", \"allow\": [...], \"deny\": [...], ...}");
  }
  if (!value.is_object())
    return absl::InvalidArgumentError("'network' must be \"none\" or a policy object");
  auto policy = governance::ParseEgressPolicy(value, manager_->DefaultEgressPolicy(tenant));
  if (!policy.ok()) return policy.status();
  return std::optional<governance::EgressPolicy>(*std::move(policy));
}

void ApiService::RegisterNetwork(
    const std::function<void(std::string, std::string_view, RouteFn)>& add) {
  add("GET", "/environments/{id}/network", [this](Request& req, const Caller& t) {
    const std::string id = req.Param("id");
    auto info = manager_->GetNetwork(t, id);
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(200, RenderNetwork(id, *info));
  });

  // Replaces the policy live (not a merge with the current one: the body is laid over the
  // tenant's default, as at create).
  add("PUT", "/environments/{id}/network", [this](Request& req, const Caller& t) {
    auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    const json::value* network = f.OptionalValue("network");
    if (!f.ok()) return f.ErrorResponse();
    if (network == nullptr || network->is_null())
      return ErrorResponse(400, "bad_request",
                           "'network' is required: \"none\" or a policy object");
    auto policy = ParseNetwork(*network, t.tenant);
    if (!policy.ok()) return ErrorResponse(400, "bad_request", StdView(policy.status().message()));
    const std::string id = req.Param("id");
    auto info = manager_->SetNetwork(t, id, *policy ? &**policy : nullptr);
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(200, RenderNetwork(id, *info));
  });

  add("POST", "/environments/{id}/intents", [this](Request& req, const Caller& t) {
    auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    std::string name = f.RequiredString("intent");
    int64_t ttl = f.OptionalInt("ttl_seconds", governance::kDefaultIntentTtlSeconds, 1,
                                governance::kMaxIntentTtlSeconds);
    if (!f.ok()) return f.ErrorResponse();
    if (absl::Status st = governance::ValidateIntentName(name); !st.ok())
      return ErrorResponse(400, "bad_request", absl::StrCat("'intent': ", st.message()));
    const std::string id = req.Param("id");
    auto info = manager_->ActivateIntent(t, id, name, ttl);
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(200, RenderNetwork(id, *info));
  });

  add("GET", "/environments/{id}/intents", [this](Request& req, const Caller& t) {
    const std::string id = req.Param("id");
    auto info = manager_->GetNetwork(t, id);
    if (!info.ok()) return StatusResponse(info.status());
    json::object o = RenderNetwork(id, *info);
    o.erase("network");
    // What may be activated: the tenant's catalogue.
    json::array available;
    for (const auto& [name, def] : manager_->options().egress_config.IntentsFor(t.tenant)) {
      json::array allow;
      for (const governance::HostRule& r : def.allow) allow.emplace_back(r.text);
      json::object d{
          {"intent", name}, {"allow", std::move(allow)}, {"max_ttl_seconds", def.max_ttl_seconds}};
      if (!def.description.empty()) d["description"] = def.description;
      available.push_back(std::move(d));
    }
    o["available"] = std::move(available);
    return JsonResponse(200, o);
  });

  add("DELETE", "/environments/{id}/intents/{name}", [this](Request& req, const Caller& t) {
    const std::string id = req.Param("id");
    const std::string name = req.Param("name");
    if (absl::Status st = governance::ValidateIntentName(name); !st.ok())
      return ErrorResponse(400, "bad_request", StdView(st.message()));
    auto info = manager_->DeactivateIntent(t, id, name);
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(200, RenderNetwork(id, *info));
  });

  add("GET", "/environments/{id}/ca.pem", [this](Request& req, const Caller& t) {
    auto pem = manager_->CaCertificate(t, req.Param("id"));
    if (!pem.ok()) return StatusResponse(pem.status());
    Response resp = Response::Text(200, *std::move(pem), "application/x-pem-file");
    resp.SetHeader("X-Content-Type-Options", "nosniff");
    return resp;
  });
}

}  // namespace esb::api
