#include "common/utf8.h"

namespace esb {
namespace {

// Length of the valid UTF-8 sequence at p[0..n), or 0 if invalid. If the bytes are a valid but
// truncated prefix of a sequence, returns 0 and sets *incomplete.
size_t Utf8Step(const unsigned char* p, size_t n, bool* incomplete) {
  *incomplete = false;
  unsigned char c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return 0;
  }
  for (size_t i = 1; i < len; ++i) {
    if (i >= n) {
      *incomplete = true;
      return 0;
    }
    unsigned char b = p[i];
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

const unsigned char* Bytes(std::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

}  // namespace

bool IsValidUtf8(std::string_view data) {
  const unsigned char* p = Bytes(data);
  size_t n = data.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {  // fast path for ASCII runs
      ++i;
      continue;
    }
    bool incomplete;
    size_t len = Utf8Step(p + i, n - i, &incomplete);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

size_t Utf8CompletePrefix(std::string_view data) {
  const unsigned char* p = Bytes(data);
  size_t n = data.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    size_t start = n - back;
    if ((p[start] & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    bool incomplete;
    Utf8Step(p + start, back, &incomplete);
    return incomplete ? start : n;
  }
  return n;
}

std::string SanitizeUtf8(std::string_view in) {
  if (IsValidUtf8(in)) return std::string(in);
  const unsigned char* p = Bytes(in);
  std::string out;
  out.reserve(in.size() + 16);
  size_t i = 0;
  while (i < in.size()) {
    bool incomplete;
    size_t len = Utf8Step(p + i, in.size() - i, &incomplete);
    if (len > 0) {
      out.append(in.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace esb
