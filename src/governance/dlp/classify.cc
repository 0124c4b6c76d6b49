#include "governance/dlp/classify.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
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

// One byte's classes for the portable code, one bit each.
constexpr uint8_t kByteDigit = 1, kByteWord = 2, kByteUpper = 4, kByteCardSep = 8, kByteNumSep = 16,
                  kByteMarker = 32, kByteAt = 64, kByteEscape = 128;

constexpr std::array<uint8_t, 256> ByteTable() {
  std::array<uint8_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const uint8_t bits = kLow[c & 15] & kHigh[c >> 4];
    uint8_t out = 0;
    if (bits & kDigit) out |= kByteDigit;
    if (bits & kWord) out |= kByteWord;
    if (c >= 'A' && c <= 'Z') out |= kByteUpper;
    if (bits & kCardSep) out |= kByteCardSep;
    if (bits & kNumSep) out |= kByteNumSep;
    if (bits & kMarker) out |= kByteMarker;
    if (c == '@') out |= kByteAt;
    if (c == '%' || c == '\\') out |= kByteEscape;
    t[c] = out;
  }
  return t;
}
constexpr std::array<uint8_t, 256> kByteTable = ByteTable();

// 64 bytes at t, a table lookup per byte; 8 bytes' class bytes at a time are turned into 8-bit
// masks with a multiply (bit 0 of byte j to bit j of the top byte: no carries).
void ClassifyBytes(const char* t, BlockMasks* out, ClassifySeen* seen) {
  *out = BlockMasks{};
  uint64_t any = 0;
  for (int g = 0; g < 8; ++g) {
    uint64_t w = 0;
    for (int j = 0; j < 8; ++j) {
      w |= static_cast<uint64_t>(kByteTable[static_cast<unsigned char>(t[8 * g + j])]) << (8 * j);
    }
    any |= w;
    const auto bits = [w, g](int k) -> uint64_t {
      return (((w >> k) & 0x0101010101010101ull) * 0x0102040810204080ull >> 56) << (8 * g);
    };
    out->digit |= bits(0);
    out->word |= bits(1);
    out->upper |= bits(2);
    out->card_sep |= bits(3);
    out->num_sep |= bits(4);
    out->marker |= bits(5);
  }
  seen->at |= (any & 0x4040404040404040ull) != 0;
  seen->escape |= (any & 0x8080808080808080ull) != 0;
}

#if defined(__x86_64__)
// A table repeated in each 16-byte lane of a 512-bit vector (a shuffle looks up within lanes).
constexpr std::array<uint8_t, 64> Lanes(const std::array<uint8_t, 16>& t) {
  std::array<uint8_t, 64> out{};
  for (int i = 0; i < 64; ++i) out[i] = t[i % 16];
  return out;
}
alignas(64) constexpr std::array<uint8_t, 64> kLowLanes = Lanes(kLow);
alignas(64) constexpr std::array<uint8_t, 64> kHighLanes = Lanes(kHigh);

__attribute__((target("avx2"), always_inline)) inline uint64_t Movemask(__m256i x) {
  return static_cast<uint32_t>(_mm256_movemask_epi8(x));
}

// `count` blocks of 64 readable bytes from t.
__attribute__((target("avx2"))) void ClassifyAvx2(const char* t, size_t count, BlockMasks* out,
                                                  ClassifySeen* seen) {
  const __m256i low_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLowLanes.data()));
  const __m256i high_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kHighLanes.data()));
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

// `count` blocks of 64 readable bytes from t.
__attribute__((target("avx512bw"))) void ClassifyAvx512(const char* t, size_t count,
                                                        BlockMasks* out, ClassifySeen* seen) {
  const __m512i low_table = _mm512_load_si512(kLowLanes.data());
  const __m512i high_table = _mm512_load_si512(kHighLanes.data());
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __mmask64 at = 0, escape = 0;
  for (size_t k = 0; k < count; ++k, t += 64) {
    const __m512i v = _mm512_loadu_si512(t);
    const __m512i low = _mm512_and_si512(v, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m512i cls = _mm512_and_si512(_mm512_shuffle_epi8(low_table, low),
                                         _mm512_shuffle_epi8(high_table, high));
    BlockMasks& m = out[k];
    m.digit = _mm512_movepi8_mask(cls);
    m.word = _mm512_test_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(kWord)));
    m.upper = _mm512_cmple_epu8_mask(_mm512_sub_epi8(v, _mm512_set1_epi8('A')),
                                     _mm512_set1_epi8('Z' - 'A'));
    m.card_sep = _mm512_test_epi8_mask(cls, _mm512_set1_epi8(kCardSep));
    m.num_sep = _mm512_test_epi8_mask(cls, _mm512_set1_epi8(kNumSep));
    m.marker = _mm512_test_epi8_mask(cls, _mm512_set1_epi8(kMarker));
    at |= _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('@'));
    escape |= _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('%')) |
              _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('\\'));
  }
  seen->at |= at != 0;
  seen->escape |= escape != 0;
}

#if defined(__SSE2__)
inline uint64_t Movemask16(__m128i x) { return static_cast<uint32_t>(_mm_movemask_epi8(x)); }

// lo <= v <= hi per byte (unsigned).
inline __m128i InRange(__m128i v, char lo, char hi) {
  const __m128i d = _mm_sub_epi8(v, _mm_set1_epi8(lo));
  return _mm_cmpeq_epi8(_mm_min_epu8(d, _mm_set1_epi8(static_cast<char>(hi - lo))), d);
}

// `count` blocks of 64 readable bytes from t; compares (SSE2 has no byte shuffle).
void ClassifySse2(const char* t, size_t count, BlockMasks* out, ClassifySeen* seen) {
  __m128i at = _mm_setzero_si128(), escape = _mm_setzero_si128();
  for (size_t k = 0; k < count; ++k, t += 64) {
    BlockMasks m;
    for (int q = 0; q < 4; ++q) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * q));
      const auto eq = [v](char c) { return _mm_cmpeq_epi8(v, _mm_set1_epi8(c)); };
      const __m128i digit = InRange(v, '0', '9');
      const __m128i upper = InRange(v, 'A', 'Z');
      const __m128i word =
          _mm_or_si128(_mm_or_si128(digit, upper), _mm_or_si128(InRange(v, 'a', 'z'), eq('_')));
      const __m128i paren = eq('(');
      const int shift = 16 * q;
      m.digit |= Movemask16(digit) << shift;
      m.word |= Movemask16(word) << shift;
      m.upper |= Movemask16(upper) << shift;
      m.card_sep |= Movemask16(_mm_or_si128(eq(' '), eq('-'))) << shift;
      m.num_sep |= Movemask16(_mm_or_si128(_mm_or_si128(eq('.'), paren), eq(')'))) << shift;
      m.marker |= Movemask16(_mm_or_si128(eq('+'), paren)) << shift;
      at = _mm_or_si128(at, eq('@'));
      escape = _mm_or_si128(escape, _mm_or_si128(eq('%'), eq('\\')));
    }
    out[k] = m;
  }
  seen->at |= Movemask16(at) != 0;
  seen->escape |= Movemask16(escape) != 0;
}
#endif

// What the CPU has, asked once (function-local statics: safe from any static initializer).
struct Cpu {
  bool avx2;
  bool avx512;
};
const Cpu& Features() {
  static const Cpu cpu = [] {
    __builtin_cpu_init();
    return Cpu{__builtin_cpu_supports("avx2") != 0, __builtin_cpu_supports("avx512bw") != 0};
  }();
  return cpu;
}
bool HasAvx2() { return Features().avx2; }
bool HasAvx512() { return Features().avx512; }
#else
bool HasAvx2() { return false; }
bool HasAvx512() { return false; }
#endif

using BlocksFn = void (*)(const char* t, size_t count, BlockMasks* out, ClassifySeen* seen);

void ClassifyPortable(const char* t, size_t count, BlockMasks* out, ClassifySeen* seen) {
  for (size_t k = 0; k < count; ++k) ClassifyBytes(t + 64 * k, out + k, seen);
}

BlocksFn Implementation(ClassifyImpl impl) {
#if defined(__x86_64__)
  if (impl == ClassifyImpl::kAvx512) return ClassifyAvx512;
  if (impl == ClassifyImpl::kAvx2) return ClassifyAvx2;
#endif
#if defined(__SSE2__)
  if (impl == ClassifyImpl::kSse2) return ClassifySse2;
#endif
  return ClassifyPortable;
}

#if defined(__SSE2__)
constexpr bool kHasSse2 = true;
#else
constexpr bool kHasSse2 = false;
#endif

ClassifyImpl Best() {
  return HasAvx512() ? ClassifyImpl::kAvx512
         : HasAvx2() ? ClassifyImpl::kAvx2
         : kHasSse2  ? ClassifyImpl::kSse2
                     : ClassifyImpl::kPortable;
}

BlocksFn BestFn() {
  static const BlocksFn fn = Implementation(Best());
  return fn;
}

// Full blocks straight from the text, the partial last one padded with classless NUL bytes,
// then empty blocks.
void Classify(BlocksFn fn, std::string_view text, size_t offset, size_t count, BlockMasks* out,
              ClassifySeen* seen) {
  const size_t available = offset < text.size() ? text.size() - offset : 0;
  const size_t full = std::min(count, available / 64);
  if (full > 0) fn(text.data() + offset, full, out, seen);
  if (full < count) {
    char padded[64] = {};
    const size_t rest = available - 64 * full;
    if (rest > 0) std::memcpy(padded, text.data() + offset + 64 * full, std::min<size_t>(rest, 64));
    fn(padded, 1, out + full, seen);
    for (size_t k = full + 1; k < count; ++k) out[k] = BlockMasks{};
  }
}

}  // namespace

bool ClassifySupported(ClassifyImpl impl) {
  switch (impl) {
    case ClassifyImpl::kPortable:
      return true;
    case ClassifyImpl::kSse2:
      return kHasSse2;
    case ClassifyImpl::kAvx2:
      return HasAvx2();
    case ClassifyImpl::kAvx512:
      return HasAvx512();
  }
  return false;
}

ClassifyImpl ClassifyBest() { return Best(); }

void ClassifyBlocks(std::string_view text, size_t offset, size_t count, BlockMasks* out,
                    ClassifySeen* seen) {
  Classify(BestFn(), text, offset, count, out, seen);
}

void ClassifyBlocksWith(ClassifyImpl impl, std::string_view text, size_t offset, size_t count,
                        BlockMasks* out, ClassifySeen* seen) {
  Classify(ClassifySupported(impl) ? Implementation(impl) : ClassifyPortable, text, offset, count,
           out, seen);
}

}  // namespace esb::governance::dlp
