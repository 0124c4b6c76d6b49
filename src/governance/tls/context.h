// The two TLS contexts of an intercepted connection (issue 12, governance.md §C3/§D.6):
// - InterceptContext (one per environment): the server side facing the sandbox. Its SNI
//   callback checks the ClientHello's server name against the CONNECT target, mints (or takes
//   from the cache) the leaf for that host and records the SNI. ALPN: http/1.1 only (a client
//   offering only h2 gets no ALPN and speaks HTTP/1.1). TLS ≥ 1.2, no session tickets or
//   resumption, no renegotiation.
// - UpstreamContext (one per esb-proxy process): the client side facing the real server.
//   Verifies against the system roots plus the operator's extra roots (--egress-upstream-ca),
//   with hostname (or IP) verification per connection, SNI, ALPN http/1.1, TLS ≥ 1.2.
#pragma once

#include <openssl/ssl.h>

#include <boost/asio/ssl/context.hpp>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "governance/tls/ca.h"

namespace esb::governance::tls {

// Per-connection state the server context's callbacks read and write, attached to the SSL
// object (SSL ex_data) for the duration of the handshake only.
struct ServerHandshakeState {
  std::string target_host;  // normalized CONNECT target (NormalizeHost)
  std::string sni;          // the ClientHello's server name ("" when none was sent)
  bool sni_mismatch = false;
  std::string mint_error;  // why no certificate could be provided, if so
};

class InterceptContext {
 public:
  static absl::StatusOr<std::shared_ptr<InterceptContext>> Create(
      std::shared_ptr<LeafMinter> minter);

  boost::asio::ssl::context& context() { return ctx_; }
  LeafMinter& minter() { return *minter_; }

  // Attaches `state` to a server-side SSL before its handshake (nullptr detaches). The state
  // must outlive the handshake.
  static void Attach(SSL* ssl, ServerHandshakeState* state);

  explicit InterceptContext(std::shared_ptr<LeafMinter> minter);

 private:
  std::shared_ptr<LeafMinter> minter_;
  boost::asio::ssl::context ctx_;
};

class UpstreamContext {
 public:
  // `extra_roots_file`: PEM certificates trusted in addition to the system roots ("" = none);
  // unreadable or without a certificate → FailedPrecondition naming the file.
  // `use_system_roots` = false is for tests (trust only the extra roots).
  static absl::StatusOr<std::shared_ptr<UpstreamContext>> Create(
      const std::string& extra_roots_file, bool use_system_roots = true);

  boost::asio::ssl::context& context() { return ctx_; }

  // Per connection, before the client handshake: SNI (DNS names only, RFC 6066 §3),
  // verification of the certificate against `host` (DNS name without partial wildcards, or the
  // IP address of an IP literal), ALPN http/1.1. `host` as from NormalizeHost.
  static absl::Status PrepareConnection(SSL* ssl, const std::string& host);

  UpstreamContext();

 private:
  boost::asio::ssl::context ctx_;
};

}  // namespace esb::governance::tls
