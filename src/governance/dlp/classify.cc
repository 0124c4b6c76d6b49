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
constexpr uint8_t kHigh45 = 1u << 6;    // high 4 or 5 (with a letter bit: A-Z)

constexpr std::array<uint8_t, 16> LowTable() {
  std::array<uint8_t, 16> t{};
  for (int l = 0; l < 16; ++l) {
    uint8_t bits = kHigh45;
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
  t[4] = kLetterAO | kHigh45;
  t[5] = kLetterPZ | kUnder | kHigh45;
  t[6] = kLetterAO;
  t[7] = kLetterPZ;
  return t;  // 8-15 (bytes ≥ 0x80): no class
}

constexpr std::array<uint8_t, 16> kLow = LowTable();
constexpr std::array<uint8_t, 16> kHigh = HighTable();

// The block's masks from its per-class-bit masks.
void Finish(uint64_t digit, uint64_t ao, uint64_t pz, uint64_t under, uint64_t card_sep,
            uint64_t num_sep, uint64_t marker, uint64_t high45, uint64_t at, uint64_t escape,
            BlockMasks* out) {
  out->digit = digit;
  out->word = digit | ao | pz | under;
  out->upper = (ao | pz) & high45;
  out->card_sep = card_sep;
  out->num_sep = num_sep;
  out->marker = marker;
  out->at = at;
  out->escape = escape;
}

void ClassifyBytes(const char* t, size_t n, BlockMasks* out) {
  uint64_t m[8] = {};
  uint64_t at = 0, escape = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(t[i]);
    const uint8_t bits = kLow[c & 15] & kHigh[c >> 4];
    for (int k = 0; k < 8; ++k) m[k] |= static_cast<uint64_t>((bits >> k) & 1) << i;
    at |= static_cast<uint64_t>(c == '@') << i;
    escape |= static_cast<uint64_t>(c == '%' || c == '\\') << i;
  }
  Finish(m[7], m[0], m[1], m[2], m[3], m[4], m[5], m[6], at, escape, out);
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

// 64 readable bytes at t.
__attribute__((target("avx2"))) void ClassifyAvx2(const char* t, BlockMasks* out) {
  const __m256i low_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLow32.data()));
  const __m256i high_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kHigh32.data()));
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  uint64_t m[8] = {};
  uint64_t at = 0, escape = 0;
  for (int half = 0; half < 2; ++half) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * half));
    const __m256i low = _mm256_and_si256(v, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    const __m256i cls = _mm256_and_si256(_mm256_shuffle_epi8(low_table, low),
                                         _mm256_shuffle_epi8(high_table, high));
    const int shift = 32 * half;
    // Bit k of each byte to bit 7 (a 16-bit shift moves no bit across a byte's bit 7).
    m[7] |= Movemask(cls) << shift;
    m[6] |= Movemask(_mm256_slli_epi16(cls, 1)) << shift;
    m[5] |= Movemask(_mm256_slli_epi16(cls, 2)) << shift;
    m[4] |= Movemask(_mm256_slli_epi16(cls, 3)) << shift;
    m[3] |= Movemask(_mm256_slli_epi16(cls, 4)) << shift;
    m[2] |= Movemask(_mm256_slli_epi16(cls, 5)) << shift;
    m[1] |= Movemask(_mm256_slli_epi16(cls, 6)) << shift;
    m[0] |= Movemask(_mm256_slli_epi16(cls, 7)) << shift;
    at |= Movemask(_mm256_cmpeq_epi8(v, _mm256_set1_epi8('@'))) << shift;
    escape |= Movemask(_mm256_or_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8('%')),
                                       _mm256_cmpeq_epi8(v, _mm256_set1_epi8('\\'))))
              << shift;
  }
  Finish(m[7], m[0], m[1], m[2], m[3], m[4], m[5], m[6], at, escape, out);
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#else
constexpr bool kHasAvx2 = false;
#endif

}  // namespace

void ClassifyBlock(std::string_view text, size_t offset, BlockMasks* out) {
#if defined(__x86_64__)
  if (kHasAvx2) {
    if (offset + 64 <= text.size()) {
      ClassifyAvx2(text.data() + offset, out);
    } else {
      char padded[64] = {};
      const size_t n = offset < text.size() ? text.size() - offset : 0;
      if (n > 0) std::memcpy(padded, text.data() + offset, n);
      ClassifyAvx2(padded, out);
    }
    return;
  }
#endif
  ClassifyBlockPortable(text, offset, out);
}

void ClassifyBlockPortable(std::string_view text, size_t offset, BlockMasks* out) {
  const size_t n = offset < text.size() ? std::min<size_t>(64, text.size() - offset) : 0;
  ClassifyBytes(n > 0 ? text.data() + offset : text.data(), n, out);
}

bool ClassifyUsesAvx2() { return kHasAvx2; }

}  // namespace esb::governance::dlp
