#include "governance/proxy/host_scan.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace esb::governance::proxy {
namespace {

std::shared_ptr<const dlp::Engine> DefaultEngine() {
  absl::StatusOr<std::shared_ptr<const dlp::Engine>> e = dlp::Engine::Compile(dlp::DlpConfig{});
  EXPECT_TRUE(e.ok()) << e.status();
  return *e;
}

std::vector<std::string> Rules(const dlp::Result& r) {
  std::vector<std::string> out;
  for (const dlp::Finding& f : r.findings) out.push_back(f.rule_id);
  return out;
}

TEST(HostScanTest, TextHasTheNameJoinedRunsAndUpperCase) {
  absl::StatusOr<std::string> t = HostScanText("ab.c-d.e");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t,
            "ab.c-d.e\nabc\nabcd\nabcde\ncd\ncde\nde\n"
            "AB.C-D.E\nABC\nABCD\nABCDE\nCD\nCDE\nDE\n");
}

TEST(HostScanTest, SecretsInNamesAreFoundWholeSplitAndInAnyCase) {
  auto engine = DefaultEngine();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"akiaq2we3rt4yu5i6paz.attacker.test", "dlp:aws_access_key"},
      {"x.akiaq2we3r.t4yu5i6paz.attacker.test", "dlp:aws_access_key"},
      {"akiaq-2we3rt4yu5i6paz.attacker.test", "dlp:aws_access_key"},
      {"4111-1111-1111-1111.attacker.test", "dlp:credit_card"},
      {"4111.1111.1111.1111.attacker.test", "dlp:credit_card"},
      {"41.11111111111111.x.attacker.test", "dlp:credit_card"},
      {"ghp_abcdefghijklmnopqrstuvwxyz0123456789.attacker.test", "dlp:github_token"},
  };
  for (const auto& [host, rule] : cases) {
    absl::StatusOr<dlp::Result> r = ScanHost(*engine, host);
    ASSERT_TRUE(r.ok()) << host;
    EXPECT_EQ(StoppingRule(*r), rule) << host;
  }
}

TEST(HostScanTest, OrdinaryNamesHaveNoFindings) {
  auto engine = DefaultEngine();
  for (const char* host : {"www.example.com", "pypi.org", "files.pythonhosted.org",
                           "ec2-54-210-167-204.compute-1.amazonaws.com",
                           "ip-10-0-0-1.ec2.internal", "r3---sn-4g5e6nz7.googlevideo.com",
                           "xn--bcher-kva.example", "192-168-1-1.nip.io",
                           "d1a2b3c4d5e6f7.cloudfront.net", "s3.dualstack.us-east-1.amazonaws.com",
                           "1e100.net", "cdn-123456789.example.com", "api.github.com",
                           "a-very-long-label-with-many-dashes-in-it-for-testing-0123.example"}) {
    absl::StatusOr<dlp::Result> r = ScanHost(*engine, host);
    ASSERT_TRUE(r.ok()) << host;
    EXPECT_TRUE(r->findings.empty()) << host << ": " << testing::PrintToString(Rules(*r));
  }
}

// A name of a great many one-character parts would need more than the bound: refused as
// unscannable (not scanned partly), and the work before refusing is bounded.
TEST(HostScanTest, NameWithTooManyPartsIsUnscannable) {
  std::string host;
  for (int i = 0; i < 120; ++i) host += "a.";
  host += "test";
  absl::StatusOr<std::string> t = HostScanText(host);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  // A long but ordinary name is fine.
  std::string ok = std::string(63, 'a') + "." + std::string(63, 'b') + "." + std::string(63, 'c');
  EXPECT_TRUE(HostScanText(ok).ok());
}

}  // namespace
}  // namespace esb::governance::proxy
