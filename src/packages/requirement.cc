#include "packages/requirement.h"

#include <boost/json.hpp>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "packages/version.h"

namespace esb::packages {
namespace {

constexpr size_t kMaxNameLength = kMaxProjectNameLength;
// Parentheses in a marker nest at most this deep (the parser recurses).
constexpr int kMaxMarkerDepth = 32;
// Bounds for what the probe reports.
constexpr size_t kMaxProbeVersionLength = 100;
constexpr size_t kMaxProbeErrorLength = 300;

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

// PEP 508 marker variables, as `packaging` accepts them (including the legacy dotted names).
bool IsMarkerVariable(std::string_view w) {
  static constexpr std::string_view kVariables[] = {
      "python_version", "python_full_version", "os_name", "os.name", "sys_platform",
      "sys.platform", "platform_release", "platform_system", "platform_version",
      "platform.version", "platform_machine", "platform.machine",
      "platform_python_implementation", "platform.python_implementation",
      "python_implementation", "implementation_name", "implementation_version", "extra"};
  for (std::string_view v : kVariables) {
    if (w == v) return true;
  }
  return false;
}

// Recursive descent over the PEP 508 marker grammar:
//   marker := and ('or' and)*        and  := atom ('and' atom)*
//   atom   := '(' marker ')' | value op value
//   value  := VARIABLE | 'string' | "string"
//   op     := '<' | '<=' | '==' | '!=' | '>=' | '>' | '~=' | '===' | 'in' | 'not' 'in'
class MarkerParser {
 public:
  explicit MarkerParser(std::string_view text) : text_(text) {}

  absl::Status Parse() {
    if (absl::Status st = Tokenize(); !st.ok()) return st;
    if (tokens_.empty()) return absl::InvalidArgumentError("empty environment marker");
    if (absl::Status st = Or(0); !st.ok()) return st;
    if (pos_ != tokens_.size()) return Error("expected 'and', 'or' or the end");
    return absl::OkStatus();
  }

 private:
  enum class Kind { kLParen, kRParen, kValue, kCompare, kIn, kNot, kAnd, kOr };
  struct Token {
    Kind kind;
    size_t offset;  // into text_, for messages
  };

  absl::Status Error(std::string_view why) const {
    std::string at = pos_ < tokens_.size()
                         ? absl::StrCat(" at '", Printable(text_.substr(tokens_[pos_].offset), 20),
                                        "'")
                         : " at the end";
    return absl::InvalidArgumentError(
        absl::StrCat("invalid environment marker: ", AbslView(why), at));
  }
  absl::Status TokenError(size_t offset, std::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat("invalid environment marker: ", AbslView(why),
                                                   " at '",
                                                   Printable(text_.substr(offset), 20), "'"));
  }

  absl::Status Tokenize() {
    size_t i = 0;
    while (i < text_.size()) {
      char c = text_[i];
      if (IsSpace(c)) {
        ++i;
      } else if (c == '(' || c == ')') {
        tokens_.push_back({c == '(' ? Kind::kLParen : Kind::kRParen, i});
        ++i;
      } else if (c == '\'' || c == '"') {
        size_t close = text_.find(c, i + 1);
        if (close == std::string_view::npos) return TokenError(i, "unterminated string");
        tokens_.push_back({Kind::kValue, i});
        i = close + 1;
      } else if (c == '<' || c == '>' || c == '=' || c == '!' || c == '~') {
        size_t n = 0;
        for (std::string_view op : {"===", "==", "!=", "<=", ">=", "~=", "<", ">"}) {
          if (text_.substr(i).starts_with(op)) {
            n = op.size();
            break;
          }
        }
        if (n == 0) return TokenError(i, "unknown operator");
        tokens_.push_back({Kind::kCompare, i});
        i += n;
      } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.') {
        size_t start = i;
        while (i < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[i])) ||
                                    text_[i] == '_' || text_[i] == '.')) {
          ++i;
        }
        std::string_view w = text_.substr(start, i - start);
        if (w == "and") {
          tokens_.push_back({Kind::kAnd, start});
        } else if (w == "or") {
          tokens_.push_back({Kind::kOr, start});
        } else if (w == "in") {
          tokens_.push_back({Kind::kIn, start});
        } else if (w == "not") {
          tokens_.push_back({Kind::kNot, start});
        } else if (IsMarkerVariable(w)) {
          tokens_.push_back({Kind::kValue, start});
        } else {
          return TokenError(start, absl::StrCat("unknown marker variable '",
                                                Printable(w, 40),
                                                "' (strings must be quoted)"));
        }
      } else {
        return TokenError(i, "unexpected character");
      }
    }
    return absl::OkStatus();
  }

  bool At(Kind k) const { return pos_ < tokens_.size() && tokens_[pos_].kind == k; }

  absl::Status Or(int depth) {
    if (absl::Status st = And(depth); !st.ok()) return st;
    while (At(Kind::kOr)) {
      ++pos_;
      if (absl::Status st = And(depth); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  absl::Status And(int depth) {
    if (absl::Status st = Atom(depth); !st.ok()) return st;
    while (At(Kind::kAnd)) {
      ++pos_;
      if (absl::Status st = Atom(depth); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  absl::Status Atom(int depth) {
    if (At(Kind::kLParen)) {
      if (depth >= kMaxMarkerDepth) return Error("parentheses nested too deeply");
      ++pos_;
      if (absl::Status st = Or(depth + 1); !st.ok()) return st;
      if (!At(Kind::kRParen)) return Error("expected ')'");
      ++pos_;
      return absl::OkStatus();
    }
    if (!At(Kind::kValue)) return Error("expected a marker variable or a quoted string");
    ++pos_;
    if (At(Kind::kCompare) || At(Kind::kIn)) {
      ++pos_;
    } else if (At(Kind::kNot)) {
      ++pos_;
      if (!At(Kind::kIn)) return Error("expected 'in' after 'not'");
      ++pos_;
    } else {
      return Error("expected a comparison operator, 'in' or 'not in'");
    }
    if (!At(Kind::kValue)) return Error("expected a marker variable or a quoted string");
    ++pos_;
    return absl::OkStatus();
  }

  std::string_view text_;
  std::vector<Token> tokens_;
  size_t pos_ = 0;
};

}  // namespace

absl::Status ValidateMarker(std::string_view marker) {
  if (marker.size() > kMaxRequirementLength) {
    return absl::InvalidArgumentError("invalid environment marker: too long");
  }
  return MarkerParser(marker).Parse();
}

std::optional<std::string_view> FindMissingDistribution(std::string_view pip_output) {
  static constexpr std::string_view kNeedle = "No matching distribution found for ";
  size_t at = pip_output.find(kNeedle);
  if (at == std::string_view::npos) return std::nullopt;
  std::string_view rest = pip_output.substr(at + kNeedle.size());
  rest = rest.substr(0, rest.find_first_of("\r\n"));
  while (!rest.empty() && IsSpace(rest.front())) rest.remove_prefix(1);
  while (!rest.empty() && (IsSpace(rest.back()) || rest.back() == '.')) rest.remove_suffix(1);
  return rest;
}

absl::StatusOr<std::vector<ProbeEntry>> ParseProbeAnswer(std::string_view json, size_t count) {
  auto bad = [](std::string_view why) {
    return absl::FailedPreconditionError(
        absl::StrCat("the sandbox's answer to the installed-packages check is malformed: ",
                     AbslView(why)));
  };
  boost::system::error_code ec;
  boost::json::value doc =
      boost::json::parse(boost::json::string_view(json.data(), json.size()), ec);
  if (ec) return bad(absl::StrCat("not JSON (", ec.message(), ")"));
  const boost::json::array* entries = doc.if_array();
  if (entries == nullptr) return bad("not a JSON array");
  if (entries->size() < count) {
    return bad(absl::StrCat(entries->size(), " entries for ", count, " requirements"));
  }
  std::vector<ProbeEntry> out;
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const boost::json::object* o = (*entries)[i].if_object();
    if (o == nullptr) return bad(absl::StrCat("entry ", i, " is not an object"));
    ProbeEntry e;
    if (const auto* err = o->if_contains("error")) {
      if (!err->is_string()) return bad(absl::StrCat("entry ", i, ": \"error\" is not a string"));
      e.kind = ProbeEntry::Kind::kInvalid;
      e.error = Printable(std::string_view(err->get_string()), kMaxProbeErrorLength);
    } else if (const auto* skip = o->if_contains("skip")) {
      if (!skip->is_bool() || !skip->get_bool()) {
        return bad(absl::StrCat("entry ", i, ": \"skip\" is not true"));
      }
      e.kind = ProbeEntry::Kind::kSkip;
    } else {
      const auto* ok = o->if_contains("ok");
      const auto* installed = o->if_contains("installed");
      if (ok == nullptr || !ok->is_bool()) {
        return bad(absl::StrCat("entry ", i, ": \"ok\" is missing or not a boolean"));
      }
      if (installed != nullptr && !installed->is_string() && !installed->is_null()) {
        return bad(absl::StrCat("entry ", i, ": \"installed\" is neither a string nor null"));
      }
      if (ok->get_bool()) {
        if (installed == nullptr || !installed->is_string()) {
          return bad(absl::StrCat("entry ", i, ": satisfied, but no installed version"));
        }
        std::string_view v = installed->get_string();
        bool printable = !v.empty() && v.size() <= kMaxProbeVersionLength;
        for (char c : v) {
          printable = printable && static_cast<unsigned char>(c) > 0x20 &&
                      static_cast<unsigned char>(c) < 0x7f;
        }
        if (!printable) return bad(absl::StrCat("entry ", i, ": implausible installed version"));
        e.kind = ProbeEntry::Kind::kSatisfied;
        e.installed = std::string(v);
      } else {
        e.kind = ProbeEntry::Kind::kMissing;
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

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

  // Marker: everything after ';'. Checked here, so that a typo is a clear 400 naming the
  // problem, not a traceback from the sandbox's `packaging`; evaluated in the sandbox.
  std::string_view body = t;
  std::string_view marker;
  if (size_t semi = body.find(';'); semi != std::string_view::npos) {
    marker = TrimView(body.substr(semi + 1));
    if (marker.empty()) return bad("empty environment marker");
    if (absl::Status st = ValidateMarker(marker); !st.ok()) return bad(st.message());
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
  req.marker = std::string(marker);
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

std::string Printable(std::string_view s, size_t max) {
  std::string out(s.substr(0, max));
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  if (s.size() > max) out += "...";
  return out;
}

}  // namespace esb::packages
