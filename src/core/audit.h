// The one audit path (issue 11). Every environment action goes through the core
// (EnvironmentManager, the run pipeline, the package installer), and the core writes its audit
// row here: REST, MCP, the SDKs and the egress proxy only say who is calling (a Caller), so no
// entry point can forget to audit, and all of them write the same rows.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

class AuditLog {
 public:
  AuditLog(Store* store, Metrics* metrics) : store_(store), metrics_(metrics) {}
  // Writes the row unless `caller` is a Step of an operation audited as a whole. A failed
  // write is counted and logged, never fails the action itself.
  void Record(const Caller& caller, const AuditEvent& event);

 private:
  Store* store_;
  Metrics* metrics_;
};

}  // namespace esb
