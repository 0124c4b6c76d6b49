// Byte classes of a text, 64 bytes at a time, as bit masks (internal to the DLP library): the
// hand-written scanners (number-shaped rules, e-mail) find their candidate starts with a few
// shifts and ANDs on these masks instead of looking at every byte. One table lookup per byte
// (two nibble tables ANDed: every class is a rectangle of high × low nibbles), done with
// AVX2 shuffles when the CPU has them (chosen at run time), else one byte at a time; both give
// the same masks (classify_test.cc).
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
  uint64_t at = 0;        // '@'
  uint64_t escape = 0;    // '%' or '\\' (a decoded view may differ from the text)
};

// The masks of text[offset, offset + 64) (fewer bytes at the end of the text).
void ClassifyBlock(std::string_view text, size_t offset, BlockMasks* out);

// The one-byte-at-a-time implementation (what ClassifyBlock uses without AVX2); for the tests.
void ClassifyBlockPortable(std::string_view text, size_t offset, BlockMasks* out);

// Whether ClassifyBlock uses AVX2 on this CPU.
bool ClassifyUsesAvx2();

}  // namespace esb::governance::dlp
