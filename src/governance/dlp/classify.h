// Byte classes of a text, 64 bytes at a time, as bit masks (internal to the DLP library): the
// hand-written scanners (number-shaped rules, e-mail) find their candidate starts with a few
// shifts and ANDs on these masks instead of looking at every byte. One table lookup per byte
// (two nibble tables ANDed: every class is a rectangle of high × low nibbles), done with
// AVX-512BW or AVX2 shuffles when the CPU has them (chosen at run time), else SSE2 compares
// (x86-64), else one byte at a time; all give the same masks (classify_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace esb::governance::dlp {

// Bit i of each mask describes byte i of the block. Bytes past the end of the text are
// classless (like a NUL byte: not a word byte, so the end of the text is a \b boundary).
struct BlockMasks {
  uint64_t digit = 0;     // [0-9]
  uint64_t word = 0;      // [0-9A-Za-z_] (RE2's \w, ASCII only)
  uint64_t upper = 0;     // [A-Z]
  uint64_t card_sep = 0;  // ' ' or '-' (what joins the digit groups of a card or SSN)
  uint64_t num_sep = 0;   // '.', '(' or ')' (what else a phone number contains)
  uint64_t marker = 0;    // '+' or '(' (what starts a phone number without a context word)
};

// Whether the classified bytes had a '@' (e-mail candidates) or a '%' or '\\' (a decoded view
// may differ from the text); ORed in by each call.
struct ClassifySeen {
  bool at = false;
  bool escape = false;
};

// The implementations: one byte at a time (any CPU), SSE2 compares (every x86-64), AVX2
// shuffles, AVX-512BW shuffles and mask tests.
enum class ClassifyImpl : uint8_t { kPortable, kSse2, kAvx2, kAvx512 };
// Whether this CPU (and build) has `impl`.
bool ClassifySupported(ClassifyImpl impl);
// The fastest supported implementation (what ClassifyBlocks uses).
ClassifyImpl ClassifyBest();

// The masks of the `count` blocks text[offset + 64 k, offset + 64 (k + 1)) into out[k].
void ClassifyBlocks(std::string_view text, size_t offset, size_t count, BlockMasks* out,
                    ClassifySeen* seen);
// The same with a given supported implementation (the tests compare them).
void ClassifyBlocksWith(ClassifyImpl impl, std::string_view text, size_t offset, size_t count,
                        BlockMasks* out, ClassifySeen* seen);

}  // namespace esb::governance::dlp
