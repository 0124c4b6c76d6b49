#include "packages/version.h"

#include <gtest/gtest.h>

#include <vector>

namespace esb::packages {
namespace {

Version V(const char* s) {
  auto v = ParseVersion(s);
  EXPECT_TRUE(v.ok()) << s << ": " << v.status();
  return v.ok() ? *v : Version{};
}

TEST(VersionTest, NormalisesSpellings) {
  EXPECT_EQ(V("1.0").ToString(), "1.0");
  EXPECT_EQ(V("v1.0").ToString(), "1.0");
  EXPECT_EQ(V("1.0-alpha.1").ToString(), "1.0a1");
  EXPECT_EQ(V("1.0RC1").ToString(), "1.0rc1");
  EXPECT_EQ(V("1.0c2").ToString(), "1.0rc2");
  EXPECT_EQ(V("1.0.preview3").ToString(), "1.0rc3");
  EXPECT_EQ(V("1.0-1").ToString(), "1.0.post1");
  EXPECT_EQ(V("1.0.post").ToString(), "1.0.post0");
  EXPECT_EQ(V("1.0-rev2").ToString(), "1.0.post2");
  EXPECT_EQ(V("1.0.dev").ToString(), "1.0.dev0");
  EXPECT_EQ(V("1!2.0b3.post4.dev5+Ubuntu-1_x").ToString(), "1!2.0b3.post4.dev5+ubuntu.1.x");
  EXPECT_EQ(V("  2.1  ").ToString(), "2.1");
}

TEST(VersionTest, RejectsGarbage) {
  for (const char* bad : {"", "abc", "1.0.", "1..0", "1.0+", "1.0+a..b", "1.0 2", "1.0-", "==1",
                          "1.0foo", "99999999999999999999999"}) {
    EXPECT_FALSE(ParseVersion(bad).ok()) << bad;
  }
}

TEST(VersionTest, Pep440OrderingExample) {
  // The ordering example from PEP 440 ("Summary of permitted suffixes and relative ordering").
  std::vector<const char*> ordered = {
      "1.dev0",      "1.0.dev456",  "1.0a1",        "1.0a2.dev456", "1.0a12.dev456", "1.0a12",
      "1.0b1.dev456", "1.0b2",      "1.0b2.post345.dev456", "1.0b2.post345", "1.0rc1.dev456",
      "1.0rc1",      "1.0",         "1.0+abc.5",    "1.0+abc.7",    "1.0+5",         "1.0.post456.dev34",
      "1.0.post456", "1.0.15",      "1.1.dev1"};
  for (size_t i = 0; i + 1 < ordered.size(); ++i) {
    EXPECT_LT(V(ordered[i]), V(ordered[i + 1])) << ordered[i] << " < " << ordered[i + 1];
    EXPECT_GT(V(ordered[i + 1]), V(ordered[i]));
  }
}

TEST(VersionTest, EqualityIgnoresTrailingZerosAndEpochOrders) {
  EXPECT_EQ(V("1.0"), V("1.0.0"));
  EXPECT_EQ(V("1"), V("1.0.0.0"));
  EXPECT_LT(V("2.0"), V("1!1.0"));
  EXPECT_LT(V("1.9"), V("1.10"));
  EXPECT_LT(V("1.0+abc"), V("1.0+1"));
  EXPECT_LT(V("1.0+1"), V("1.0+1.0"));
}

TEST(VersionTest, Prerelease) {
  EXPECT_TRUE(V("1.0a1").IsPrerelease());
  EXPECT_TRUE(V("1.0.dev1").IsPrerelease());
  EXPECT_TRUE(V("1.0.post1.dev1").IsPrerelease());
  EXPECT_FALSE(V("1.0.post1").IsPrerelease());
  EXPECT_FALSE(V("1.0+local").IsPrerelease());
}

struct SpecCase {
  const char* spec;
  const char* version;
  bool prereleases;
  bool expected;
};

class SpecifierTest : public ::testing::TestWithParam<SpecCase> {};

TEST_P(SpecifierTest, Contains) {
  const SpecCase& c = GetParam();
  auto spec = ParseSpecifier(c.spec);
  ASSERT_TRUE(spec.ok()) << c.spec << ": " << spec.status();
  EXPECT_EQ(spec->Contains(V(c.version), c.prereleases), c.expected)
      << c.spec << " contains " << c.version;
}

INSTANTIATE_TEST_SUITE_P(
    Pep440, SpecifierTest,
    ::testing::Values(
        SpecCase{"", "1.0", false, true}, SpecCase{"", "1.0a1", false, false},
        SpecCase{"", "1.0a1", true, true}, SpecCase{"==1.0", "1.0.0", false, true},
        SpecCase{"==1.0", "1.0+local", false, true}, SpecCase{"==1.0+local", "1.0", false, false},
        SpecCase{"==1.0", "1.0.post1", false, false}, SpecCase{"==1.*", "1.5.2", false, true},
        SpecCase{"==1.*", "2.0", false, false}, SpecCase{"==1.4.*", "1.4", false, true},
        SpecCase{"==1.4.*", "1.4.5.post1", false, true}, SpecCase{"==1.4.*", "1.40", false, false},
        SpecCase{"==1.*", "1.0a1", false, false}, SpecCase{"==1.*", "1.0a1", true, true},
        SpecCase{"!=1.3.*", "1.3.2", false, false}, SpecCase{"!=1.3.*", "1.4", false, true},
        SpecCase{"!=1.0", "1.0", false, false}, SpecCase{"!=1.0", "1.0.1", false, true},
        SpecCase{"~=1.4.5", "1.4.5", false, true}, SpecCase{"~=1.4.5", "1.4.9", false, true},
        SpecCase{"~=1.4.5", "1.5.0", false, false}, SpecCase{"~=1.4.5", "1.4.4", false, false},
        SpecCase{"~=2.2", "2.9", false, true}, SpecCase{"~=2.2", "3.0", false, false},
        SpecCase{"~=2.2.0a1", "2.2.0a2", false, true}, SpecCase{"~=2.2.post3", "2.2.post4", false, true},
        SpecCase{">=1.0", "1.0", false, true}, SpecCase{">=1.0", "0.9", false, false},
        SpecCase{">=1.0", "2.0b1", false, false}, SpecCase{">=1.0b1", "2.0b1", false, true},
        SpecCase{"<=2.0", "2.0+local", false, true}, SpecCase{"<2.0", "2.0a1", true, false},
        SpecCase{"<2.0", "1.9.9", false, true}, SpecCase{"<2.0rc1", "2.0b1", false, true},
        SpecCase{">1.0", "1.0.post1", false, false}, SpecCase{">1.0", "1.0.1", false, true},
        SpecCase{">1.0", "1.0+local", false, false}, SpecCase{">1.0.post1", "1.0.post2", false, true},
        SpecCase{">=1.0,<2", "1.5", false, true}, SpecCase{">=1.0,<2", "2.0", false, false},
        SpecCase{"<2,>=1", "1.0", false, true}, SpecCase{">= 1.0 , != 1.5", "1.5", false, false},
        SpecCase{"===1.0", "1.0", false, true}, SpecCase{"===1.0", "1.0.0", false, false},
        SpecCase{">=1!1.0", "2.0", false, false}, SpecCase{"==1.0.dev1", "1.0.dev1", false, true}));

TEST(SpecifierParseTest, Rejects) {
  for (const char* bad : {"1.0", ">=", "=>1.0", ">=1.0,", ",>=1", "~=1", ">=1.*", "<1.0+local",
                          "==1.0a1.*", ">=1.0 <2", "=1.0", ">>1"}) {
    EXPECT_FALSE(ParseSpecifier(bad).ok()) << bad;
  }
}

TEST(SpecifierParseTest, CanonicalText) {
  auto s = ParseSpecifier(" >= 1.0 ,< 2 , !=1.5.* ");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->ToString(), ">=1.0,<2,!=1.5.*");
}

}  // namespace
}  // namespace esb::packages
