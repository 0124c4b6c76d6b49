#include "governance/tls/context.h"

#include <openssl/err.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace esb::governance::tls {
namespace {

namespace ssl = boost::asio::ssl;

// ALPN wire format: one protocol, HTTP/1.1 (Beast has no h2; clients fall back).
constexpr unsigned char kAlpnHttp11[] = {8, 'h', 't', 't', 'p', '/', '1', '.', '1'};

// Longest SNI we record (a DNS name is at most 253 characters; anything longer is refused as
// a mismatch anyway).
constexpr size_t kMaxRecordedSni = 255;

int StateIndex() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

// SNI callback (runs for every ClientHello, with or without a server_name extension): checks the
// name against the CONNECT target and installs the leaf for the target on this connection.
// SECURITY: a leaf is only ever minted for the CONNECT target the policy approved, never for a
// name the client chose; the client cannot make the proxy speak for another host.
int OnServerName(SSL* ssl, int* alert, void* arg) {
  auto* self = static_cast<InterceptContext*>(arg);
  auto* state = static_cast<ServerHandshakeState*>(SSL_get_ex_data(ssl, StateIndex()));
  if (state == nullptr) {  // not attached (or a renegotiation attempt after the handshake)
    *alert = SSL_AD_INTERNAL_ERROR;
    return SSL_TLSEXT_ERR_ALERT_FATAL;
  }
  if (const char* name = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name); name != nullptr) {
    state->sni.assign(name, strnlen(name, kMaxRecordedSni));
    absl::StatusOr<std::string> normalized = NormalizeHost(state->sni);
    if (!normalized.ok() || *normalized != state->target_host) {
      state->sni_mismatch = true;
      *alert = SSL_AD_UNRECOGNIZED_NAME;
      return SSL_TLSEXT_ERR_ALERT_FATAL;
    }
  }
  absl::StatusOr<std::shared_ptr<const Leaf>> leaf = self->minter().LeafFor(state->target_host);
  if (!leaf.ok()) {
    state->mint_error = leaf.status().ToString();
    *alert = SSL_AD_INTERNAL_ERROR;
    return SSL_TLSEXT_ERR_ALERT_FATAL;
  }
  // Both calls take their own references; the leaf may leave the cache meanwhile.
  if (SSL_use_certificate(ssl, (*leaf)->cert.get()) != 1 ||
      SSL_use_PrivateKey(ssl, (*leaf)->key.get()) != 1) {
    state->mint_error = "cannot install the leaf certificate";
    ERR_clear_error();
    *alert = SSL_AD_INTERNAL_ERROR;
    return SSL_TLSEXT_ERR_ALERT_FATAL;
  }
  return SSL_TLSEXT_ERR_OK;
}

// ALPN: select http/1.1 if offered; otherwise no ALPN at all (the client then speaks HTTP/1.1 or
// gives up), never h2.
int OnAlpn(SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in,
           unsigned int inlen, void*) {
  unsigned char* selected = nullptr;
  if (SSL_select_next_proto(&selected, outlen, kAlpnHttp11, sizeof(kAlpnHttp11), in, inlen) !=
      OPENSSL_NPN_NEGOTIATED) {
    return SSL_TLSEXT_ERR_NOACK;
  }
  *out = selected;
  return SSL_TLSEXT_ERR_OK;
}

// Settings both sides share: TLS 1.2 at least, no renegotiation, no compression.
absl::Status CommonSettings(SSL_CTX* ctx) {
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1) {
    return absl::InternalError("cannot require TLS 1.2");
  }
  return absl::OkStatus();
}

}  // namespace

InterceptContext::InterceptContext(std::shared_ptr<LeafMinter> minter)
    : minter_(std::move(minter)), ctx_(ssl::context::tls_server) {}

absl::StatusOr<std::shared_ptr<InterceptContext>> InterceptContext::Create(
    std::shared_ptr<LeafMinter> minter) {
  if (minter == nullptr) return absl::InvalidArgumentError("InterceptContext needs a minter");
  if (StateIndex() < 0) return absl::InternalError("SSL_get_ex_new_index failed");
  auto self = std::make_shared<InterceptContext>(std::move(minter));
  SSL_CTX* ctx = self->ctx_.native_handle();
  if (auto s = CommonSettings(ctx); !s.ok()) return s;
  // Every connection does a full handshake (and so passes the SNI check and gets a leaf for
  // its own target): no session cache, no tickets, so nothing carries over between tunnels.
  SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET | SSL_OP_CIPHER_SERVER_PREFERENCE);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_num_tickets(ctx, 0);
  // Fast, widely supported key exchanges only (no finite-field DH: slow, and a CPU lever for a
  // hostile client); a client whose first key share is another group gets a HelloRetryRequest.
  if (SSL_CTX_set1_groups_list(ctx, "X25519:P-256:P-384") != 1) {
    return absl::InternalError("cannot set the TLS key-exchange groups");
  }
  SSL_CTX_set_tlsext_servername_callback(ctx, OnServerName);
  SSL_CTX_set_tlsext_servername_arg(ctx, self.get());
  SSL_CTX_set_alpn_select_cb(ctx, OnAlpn, nullptr);
  return self;
}

void InterceptContext::Attach(SSL* ssl, ServerHandshakeState* state) {
  SSL_set_ex_data(ssl, StateIndex(), state);
}

UpstreamContext::UpstreamContext() : ctx_(ssl::context::tls_client) {}

absl::StatusOr<std::shared_ptr<UpstreamContext>> UpstreamContext::Create(
    const std::string& extra_roots_file, bool use_system_roots) {
  auto self = std::make_shared<UpstreamContext>();
  SSL_CTX* ctx = self->ctx_.native_handle();
  if (auto s = CommonSettings(ctx); !s.ok()) return s;
  boost::system::error_code ec;
  if (use_system_roots) {
    // A broken system store is not fatal on its own: the extra roots may suffice, and otherwise
    // every upstream fails verification with a clear reason.
    self->ctx_.set_default_verify_paths(ec);
  }
  self->ctx_.set_verify_mode(ssl::verify_peer);
  // ALPN offer (SSL_CTX_set_alpn_protos returns 0 on success).
  if (SSL_CTX_set_alpn_protos(ctx, kAlpnHttp11, sizeof(kAlpnHttp11)) != 0) {
    return absl::InternalError("cannot set ALPN");
  }
  if (extra_roots_file.empty()) return self;
  // OpenSSL reports a missing file only as "system lib"; name the errno ourselves.
  if (FILE* f = std::fopen(extra_roots_file.c_str(), "r"); f == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot read the upstream CA file '", extra_roots_file, "': ", std::strerror(errno)));
  } else {
    std::fclose(f);
  }
  self->ctx_.load_verify_file(extra_roots_file, ec);
  if (ec) {
    ERR_clear_error();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load the upstream CA file '", extra_roots_file,
                     "' (expected PEM certificates): ", ec.message()));
  }
  return self;
}

absl::Status UpstreamContext::PrepareConnection(SSL* ssl, const std::string& host) {
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  // SECURITY: the upstream certificate must name the CONNECT target (DNS name, or the IP
  // address of an IP literal); OpenSSL checks it during the handshake.
  if (X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) == 1) return absl::OkStatus();
  ERR_clear_error();
  if (SSL_set1_host(ssl, host.c_str()) != 1 || SSL_set_tlsext_host_name(ssl, host.c_str()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("cannot set the TLS server name ", host));
  }
  return absl::OkStatus();
}

}  // namespace esb::governance::tls
