// HTTP GET for index pages and wheels, behind an interface so tests can inject a fake.
//
// The daemon talks to exactly one operator-configured index (and the file hosts it names), so
// every request is bounded: allowed hosts (also across redirects), connect and total timeouts,
// and a body size cap. Bodies stream to a sink so a 200 MB wheel never sits in memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/util.h"

namespace esb::packages {

// The way out for a governed environment's fetches (docs/design.md "Host-side wheel cache"):
// every connection of the request — each redirect hop too — is a fresh socket from `connect`,
// connected to that environment's egress proxy, which decides, DLP-scans and audits it like
// the sandbox's own traffic. The fetcher then speaks forward-proxy HTTP: an absolute-URI GET
// for http, CONNECT host:port and then TLS for https. esbd resolves no name and opens no
// connection of its own for such a request.
struct ProxyRoute {
  // A new stream socket connected to the proxy, within `timeout` (DeadlineExceeded after it).
  std::function<absl::StatusOr<UniqueFd>(std::chrono::milliseconds timeout)> connect;
  // PEM certificate(s) of the environment's CA: the proxy intercepts TLS with leaves it signs.
  // Trusted in addition to the system store and the fetcher's CA bundle (those verify the
  // upstream itself when the policy tunnels the host without inspection). Hostname
  // verification applies either way.
  std::string ca_pem;
};

struct FetchLimits {
  int64_t max_body_bytes = 16 << 20;  // more → ResourceExhausted
  std::chrono::milliseconds connect_timeout{10'000};
  // The whole request including name resolution and redirects.
  std::chrono::milliseconds timeout{120'000};
  int max_redirects = 5;
  // Hosts ("example.org" or "example.org:8080") the request and its redirects may reach. Host
  // and port must match (HostAllowed in url.h): an entry without a port means the default port
  // of the URL's scheme. Empty = only the host and port of the requested URL.
  std::vector<std::string> allowed_hosts;
  std::string accept;  // Accept header; "" = "*/*"
  // Set: through this environment's egress proxy (see ProxyRoute); null: directly.
  std::shared_ptr<const ProxyRoute> proxy;
};

struct HttpResult {
  int status = 0;
  std::string content_type;
  std::string final_url;  // after redirects
  int64_t body_bytes = 0;
};

using BodySink = std::function<absl::Status(std::string_view chunk)>;

class HttpFetcher {
 public:
  virtual ~HttpFetcher() = default;
  // GETs url. On a 2xx the body goes to `sink` (an error from the sink aborts the request and
  // is returned). Errors: non-2xx per HttpStatusError; connection failures → Unavailable;
  // timeouts → DeadlineExceeded; body too large → ResourceExhausted; redirect to a host not
  // allowed → PermissionDenied naming the host. Through a proxy (limits.proxy), a refusal by
  // the environment's egress policy (403 with X-Esb-Blocked) → PermissionDenied naming the
  // host, the rule and the proxy's reason; the proxy's other errors map like an upstream's.
  virtual absl::StatusOr<HttpResult> Get(const std::string& url, const FetchLimits& limits,
                                         const BodySink& sink) = 0;
};

// The Status for a non-2xx answer: 404/410 → NotFound, 401/403 → PermissionDenied,
// 408/429/5xx → Unavailable, others → FailedPrecondition. The message names code and URL.
absl::Status HttpStatusError(int status, const std::string& url);

// True for failures where the server could not be reached or did not answer properly
// (Unavailable, DeadlineExceeded): the caller may fall back to cached data.
bool IsUnreachable(const absl::Status& status);

// Boost.Beast over Asio; https with OpenSSL (system trust store, SNI, hostname verification).
// Direct, or through an environment's egress proxy (FetchLimits::proxy); no other proxies.
// Each Get uses its own io_context, so concurrent calls are independent. A proxy's answers are
// treated as untrusted like an upstream's: the same header, body and time limits apply to
// them, a CONNECT answer must be a bare 2xx head (no bytes before the TLS handshake), and the
// refusal body is read only up to 16 KiB.
//
// `ca_file`: optional PEM bundle of CA certificates trusted IN ADDITION to the system trust
// store, for an index behind an internal CA (a corporate mirror). It is read on every Get (so a
// rotated bundle is picked up without a restart); if it is missing, unreadable or holds no
// certificate, every Get — http too, as redirects may lead to https — fails with
// FailedPrecondition naming the file, before any connection is made. "" = system store only.
//
// A server certificate that does not verify (unknown CA, expired, or not naming the host /
// IP of the URL) → FailedPrecondition with OpenSSL's reason, e.g. "unable to get local issuer
// certificate" or "hostname mismatch". Deliberately not Unavailable: it is a trust or
// configuration problem for the operator, not an outage, so callers do not quietly fall back
// to cached data (IsUnreachable is false). Other handshake failures stay Unavailable.
//
// Name resolution (getaddrinfo) cannot be interrupted, so it runs on a short-lived thread of
// its own and the request stops waiting for it at min(connect_timeout, the request's deadline):
// a hanging DNS server costs a DeadlineExceeded in time, and the thread ends whenever the
// resolver gives up (glibc: at most a few tens of seconds), its late answer dropped.
class BeastHttpFetcher final : public HttpFetcher {
 public:
  // Blocking host name → IP address literals ("192.0.2.1", "2001:db8::1"). The default uses
  // getaddrinfo; tests inject a slow one. Called on a detached thread: it must not refer to
  // anything that may be gone by the time it returns.
  using HostResolver =
      std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host)>;

  explicit BeastHttpFetcher(std::string ca_file = "", HostResolver resolver = nullptr);
  absl::StatusOr<HttpResult> Get(const std::string& url, const FetchLimits& limits,
                                 const BodySink& sink) override;

 private:
  std::string ca_file_;
  HostResolver resolver_;
};

}  // namespace esb::packages
