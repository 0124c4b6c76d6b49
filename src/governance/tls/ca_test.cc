#include "governance/tls/ca.h"

#include <gtest/gtest.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>

namespace esb::governance::tls {
namespace {

using Clock = std::chrono::system_clock;

X509Ptr ParseCert(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  return X509Ptr(cert);
}

int CountCerts(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  int n = 0;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    X509_free(cert);
    ++n;
  }
  ERR_clear_error();
  BIO_free(bio);
  return n;
}

Clock::time_point ToTime(const ASN1_TIME* t) {
  struct tm tm {};
  EXPECT_EQ(ASN1_TIME_to_tm(t, &tm), 1);
  return Clock::from_time_t(timegm(&tm));
}

bool ExtensionCritical(X509* cert, int nid) {
  int at = X509_get_ext_by_NID(cert, nid, -1);
  return at >= 0 && X509_EXTENSION_get_critical(X509_get_ext(cert, at)) == 1;
}

std::string SerialHex(X509* cert) {
  BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get_serialNumber(cert), nullptr);
  char* hex = BN_bn2hex(bn);
  std::string out(hex);
  OPENSSL_free(hex);
  BN_free(bn);
  return out;
}

// Verifies `leaf` against `ca` as a TLS server certificate for `host` (a DNS name or an IP
// literal) with OpenSSL's own chain and name checks. Returns the X509_V_* result.
int VerifyFor(const Ca& ca, X509* leaf, const std::string& host) {
  X509_STORE* store = X509_STORE_new();
  X509_STORE_add_cert(store, ca.cert());
  X509_STORE_CTX* ctx = X509_STORE_CTX_new();
  X509_STORE_CTX_init(ctx, store, leaf, nullptr);
  X509_VERIFY_PARAM* param = X509_STORE_CTX_get0_param(ctx);
  X509_VERIFY_PARAM_set_purpose(param, X509_PURPOSE_SSL_SERVER);
  // Strict RFC 5280 checks, as Python ≥ 3.13's default context does (VERIFY_X509_STRICT).
  X509_VERIFY_PARAM_set_flags(param, X509_V_FLAG_X509_STRICT);
  if (X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) != 1) {
    X509_VERIFY_PARAM_set1_host(param, host.c_str(), 0);
  }
  int ok = X509_verify_cert(ctx);
  int err = ok == 1 ? X509_V_OK : X509_STORE_CTX_get_error(ctx);
  X509_STORE_CTX_free(ctx);
  X509_STORE_free(store);
  ERR_clear_error();
  return err;
}

std::shared_ptr<const Ca> NewCa(const std::string& cn = "EnterSandBox test env") {
  auto pem = GenerateCa(cn);
  EXPECT_TRUE(pem.ok()) << pem.status();
  auto ca = Ca::FromPem(pem->cert_pem, pem->key_pem);
  EXPECT_TRUE(ca.ok()) << ca.status();
  return *ca;
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/esb_tls_test_" + std::to_string(getpid()) + "_" + name;
}

TEST(CaTest, GeneratedCaIsAP256PathlenZeroSigningCa) {
  auto pem = GenerateCa("EnterSandBox env e-1");
  ASSERT_TRUE(pem.ok()) << pem.status();
  X509Ptr cert = ParseCert(pem->cert_pem);
  ASSERT_NE(cert, nullptr);

  // Key: EC P-256.
  EVP_PKEY* pub = X509_get0_pubkey(cert.get());
  ASSERT_NE(pub, nullptr);
  EXPECT_EQ(EVP_PKEY_get_base_id(pub), EVP_PKEY_EC);
  char curve[64] = {};
  size_t curve_len = 0;
  ASSERT_EQ(EVP_PKEY_get_utf8_string_param(pub, "group", curve, sizeof(curve), &curve_len), 1);
  EXPECT_STREQ(curve, "prime256v1");

  // basicConstraints critical CA:TRUE pathlen:0; keyUsage critical keyCertSign|cRLSign only.
  EXPECT_EQ(X509_check_ca(cert.get()), 1);
  EXPECT_TRUE(ExtensionCritical(cert.get(), NID_basic_constraints));
  EXPECT_EQ(X509_get_pathlen(cert.get()), 0);
  EXPECT_TRUE(ExtensionCritical(cert.get(), NID_key_usage));
  EXPECT_EQ(X509_get_key_usage(cert.get()), static_cast<uint32_t>(KU_KEY_CERT_SIGN | KU_CRL_SIGN));
  EXPECT_GE(X509_get_ext_by_NID(cert.get(), NID_subject_key_identifier, -1), 0);

  // Self-signed, subject as asked.
  EXPECT_EQ(X509_verify(cert.get(), pub), 1);
  EXPECT_EQ(X509_NAME_cmp(X509_get_subject_name(cert.get()), X509_get_issuer_name(cert.get())), 0);
  char cn[128] = {};
  X509_NAME_get_text_by_NID(X509_get_subject_name(cert.get()), NID_commonName, cn, sizeof(cn));
  EXPECT_STREQ(cn, "EnterSandBox env e-1");

  // Validity: already valid (backdated), ten years.
  Clock::time_point now = Clock::now();
  Clock::time_point not_before = ToTime(X509_get0_notBefore(cert.get()));
  Clock::time_point not_after = ToTime(X509_get0_notAfter(cert.get()));
  EXPECT_LT(not_before, now);
  EXPECT_GT(not_after - now, std::chrono::hours(24 * 3650));
  EXPECT_LT(not_after - now, std::chrono::hours(24 * 3654));

  // Serial: positive, random (two CAs differ).
  EXPECT_EQ(ASN1_STRING_length(X509_get_serialNumber(cert.get())), 16);
  EXPECT_EQ(X509_get_serialNumber(cert.get())->type, V_ASN1_INTEGER);  // not NEG_INTEGER
  auto other = GenerateCa("EnterSandBox env e-1");
  ASSERT_TRUE(other.ok());
  X509Ptr other_cert = ParseCert(other->cert_pem);
  EXPECT_NE(SerialHex(cert.get()), SerialHex(other_cert.get()));
  EXPECT_NE(pem->key_pem, other->key_pem);

  // The key PEM is an unencrypted private key matching the certificate.
  EXPECT_NE(pem->key_pem.find("BEGIN PRIVATE KEY"), std::string::npos);
  auto ca = Ca::FromPem(pem->cert_pem, pem->key_pem);
  ASSERT_TRUE(ca.ok()) << ca.status();
  EXPECT_EQ((*ca)->fingerprint_sha256().size(), 64u);
  EXPECT_EQ((*ca)->not_after(), not_after);
}

TEST(CaTest, RejectsBadCommonNames) {
  EXPECT_FALSE(GenerateCa("").ok());
  EXPECT_FALSE(GenerateCa(std::string(65, 'a')).ok());
  EXPECT_FALSE(GenerateCa("bad\nname").ok());
  EXPECT_TRUE(GenerateCa(std::string(64, 'a')).ok());
}

TEST(CaTest, FromPemRejectsWhatIsNotThisCa) {
  auto a = GenerateCa("a");
  auto b = GenerateCa("b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(Ca::FromPem("garbage", a->key_pem).ok());
  EXPECT_FALSE(Ca::FromPem(a->cert_pem, "garbage").ok());
  // Key of another CA.
  auto mismatch = Ca::FromPem(a->cert_pem, b->key_pem);
  EXPECT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("does not match"), std::string::npos);
  // Two certificates.
  EXPECT_FALSE(Ca::FromPem(a->cert_pem + b->cert_pem, a->key_pem).ok());
  // A leaf is not a CA.
  auto minter = LeafMinter::Create(*Ca::FromPem(a->cert_pem, a->key_pem));
  ASSERT_TRUE(minter.ok());
  auto leaf = (*minter)->LeafFor("weather.test");
  ASSERT_TRUE(leaf.ok());
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, (*leaf)->cert.get());
  PEM_write_bio_PrivateKey(bio, (*leaf)->key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  long len = BIO_get_mem_data(bio, &data);
  std::string both(data, len);
  BIO_free(bio);
  auto not_ca = Ca::FromPem(both.substr(0, both.find("-----BEGIN PRIVATE KEY")),
                            both.substr(both.find("-----BEGIN PRIVATE KEY")));
  EXPECT_FALSE(not_ca.ok());
  EXPECT_NE(not_ca.status().message().find("not a CA"), std::string::npos);
}

TEST(LeafMinterTest, LeafVerifiesForItsHostAndNotForAnother) {
  auto ca = NewCa();
  auto minter = LeafMinter::Create(ca);
  ASSERT_TRUE(minter.ok()) << minter.status();
  auto leaf = (*minter)->LeafFor("weather.test");
  ASSERT_TRUE(leaf.ok()) << leaf.status();
  X509* cert = (*leaf)->cert.get();
  EXPECT_EQ(VerifyFor(*ca, cert, "weather.test"), X509_V_OK);
  EXPECT_EQ(VerifyFor(*ca, cert, "evil.test"), X509_V_ERR_HOSTNAME_MISMATCH);
  EXPECT_EQ(VerifyFor(*ca, cert, "sub.weather.test"), X509_V_ERR_HOSTNAME_MISMATCH);

  // Leaf properties: end entity, serverAuth, signed by the CA, short-lived, within the CA.
  EXPECT_EQ(X509_check_ca(cert), 0);
  EXPECT_TRUE(ExtensionCritical(cert, NID_basic_constraints));
  EXPECT_NE(X509_get_extended_key_usage(cert) & XKU_SSL_SERVER, 0u);
  EXPECT_EQ(X509_check_issued(ca->cert(), cert), X509_V_OK);
  Clock::time_point not_after = ToTime(X509_get0_notAfter(cert));
  EXPECT_LE(not_after - Clock::now(), LeafOptions{}.validity);
  EXPECT_GT(not_after - Clock::now(), LeafOptions{}.validity - std::chrono::minutes(5));

  // Another environment's CA does not vouch for it.
  auto other = NewCa("other env");
  EXPECT_NE(VerifyFor(*other, cert, "weather.test"), X509_V_OK);
}

TEST(LeafMinterTest, IpLiteralLeavesCarryAnIpAddressSan) {
  auto ca = NewCa();
  auto minter = LeafMinter::Create(ca);
  ASSERT_TRUE(minter.ok());
  auto v4 = (*minter)->LeafFor("127.0.0.1");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(VerifyFor(*ca, (*v4)->cert.get(), "127.0.0.1"), X509_V_OK);
  EXPECT_EQ(VerifyFor(*ca, (*v4)->cert.get(), "127.0.0.2"), X509_V_ERR_IP_ADDRESS_MISMATCH);
  auto v6 = (*minter)->LeafFor("[0:0::1]");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ((*v6)->host, "::1");
  EXPECT_EQ(VerifyFor(*ca, (*v6)->cert.get(), "::1"), X509_V_OK);
  EXPECT_EQ(VerifyFor(*ca, (*v6)->cert.get(), "::2"), X509_V_ERR_IP_ADDRESS_MISMATCH);
}

TEST(LeafMinterTest, CachesPerHostWithOneKeyAndEvictsLeastRecentlyUsed) {
  auto ca = NewCa();
  auto minter = LeafMinter::Create(ca, LeafOptions{.cache_capacity = 2});
  ASSERT_TRUE(minter.ok());
  LeafMinter& m = **minter;
  auto a1 = m.LeafFor("a.test");
  auto a2 = m.LeafFor("A.Test.");  // same host, normalized
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->get(), a2->get());
  EXPECT_EQ(m.minted(), 1u);
  auto b = m.LeafFor("b.test");
  ASSERT_TRUE(b.ok());
  EXPECT_NE(b->get(), a1->get());
  EXPECT_NE(SerialHex((*b)->cert.get()), SerialHex((*a1)->cert.get()));
  // One key per CA: every leaf carries the same public key.
  EXPECT_EQ(EVP_PKEY_eq(X509_get0_pubkey((*a1)->cert.get()), X509_get0_pubkey((*b)->cert.get())),
            1);
  EXPECT_EQ(m.minted(), 2u);
  // Touch a (most recent), then c evicts b, the least recently used.
  ASSERT_TRUE(m.LeafFor("a.test").ok());
  ASSERT_TRUE(m.LeafFor("c.test").ok());
  EXPECT_EQ(m.minted(), 3u);
  EXPECT_EQ(m.cached(), 2u);
  auto a3 = m.LeafFor("a.test");
  ASSERT_TRUE(a3.ok());
  EXPECT_EQ(a3->get(), a1->get());
  EXPECT_EQ(m.minted(), 3u);
  ASSERT_TRUE(m.LeafFor("b.test").ok());
  EXPECT_EQ(m.minted(), 4u);  // b was evicted: minted again
}

TEST(LeafMinterTest, IsThreadSafe) {
  auto ca = NewCa();
  auto minter = LeafMinter::Create(ca, LeafOptions{.cache_capacity = 8});
  ASSERT_TRUE(minter.ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 60; ++i) {
        std::string host = "h" + std::to_string((i + t) % 12) + ".test";
        auto leaf = (*minter)->LeafFor(host);
        if (!leaf.ok() || (*leaf)->host != host ||
            VerifyFor(*ca, (*leaf)->cert.get(), host) != X509_V_OK) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE((*minter)->cached(), 8u);
  EXPECT_GE((*minter)->minted(), 12u);
}

TEST(LeafMinterTest, ConcurrentFirstRequestsForOneHostMintOnce) {
  auto minter = LeafMinter::Create(NewCa());
  ASSERT_TRUE(minter.ok());
  std::vector<std::thread> threads;
  std::vector<const Leaf*> seen(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto leaf = (*minter)->LeafFor("burst.test");
      seen[t] = leaf.ok() ? leaf->get() : nullptr;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*minter)->minted(), 1u);
  for (const Leaf* leaf : seen) EXPECT_EQ(leaf, seen[0]);
}

TEST(LeafMinterTest, RefusesHostsThatAreNotNames) {
  auto minter = LeafMinter::Create(NewCa());
  ASSERT_TRUE(minter.ok());
  for (const char* bad : {"", "*.evil.test", "a b.test", "ex..ample", "evil.test/x",
                          "\xc3\xa9vil.test", "[127.0.0.1]", "[nothex::1]"}) {
    EXPECT_FALSE((*minter)->LeafFor(bad).ok()) << bad;
  }
  EXPECT_FALSE((*minter)->LeafFor(std::string(64, 'a') + ".test").ok());  // label > 63
  EXPECT_FALSE((*minter)->LeafFor(std::string(254, 'a')).ok());
  EXPECT_EQ((*minter)->minted(), 0u);
  // A long but valid name has no CN (64 max) and still verifies through its SAN.
  std::string long_name = std::string(60, 'a') + "." + std::string(60, 'b') + ".test";
  auto leaf = (*minter)->LeafFor(long_name);
  ASSERT_TRUE(leaf.ok()) << leaf.status();
  EXPECT_EQ(VerifyFor((*minter)->ca(), (*leaf)->cert.get(), long_name), X509_V_OK);
}

TEST(NormalizeHostTest, CanonicalForms) {
  EXPECT_EQ(*NormalizeHost("Weather.TEST."), "weather.test");
  EXPECT_EQ(*NormalizeHost("[::1]"), "::1");
  EXPECT_EQ(*NormalizeHost("0:0:0::1"), "::1");
  EXPECT_EQ(*NormalizeHost("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(*NormalizeHost("_dmarc.x-y.test"), "_dmarc.x-y.test");
  EXPECT_FALSE(NormalizeHost(".").ok());
}

TEST(CombinedBundleTest, AppendsTheEnvCaToTheSystemBundle) {
  auto system_ca = GenerateCa("pretend system root");
  auto env_ca = GenerateCa("env ca");
  ASSERT_TRUE(system_ca.ok() && env_ca.ok());
  std::string path = TempPath("system.crt");
  {
    std::ofstream out(path);
    // No trailing newline: the bundle must still be valid PEM.
    out << system_ca->cert_pem.substr(0, system_ca->cert_pem.size() - 1);
  }
  auto bundle = CombinedBundle(path, env_ca->cert_pem);
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  EXPECT_EQ(CountCerts(*bundle), 2);
  EXPECT_EQ(bundle->find(system_ca->cert_pem.substr(0, 60)), 0u);
  EXPECT_NE(bundle->find(env_ca->cert_pem), std::string::npos);
  EXPECT_EQ(bundle->find("PRIVATE KEY"), std::string::npos);
  std::remove(path.c_str());

  // No system bundle on this host: the env CA alone.
  auto alone = CombinedBundle(TempPath("missing.crt"), env_ca->cert_pem);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(CountCerts(*alone), 1);

  // The real one on this machine, when present.
  struct stat st {};
  if (stat(std::string(kSystemBundlePath).c_str(), &st) == 0) {
    auto real = CombinedBundle(std::string(kSystemBundlePath), env_ca->cert_pem);
    ASSERT_TRUE(real.ok()) << real.status();
    EXPECT_GT(CountCerts(*real), 1);
  }
}

TEST(CombinedBundleTest, RejectsBadInputs) {
  auto env_ca = GenerateCa("env ca");
  ASSERT_TRUE(env_ca.ok());
  EXPECT_FALSE(CombinedBundle("", "not a pem").ok());
  EXPECT_FALSE(CombinedBundle("", env_ca->cert_pem + env_ca->cert_pem).ok());
  EXPECT_FALSE(CombinedBundle("/", env_ca->cert_pem).ok());  // a directory
  auto ok = CombinedBundle("", env_ca->cert_pem);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(CountCerts(*ok), 1);
}

TEST(TrustEnvironmentTest, PointsEveryClientAtTheBundle) {
  auto vars = TrustEnvironment("/etc/ssl/certs/ca-certificates.crt");
  std::set<std::string> names;
  for (const auto& [name, value] : vars) {
    names.insert(name);
    EXPECT_EQ(value, "/etc/ssl/certs/ca-certificates.crt") << name;
  }
  EXPECT_EQ(names.size(), vars.size());  // no duplicates
  for (const char* want :
       {"SSL_CERT_FILE", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS", "AWS_CA_BUNDLE", "CARGO_HTTP_CAINFO", "NPM_CONFIG_CAFILE"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  EXPECT_FALSE(names.count("SSL_CERT_DIR"));
}

}  // namespace
}  // namespace esb::governance::tls
