#include "common/shell_quote.h"

#include <gtest/gtest.h>
#include <stdio.h>

#include <string>

namespace esb {
namespace {

TEST(ShellQuoteTest, PlainWordsStayAndEverythingElseIsSingleQuoted) {
  EXPECT_EQ(ShellQuote("ls"), "ls");
  EXPECT_EQ(ShellQuote("/tmp/a-b_c.txt"), "/tmp/a-b_c.txt");
  EXPECT_EQ(ShellQuote("numpy==1.26"), "numpy==1.26");
  EXPECT_EQ(ShellQuote(""), "''");
  EXPECT_EQ(ShellQuote("a b"), "'a b'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
  EXPECT_EQ(ShellQuote("$HOME"), "'$HOME'");
  EXPECT_EQ(ShellQuote("a;rm -rf /"), "'a;rm -rf /'");
  EXPECT_EQ(ShellQuote("~"), "'~'");
  EXPECT_EQ(ShellQuote(std::string("a\nb")), "'a\nb'");
}

// The attack: a word that tries to end the quoting and run a command of its own. The real shell
// must see exactly one word, byte for byte.
TEST(ShellQuoteTest, InjectionThroughAWordIsOneWordToTheShell) {
  const std::string hostile[] = {"'; touch /tmp/esb-pwned; '",
                                 "$(id)",
                                 "`id`",
                                 "a' b 'c",
                                 "\\'",
                                 "x\ny",
                                 "*",
                                 "-rf",
                                 "'\"'\"'",
                                 std::string("\x01\xff", 2)};
  for (const std::string& word : hostile) {
    std::string cmd = "printf '%s' " + ShellQuote(word);
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string got;
    char buf[256];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) got.append(buf, n);
    EXPECT_EQ(pclose(p), 0) << word;
    EXPECT_EQ(got, word) << cmd;
  }
}

}  // namespace
}  // namespace esb
