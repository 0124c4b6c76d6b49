#include "governance/audit_redact.h"

#include <gtest/gtest.h>

namespace esb::governance {
namespace {

TEST(AuditRedactTest, SensitiveHeaderNames) {
  for (const char* name :
       {"Authorization", "proxy-authorization", "Cookie", "SET-COOKIE", "X-Api-Key",
        "X-Amz-Security-Token", "X-Client-Secret", "X-Password", "X-Session-Id", "X-Auth-User",
        "Sec-WebSocket-Key", "X-Goog-Credential", "X-Amz-Signature"}) {
    EXPECT_TRUE(IsSensitiveHeader(name)) << name;
  }
  for (const char* name :
       {"Host", "Content-Type", "Content-Length", "User-Agent", "Accept", "Keep-Alive"}) {
    EXPECT_FALSE(IsSensitiveHeader(name)) << name;
  }
}

TEST(AuditRedactTest, AuthorizationKeepsSchemeOnly) {
  EXPECT_EQ(MaskHeaderValue("Authorization", "Bearer ghp_abcdefghijklmnop"), "Bearer [masked]");
  EXPECT_EQ(MaskHeaderValue("Proxy-Authorization", "Basic dXNlcjpwYXNz"), "Basic [masked]");
  EXPECT_EQ(MaskHeaderValue("authorization", "tokenwithoutscheme"), "[masked]");
  // A "scheme" that is not a token is not kept (it could be the secret itself).
  EXPECT_EQ(MaskHeaderValue("Authorization", "a:b:c secret"), "[masked]");
}

TEST(AuditRedactTest, CookiesKeepNamesOnly) {
  EXPECT_EQ(MaskHeaderValue("Cookie", "sid=abc123; theme=dark;  x=y"),
            "sid=[masked]; theme=[masked]; x=[masked]");
  EXPECT_EQ(MaskHeaderValue("Set-Cookie", "sid=abc123; Path=/; HttpOnly"), "sid=[masked]");
  EXPECT_EQ(MaskHeaderValue("Cookie", "bare-secret"), "[masked]");
}

TEST(AuditRedactTest, KeyLikeHeadersMaskedWhole) {
  const std::string v = MaskHeaderValue("X-Api-Key", "AKIAIOSFODNN7REALKEY");
  EXPECT_EQ(v, "[masked]");
  EXPECT_EQ(MaskHeaderValue("Content-Type", "application/json"), "application/json");
}

TEST(AuditRedactTest, MaskedValueNeverContainsTheSecret) {
  const std::string secret = "s3cr3t-VALUE-1234567890";
  for (const char* name :
       {"Authorization", "Cookie", "Set-Cookie", "X-Token", "Proxy-Authorization"}) {
    for (const std::string& value :
         {secret, "Bearer " + secret, "a=" + secret, "a=" + secret + "; b=" + secret}) {
      EXPECT_EQ(MaskHeaderValue(name, value).find(secret), std::string::npos) << name << value;
    }
  }
}

TEST(AuditRedactTest, UrlQuerySensitiveParamsMasked) {
  EXPECT_EQ(MaskUrlQuery("/v1/x?api_key=abc&page=2&access_token=zzz#frag"),
            "/v1/x?api_key=[masked]&page=2&access_token=[masked]#frag");
  EXPECT_EQ(MaskUrlQuery("/plain/path"), "/plain/path");
  EXPECT_EQ(MaskUrlQuery("/p?flag&x=1"), "/p?flag&x=1");
  EXPECT_EQ(MaskUrlQuery("/p?"), "/p?");
}

}  // namespace
}  // namespace esb::governance
