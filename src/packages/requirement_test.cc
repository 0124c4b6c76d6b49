#include "packages/requirement.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace esb::packages {
namespace {

TEST(NormalizeNameTest, Pep503) {
  EXPECT_EQ(NormalizeName("Foo.Bar__baz-Qux"), "foo-bar-baz-qux");
  EXPECT_EQ(NormalizeName("zope.interface"), "zope-interface");
  EXPECT_EQ(NormalizeName("a-_.b"), "a-b");
}

struct Good {
  const char* text;
  const char* name;
  const char* specifier;
  std::vector<std::string> extras;
};

class ParseRequirementGood : public ::testing::TestWithParam<Good> {};

TEST_P(ParseRequirementGood, Parses) {
  const Good& g = GetParam();
  auto r = ParseRequirement(g.text);
  ASSERT_TRUE(r.ok()) << g.text << ": " << r.status();
  EXPECT_EQ(r->name, g.name);
  EXPECT_EQ(r->specifier, g.specifier);
  EXPECT_EQ(r->extras, g.extras);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ParseRequirementGood,
    ::testing::Values(Good{"requests", "requests", "", {}},
                      Good{"  Requests  ", "requests", "", {}},
                      Good{"foo==1.0", "foo", "==1.0", {}},
                      Good{"Foo_Bar.baz>=1.2", "foo-bar-baz", ">=1.2", {}},
                      Good{"foo<2,>=1", "foo", "<2,>=1", {}},
                      Good{"foo (>=1.0)", "foo", ">=1.0", {}},
                      Good{"foo(>=1.0,<2)", "foo", ">=1.0,<2", {}},
                      Good{"foo >= 1.0 , < 2", "foo", ">=1.0,<2", {}},
                      Good{"foo[bar]", "foo", "", {"bar"}},
                      Good{"foo[bar, Baz_x]>=2", "foo", ">=2", {"bar", "baz-x"}},
                      Good{"foo [bar] (==1.*)", "foo", "==1.*", {"bar"}},
                      Good{"foo~=1.4.2", "foo", "~=1.4.2", {}},
                      Good{"foo===1.0-weird", "foo", "===1.0-weird", {}},
                      Good{"foo!=1.5", "foo", "!=1.5", {}},
                      Good{"foo>=1.0; python_version < \"3.12\"", "foo", ">=1.0", {}},
                      Good{"foo ; sys_platform == 'linux'", "foo", "", {}},
                      Good{"numpy==2.0.0rc1", "numpy", "==2.0.0rc1", {}},
                      Good{"a", "a", "", {}},
                      Good{"foo[]", "foo", "", {}},
                      Good{"zope.interface>=5", "zope-interface", ">=5", {}}));

TEST(ParseRequirementTest, KeepsDisplay) {
  auto r = ParseRequirement("  Foo_Bar>=1 ");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->display, "Foo_Bar>=1");
}

TEST(ParseRequirementTest, Rejects) {
  const char* bad[] = {"",
                       "   ",
                       "-e .",
                       "--index-url https://evil.example/simple",
                       "-r requirements.txt",
                       "https://example.org/foo-1.0.whl",
                       "foo @ https://example.org/foo.whl",
                       "foo@file:///tmp/x",
                       "./foo",
                       "/tmp/foo.whl",
                       "../foo",
                       "~/foo",
                       "dir/foo",
                       "C:\\foo",
                       "foo-1.0-py3-none-any.whl",
                       "foo.tar.gz",
                       "foo bar",
                       "foo  bar>=1",
                       "foo\nbar",
                       "foo\x01",
                       "foo\t==1\x7f",
                       "_foo",
                       "foo-",
                       "foo>=",
                       "foo>=1.0,",
                       "foo=1.0",
                       "foo[bar",
                       "foo[b@r]",
                       "foo (>=1.0",
                       "foo;",
                       "foo$",
                       "foo>=1.0 extra"};
  for (const char* b : bad) {
    auto r = ParseRequirement(b);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << "'" << b << "' gave " << r.status();
  }
  std::string long_name(201, 'a');
  EXPECT_TRUE(absl::IsInvalidArgument(ParseRequirement(long_name).status()));
  EXPECT_TRUE(ParseRequirement(std::string(200, 'a')).ok());
}

TEST(ParseRequirementTest, MessagesSayWhy) {
  auto r = ParseRequirement("--index-url http://x");
  EXPECT_NE(std::string(r.status().message()).find("options"), std::string::npos) << r.status();
  r = ParseRequirement("foo bar");
  EXPECT_NE(std::string(r.status().message()).find("one requirement"), std::string::npos)
      << r.status();
  r = ParseRequirement("foo @ https://x/y");
  EXPECT_NE(std::string(r.status().message()).find("URL"), std::string::npos) << r.status();
}

// Finding: markers after ';' were not checked, so a typo reached the sandbox's `packaging`,
// which raised, and the user read "is python3-pip in the image?".
TEST(ParseRequirementTest, ValidatesMarkers) {
  for (const char* good : {
           "foo; python_version < \"3.12\"",
           "foo;python_version<'3'",
           "foo >= 1 ; (os_name == 'posix' and python_version >= '3.8') or extra == \"x\"",
           "foo; 'linux' in sys_platform",
           "foo; platform_machine not in 'arm64 aarch64'",
           "foo; os.name == 'posix' and platform.machine != 'x86_64'",
           "foo; python_full_version === '3.11.2'",
           "foo; implementation_name == 'cpython' and platform_python_implementation == 'CPython'",
           "foo; ((python_version > '3'))",
           "tomli>=1.1.0; python_version < \"3.11\"",  // as pip prints dependencies
       }) {
    auto r = ParseRequirement(good);
    EXPECT_TRUE(r.ok()) << good << ": " << r.status();
  }
  auto r = ParseRequirement("foo>=1 ; python_version < '3.12' ");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->marker, "python_version < '3.12'");
  EXPECT_EQ(r->specifier, ">=1");

  struct Bad {
    const char* text;
    const char* why;
  };
  for (const Bad& b : {
           Bad{"foo; python_version <", "expected a marker variable or a quoted string"},
           Bad{"foo; pyhton_version < '3'", "unknown marker variable 'pyhton_version'"},
           Bad{"foo; python_version < 3.12", "strings must be quoted"},
           Bad{"foo; python_version = '3'", "unknown operator"},
           Bad{"foo; (python_version < '3'", "expected ')'"},
           Bad{"foo; python_version < '3' and", "at the end"},
           Bad{"foo; python_version < '3", "unterminated string"},
           Bad{"foo; python_version not '3'", "expected 'in' after 'not'"},
           Bad{"foo; python_version < '3' python_version", "expected 'and', 'or' or the end"},
           Bad{"foo; python_version", "expected a comparison operator"},
           Bad{"foo; python_version < '3' && os_name == 'nt'", "unexpected character"},
           Bad{"foo; ()", "expected a marker variable"},
       }) {
    auto r = ParseRequirement(b.text);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << b.text << ": " << r.status();
    EXPECT_NE(std::string(r.status().message()).find(b.why), std::string::npos)
        << b.text << ": " << r.status();
    EXPECT_NE(std::string(r.status().message()).find("environment marker"), std::string::npos)
        << b.text << ": " << r.status();
  }
  // Nesting is bounded (the parser recurses); the whole text is bounded anyway.
  std::string deep = "foo; " + std::string(40, '(') + "os_name == 'posix'" + std::string(40, ')');
  EXPECT_NE(std::string(ParseRequirement(deep).status().message()).find("nested too deeply"),
            std::string::npos);
  std::string ok_depth = "foo; " + std::string(20, '(') + "os_name == 'posix'" +
                         std::string(20, ')');
  EXPECT_TRUE(ParseRequirement(ok_depth).ok());
}

TEST(FindMissingDistributionTest, FindsTheRequirement) {
  EXPECT_EQ(FindMissingDistribution("Looking in links: /tmp/x\nERROR: Could not find a version "
                                    "that satisfies the requirement dep>=1 (from versions: none)"
                                    "\nERROR: No matching distribution found for dep>=1\n"),
            "dep>=1");
  EXPECT_EQ(FindMissingDistribution("No matching distribution found for a<2,>=1.\r\nmore"),
            "a<2,>=1");
  EXPECT_EQ(FindMissingDistribution(
                "ERROR: No matching distribution found for tomli>=1.1.0; python_version < "
                "\"3.11\"  \n"),
            "tomli>=1.1.0; python_version < \"3.11\"");
  EXPECT_EQ(FindMissingDistribution("No matching distribution found for "), "");
  EXPECT_EQ(FindMissingDistribution("ERROR: something else entirely\n"), std::nullopt);
  EXPECT_EQ(FindMissingDistribution(""), std::nullopt);
}

// Finding: a std::regex over pip's output recursed per character and a 50k-character line
// crashed the daemon. The output is the sandbox's to forge: a megabyte on one line.
TEST(FindMissingDistributionTest, HugeLinesAreLinearAndBoundedByTheCaller) {
  const std::string filler(1 << 20, 'x');
  auto start = std::chrono::steady_clock::now();
  auto found = FindMissingDistribution("No matching distribution found for " + filler);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->size(), filler.size());
  EXPECT_EQ(FindMissingDistribution(filler + filler), std::nullopt);
  found = FindMissingDistribution(filler + "\nNo matching distribution found for " +
                                  std::string(50'000, 'a') + "\n" + filler);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->size(), 50'000u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  // What the installer does next: too long for a requirement, and a name over the bound.
  EXPECT_GT(found->size(), kMaxRequirementLength);
  auto r = ParseRequirement(std::string(kMaxProjectNameLength + 1, 'a'));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_NE(std::string(r.status().message()).find("longer than 200"), std::string::npos);
}

// Finding: the probe's answer was trusted (its "req" strings became the fetch list, its
// "name" was read with at()). Entries are now matched by position and checked.
TEST(ParseProbeAnswerTest, ReadsEntriesByPosition) {
  auto a = ParseProbeAnswer(
      R"([{"skip": true}, {"installed": "1.26.4", "ok": true}, {"installed": null, "ok": false},
          {"installed": "0.9", "ok": false}, {"error": "InvalidMarker: bad\nmarker\u0001"},
          {"installed": "9", "ok": true, "req": "evil", "name": 7}, {"req": "surplus"}])",
      6);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 6u);  // the surplus entry is ignored
  using K = ProbeEntry::Kind;
  EXPECT_EQ((*a)[0].kind, K::kSkip);
  EXPECT_EQ((*a)[1].kind, K::kSatisfied);
  EXPECT_EQ((*a)[1].installed, "1.26.4");
  EXPECT_EQ((*a)[2].kind, K::kMissing);
  EXPECT_EQ((*a)[3].kind, K::kMissing);
  EXPECT_EQ((*a)[4].kind, K::kInvalid);
  EXPECT_EQ((*a)[4].error, "InvalidMarker: bad?marker?");
  EXPECT_EQ((*a)[5].kind, K::kSatisfied);  // unknown keys carry no weight
  EXPECT_TRUE(ParseProbeAnswer("[]", 0).ok());
}

TEST(ParseProbeAnswerTest, MalformedAnswersAreErrorsNotCrashes) {
  for (const char* bad : {
           "", "not json", "{\"req\": \"x\"}", "[]", "[1]", "[{}]", "[{\"ok\": \"yes\"}]",
           "[{\"ok\": true}]", "[{\"ok\": true, \"installed\": null}]",
           "[{\"ok\": true, \"installed\": 5}]", "[{\"ok\": false, \"installed\": []}]",
           "[{\"skip\": false}]", "[{\"error\": 3}]", "[{\"ok\": true, \"installed\": \"\"}]",
           "[{\"ok\": true, \"installed\": \"1 .0\"}]",
           "[{\"ok\": true, \"installed\": \"1\\n0\"}]",
       }) {
    auto a = ParseProbeAnswer(bad, 1);
    EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << bad << ": " << a.status();
    EXPECT_NE(std::string(a.status().message()).find("malformed"), std::string::npos) << bad;
  }
  // Fewer entries than requirements: nothing is guessed.
  auto a = ParseProbeAnswer(R"([{"installed": "1", "ok": true}])", 2);
  EXPECT_NE(std::string(a.status().message()).find("1 entries for 2 requirements"),
            std::string::npos)
      << a.status();
  // Bounded: a huge version or error text, deep nesting.
  std::string huge = "[{\"ok\": true, \"installed\": \"" + std::string(5000, '1') + "\"}]";
  EXPECT_FALSE(ParseProbeAnswer(huge, 1).ok());
  a = ParseProbeAnswer("[{\"error\": \"" + std::string(100'000, 'e') + "\"}]", 1);
  ASSERT_TRUE(a.ok());
  EXPECT_LT((*a)[0].error.size(), 400u);
  EXPECT_FALSE(ParseProbeAnswer(std::string(100'000, '[') + std::string(100'000, ']'), 1).ok());
}

}  // namespace
}  // namespace esb::packages
