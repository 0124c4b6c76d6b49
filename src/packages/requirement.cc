#include "packages/requirement.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "packages/version.h"

namespace esb::packages {
namespace {

constexpr size_t kMaxNameLength = 200;
constexpr size_t kMaxRequirementLength = 2000;

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}
bool IsSpace(char c) { return c == ' ' || c == '\t'; }

std::string_view TrimView(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool ValidName(std::string_view n) {
  if (n.empty()) return false;
  if (!std::isalnum(static_cast<unsigned char>(n.front())) ||
      !std::isalnum(static_cast<unsigned char>(n.back()))) {
    return false;
  }
  for (char c : n) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

}  // namespace

std::string NormalizeName(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  bool in_sep = false;
  for (char c : name) {
    if (c == '-' || c == '_' || c == '.') {
      if (!in_sep) out += '-';
      in_sep = true;
    } else {
      out += absl::ascii_tolower(static_cast<unsigned char>(c));
      in_sep = false;
    }
  }
  return out;
}

absl::StatusOr<Requirement> ParseRequirement(std::string_view text) {
  std::string_view t = TrimView(text);
  std::string shown(t.substr(0, 80));
  for (char& c : shown) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid package requirement '", shown,
                                                   "': ", why));
  };
  if (t.empty()) return bad("empty");
  if (t.size() > kMaxRequirementLength) return bad("too long");
  for (char c : t) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return bad("contains control characters");
    }
  }
  if (t.front() == '-') return bad("options such as -e or --index-url are not allowed");
  if (absl::StrContains(AbslView(t), "://")) return bad("URLs are not allowed; name a package instead");
  if (t.front() == '.' || t.front() == '/' || t.front() == '~' || t.front() == '\\' ||
      absl::StrContains(AbslView(t), "/") || absl::StrContains(AbslView(t), "\\")) {
    return bad("paths are not allowed; name a package instead");
  }

  // Marker: everything after ';' is ignored (after a sanity check it is not empty).
  std::string_view body = t;
  if (size_t semi = body.find(';'); semi != std::string_view::npos) {
    if (TrimView(body.substr(semi + 1)).empty()) return bad("empty environment marker");
    body = TrimView(body.substr(0, semi));
  }
  if (absl::StrContains(AbslView(body), "@")) {
    return bad("direct references ('name @ url') are not allowed");
  }

  size_t i = 0;
  while (i < body.size() && IsNameChar(body[i])) ++i;
  std::string_view name = body.substr(0, i);
  if (name.empty()) return bad("must start with a package name");
  if (name.size() > kMaxNameLength) {
    return bad(absl::StrCat("package name longer than ", kMaxNameLength, " characters"));
  }
  if (!ValidName(name)) {
    return bad("package names contain only letters, digits, '-', '_' and '.', and start and end "
               "with a letter or digit");
  }
  std::string lower = absl::AsciiStrToLower(AbslView(name));
  for (std::string_view ext : {".whl", ".tar.gz", ".zip", ".tgz", ".tar.bz2", ".egg"}) {
    if (absl::EndsWith(lower, AbslView(ext))) return bad("archive files are not allowed; name a package");
  }

  Requirement req;
  req.display = std::string(t);
  req.name = NormalizeName(name);
  while (i < body.size() && IsSpace(body[i])) ++i;

  if (i < body.size() && body[i] == '[') {
    size_t close = body.find(']', i);
    if (close == std::string_view::npos) return bad("unterminated [extras]");
    std::string_view list = body.substr(i + 1, close - i - 1);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      if (comma == std::string_view::npos) comma = list.size();
      std::string_view extra = TrimView(list.substr(start, comma - start));
      if (extra.empty()) {
        if (TrimView(list).empty()) break;  // "foo[]" is allowed and means no extras
        return bad("empty extra name");
      }
      if (!ValidName(extra) || extra.size() > kMaxNameLength) {
        return bad(absl::StrCat("invalid extra name '", AbslView(extra), "'"));
      }
      req.extras.push_back(NormalizeName(extra));
      start = comma + 1;
    }
    i = close + 1;
    while (i < body.size() && IsSpace(body[i])) ++i;
  }

  std::string_view rest = TrimView(body.substr(i));
  if (!rest.empty() && rest.front() == '(') {
    if (rest.back() != ')') return bad("unbalanced parentheses around the version");
    rest = TrimView(rest.substr(1, rest.size() - 2));
    if (rest.empty()) return bad("empty version specifier in parentheses");
  }
  if (!rest.empty()) {
    char c = rest.front();
    if (c != '=' && c != '!' && c != '<' && c != '>' && c != '~') {
      if (std::isalnum(static_cast<unsigned char>(c))) {
        return bad("one requirement per entry: found several names separated by whitespace");
      }
      return bad(absl::StrCat("unexpected text '", AbslView(rest.substr(0, 20)), "' after the name"));
    }
    auto spec = ParseSpecifier(rest);
    if (!spec.ok()) return bad(spec.status().message());
    req.specifier = spec->ToString();
  }
  return req;
}

}  // namespace esb::packages
