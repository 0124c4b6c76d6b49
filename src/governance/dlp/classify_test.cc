// The byte-class masks (classify.h): the AVX2 and the portable implementations agree on every
// byte value at every position, and the classes are what their comments say.
#include "governance/dlp/classify.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace esb::governance::dlp {
namespace {

void ExpectSame(const BlockMasks& a, const BlockMasks& b, const std::string& what) {
  EXPECT_EQ(a.digit, b.digit) << what;
  EXPECT_EQ(a.word, b.word) << what;
  EXPECT_EQ(a.upper, b.upper) << what;
  EXPECT_EQ(a.card_sep, b.card_sep) << what;
  EXPECT_EQ(a.num_sep, b.num_sep) << what;
  EXPECT_EQ(a.marker, b.marker) << what;
  EXPECT_EQ(a.at, b.at) << what;
  EXPECT_EQ(a.escape, b.escape) << what;
}

TEST(DlpClassifyTest, EveryByteValueHasItsClasses) {
  for (int c = 0; c < 256; ++c) {
    const std::string text(1, static_cast<char>(c));
    BlockMasks m;
    ClassifyBlockPortable(text, 0, &m);
    const bool digit = c >= '0' && c <= '9';
    const bool upper = c >= 'A' && c <= 'Z';
    const bool word = digit || upper || (c >= 'a' && c <= 'z') || c == '_';
    EXPECT_EQ(m.digit, digit ? 1u : 0u) << c;
    EXPECT_EQ(m.upper, upper ? 1u : 0u) << c;
    EXPECT_EQ(m.word, word ? 1u : 0u) << c;
    EXPECT_EQ(m.card_sep, c == ' ' || c == '-' ? 1u : 0u) << c;
    EXPECT_EQ(m.num_sep, c == '.' || c == '(' || c == ')' ? 1u : 0u) << c;
    EXPECT_EQ(m.marker, c == '+' || c == '(' ? 1u : 0u) << c;
    EXPECT_EQ(m.at, c == '@' ? 1u : 0u) << c;
    EXPECT_EQ(m.escape, c == '%' || c == '\\' ? 1u : 0u) << c;
    // The dispatched implementation (AVX2 where the CPU has it) on a full block: the byte at
    // every position, and past the end of a short text nothing.
    for (size_t pos = 0; pos < 64; pos += 9) {
      std::string block(64, '\x80');
      block[pos] = static_cast<char>(c);
      BlockMasks fast, slow;
      ClassifyBlock(block, 0, &fast);
      ClassifyBlockPortable(block, 0, &slow);
      ExpectSame(fast, slow, "byte " + std::to_string(c) + " at " + std::to_string(pos));
    }
    BlockMasks short_fast;
    ClassifyBlock(text, 0, &short_fast);
    ExpectSame(short_fast, m, "short text, byte " + std::to_string(c));
  }
}

TEST(DlpClassifyTest, RandomBlocksAndTailsAgree) {
  if (!ClassifyUsesAvx2()) std::printf("note: no AVX2 here: both sides are the portable code\n");
  uint64_t x = 88172645463325252ull;
  std::string text(4096 + 37, '\0');
  for (char& c : text) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x);
  }
  for (size_t offset = 0; offset < text.size(); offset += 13) {
    BlockMasks fast, slow;
    ClassifyBlock(text, offset, &fast);
    ClassifyBlockPortable(text, offset, &slow);
    ExpectSame(fast, slow, "offset " + std::to_string(offset));
  }
  BlockMasks past;
  ClassifyBlock(text, text.size(), &past);
  ExpectSame(past, BlockMasks{}, "past the end");
}

}  // namespace
}  // namespace esb::governance::dlp
