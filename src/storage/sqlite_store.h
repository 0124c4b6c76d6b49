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

// Turns a user's audit search keyword into an FTS5 query. Plain words are quoted so that
// punctuation ("main.py", "/tmp/x", "a-b") never becomes FTS5 syntax; FTS5 operators
// (AND/OR/NOT/NEAR, "phrases", prefix*, ^, (groups), action:/detail: column filters) are
// passed through unchanged. Returns "" for a blank keyword.
std::string NormalizeFtsQuery(std::string_view keyword);

// Checks a user's audit search keyword against the cost caps of store.h (length, terms,
// prefix terms and their length) and for balanced quotes and parentheses (so that it can be
// ANDed with the tenant scope as one group), and returns its normalized FTS5 form.
// InvalidArgument with the reason otherwise.
absl::StatusOr<std::string> CheckAuditSearch(std::string_view keyword);

// Lowercase hex SHA-256 of `data` (how API key secrets are stored).
std::string Sha256Hex(std::string_view data);

}  // namespace esb
