// The Environment API (docs/api.md) on top of HttpServer: parses and validates requests,
// authenticates them to a tenant, calls the core with who is calling (a Caller: the core writes
// the audit rows), renders answers.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "api/http_server.h"
#include "common/utf8.h"  // SanitizeUtf8 for the routes
#include "core/artifact_store.h"
#include "core/config.h"
#include "core/driver_registry.h"
#include "core/egress.h"
#include "core/environment_manager.h"
#include "core/metrics.h"
#include "drivers/env_limits.h"
#include "storage/store.h"

namespace esb::mcp_hosts {
class McpHosts;
}

namespace esb::api {

struct ServiceOptions {
  std::map<std::string, std::string> images;  // known image names (values unused here)
  int64_t max_output_bytes = 1 << 20;
  int64_t max_upload_bytes = 256ll << 20;
  int64_t max_json_read_bytes = 16ll << 20;
  // The caps of the one limit table (drivers/env_limits.h): host CPUs, max_memory_mb,
  // max_pids, max_disk_mb of the daemon config.
  EnvLimitCaps limits;
  // Which runtimes this esbd has, their tiers, descriptions (/healthz) and why the others are
  // unavailable (shown in 400 answers). Not owned; null: none.
  const DriverRegistry* drivers = nullptr;
  // /healthz "userns": per container driver, whether sandboxes get user namespaces, and why.
  std::map<std::string, std::pair<bool, std::string>> userns;
  // /healthz "egress": the egress proxy's state (core/egress.h). Not owned; null: not shown.
  const EgressControl* egress = nullptr;
};

// Handler for POST /run and POST /environments/{id}/run (api/run_service.h builds it);
// `env_id` is empty for one-shot runs.
using RunHandler =
    std::function<Response(const Caller& caller, const std::string& env_id, Request& req)>;

class ApiService {
 public:
  ApiService(EnvironmentManager* manager, Store* store, Metrics* metrics, ServiceOptions options);

  // Registers every route on `router`.
  void Register(Router& router);
  // Optional handlers for POST /run and POST /environments/{id}/run (nano / heavy Python).
  void SetRunHandler(RunHandler handler) { run_handler_ = std::move(handler); }
  // Serves GET /environments/{id}/artifacts[/{aid}] from `store` (not owned; may be null).
  void SetArtifactStore(ArtifactStore* store) { artifacts_ = store; }
  // Serves the hosted MCP servers' routes (mcp_servers_service.cc) from `hosts` (not owned; null:
  // they answer 503).
  void SetMcpHosts(mcp_hosts::McpHosts* hosts) { mcp_hosts_ = hosts; }

  // Authenticates a request to a tenant: Bearer key when any key exists; otherwise dev mode
  // (loopback or unix socket only, tenant "default").
  // In dev mode a TCP request must also name this machine in Host and, if it has an Origin,
  // come from a page on this machine (PermissionDenied otherwise: 403).
  absl::StatusOr<std::string> Authenticate(const Request& req);
  // The admission step of every authenticated route, run on the request header before any body
  // is read: authenticates (401, or 403 for a dev-mode browser request from elsewhere), checks
  // that a JSON route's body is application/json (415), and sets req.principal_ to the tenant.
  // nullopt when admitted.
  std::optional<Response> Admit(Request& req, bool json_body);
  // Who an admitted request is, for the core (which audits every environment action).
  Caller CallerOf(const Request& req);

  // A POST /environments body checked and carried out (InvalidArgument naming the field, or
  // the core's error): the REST route and MCP's create_environment (api/mcp/esb_tools.h).
  absl::StatusOr<EnvironmentInfo> CreateEnvironmentFrom(const boost::json::object& body,
                                                        const Caller& caller);
  // An environment as the API renders it (GET /environments/{id}; with_usage adds its usage).
  boost::json::object RenderEnvironment(const EnvironmentInfo& info, bool with_usage);

 private:
  Response CreateEnvironment(Request& req, const Caller& caller);
  Response Execute(Request& req, const Caller& caller);
  Response WriteFile(Request& req, const Caller& caller);
  Response ReadFile(Request& req, const Caller& caller);
  Response PutRaw(Request& req, const Caller& caller);
  Response GetRaw(Request& req, const Caller& caller);
  Response ListFiles(Request& req, const Caller& caller);
  Response QueryAudit(Request& req, const Caller& caller);
  Response GetReport(Request& req, const Caller& caller);
  Response ListArtifacts(Request& req, const Caller& caller);
  Response GetArtifact(Request& req, const Caller& caller);
  Response StatFile(Request& req, const Caller& caller);
  Response MakeDir(Request& req, const Caller& caller);
  Response RemoveFile(Request& req, const Caller& caller);
  Response RenameFile(Request& req, const Caller& caller);
  // Egress governance (network_service.cc): GET/PUT /environments/{id}/network, the intents
  // routes and GET /environments/{id}/ca.pem.
  using RouteFn = std::function<Response(Request&, const Caller&)>;
  void RegisterNetwork(const std::function<void(std::string, std::string_view, RouteFn)>& add);
  // GET /environments/{id}/terminal (terminal_service.cc): a shell's PTY over a WebSocket.
  void RegisterTerminal(const std::function<void(std::string, std::string_view, RouteFn)>& add);
  // Time travel (steps_service.cc): the steps routes, rewind and fork (docs/api.md "Steps").
  void RegisterSteps(const std::function<void(std::string, std::string_view, RouteFn)>& add);
  // Hosted MCP servers (mcp_servers_service.cc): /environments/{id}/mcp-servers[/{name}],
  // GET /environments/{id}/tools, POST /environments/{id}/tools/{name}/call.
  void RegisterMcpServers(const std::function<void(std::string, std::string_view, RouteFn)>& add);
  // A `network` value: "none" (nullopt) or a policy object, laid over the tenant's default.
  absl::StatusOr<std::optional<governance::EgressPolicy>> ParseNetwork(
      const boost::json::value& value, const std::string& tenant);

  EnvironmentManager* manager_;
  Store* store_;
  Metrics* metrics_;
  ServiceOptions options_;
  RunHandler run_handler_;
  ArtifactStore* artifacts_ = nullptr;
  mcp_hosts::McpHosts* mcp_hosts_ = nullptr;

  // files/read builds its whole answer in memory (the file, its JSON string, the serialised
  // body: about three times the file): the bytes of files being read at once are bounded
  // server-wide (4 × max_json_read_bytes) and per tenant (2 ×), beyond which a read is
  // answered 503 / 429 rather than piling up copies of large files.
  bool ReserveRead(const std::string& tenant, int64_t bytes, bool* over_share);
  void ReleaseRead(const std::string& tenant, int64_t bytes);
  // Sha256Hex(API key secret) → the key's public id, filled by Authenticate.
  std::mutex key_ids_mu_;
  std::map<std::string, std::string> key_ids_;
  std::mutex read_mu_;
  int64_t reads_in_flight_ = 0;
  std::map<std::string, int64_t> tenant_reads_;
};

// An artifact as the API shows it: {id, kind, name, mime_type, size, title, step,
// environment_id, created_at, url}.
boost::json::object RenderArtifact(const ArtifactMeta& meta);

// The `steps` value of a create: false / true / a settings object (docs/api.md "Steps").
absl::StatusOr<StepSettings> ParseStepSettings(const boost::json::value& value);
// An environment's "steps" object.
boost::json::object RenderStepsStatus(const StepsStatus& status);

// Status → HTTP answer for file operations, where PermissionDenied means "the sandbox user may
// not do that" (403), not tenant isolation.
Response FileStatusResponse(const absl::Status& status);

}  // namespace esb::api
