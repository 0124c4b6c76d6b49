// The one set of UTF-8 helpers (strict: no overlong forms, no surrogates, nothing above
// U+10FFFF). Standard library only, so every target can link it (the static agent, the router's
// fuzz build).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace esb {

bool IsValidUtf8(std::string_view data);
// For splitting a byte stream into UTF-8 chunks: the length of the longest prefix of `data`
// that does not end inside an incomplete (but so far valid) multi-byte sequence. The remaining
// 1–3 bytes should be held back and prepended to the next chunk. Invalid bytes are not held back.
size_t Utf8CompletePrefix(std::string_view data);
// `in` with every byte that does not start a valid sequence replaced by U+FFFD, so that text
// from a sandbox (output, file names) is always valid in JSON; exact bytes travel as base64.
std::string SanitizeUtf8(std::string_view in);
// Appends the UTF-8 encoding of code point `cp` (<= U+10FFFF, not a surrogate) to `out`.
void AppendUtf8(uint32_t cp, std::string* out);

}  // namespace esb
