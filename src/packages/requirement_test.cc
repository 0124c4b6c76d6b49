#include "packages/requirement.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace esb::packages
