#include "governance/dlp/classify.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstring>

namespace esb::governance::dlp {
namespace {

// Class bits of one byte: LowTable[c & 15] & HighTable[c >> 4]. Each class is the set of bytes
// whose high nibble is in one set and low nibble in another, so the AND is exact per bit.
// Bit 7 is the digit class (a movemask reads it without a shift).
constexpr uint8_t kDigit = 1u << 7;     // high 3, low 0-9
constexpr uint8_t kLetterAO = 1u << 0;  // high 4 or 6, low 1-15: A-O, a-o
constexpr uint8_t kLetterPZ = 1u << 1;  // high 5 or 7, low 0-10: P-Z, p-z
constexpr uint8_t kUnder = 1u << 2;     // high 5, low 15: '_'
constexpr uint8_t kCardSep = 1u << 3;   // high 2, low 0 or 13: ' ', '-'
constexpr uint8_t kNumSep = 1u << 4;    // high 2, low 8, 9 or 14: '(', ')', '.'
constexpr uint8_t kMarker = 1u << 5;    // high 2, low 8 or 11: '(', '+'
constexpr uint8_t kWord = kDigit | kLetterAO | kLetterPZ | kUnder;

constexpr std::array<uint8_t, 16> LowTable() {
  std::array<uint8_t, 16> t{};
  for (int l = 0; l < 16; ++l) {
    uint8_t bits = 0;
    if (l <= 9) bits |= kDigit;
    if (l >= 1) bits |= kLetterAO;
    if (l <= 10) bits |= kLetterPZ;
    if (l == 15) bits |= kUnder;
    if (l == 0 || l == 13) bits |= kCardSep;
    if (l == 8 || l == 9 || l == 14) bits |= kNumSep;
    if (l == 8 || l == 11) bits |= kMarker;
    t[l] = bits;
  }
  return t;
}

constexpr std::array<uint8_t, 16> HighTable() {
  std::array<uint8_t, 16> t{};
  t[2] = kCardSep | kNumSep | kMarker;
  t[3] = kDigit;
  t[4] = kLetterAO;
  t[5] = kLetterPZ | kUnder;
  t[6] = kLetterAO;
  t[7] = kLetterPZ;
  return t;  // 8-15 (bytes ≥ 0x80): no class
}

constexpr std::array<uint8_t, 16> kLow = LowTable();
constexpr std::array<uint8_t, 16> kHigh = HighTable();

// n ≤ 64 bytes at t.
void ClassifyBytes(const char* t, size_t n, BlockMasks* out, ClassifySeen* seen) {
  *out = BlockMasks{};
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(t[i]);
    const uint8_t bits = kLow[c & 15] & kHigh[c >> 4];
    const uint64_t bit = uint64_t{1} << i;
    if (bits & kDigit) out->digit |= bit;
    if (bits & kWord) out->word |= bit;
    if (c >= 'A' && c <= 'Z') out->upper |= bit;
    if (bits & kCardSep) out->card_sep |= bit;
    if (bits & kNumSep) out->num_sep |= bit;
    if (bits & kMarker) out->marker |= bit;
    seen->at |= c == '@';
    seen->escape |= c == '%' || c == '\\';
  }
}

#if defined(__x86_64__)
constexpr std::array<uint8_t, 32> Twice(const std::array<uint8_t, 16>& t) {
  std::array<uint8_t, 32> out{};
  for (int i = 0; i < 16; ++i) out[i] = out[i + 16] = t[i];
  return out;
}
alignas(32) constexpr std::array<uint8_t, 32> kLow32 = Twice(kLow);
alignas(32) constexpr std::array<uint8_t, 32> kHigh32 = Twice(kHigh);

__attribute__((target("avx2"), always_inline)) inline uint64_t Movemask(__m256i x) {
  return static_cast<uint32_t>(_mm256_movemask_epi8(x));
}

// `count` blocks of 64 readable bytes from t.
__attribute__((target("avx2"))) void ClassifyAvx2(const char* t, size_t count, BlockMasks* out,
                                                  ClassifySeen* seen) {
  const __m256i low_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLow32.data()));
  const __m256i high_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kHigh32.data()));
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i word_bits = _mm256_set1_epi8(static_cast<char>(kWord));
  const __m256i zero = _mm256_setzero_si256();
  __m256i at = zero, escape = zero;
  for (size_t k = 0; k < count; ++k, t += 64) {
    BlockMasks m;
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * half));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      const __m256i cls = _mm256_and_si256(_mm256_shuffle_epi8(low_table, low),
                                           _mm256_shuffle_epi8(high_table, high));
      const int shift = 32 * half;
      // A class bit k to each byte's bit 7 (a 16-bit shift moves no bit across it).
      m.digit |= Movemask(cls) << shift;
      m.word |= (~Movemask(_mm256_cmpeq_epi8(_mm256_and_si256(cls, word_bits), zero)) & 0xffffffffu)
                << shift;
      m.upper |= Movemask(_mm256_and_si256(_mm256_cmpgt_epi8(v, _mm256_set1_epi8('A' - 1)),
                                           _mm256_cmpgt_epi8(_mm256_set1_epi8('Z' + 1), v)))
                 << shift;
      m.card_sep |= Movemask(_mm256_slli_epi16(cls, 4)) << shift;
      m.num_sep |= Movemask(_mm256_slli_epi16(cls, 3)) << shift;
      m.marker |= Movemask(_mm256_slli_epi16(cls, 2)) << shift;
      at = _mm256_or_si256(at, _mm256_cmpeq_epi8(v, _mm256_set1_epi8('@')));
      escape = _mm256_or_si256(escape, _mm256_cmpeq_epi8(v, _mm256_set1_epi8('%')));
      escape = _mm256_or_si256(escape, _mm256_cmpeq_epi8(v, _mm256_set1_epi8('\\')));
    }
    out[k] = m;
  }
  seen->at |= Movemask(at) != 0;
  seen->escape |= Movemask(escape) != 0;
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#else
constexpr bool kHasAvx2 = false;
#endif

}  // namespace

void ClassifyBlocks(std::string_view text, size_t offset, size_t count, BlockMasks* out,
                    ClassifySeen* seen) {
#if defined(__x86_64__)
  if (kHasAvx2) {
    const size_t available = offset < text.size() ? text.size() - offset : 0;
    const size_t full = std::min(count, available / 64);
    if (full > 0) ClassifyAvx2(text.data() + offset, full, out, seen);
    if (full < count) {
      // The partial last block, padded with classless NUL bytes; then empty blocks.
      char padded[64] = {};
      const size_t rest = available - 64 * full;
      if (rest > 0)
        std::memcpy(padded, text.data() + offset + 64 * full, std::min<size_t>(rest, 64));
      ClassifyAvx2(padded, 1, out + full, seen);
      for (size_t k = full + 1; k < count; ++k) out[k] = BlockMasks{};
    }
    return;
  }
#endif
  ClassifyBlocksPortable(text, offset, count, out, seen);
}

void ClassifyBlocksPortable(std::string_view text, size_t offset, size_t count, BlockMasks* out,
                            ClassifySeen* seen) {
  for (size_t k = 0; k < count; ++k, offset += 64) {
    const size_t n = offset < text.size() ? std::min<size_t>(64, text.size() - offset) : 0;
    ClassifyBytes(n > 0 ? text.data() + offset : text.data(), n, out + k, seen);
  }
}

bool ClassifyUsesAvx2() { return kHasAvx2; }

}  // namespace esb::governance::dlp
