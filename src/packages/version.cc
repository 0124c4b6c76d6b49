#include "packages/version.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"

namespace esb::packages {
namespace {

constexpr size_t kMaxVersionLength = 200;
// Components beyond this would overflow int64; no real version has them.
constexpr size_t kMaxDigits = 18;

bool IsSep(char c) { return c == '.' || c == '-' || c == '_'; }

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// A tiny cursor over the lowercased text; every Try* restores the position on failure.
class Cursor {
 public:
  explicit Cursor(const std::string& s) : s_(s) {}
  size_t pos = 0;
  bool AtEnd() const { return pos >= s_.size(); }
  char Peek() const { return AtEnd() ? '\0' : s_[pos]; }
  bool TryChar(char c) {
    if (Peek() != c) return false;
    ++pos;
    return true;
  }
  bool TrySep() {
    if (!IsSep(Peek())) return false;
    ++pos;
    return true;
  }
  bool TryWord(std::string_view w) {
    if (s_.compare(pos, w.size(), w) != 0) return false;
    pos += w.size();
    return true;
  }
  // -1: no digits; -2: too many digits.
  int64_t TryNumber() {
    size_t start = pos;
    while (std::isdigit(static_cast<unsigned char>(Peek()))) ++pos;
    if (pos == start) return -1;
    if (pos - start > kMaxDigits) return -2;
    return std::stoll(s_.substr(start, pos - start));
  }
  // The optional "[sep][N]" after a pre/post/dev word: N, 0 when absent (nothing consumed),
  // -2 when too many digits.
  int64_t TryImplicitNumber() {
    size_t before = pos;
    TrySep();
    int64_t n = TryNumber();
    if (n == -1) {
      pos = before;
      return 0;
    }
    return n;
  }

 private:
  const std::string& s_;
};

int CompareRelease(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    int64_t x = i < a.size() ? a[i] : 0;
    int64_t y = i < b.size() ? b[i] : 0;
    if (x != y) return x < y ? -1 : 1;
  }
  return 0;
}

bool IsAllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Local segments: numbers compare numerically and sort after strings; a longer local version
// with an equal prefix sorts later.
int CompareLocal(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a.empty() == b.empty() ? 0 : (a.empty() ? -1 : 1);
  std::vector<std::string_view> pa, pb;
  auto split = [](const std::string& s, std::vector<std::string_view>* out) {
    size_t start = 0;
    for (size_t i = 0; i <= s.size(); ++i) {
      if (i == s.size() || s[i] == '.') {
        out->push_back(std::string_view(s).substr(start, i - start));
        start = i + 1;
      }
    }
  };
  split(a, &pa);
  split(b, &pb);
  for (size_t i = 0; i < std::min(pa.size(), pb.size()); ++i) {
    bool na = IsAllDigits(pa[i]), nb = IsAllDigits(pb[i]);
    if (na && nb) {
      // Compare as numbers without overflow: strip leading zeros, then length, then text.
      std::string_view x = pa[i], y = pb[i];
      while (x.size() > 1 && x[0] == '0') x.remove_prefix(1);
      while (y.size() > 1 && y[0] == '0') y.remove_prefix(1);
      if (x.size() != y.size()) return x.size() < y.size() ? -1 : 1;
      if (x != y) return x < y ? -1 : 1;
    } else if (na != nb) {
      return na ? 1 : -1;
    } else if (pa[i] != pb[i]) {
      return pa[i] < pb[i] ? -1 : 1;
    }
  }
  if (pa.size() != pb.size()) return pa.size() < pb.size() ? -1 : 1;
  return 0;
}

}  // namespace

absl::StatusOr<Version> ParseVersion(std::string_view text) {
  std::string trimmed = Trim(text);
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid version '", trimmed.substr(0, 64), "': ", AbslView(why)));
  };
  if (trimmed.empty()) return bad("empty");
  if (trimmed.size() > kMaxVersionLength) return bad("too long");
  std::string s = absl::AsciiStrToLower(trimmed);
  Version v;
  v.original = trimmed;
  Cursor c(s);
  c.TryChar('v');

  // Epoch and release.
  int64_t n = c.TryNumber();
  if (n == -2) return bad("number too large");
  if (n < 0) return bad("expected a release number");
  if (c.TryChar('!')) {
    v.epoch = n;
    n = c.TryNumber();
    if (n == -2) return bad("number too large");
    if (n < 0) return bad("expected a release number after the epoch");
  }
  v.release.push_back(n);
  while (c.Peek() == '.') {
    size_t save = c.pos;
    ++c.pos;
    int64_t m = c.TryNumber();
    if (m == -2) return bad("number too large");
    if (m < 0) {
      c.pos = save;
      break;
    }
    v.release.push_back(m);
  }

  // Pre-release: [sep](a|alpha|b|beta|c|rc|pre|preview)[sep][N]
  {
    size_t save = c.pos;
    c.TrySep();
    static constexpr std::pair<std::string_view, char> kPre[] = {
        {"alpha", 'a'}, {"beta", 'b'}, {"preview", 'r'}, {"pre", 'r'},
        {"rc", 'r'},    {"a", 'a'},    {"b", 'b'},       {"c", 'r'}};
    bool found = false;
    for (const auto& [word, kind] : kPre) {
      if (c.TryWord(word)) {
        v.pre_kind = kind;
        found = true;
        break;
      }
    }
    if (found) {
      int64_t m = c.TryImplicitNumber();
      if (m == -2) return bad("number too large");
      v.pre_num = m;
    } else {
      c.pos = save;
    }
  }

  // Post-release: "-N" or [sep](post|rev|r)[sep][N]
  {
    size_t save = c.pos;
    if (c.TryChar('-') && std::isdigit(static_cast<unsigned char>(c.Peek()))) {
      int64_t m = c.TryNumber();
      if (m == -2) return bad("number too large");
      v.has_post = true;
      v.post = m;
    } else {
      c.pos = save;
      c.TrySep();
      if (c.TryWord("post") || c.TryWord("rev") || c.TryWord("r")) {
        v.has_post = true;
        int64_t m = c.TryImplicitNumber();
        if (m == -2) return bad("number too large");
        v.post = m;
      } else {
        c.pos = save;
      }
    }
  }

  // Dev release: [sep]dev[sep][N]
  {
    size_t save = c.pos;
    c.TrySep();
    if (c.TryWord("dev")) {
      v.has_dev = true;
      int64_t m = c.TryImplicitNumber();
      if (m == -2) return bad("number too large");
      v.dev = m;
    } else {
      c.pos = save;
    }
  }

  // Local version: +[a-z0-9]+([-_.][a-z0-9]+)*
  if (c.TryChar('+')) {
    std::string local;
    bool need_alnum = true;
    while (!c.AtEnd()) {
      char ch = c.Peek();
      if (std::isalnum(static_cast<unsigned char>(ch))) {
        local += ch;
        need_alnum = false;
      } else if (IsSep(ch) && !need_alnum) {
        local += '.';
        need_alnum = true;
      } else {
        break;
      }
      ++c.pos;
    }
    if (local.empty() || need_alnum) return bad("malformed local version");
    v.local = local;
  }
  if (!c.AtEnd()) return bad(absl::StrCat("unexpected text at '", s.substr(c.pos, 20), "'"));
  return v;
}

std::string Version::ToString() const {
  std::string out;
  if (epoch != 0) absl::StrAppend(&out, epoch, "!");
  absl::StrAppend(&out, absl::StrJoin(release, "."));
  if (pre_kind != 0) {
    absl::StrAppend(&out, pre_kind == 'r' ? "rc" : std::string(1, pre_kind), pre_num);
  }
  if (has_post) absl::StrAppend(&out, ".post", post);
  if (has_dev) absl::StrAppend(&out, ".dev", dev);
  if (!local.empty()) absl::StrAppend(&out, "+", local);
  return out;
}

Version Version::BaseVersion() const {
  Version b;
  b.epoch = epoch;
  b.release = release;
  b.original = b.ToString();
  return b;
}

Version Version::Public() const {
  Version p = *this;
  p.local.clear();
  p.original = p.ToString();
  return p;
}

int Version::Compare(const Version& o) const {
  if (epoch != o.epoch) return epoch < o.epoch ? -1 : 1;
  if (int r = CompareRelease(release, o.release); r != 0) return r;
  // Pre-release key: a dev-only release sorts before every pre-release; a final (or post)
  // release sorts after them. Encode as (rank, kind, num).
  auto pre_key = [](const Version& v) -> std::tuple<int, char, int64_t> {
    if (v.pre_kind == 0 && !v.has_post && v.has_dev) return {0, 0, 0};
    if (v.pre_kind == 0) return {2, 0, 0};
    return {1, v.pre_kind, v.pre_num};  // 'a' < 'b' < 'r'
  };
  auto pa = pre_key(*this), pb = pre_key(o);
  if (pa != pb) return pa < pb ? -1 : 1;
  auto post_key = [](const Version& v) -> std::pair<int, int64_t> {
    return v.has_post ? std::pair<int, int64_t>{1, v.post} : std::pair<int, int64_t>{0, 0};
  };
  auto qa = post_key(*this), qb = post_key(o);
  if (qa != qb) return qa < qb ? -1 : 1;
  auto dev_key = [](const Version& v) -> std::pair<int, int64_t> {
    return v.has_dev ? std::pair<int, int64_t>{0, v.dev} : std::pair<int, int64_t>{1, 0};
  };
  auto da = dev_key(*this), db = dev_key(o);
  if (da != db) return da < db ? -1 : 1;
  return CompareLocal(local, o.local);
}

// ---------------------------------------------------------------------------------------------
// Specifiers

namespace {

// Matches v against the wildcard prefix of "==1.2.*": same epoch and the release, zero-padded,
// starts with the prefix. Pre/post/dev/local of v do not matter.
bool PrefixMatch(const Version& v, const Version& prefix) {
  if (v.epoch != prefix.epoch) return false;
  for (size_t i = 0; i < prefix.release.size(); ++i) {
    int64_t x = i < v.release.size() ? v.release[i] : 0;
    if (x != prefix.release[i]) return false;
  }
  return true;
}

bool EqualMatch(const Version& v, const SpecifierClause& c) {
  if (c.wildcard) return PrefixMatch(v, c.version);
  // Without a local segment in the specifier, the candidate's local segment is ignored.
  if (c.version.local.empty()) return v.Public().Compare(c.version) == 0;
  return v.Compare(c.version) == 0;
}

bool ClauseContains(const SpecifierClause& c, const Version& v) {
  const Version& s = c.version;
  if (c.op == "===") return absl::AsciiStrToLower(v.original) == absl::AsciiStrToLower(c.version_text);
  if (c.op == "==") return EqualMatch(v, c);
  if (c.op == "!=") return !EqualMatch(v, c);
  Version pub = v.Public();
  if (c.op == "<=") return pub.Compare(s) <= 0;
  if (c.op == ">=") return pub.Compare(s) >= 0;
  if (c.op == "<") {
    if (pub.Compare(s) >= 0) return false;
    // "<3.0" must not match 3.0a1 unless the specifier itself is a prerelease.
    if (!s.IsPrerelease() && v.IsPrerelease() && v.BaseVersion() == s.BaseVersion()) return false;
    return true;
  }
  if (c.op == ">") {
    if (pub.Compare(s) <= 0) return false;
    // ">1.0" must not match 1.0.post1 (unless the specifier is a post release) nor 1.0+local.
    if (!s.IsPostrelease() && v.IsPostrelease() && v.BaseVersion() == s.BaseVersion()) {
      return false;
    }
    if (!v.local.empty() && v.BaseVersion() == s.BaseVersion()) return false;
    return true;
  }
  if (c.op == "~=") {
    // ~=1.4.5 is >=1.4.5, ==1.4.*
    if (pub.Compare(s) < 0) return false;
    Version prefix = s.BaseVersion();
    prefix.release.pop_back();
    return PrefixMatch(v, prefix);
  }
  return false;
}

}  // namespace

bool Specifier::MentionsPrerelease() const {
  for (const auto& c : clauses_) {
    if (c.op == "===" || c.op == "!=" || c.wildcard) continue;
    if (c.version.IsPrerelease()) return true;
  }
  return false;
}

bool Specifier::Contains(const Version& v, bool allow_prereleases) const {
  if (v.IsPrerelease() && !allow_prereleases && !MentionsPrerelease()) return false;
  for (const auto& c : clauses_) {
    if (!ClauseContains(c, v)) return false;
  }
  return true;
}

std::string Specifier::ToString() const {
  std::vector<std::string> parts;
  for (const auto& c : clauses_) {
    parts.push_back(absl::StrCat(c.op, c.version_text, c.wildcard ? ".*" : ""));
  }
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<Specifier> ParseSpecifier(std::string_view text) {
  std::string all = Trim(text);
  std::vector<SpecifierClause> clauses;
  if (all.empty()) return Specifier();
  if (all.size() > 1000) return absl::InvalidArgumentError("version specifier too long");
  size_t start = 0;
  while (start <= all.size()) {
    size_t comma = all.find(',', start);
    if (comma == std::string::npos) comma = all.size();
    std::string part = Trim(std::string_view(all).substr(start, comma - start));
    start = comma + 1;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("invalid version specifier '", part,
                                                     "' in '", all, "': ", why));
    };
    if (part.empty()) return bad("empty clause");
    SpecifierClause c;
    static constexpr std::string_view kOps[] = {"===", "~=", "==", "!=", "<=", ">=", "<", ">"};
    for (std::string_view op : kOps) {
      if (part.compare(0, op.size(), op) == 0) {
        c.op = std::string(op);
        break;
      }
    }
    if (c.op.empty()) return bad("expected one of == != <= >= < > ~= ===");
    c.version_text = Trim(std::string_view(part).substr(c.op.size()));
    if (c.version_text.empty()) return bad("missing version");
    for (char ch : c.version_text) {
      if (std::isspace(static_cast<unsigned char>(ch)) || ch == ';' || ch == '(' || ch == ')') {
        return bad("unexpected character in version");
      }
    }
    if (c.op == "===") {
      auto parsed = ParseVersion(c.version_text);
      if (parsed.ok()) c.version = *parsed;
      clauses.push_back(std::move(c));
      continue;
    }
    if (c.version_text.size() > 2 && c.version_text.ends_with(".*")) {
      if (c.op != "==" && c.op != "!=") return bad("'.*' is only allowed with == and !=");
      c.wildcard = true;
      c.version_text.resize(c.version_text.size() - 2);
    }
    auto parsed = ParseVersion(c.version_text);
    if (!parsed.ok()) return bad(parsed.status().message());
    c.version = *parsed;
    if (c.wildcard && (c.version.IsPrerelease() || c.version.has_post || !c.version.local.empty())) {
      return bad("a '.*' prefix may only contain an epoch and release numbers");
    }
    if (!c.version.local.empty() && c.op != "==" && c.op != "!=") {
      return bad("local versions are only allowed with == and !=");
    }
    if (c.op == "~=" && c.version.release.size() < 2) {
      return bad("~= needs at least two release components (e.g. ~=1.4)");
    }
    clauses.push_back(std::move(c));
    if (comma == all.size()) break;
  }
  return Specifier(std::move(clauses));
}

}  // namespace esb::packages
