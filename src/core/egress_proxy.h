// ProxyEgressControl: the EgressControl (core/egress.h) esbd runs. It starts esb-proxy as its
// own unprivileged user with one end of a socketpair as the control socket
// (governance/control.h), supervises it (a restart with backoff when it dies, its state in
// /healthz and the log), attaches every governed environment (the listening socket the driver
// opens inside the environment's netns, passed with SCM_RIGHTS) and attaches all of them again
// with fresh listeners after each restart. Every AuditEvent the proxy reports is written through
// the audit sink (core/audit: AuditLog::RecordEgress), with the tenant esbd knows for the
// environment, never the one the proxy claims.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/audit.h"
#include "core/egress.h"
#include "governance/control.h"

namespace esb {

struct ProxyEgressOptions {
  // The esb-proxy executable ("" or missing: egress disabled, governed creates refused).
  std::string proxy_binary;
  std::vector<std::string> resolve;  // NAME=HOST:PORT, each passed as --egress-resolve
  std::string upstream_ca;           // --egress-upstream-ca (opened by esbd, passed as an fd)
  // The proxy's own unprivileged uid and gid (ProxyIdentity()).
  uid_t uid = 0;
  gid_t gid = 0;
  int64_t min_backoff_ms = 100;  // first restart delay, doubled per quick death
  int64_t max_backoff_ms = 5000;
  int64_t stable_after_ms = 10000;   // a proxy up this long resets the backoff
  int64_t ready_timeout_ms = 10000;  // from start to its first Health (ready)
  // How long an Attach waits for a (re)starting proxy before it keeps the attachment for
  // later (one waiter per outage).
  int64_t attach_wait_ms = 10000;
  int64_t result_timeout_ms = 5000;  // an attach/update/detach's Result
};

// The uid/gid esb-proxy runs as: the system user "esb-proxy" when it exists
// (scripts/install-deps.sh creates it), else kProxyFallbackId for both. Never root, never a
// sandbox's range (esbd checks the fallback against userns_uid_base).
inline constexpr uint32_t kProxyFallbackId = 0x6FFFFFFE;  // 1879048190
struct ProxyIdentity {
  uid_t uid;
  gid_t gid;
  std::string source;  // "user esb-proxy" | "fallback id 1879048190"
};
ProxyIdentity FindProxyIdentity();

// Converts one proxy report to an audit row. `tenant` is esbd's record of the environment's
// tenant (the proxy's claim is ignored).
EgressAuditRow ToAuditRow(const governance::control::AuditEvent& event, const std::string& tenant);

class ProxyEgressControl : public EgressControl {
 public:
  using AuditSink = std::function<void(const EgressAuditRow&)>;
  ProxyEgressControl(ProxyEgressOptions options, AuditSink audit_sink);
  ~ProxyEgressControl() override;  // Stop()
  ProxyEgressControl(const ProxyEgressControl&) = delete;
  ProxyEgressControl& operator=(const ProxyEgressControl&) = delete;

  // Starts the supervisor (which starts the proxy). Disabled (Health "disabled", governed
  // creates refused) when the binary is missing; returns that reason as an error.
  absl::Status Start();
  // Stops the supervisor and the proxy (its listeners close: sandboxes fail closed).
  void Stop();

  absl::Status Attach(const EgressAttachment& attachment) override;
  absl::Status Update(const std::string& env_id, const governance::EgressPolicy& policy,
                      const std::vector<governance::ActiveIntent>& intents) override;
  void Detach(const std::string& env_id) override;
  EgressHealth Health() const override;
  std::optional<uid_t> ProxyUid() const override { return options_.uid; }

  // Waits until the proxy is up and serves every attachment (tests), false on timeout.
  bool WaitUntilServing(int64_t timeout_ms);

 private:
  struct Entry {
    EgressAttachment attachment;
    bool attached = false;  // the current proxy serves it
  };
  using Client = governance::control::ControlClient;

  void SupervisorLoop();
  // Starts one proxy process; its pid and esbd's end of the control socket.
  absl::StatusOr<pid_t> Spawn(UniqueFd* control);
  // Sends one attachment to the proxy `client` (a fresh listener) and waits for its Result.
  absl::Status SendAttach(const std::shared_ptr<Client>& client, uint64_t generation,
                          const EgressAttachment& attachment);
  // Waits for the Result of request `seq` of generation `generation`.
  absl::Status AwaitResult(uint64_t generation, uint32_t seq);
  void ReattachAll(const std::shared_ptr<Client>& client, uint64_t generation);
  void OnAudit(governance::control::AuditEvent event);
  void SetState(const std::string& state, const std::string& detail);
  std::string TenantOf(const std::string& env_id);

  const ProxyEgressOptions options_;
  const AuditSink audit_sink_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  bool stopping_ = false;
  std::map<std::string, Entry> entries_;  // by env id
  // Tenants of recently detached environments (their last requests may still be reported).
  std::map<std::string, std::string> detached_tenants_;
  std::shared_ptr<Client> client_;  // the running proxy's control client (null: none)
  uint64_t generation_ = 0;         // proxy starts so far; Results are per generation
  bool ready_ = false;              // the current proxy sent its first Health
  bool closed_ = false;             // the current proxy's control socket closed
  std::string close_reason_;
  // The current proxy is up and ReattachAll took its list: Attach sends new ones itself.
  bool serving_ = false;
  bool attach_wait_expired_ = false;  // an Attach waited for the proxy in vain this outage
  std::map<uint32_t, governance::control::Result> results_;  // of the current generation
  EgressHealth health_;
  std::thread supervisor_;
};

}  // namespace esb
