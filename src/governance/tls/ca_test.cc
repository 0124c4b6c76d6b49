#include "governance/tls/ca.h"

#include <gtest/gtest.h>

namespace esb::governance::tls {
namespace {

TEST(CaTest, GeneratesALoadableCa) {
  auto pem = GenerateCa("EnterSandBox test");
  ASSERT_TRUE(pem.ok()) << pem.status();
  auto ca = Ca::FromPem(pem->cert_pem, pem->key_pem);
  ASSERT_TRUE(ca.ok()) << ca.status();
}

}  // namespace
}  // namespace esb::governance::tls
