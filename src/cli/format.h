// Human-readable output for the CLI: tables, times, sizes; plus base64 decoding for SSE.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace esb::cli {

// Left-aligned columns separated by two spaces, header first; no trailing spaces.
std::string RenderTable(const std::vector<std::string>& headers,
                        const std::vector<std::vector<std::string>>& rows);

// Makes untrusted text safe for one table cell on a terminal: newlines become "\n", tabs a
// space, other control characters (C0, DEL, C1) and invalid UTF-8 become '?'; cut to
// `max_chars` characters with "..." when longer (0 = no limit).
std::string SanitizeCell(std::string_view text, size_t max_chars = 0);

// Number of terminal columns of UTF-8 text (one per code point; good enough for tables).
size_t DisplayWidth(std::string_view text);

// "5s ago" / "in 3m" / "2h ago" / "4d ago"; "-" when unix_ms is 0.
std::string FormatRelative(int64_t unix_ms, int64_t now_ms);
// "850ms", "3.2s", "2m05s", "1h02m".
std::string FormatDurationMs(int64_t ms);
// "512 MiB", "1.5 GiB".
std::string FormatMiB(double mib);
// A number without trailing zeros: 1 → "1", 0.5 → "0.5".
std::string FormatNumber(double value);

// Standard base64 (RFC 4648, padding optional). false on bad input.
bool Base64Decode(std::string_view in, std::string* out);

}  // namespace esb::cli
