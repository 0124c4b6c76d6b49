// PEP 440 versions and version specifiers, as pip understands them.
//
// The daemon picks which wheel to download for a requirement such as "foo>=1.2,!=1.3.*", so it
// has to order versions and evaluate specifiers exactly like pip does inside the sandbox;
// otherwise pip would reject what we fetched and the fetch loop would never converge.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace esb::packages {

// A parsed PEP 440 version. Parsing accepts the spellings PEP 440 normalises ("1.0-alpha.1",
// "v1.0", "1.0-1", "1.0.post", "1.0RC1"); ToString() gives the normalised form ("1.0a1").
struct Version {
  int64_t epoch = 0;
  std::vector<int64_t> release;  // at least one component
  char pre_kind = 0;             // 0 (none), 'a', 'b' or 'r' (rc)
  int64_t pre_num = 0;
  bool has_post = false;
  int64_t post = 0;
  bool has_dev = false;
  int64_t dev = 0;
  std::string local;     // normalised ("ubuntu-1" → "ubuntu.1"), "" when absent
  std::string original;  // the text as given (trimmed), for === comparisons

  bool IsPrerelease() const { return pre_kind != 0 || has_dev; }
  bool IsPostrelease() const { return has_post; }
  // "1!2.0rc1.post3.dev4+abc" style normalised text.
  std::string ToString() const;
  // Epoch and release only ("1!2.0"), as used by the < and > exclusion rules.
  Version BaseVersion() const;
  // The version without its local segment.
  Version Public() const;

  // Total PEP 440 ordering (release compared with trailing zeros ignored; dev < pre < final <
  // post; local versions sort after the public version).
  int Compare(const Version& other) const;
  bool operator==(const Version& o) const { return Compare(o) == 0; }
  std::strong_ordering operator<=>(const Version& o) const { return Compare(o) <=> 0; }
};

absl::StatusOr<Version> ParseVersion(std::string_view text);

// One clause of a specifier: "~=1.4.2", "==1.*", "!=2.0", "<3".
struct SpecifierClause {
  std::string op;           // "~=", "==", "!=", "<=", ">=", "<", ">", "==="
  std::string version_text; // as written (without ".*")
  bool wildcard = false;    // "==1.2.*" / "!=1.2.*"
  Version version;          // parsed; unused for "===" when unparsable
};

// A comma-separated list of clauses; all must hold. Empty = any version.
class Specifier {
 public:
  Specifier() = default;
  explicit Specifier(std::vector<SpecifierClause> clauses) : clauses_(std::move(clauses)) {}

  // PEP 440 containment. Prereleases (and dev releases) match only when allow_prereleases is
  // true or a clause itself names a prerelease (">=2.0b1"), as in pip.
  bool Contains(const Version& v, bool allow_prereleases) const;
  // True when some clause's version is a prerelease.
  bool MentionsPrerelease() const;
  bool empty() const { return clauses_.empty(); }
  const std::vector<SpecifierClause>& clauses() const { return clauses_; }
  // Canonical text: clauses joined with ',' and no spaces (">=1.0,<2").
  std::string ToString() const;

 private:
  std::vector<SpecifierClause> clauses_;
};

// Parses ">=1.0, <2" (spaces around clauses and between operator and version are allowed).
absl::StatusOr<Specifier> ParseSpecifier(std::string_view text);

}  // namespace esb::packages
