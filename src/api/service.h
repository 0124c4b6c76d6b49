// The Environment API (docs/api.md) on top of HttpServer: parses and validates requests,
// authenticates them to a tenant, calls the core, writes audit rows, renders answers.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "api/http_server.h"
#include "core/artifact_store.h"
#include "core/config.h"
#include "core/environment_manager.h"
#include "core/metrics.h"
#include "storage/store.h"

namespace esb::api {

struct ServiceOptions {
  std::map<std::string, std::string> images;  // known image names (values unused here)
  int64_t max_output_bytes = 1 << 20;
  int64_t max_upload_bytes = 256ll << 20;
  int64_t max_json_read_bytes = 16ll << 20;
  int host_cpus = 1;
  int64_t max_pids = 4096;  // largest "pids" an environment may ask for (daemon config)
  int64_t max_memory_mb = 16384;  // largest "memory_mb" (daemon config max_memory_mb)
  int64_t max_disk_mb = 65536;    // largest "disk_mb" (daemon config max_disk_mb)
  // runtime name → why it is unavailable (shown in 400 answers), for runtimes with no driver.
  std::map<std::string, std::string> unavailable_runtimes;
  std::map<std::string, std::string> driver_descriptions;  // for /healthz
  // /healthz "userns": per container driver, whether sandboxes get user namespaces, and why.
  std::map<std::string, std::pair<bool, std::string>> userns;
};

// Handler for POST /run and POST /environments/{id}/run (api/run_service.h builds it);
// `env_id` is empty for one-shot runs.
using RunHandler = std::function<Response(const std::string& tenant, const std::string& env_id,
                                          Request& req)>;

class ApiService {
 public:
  ApiService(EnvironmentManager* manager, Store* store, Metrics* metrics, ServiceOptions options);

  // Registers every route on `router`.
  void Register(Router& router);
  // Optional handlers for POST /run and POST /environments/{id}/run (nano / heavy Python).
  void SetRunHandler(RunHandler handler) { run_handler_ = std::move(handler); }
  // Serves GET /environments/{id}/artifacts[/{aid}] from `store` (not owned; may be null).
  void SetArtifactStore(ArtifactStore* store) { artifacts_ = store; }

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
  void Audit(const std::string& tenant, const std::string& env_id, const std::string& action,
             const std::string& detail, std::optional<int64_t> exit_code, int64_t duration_ms,
             int64_t bytes, int status);

 private:
  Response CreateEnvironment(Request& req, const std::string& tenant);
  Response Execute(Request& req, const std::string& tenant);
  Response WriteFile(Request& req, const std::string& tenant);
  Response ReadFile(Request& req, const std::string& tenant);
  Response PutRaw(Request& req, const std::string& tenant);
  Response GetRaw(Request& req, const std::string& tenant);
  Response ListFiles(Request& req, const std::string& tenant);
  Response QueryAudit(Request& req, const std::string& tenant);
  Response ListArtifacts(Request& req, const std::string& tenant);
  Response GetArtifact(Request& req, const std::string& tenant);
  boost::json::object RenderEnvironment(const EnvironmentInfo& info, bool with_usage);

  EnvironmentManager* manager_;
  Store* store_;
  Metrics* metrics_;
  ServiceOptions options_;
  RunHandler run_handler_;
  ArtifactStore* artifacts_ = nullptr;

  // files/read builds its whole answer in memory (the file, its JSON string, the serialised
  // body: about three times the file): the bytes of files being read at once are bounded
  // server-wide (4 × max_json_read_bytes) and per tenant (2 ×), beyond which a read is
  // answered 503 / 429 rather than piling up copies of large files.
  bool ReserveRead(const std::string& tenant, int64_t bytes, bool* over_share);
  void ReleaseRead(const std::string& tenant, int64_t bytes);
  std::mutex read_mu_;
  int64_t reads_in_flight_ = 0;
  std::map<std::string, int64_t> tenant_reads_;
};

// An artifact as the API shows it: {id, kind, name, mime_type, size, title, step,
// environment_id, created_at, url}.
boost::json::object RenderArtifact(const ArtifactMeta& meta);

// Replaces invalid UTF-8 sequences with U+FFFD (JSON strings must be UTF-8; exact bytes are
// available through files/raw).
std::string SanitizeUtf8(std::string_view in);

// Status → HTTP answer for file operations, where PermissionDenied means "the sandbox user may
// not do that" (403), not tenant isolation.
Response FileStatusResponse(const absl::Status& status);

}  // namespace esb::api
