// The byte-class masks (classify.h): every implementation this CPU has agrees with the portable
// one on every byte value at every position, on random text, batches and tails, and the classes
// are what their comments say.
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

std::string Name(ClassifyImpl impl) {
  switch (impl) {
    case ClassifyImpl::kSse2:
      return "sse2";
    case ClassifyImpl::kAvx2:
      return "avx2";
    case ClassifyImpl::kAvx512:
      return "avx512";
    case ClassifyImpl::kPortable:
      break;
  }
  return "portable";
}

// The SIMD implementations this CPU has (each is compared with the portable one).
std::vector<ClassifyImpl> Fast() {
  std::vector<ClassifyImpl> out;
  for (ClassifyImpl impl : {ClassifyImpl::kSse2, ClassifyImpl::kAvx2, ClassifyImpl::kAvx512}) {
    if (ClassifySupported(impl)) {
      out.push_back(impl);
    } else {
      std::printf("note: this CPU (or build) has no %s: not compared\n", Name(impl).c_str());
    }
  }
  return out;
}

TEST(DlpClassifyTest, EveryByteValueHasItsClasses) {
  const std::vector<ClassifyImpl> fast = Fast();
  for (int c = 0; c < 256; ++c) {
    const std::string text(1, static_cast<char>(c));
    BlockMasks m;
    ClassifySeen seen;
    ClassifyBlocksWith(ClassifyImpl::kPortable, text, 0, 1, &m, &seen);
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
    for (ClassifyImpl impl : fast) {
      // The byte at every 9th position of a full block of classless 0x80 bytes.
      for (size_t pos = 0; pos < 64; pos += 9) {
        std::string block(64, '\x80');
        block[pos] = static_cast<char>(c);
        BlockMasks a, b;
        ClassifySeen a_seen, b_seen;
        ClassifyBlocksWith(impl, block, 0, 1, &a, &a_seen);
        ClassifyBlocksWith(ClassifyImpl::kPortable, block, 0, 1, &b, &b_seen);
        const std::string what =
            Name(impl) + ": byte " + std::to_string(c) + " at " + std::to_string(pos);
        ExpectSame(a, b, what);
        ExpectSame(a_seen, b_seen, what);
      }
      // A one-byte text: its block, then a block past the end with nothing in it.
      BlockMasks short_text[2];
      ClassifySeen short_seen;
      ClassifyBlocksWith(impl, text, 0, 2, short_text, &short_seen);
      const std::string what = Name(impl) + ": one-byte text " + std::to_string(c);
      ExpectSame(short_text[0], m, what);
      ExpectSame(short_text[1], BlockMasks{}, what + ", past the end");
      ExpectSame(short_seen, seen, what);
    }
  }
}

TEST(DlpClassifyTest, RandomBlocksBatchesAndTailsAgree) {
  uint64_t x = 88172645463325252ull;
  std::string text(4096 + 37, '\0');
  for (char& c : text) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x);
  }
  const std::vector<ClassifyImpl> fast = Fast();
  // Batches of 1..20 blocks from every 13th offset, running past the end.
  for (size_t offset = 0; offset < text.size(); offset += 13) {
    const size_t count = 1 + offset % 20;
    std::vector<BlockMasks> want(count);
    ClassifySeen want_seen;
    ClassifyBlocksWith(ClassifyImpl::kPortable, text, offset, count, want.data(), &want_seen);
    for (ClassifyImpl impl : fast) {
      std::vector<BlockMasks> got(count);
      ClassifySeen got_seen;
      ClassifyBlocksWith(impl, text, offset, count, got.data(), &got_seen);
      const std::string what = Name(impl) + ": offset " + std::to_string(offset);
      for (size_t k = 0; k < count; ++k) {
        ExpectSame(got[k], want[k], what + " block " + std::to_string(k));
      }
      ExpectSame(got_seen, want_seen, what);
    }
  }
  // ClassifyBlocks is the best implementation; past the end there is nothing.
  BlockMasks a, b;
  ClassifySeen a_seen, b_seen;
  ClassifyBlocks(text, 64, 1, &a, &a_seen);
  ClassifyBlocksWith(ClassifyBest(), text, 64, 1, &b, &b_seen);
  ExpectSame(a, b, "ClassifyBlocks");
  BlockMasks past;
  ClassifySeen past_seen;
  ClassifyBlocks(text, text.size(), 1, &past, &past_seen);
  ExpectSame(past, BlockMasks{}, "past the end");
  EXPECT_FALSE(past_seen.at || past_seen.escape);
}

}  // namespace
}  // namespace esb::governance::dlp
