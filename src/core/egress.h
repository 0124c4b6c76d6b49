// The core's seam to the egress proxy (issue 12; docs/design.md "Egress"). The core decides what
// an environment may reach (policy, intents: governance/policy.h) and pushes every change
// through an EgressControl; the implementation (core/egress_proxy.h: ProxyEgressControl) starts
// and supervises esb-proxy, hands it each environment's listening socket and writes the audit
// events it reports through core/audit. Tests use a fake.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/util.h"
#include "governance/policy.h"

namespace esb {

// Everything the proxy needs to serve one governed environment.
struct EgressAttachment {
  std::string env_id;
  std::string tenant;
  governance::EgressPolicy policy;
  std::vector<governance::ActiveIntent> intents;  // the complete list, absolute expiry
  std::string ca_cert_pem;                        // the environment's CA (governance/tls/ca.h)
  std::string ca_key_pem;
  // Opens a fresh listening socket 127.0.0.1:3128 inside the environment's network namespace
  // (Driver::OpenEgressListener). Called at Attach and again after every proxy restart (the
  // old listener died with the old proxy), so it must stay valid until Detach.
  std::function<absl::StatusOr<UniqueFd>()> open_listener;
};

// The proxy as /healthz shows it.
struct EgressHealth {
  // "disabled" (no proxy binary or egress off: governed environments are refused), "starting",
  // "up", "down" (died; restarting after a backoff: sandboxes' egress fails closed meanwhile).
  std::string state = "disabled";
  std::string detail;        // why disabled / the last exit or error
  int64_t pid = 0;           // the running proxy's pid (0: none)
  int64_t restarts = 0;      // proxy starts after the first
  int64_t since_ms = 0;      // unix ms of the last state change
  int64_t environments = 0;  // attachments esbd holds (each re-attached after a restart)
  int64_t attached = 0;      // of which the proxy currently serves
  int64_t connections = 0;   // the proxy's last Health report
  int64_t requests_total = 0;
  int64_t blocked_total = 0;
  // Fair-share refusals and audit drops the proxy reported (governance/control.h Health).
  int64_t refused_connections = 0;
  int64_t refused_body_budget = 0;
  int64_t refused_dlp_busy = 0;
  int64_t refused_resolve_busy = 0;
  int64_t audit_dropped = 0;
};

class EgressControl {
 public:
  virtual ~EgressControl() = default;
  // After the driver created a kGoverned environment (its netns exists): opens its listener
  // (open_listener) and attaches it to the proxy; remembered (and replaced when called again
  // for the same env_id) for re-attach after a proxy restart. While the proxy is restarting the
  // attachment is kept and sent once it is up (OK: the sandbox fails closed until then). Error
  // (egress disabled, the listener cannot be opened, the proxy refused it): the core destroys
  // the environment and the create fails (503).
  virtual absl::Status Attach(const EgressAttachment& attachment) = 0;
  // Replaces policy and intents (the complete current list). Also used when an intent is
  // activated or removed. The new state is remembered for re-attach even when the proxy
  // cannot be told now (error: 503 to the API client).
  virtual absl::Status Update(const std::string& env_id, const governance::EgressPolicy& policy,
                              const std::vector<governance::ActiveIntent>& intents) = 0;
  // Before the driver destroys the environment; idempotent, never fails.
  virtual void Detach(const std::string& env_id) = 0;
  virtual EgressHealth Health() const = 0;
  // The uid the proxy runs as (it accepts on every environment's listener, so the sockets it
  // accepted are owned by it); nullopt: no proxy process (fakes).
  virtual std::optional<uid_t> ProxyUid() const { return std::nullopt; }
};

}  // namespace esb
