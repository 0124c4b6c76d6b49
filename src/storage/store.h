// Durable state: environments, API keys/tenants and the audit log, in SQLite (WAL).
// Thread-safe: one writer connection guarded by a mutex (SQLite serialises writers anyway);
// audit searches run on their own read-only connections so they never wait behind, or hold up,
// the writer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/env_types.h"

namespace esb {

struct EnvironmentRecord {
  std::string id;
  std::string tenant;
  EnvState state = EnvState::kCreating;  // stored as its name (ToString / ParseEnvState)
  // The driver's name as stored (ToString(DriverKind)); the core parses it (ParseDriverKind) so
  // that a row naming a driver this esbd lacks is cleaned up, not misread.
  std::string runtime;
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

// The egress part of an audit row (action "egress", issue 12): one proxied request, refused
// connection or opaque tunnel. Stored in the side table audit_egress (schema v6), deleted with
// its audit row, and indexed for search (host, path, headers, body).
struct EgressFields {
  std::vector<std::string> intents;  // active intents (at most 32 stored)
  std::string method;
  std::string scheme;  // "http" | "https" | "tunnel"
  std::string host;
  int port = 0;
  std::string path;
  std::string decision;               // "allowed" | "blocked" | "redacted" | "opaque" | "error"
  std::vector<std::string> rule_ids;  // at most 32 stored
  std::string reason;
  int64_t bytes_up = 0;
  int64_t bytes_down = 0;
  int64_t added_latency_us = 0;
  std::string headers;        // "Name: value" lines, masked (stored <= kMaxEgressHeadersBytes)
  std::string body;           // redacted body (stored <= kMaxEgressBodyBytes, cut marked)
  int64_t body_bytes = 0;     // size of the original body
  std::string body_sha256;    // of the original body
  bool body_omitted = false;  // query results only: left out by the response size budget
};

inline constexpr size_t kMaxEgressHeadersBytes = 16 * 1024;
// What an egress row stores instead of its headers and body once the tenant's budget
// (StoreOptions::max_egress_stored_bytes_per_tenant) is full.
inline constexpr char kEgressBudgetFullMarker[] =
    "[headers and body not stored: the tenant's audit budget for egress bodies is full]";
inline constexpr size_t kMaxEgressBodyBytes = 64 * 1024;
// An audit search returns at most this many bytes of egress bodies; later rows come without
// theirs (body_omitted).
inline constexpr size_t kMaxAuditResultBodyBytes = 4 * 1024 * 1024;

// The tool call of an audit row with action "tool.call" (issue 14; core/tools/tool_gate.h): one
// row per call of a tool (esbd's own or a hosted MCP server's), written by the ToolCallGate.
struct ToolCallFields {
  std::string tool;                          // the tool's name on its server
  std::string server;                        // "esbd" or the hosted server's name
  std::string decision;                      // "allowed" | "redacted" | "blocked" | "error"
  std::vector<std::string> rule_ids;         // DLP rules hit in the arguments (<= 32 stored)
  std::vector<std::string> result_rule_ids;  // ... in the result (<= 32 stored)
  // The arguments as dispatched (after redaction) as JSON, or a placeholder saying why they are
  // not kept (never the text of a finding). Stored <= kMaxToolArgumentsBytes, cut marked.
  std::string arguments;
  int64_t result_bytes = 0;  // serialised size of the result
};
inline constexpr size_t kMaxToolArgumentsBytes = 16 * 1024;

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
  int status = 0;  // HTTP status of the call (the core's outcome mapped the API's way)
  // Who: an API key's public id ("key_..."), "dev" (no keys configured), "system" (the
  // daemon itself: expiry, restart cleanup), "proxy" (egress rows).
  std::string principal;
  std::optional<EgressFields> egress;  // set for egress rows (action "egress")
  std::optional<ToolCallFields> tool_call;  // set for tool rows (action "tool.call")
};

// A persistent volume (issue 11): named per tenant; its contents live with the driver.
struct VolumeRecord {
  std::string tenant;
  std::string name;
  int64_t size_mb = 0;
  int64_t created_ms = 0;
};

// The egress state of a governed environment (issue 12): what survives an esbd restart. One row
// per environment, deleted with it (the CA key must not outlive the environment).
struct EgressRecord {
  std::string env_id;
  std::string tenant;
  std::string policy_json;   // governance::ToJson(EgressPolicy)
  std::string intents_json;  // JSON array of governance::ToJson(ActiveIntent), with expiry
  std::string ca_cert_pem;
  std::string ca_key_pem;  // secret
  int64_t updated_ms = 0;
};

// Time travel (issue 13; docs/design.md "Time travel"): one environment's step log header.
// One row per environment with steps, deleted with its steps.
struct StepLogRecord {
  std::string env_id;
  std::string tenant;
  std::string settings_json;    // the environment's `steps` settings (core/snapshots)
  std::optional<int64_t> head;  // the step the environment's state is at; nullopt: none yet
  int64_t next_step = 0;        // the number the next step gets
  int64_t updated_ms = 0;
};

// One step of an environment (its number `n` is unique per environment). The core fills every
// field; the store keeps them as given (text fields are bounded by the core).
struct StepRecord {
  std::string env_id;
  int64_t n = 0;
  std::string tenant;
  std::optional<int64_t> parent;
  std::string kind;           // "create" | "fork" | "execute" | "run" | "files.write" | ...
  std::string summary;        // bounded input text
  std::string status = "ok";  // "ok" | "error"
  std::optional<int64_t> exit_code;
  std::optional<std::string> error;
  int64_t started_ms = 0;
  int64_t duration_ms = 0;
  int64_t capture_ms = 0;
  std::string tier;
  std::string memory = "none";  // "snapshot" | "none"
  std::optional<std::string> memory_detail;
  bool memory_live = false;  // the memory snapshot is held by a live process
  int64_t files_changed = 0;
  int64_t created_ms = 0;
  std::string manifest_sha;  // the workspace manifest blob; "" = no state
  std::string state_json;    // snapshot ref, shell state and variables blobs (core/snapshots)
  std::string detail_json;   // input, output, artifacts, shell cwd (bounded by the core)
  int64_t bytes = 0;         // bytes this step added (new blobs, memory snapshot)
  bool collected = false;    // its state was collected by retention
};
// At most this many steps are listed per call.
inline constexpr int kMaxStepsListed = 1000;

struct AuditQuery {
  std::string tenant;          // required: callers only see their own tenant
  int64_t since_ms = 0;        // 0 = unbounded
  int64_t until_ms = 0;        // 0 = unbounded
  std::string environment_id;  // empty = any
  // FTS5 query over action + detail, and over host, path, headers and body of egress rows;
  // empty = any.
  std::string keyword;
  int limit = 100;       // 1..1000, newest first
  // "" = every row; "egress" = egress rows only; "tool" = tool-call rows only (action
  // "tool.call").
  std::string kind;
  // "" = any; else rows with this decision: egress rows (implies kind "egress") unless kind is
  // "tool" (tool rows with this decision).
  std::string decision;
  // Keyset cursor: only rows older than (before_time_ms, before_id) in the result order; 0 =
  // from the newest. The API encodes the last row's (time_ms, id) as its next cursor.
  int64_t before_time_ms = 0;
  int64_t before_id = 0;
};

// A compliance report over a tenant's egress rows in [from_ms, to_ms) (issue 12, P3-013).
struct EgressReportQuery {
  std::string tenant;          // required
  std::string environment_id;  // "" = every environment of the tenant
  int64_t from_ms = 0;
  int64_t to_ms = 0;  // exclusive; > from_ms
  int top_n = 20;     // rows of top hosts / rules (1..100)
};

struct EgressReport {
  struct Summary {
    std::string environment_id;  // "" in the totals
    int64_t requests = 0;
    int64_t allowed = 0;
    int64_t blocked = 0;
    int64_t redacted = 0;
    int64_t opaque = 0;
    int64_t errors = 0;
    int64_t bytes_up = 0;
    int64_t bytes_down = 0;
  };
  struct Count {
    std::string key;  // a rule id or a host
    int64_t count = 0;
  };
  struct Host {
    std::string host;
    int64_t requests = 0;
    int64_t blocked = 0;
    int64_t bytes_up = 0;
    int64_t bytes_down = 0;
  };
  struct Day {
    int64_t day_start_ms = 0;  // UTC midnight
    int64_t requests = 0;
    int64_t blocked = 0;
    int64_t bytes_up = 0;
    int64_t bytes_down = 0;
  };
  Summary totals;
  std::vector<Summary> environments;  // busiest first, at most kMaxReportEnvironments
  // Rules that blocked, busiest first: the rule ids of blocked rows except the permitting ones
  // ("allow:", "intent:", "mode:open").
  std::vector<Count> blocks_by_rule;
  std::vector<Host> top_hosts;      // by requests
  std::vector<Count> dlp_findings;  // rule ids starting "dlp:" on any row, by rows
  std::vector<Day> days;            // one per UTC day with rows, oldest first
};
inline constexpr int kMaxReportEnvironments = 1000;
inline constexpr int kMaxReportTopN = 100;

// Limits that keep the audit log (and the environments history) bounded in size, and audit
// searches bounded in cost, whatever a tenant does.
struct StoreOptions {
  // Rows older than this are deleted (audit rows, and destroyed environments' records).
  int64_t retention_s = 30 * 86400;
  // Per tenant: beyond this many audit rows, the oldest are dropped in batches of 5%.
  int64_t max_audit_rows_per_tenant = 100000;
  // Per tenant: a token bucket of audit rows. Rows over the rate are not stored one by one but
  // counted per (environment, action, status; for tool calls also server and decision) and
  // written as one "suppressed" summary row per kind (with that environment_id; a tool summary
  // with a tool_call object, so kind=tool&decision=... finds it). Tool calls whose decision is
  // blocked or redacted have a bucket of their own with this rate and burst (a flood of cheap
  // calls cannot push a DLP decision out of its row).
  double audit_rate_per_s = 20;
  double audit_burst = 200;
  // Egress rows (one per proxied request: a `pip install` makes hundreds) have their own,
  // larger bucket per tenant, so they neither starve nor are starved by the API's rows.
  double egress_rate_per_s = 200;
  double egress_burst = 2000;
  // Per tenant: egress headers and bodies stored at most (bytes, as stored). Beyond it new egress
  // rows keep every field, size and hash but say kEgressBudgetFullMarker instead of their headers
  // and body; rows deleted by the row cap or retention free their share.
  int64_t max_egress_stored_bytes_per_tenant = 256LL << 20;
  // Stored size cap of `detail` (bytes, cut at a UTF-8 boundary, marked "…[truncated N bytes]").
  size_t max_detail_bytes = 1024;
  // An audit search that runs longer than this is stopped (DeadlineExceeded, "too expensive").
  int64_t audit_query_timeout_ms = 500;
  // Read-only connections for audit searches (file databases only; ":memory:" uses the writer).
  int audit_readers = 2;
  std::function<int64_t()> now_ms;  // injectable clock (unix ms); defaults to NowUnixMs
  // Write-behind: audit rows (AppendAudit) and deferred environment updates
  // (PutEnvironmentDeferred) are queued and committed by a background writer in one transaction
  // at most this long after they were queued (0: written synchronously by the caller). Every
  // read (environments, audit searches and counts, Maintain) and the store's destruction flush
  // the queue first, so readers always see them. A crash (SIGKILL, power loss) may lose at most
  // this interval of queued rows and counters.
  int64_t write_behind_ms = 50;
  // Audit rows queued at most; when the queue is full the caller flushes it (and writes its row)
  // synchronously: a burst slows callers down, never drops a row.
  size_t max_write_behind_rows = 4096;
  // The key secrets are sealed with at rest (storage/secret_box.h: the env CA private keys in
  // env_egress): a 32-byte owner-only file, created on first open when missing (and nothing is
  // sealed yet). Open re-seals plaintext rows from before. Empty: stored as given (in-memory
  // test stores; esbd always sets it, default <state_dir>/state.key).
  std::string secret_key_file;
};

// Caps on the cost of one audit search (checked before SQLite sees the query).
inline constexpr size_t kMaxAuditKeywordBytes = 256;
inline constexpr int kMaxAuditQueryTerms = 16;
inline constexpr int kMaxAuditPrefixTerms = 4;
inline constexpr int kMinAuditPrefixChars = 3;
inline constexpr int kMaxAuditLimit = 1000;
// At most this many destroyed environments are listed (newest first); live ones always are.
inline constexpr int kMaxListedDestroyed = 1000;

class Store {
 public:
  // Opens (creating and migrating) the database at `path`; ":memory:" for tests.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path,
                                                     StoreOptions options = {});
  virtual ~Store() = default;

  virtual absl::Status PutEnvironment(const EnvironmentRecord& rec) = 0;  // insert or replace
  // The same, off the caller's path (write-behind, StoreOptions::write_behind_ms): for
  // counters a crash may lose (exec_count, last_used_ms). Queued updates of one id coalesce to
  // the newest; a later PutEnvironment of that id supersedes a queued one. Reads see it.
  virtual absl::Status PutEnvironmentDeferred(const EnvironmentRecord& rec) {
    return PutEnvironment(rec);
  }
  // Writes everything queued by the write-behind now.
  virtual absl::Status Flush() { return absl::OkStatus(); }
  virtual absl::StatusOr<EnvironmentRecord> GetEnvironment(const std::string& id) = 0;
  // All environments not in state "destroyed" (any tenant); for re-attach after restart.
  virtual absl::StatusOr<std::vector<EnvironmentRecord>> ListLiveEnvironments() = 0;
  virtual absl::StatusOr<std::vector<EnvironmentRecord>> ListEnvironments(
      const std::string& tenant, bool include_destroyed) = 0;  // destroyed: newest 1000

  // Volumes: AlreadyExists for a (tenant, name) taken; NotFound when deleting a missing one.
  virtual absl::Status InsertVolume(const VolumeRecord& rec) = 0;
  // One tenant's volumes (every tenant's when `tenant` is empty), ordered by tenant, name.
  virtual absl::StatusOr<std::vector<VolumeRecord>> ListVolumes(const std::string& tenant) = 0;
  virtual absl::Status DeleteVolume(const std::string& tenant, const std::string& name) = 0;

  // Egress state (EgressRecord): insert or replace; NotFound for an environment without one;
  // deleting a missing one is fine.
  virtual absl::Status PutEgress(const EgressRecord& rec) = 0;
  virtual absl::StatusOr<EgressRecord> GetEgress(const std::string& env_id) = 0;
  virtual absl::Status DeleteEgress(const std::string& env_id) = 0;

  // API keys: only a SHA-256 of the secret is stored. Returns the new record and the secret
  // (shown once) via `secret`.
  virtual absl::StatusOr<ApiKeyRecord> CreateApiKey(const std::string& tenant,
                                                    const std::string& name,
                                                    std::string* secret) = 0;
  // Imports a key given in plain text (from the config file); idempotent.
  virtual absl::Status ImportApiKey(const std::string& tenant, const std::string& secret,
                                    const std::string& name) = 0;
  // The record (public key_id, tenant, ...) of a valid, unrevoked key; NotFound otherwise.
  virtual absl::StatusOr<ApiKeyRecord> KeyForSecret(const std::string& secret) = 0;
  virtual absl::StatusOr<std::vector<ApiKeyRecord>> ListApiKeys() = 0;
  virtual absl::Status RevokeApiKey(const std::string& key_id) = 0;
  virtual absl::StatusOr<int64_t> CountActiveApiKeys() = 0;

  // Stores one audit row, subject to the tenant's rate (over it: counted into a summary row)
  // and row cap; `detail` is cut to max_detail_bytes. Write-behind (StoreOptions): queued and
  // committed within write_behind_ms; the rate is judged by the time of this call.
  virtual absl::Status AppendAudit(const AuditEntry& entry) = 0;
  // InvalidArgument for a bad or too costly query, DeadlineExceeded when it runs too long,
  // ResourceExhausted when the tenant already has a search running.
  virtual absl::StatusOr<std::vector<AuditEntry>> QueryAudit(const AuditQuery& query) = 0;
  // Periodic upkeep (the manager's reaper calls it): writes pending "suppressed" summaries and
  // deletes rows past retention. Cheap when there is nothing to do.
  virtual absl::Status Maintain() = 0;
  // Aggregates the tenant's egress rows (SQL, bounded by the audit search timeout); the same
  // errors as QueryAudit for a bad query, one running at a time per tenant.
  virtual absl::StatusOr<EgressReport> ReportEgress(const EgressReportQuery& query) {
    return absl::UnimplementedError("egress reports are not supported by this store");
  }
  // Time travel: step logs and steps (StepRecord). Every read is scoped to a tenant: another
  // tenant's environment reads as absent (NotFound / empty).
  virtual absl::Status PutStepLog(const StepLogRecord& rec) { return NoSteps(); }
  virtual absl::StatusOr<StepLogRecord> GetStepLog(const std::string& tenant,
                                                   const std::string& env_id) {
    return NoSteps();
  }
  // Insert or replace (env_id, n).
  virtual absl::Status PutStep(const StepRecord& rec) { return NoSteps(); }
  virtual absl::StatusOr<StepRecord> GetStep(const std::string& tenant, const std::string& env_id,
                                             int64_t n) {
    return NoSteps();
  }
  // Newest first: steps with n < before (before < 0: from the newest), at most `limit`
  // (1..kMaxStepsListed, else InvalidArgument).
  virtual absl::StatusOr<std::vector<StepRecord>> ListSteps(const std::string& tenant,
                                                            const std::string& env_id,
                                                            int64_t before, int limit) {
    return NoSteps();
  }
  virtual absl::StatusOr<int64_t> CountSteps(const std::string& env_id) { return NoSteps(); }
  // Deletes one step row (retention's row cap); fine when absent.
  virtual absl::Status DeleteStep(const std::string& env_id, int64_t n) { return NoSteps(); }
  // Deletes an environment's steps and its step log.
  virtual absl::Status DeleteSteps(const std::string& env_id) { return NoSteps(); }
  // Every environment's steps whose memory snapshot is live (for restart: they are lost).
  virtual absl::StatusOr<std::vector<StepRecord>> ListLiveMemorySteps() { return NoSteps(); }
  // The blob references of every stored step (env_id, n, tenant, manifest_sha, state_json,
  // collected filled; the rest empty), for the blob store's mark-and-sweep (per tenant).
  virtual absl::StatusOr<std::vector<StepRecord>> ListStepBlobRefs() { return NoSteps(); }
  // The environments that have a step log (any tenant), for cleanup after a restart.
  virtual absl::StatusOr<std::vector<StepLogRecord>> ListStepLogs() { return NoSteps(); }

  // Number of audit rows of `tenant` (all tenants when empty); for tests and metrics.
  virtual absl::StatusOr<int64_t> CountAudit(const std::string& tenant) = 0;

 private:
  static absl::Status NoSteps() {
    return absl::UnimplementedError("steps are not supported by this store");
  }
};

}  // namespace esb
