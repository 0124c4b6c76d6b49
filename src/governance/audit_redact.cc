#include "governance/audit_redact.h"

#include <array>
#include <cctype>

#include "absl/strings/ascii.h"
#include "common/util.h"

namespace esb::governance {
namespace {

constexpr std::string_view kMasked = "[masked]";

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// "name=value" -> "name=[masked]"; a part without '=' is masked whole (it may be a bare value).
std::string MaskCookiePair(std::string_view pair) {
  pair = Trim(pair);
  const size_t eq = pair.find('=');
  if (eq == std::string_view::npos) return std::string(kMasked);
  return std::string(Trim(pair.substr(0, eq))) + "=" + std::string(kMasked);
}

}  // namespace

bool IsSensitiveHeader(std::string_view name) {
  static constexpr std::array<std::string_view, 9> kWords = {
      "key", "token", "secret", "password", "passwd", "session", "auth", "credential", "signature"};
  const std::string lower = absl::AsciiStrToLower(AbslView(name));
  if (lower == "cookie" || lower == "set-cookie") return true;  // authorization: "auth" below
  for (std::string_view w : kWords) {
    if (lower.find(w) != std::string::npos) return true;
  }
  return false;
}

std::string MaskHeaderValue(std::string_view name, std::string_view value) {
  if (!IsSensitiveHeader(name)) return std::string(value);
  const std::string lower = absl::AsciiStrToLower(AbslView(name));
  if (lower == "authorization" || lower == "proxy-authorization") {
    // Keep a scheme (letters, digits, '-', at most 32) so a reader sees Basic vs Bearer.
    std::string_view v = Trim(value);
    const size_t sp = v.find(' ');
    if (sp != std::string_view::npos && sp > 0 && sp <= 32) {
      std::string_view scheme = v.substr(0, sp);
      bool ok = true;
      for (char c : scheme) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '-');
      if (ok) return std::string(scheme) + " " + std::string(kMasked);
    }
    return std::string(kMasked);
  }
  if (lower == "cookie") {
    std::string out;
    size_t start = 0;
    while (start <= value.size()) {
      size_t end = value.find(';', start);
      if (end == std::string_view::npos) end = value.size();
      std::string_view part = value.substr(start, end - start);
      if (!Trim(part).empty()) {
        if (!out.empty()) out += "; ";
        out += MaskCookiePair(part);
      }
      start = end + 1;
    }
    return out.empty() ? std::string(kMasked) : out;
  }
  if (lower == "set-cookie") {
    return MaskCookiePair(value.substr(0, value.find(';')));
  }
  return std::string(kMasked);
}

std::string MaskUrlQuery(std::string_view path_and_query) {
  const size_t q = path_and_query.find('?');
  if (q == std::string_view::npos) return std::string(path_and_query);
  size_t end = path_and_query.find('#', q);
  if (end == std::string_view::npos) end = path_and_query.size();
  std::string out(path_and_query.substr(0, q + 1));
  std::string_view query = path_and_query.substr(q + 1, end - q - 1);
  size_t start = 0;
  bool first = true;
  while (start <= query.size()) {
    size_t amp = query.find('&', start);
    if (amp == std::string_view::npos) amp = query.size();
    std::string_view param = query.substr(start, amp - start);
    if (!first) out += '&';
    first = false;
    const size_t eq = param.find('=');
    if (eq != std::string_view::npos && IsSensitiveHeader(param.substr(0, eq))) {
      out += std::string(param.substr(0, eq + 1)) + std::string(kMasked);
    } else {
      out += std::string(param);
    }
    start = amp + 1;
  }
  out += std::string(path_and_query.substr(end));
  return out;
}

}  // namespace esb::governance
