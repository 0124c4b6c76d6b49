#include "governance/tls/ca.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace esb::governance::tls {
namespace {

using Clock = std::chrono::system_clock;

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct ExtDeleter {
  void operator()(X509_EXTENSION* e) const { X509_EXTENSION_free(e); }
};
struct NameDeleter {
  void operator()(X509_NAME* n) const { X509_NAME_free(n); }
};
struct PkeyCtxDeleter {
  void operator()(EVP_PKEY_CTX* c) const { EVP_PKEY_CTX_free(c); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;

constexpr auto kBackdate = std::chrono::hours(1);
constexpr auto kCaValidity = std::chrono::hours(24 * 3653);  // 10 years incl. leap days
constexpr size_t kMaxBundleBytes = 16 << 20;

// The OpenSSL error queue as text (and cleared), for messages.
std::string OpenSslErrors() {
  std::string out;
  unsigned long e;
  while ((e = ERR_get_error()) != 0) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

absl::Status OpenSslError(std::string_view what) {
  return absl::InternalError(absl::StrCat(std::string(what), ": ", OpenSslErrors()));
}

absl::StatusOr<PkeyPtr> NewP256Key() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (key == nullptr) return OpenSslError("generating a P-256 key");
  return key;
}

// A random serial: 16 octets, positive, top bits 01 so it is never zero or shortened (RFC 5280
// §4.1.2.2: positive, at most 20 octets); 126 random bits.
absl::Status SetRandomSerial(X509* cert) {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) return OpenSslError("random serial");
  bytes[0] = (bytes[0] & 0x3f) | 0x40;
  BIGNUM* bn = BN_bin2bn(bytes, sizeof(bytes), nullptr);
  if (bn == nullptr) return OpenSslError("serial");
  ASN1_INTEGER* serial = X509_get_serialNumber(cert);
  bool ok = BN_to_ASN1_INTEGER(bn, serial) != nullptr;
  BN_free(bn);
  if (!ok) return OpenSslError("serial");
  return absl::OkStatus();
}

absl::Status SetValidity(X509* cert, Clock::time_point not_before, Clock::time_point not_after) {
  time_t nb = Clock::to_time_t(not_before);
  time_t na = Clock::to_time_t(not_after);
  if (ASN1_TIME_set(X509_getm_notBefore(cert), nb) == nullptr ||
      ASN1_TIME_set(X509_getm_notAfter(cert), na) == nullptr) {
    return OpenSslError("validity");
  }
  return absl::OkStatus();
}

// Adds one extension given in openssl.cnf syntax (the values here are constants of ours).
absl::Status AddExt(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
  std::unique_ptr<X509_EXTENSION, ExtDeleter> ext(X509V3_EXT_conf_nid(nullptr, ctx, nid, value));
  if (ext == nullptr || X509_add_ext(cert, ext.get(), -1) != 1) {
    return OpenSslError(absl::StrCat("extension ", OBJ_nid2sn(nid), "=", value));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ToPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) return OpenSslError("PEM");
  char* data = nullptr;
  long len = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(len));
}

absl::StatusOr<std::string> KeyToPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr ||
      PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslError("key PEM");
  }
  char* data = nullptr;
  long len = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(len));
}

Clock::time_point FromAsn1Time(const ASN1_TIME* t) {
  struct tm tm {};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return Clock::time_point::min();
  return Clock::from_time_t(timegm(&tm));
}

std::string Sha256Hex(X509* cert) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  X509_digest(cert, EVP_sha256(), md, &len);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += kHex[md[i] >> 4];
    out += kHex[md[i] & 15];
  }
  return out;
}

// The canonical text of an IP literal (inet_ntop: lowercase, IPv6 compressed), or "" if `host`
// is not one.
std::string CanonicalIp(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  char text[INET6_ADDRSTRLEN];
  for (int af : {AF_INET, AF_INET6}) {
    if (inet_pton(af, host.c_str(), buf) == 1 && inet_ntop(af, buf, text, sizeof(text))) {
      return text;
    }
  }
  return "";
}

bool IsIpLiteral(const std::string& host) { return !CanonicalIp(host).empty(); }

// Reads a CA bundle file: a regular file of at most kMaxBundleBytes. ENOENT → "" (no system
// bundle on this host).
absl::StatusOr<std::string> ReadBundleFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (errno == ENOENT) return std::string();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open the CA bundle '", path, "': ", std::strerror(errno)));
  }
  std::string out;
  struct stat st {};
  absl::Status status;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::FailedPreconditionError(
        absl::StrCat("the CA bundle '", path, "' is not a regular file"));
  } else if (static_cast<uint64_t>(st.st_size) > kMaxBundleBytes) {
    status =
        absl::FailedPreconditionError(absl::StrCat("the CA bundle '", path, "' is over 16 MiB"));
  } else {
    char buf[65536];
    for (;;) {
      ssize_t n = read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        status = absl::FailedPreconditionError(
            absl::StrCat("cannot read the CA bundle '", path, "': ", std::strerror(errno)));
        break;
      }
      if (n == 0) break;
      out.append(buf, static_cast<size_t>(n));
      if (out.size() > kMaxBundleBytes) {
        status = absl::FailedPreconditionError(
            absl::StrCat("the CA bundle '", path, "' is over 16 MiB"));
        break;
      }
    }
  }
  close(fd);
  if (!status.ok()) return status;
  return out;
}

}  // namespace

absl::StatusOr<CaPem> GenerateCa(std::string_view common_name) {
  if (common_name.empty() || common_name.size() > 64) {
    return absl::InvalidArgumentError("CA common name must be 1..64 characters");
  }
  for (char c : common_name) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("CA common name must be printable ASCII");
    }
  }
  auto key = NewP256Key();
  if (!key.ok()) return key.status();
  X509Ptr cert(X509_new());
  if (cert == nullptr || X509_set_version(cert.get(), X509_VERSION_3) != 1) {
    return OpenSslError("new certificate");
  }
  if (auto s = SetRandomSerial(cert.get()); !s.ok()) return s;
  Clock::time_point now = Clock::now();
  if (auto s = SetValidity(cert.get(), now - kBackdate, now + kCaValidity); !s.ok()) return s;
  X509_NAME* name = X509_get_subject_name(cert.get());
  const std::string cn(common_name);
  if (X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                                 reinterpret_cast<const unsigned char*>("EnterSandBox"), -1, -1,
                                 0) != 1 ||
      X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                 reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1,
                                 0) != 1 ||
      X509_set_issuer_name(cert.get(), name) != 1 || X509_set_pubkey(cert.get(), key->get()) != 1) {
    return OpenSslError("CA name");
  }
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, cert.get(), cert.get(), nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                            std::pair{NID_key_usage, "critical,keyCertSign,cRLSign"},
                            std::pair{NID_subject_key_identifier, "hash"}}) {
    if (auto s = AddExt(cert.get(), &ctx, nid, value); !s.ok()) return s;
  }
  if (X509_sign(cert.get(), key->get(), EVP_sha256()) == 0) return OpenSslError("signing the CA");
  CaPem out;
  auto cert_pem = ToPem(cert.get());
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = KeyToPem(key->get());
  if (!key_pem.ok()) return key_pem.status();
  out.cert_pem = std::move(*cert_pem);
  out.key_pem = std::move(*key_pem);
  return out;
}

absl::StatusOr<std::shared_ptr<const Ca>> Ca::FromPem(std::string_view cert_pem,
                                                      std::string_view key_pem) {
  BioPtr cbio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())));
  X509Ptr cert(cbio ? PEM_read_bio_X509(cbio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("CA certificate is not a PEM certificate");
  }
  if (X509* extra = PEM_read_bio_X509(cbio.get(), nullptr, nullptr, nullptr); extra != nullptr) {
    X509_free(extra);
    return absl::InvalidArgumentError("CA certificate PEM holds more than one certificate");
  }
  ERR_clear_error();
  BioPtr kbio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
  // A null password callback + empty password: an encrypted key fails instead of prompting.
  PkeyPtr key(kbio ? PEM_read_bio_PrivateKey(kbio.get(), nullptr, nullptr, const_cast<char*>(""))
                   : nullptr);
  if (key == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("CA key is not an unencrypted PEM private key");
  }
  if (X509_check_ca(cert.get()) != 1 ||
      (X509_get_extension_flags(cert.get()) & EXFLAG_BCONS) == 0 ||
      (X509_get_key_usage(cert.get()) & KU_KEY_CERT_SIGN) == 0) {
    return absl::InvalidArgumentError("CA certificate is not a CA (CA:TRUE with keyCertSign)");
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("CA key does not match the CA certificate");
  }
  Clock::time_point now = Clock::now();
  Clock::time_point not_before = FromAsn1Time(X509_get0_notBefore(cert.get()));
  Clock::time_point not_after = FromAsn1Time(X509_get0_notAfter(cert.get()));
  if (now < not_before || now >= not_after) {
    return absl::InvalidArgumentError("CA certificate is outside its validity period");
  }
  auto pem = ToPem(cert.get());
  if (!pem.ok()) return pem.status();
  std::string fingerprint = Sha256Hex(cert.get());
  return std::make_shared<const Ca>(std::move(cert), std::move(key), std::move(*pem),
                                    std::move(fingerprint), not_after);
}

absl::StatusOr<std::string> NormalizeHost(std::string_view host_in) {
  std::string host = absl::AsciiStrToLower(std::string(host_in));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    std::string ip = CanonicalIp(host);
    if (host.find(':') == std::string::npos || ip.empty()) {
      return absl::InvalidArgumentError("bracketed host is not an IPv6 address");
    }
    return ip;
  }
  if (!host.empty() && host.back() == '.') host.pop_back();
  if (host.empty() || host.size() > 253) {
    return absl::InvalidArgumentError("host name must be 1..253 characters");
  }
  if (std::string ip = CanonicalIp(host); !ip.empty()) return ip;
  for (absl::string_view label : absl::StrSplit(host, '.')) {
    if (label.empty() || label.size() > 63) {
      return absl::InvalidArgumentError("host name has an empty or over-long label");
    }
    for (char c : label) {
      bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
      if (!ok) {
        return absl::InvalidArgumentError(
            "host name may contain only letters, digits, '-', '_' and '.'");
      }
    }
  }
  return host;
}

absl::StatusOr<std::shared_ptr<LeafMinter>> LeafMinter::Create(std::shared_ptr<const Ca> ca,
                                                               LeafOptions options) {
  if (ca == nullptr) return absl::InvalidArgumentError("LeafMinter needs a CA");
  if (options.cache_capacity == 0) options.cache_capacity = 1;
  if (options.validity < std::chrono::hours(1)) options.validity = std::chrono::hours(1);
  auto key = NewP256Key();
  if (!key.ok()) return key.status();
  std::shared_ptr<EVP_PKEY> shared(key->release(), EVP_PKEY_free);
  return std::make_shared<LeafMinter>(std::move(ca), std::move(shared), options);
}

absl::StatusOr<std::shared_ptr<const Leaf>> LeafMinter::Mint(const std::string& host) const {
  X509Ptr cert(X509_new());
  if (cert == nullptr || X509_set_version(cert.get(), X509_VERSION_3) != 1) {
    return OpenSslError("new certificate");
  }
  if (auto s = SetRandomSerial(cert.get()); !s.ok()) return s;
  Clock::time_point now = Clock::now();
  Clock::time_point not_after = std::min(now + options_.validity, ca_->not_after());
  if (not_after <= now) return absl::FailedPreconditionError("the environment CA has expired");
  if (auto s = SetValidity(cert.get(), now - kBackdate, not_after); !s.ok()) return s;
  X509_NAME* name = X509_get_subject_name(cert.get());
  // CN is at most 64 characters (RFC 5280 ub-common-name); the SAN is what clients check.
  if (host.size() <= 64 &&
      X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                 reinterpret_cast<const unsigned char*>(host.c_str()), -1, -1,
                                 0) != 1) {
    return OpenSslError("leaf name");
  }
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_->cert())) != 1 ||
      X509_set_pubkey(cert.get(), key_.get()) != 1) {
    return OpenSslError("leaf issuer");
  }
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, ca_->cert(), cert.get(), nullptr, nullptr, 0);
  // RFC 5280 §4.2.1.6: with an empty subject the SAN must be critical.
  const std::string san =
      absl::StrCat(host.size() > 64 ? "critical," : "", IsIpLiteral(host) ? "IP:" : "DNS:", host);
  for (auto [nid, value] :
       {std::pair{NID_basic_constraints, "critical,CA:FALSE"},
        std::pair{NID_key_usage, "critical,digitalSignature"},
        std::pair{NID_ext_key_usage, "serverAuth"}, std::pair{NID_subject_key_identifier, "hash"},
        std::pair{NID_authority_key_identifier, "keyid:always"},
        std::pair{NID_subject_alt_name, san.c_str()}}) {
    if (auto s = AddExt(cert.get(), &ctx, nid, value); !s.ok()) return s;
  }
  if (X509_sign(cert.get(), ca_->key(), EVP_sha256()) == 0) {
    return OpenSslError("signing a leaf");
  }
  auto leaf = std::make_shared<Leaf>();
  leaf->host = host;
  leaf->cert = std::move(cert);
  leaf->key = key_;
  leaf->not_after = not_after;
  return std::shared_ptr<const Leaf>(std::move(leaf));
}

// Fresh enough: more than half of the validity left (or capped by the CA's end and still valid).
bool LeafMinter::Fresh(const Leaf& leaf, std::chrono::system_clock::time_point now) const {
  return leaf.not_after - now > options_.validity / 2 ||
         (leaf.not_after >= ca_->not_after() && leaf.not_after > now);
}

std::shared_ptr<const Leaf> LeafMinter::Lookup(const std::string& host,
                                               std::chrono::system_clock::time_point now) {
  std::lock_guard lock(mu_);
  auto it = index_.find(host);
  if (it == index_.end() || !Fresh(**it->second, now)) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return *it->second;
}

absl::StatusOr<std::shared_ptr<const Leaf>> LeafMinter::LeafFor(std::string_view host_in) {
  auto host = NormalizeHost(host_in);
  if (!host.ok()) return host.status();
  if (auto leaf = Lookup(*host, Clock::now())) return leaf;
  // One mint at a time per minter (a burst of tunnels to a new host mints once); cache hits take
  // only mu_ and never wait for a signature.
  std::lock_guard mint_lock(mint_mu_);
  if (auto leaf = Lookup(*host, Clock::now())) return leaf;
  auto minted = Mint(*host);
  if (!minted.ok()) return minted.status();
  std::lock_guard lock(mu_);
  ++minted_;
  if (auto it = index_.find(*host); it != index_.end()) {
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.push_front(*minted);
  index_[*host] = lru_.begin();
  while (lru_.size() > options_.cache_capacity) {
    index_.erase(lru_.back()->host);
    lru_.pop_back();
  }
  return *minted;
}

size_t LeafMinter::minted() const {
  std::lock_guard lock(mu_);
  return minted_;
}

size_t LeafMinter::cached() const {
  std::lock_guard lock(mu_);
  return lru_.size();
}

absl::StatusOr<std::string> CombinedBundle(const std::string& system_bundle_path,
                                           std::string_view env_ca_pem) {
  // The env CA: exactly one certificate.
  {
    BioPtr bio(BIO_new_mem_buf(env_ca_pem.data(), static_cast<int>(env_ca_pem.size())));
    X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
    X509* extra = cert ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr;
    ERR_clear_error();
    if (cert == nullptr || extra != nullptr) {
      X509_free(extra);
      return absl::InvalidArgumentError("the environment CA must be exactly one PEM certificate");
    }
  }
  std::string out;
  if (!system_bundle_path.empty()) {
    auto system = ReadBundleFile(system_bundle_path);
    if (!system.ok()) return system.status();
    out = std::move(*system);
    if (!out.empty() && out.back() != '\n') out += '\n';
  }
  out += "# EnterSandBox environment CA (TLS inspection by the egress proxy)\n";
  out.append(env_ca_pem);
  if (!out.empty() && out.back() != '\n') out += '\n';
  return out;
}

std::vector<std::pair<std::string, std::string>> TrustEnvironment(std::string_view bundle_path) {
  const std::string path(bundle_path);
  std::vector<std::pair<std::string, std::string>> vars;
  for (const char* name : {
           "SSL_CERT_FILE",                       // OpenSSL, Python ssl/urllib, Ruby, Go
           "CURL_CA_BUNDLE",                      // curl, and requests as a fallback
           "REQUESTS_CA_BUNDLE",                  // Python requests (else certifi)
           "PIP_CERT",                            // pip (else its vendored certifi)
           "GIT_SSL_CAINFO",                      // git over https
           "NODE_EXTRA_CA_CERTS",                 // Node (added to its bundled roots)
           "NPM_CONFIG_CAFILE",                   // npm
           "AWS_CA_BUNDLE",                       // AWS CLI, boto3
           "CARGO_HTTP_CAINFO",                   // cargo
           "DENO_CERT",                           // Deno
           "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE",  // gcloud
           "NIX_SSL_CERT_FILE",                   // Nix
           "BUNDLE_SSL_CA_CERT",                  // Ruby bundler
           "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",    // gRPC core
           "HTTPLIB2_CA_CERTS",                   // httplib2 (Google API clients)
       }) {
    vars.emplace_back(name, path);
  }
  return vars;
}

}  // namespace esb::governance::tls
