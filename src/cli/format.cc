#include "cli/format.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace esb::cli {

size_t DisplayWidth(std::string_view text) {
  size_t n = 0;
  for (unsigned char c : text) {
    if ((c & 0xC0) != 0x80) ++n;  // count lead bytes only
  }
  return n;
}

std::string RenderTable(const std::vector<std::string>& headers,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths(headers.size(), 0);
  for (size_t i = 0; i < headers.size(); ++i) widths[i] = DisplayWidth(headers[i]);
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size() && i < widths.size(); ++i) {
      widths[i] = std::max(widths[i], DisplayWidth(row[i]));
    }
  }
  std::string out;
  auto emit = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < widths.size(); ++i) {
      const std::string& cell = i < cells.size() ? cells[i] : std::string();
      line += cell;
      if (i + 1 < widths.size()) line.append(widths[i] - DisplayWidth(cell) + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  };
  emit(headers);
  for (const auto& row : rows) emit(row);
  return out;
}

std::string SanitizeCell(std::string_view text, size_t max_chars) {
  std::string out;
  size_t chars = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (max_chars != 0 && chars >= max_chars) {
      // Replace the tail with "..." (keeping the cell at max_chars characters).
      size_t keep = max_chars > 3 ? max_chars - 3 : 0;
      // Re-walk `out` to cut it at `keep` characters.
      size_t seen = 0, cut = 0;
      for (; cut < out.size(); ++cut) {
        if ((static_cast<unsigned char>(out[cut]) & 0xC0) != 0x80) {
          if (seen == keep) break;
          ++seen;
        }
      }
      out.resize(cut);
      out += "...";
      return out;
    }
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c == '\n') {
        out += "\\n";
      } else if (c == '\t') {
        out += ' ';
      } else if (c < 0x20 || c == 0x7f) {
        out += '?';
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      ++chars;
      continue;
    }
    // Multi-byte UTF-8: validate the sequence; reject overlongs, surrogates and C1 controls.
    size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    bool ok = len != 0 && i + len <= text.size();
    uint32_t cp = 0;
    if (ok) {
      cp = c & (0xFF >> (len + 1));
      for (size_t k = 1; k < len; ++k) {
        const unsigned char cc = static_cast<unsigned char>(text[i + k]);
        if ((cc & 0xC0) != 0x80) {
          ok = false;
          break;
        }
        cp = (cp << 6) | (cc & 0x3F);
      }
    }
    if (!ok) {  // broken sequence: replace one byte and resynchronise
      out += '?';
      ++i;
      ++chars;
      continue;
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    const bool allowed = cp >= kMin[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF) &&
                         !(cp >= 0x80 && cp <= 0x9F);
    if (allowed) {
      out.append(text.substr(i, len));
    } else {
      out += '?';  // one '?' for the whole well-formed but unwanted character
    }
    i += len;
    ++chars;
  }
  return out;
}

std::string FormatDurationMs(int64_t ms) {
  char buf[64];
  if (ms < 0) ms = 0;
  if (ms < 1000) {
    std::snprintf(buf, sizeof(buf), "%lldms", static_cast<long long>(ms));
  } else if (ms < 60'000) {
    std::snprintf(buf, sizeof(buf), "%.1fs", static_cast<double>(ms) / 1000.0);
  } else if (ms < 3'600'000) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(ms / 60'000),
                  static_cast<long long>((ms / 1000) % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(ms / 3'600'000),
                  static_cast<long long>((ms / 60'000) % 60));
  }
  return buf;
}

std::string FormatRelative(int64_t unix_ms, int64_t now_ms) {
  if (unix_ms == 0) return "-";
  const int64_t delta = unix_ms - now_ms;
  const int64_t secs = std::llabs(delta) / 1000;
  std::string amount;
  if (secs < 60) {
    amount = std::to_string(secs) + "s";
  } else if (secs < 3600) {
    amount = std::to_string(secs / 60) + "m";
  } else if (secs < 86400) {
    amount = std::to_string(secs / 3600) + "h";
  } else {
    amount = std::to_string(secs / 86400) + "d";
  }
  if (std::llabs(delta) < 1000) return "now";
  return delta > 0 ? "in " + amount : amount + " ago";
}

std::string FormatNumber(double value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3f", value);
  std::string s = buf;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

std::string FormatMiB(double mib) {
  if (mib >= 1024) return FormatNumber(mib / 1024) + " GiB";
  return FormatNumber(mib) + " MiB";
}

bool Base64Decode(std::string_view in, std::string* out) {
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (char ch : in) {
    int v;
    if (ch >= 'A' && ch <= 'Z') {
      v = ch - 'A';
    } else if (ch >= 'a' && ch <= 'z') {
      v = ch - 'a' + 26;
    } else if (ch >= '0' && ch <= '9') {
      v = ch - '0' + 52;
    } else if (ch == '+') {
      v = 62;
    } else if (ch == '/') {
      v = 63;
    } else if (ch == '=') {
      ++pad;
      continue;
    } else {
      return false;
    }
    if (pad != 0) return false;  // data after padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return pad <= 2 && bits < 6;
}

}  // namespace esb::cli
