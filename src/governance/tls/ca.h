// Per-environment certificate authority for TLS inspection (issue 12, governance.md §C3/§D.6).
//
// Every governed environment gets its own CA: esbd creates it at environment create
// (GenerateCa), stores the PEM pair, serves the certificate at GET /environments/{id}/ca.pem and
// installs it into the sandbox's trust stores (CombinedBundle + TrustEnvironment). esb-proxy
// loads the pair (Ca::FromPem) and mints one short-lived leaf per host it intercepts
// (LeafMinter). A CA can sign for any name, so its key never enters the sandbox.
#pragma once

#include <openssl/evp.h>
#include <openssl/x509.h>

#include <chrono>
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace esb::governance::tls {

// Owning OpenSSL handles.
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

// A CA as PEM text: what esbd stores and hands to esb-proxy. `key_pem` is an unencrypted
// PKCS#8 private key: a secret (never logged, never inside a sandbox).
struct CaPem {
  std::string cert_pem;
  std::string key_pem;
};

// A fresh CA: P-256 key, self-signed, subject CN=`common_name` O=EnterSandBox, basicConstraints
// critical CA:TRUE pathlen:0, keyUsage critical keyCertSign|cRLSign, subject key id, a random
// 126-bit serial, valid from one hour ago (clock skew) for 10 years. `common_name` must be
// 1..64 printable ASCII characters (e.g. "EnterSandBox env env-1a2b"); else InvalidArgument.
absl::StatusOr<CaPem> GenerateCa(std::string_view common_name);

// A loaded CA (immutable, thread-safe to share).
class Ca {
 public:
  // Parses the pair and checks it: one certificate, CA:TRUE with keyCertSign, the key matches
  // the certificate, and it is within its validity period. InvalidArgument otherwise.
  static absl::StatusOr<std::shared_ptr<const Ca>> FromPem(std::string_view cert_pem,
                                                           std::string_view key_pem);

  X509* cert() const { return cert_.get(); }
  EVP_PKEY* key() const { return key_.get(); }
  const std::string& cert_pem() const { return cert_pem_; }
  // SHA-256 of the DER certificate, lowercase hex (for logs and the API: identifies the CA).
  const std::string& fingerprint_sha256() const { return fingerprint_; }
  // The certificate's notAfter as a Unix time.
  std::chrono::system_clock::time_point not_after() const { return not_after_; }

  Ca(X509Ptr cert, PkeyPtr key, std::string cert_pem, std::string fingerprint,
     std::chrono::system_clock::time_point not_after)
      : cert_(std::move(cert)),
        key_(std::move(key)),
        cert_pem_(std::move(cert_pem)),
        fingerprint_(std::move(fingerprint)),
        not_after_(not_after) {}

 private:
  X509Ptr cert_;
  PkeyPtr key_;
  std::string cert_pem_;
  std::string fingerprint_;
  std::chrono::system_clock::time_point not_after_;
};

// A minted leaf: certificate for one host plus the (shared, per-minter) key.
struct Leaf {
  std::string host;  // normalized: lowercase, no trailing dot; an IP literal without brackets
  X509Ptr cert;
  std::shared_ptr<EVP_PKEY> key;  // the minter's key (one per CA)
  std::chrono::system_clock::time_point not_after;
};

struct LeafOptions {
  // Leaves live this long (never past the CA's notAfter); a cached leaf with less than half of
  // it left is minted again.
  std::chrono::seconds validity = std::chrono::hours(24 * 7);
  // LRU cache size (hosts per CA).
  size_t cache_capacity = 1024;
};

// Normalizes a host for minting and for SNI comparison: lowercase, one trailing dot removed,
// brackets removed from an IPv6 literal. InvalidArgument unless it is an IP literal or a DNS
// name (1..253 chars, labels 1..63 of [a-z0-9-_], no wildcard). Hosts come from untrusted
// CONNECT lines and ClientHellos.
absl::StatusOr<std::string> NormalizeHost(std::string_view host);

// Mints leaves signed by one CA: SAN dNSName or iPAddress = the host, subject CN=<host> when
// ≤ 64 chars (else an empty subject and a critical SAN), CA:FALSE, keyUsage digitalSignature,
// extendedKeyUsage serverAuth, authority key id, random serial, valid from one hour ago for
// LeafOptions::validity (capped at the CA's notAfter).
// One P-256 key for all leaves of this minter (minting then costs one signature, ~0.3 ms).
// Thread-safe; one mint at a time, so concurrent first tunnels to a host share one leaf.
class LeafMinter {
 public:
  static absl::StatusOr<std::shared_ptr<LeafMinter>> Create(std::shared_ptr<const Ca> ca,
                                                            LeafOptions options = {});

  // The cached leaf for `host` (normalized first), or a freshly minted one.
  absl::StatusOr<std::shared_ptr<const Leaf>> LeafFor(std::string_view host);

  const Ca& ca() const { return *ca_; }
  // Leaves minted so far (cache misses), for tests and metrics.
  size_t minted() const;
  size_t cached() const;

  LeafMinter(std::shared_ptr<const Ca> ca, std::shared_ptr<EVP_PKEY> key, LeafOptions options)
      : ca_(std::move(ca)), key_(std::move(key)), options_(options) {}

 private:
  absl::StatusOr<std::shared_ptr<const Leaf>> Mint(const std::string& host) const;
  bool Fresh(const Leaf& leaf, std::chrono::system_clock::time_point now) const;
  // The cached leaf if fresh (and marks it most recently used), else nullptr.
  std::shared_ptr<const Leaf> Lookup(const std::string& host,
                                     std::chrono::system_clock::time_point now);

  std::shared_ptr<const Ca> ca_;
  std::shared_ptr<EVP_PKEY> key_;
  LeafOptions options_;
  std::mutex mint_mu_;  // serializes minting (taken before mu_, never while holding it)
  mutable std::mutex mu_;
  // LRU: most recently used at the front.
  std::list<std::shared_ptr<const Leaf>> lru_;
  std::unordered_map<std::string, std::list<std::shared_ptr<const Leaf>>::iterator> index_;
  size_t minted_ = 0;
};

// The Debian system bundle (what OpenSSL and curl read by default).
inline constexpr std::string_view kSystemBundlePath = "/etc/ssl/certs/ca-certificates.crt";

// The trust bundle for a sandbox: the system bundle's certificates followed by the env CA, as
// PEM bytes. Bind-mounted read-only over the sandbox's system bundle, and pointed to by the
// variables below. A missing system bundle (ENOENT) yields the env CA alone (every intercepted
// connection only needs it); other read errors, a bundle over 16 MiB, or an `env_ca_pem` that
// is not exactly one PEM certificate → error.
absl::StatusOr<std::string> CombinedBundle(const std::string& system_bundle_path,
                                           std::string_view env_ca_pem);

// The environment variables that make common clients trust `bundle_path` (the combined bundle's
// path INSIDE the sandbox): OpenSSL/Python (SSL_CERT_FILE), curl, requests, pip, git, Node
// (NODE_EXTRA_CA_CERTS), AWS CLI/boto, cargo, Deno, gcloud, Nix, npm, bundler, gRPC. SSL_CERT_DIR
// is deliberately not set: the hashed system directory does not hold the env CA, and the file
// is read too. Name → value, in a stable order.
std::vector<std::pair<std::string, std::string>> TrustEnvironment(std::string_view bundle_path);

}  // namespace esb::governance::tls
