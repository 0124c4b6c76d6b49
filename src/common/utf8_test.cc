#include "common/utf8.h"

#include <gtest/gtest.h>

namespace esb {
namespace {

TEST(Utf8Test, Validation) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("hello"));
  EXPECT_TRUE(IsValidUtf8("h\xc3\xa9llo"));          // é
  EXPECT_TRUE(IsValidUtf8("\xe2\x82\xac"));          // €
  EXPECT_TRUE(IsValidUtf8("\xf0\x9f\x98\x80"));      // 😀
  EXPECT_TRUE(IsValidUtf8("\xf4\x8f\xbf\xbf"));      // U+10FFFF
  EXPECT_TRUE(IsValidUtf8(std::string("a\0b", 3)));  // NUL is valid UTF-8
  EXPECT_FALSE(IsValidUtf8("\xff"));
  EXPECT_FALSE(IsValidUtf8("\x80"));              // lone continuation
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xe0\x80\xaf"));      // overlong
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xf5\x80\x80\x80"));
  EXPECT_FALSE(IsValidUtf8("\xc3"));  // truncated
  EXPECT_FALSE(IsValidUtf8("\xe2\x82"));
  EXPECT_FALSE(IsValidUtf8("\xc3\x28"));
}

TEST(Utf8Test, CompletePrefixHoldsBackTruncatedSequence) {
  EXPECT_EQ(Utf8CompletePrefix("abc"), 3u);
  EXPECT_EQ(Utf8CompletePrefix(""), 0u);
  EXPECT_EQ(Utf8CompletePrefix("ab\xc3"), 2u);
  EXPECT_EQ(Utf8CompletePrefix("ab\xe2\x82"), 2u);
  EXPECT_EQ(Utf8CompletePrefix("ab\xf0\x9f\x98"), 2u);
  EXPECT_EQ(Utf8CompletePrefix("ab\xf0\x9f\x98\x80"), 6u);
  EXPECT_EQ(Utf8CompletePrefix("ab\xff"), 3u);      // invalid: not held back
  EXPECT_EQ(Utf8CompletePrefix("ab\xe0\x80"), 4u);  // overlong start: invalid, not held back
  // Splitting a valid string at every point and holding back the tail yields valid chunks.
  std::string s = "x\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80y";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    std::string head = s.substr(0, cut);
    size_t keep = Utf8CompletePrefix(head);
    EXPECT_TRUE(IsValidUtf8(head.substr(0, keep))) << cut;
    EXPECT_TRUE(IsValidUtf8(head.substr(keep) + s.substr(cut))) << cut;
  }
}

TEST(Utf8Test, SanitizeReplacesEachBadByteAndKeepsValidText) {
  EXPECT_EQ(SanitizeUtf8("h\xc3\xa9llo"), "h\xc3\xa9llo");
  EXPECT_EQ(SanitizeUtf8(std::string("a\0b", 3)), std::string("a\0b", 3));
  EXPECT_EQ(SanitizeUtf8("a\xff"
                         "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(SanitizeUtf8("\xc0\xaf"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: two bytes
  EXPECT_EQ(SanitizeUtf8("\xed\xa0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(SanitizeUtf8("ok\xe2\x82"), "ok\xEF\xBF\xBD\xEF\xBF\xBD");  // truncated at end
  EXPECT_EQ(SanitizeUtf8("\xc3\x28"), "\xEF\xBF\xBD(");
  for (std::string s : {"\xff\xfe", "\x80x\xf5\x80\x80\x80", "\xf4\x90\x80\x80\xe2\x82\xac"}) {
    EXPECT_TRUE(IsValidUtf8(SanitizeUtf8(s))) << s;
  }
}

TEST(Utf8Test, AppendEncodesEveryLength) {
  std::string out;
  for (uint32_t cp : {0x41u, 0xE9u, 0x20ACu, 0x1F600u, 0x10FFFFu}) AppendUtf8(cp, &out);
  EXPECT_EQ(out, "A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf");
  EXPECT_TRUE(IsValidUtf8(out));
}

}  // namespace
}  // namespace esb
