#include "api/service.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "api/host_check.h"
#include "api/json_util.h"
#include "api/report_render.h"
#include "api/sse_output.h"
#include "api/tools_catalog.h"
#include "common/util.h"
#include "core/audit.h"
#include "core/egress_report.h"
#include "drivers/env_limits.h"
#include "storage/sqlite_store.h"

namespace esb::api {
namespace json = boost::json;
namespace {

constexpr int64_t kChunk = 4 << 20;  // bytes per agent round trip for file transfers
// Bytes per write of a download (files/raw, artifacts): what one slow reader holds at a time.
constexpr int64_t kDownloadChunk = 256 << 10;
// Bytes of an upload read from the socket at a time (the agent gets up to kChunk per write).
constexpr size_t kUploadReadChunk = 64 << 10;

// Bytes `s` takes as a JSON string body (without quotes), as boost::json writes it: control
// characters other than \b \f \n \r \t become \u00XX, six bytes for one.
uint64_t JsonEscapedSize(std::string_view s) {
  uint64_t n = 0;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\' || c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t')
      n += 2;
    else if (c < 0x20)
      n += 6;
    else
      n += 1;
  }
  return n;
}

json::value Time(int64_t ms) { return ms > 0 ? json::value(FormatRfc3339(ms)) : json::value(); }

// Paths reach the sandbox as text; keep them sane before they cross the boundary.
absl::Status CheckPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("'path' must not be empty");
  if (path.size() > 4096) return absl::InvalidArgumentError("'path' is longer than 4096 bytes");
  if (path.find('\0') != std::string::npos)
    return absl::InvalidArgumentError("'path' must not contain NUL bytes");
  if (!IsValidUtf8(path)) return absl::InvalidArgumentError("'path' must be valid UTF-8");
  return absl::OkStatus();
}

std::string_view RuntimeAlias(std::string_view runtime) {
  if (runtime == "heavy") return "container";
  return runtime;
}

// A path the files API creates or moves something to (mkdir, remove, rename): CheckPath's rules,
// and no control characters (names an agent could not show or type back).
absl::Status CheckNewPath(std::string_view field, const std::string& path) {
  absl::Status st = CheckPath(path);
  if (st.ok()) {
    for (unsigned char c : path) {
      if (c < 0x20 || c == 0x7f) {
        st = absl::InvalidArgumentError("'path' must not contain control characters");
        break;
      }
    }
  }
  std::string_view message = StdView(st.message());
  if (st.ok() || field == "path" || !message.starts_with("'path'")) return st;
  // CheckPath names the field 'path'; say which one it was.
  return absl::InvalidArgumentError(
      absl::StrCat("'", AbslView(field), "'", AbslView(message.substr(6))));
}

// A directory entry as files/list and files/stat show it.
json::object RenderEntry(const FileEntry& e) {
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", e.mode & 07777);
  return json::object{{"name", SanitizeUtf8(e.name)},
                      {"type", e.type},
                      {"size", e.size},
                      {"mode", mode},
                      {"mtime", FormatRfc3339(e.mtime_ms)}};
}

// The error answer of files/stat, mkdir, remove and rename: a non-empty directory (ENOTEMPTY,
// FailedPrecondition) is a conflict like an existing destination.
Response FileOpResponse(const absl::Status& st) {
  if (absl::IsFailedPrecondition(st)) return ErrorResponse(409, "conflict", StdView(st.message()));
  return FileStatusResponse(st);
}

json::object ResultJson(const ExecResult& r) {
  return json::object{{"error", r.exit_code != 0},
                      {"stdout", SanitizeUtf8(r.stdout_data)},
                      {"stderr", SanitizeUtf8(r.stderr_data)},
                      {"exit_code", r.exit_code},
                      {"duration_ms", r.duration_ms},
                      {"timed_out", r.timed_out},
                      {"truncated", r.truncated}};
}

// SECURITY: dev mode has no keys, so "who may call" is "who can reach loopback". A browser on
// this machine can, on behalf of any web page: through DNS rebinding (a page's own name resolved
// to 127.0.0.1: its requests carry that name in Host) or as a cross-site request (Origin is the
// other site). Only requests naming this machine in Host, and coming from a loopback page if
// they carry an Origin, are served.
absl::Status CheckDevModeBrowserRequest(const Request& req) {
  // Every Host and Origin header is checked: a repeated one must not hide behind a good first.
  for (const auto& [name, value] : req.headers()) {
    std::string_view v = TrimAscii(value);
    if (EqualsIgnoreCase(name, "host") && !IsLoopbackHostPort(v)) {
      return absl::PermissionDeniedError(
          Cat("requests served without an API key (dev mode, loopback /metrics) must be "
              "addressed to localhost, 127.0.0.1 or [::1]; Host '",
              v.substr(0, 200), "' is refused (DNS rebinding protection)"));
    }
    if (EqualsIgnoreCase(name, "origin")) {
      if (!IsLoopbackOrigin(v)) {
        return absl::PermissionDeniedError(
            Cat("requests served without an API key (dev mode, loopback /metrics) refuse "
                "cross-site browser requests: Origin '",
                v.substr(0, 200), "' is not a page on this machine"));
      }
    }
  }
  return absl::OkStatus();
}

json::object RenderVolume(const VolumeInfo& v) {
  return json::object{
      {"name", v.record.name},
      {"size_mb", v.record.size_mb},
      {"created_at", FormatRfc3339(v.record.created_ms)},
      {"mounted_by", v.mounted_by.empty() ? json::value() : json::value(v.mounted_by)}};
}

}  // namespace

Response FileStatusResponse(const absl::Status& st) {
  switch (st.code()) {
    case absl::StatusCode::kPermissionDenied:
      return ErrorResponse(403, "forbidden", StdView(st.message()));
    case absl::StatusCode::kResourceExhausted:
      return ErrorResponse(507, "insufficient_storage", StdView(st.message()));
    default:
      return StatusResponse(st);
  }
}

ApiService::ApiService(EnvironmentManager* manager, Store* store, Metrics* metrics,
                       ServiceOptions options)
    : manager_(manager), store_(store), metrics_(metrics), options_(std::move(options)) {}

absl::StatusOr<std::string> ApiService::Authenticate(const Request& req) {
  auto active = store_->CountActiveApiKeys();
  if (!active.ok()) return active.status();
  if (*active == 0) {
    // SECURITY: dev mode (no keys) serves only this machine's users, and not web pages their
    // browsers load (browsers speak TCP only, so the unix socket needs no such check).
    if (req.peer().is_unix) return std::string("default");
    if (!req.peer().is_loopback) {
      return absl::UnauthenticatedError(
          "no API keys are configured (dev mode): only loopback clients are served");
    }
    if (absl::Status st = CheckDevModeBrowserRequest(req); !st.ok()) return st;
    return std::string("default");
  }
  auto token = BearerToken(req);
  if (!token) return absl::UnauthenticatedError("missing 'Authorization: Bearer <api-key>'");
  auto key = store_->KeyForSecret(*token);
  if (!key.ok()) return absl::UnauthenticatedError("invalid or revoked API key");
  {
    // The key's public id, for CallerOf (the audit's principal). Bounded: a flood of distinct
    // valid keys only empties it.
    std::lock_guard<std::mutex> lock(key_ids_mu_);
    if (key_ids_.size() >= 4096) key_ids_.clear();
    key_ids_[Sha256Hex(*token)] = key->key_id;
  }
  return key->tenant;
}

Caller ApiService::CallerOf(const Request& req) {
  std::optional<std::string> token = BearerToken(req);
  std::string principal = "dev";  // no keys configured: loopback / unix socket only
  if (token) {
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(key_ids_mu_);
      auto it = key_ids_.find(Sha256Hex(*token));
      if (it != key_ids_.end()) principal = it->second, found = true;
    }
    // Not cached: dev mode ignores tokens; else the cache was just emptied.
    if (!found && store_->CountActiveApiKeys().value_or(1) > 0) principal = "api_key";
  }
  return Caller(req.principal(), std::move(principal), "rest");
}

json::object ApiService::RenderEnvironment(const EnvironmentInfo& info, bool with_usage) {
  const EnvironmentRecord& r = info.record;
  json::object o{
      {"environment_id", r.id},
      {"state", std::string(ToString(r.state))},
      {"runtime", r.runtime},
      {"image", r.image},
      {"limits", json::object{{"cpu", info.spec.cpu},
                              {"memory_mb", info.spec.memory_mb},
                              {"pids", info.spec.pids},
                              {"disk_mb", info.spec.disk_mb}}},
      {"network", info.egress ? json::value(governance::ToDisplayJson(*info.egress))
                              : json::value(NetworkPolicyName(info.spec.network))},
      {"ttl_seconds", info.ttl_s},
      {"created_at", Time(r.created_ms)},
      {"last_used_at", Time(r.last_used_ms)},
      {"expires_at", r.state == EnvState::kRunning ? Time(r.expires_ms) : json::value()},
      {"destroyed_at", Time(r.destroyed_ms)},
      {"destroy_reason", r.destroy_reason.empty() ? json::value() : json::value(r.destroy_reason)},
  };
  json::array env_keys;
  for (const auto& [k, v] : info.spec.env) env_keys.push_back(json::value(k));
  o["env_keys"] = std::move(env_keys);
  json::array volumes;
  for (const VolumeMount& v : info.spec.volumes) {
    volumes.push_back(json::object{{"name", v.name}, {"path", v.path}, {"read_only", v.read_only}});
  }
  o["volumes"] = std::move(volumes);
  if (r.state == EnvState::kRunning) o["steps"] = RenderStepsStatus(info.steps);
  if (with_usage) {
    json::object usage{{"exec_count", r.exec_count}};
    if (r.state == EnvState::kRunning) {
      auto u = manager_->Stats(Caller(r.tenant), r.id);
      if (u.ok()) {
        usage["memory_bytes"] = u->memory_bytes;
        usage["cpu_ms"] = u->cpu_ms;
        usage["pids"] = u->pids;
      }
    }
    o["usage"] = std::move(usage);
  }
  return o;
}

std::optional<Response> ApiService::Admit(Request& req, bool json_body) {
  auto tenant = Authenticate(req);
  if (!tenant.ok()) {
    if (absl::IsPermissionDenied(tenant.status()))
      return ErrorResponse(403, "forbidden", StdView(tenant.status().message()));
    return StatusResponse(tenant.status());
  }
  if (json_body) {
    if (std::optional<Response> bad = CheckJsonContentType(req)) return bad;
  }
  req.principal_ = *tenant;
  return std::nullopt;
}

void ApiService::Register(Router& router) {
  // Authenticated routes. The server admits the request on its header (RouteOptions::
  // before_body) before reading any body, so an unauthenticated client never gets a body
  // buffered; POST bodies must be JSON (CheckJsonContentType).
  auto add = [this, &router](std::string method, std::string_view pattern, auto fn,
                             RouteOptions opts = {}) {
    const bool json_body = (method == "POST" || method == "PUT") && !opts.stream_body;
    opts.accepts_body = json_body || opts.stream_body;  // the others answer a body with 413
    opts.before_body = [this, json_body](Request& req) { return Admit(req, json_body); };
    router.Add(
        std::move(method), pattern,
        [this, fn, json_body](Request& req) -> Response {
          if (req.principal().empty()) {  // called without the server's admission step
            if (std::optional<Response> refused = Admit(req, json_body)) return *refused;
          }
          return fn(req, CallerOf(req));
        },
        std::move(opts));
  };

  router.Add("GET", "/healthz", [this](Request&) {
    json::object drivers;
    json::object unavailable;
    if (options_.drivers) {
      for (const DriverRegistry::Entry& e : options_.drivers->entries()) {
        if (e.driver)
          drivers[e.name] = e.description;
        else
          unavailable[e.name] = e.unavailable;
      }
    }
    json::object userns;
    for (const auto& [name, st] : options_.userns) {
      userns[name] = json::object{{"enabled", st.first}, {"reason", st.second}};
    }
    json::object health = {{"status", "ok"},
                           {"version", ESB_VERSION},
                           {"drivers", std::move(drivers)},
                           {"unavailable", std::move(unavailable)},
                           {"userns", std::move(userns)},
                           {"pool_ready", manager_->PoolReady()}};
    if (options_.egress != nullptr) {
      // The egress proxy (docs/design.md "Governed networks"): while it is down, governed
      // sandboxes' egress fails closed; esbd restarts it.
      const EgressHealth e = options_.egress->Health();
      health["egress"] =
          json::object{{"state", e.state},
                       {"detail", e.detail},
                       {"pid", e.pid},
                       {"restarts", e.restarts},
                       {"since", e.since_ms > 0 ? FormatRfc3339(e.since_ms) : ""},
                       {"environments", e.environments},
                       {"attached", e.attached},
                       {"connections", e.connections},
                       {"requests_total", e.requests_total},
                       {"blocked_total", e.blocked_total},
                       {"refused", json::object{{"connections", e.refused_connections},
                                                {"body_budget", e.refused_body_budget},
                                                {"dlp_busy", e.refused_dlp_busy},
                                                {"resolve_busy", e.refused_resolve_busy}}},
                       {"audit_dropped", e.audit_dropped}};
    }
    return JsonResponse(200, std::move(health));
  });

  router.Add("GET", "/metrics", [this](Request& req) {
    if (!req.peer().is_loopback && !req.peer().is_unix) {
      auto tenant = Authenticate(req);
      if (!tenant.ok()) return StatusResponse(tenant.status());
    } else if (req.peer().is_loopback) {
      // Served without a key on loopback, so not to web pages (see CheckDevModeBrowserRequest).
      if (absl::Status st = CheckDevModeBrowserRequest(req); !st.ok())
        return ErrorResponse(403, "forbidden", StdView(st.message()));
    }
    return Response::Text(200, metrics_->Render(manager_->StateCounts(), manager_->PoolReady()),
                          "text/plain; version=0.0.4");
  });

  router.Add("GET", "/tools", [](Request&) { return JsonResponse(200, ToolsCatalog()); });

  add("POST", "/environments",
      [this](Request& req, const Caller& t) { return CreateEnvironment(req, t); });

  add("GET", "/environments", [this](Request& req, const Caller& t) {
    std::string all = req.Query("all").value_or("0");
    auto list = manager_->List(t, all == "1" || all == "true");
    if (!list.ok()) return StatusResponse(list.status());
    json::array arr;
    for (const auto& info : *list) arr.push_back(RenderEnvironment(info, false));
    return JsonResponse(200, json::object{{"environments", std::move(arr)}});
  });

  add("POST", "/volumes", [this](Request& req, const Caller& t) {
    auto body = ParseJsonObjectBody(req);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    std::string name = f.RequiredString("name");
    int64_t size_mb = f.RequiredInt("size_mb", 1, int64_t{1} << 30);
    if (!f.ok()) return f.ErrorResponse();
    auto rec = manager_->CreateVolume(t, name, size_mb);
    if (!rec.ok()) return StatusResponse(rec.status());
    return JsonResponse(201, RenderVolume(VolumeInfo{*rec, ""}));
  });
  add("GET", "/volumes", [this](Request&, const Caller& t) {
    auto list = manager_->ListVolumes(t);
    if (!list.ok()) return StatusResponse(list.status());
    json::array arr;
    for (const VolumeInfo& v : *list) arr.push_back(RenderVolume(v));
    return JsonResponse(200, json::object{{"volumes", std::move(arr)}});
  });
  add("DELETE", "/volumes/{name}", [this](Request& req, const Caller& t) {
    absl::Status st = manager_->DeleteVolume(t, req.Param("name"));
    if (!st.ok()) return StatusResponse(st);
    return JsonResponse(200, json::object{{"error", false}, {"message", "Volume deleted."}});
  });

  add("GET", "/environments/{id}", [this](Request& req, const Caller& t) {
    auto info = manager_->Get(t, req.Param("id"));
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(200, RenderEnvironment(*info, true));
  });

  add("DELETE", "/environments/{id}", [this](Request& req, const Caller& t) {
    absl::Status st = manager_->Destroy(t, req.Param("id"), "deleted");
    return st.ok() ? JsonResponse(
                         200, json::object{{"error", false}, {"message", "Environment destroyed."}})
                   : StatusResponse(st);
  });

  add("POST", "/environments/{id}/heartbeat", [this](Request& req, const Caller& t) {
    auto body = ParseJsonObjectBody(req);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    int64_t ttl = f.OptionalInt("ttl_seconds", 0, 10, 86400);
    if (!f.ok()) return f.ErrorResponse();
    auto expires = manager_->Heartbeat(t, req.Param("id"), ttl);
    if (!expires.ok()) return StatusResponse(expires.status());
    return JsonResponse(200,
                        json::object{{"error", false}, {"expires_at", FormatRfc3339(*expires)}});
  });

  add("POST", "/environments/{id}/execute",
      [this](Request& req, const Caller& t) { return Execute(req, t); });
  add("POST", "/environments/{id}/files/write",
      [this](Request& req, const Caller& t) { return WriteFile(req, t); });
  add("GET", "/environments/{id}/files/read",
      [this](Request& req, const Caller& t) { return ReadFile(req, t); });
  RouteOptions upload;
  upload.stream_body = true;
  upload.max_stream_body_bytes = static_cast<uint64_t>(options_.max_upload_bytes);
  add(
      "PUT", "/environments/{id}/files/raw",
      [this](Request& req, const Caller& t) { return PutRaw(req, t); }, upload);
  add("GET", "/environments/{id}/files/raw",
      [this](Request& req, const Caller& t) { return GetRaw(req, t); });
  add("GET", "/environments/{id}/files/list",
      [this](Request& req, const Caller& t) { return ListFiles(req, t); });
  add("GET", "/environments/{id}/files/stat",
      [this](Request& req, const Caller& t) { return StatFile(req, t); });
  add("POST", "/environments/{id}/files/mkdir",
      [this](Request& req, const Caller& t) { return MakeDir(req, t); });
  add("POST", "/environments/{id}/files/remove",
      [this](Request& req, const Caller& t) { return RemoveFile(req, t); });
  add("POST", "/environments/{id}/files/rename",
      [this](Request& req, const Caller& t) { return RenameFile(req, t); });
  add("GET", "/environments/{id}/artifacts",
      [this](Request& req, const Caller& t) { return ListArtifacts(req, t); });
  add("GET", "/environments/{id}/artifacts/{aid}",
      [this](Request& req, const Caller& t) { return GetArtifact(req, t); });
  add("GET", "/audit", [this](Request& req, const Caller& t) { return QueryAudit(req, t); });
  add("GET", "/reports", [this](Request& req, const Caller& t) { return GetReport(req, t); });

  auto run = [this](Request& req, const Caller& t) -> Response {
    if (!run_handler_)
      return ErrorResponse(400, "bad_request",
                           "POST /run needs the nano tier, which is not available on this "
                           "daemon (see GET /healthz 'unavailable')");
    return run_handler_(t, req.Param("id"), req);
  };
  add("POST", "/run", run);
  add("POST", "/environments/{id}/run", run);
  RegisterNetwork([&add](std::string method, std::string_view pattern, RouteFn fn) {
    add(std::move(method), pattern, std::move(fn));
  });
  RegisterTerminal([&add](std::string method, std::string_view pattern, RouteFn fn) {
    add(std::move(method), pattern, std::move(fn));
  });
  RegisterSteps([&add](std::string method, std::string_view pattern, RouteFn fn) {
    add(std::move(method), pattern, std::move(fn));
  });
  RegisterMcpServers([&add](std::string method, std::string_view pattern, RouteFn fn) {
    add(std::move(method), pattern, std::move(fn));
  });
}

json::object RenderArtifact(const ArtifactMeta& m) {
  return json::object{
      {"id", m.id},
      {"kind", m.kind},
      {"name", m.name},
      {"mime_type", m.mime_type},
      {"size", m.size},
      {"title", m.title.empty() ? json::value(nullptr) : json::value(m.title)},
      {"step", m.step},
      {"environment_id", m.environment_id},
      {"created_at", FormatRfc3339(m.created_ms)},
      {"url", absl::StrCat("/environments/", m.environment_id, "/artifacts/", m.id)}};
}

// Artifacts outlive their environment (one-shot runs destroy theirs at once), so these two
// look only at the store, which is scoped by tenant like everything else.
Response ApiService::ListArtifacts(Request& req, const Caller& caller) {
  const std::string& tenant = caller.tenant;
  const std::string id = req.Param("id");
  if (!artifacts_) return ErrorResponse(404, "not_found", "this daemon keeps no artifacts");
  artifacts_->MaybeSweep();
  json::array arr;
  for (const ArtifactMeta& m : artifacts_->List(tenant, id)) arr.push_back(RenderArtifact(m));
  if (arr.empty() && !manager_->Get(tenant, id).ok())
    return ErrorResponse(404, "not_found", absl::StrCat("environment ", id, " not found"));
  return JsonResponse(200, json::object{{"artifacts", std::move(arr)}});
}

Response ApiService::GetArtifact(Request& req, const Caller& caller) {
  const std::string& tenant = caller.tenant;
  if (!artifacts_) return ErrorResponse(404, "not_found", "this daemon keeps no artifacts");
  artifacts_->MaybeSweep();
  const std::string id = req.Param("id"), aid = req.Param("aid");
  auto meta = artifacts_->Get(tenant, id, aid);
  if (!meta.ok()) return StatusResponse(meta.status());
  auto file = artifacts_->Open(tenant, id, aid);
  if (!file.ok()) return StatusResponse(file.status());
  // Streamed from disk in small chunks: a slow reader holds one chunk, never the artifact.
  Response resp = Response::Stream(
      200, meta->mime_type,
      [fd = std::make_shared<UniqueFd>(std::move(*file))](ResponseWriter& w) {
        std::string buf(kDownloadChunk, '\0');
        for (off_t offset = 0;;) {
          ssize_t n = pread(fd->get(), buf.data(), buf.size(), offset);
          if (n < 0 && errno == EINTR) continue;
          // A read error ends the body without its terminating chunk: the client sees a
          // failed transfer, not a short artifact.
          if (n < 0) throw std::runtime_error(absl::StrCat("reading artifact: ", strerror(errno)));
          if (n == 0 || !w.Write(std::string_view(buf.data(), static_cast<size_t>(n)))) break;
          offset += n;
        }
      });
  resp.SetHeader("X-File-Size", std::to_string(meta->size));
  // The bytes are whatever the sandboxed code wrote: never let a browser run them (an SVG
  // or HTML artifact could carry script) or guess another type; only raster images inline.
  resp.SetHeader("X-Content-Type-Options", "nosniff");
  resp.SetHeader("Content-Security-Policy", "sandbox; default-src 'none'; style-src 'unsafe-inline'");
  static const std::set<std::string> kInline = {"image/png", "image/jpeg", "image/gif",
                                                 "image/webp"};
  if (!kInline.count(meta->mime_type)) {
    std::string name;
    for (char c : meta->name.substr(meta->name.rfind('/') + 1))
      name += (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) ? '_' : c;
    resp.SetHeader("Content-Disposition", absl::StrCat("attachment; filename=\"", name, "\""));
  }
  return resp;
}

Response ApiService::CreateEnvironment(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req);
  if (!body.ok()) return body.error();
  auto info = CreateEnvironmentFrom(body.value(), caller);
  if (!info.ok()) return StatusResponse(info.status());
  json::object o = RenderEnvironment(*info, false);
  o["pooled"] = info->pooled;
  return JsonResponse(201, o);
}

absl::StatusOr<EnvironmentInfo> ApiService::CreateEnvironmentFrom(const json::object& body,
                                                                  const Caller& caller) {
  JsonFields f(body);
  const EnvSpec& d = manager_->options().default_spec;
  EnvSpec spec = d;
  spec.image = f.OptionalString("image", d.image);
  std::string runtime = f.OptionalEnum("runtime", "container",
                                       {"auto", "container", "heavy", "gvisor", "nano", "microvm"});
  // The one limit table (drivers/env_limits.h): the driver refuses the same ranges.
  const EnvLimitTable limits = EnvLimits(options_.limits);
  auto int_limit = [&](const LimitRange& r, int64_t dflt) {
    return f.OptionalInt(r.field, dflt, static_cast<int64_t>(r.min), static_cast<int64_t>(r.max));
  };
  spec.cpu = f.OptionalDouble("cpu", d.cpu, limits.cpu.min, limits.cpu.max);
  spec.memory_mb = int_limit(limits.memory_mb, d.memory_mb);
  spec.pids = int_limit(limits.pids, d.pids);
  spec.disk_mb = int_limit(limits.disk_mb, d.disk_mb);
  int64_t ttl = f.OptionalInt("ttl_seconds", 0, 10, 86400);
  spec.env = f.OptionalStringMap("env", 256);
  // "none" or a policy object (laid over the tenant's default: the core's config).
  std::optional<governance::EgressPolicy> egress;
  if (const json::value* network = f.OptionalValue("network"); network && !network->is_null()) {
    auto parsed = ParseNetwork(*network, caller.tenant);
    if (parsed.ok())
      egress = *std::move(parsed);
    else
      f.Fail(std::string(parsed.status().message()));
  }
  std::optional<StepSettings> steps;
  if (const json::value* v = f.OptionalValue("steps"); v && !v->is_null()) {
    auto parsed = ParseStepSettings(*v);
    if (parsed.ok())
      steps = *parsed;
    else
      f.Fail(std::string(parsed.status().message()));
  }
  if (const json::value* vols = f.OptionalValue("volumes"); vols && !vols->is_null()) {
    // Shape only here; names, paths and ownership are the core's (ClaimVolumes).
    if (!vols->is_array() || vols->as_array().size() > 64) {
      f.Fail("'volumes' must be an array of at most 64 {name, path, read_only} objects");
    } else {
      for (const json::value& item : vols->as_array()) {
        if (!item.is_object()) {
          f.Fail("'volumes' entries must be objects {name, path, read_only}");
          break;
        }
        JsonFields vf(item.as_object());
        VolumeMount m;
        m.name = vf.RequiredString("name");
        m.path = vf.RequiredString("path");
        m.read_only = vf.OptionalBool("read_only", false);
        if (!vf.ok()) {
          f.Fail(absl::StrCat("volumes: ", vf.error()));
          break;
        }
        spec.volumes.push_back(std::move(m));
      }
    }
  }
  if (!f.ok()) return absl::InvalidArgumentError(f.error());
  for (const auto& [k, v] : spec.env) {
    bool valid = !k.empty() && k.size() <= 256 && !(k[0] >= '0' && k[0] <= '9');
    for (char c : k) valid = valid && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
    if (!valid)
      return absl::InvalidArgumentError(
          absl::StrCat("env: '", k, "' is not a valid variable name"));
    if (v.size() > 32768 || v.find('\0') != std::string::npos)
      return absl::InvalidArgumentError(
          absl::StrCat("env: value of '", k, "' is too long or contains NUL"));
  }
  if (runtime == "auto") runtime = "container";  // the adaptive router arrives with the nano tier
  // Every name the enum above accepts (after the alias) is a DriverKind.
  spec.runtime = *ParseDriverKind(RuntimeAlias(runtime));
  const DriverRegistry::Entry* driver =
      options_.drivers ? options_.drivers->Lookup(ToString(spec.runtime)) : nullptr;
  if (!driver || !driver->driver || !manager_->HasDriver(spec.runtime)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "runtime '", runtime, "' is not available on this host",
        driver && !driver->unavailable.empty() ? absl::StrCat(": ", driver->unavailable) : ""));
  }
  // Heavy tiers boot a rootfs image; the nano tier has its interpreter built in.
  if (driver->tier == DriverRegistry::Tier::kHeavy && !options_.images.count(spec.image))
    return absl::InvalidArgumentError(absl::StrCat("unknown image '", spec.image, "'"));
  return manager_->Create(caller, spec, ttl, egress ? &*egress : nullptr,
                          steps ? &*steps : nullptr);
}

Response ApiService::Execute(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  ExecRequest exec;
  exec.command = f.RequiredString("command");
  exec.timeout = std::chrono::seconds(f.OptionalInt("timeout_seconds", 60, 1, 3600));
  exec.env = f.OptionalStringMap("env", 256);
  // An intent active for this call only (docs/api.md "Intents").
  std::string intent = f.OptionalString("intent", "");
  if (!f.ok()) return f.ErrorResponse();
  if (absl::Status st = intent.empty() ? absl::OkStatus() : governance::ValidateIntentName(intent);
      !st.ok())
    return ErrorResponse(400, "bad_request", absl::StrCat("'intent': ", st.message()));
  if (exec.command.empty()) return ErrorResponse(400, "bad_request", "'command' is empty");
  if (exec.command.size() > (1 << 20))
    return ErrorResponse(413, "payload_too_large", "'command' is longer than 1 MiB");
  if (exec.command.find('\0') != std::string::npos)
    return ErrorResponse(400, "bad_request", "'command' must not contain NUL bytes");
  exec.max_output_bytes = options_.max_output_bytes;
  std::string id = req.Param("id");

  if (req.Accepts("text/event-stream")) {
    // Check existence first so a bad id is a plain 404, not a stream with an error event.
    auto info = manager_->Get(caller, id);
    if (!info.ok() || info->record.state != EnvState::kRunning)
      return StatusResponse(
          info.ok() ? absl::NotFoundError(absl::StrCat("environment ", id, " is ",
                                                       AbslView(ToString(info->record.state))))
                    : info.status());
    return Response::Sse([this, caller, id, exec, intent](ResponseWriter& w) {
      SseOutput out(w);
      auto result = manager_->Exec(caller, id, exec, out.Sink(), intent);
      if (!result.ok()) {
        Response err = StatusResponse(result.status());
        w.WriteEvent("error",
                     ErrorBody(ErrorCodeForStatus(err.status), StdView(result.status().message())));
        return;
      }
      out.Flush();
      w.WriteEvent("result", ResultJson(*result));
    });
  }

  // Non-streaming: still notice a client that went away, and kill its command.
  auto sink = [&req](Stream, std::string_view) { return !req.ClientGone(); };
  auto result = manager_->Exec(caller, id, exec, sink, intent);
  if (!result.ok()) return StatusResponse(result.status());
  return JsonResponse(200, ResultJson(*result));
}

Response ApiService::WriteFile(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  std::string path = f.RequiredString("path");
  std::string content = f.RequiredString("content");
  std::string encoding = f.OptionalEnum("encoding", "utf-8", {"utf-8", "utf8", "base64"});
  if (!f.ok()) return f.ErrorResponse();
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  std::string data;
  if (encoding == "base64") {
    auto decoded = Base64Decode(content);
    if (!decoded.ok())
      return ErrorResponse(400, "bad_request",
                           absl::StrCat("'content' is not valid base64: ",
                                        decoded.status().message()));
    data = std::move(*decoded);
  } else {
    data = std::move(content);
  }
  // One audited write, however many agent round trips it takes.
  auto transfer = manager_->OpenTransfer(caller, req.Param("id"), path, "files.write");
  if (!transfer.ok()) return FileStatusResponse(transfer.status());
  absl::Status st;
  int64_t offset = 0;
  do {
    std::string_view part = std::string_view(data).substr(offset, kChunk);
    st = (*transfer)->Write(part, offset, offset == 0);
    offset += static_cast<int64_t>(part.size());
  } while (st.ok() && offset < static_cast<int64_t>(data.size()));
  return st.ok() ? JsonResponse(200, json::object{{"error", false},
                                                  {"message", "File saved successfully."},
                                                  {"bytes", data.size()}})
                 : FileStatusResponse(st);
}

bool ApiService::ReserveRead(const std::string& tenant, int64_t bytes, bool* over_share) {
  std::lock_guard<std::mutex> lock(read_mu_);
  const int64_t total = 4 * options_.max_json_read_bytes, share = 2 * options_.max_json_read_bytes;
  int64_t& mine = tenant_reads_[tenant];
  *over_share = mine + bytes > share;
  if (*over_share || reads_in_flight_ + bytes > total) {
    if (mine == 0) tenant_reads_.erase(tenant);
    return false;
  }
  mine += bytes;
  reads_in_flight_ += bytes;
  return true;
}

void ApiService::ReleaseRead(const std::string& tenant, int64_t bytes) {
  std::lock_guard<std::mutex> lock(read_mu_);
  reads_in_flight_ -= bytes;
  auto it = tenant_reads_.find(tenant);
  if (it != tenant_reads_.end() && (it->second -= bytes) <= 0) tenant_reads_.erase(it);
}

Response ApiService::ReadFile(Request& req, const Caller& caller) {
  const std::string& tenant = caller.tenant;
  std::string path = req.Query("path").value_or("");
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  std::string id = req.Param("id");
  std::string data;
  absl::Status st;
  int64_t size = 0;
  int64_t reserved = 0;  // of the files/read memory bound (ReserveRead)
  struct Unreserve {
    ApiService* self;
    const std::string& tenant;
    int64_t& bytes;
    ~Unreserve() {
      if (bytes > 0) self->ReleaseRead(tenant, bytes);
    }
  } unreserve{this, tenant, reserved};
  // One audited read, however many agent round trips it takes (the row is written when
  // `transfer` goes, after the answer is built).
  auto transfer = manager_->OpenTransfer(caller, id, path, "files.read");
  if (!transfer.ok()) st = transfer.status();
  for (; transfer.ok();) {
    auto chunk = (*transfer)->Read(static_cast<int64_t>(data.size()), kChunk);
    if (!chunk.ok()) {
      st = chunk.status();
      break;
    }
    size = chunk->file_size;
    if (size > options_.max_json_read_bytes) {
      st = absl::OutOfRangeError(absl::StrCat(
          "file is ", size, " bytes, more than files/read returns (", options_.max_json_read_bytes,
          "); use files/raw for large or binary files"));
      break;
    }
    if (reserved == 0 && size > kChunk) {
      bool over_share = false;
      if (!ReserveRead(tenant, size, &over_share)) {
        Response busy = ErrorResponse(over_share ? 429 : 503,
                                      over_share ? "too_many_requests" : "unavailable",
                                      "too many large files are being read at once; retry "
                                      "shortly, or use files/raw");
        busy.SetHeader("Retry-After", "1");
        (*transfer)->Finish(absl::ResourceExhaustedError("too many large files read at once"));
        return busy;
      }
      reserved = size;
      data.reserve(static_cast<size_t>(size));
    }
    data += chunk->data;
    if (chunk->eof || chunk->data.empty()) break;
    if (static_cast<int64_t>(data.size()) > options_.max_json_read_bytes) {
      st = absl::OutOfRangeError("file grew beyond the files/read limit; use files/raw");
      break;
    }
  }
  Response resp;
  if (!st.ok()) {
    if (absl::IsOutOfRange(st)) {
      resp = ErrorResponse(413, "payload_too_large", StdView(st.message()));
    } else {
      resp = FileStatusResponse(st);
    }
    // Seed 004's read_file shape carries the error text in `content` as well: add it to the
    // error body built above rather than re-deriving its code here.
    json::value body = json::parse(resp.body);
    body.as_object()["content"] = std::string(st.message());
    resp.body = ToJson(body);
  } else if (IsValidUtf8(data) &&
             JsonEscapedSize(data) > static_cast<uint64_t>(options_.max_json_read_bytes)) {
    // Text that escapes to much more than it is (a control character is six bytes in JSON):
    // the answer would be up to 6× max_json_read_bytes, all of it held in memory.
    st = absl::OutOfRangeError(absl::StrCat(
        "file is ", data.size(), " bytes of text whose JSON encoding is ", JsonEscapedSize(data),
        " bytes, more than files/read returns (", options_.max_json_read_bytes,
        "); use files/raw for large or binary files"));
    resp = ErrorResponse(413, "payload_too_large", StdView(st.message()));
    json::value body = json::parse(resp.body);
    body.as_object()["content"] = std::string(st.message());
    resp.body = ToJson(body);
  } else {
    bool text = IsValidUtf8(data);
    json::object o{{"error", false},
                   {"content", text ? data : Base64Encode(data)},
                   {"encoding", text ? "utf-8" : "base64"},
                   {"size", data.size()}};
    std::string().swap(data);  // one copy less while the answer is serialised
    resp = JsonResponse(200, o);
  }
  if (transfer.ok() && !st.ok()) (*transfer)->Finish(st);  // a limit of files/read's own
  return resp;
}

Response ApiService::PutRaw(Request& req, const Caller& caller) {
  std::string path = req.Query("path").value_or("");
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  // One audited upload, however many agent writes it takes.
  auto transfer = manager_->OpenTransfer(caller, req.Param("id"), path, "files.upload");
  if (!transfer.ok()) return FileStatusResponse(transfer.status());
  BodyReader* reader = req.body_reader();
  if (!reader) return ErrorResponse(500, "internal", "upload route without a body reader");
  std::string buf;  // grows as bytes arrive, up to one agent write (kChunk)
  std::vector<char> tmp(kUploadReadChunk);
  int64_t offset = 0;
  bool first = true;
  absl::Status read_error, write_error;
  for (;;) {
    auto n = reader->Read(tmp.data(), tmp.size());
    if (!n.ok()) {
      read_error = n.status();
      break;
    }
    buf.append(tmp.data(), *n);
    bool done = *n == 0;
    if (buf.size() >= static_cast<size_t>(kChunk) || (done && (first || !buf.empty()))) {
      write_error = (*transfer)->Write(buf, offset, first);
      if (!write_error.ok()) break;
      offset += static_cast<int64_t>(buf.size());
      buf.clear();
      first = false;
    }
    if (done) break;
  }
  Response resp;
  if (!read_error.ok()) {
    (*transfer)->Finish(read_error);
    resp = absl::IsResourceExhausted(read_error)
               ? ErrorResponse(413, "payload_too_large",
                               absl::StrCat("upload exceeds max_upload_bytes (",
                                            options_.max_upload_bytes, " bytes)"))
           : absl::IsDeadlineExceeded(read_error)
               ? ErrorResponse(408, "bad_request",
                               absl::StrCat("reading the upload failed: ", read_error.message()))
               : ErrorResponse(400, "bad_request",
                               absl::StrCat("reading the upload failed: ", read_error.message()));
  } else if (!write_error.ok()) {
    resp = FileStatusResponse(write_error);
  } else {
    resp = JsonResponse(200, json::object{{"error", false},
                                          {"message", "File saved successfully."},
                                          {"bytes", offset}});
  }
  return resp;
}

Response ApiService::GetRaw(Request& req, const Caller& caller) {
  std::string path = req.Query("path").value_or("");
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  // One audited download (written when the last chunk went, or the client did).
  auto opened = manager_->OpenTransfer(caller, req.Param("id"), path, "files.download");
  if (!opened.ok()) return FileStatusResponse(opened.status());
  std::shared_ptr<EnvironmentManager::FileTransfer> transfer = std::move(*opened);
  // First chunk before answering, so a missing file is a clean 404.
  auto first = transfer->Read(0, kDownloadChunk);
  if (!first.ok()) return FileStatusResponse(first.status());
  Response resp = Response::Stream(
      200, "application/octet-stream",
      [transfer, chunk = std::move(*first)](ResponseWriter& w) mutable {
        int64_t offset = 0;
        for (;;) {
          if (!w.Write(chunk.data)) {
            transfer->Finish(absl::CancelledError("the client went away"));
            break;
          }
          offset += static_cast<int64_t>(chunk.data.size());
          if (chunk.eof || chunk.data.empty()) break;
          auto next = transfer->Read(offset, kDownloadChunk);
          if (!next.ok()) break;  // headers are gone; the truncated chunked body tells the client
          chunk = std::move(*next);
        }
      });
  resp.SetHeader("X-File-Size", std::to_string(first->file_size));
  return resp;
}

Response ApiService::ListFiles(Request& req, const Caller& caller) {
  std::string path = req.Query("path").value_or(".");
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  auto entries = manager_->ListDir(caller, req.Param("id"), path);
  if (!entries.ok()) return FileStatusResponse(entries.status());
  json::array arr;
  for (const FileEntry& e : entries->entries) arr.push_back(RenderEntry(e));
  json::object out{{"error", false}, {"path", path}, {"entries", std::move(arr)}};
  if (entries->truncated) out["truncated"] = true;
  return JsonResponse(200, std::move(out));
}

Response ApiService::StatFile(Request& req, const Caller& caller) {
  std::string path = req.Query("path").value_or("");
  if (absl::Status st = CheckPath(path); !st.ok()) return StatusResponse(st);
  auto entry = manager_->StatFile(caller, req.Param("id"), path);
  if (!entry.ok()) return FileOpResponse(entry.status());
  json::object out = RenderEntry(*entry);
  out["error"] = false;
  out["path"] = path;
  return JsonResponse(200, std::move(out));
}

Response ApiService::MakeDir(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  std::string path = f.RequiredString("path");
  if (!f.ok()) return f.ErrorResponse();
  if (absl::Status st = CheckNewPath("path", path); !st.ok()) return StatusResponse(st);
  std::string id = req.Param("id");
  auto created = manager_->MakeDir(caller, id, path);
  Response resp =
      created.ok()
          ? JsonResponse(200, json::object{{"error", false}, {"path", path}, {"created", *created}})
          : FileOpResponse(created.status());
  return resp;
}

Response ApiService::RemoveFile(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  std::string path = f.RequiredString("path");
  bool recursive = f.OptionalBool("recursive", false);
  if (!f.ok()) return f.ErrorResponse();
  if (absl::Status st = CheckNewPath("path", path); !st.ok()) return StatusResponse(st);
  std::string id = req.Param("id");
  absl::Status st = manager_->RemoveFile(caller, id, path, recursive);
  Response resp = st.ok() ? JsonResponse(200, json::object{{"error", false}, {"path", path}})
                          : FileOpResponse(st);
  return resp;
}

Response ApiService::RenameFile(Request& req, const Caller& caller) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  std::string source = f.RequiredString("source");
  std::string destination = f.RequiredString("destination");
  bool overwrite = f.OptionalBool("overwrite", false);
  if (!f.ok()) return f.ErrorResponse();
  for (const auto& [field, value] : {std::pair<const char*, const std::string&>{"source", source},
                                     {"destination", destination}}) {
    if (absl::Status st = CheckNewPath(field, value); !st.ok()) return StatusResponse(st);
  }
  std::string id = req.Param("id");
  absl::Status st = manager_->RenameFile(caller, id, source, destination, overwrite);
  Response resp = st.ok() ? JsonResponse(200, json::object{{"error", false},
                                                           {"source", source},
                                                           {"destination", destination}})
                          : FileOpResponse(st);
  return resp;
}

namespace {

// The cursor of an audit page: "<time_ms>.<id>" of its last row (opaque to clients).
std::string AuditCursor(const AuditEntry& e) { return absl::StrCat(e.time_ms, ".", e.id); }

bool ParseAuditCursor(std::string_view text, int64_t* time_ms, int64_t* id) {
  const size_t dot = text.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 == text.size() || text.size() > 40)
    return false;
  auto digits = [](std::string_view d, int64_t* out) {
    if (d.size() > 18) return false;
    int64_t v = 0;
    for (char c : d) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + (c - '0');
    }
    *out = v;
    return true;
  };
  return digits(text.substr(0, dot), time_ms) && digits(text.substr(dot + 1), id);
}

json::object EgressJson(const EgressFields& f) {
  json::array intents, rules;
  for (const auto& i : f.intents) intents.push_back(json::value(SanitizeUtf8(i)));
  for (const auto& r : f.rule_ids) rules.push_back(json::value(SanitizeUtf8(r)));
  json::object o{{"method", SanitizeUtf8(f.method)},
                 {"scheme", SanitizeUtf8(f.scheme)},
                 {"host", SanitizeUtf8(f.host)},
                 {"port", f.port},
                 {"path", SanitizeUtf8(f.path)},
                 {"decision", SanitizeUtf8(f.decision)},
                 {"rule_ids", std::move(rules)},
                 {"reason", SanitizeUtf8(f.reason)},
                 {"intents", std::move(intents)},
                 {"bytes_up", f.bytes_up},
                 {"bytes_down", f.bytes_down},
                 {"added_latency_us", f.added_latency_us},
                 {"request_headers", SanitizeUtf8(f.headers)},
                 {"body", SanitizeUtf8(f.body)},
                 {"body_bytes", f.body_bytes},
                 {"body_sha256", SanitizeUtf8(f.body_sha256)}};
  if (f.body_omitted) o["body_omitted"] = true;
  return o;
}

}  // namespace

Response ApiService::QueryAudit(Request& req, const Caller& caller) {
  const std::string& tenant = caller.tenant;
  AuditQuery q;
  q.tenant = tenant;
  // `from`/`to` are the names of issue 12; `since`/`until` stay for existing clients.
  auto time_param = [&](const char* name, const char* alias, int64_t* out) -> bool {
    auto v = req.Query(name);
    if (!v) v = req.Query(alias);
    return !v || ParseTime(*v, out);
  };
  if (!time_param("since", "from", &q.since_ms) || !time_param("until", "to", &q.until_ms))
    return ErrorResponse(400, "bad_request",
                         "'from'/'to' ('since'/'until') must be RFC 3339 times or unix seconds");
  q.environment_id = req.Query("environment_id").value_or("");
  q.keyword = req.Query("q").value_or("");
  if (auto limit = req.Query("limit")) {
    char* end = nullptr;
    long n = std::strtol(limit->c_str(), &end, 10);
    if (limit->empty() || *end != '\0' || n < 1 || n > kMaxAuditLimit)
      return ErrorResponse(400, "bad_request",
                           absl::StrCat("'limit' must be an integer in 1..", kMaxAuditLimit));
    q.limit = static_cast<int>(n);
  }
  q.kind = req.Query("kind").value_or("");
  if (!q.kind.empty() && q.kind != "egress" && q.kind != "tool")
    return ErrorResponse(400, "bad_request",
                         "'kind' must be \"egress\" or \"tool\" (or absent: every row)");
  q.decision = req.Query("decision").value_or("");
  // Tool-call rows' decisions (core/tools/tool_gate.h) are egress decisions less "opaque".
  if (!q.decision.empty() &&
      (!ParseEgressDecision(q.decision) || (q.kind == "tool" && q.decision == "opaque")))
    return ErrorResponse(
        400, "bad_request",
        q.kind == "tool" ? "'decision' must be one of allowed, blocked, redacted, error"
                         : "'decision' must be one of allowed, blocked, redacted, opaque, error");
  if (auto cursor = req.Query("cursor")) {
    if (!ParseAuditCursor(*cursor, &q.before_time_ms, &q.before_id))
      return ErrorResponse(400, "bad_request",
                           "'cursor' must be a next_cursor value from a previous page");
  }
  auto entries = store_->QueryAudit(q);
  if (!entries.ok()) return StatusResponse(entries.status());
  json::array arr;
  for (const AuditEntry& e : *entries) {
    json::object row{{"id", e.id},
                     {"time", FormatRfc3339(e.time_ms)},
                     {"tenant", e.tenant},
                     {"environment_id",
                      e.environment_id.empty() ? json::value() : json::value(e.environment_id)},
                     {"action", e.action},
                     {"detail", SanitizeUtf8(e.detail)},
                     {"exit_code", e.exit_code ? json::value(*e.exit_code) : json::value()},
                     {"duration_ms", e.duration_ms},
                     {"bytes", e.bytes},
                     {"status", e.status},
                     {"principal", e.principal.empty() ? json::value() : json::value(e.principal)}};
    if (e.egress) row["egress"] = EgressJson(*e.egress);
    if (e.tool_call) {
      const ToolCallFields& t = *e.tool_call;
      json::array rules(t.rule_ids.begin(), t.rule_ids.end());
      json::array result_rules(t.result_rule_ids.begin(), t.result_rule_ids.end());
      row["tool_call"] = json::object{{"tool", t.tool},
                                      {"server", t.server},
                                      {"decision", t.decision},
                                      {"rule_ids", std::move(rules)},
                                      {"result_rule_ids", std::move(result_rules)},
                                      {"arguments", SanitizeUtf8(t.arguments)},
                                      {"result_bytes", t.result_bytes}};
    }
    arr.push_back(std::move(row));
  }
  json::object out{{"entries", std::move(arr)}};
  // A full page may have more after it.
  out["next_cursor"] = entries->size() == static_cast<size_t>(q.limit) && !entries->empty()
                           ? json::value(AuditCursor(entries->back()))
                           : json::value();
  return JsonResponse(200, out);
}

Response ApiService::GetReport(Request& req, const Caller& caller) {
  static constexpr std::string_view kParams[] = {"period", "format", "environment_id", "date",
                                                 "top"};
  for (const auto& [key, value] : req.query()) {
    if (std::find(std::begin(kParams), std::end(kParams), key) == std::end(kParams))
      return ErrorResponse(400, "bad_request",
                           absl::StrCat("unknown parameter '", SanitizeUtf8(key),
                                        "' (period, format, environment_id, date, top)"));
  }
  std::optional<ReportPeriod> period = ParseReportPeriod(req.Query("period").value_or("daily"));
  if (!period) return ErrorResponse(400, "bad_request", "'period' must be daily or weekly");
  const std::string format = req.Query("format").value_or("json");
  if (format != "json" && format != "csv" && format != "html")
    return ErrorResponse(400, "bad_request", "'format' must be json, csv or html");
  EgressReportQuery q;
  q.tenant = caller.tenant;
  q.environment_id = req.Query("environment_id").value_or("");
  if (q.environment_id.size() > 64)
    return ErrorResponse(400, "bad_request", "'environment_id' is longer than 64 bytes");
  const int64_t now = NowUnixMs();
  int64_t at = now;
  if (auto date = req.Query("date")) {
    absl::StatusOr<int64_t> day = ParseReportDate(*date);
    if (!day.ok()) return StatusResponse(day.status());
    at = *day;
  }
  if (auto top = req.Query("top")) {
    char* end = nullptr;
    long n = std::strtol(top->c_str(), &end, 10);
    if (top->empty() || *end != '\0' || n < 1 || n > kMaxReportTopN)
      return ErrorResponse(400, "bad_request",
                           absl::StrCat("'top' must be an integer in 1..", kMaxReportTopN));
    q.top_n = static_cast<int>(n);
  }
  const ReportWindow window = WindowFor(*period, at);
  q.from_ms = window.from_ms;
  q.to_ms = window.to_ms;
  absl::StatusOr<EgressReport> report = store_->ReportEgress(q);
  if (!report.ok()) return StatusResponse(report.status());
  ReportMeta meta{
      caller.tenant, std::string(ToString(*period)), q.environment_id, q.from_ms, q.to_ms, now};
  if (format == "json") return JsonResponse(200, ReportToJson(*report, meta));
  // A file name from safe characters only (the tenant is configured, the date is ours).
  std::string name =
      absl::StrCat("egress-", meta.period, "-", FormatRfc3339(q.from_ms).substr(0, 10));
  Response resp =
      format == "csv"
          ? Response::Text(200, ReportToCsv(*report, meta), "text/csv; charset=utf-8")
          : Response::Text(200, ReportToHtml(*report, meta), "text/html; charset=utf-8");
  resp.SetHeader("X-Content-Type-Options", "nosniff");
  if (format == "csv") {
    resp.SetHeader("Content-Disposition", absl::StrCat("attachment; filename=\"", name, ".csv\""));
  } else {
    // The page needs nothing but its own inline style.
    resp.SetHeader("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'");
  }
  return resp;
}

}  // namespace esb::api
