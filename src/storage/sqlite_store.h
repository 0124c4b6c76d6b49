// SQLite implementation details of Store that are useful to tests and tools (additive to
// store.h; the daemon only needs Store::Open).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace esb {

// The schema version this build creates and migrates to.
int LatestSchemaVersion();
// The SQL of migration `version` (1..LatestSchemaVersion()); for tests that build old schemas.
std::string MigrationSql(int version);

// Parses a user's audit search keyword with the audit search grammar (words, "phrases",
// word* prefixes with >= kMinAuditPrefixChars letters or digits, AND/OR/NOT, parentheses at
// most 8 deep; nothing else of FTS5: no column filters, NEAR, ^, +, {}), checks the cost caps
// of store.h on its own tokens (length, terms, prefix terms) and returns the FTS5 query rebuilt
// from those tokens, so SQLite sees exactly what was checked. "" for a blank keyword.
// InvalidArgument with the reason otherwise.
absl::StatusOr<std::string> CheckAuditSearch(std::string_view keyword);

// Lowercase hex SHA-256 of `data` (how API key secrets are stored).
std::string Sha256Hex(std::string_view data);

// The same, of data given in pieces (a large blob is hashed without being held whole).
class Sha256Stream {
 public:
  Sha256Stream();
  ~Sha256Stream();
  Sha256Stream(const Sha256Stream&) = delete;
  Sha256Stream& operator=(const Sha256Stream&) = delete;
  void Update(std::string_view data);
  std::string HexDigest();  // once, after the last Update

 private:
  void* ctx_;  // EVP_MD_CTX
};

}  // namespace esb
