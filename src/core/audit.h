// The one audit path (issue 11). Every environment action goes through the core
// (EnvironmentManager, the run pipeline, the package installer), and the core writes its audit
// row here: REST, MCP, the SDKs and the egress proxy only say who is calling (a Caller), so no
// entry point can forget to audit, and all of them write the same rows.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/metrics.h"
#include "storage/store.h"

namespace esb {

// Who asks the core for something. Built by the entry point from what it authenticated.
struct Caller {
  // Implicit from a tenant name: tests and internal callers that only know the tenant.
  Caller(std::string tenant_name) : tenant(std::move(tenant_name)) {}  // NOLINT
  Caller(const char* tenant_name) : tenant(tenant_name) {}             // NOLINT
  Caller(std::string tenant_name, std::string principal_name, std::string channel_name)
      : tenant(std::move(tenant_name)),
        principal(std::move(principal_name)),
        channel(std::move(channel_name)) {}
  // The daemon acting on its own (expiry, dead environments): principal "system".
  static Caller System(std::string tenant_name) {
    return Caller(std::move(tenant_name), "system", "daemon");
  }
  // The same caller for the steps of an operation that is audited as a whole (a run's file
  // writes and execs): those steps write no rows of their own.
  Caller Step() const {
    Caller c = *this;
    c.audited = false;
    return c;
  }

  std::string tenant;
  std::string principal;  // "key_..." (an API key's public id), "dev", "system", ...
  std::string channel;    // "rest", "mcp", "sdk", "proxy", "daemon"
  bool audited = true;
};

// An outcome is recorded with HttpStatusFor(outcome) (common/util.h), the status the API
// answers for it.

// One audit row in the making.
struct AuditEvent {
  std::string environment_id;
  std::string action;  // "environment.create", "execute", "files.write", "run", ...
  std::string detail;  // command, path, code (the store caps it)
  std::optional<int64_t> exit_code;
  int64_t duration_ms = 0;
  int64_t bytes = 0;
  absl::Status outcome;
};

// What the egress proxy did with one request or connection.
enum class EgressDecision {
  kAllowed,   // forwarded as sent
  kBlocked,   // refused by policy or DLP (403, or a refused CONNECT): nothing reached upstream
  kRedacted,  // forwarded with DLP redactions applied
  kOpaque,    // tunnelled without inspection (tls_exclude, tls_inspect=false)
  kError,     // failed on the way (upstream unreachable, TLS failure, timeout, bad request)
};
std::string_view ToString(EgressDecision decision);  // "allowed", "blocked", ...
std::optional<EgressDecision> ParseEgressDecision(std::string_view name);

// The stored size cap of an egress row's body (after redaction); the hash is of the original.
inline constexpr size_t kMaxEgressAuditBodyBytes = kMaxEgressBodyBytes;  // store.h

// One egress audit row in the making: one per proxied request, refused connection or opaque
// tunnel. The proxy fills it (through esbd's EgressControl); AuditLog::RecordEgress stores it
// in the one audit log (action "egress"), searchable with kind=egress and summed in /reports.
struct EgressAuditRow {
  int64_t time_ms = 0;  // unix ms when the request started; 0 = now
  std::string tenant;   // the environment's tenant (required)
  std::string environment_id;
  std::vector<std::string> intents;  // names of the intents active for this request
  std::string method;                // "GET", "POST", "CONNECT" (a refused or opaque tunnel)
  std::string scheme;                // "http", "https" (inspected TLS), "tunnel" (opaque)
  std::string host;                  // as the client asked (CONNECT target or URI host)
  int port = 0;
  std::string path;  // path and query as sent upstream (after redaction); "" for CONNECT
  int status = 0;    // the status the client got (upstream's or the proxy's 403/421/502); 0: none
  EgressDecision decision = EgressDecision::kAllowed;
  // Every rule that decided or fired, e.g. "allow:*.pypi.org", "deny:evil.test",
  // "intent:check-weather", "not_allowed", "private_address", "dlp:credit_card". Ids that
  // start with "dlp:" are DLP findings (counted per type in reports and /metrics).
  std::vector<std::string> rule_ids;
  std::string reason;      // one line for a human: why blocked or failed ("" when allowed)
  int64_t bytes_up = 0;    // request body bytes sent upstream (after redaction)
  int64_t bytes_down = 0;  // response body bytes returned to the client
  int64_t duration_ms = 0;
  // Time the proxy itself added to the request (policy, DLP, TLS minting; excluding the
  // upstream's own time), in microseconds: the /metrics added-latency histogram; 0: unknown.
  int64_t added_latency_us = 0;
  // Request headers as sent upstream, "Name: value" lines separated by "\n" (the proxy's
  // control::AuditEvent form). RecordEgress masks every line again with
  // governance::MaskHeaderValue (the proxy should already have), so a row never stores a
  // credential header in the clear.
  std::string request_headers;
  // The request body after DLP redaction; RecordEgress keeps at most
  // kMaxEgressAuditBodyBytes of it (cut marked).
  std::string body;
  bool body_truncated = false;  // the proxy already cut `body` (marked as cut when stored)
  int64_t body_bytes = 0;       // size of the original (decoded) request body; 0: unknown
  std::string body_sha256;  // lowercase hex SHA-256 of the original body; "" when none
};

// One tool call (issue 14; core/tools/tool_gate.h): the ToolCallGate fills it for every call of
// esbd's own tools and of hosted MCP servers' tools; AuditLog::RecordToolCall stores it as an
// audit row with action "tool.call" (searchable with kind=tool) and counts it in /metrics.
struct ToolCallAuditRow {
  std::string environment_id;  // "" for calls about no environment
  ToolCallFields call;         // tool, server, decision, rules, redacted arguments, result size
  int64_t duration_ms = 0;
  absl::Status outcome;  // the call's protocol-level outcome (a blocked call: PermissionDenied)
};

class AuditLog {
 public:
  AuditLog(Store* store, Metrics* metrics) : store_(store), metrics_(metrics) {}
  // Writes the row unless `caller` is a Step of an operation audited as a whole. A failed
  // write is counted and logged, never fails the action itself.
  void Record(const Caller& caller, const AuditEvent& event);
  // Writes one egress row (principal "proxy") through the same store path (rate, caps,
  // write-behind) and counts it in /metrics (decision, DLP hits per rule, added latency).
  // Masks headers, caps the body; a failed write is counted and logged.
  void RecordEgress(const EgressAuditRow& row);
  // Writes one tool-call row (the call's one row; the core operations a tool runs are Steps of
  // it) and counts it in /metrics. Its detail is "<server>.<tool> <decision> <rules...>" (the
  // FTS-searchable summary); the fields go to AuditEntry::tool_call.
  void RecordToolCall(const Caller& caller, const ToolCallAuditRow& row);

 private:
  Store* store_;
  Metrics* metrics_;
};

}  // namespace esb
