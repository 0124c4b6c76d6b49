// SQLite implementation details of Store that are useful to tests and tools (additive to
// store.h; the daemon only needs Store::Open).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace esb {

// The schema version this build creates and migrates to.
int LatestSchemaVersion();

// Turns a user's audit search keyword into an FTS5 query. Plain words are quoted so that
// punctuation ("main.py", "/tmp/x", "a-b") never becomes FTS5 syntax; FTS5 operators
// (AND/OR/NOT/NEAR, "phrases", prefix*, ^, (groups), action:/detail: column filters) are
// passed through unchanged. Returns "" for a blank keyword.
std::string NormalizeFtsQuery(std::string_view keyword);

// Lowercase hex SHA-256 of `data` (how API key secrets are stored).
std::string Sha256Hex(std::string_view data);

}  // namespace esb
