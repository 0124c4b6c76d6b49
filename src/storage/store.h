// Durable state: environments, API keys/tenants and the audit log, in SQLite (WAL).
// Thread-safe: one connection guarded by a mutex (SQLite serialises writers anyway).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb {

struct EnvironmentRecord {
  std::string id;
  std::string tenant;
  std::string state;    // "creating" | "running" | "destroying" | "destroyed" | "failed"
  std::string runtime;  // driver name
  std::string image;
  std::string spec_json;     // the EnvSpec as JSON (limits, env, network)
  std::string driver_state;  // InstanceRef::state
  int64_t created_ms = 0;
  int64_t last_used_ms = 0;
  int64_t expires_ms = 0;
  int64_t destroyed_ms = 0;    // 0 = not destroyed
  std::string destroy_reason;  // "deleted" | "ttl_expired" | "died" | "create_failed" | ...
  int64_t exec_count = 0;
};

struct ApiKeyRecord {
  std::string key_id;  // public id shown in listings ("key_ab12...")
  std::string tenant;
  std::string name;
  int64_t created_ms = 0;
  bool revoked = false;
};

struct AuditEntry {
  int64_t id = 0;
  int64_t time_ms = 0;
  std::string tenant;
  std::string environment_id;
  std::string action;  // "environment.create", "execute", "files.write", ...
  std::string detail;  // command or path
  std::optional<int64_t> exit_code;
  int64_t duration_ms = 0;
  int64_t bytes = 0;
  int status = 0;  // HTTP status of the call
};

struct AuditQuery {
  std::string tenant;          // required: callers only see their own tenant
  int64_t since_ms = 0;        // 0 = unbounded
  int64_t until_ms = 0;        // 0 = unbounded
  std::string environment_id;  // empty = any
  std::string keyword;         // FTS5 query over action + detail; empty = any
  int limit = 100;             // 1..1000, newest first
};

class Store {
 public:
  // Opens (creating and migrating) the database at `path`; ":memory:" for tests.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path);
  virtual ~Store() = default;

  virtual absl::Status PutEnvironment(const EnvironmentRecord& rec) = 0;  // insert or replace
  virtual absl::StatusOr<EnvironmentRecord> GetEnvironment(const std::string& id) = 0;
  // All environments not in state "destroyed" (any tenant); for re-attach after restart.
  virtual absl::StatusOr<std::vector<EnvironmentRecord>> ListLiveEnvironments() = 0;
  virtual absl::StatusOr<std::vector<EnvironmentRecord>> ListEnvironments(
      const std::string& tenant, bool include_destroyed) = 0;

  // API keys: only a SHA-256 of the secret is stored. Returns the new record and the secret
  // (shown once) via `secret`.
  virtual absl::StatusOr<ApiKeyRecord> CreateApiKey(const std::string& tenant,
                                                    const std::string& name,
                                                    std::string* secret) = 0;
  // Imports a key given in plain text (from the config file); idempotent.
  virtual absl::Status ImportApiKey(const std::string& tenant, const std::string& secret,
                                    const std::string& name) = 0;
  // Returns the tenant of a valid, unrevoked key; NotFound otherwise.
  virtual absl::StatusOr<std::string> TenantForKey(const std::string& secret) = 0;
  virtual absl::StatusOr<std::vector<ApiKeyRecord>> ListApiKeys() = 0;
  virtual absl::Status RevokeApiKey(const std::string& key_id) = 0;
  virtual absl::StatusOr<int64_t> CountActiveApiKeys() = 0;

  virtual absl::Status AppendAudit(const AuditEntry& entry) = 0;
  virtual absl::StatusOr<std::vector<AuditEntry>> QueryAudit(const AuditQuery& query) = 0;
};

}  // namespace esb
