// esb-proxy's engine: every governed environment's egress (docs/design.md "Egress proxy").
//
// One Asio io_context on a small thread pool; one accept loop per attached environment on the
// listener esbd handed over (it lives in the environment's network namespace, so whatever
// connects to it IS that environment); one coroutine per client connection on its own strand.
// Per connection: the request head is read with limits and a deadline, then
//   - absolute-URI HTTP requests are decided (governance/policy.h Decide: allow ∪ active
//     intents, deny wins, expiry checked at request time), DLP-scanned (URL, headers, body
//     buffered up to the cap: a blocked body never reaches the upstream), and forwarded over a
//     kept-alive upstream connection; the response streams back;
//   - CONNECT host:port is decided, resolved and connected, then either tunnelled opaquely (TLS
//     inspection off or the host excluded; audited as "opaque") or intercepted (governance/tls
//     mitm: a leaf for the target from the environment's CA, verified TLS upstream) and the
//     same request loop runs inside the tunnel (Host must equal the CONNECT target, else 421).
// Every request — kept-alive ones and those inside tunnels — is decided again. Names resolve
// through the injected Resolver; resolved private/loopback/link-local/metadata addresses and the
// host's own addresses are refused unless the destination was explicitly allowed. One AuditEvent
// per request or refused connection goes to the sink.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "governance/control.h"
#include "governance/proxy/host_addresses.h"
#include "governance/proxy/resolver.h"

namespace esb::governance::proxy {

struct ProxyOptions {
  int threads = 2;
  size_t max_connections_per_env = 256;
  size_t max_connections_per_tenant = 1024;  // all environments of one tenant
  size_t max_connections_total = 8192;
  // Fair shares between tenants (docs/design.md "Egress proxy", "Fair shares"). Request bodies
  // are buffered whole (up to the policy's max_body_bytes) so that DLP decides before anything
  // goes upstream; the bytes buffered at once are bounded in total and per tenant. A body that
  // does not fit is refused at once: 503, Retry-After, rule "limit:body_budget".
  int64_t body_budget_bytes = int64_t{256} << 20;
  int64_t body_budget_per_tenant_bytes = int64_t{64} << 20;
  // The per-byte work on a body larger than dlp_inline_bytes (the DLP scan, the audit hash)
  // runs on a pool of its own (not the I/O threads), tenants served round-robin, at most
  // dlp_max_running_per_tenant scans of one tenant at once and dlp_max_queued_per_tenant
  // waiting (over it: 503 "limit:dlp_busy").
  int dlp_threads = 2;
  int dlp_max_running_per_tenant = 1;
  size_t dlp_max_queued_per_tenant = 32;
  size_t dlp_inline_bytes = 64 << 10;
  // Tests: called with the body's size inside the per-byte work on a body, where that work runs
  // (inline on an I/O thread or on the DLP pool), e.g. to make it slow. Unset in production.
  std::function<void(size_t body_bytes)> body_work_hook_for_test;
  // Names being resolved at once (over it: 503 "resolve:busy" at once; the resolver also
  // bounds each tenant's share of its threads and its queue).
  size_t max_resolutions_per_env = 8;
  size_t max_resolutions_per_tenant = 32;
  std::chrono::milliseconds header_timeout{10000};  // the first request head of a connection
  std::chrono::milliseconds idle_timeout{60000};    // between requests; an idle tunnel
  std::chrono::milliseconds body_timeout{60000};    // a request body, in total
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds upstream_timeout{60000};  // response head; stall of a response body
  std::chrono::milliseconds tls_handshake_timeout{10000};
  // Extra roots trusted upstream (--egress-upstream-ca) and whether the system's are.
  std::string upstream_ca_file;
  bool use_system_roots = true;
  // The host's own addresses, refused like private ranges (proxy/host_addresses.h): read at
  // Create and again when older than host_addresses_refresh. nullptr: getifaddrs (tests inject).
  HostAddresses::Source host_addresses;
  std::chrono::milliseconds host_addresses_refresh{5000};
  // Wall clock (ms since the epoch) for intent expiry and audit times; injectable for tests.
  std::function<int64_t()> now_ms;
};

using AuditSink = std::function<void(control::AuditEvent)>;

class Proxy {
 public:
  // Starts the I/O threads. `audit` is called from I/O threads (keep it quick, thread-safe).
  static absl::StatusOr<std::unique_ptr<Proxy>> Create(ProxyOptions options,
                                                       std::shared_ptr<Resolver> resolver,
                                                       AuditSink audit);
  ~Proxy();  // Stop()
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Starts serving the environment's listener (takes it from `attach.received_listener`, or
  // dups `attach.listener_fd` when that is unset). Re-attaching an attached env replaces it.
  // InvalidArgument: not a listening TCP socket, bad CA, DLP config that does not compile.
  absl::Status Attach(control::Attach attach);
  // Replaces the policy and intents; the next request of every connection sees them.
  absl::Status Update(const control::Update& update);
  // Closes the listener and every connection of the env. NotFound if not attached.
  absl::Status Detach(std::string_view env_id);
  control::Health Health() const;
  // Closes everything and joins the threads (idempotent).
  void Stop();

  struct Impl;

 private:
  explicit Proxy(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace esb::governance::proxy
