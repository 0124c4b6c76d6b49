// The byte-class masks (classify.h): the AVX2 and the portable implementations agree on every
// byte value at every position, and the classes are what their comments say.
#include "governance/dlp/classify.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace esb::governance::dlp {
namespace {

void ExpectSame(const BlockMasks& a, const BlockMasks& b, const std::string& what) {
  EXPECT_EQ(a.digit, b.digit) << what;
  EXPECT_EQ(a.word, b.word) << what;
  EXPECT_EQ(a.upper, b.upper) << what;
  EXPECT_EQ(a.card_sep, b.card_sep) << what;
  EXPECT_EQ(a.num_sep, b.num_sep) << what;
  EXPECT_EQ(a.marker, b.marker) << what;
}

void ExpectSame(const ClassifySeen& a, const ClassifySeen& b, const std::string& what) {
  EXPECT_EQ(a.at, b.at) << what;
  EXPECT_EQ(a.escape, b.escape) << what;
}

TEST(DlpClassifyTest, EveryByteValueHasItsClasses) {
  for (int c = 0; c < 256; ++c) {
    const std::string text(1, static_cast<char>(c));
    BlockMasks m;
    ClassifySeen seen;
    ClassifyBlocksPortable(text, 0, 1, &m, &seen);
    const bool digit = c >= '0' && c <= '9';
    const bool upper = c >= 'A' && c <= 'Z';
    const bool word = digit || upper || (c >= 'a' && c <= 'z') || c == '_';
    EXPECT_EQ(m.digit, digit ? 1u : 0u) << c;
    EXPECT_EQ(m.upper, upper ? 1u : 0u) << c;
    EXPECT_EQ(m.word, word ? 1u : 0u) << c;
    EXPECT_EQ(m.card_sep, c == ' ' || c == '-' ? 1u : 0u) << c;
    EXPECT_EQ(m.num_sep, c == '.' || c == '(' || c == ')' ? 1u : 0u) << c;
    EXPECT_EQ(m.marker, c == '+' || c == '(' ? 1u : 0u) << c;
    EXPECT_EQ(seen.at, c == '@') << c;
    EXPECT_EQ(seen.escape, c == '%' || c == '\\') << c;
    // The dispatched implementation (AVX2 where the CPU has it) on a full block: the byte at
    // every position, and past the end of a short text nothing.
    for (size_t pos = 0; pos < 64; pos += 9) {
      std::string block(64, '\x80');
      block[pos] = static_cast<char>(c);
      BlockMasks fast, slow;
      ClassifySeen fast_seen, slow_seen;
      ClassifyBlocks(block, 0, 1, &fast, &fast_seen);
      ClassifyBlocksPortable(block, 0, 1, &slow, &slow_seen);
      const std::string what = "byte " + std::to_string(c) + " at " + std::to_string(pos);
      ExpectSame(fast, slow, what);
      ExpectSame(fast_seen, slow_seen, what);
    }
    BlockMasks short_fast[2];
    ClassifySeen short_seen;
    ClassifyBlocks(text, 0, 2, short_fast, &short_seen);
    ExpectSame(short_fast[0], m, "short text, byte " + std::to_string(c));
    ExpectSame(short_fast[1], BlockMasks{}, "past a short text, byte " + std::to_string(c));
    ExpectSame(short_seen, seen, "short text, byte " + std::to_string(c));
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
  // Batches of 1..20 blocks from every 13th offset, running past the end.
  for (size_t offset = 0; offset < text.size(); offset += 13) {
    const size_t count = 1 + offset % 20;
    std::vector<BlockMasks> fast(count), slow(count);
    ClassifySeen fast_seen, slow_seen;
    ClassifyBlocks(text, offset, count, fast.data(), &fast_seen);
    ClassifyBlocksPortable(text, offset, count, slow.data(), &slow_seen);
    for (size_t k = 0; k < count; ++k) {
      ExpectSame(fast[k], slow[k],
                 "offset " + std::to_string(offset) + " block " + std::to_string(k));
    }
    ExpectSame(fast_seen, slow_seen, "offset " + std::to_string(offset));
  }
  BlockMasks past;
  ClassifySeen past_seen;
  ClassifyBlocks(text, text.size(), 1, &past, &past_seen);
  ExpectSame(past, BlockMasks{}, "past the end");
  EXPECT_FALSE(past_seen.at || past_seen.escape);
}

}  // namespace
}  // namespace esb::governance::dlp
